"""The attention mixer of the hybrid LM (grouped-query causal attention with
optional RoPE and a KV cache), with the entry points of every mixer
(`models.layers`): prefill, step, verify. `gated_attention.GatedAttention`
and `mla_attention.MLAttention` extend it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax import slots
from replayssm_jax.models.cached_attention import cached_attention
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.layers import Linear
from replayssm_jax.models.states import AttentionState

F32 = jnp.float32


def _rope(x, positions, theta):
  """Rotate-half RoPE (HF Llama layout). x [..., T, heads, D], positions
  [..., T]."""
  d = x.shape[-1]
  inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=F32) / d))  # [D/2]
  ang = positions.astype(F32)[..., None] * inv  # [..., T, D/2]
  cos = jnp.cos(ang)[..., None, :]
  sin = jnp.sin(ang)[..., None, :]
  xf = x.astype(F32)
  x1, x2 = xf[..., :d // 2], xf[..., d // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
  return out.astype(x.dtype)


def _partial_rope(x, positions, theta, rotary_dim):
  """`_rope` on the first rotary_dim dims of each head (all if None), the
  rest passed through (Bamba's partial rotary embedding)."""
  if rotary_dim is None or rotary_dim == x.shape[-1]:
    return _rope(x, positions, theta)
  return jnp.concatenate([_rope(x[..., :rotary_dim], positions, theta),
                          x[..., rotary_dim:]], -1)


class Attention(nnx.Module):
  """Grouped-query causal attention with optional RoPE and a KV cache."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.cfg = cfg
    hd = cfg.attn_head_dim
    self.q_proj = Linear(cfg.d_model, cfg.num_heads * hd, cfg, rngs=rngs)
    self.k_proj = Linear(cfg.d_model, cfg.num_kv_heads * hd, cfg, rngs=rngs)
    self.v_proj = Linear(cfg.d_model, cfg.num_kv_heads * hd, cfg, rngs=rngs)
    self.o_proj = Linear(cfg.num_heads * hd, cfg.d_model, cfg, rngs=rngs)

  def _qkv(self, h, positions):
    """h [b, T, d], positions [b, T] -> q [b, T, Hq, D], k, v [b, Hk, T, D]
    (head-major, as the KV cache)."""
    c = self.cfg
    lead = h.shape[:-1]
    q = self.q_proj(h).reshape(lead + (c.num_heads, c.attn_head_dim))
    k = self.k_proj(h).reshape(lead + (c.num_kv_heads, c.attn_head_dim))
    v = self.v_proj(h).reshape(lead + (c.num_kv_heads, c.attn_head_dim))
    if c.rope_theta is not None:
      q = _partial_rope(q, positions, c.rope_theta, c.rotary_dim)
      k = _partial_rope(k, positions, c.rope_theta, c.rotary_dim)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def _project(self, h, positions):
    """(q, k, v as `_qkv`, ctx): ctx is what `_output` needs besides the
    heads' output (None here; `GatedAttention`'s gate)."""
    return self._qkv(h, positions) + (None,)

  def _output(self, o, ctx):
    """The heads' output o [.., num_heads * attn_head_dim] -> [.., d]."""
    del ctx
    return self.o_proj(o)

  def _scale(self) -> float:
    c = self.cfg
    return (c.attn_head_dim ** -0.5 if c.attention_multiplier is None
            else c.attention_multiplier)

  def _attend(self, q, k, v, mask):
    """q [b, Tq, Hq, D], k/v [b, Hk, S, D], mask [b, Tq, S] -> [b, Tq, Hq*D]
    (prefill; decode steps and verify windows use ops.decode_attention).

    With k/v head-major the products' batch dimensions (row, KV head) lead,
    as XLA's GEMMs need them (a [b, S, Hk, D] layout makes XLA transpose
    the whole cache; benchmarks/decode_step/attention_cache_layouts_b256_h200.json).
    """
    c = self.cfg
    b, tq = q.shape[:2]
    rep = c.num_heads // c.num_kv_heads
    qg = q.reshape(b, tq, c.num_kv_heads, rep, c.attn_head_dim)
    s = jnp.einsum("bqkrd,bksd->bkrqs", qg.astype(F32), k.astype(F32))
    s = s * self._scale()
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    # A masked key's weight is 0, and 0 times a pad's or a later position's
    # inf / NaN value would poison the sum: non-finite values enter it as 0,
    # and a query that sees one returns NaN.
    vf = v.astype(F32)
    bad = ~jnp.all(jnp.isfinite(vf), axis=-1)  # [b, Hk, S]
    o = jnp.einsum("bkrqs,bksd->bqkrd", p, jnp.where(bad[..., None], 0.0, vf))
    sees_bad = jnp.any(mask[:, :, None] & bad[:, None], axis=-1)  # [b, Tq, Hk]
    o = jnp.where(sees_bad[..., None, None], jnp.nan, o)
    return o.reshape(b, tq, c.num_heads * c.attn_head_dim).astype(c.jnp_dtype)

  def prefill(self, h, lengths, state: AttentionState | None,
              resume: bool = False, kv_len: int | None = None):
    """The right-padded prompt h [b, T, d] (lengths [b]) -> (y [b, T, d],
    the KV cache holding it). resume: each row's chunk continues its cache
    (`_prefill_resume`, reading up to kv_len entries: `cached_attention`);
    otherwise every row starts at position 0."""
    if resume:
      return self._prefill_resume(h, lengths, state, kv_len)
    b, t, _ = h.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    q, k, v, ctx = self._project(h, positions)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, T]
    mask = causal & (jnp.arange(t)[None, None, :] < lengths[:, None, None])
    out = self._output(self._attend(q, k, v, mask), ctx)
    if state is None:
      return out, None
    if t > state.max_len:
      raise ValueError(f"prompt length {t} exceeds the KV cache max_len "
                       f"{state.max_len}.")
    new = AttentionState(
        k=jax.lax.dynamic_update_slice_in_dim(state.k, k.astype(state.k.dtype),
                                              0, axis=2),
        v=jax.lax.dynamic_update_slice_in_dim(state.v, v.astype(state.v.dtype),
                                              0, axis=2),
        length=lengths.astype(jnp.int32))
    return out, new

  def _prefill_resume(self, h, lengths, state: AttentionState, kv_len=None):
    """A chunk appended to each row's cache: the queries at positions
    length .. length + T - 1 (RoPE'd there) attend to the cache's first
    `length` entries and causally within the chunk; the chunk's keys and
    values of its valid positions are written at those positions (a pad
    writes nothing) and length grows by lengths."""
    b, t, _ = h.shape
    pos = state.length[:, None] + jnp.arange(t)[None, :]  # [b, T]
    q, k, v, ctx = self._project(h, pos)  # k, v [b, Hk, T, D]
    valid = jnp.arange(t)[None, :] < lengths[:, None]
    # Pads (and positions past max_len) scatter to max_len: dropped.
    idx = jnp.where(valid, pos, state.max_len)
    rows = jnp.arange(b)[:, None]
    kc = state.k.at[rows, :, idx].set(jnp.swapaxes(k, 1, 2).astype(
        state.k.dtype), mode="drop")
    vc = state.v.at[rows, :, idx].set(jnp.swapaxes(v, 1, 2).astype(
        state.v.dtype), mode="drop")
    new_len = (state.length + lengths).astype(jnp.int32)
    # Block by block, up to kv_len (stale entries selected away).
    o = cached_attention(q, kc, vc, new_len, pos, self._scale(),
                         kv_len=kv_len)
    out = self._output(o.astype(self.cfg.jnp_dtype), ctx)
    return out, AttentionState(k=kc, v=vc, length=new_len)

  def step(self, h, state: AttentionState, implementation: str | None = None,
           rows=None):
    """One query per row against its cache (no recompute): the cache's
    first length + 1 entries, through `ops.decode_attention` (a kernel
    reads only those; `implementation` picks it).

    A row whose cache is full (length == max_len) drops its new key/value.
    rows: [b] effective slots (`replayssm_jax.slots`): query row i reads
    and writes cache row rows[i] of a state with any number of rows.
    """
    b = h.shape[0]
    if rows is None:
      idx = jnp.arange(b)
      pos = state.length  # [b]
    else:  # padding rows (-1) write at row `capacity`: dropped
      idx = jnp.where(rows < 0, state.k.shape[0], rows)
      pos = slots.gather(state.length, rows)
    with jax.named_scope("qkv"):
      # k, v [b, Hk, 1, D]
      q, k, v, ctx = self._project(h[:, None], pos[:, None])
    with jax.named_scope("kv_write"):
      kc = state.k.at[idx, :, pos].set(k[:, :, 0].astype(state.k.dtype),
                                       mode="drop")
      vc = state.v.at[idx, :, pos].set(v[:, :, 0].astype(state.v.dtype),
                                       mode="drop")
    with jax.named_scope("attend"):
      o = ops.decode_attention(q[:, 0], kc, vc,
                               jnp.minimum(pos + 1, state.max_len),
                               self.cfg.attention_multiplier, rows=rows,
                               implementation=implementation)
    with jax.named_scope("o_proj"):
      out = self._output(o.reshape(b, -1), ctx)
    length = pos + 1 if rows is None else state.length.at[idx].set(
        pos + 1, mode="drop")
    return out, AttentionState(k=kc, v=vc, length=length)

  def verify(self, h, state: AttentionState,
             implementation: str | None = None):
    """A window of T queries per row: writes the T new keys/values at
    positions length .. length + T - 1 and attends causally (the cache
    prefix plus the window up to each query) through `ops.decode_attention`.

    Returns (y [b, T, d], the cache with the window written and `length`
    unchanged: committing n tokens sets length += n, and the rest is
    overwritten later). Keys of positions >= max_len are dropped (callers
    check the room).
    """
    b, t, _ = h.shape
    pos = state.length[:, None] + jnp.arange(t)[None, :]  # [b, T]
    q, k, v, ctx = self._project(h, pos)  # k, v [b, Hk, T, D]
    rows = jnp.arange(b)[:, None]
    kc = state.k.at[rows, :, pos].set(jnp.swapaxes(k, 1, 2).astype(
        state.k.dtype), mode="drop")
    vc = state.v.at[rows, :, pos].set(jnp.swapaxes(v, 1, 2).astype(
        state.v.dtype), mode="drop")
    o = ops.decode_attention(q, kc, vc,
                             jnp.minimum(state.length + 1, state.max_len),
                             self.cfg.attention_multiplier,
                             implementation=implementation)
    out = self._output(o.reshape(b, t, -1), ctx)
    return out, AttentionState(k=kc, v=vc, length=state.length)
