"""Pallas (Triton backend) kernel: decode attention (one query per row, or
a speculative window of T queries per row).

A program handles one (row, KV head) and a span of the cache (all of it by
default; `AttentionConfig.split_s` splits it, flash-decoding style). It
reads only the entries the row's queries see (the loads of later entries
are masked off, and a split that starts past them exits at once), in
blocks of `block_s`, and keeps an online softmax (running max, sum and
weighted value sum in float32) for every query of the row that reads the KV
head: T window positions x q_heads // kv_heads query heads, one row of the
program's tiles each, so each key and value is read once for all of them.
Both products run on the tensor cores: the query rows are zero-padded to a
power of two >= 16 (a dot's smallest M), the scores are a dot of the
16-bit q and K with float32 accumulation (exact products, as the
reference's float32 math), and p . V is two dots of p split into a 16-bit
high and low part (p to ~2^-17 relative, not rounded to 16 bits). With
float32 operands both are IEEE float32 dots. Matches
`replayssm_jax.attention.decode_attention_reference` within the per-dtype
tolerances (the sums are reordered; p's split).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.config_base import _check_pow2
from replayssm_jax.attention import resolve_scale

F32 = jnp.float32
_MIN_DOT = 16  # smallest dot operand side (M, N, K) Triton takes
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tuning of the decode attention kernel (`pallas_kernels.attention`).

  Attributes:
    block_s: cache entries per loop iteration (a power of two >= 16: the
      scores are a tensor-core dot).
    split_s: cache entries per program (a multiple of block_s); None = the
      whole cache, so one program per (row, KV head) and no combine. With a
      split, programs of (row, KV head, split) write partial softmax sums
      that XLA combines (flash-decoding), and a split past the row's length
      exits at once.
    num_warps, num_stages: Triton launch parameters (num_stages > 1
      pipelines the block loop's loads).

  Defaults: the fastest of the H200 sweep in
  benchmarks/decode_step/attention_forms_hybrid_1b_b256_h200.json (figures:
  benchmarks/VARIANTS.md).
  """
  block_s: int = 64
  split_s: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _check_pow2("block_s", self.block_s)
    if self.block_s < 16:
      raise ValueError(f"block_s must be >= 16 (a dot operand), got "
                       f"{self.block_s}.")
    if self.split_s is not None and (
        not isinstance(self.split_s, int) or self.split_s < self.block_s
        or self.split_s % self.block_s):
      raise ValueError(f"split_s must be None or a multiple of block_s "
                       f"({self.block_s}), got {self.split_s!r}.")
    _check_pow2("num_warps", self.num_warps)
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}.")


def block_len(max_len: int, config: AttentionConfig) -> int:
  """Cache entries per iteration: config.block_s, or the largest power of
  two dividing max_len below it (a block never straddles the cache's end)."""
  return math.gcd(max_len, config.block_s)


def shape_problem(head_dim: int, max_len: int,
                  config: AttentionConfig) -> str | None:
  """Why the kernel cannot take these shapes, or None."""
  if head_dim < _MIN_DOT or head_dim & (head_dim - 1):
    return (f"head_dim = {head_dim} is not a power of two >= {_MIN_DOT} (a "
            f"dot operand); use implementation='reference'.")
  if block_len(max_len, config) < _MIN_DOT:
    return (f"max_len = {max_len} is not a multiple of {_MIN_DOT} (the "
            f"kernel's smallest cache block); use implementation="
            f"'reference'.")
  return None


def _dot(a, b, contract_b: int):
  """a [M, K] . b (contracting b's axis contract_b), float32 accumulation;
  IEEE float32 when either operand is float32."""
  if a.dtype != b.dtype or a.dtype == F32:
    a, b, precision = a.astype(F32), b.astype(F32), _HIGHEST
  else:
    precision = None
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                         precision=precision, preferred_element_type=F32)


def _kernel(q_ref, k_ref, v_ref, len_ref, *out_refs, rep, window, block_s,
            chunk, scale, max_len, split, has_rows=False):
  sid, kh, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  # The cache row: the query row, or its slot (has_rows: a [batch] slot
  # input after the lengths; a padding row, -1, reads row 0 and the op
  # makes its output NaN).
  sb = b
  if has_rows:
    sb = jnp.maximum(out_refs[0][b], 0)
    out_refs = out_refs[1:]
  n = jnp.clip(len_ref[b], 0, max_len)  # out-of-range lengths: clamped
  start0 = sid * chunk
  rows = q_ref.shape[2]  # window x query heads, padded to a dot's M
  d = q_ref.shape[3]
  row = jnp.arange(rows)
  row_mask = (row < window * rep)[:, None]
  # Query row t * rep + r (window position t) sees `limit` entries.
  limit = jnp.minimum(n + row // rep, max_len)  # [rows]
  seen = jnp.minimum(n + window - 1, max_len)  # the most any row sees

  def attend():
    q = q_ref[b, kh]  # [rows, D]

    def body(i, carry):
      m, l, acc, flag = carry
      start = start0 + i * block_s
      pos = start + jnp.arange(block_s)
      k, v = (plgpu.load(ref.at[sb, kh, pl.ds(start, block_s), :],
                         mask=(pos < seen)[:, None], other=0.0,
                         eviction_policy="evict_first")
              for ref in (k_ref, v_ref))
      sees = pos[None, :] < limit[:, None]  # [rows, block_s]
      s = jnp.where(sees, _dot(q, k, 1) * scale, -jnp.inf)
      if window > 1:
        # A window query must not take a later position's non-finite
        # value through its zero weight: such values enter the dots as 0,
        # and a query that sees one is flagged (its output becomes NaN).
        # A single query loads only entries it sees (a value of theirs
        # that is not finite reaches the output by itself).
        fin = jnp.abs(v.astype(F32)) < jnp.inf  # (False at NaN too)
        bad = jnp.min(jnp.where(fin, 1.0, 0.0), axis=1) < 0.5  # [block_s]
        v = jnp.where(fin, v, jnp.zeros_like(v))
        flag = jnp.maximum(flag, jnp.max(
            jnp.where(sees & bad[None, :], 1.0, 0.0), axis=1))
      m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [rows]
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[:, None])  # 0 at masked keys
      if v.dtype == F32:
        pv = _dot(p, v, 0)
      else:  # p to ~2^-17: a high and a low 16-bit part, two tensor-core dots
        hi = p.astype(v.dtype)
        lo = (p - hi.astype(F32)).astype(v.dtype)
        pv = _dot(hi, v, 0) + _dot(lo, v, 0)
      return (m_new, l * alpha + jnp.sum(p, axis=1),
              acc * alpha[:, None] + pv, flag)

    init = (jnp.full((rows,), -jnp.inf, F32), jnp.zeros((rows,), F32),
            jnp.zeros((rows, d), F32), jnp.zeros((rows,), F32))
    m, l, acc, flag = lax.fori_loop(0, chunk // block_s, body, init)
    if window > 1:  # (a NaN sum stays NaN through the splits' combine)
      acc = jnp.where((flag > 0)[:, None], jnp.nan, acc)
    return m, l, acc

  if split == 1:
    (o_ref,) = out_refs
    _, l, acc = attend()
    o = jnp.where((l > 0)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None],
                  0.0)
    plgpu.store(o_ref.at[b, kh], o.astype(o_ref.dtype), mask=row_mask)
  else:
    m_ref, l_ref, acc_ref = out_refs

    @pl.when(start0 < seen)
    def _partial():
      m, l, acc = attend()
      m_ref[b, kh, sid] = m
      l_ref[b, kh, sid] = l
      plgpu.store(acc_ref.at[b, kh, sid], acc, mask=row_mask)


def _combine(m, l, acc, seen, chunk, used):
  """The splits' partial softmax sums -> [b, Hk, used, D] (the first `used`
  query rows; splits starting past `seen[row]`, the most entries any query
  of the row sees, were not written: masked here)."""
  nsplit = m.shape[2]
  valid = (jnp.arange(nsplit)[None, :] * chunk
           < seen[:, None])[:, None, :, None]  # [b, 1, split, 1]
  m = jnp.where(valid, m[..., :used], -jnp.inf)
  top = jnp.max(m, axis=2, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.where(valid, jnp.exp(m - top), 0.0)  # [b, Hk, split, used]
  denom = jnp.sum(w * jnp.where(valid, l[..., :used], 0.0), axis=2)
  num = jnp.sum(w[..., None] * jnp.where(valid[..., None],
                                         acc[..., :used, :], 0.0), axis=2)
  return jnp.where((denom > 0)[..., None],
                   num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def decode_attention(q, k_cache, v_cache, lengths, scale=None, *,
                     rows=None, config: AttentionConfig = AttentionConfig(),
                     interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config;
  rows: [batch] int32 slots of the caches' rows (`replayssm_jax.slots`,
  effective: -1 for a padding row)."""
  slot_in = [] if rows is None else [rows]  # after the lengths
  qw = q if q.ndim == 4 else q[:, None]  # [b, T, Hq, D]
  batch, window, hq, d = qw.shape
  hk, max_len = k_cache.shape[1], k_cache.shape[2]
  problem = shape_problem(d, max_len, config)
  if problem is not None:
    raise NotImplementedError(problem)
  rep = hq // hk
  used = window * rep  # query rows per (row, KV head): (t, r), t major
  rows = max(_MIN_DOT, 1 << (used - 1).bit_length())
  qg = jnp.swapaxes(qw.reshape(batch, window, hk, rep, d), 1, 2)
  qg = jnp.pad(qg.reshape(batch, hk, used, d),
               ((0, 0), (0, 0), (0, rows - used), (0, 0)))
  chunk = max_len if config.split_s is None else min(config.split_s, max_len)
  nsplit = -(-max_len // chunk)
  lengths = jnp.clip(lengths.astype(jnp.int32), 0, max_len)
  if nsplit == 1:
    out_shape = jax.ShapeDtypeStruct((batch, hk, rows, d), q.dtype)
  else:
    part = (batch, hk, nsplit, rows)
    out_shape = (jax.ShapeDtypeStruct(part, F32),
                 jax.ShapeDtypeStruct(part, F32),
                 jax.ShapeDtypeStruct(part + (d,), F32))
  out = pl.pallas_call(
      functools.partial(_kernel, rep=rep, window=window,
                        block_s=block_len(max_len, config), chunk=chunk,
                        scale=resolve_scale(scale, d), max_len=max_len,
                        split=nsplit, has_rows=bool(slot_in)),
      grid=(nsplit, hk, batch),
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="replayssm_decode_attention",
  )(qg, k_cache, v_cache, lengths, *slot_in)
  if nsplit == 1:
    o = out[:, :, :used]
  else:
    seen = jnp.minimum(lengths + window - 1, max_len)
    o = _combine(*out, seen, chunk, used)
  o = jnp.swapaxes(o.reshape(batch, hk, window, rep, d), 1, 2)
  o = o.reshape(batch, window, hq, d).astype(q.dtype)
  return o if q.ndim == 4 else o[:, 0]
