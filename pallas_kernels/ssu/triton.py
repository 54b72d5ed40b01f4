"""Pallas (Triton backend) kernel: baseline Mamba-2 selective state update.

One program per (headdim block, head, row): read the [block_p, N] state tile, apply the decayed
rank-1 update, write it back in place (the state is aliased input->output),
and write y = S C + D x (optionally gated by silu(z)). Matches
`replayssm_jax.reference.selective_state_update`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _LaunchConfig
from replayssm_jax.reference import process_dt

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SSUConfig(_LaunchConfig):
  """Tuning of the baseline kernel.

  Attributes:
    block_p: headdim rows per program (the state tile is [block_p, dstate]);
      None = all of headdim.
    num_warps, num_stages: Triton launch parameters.
  """
  block_p: int | None = 16  # benchmarks/kernel_tuning/first_kernel_designs_h200.json


def _unpack(refs, has_D, has_z, has_bias, heads_per_group, block_p,
            has_rows=False):
  """(6 inputs, D/z/dt_bias refs or None, 2 outputs) and the program's tile:
  row b, head h, group g, headdim slice ps (grid: headdim blocks, heads,
  batch); with has_rows a [batch] slot input follows the optional ones and
  the tile also holds the state row (-1 for a padding row)."""
  it = iter(refs)
  ins = tuple(next(it) for _ in range(6))
  opt = tuple(next(it) if flag else None for flag in (has_D, has_z,
                                                      has_bias))
  rows_ref = next(it) if has_rows else None
  outs = (next(it), next(it))
  pblk, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  tile = (b, h, h // heads_per_group, pl.ds(pblk * block_p, block_p))
  if has_rows:
    tile += (rows_ref[b],)
  return ins, opt, outs, tile


def _ssu_kernel(*refs, has_D, has_z, has_bias, dt_softplus, heads_per_group,
                block_p, has_rows=False):
  # state_out_ref aliases state_ref (same HBM buffer on GPU; in interpret
  # mode it starts as a copy of the input): read one, write the other.
  ((state_ref, x_ref, dt_ref, a_ref, b_ref, c_ref), (d_ref, z_ref, bias_ref),
   (y_ref, state_out_ref), tile) = _unpack(
       refs, has_D, has_z, has_bias, heads_per_group, block_p, has_rows)
  b, h, g, ps = tile[:4]
  # The state row: the token row, or its slot (a padding row, slot -1,
  # reads row 0, writes nothing and outputs NaN).
  sb = jnp.maximum(tile[4], 0) if has_rows else b
  live = tile[4] >= 0 if has_rows else True

  d = process_dt(dt_ref[b, h], bias_ref[h] if has_bias else None,
                        dt_softplus)
  decay = jnp.exp(a_ref[h].astype(F32) * d)
  x = x_ref[b, h, ps].astype(F32)  # [block_p]
  bv = b_ref[b, g, :].astype(F32)  # [N]
  cv = c_ref[b, g, :].astype(F32)  # [N]
  s = plgpu.load(state_ref.at[sb, h, ps], eviction_policy="evict_first")
  s = s.astype(F32) * decay + (d * x)[:, None] * bv[None, :]  # [block_p, N]
  y = jnp.sum(s * cv[None, :], axis=1)  # [block_p]

  def store():
    plgpu.store(state_out_ref.at[sb, h, ps], s.astype(state_out_ref.dtype))

  pl.when(live)(store) if has_rows else store()

  y = tu.finish_output(y, x, d_ref[h] if has_D else None,
                           z_ref[b, h, ps] if has_z else None)
  y_ref[b, h, ps] = jnp.where(live, y, jnp.nan).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "config",
                                             "interpret"))
def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None,
                           dt_bias=None, dt_softplus=False, *, rows=None,
                           config: SSUConfig = SSUConfig(),
                           interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config;
  rows: [batch] int32 slots of ssm_state's rows (`replayssm_jax.slots`,
  effective: -1 for a padding row), read and written in place."""
  _, nheads, headdim, _ = ssm_state.shape
  batch = x.shape[0]
  ngroups = B.shape[1]
  block_p = tu.resolve_block_p(config.block_p, headdim)
  operands = [ssm_state, x, dt, A, B, C]
  operands += [v for v in (D, z, dt_bias, rows) if v is not None]
  kernel = functools.partial(
      _ssu_kernel, has_D=D is not None, has_z=z is not None,
      has_bias=dt_bias is not None, dt_softplus=dt_softplus,
      heads_per_group=nheads // ngroups, block_p=block_p,
      has_rows=rows is not None)
  y, new_state = pl.pallas_call(
      kernel,
      grid=(headdim // block_p, nheads, batch),
      out_shape=(jax.ShapeDtypeStruct((batch, nheads, headdim), x.dtype),
                 jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype)),
      input_output_aliases={0: 1},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="replayssm_selective_state_update",
  )(*operands)
  return y, new_state


def _window_kernel(*refs, window, has_D, has_z, has_bias, dt_softplus,
                   heads_per_group, block_p):
  """Snapshot verify: T baseline steps on one state tile, every state
  written to its window slot (the state is read once, written T times)."""
  ((state_ref, x_ref, dt_ref, a_ref, b_ref, c_ref), (d_ref, z_ref, bias_ref),
   (y_ref, snap_ref), (b, h, g, ps)) = _unpack(
       refs, has_D, has_z, has_bias, heads_per_group, block_p)
  a = a_ref[h].astype(F32)
  s = plgpu.load(state_ref.at[b, h, ps],
                 eviction_policy="evict_first").astype(F32)
  for step in range(window):  # static: T is small
    t = jnp.int32(step)  # a scalar array: ref indexers want one
    d = process_dt(dt_ref[b, t, h], bias_ref[h] if has_bias else None,
                   dt_softplus)
    x = x_ref[b, t, h, ps].astype(F32)  # [block_p]
    bv = b_ref[b, t, g, :].astype(F32)  # [N]
    cv = c_ref[b, t, g, :].astype(F32)
    s = s * jnp.exp(a * d) + (d * x)[:, None] * bv[None, :]
    y = jnp.sum(s * cv[None, :], axis=1)  # from the f32 state, as a step
    stored = s.astype(snap_ref.dtype)
    plgpu.store(snap_ref.at[b, t, h, ps], stored)
    s = stored.astype(F32)  # the next step reads the stored state
    y = tu.finish_output(y, x, d_ref[h] if has_D else None,
                             z_ref[b, t, h, ps] if has_z else None)
    y_ref[b, t, h, ps] = y.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "config",
                                             "interpret"))
def baseline_verify(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                    dt_softplus=False, *,
                    config: SSUConfig = SSUConfig(),
                    interpret: bool = False):
  """`replayssm_jax.baseline_verify` in one kernel: same signature and
  results as the reference (a scan of T baseline steps), but the state is
  read once and each position's state is written straight into its
  [batch, T, ...] snapshot slot (T state writes, no stacking or transpose
  copies)."""
  batch, nheads, headdim, _ = ssm_state.shape
  window, ngroups = x.shape[1], B.shape[2]
  block_p = tu.resolve_block_p(config.block_p, headdim)
  operands = [ssm_state, x, dt, A, B, C]
  operands += [v for v in (D, z, dt_bias) if v is not None]
  kernel = functools.partial(
      _window_kernel, window=window, has_D=D is not None,
      has_z=z is not None, has_bias=dt_bias is not None,
      dt_softplus=dt_softplus, heads_per_group=nheads // ngroups,
      block_p=block_p)
  return pl.pallas_call(
      kernel,
      grid=(headdim // block_p, nheads, batch),
      out_shape=(jax.ShapeDtypeStruct((batch, window, nheads, headdim),
                                      x.dtype),
                 jax.ShapeDtypeStruct((batch, window) + ssm_state.shape[1:],
                                      ssm_state.dtype)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="replayssm_baseline_verify",
  )(*operands)
