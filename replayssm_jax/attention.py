"""One-query decode attention over a head-major KV cache (reference).

`decode_attention_reference(q, k_cache, v_cache, lengths, scale)`: each row
attends one query per head to the first `lengths[row]` entries of its cache,
with grouped-query heads (query head h reads KV head h // (Hq // Hk)). It is
the decode step's attention in `models.layers.Attention.step`; the public,
validated op with the kernel dispatcher is `replayssm_jax.ops.
decode_attention`, and the Pallas kernel is `pallas_kernels.attention`.

Math (float32 throughout, whatever the input dtypes):
  s_j = scale * q . k_j  for j < length, p = softmax(s), o = sum_j p_j v_j;
a row with length 0 attends to nothing and returns zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V

F32 = jnp.float32


def validate_decode_attention(q, k_cache, v_cache, lengths, scale) -> None:
  """Static checks of the op's arguments (shapes and dtypes; each error names
  the argument). lengths values must lie in [0, max_len]; they are checked
  when concrete (outside jit), and a kernel clamps them under jit."""
  V.check_floating("q", q)
  V.check_ndim("q", q, 3, "[batch, q_heads, head_dim]")
  b, hq, d = q.shape
  V.check_floating("k_cache", k_cache)
  V.check_ndim("k_cache", k_cache, 4,
               "[batch, kv_heads, max_len, head_dim]")
  hk, s = k_cache.shape[1], k_cache.shape[2]
  V.check_shape("k_cache", k_cache, (b, hk, s, d),
                "[batch, kv_heads, max_len, head_dim]")
  V.check_floating("v_cache", v_cache)
  V.check_shape("v_cache", v_cache, (b, hk, s, d),
                "[batch, kv_heads, max_len, head_dim]")
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
  """q [batch, Hq, D], k_cache/v_cache [batch, Hk, S, D], lengths [batch]
  -> [batch, Hq, D] in q.dtype (see the module docstring)."""
  b, hq, d = q.shape
  hk, s = k_cache.shape[1], k_cache.shape[2]
  qg = q.reshape(b, hk, hq // hk, d).astype(F32)
  sc = jnp.einsum("bkrd,bksd->bkrs", qg, k_cache.astype(F32))
  sc = sc * resolve_scale(scale, d)
  valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None]
  sc = jnp.where(valid, sc, -jnp.inf)
  m = jnp.max(sc, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no keys
  p = jnp.where(valid, jnp.exp(sc - m), 0.0)
  denom = jnp.sum(p, axis=-1)[..., None]  # [b, Hk, r, 1]
  o = jnp.einsum("bkrs,bksd->bkrd", p, v_cache.astype(F32))
  o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
  return o.reshape(b, hq, d).astype(q.dtype)
