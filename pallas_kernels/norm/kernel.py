"""Pallas (Triton backend) kernels: Mamba-2's gated grouped RMSNorm of a
decode step (`replayssm_jax.norm.gated_rms_norm_reference`), and the
residual add + RMSNorm between two blocks (`add_rms_norm_reference`).

XLA runs the decode step's norm as two fusions (a convert of the SSM
output to float32, then the grouped reduction and scale). Here one launch
reads y, the gate (in place inside the in_proj output, at a column offset)
and the weight once and writes the normalized output. A program handles
`block_rows` rows x one group (a power of two >= 16 channels), in float32.

Between two pre-norm blocks XLA computes the residual sum x + y as one
fusion and the next block's norm as another (which recomputes the sum);
`add_rms_norm` reads x, y and the weight once and writes both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _check_pow2

F32 = jnp.float32
_MIN_GROUP = 16


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """Tuning of the norm kernels (`pallas_kernels.norm`: the gated RMSNorm
  and the residual add + RMSNorm).

  Attributes:
    block_rows: rows per program (at most; the largest power of two <= it
      that divides the rows).
    num_warps: Triton launch parameter.

  Defaults not swept (their timing: benchmarks/VARIANTS.md).
  """
  block_rows: int = 4
  num_warps: int = 4

  def __post_init__(self):
    _check_pow2("block_rows", self.block_rows)
    _check_pow2("num_warps", self.num_warps)


def shape_problem(name: str, n: int, block: str = "a Triton block"
                  ) -> str | None:
  """Why a kernel cannot take n channels per block (`name`: the argument
  that sets n), or None."""
  if n < _MIN_GROUP or n & (n - 1):
    return (f"{name} = {n} is not a power of two >= {_MIN_GROUP} ({block}); "
            f"use implementation='reference'.")
  return None


def _kernel(y_ref, z_ref, w_ref, o_ref, *, block_rows, group_size, z_offset,
            eps):
  i, g = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(i * block_rows, block_rows)
  y = y_ref[rows, pl.ds(g * group_size, group_size)].astype(F32)
  z = z_ref[rows, pl.ds(z_offset + g * group_size, group_size)].astype(F32)
  h = y * (z * jax.nn.sigmoid(z))
  ms = jnp.sum(h * h, axis=1) / group_size  # [R]
  h = h * jax.lax.rsqrt(ms + eps)[:, None]
  w = w_ref[pl.ds(g * group_size, group_size)].astype(F32)
  o_ref[rows, pl.ds(g * group_size, group_size)] = (
      h * w[None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "z_offset",
                                             "out_dtype", "config",
                                             "interpret"))
def gated_rms_norm(y, z, weight, *, group_size: int, eps: float,
                   z_offset: int = 0, out_dtype=None,
                   config: NormConfig = NormConfig(),
                   interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config;
  y [..., dim] (leading axes flattened into rows)."""
  problem = shape_problem("group_size", group_size)
  if problem is not None:
    raise NotImplementedError(problem)
  lead, dim = y.shape[:-1], y.shape[-1]
  y2, z2 = y.reshape(-1, dim), z.reshape(-1, z.shape[-1])
  rows = y2.shape[0]
  br = tu.pow2_divisor(rows, config.block_rows)
  out = pl.pallas_call(
      functools.partial(_kernel, block_rows=br, group_size=group_size,
                        z_offset=z_offset, eps=eps),
      grid=(rows // br, dim // group_size),
      out_shape=jax.ShapeDtypeStruct(
          (rows, dim), y.dtype if out_dtype is None else out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
      interpret=interpret,
      name="replayssm_gated_rms_norm",
  )(y2, z2, weight)
  return out.reshape(lead + (dim,))


def _add_kernel(x_ref, y_ref, w_ref, s_ref, h_ref, *, block_rows, eps):
  rows = pl.ds(pl.program_id(0) * block_rows, block_rows)
  s = x_ref[rows, :].astype(F32) + y_ref[rows, :].astype(F32)
  s_ref[rows, :] = s
  ms = jnp.sum(s * s, axis=1) / s.shape[1]
  h = s * jax.lax.rsqrt(ms + eps)[:, None]
  h_ref[rows, :] = (w_ref[...].astype(F32)[None, :] * h).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "config",
                                             "interpret"))
def add_rms_norm(x, y, weight, *, eps: float, out_dtype=None,
                 config: NormConfig = NormConfig(),
                 interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config;
  x, y [..., d] (leading axes flattened into rows)."""
  lead, d = x.shape[:-1], x.shape[-1]
  problem = shape_problem("d", d, "one Triton block per row")
  if problem is not None:
    raise NotImplementedError(problem)
  x2, y2 = x.reshape(-1, d), y.reshape(-1, d)
  rows = x2.shape[0]
  br = tu.pow2_divisor(rows, config.block_rows)
  s, h = pl.pallas_call(
      functools.partial(_add_kernel, block_rows=br, eps=eps),
      grid=(rows // br,),
      out_shape=(jax.ShapeDtypeStruct((rows, d), F32),
                 jax.ShapeDtypeStruct(
                     (rows, d), x.dtype if out_dtype is None else out_dtype)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
      interpret=interpret,
      name="replayssm_add_rms_norm",
  )(x2, y2, weight)
  return s.reshape(lead + (d,)), h.reshape(lead + (d,))
