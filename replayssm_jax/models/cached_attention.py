"""Attention of a continued prefill's chunk to its row's KV cache.

A prefill continued from a state (`models.prefill_from_state`, a prefix
cache hit) appends T queries per row behind the row's cached entries. The
cache is max_len entries long, but only the first new_len = length + T of a
row are live. Attending to the whole cache costs T x max_len scores per
head (f32, materialized by XLA): a hit of 1024 cached tokens whose 1024 new
ones sit in a cache of 4096 entries would read four times the keys it
needs. `cached_attention` walks the cache in blocks of `key_block` entries
up to a bound the caller knows on the host (`kv_len`, static:
`models.prefill_from_state(kv_len=)`), or over all of it, keeping a
running softmax (max, sum, weighted values) across blocks: the same
attention up to the summation order. The loop's trip count is static: a
loop whose count the device computes would make XLA copy its predicate to
the host each iteration, so that the call waits for everything queued
before it (a decode step in flight) instead of returning once queued.

Masking: query t of a row (position pos[t]) sees the entries j < new_len
with j <= pos[t]. Entries past a row's new_len are stale (anything, inf /
NaN included): their scores are selected to -1e30 and their values to zero
before the products (0 * NaN is NaN), block by block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
NEG = -1e30  # a masked score (finite: the running max never forms inf - inf)


def key_block_for(max_len: int, key_block: int = 512) -> int:
  """The largest power of two <= key_block dividing max_len (at least 64),
  else max_len itself (one block)."""
  b = key_block
  while b >= 64:
    if max_len % b == 0:
      return b
    b //= 2
  return max_len


def key_blocks(kv_len: int | None, max_len: int, key_block: int = 512
               ) -> int:
  """The key blocks `cached_attention` reads for live entries up to kv_len
  (None: the whole cache of max_len), in [1, max_len / block]."""
  kb = key_block_for(max_len, key_block)
  if kv_len is None:
    return max_len // kb
  return max(1, min(max_len // kb, -(-int(kv_len) // kb)))


def cached_attention(q, k_cache, v_cache, new_len, pos, scale: float,
                     key_block: int = 512, kv_len: int | None = None):
  """q [b, T, Hq, D] (queries at positions pos [b, T]), k_cache / v_cache
  [b, Hk, S, D] holding the chunk's keys and values already, new_len [b]
  live entries per row -> [b, T, Hq * D] float32 (grouped-query heads:
  query head h reads KV head h // (Hq // Hk)). kv_len: a static bound on
  new_len (entries past it are not read: the caller makes a row past it
  invalid); None: the whole cache."""
  b, t, hq, d = q.shape
  hk, s = k_cache.shape[1], k_cache.shape[2]
  rep = hq // hk
  kb = key_block_for(s, key_block)
  qg = q.reshape(b, t, hk, rep, d).astype(F32) * scale
  n = key_blocks(kv_len, s, key_block)

  def body(i, carry):
    m, l, acc = carry
    start = i * kb
    k = jax.lax.dynamic_slice_in_dim(k_cache, start, kb, axis=2)
    v = jax.lax.dynamic_slice_in_dim(v_cache, start, kb, axis=2)
    keys = start + jnp.arange(kb)
    live = keys[None, :] < new_len[:, None]  # [b, kb]
    seen = live[:, None, :] & (keys[None, None, :] <= pos[:, :, None])
    v = jnp.where(live[:, None, :, None], v.astype(F32), 0.0)
    sc = jnp.einsum("bqkrd,bksd->bkrqs", qg, k.astype(F32))
    sc = jnp.where(seen[:, None, None], sc, NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    p = jnp.exp(sc - m_new[..., None])
    corr = jnp.exp(m - m_new)
    return (m_new, l * corr + jnp.sum(p, axis=-1),
            acc * corr[..., None] + jnp.einsum("bkrqs,bksd->bkrqd", p, v))

  init = (jnp.full((b, hk, rep, t), NEG, F32),
          jnp.zeros((b, hk, rep, t), F32),
          jnp.zeros((b, hk, rep, t, d), F32))
  _, l, acc = jax.lax.fori_loop(0, n, body, init)
  o = acc / l[..., None]  # [b, hk, rep, T, D]
  return jnp.moveaxis(o, 3, 1).reshape(b, t, hq * d)
