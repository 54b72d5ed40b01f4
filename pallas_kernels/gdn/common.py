"""In-kernel pieces shared by the GDN kernels: a program's tile, the
token's normalised q / k, and readouts of a [key_dim, block_v] tile.

The step kernels issue every global load of a program before its first
reduction: a reduction across warps puts a barrier in the program, which
no later load is moved above, so a load written after one waits for it
and adds a memory latency to the program's chain of waits."""

from __future__ import annotations

import copy

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from replayssm_jax.gdn.reference import L2NORM_EPS

F32 = jnp.float32


class Tile:
  """Program (value block, value head, row) of the grid (value_dim //
  block_v, num_v_heads, batch): its row b, value head h, key head hk and
  value columns vs. (A grid of value-head blocks: `at_head` gives the tile
  of each of the program's heads.)

  rows_ref: [batch] slots of the state's rows (`replayssm_jax.slots`; -1
  for a padding row) or None: token refs are read at row b, state refs at
  sb (b's slot; row 0 for a padding row, `live` False), or b itself."""

  def __init__(self, *, heads_per_key, block_v, rows_ref=None):
    self.vblk, self.h, self.b = (pl.program_id(0), pl.program_id(1),
                                 pl.program_id(2))
    self.sb, self.live = state_row(rows_ref, self.b)
    self.heads_per_key = heads_per_key
    self.hk = self.h // heads_per_key
    self.vs = pl.ds(self.vblk * block_v, block_v)
    self.first_of_key = (self.h % heads_per_key == 0) & (self.vblk == 0)

  def at_head(self, h):
    """This tile at value head h (possibly traced)."""
    t = copy.copy(self)
    t.h, t.hk = h, h // self.heads_per_key
    t.first_of_key = (h % self.heads_per_key == 0) & (self.vblk == 0)
    return t


def state_row(rows_ref, b):
  """(state row, live) of token row b: b and True without rows_ref, else
  b's slot (row 0 for a padding row) and whether it is one."""
  if rows_ref is None:
    return b, True
  slot = rows_ref[b]
  return jnp.maximum(slot, 0), slot >= 0


def when_live(live, fn):
  """fn() where `live` (`state_row`'s: True, or a traced bool)."""
  if live is True:
    fn()
  else:
    pl.when(live)(fn)


def each_head(tile: Tile, heads_per_program: int, fn):
  """fn(t) for each value head of the program: `tile` itself, or with
  heads_per_program > 1 (the grid's head axis in blocks of that many) the
  block's heads in a loop (`GDNConfig.heads_per_program`)."""
  if heads_per_program == 1:
    fn(tile)
  else:
    lax.fori_loop(0, heads_per_program, lambda i, c: fn(tile.at_head(
        tile.h * heads_per_program + i)) or c, 0)


def _l2_factor(x):
  """rsqrt(|x|^2 + eps) of an f32 [key_dim] vector."""
  return lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS)


def normalise(x, use_l2norm: bool, scale=1.0):
  """`gdn.reference.prepare_qk` of one [key_dim] vector (f32)."""
  x = x.astype(F32)
  if use_l2norm:
    x = x * _l2_factor(x)
  return x * scale if scale != 1.0 else x


def norm_factors(qk, *, use_l2norm, scale):
  """(f_q, f_k) f32 scalars with q f_q and k f_k `normalise_qk`'s vectors
  (up to rounding), from `load_qk`'s pair: a kernel that reads them needs
  no reduction of its own before its tile's readouts."""
  q, k = (x.astype(F32) for x in qk)
  fq, fk = jnp.float32(qk_scale(q.shape[-1], scale)), jnp.float32(1.0)
  if use_l2norm:
    fq, fk = fq * _l2_factor(q), _l2_factor(k)
  return fq, fk


def qk_scale(key_dim: int, scale):
  return key_dim ** -0.5 if scale is None else float(scale)


def load_qk(q_ref, k_ref, b, hk):
  """Row b's q and k [key_dim] of key head hk, as stored (the loads alone,
  so that a kernel can issue them with its others before any reduction)."""
  return q_ref[b, hk, :], k_ref[b, hk, :]


def normalise_qk(qk, *, use_l2norm, scale, factors=None):
  """(q normalised and scaled, k normalised) [key_dim] f32 from
  `load_qk`'s pair (the k as loaded, for the ring append, is normalised
  too); with `factors` (`norm_factors`, e.g. from the ring-weights launch)
  each vector times its factor, no reduction."""
  q, k = qk
  if factors is not None:
    return q.astype(F32) * factors[0], k.astype(F32) * factors[1]
  return (normalise(q, use_l2norm, qk_scale(q.shape[-1], scale)),
          normalise(k, use_l2norm))


def readout(tile, x):
  """tile^T x: tile [key_dim, block_v] f32, x [key_dim] f32 -> [block_v]."""
  return jnp.sum(tile * x[:, None], axis=0)

