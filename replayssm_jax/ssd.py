"""Chunked SSD scan (Mamba-2 prefill) in pure JAX, float32 accumulation.

The sequence is cut into chunks of `chunk_size` tokens. Inside a chunk the
output is a masked (causal, decayed) attention-like product; across chunks a
short `lax.scan` carries the state. Any seqlen works: the tail is padded with
zero steps (dt' = 0 after bias/softplus), which neither decay nor add to the
state, so the final state is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax.reference import (F32, HIGHEST, _finish_output,
                                     heads_from_groups, process_dt)


def _segsum_masked(a):
  """a [..., Q] -> [..., Q, Q] with out[i, j] = sum_{j<k<=i} a_k, -inf j > i.

  Computed as a cumsum of a masked matrix rather than a difference of
  cumsums, which would lose precision when the prefix sums are large.
  """
  q = a.shape[-1]
  rep = jnp.broadcast_to(a[..., None, :], a.shape + (q,))  # [..., i, k]
  rep = jnp.swapaxes(rep, -1, -2)  # [..., k, i]: value a_k
  strict = jnp.tril(jnp.ones((q, q), bool), -1)  # k > j
  seg = jnp.cumsum(jnp.where(strict, rep, 0.0), axis=-2)  # [..., i, j]
  causal = jnp.tril(jnp.ones((q, q), bool))
  return jnp.where(causal, seg, -jnp.inf)


def _segsum_blocked(a, block: int = 16):
  """`_segsum_masked` without its masked [Q, Q] cumulative sum: the sums
  within blocks of `block` positions on [block, block] tiles, and across
  blocks as (the rest of j's block) + (the whole blocks between, from the
  blocks' totals) + (i's block up to i). Every piece sums terms of one sign
  (a <= 0 in the scan), so no prefix sums are subtracted. Q not a multiple
  of `block` (or Q <= block): `_segsum_masked`."""
  q = a.shape[-1]
  if q <= block or q % block:
    return _segsum_masked(a)
  nb = q // block
  ab = a.reshape(a.shape[:-1] + (nb, block))  # [..., I, u]
  inner = _segsum_masked(ab)  # [..., I, u, v] within block I
  loc = jnp.cumsum(ab, axis=-1)  # [..., I, u]: block I up to u
  # [..., J, v]: block J after v (its last position: none)
  rest = jnp.where(jnp.arange(block) < block - 1, inner[..., -1, :], 0.0)
  between = _segsum_masked(loc[..., -1])  # [..., I, J]: blocks J < K <= I
  between = jnp.concatenate([jnp.zeros_like(between[..., :1, :]),
                             between[..., :-1, :]], axis=-2)  # J < K < I
  cross = (loc[..., :, :, None, None] + between[..., :, None, :, None]
           + rest[..., None, None, :, :])  # [..., I, u, J, v]
  blk = jnp.arange(nb)
  same = (blk[:, None] == blk[None, :])[:, None, :, None]
  below = (blk[:, None] > blk[None, :])[:, None, :, None]
  out = jnp.where(same, inner[..., :, :, None, :],
                  jnp.where(below, cross, -jnp.inf))
  return out.reshape(a.shape + (q,))


# The scan's decay sums (read when it is traced; benchmarks/scripts swap in
# other forms to time them). The blocked form: a 512-token prefill of
# hybrid_1b spends 15% less device time than with the masked one
# (benchmarks/README.md, Prefill), with sums as exact.
_segsum = _segsum_blocked


def _check_scan_inputs(x, dt, A, B, C, D, z, dt_bias, initial_state):
  V.check_floating("x", x)
  V.check_ndim("x", x, 4, "[batch, seqlen, nheads, headdim]")
  b, l, h, p = x.shape
  V.check_floating("dt", dt)
  V.check_shape("dt", dt, (b, l, h), "[batch, seqlen, nheads]")
  V.check_floating("B", B)
  V.check_ndim("B", B, 4, "[batch, seqlen, ngroups, dstate]")
  g, n = B.shape[2], B.shape[3]
  V.check_shape("B", B, (b, l, g, n), "[batch, seqlen, ngroups, dstate]")
  V.check_groups(h, g)
  V.check_floating("C", C)
  V.check_shape("C", C, (b, l, g, n), "[batch, seqlen, ngroups, dstate]")
  if z is not None:
    V.check_floating("z", z)
    V.check_shape("z", z, (b, l, h, p), "[batch, seqlen, nheads, headdim]")
  V.check_params(h, A=A, D=D, dt_bias=dt_bias)
  if initial_state is not None:
    V.check_floating("initial_state", initial_state)
    V.check_shape("initial_state", initial_state, (b, h, p, n),
                  "[batch, nheads, headdim, dstate]")


def scan_precision(name: str):
  """`ssd_chunked_scan`'s precision from a `ModelConfig.scan_precision`
  name: "highest" -> HIGHEST, else the dot algorithm of that name."""
  return HIGHEST if name == "highest" else name


def ssd_chunked_scan(x, dt, A, B, C, chunk_size: int, D=None, z=None,
                     dt_bias=None, dt_softplus=False, initial_state=None,
                     precision=HIGHEST):
  """Mamba-2 SSD over a whole sequence.

  Args:
    x: [batch, seqlen, nheads, headdim].
    dt: [batch, seqlen, nheads] raw time steps.
    A: [nheads].
    B, C: [batch, seqlen, ngroups, dstate].
    chunk_size: tokens per chunk (any positive int; seqlen need not be a
      multiple). A sequence shorter than chunk_size is one chunk of its own
      length: no padding, so a short window (a speculative-decoding verify,
      a short prompt) costs O(seqlen^2), not O(chunk_size^2), per row.
    D, z, dt_bias, dt_softplus: as in `selective_state_update`.
    initial_state: optional [batch, nheads, headdim, dstate] state before the
      first token (zeros if None).
    precision: of the scan's f32 products (a `jax.lax.Precision` or a dot
      algorithm name such as "BF16_BF16_F32_X3"; the backend must support
      it). HIGHEST, the default, is true f32 (on a GPU without tensor
      cores); benchmarks/scripts/prefill_scan_cost.py times others and
      their error against it.

  Returns:
    (y [batch, seqlen, nheads, headdim] in x.dtype,
     final_state [batch, nheads, headdim, dstate] float32).
  """
  chunk_size = V.positive_int("chunk_size", chunk_size)
  _check_scan_inputs(x, dt, A, B, C, D, z, dt_bias, initial_state)
  return _ssd_chunked_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias,
                           bool(dt_softplus), initial_state, precision)


def _ssd_chunked_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus,
                      initial_state, precision=HIGHEST):
  b, l, h, p = x.shape
  n = B.shape[-1]
  q = max(1, min(chunk_size, l))  # a short sequence: one unpadded chunk
  nchunks = -(-l // q)
  pad = nchunks * q - l

  d = process_dt(dt, dt_bias, dt_softplus)  # [b, l, h]
  xf = x.astype(F32)
  bg, cg = B.astype(F32), C.astype(F32)  # [b, l, g, n]
  if pad:
    # Zero steps after dt processing: exp(0) = 1 decay, zero contribution.
    padw = ((0, 0), (0, pad), (0, 0))
    d = jnp.pad(d, padw)
    xf, bg, cg = (jnp.pad(v, padw + ((0, 0),)) for v in (xf, bg, cg))

  def chunked(v):
    return v.reshape((b, nchunks, q) + v.shape[2:])

  d, xf, bg, cg = map(chunked, (d, xf, bg, cg))
  bh = heads_from_groups(bg, h, axis=3)  # [b, c, q, h, n]
  ch = heads_from_groups(cg, h, axis=3)
  a = jnp.moveaxis(d * A.astype(F32), 2, -1)  # [b, c, h, q]
  a_cum = jnp.cumsum(a, axis=-1)  # [b, c, h, q]
  dx = d[..., None] * xf  # [b, c, q, h, p]

  # 1. Intra-chunk (diagonal blocks). Position i must not see a later
  # token j > i of its chunk whatever that token holds (a right-padded
  # prompt's pad, an overflow): the causal mask selects the weights, and a
  # non-finite dx_j enters the product as 0 and then makes positions >= j
  # NaN directly (a zero weight times inf or NaN would poison them all).
  causal = jnp.tril(jnp.ones((q, q), bool))
  decay_ij = jnp.exp(_segsum(a))  # [b, c, h, i, j]
  # C_i . B_j once per group (the heads of a group share B and C: H / G
  # times fewer products than per head), then read by each head.
  cb = heads_from_groups(
      jnp.einsum("bcign,bcjgn->bcgij", cg, bg, precision=precision), h,
      axis=2)  # [b, c, h, i, j]
  bad = ~jnp.isfinite(dx)  # [b, c, q, h, p]
  y_diag = jnp.einsum("bchij,bcjhp->bcihp",
                      jnp.where(causal, decay_ij * cb, 0.0),
                      jnp.where(bad, 0.0, dx), precision=precision)
  y_diag = jnp.where(jnp.cumsum(bad, axis=2) > 0, jnp.nan, y_diag)

  # 2. State contributed by each chunk, as of the chunk's end.
  decay_to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # [b, c, h, q]
  chunk_states = jnp.einsum("bchj,bcjhp,bcjhn->bchpn", decay_to_end, dx, bh,
                            precision=precision)

  # 3. Carry the state across chunks.
  chunk_decay = jnp.exp(a_cum[..., -1])  # [b, c, h]
  s0 = (jnp.zeros((b, h, p, n), F32) if initial_state is None
        else initial_state.astype(F32))

  def step(state, inp):
    dec, cs = inp
    return dec[..., None, None] * state + cs, state

  final_state, prev_states = jax.lax.scan(
      step, s0, (jnp.moveaxis(chunk_decay, 1, 0),
                 jnp.moveaxis(chunk_states, 1, 0)))
  prev_states = jnp.moveaxis(prev_states, 0, 1)  # [b, c, h, p, n]

  # 4. Contribution of the state entering each chunk.
  y_off = jnp.einsum("bcihn,bchpn,bchi->bcihp", ch, prev_states,
                     jnp.exp(a_cum), precision=precision)

  y = (y_diag + y_off).reshape(b, nchunks * q, h, p)[:, :l]
  y = _finish_output(y, x, D, z)  # D/z broadcast over [.., heads, headdim]
  return y.astype(x.dtype), final_state

