"""Decode attention over a head-major KV cache (reference).

`decode_attention_reference(q, k_cache, v_cache, lengths, scale)`: each row
attends its queries to its cache, with grouped-query heads (query head h
reads KV head h // (Hq // Hk)):

  q [batch, Hq, D]      one query per row (a decode step) sees the first
                        lengths[row] cache entries;
  q [batch, T, Hq, D]   a window of T queries per row (speculative verify,
                        the window's keys already written behind the
                        prefix) whose query t sees the first
                        min(lengths[row] + t, max_len) entries.

It is the decode step's and the verify window's attention in
`models.attention_block.Attention`; the public, validated op with the kernel
dispatcher is `replayssm_jax.ops.decode_attention`, and the Pallas kernel is
`pallas_kernels.attention`.

Math (float32 throughout, whatever the input dtypes):
  s_j = scale * q . k_j  for the visible j, p = softmax(s), o = sum_j p_j v_j;
a query that sees no entry returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax import slots

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def validate_decode_attention(q, k_cache, v_cache, lengths, scale,
                              rows=None) -> None:
  """Static checks of the op's arguments (shapes and dtypes; each error names
  the argument). lengths values must lie in [0, max_len]; they are checked
  when concrete (outside jit), and both implementations clamp them under
  jit. With rows [batch] (a slot of the caches per query row,
  `replayssm_jax.slots`) the caches may have any number of rows."""
  V.check_floating("q", q)
  if q.ndim not in (3, 4):
    raise ValueError(f"q must be 3-D [batch, q_heads, head_dim] (one query "
                     f"per row) or 4-D [batch, T, q_heads, head_dim] (a "
                     f"window), got shape {tuple(q.shape)}.")
  b, hq, d = q.shape[0], q.shape[-2], q.shape[-1]
  V.check_floating("k_cache", k_cache)
  V.check_ndim("k_cache", k_cache, 4,
               "[batch, kv_heads, max_len, head_dim]")
  hk, s = k_cache.shape[1], k_cache.shape[2]
  cap = b if rows is None else k_cache.shape[0]
  V.check_shape("k_cache", k_cache, (cap, hk, s, d),
                "[batch, kv_heads, max_len, head_dim]")
  V.check_floating("v_cache", v_cache)
  V.check_shape("v_cache", v_cache, (cap, hk, s, d),
                "[batch, kv_heads, max_len, head_dim]")
  if rows is not None:
    slots.check_rows(rows, b, cap)
  if hk < 1 or hq % hk:
    raise ValueError(f"q_heads ({hq}, read from q) must be a multiple of "
                     f"kv_heads ({hk}, read from k_cache): each KV head serves "
                     f"q_heads // kv_heads query heads.")
  V.check_integer("lengths", lengths)
  V.check_shape("lengths", lengths, (b,), "[batch]")
  if V.is_concrete(lengths):
    n = jax.device_get(lengths)
    bad = (n < 0) | (n > s)
    if bad.any():
      rows = [int(r) for r in bad.nonzero()[0][:8]]
      raise ValueError(f"lengths must lie in [0, max_len] = [0, {s}] for "
                       f"every row; rows {rows} hold "
                       f"{[int(n[r]) for r in rows]}.")
  if scale is not None and not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python float or None (head_dim ** -0.5)"
                    f", got {type(scale).__name__}.")


def resolve_scale(scale, head_dim: int) -> float:
  return float(head_dim) ** -0.5 if scale is None else float(scale)


def decode_attention_reference(q, k_cache, v_cache, lengths, scale=None):
  """q [batch, Hq, D] or [batch, T, Hq, D], k_cache/v_cache [batch, Hk, S,
  D], lengths [batch] -> q's shape in q.dtype (see the module docstring)."""
  window = q.ndim == 4
  qw = q if window else q[:, None]  # [b, T, Hq, D]
  b, t, hq, d = qw.shape
  hk, s = k_cache.shape[1], k_cache.shape[2]
  qg = qw.reshape(b, t, hk, hq // hk, d).astype(F32)
  # IEEE float32 dots on every platform (XLA's default on the GPU is TF32,
  # ~1e-3 relative error).
  sc = jnp.einsum("btkrd,bksd->bktrs", qg, k_cache.astype(F32),
                  precision=HIGHEST)
  sc = sc * resolve_scale(scale, d)
  limit = jnp.clip(lengths, 0, s)[:, None] + jnp.arange(t)[None, :]  # [b, T]
  valid = (jnp.arange(s)[None, None, :] < limit[:, :, None])[:, None, :, None]
  sc = jnp.where(valid, sc, -jnp.inf)
  m = jnp.max(sc, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # a query that sees no entry
  p = jnp.where(valid, jnp.exp(sc - m), 0.0)
  denom = jnp.sum(p, axis=-1)[..., None]  # [b, Hk, T, r, 1]
  o = jnp.einsum("bktrs,bksd->btkrd", p, v_cache.astype(F32),
                 precision=HIGHEST)
  denom = jnp.moveaxis(denom, 1, 2)  # [b, T, Hk, r, 1]
  o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
  o = o.reshape(b, t, hq, d).astype(q.dtype)
  return o if window else o[:, 0]
