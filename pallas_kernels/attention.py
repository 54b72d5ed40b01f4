"""Pallas (Triton backend) kernel: one-query decode attention.

One program per (KV head, row) reads only the row's valid cache entries,
`lengths[row]` of them, in blocks of `block_s`, and keeps an online softmax
(running max, sum and weighted value sum in float32) for each of the
q_heads // kv_heads query heads that share the KV head, so every key and
value is read once for all of them. Matches
`replayssm_jax.attention.decode_attention_reference` (float32 scores and
sums; only the summation order differs).

XLA's decode attention over the same cache reads all max_len entries of
every row and ran at 1.85 TB/s on the H200 (benchmarks/attend_micro_h200.json);
this kernel's bytes are the valid entries only. It has no split over the
cache length (flash-decoding): one program per (row, KV head) fills the GPU
at serving batches, not at batch 1 with a long cache.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from replayssm_jax.attention import resolve_scale

F32 = jnp.float32


def block_len(max_len: int, config: common.AttentionConfig) -> int:
  """Cache entries per iteration: config.block_s, or the largest power of
  two dividing max_len below it (a block never runs past the cache)."""
  return math.gcd(max_len, config.block_s)


def _kernel(q_ref, k_ref, v_ref, len_ref, o_ref, *, rep, block_s, scale,
            max_len, prefetch):
  kh, b = pl.program_id(0), pl.program_id(1)
  n = jnp.clip(len_ref[b], 0, max_len)  # out-of-range lengths: clamped
  d = q_ref.shape[-1]
  qs = [q_ref[b, kh * rep + r, :].astype(F32) * scale for r in range(rep)]

  def load(i):
    pos = i * block_s + jnp.arange(block_s)
    valid = pos < n
    rows = pl.ds(i * block_s, block_s)
    tiles = [plgpu.load(ref.at[b, kh, rows, :], mask=valid[:, None],
                        other=0.0, eviction_policy="evict_first")
             for ref in (k_ref, v_ref)]
    return tiles[0], tiles[1], valid

  def update(stats, k, v, valid):
    k, v = k.astype(F32), v.astype(F32)
    out = []
    for qr, (m, l, acc) in zip(qs, stats):
      s = jnp.where(valid, jnp.sum(k * qr[None, :], axis=1), -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s))  # finite: a block has a valid key
      alpha = jnp.exp(m - m_new)
      p = jnp.exp(s - m_new)  # 0 at masked keys
      out.append((m_new, l * alpha + jnp.sum(p),
                  acc * alpha + jnp.sum(p[:, None] * v, axis=0)))
    return tuple(out)

  stats = tuple((jnp.float32(-jnp.inf), jnp.float32(0.0),
                 jnp.zeros((d,), F32)) for _ in range(rep))
  nblk = (n + block_s - 1) // block_s
  if prefetch:
    def body(i, carry):
      tiles, st = carry
      nxt = load(i + 1)  # masked off past the row's length
      return nxt, update(st, *tiles)
    _, stats = lax.fori_loop(0, nblk, body, (load(0), stats))
  else:
    stats = lax.fori_loop(0, nblk, lambda i, st: update(st, *load(i)), stats)
  for r, (_, l, acc) in enumerate(stats):
    o = jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[b, kh * rep + r, :] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def decode_attention(q, k_cache, v_cache, lengths, scale=None, *,
                     config: common.AttentionConfig = common.AttentionConfig(),
                     interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config."""
  batch, hq, d = q.shape
  hk, max_len = k_cache.shape[1], k_cache.shape[2]
  kernel = functools.partial(
      _kernel, rep=hq // hk, block_s=block_len(max_len, config),
      scale=resolve_scale(scale, d), max_len=max_len,
      prefetch=config.prefetch)
  return pl.pallas_call(
      kernel,
      grid=(hk, batch),
      out_shape=jax.ShapeDtypeStruct((batch, hq, d), q.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=1),
      interpret=interpret,
      name="replayssm_decode_attention",
  )(q, k_cache, v_cache, lengths.astype(jnp.int32))
