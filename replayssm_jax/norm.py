"""Mamba-2's gated grouped RMSNorm and the residual add + RMSNorm of a
pre-norm block (references).

`gated_rms_norm_reference(y, z, weight, group_size, eps)`:

  h = y * silu(z);  out = weight * h / sqrt(mean(h^2 over each group of
  group_size channels) + eps),

float32 throughout, returned in `out_dtype` (y's dtype if None). It is the
Mamba mixer's norm (`models.layers.GatedRMSNorm`); the public, validated op
with the kernel dispatcher is `replayssm_jax.ops.gated_rms_norm`, and the
Pallas kernel is `pallas_kernels.norm`. z may be a wider array holding the
gate in columns z_offset .. z_offset + dim - 1 (Mamba-2's in_proj output),
which a kernel reads in place.

`add_rms_norm_reference(x, y, weight, eps)`: the residual stream's next
value s = x + y (float32) and the next block's input weight * s / rms(s)
(in `out_dtype`), the pair a decode step computes between two blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V

F32 = jnp.float32


def gated_rms_norm_reference(y, z, weight, *, group_size: int, eps: float,
                             z_offset: int = 0, out_dtype=None):
  """See the module docstring; y [..., dim], z [..., >= z_offset + dim],
  weight [dim] -> [..., dim] in out_dtype."""
  dim = y.shape[-1]
  z = z[..., z_offset:z_offset + dim]
  h = y.astype(F32) * jax.nn.silu(z.astype(F32))
  g = h.reshape(h.shape[:-1] + (-1, group_size))
  g = g * jax.lax.rsqrt(jnp.mean(g * g, -1, keepdims=True) + eps)
  out = weight.astype(F32) * g.reshape(h.shape)
  return out.astype(y.dtype if out_dtype is None else out_dtype)


def validate_gated_rms_norm(y, z, weight, group_size, eps, z_offset):
  """Clear errors for the op's arguments (shapes, dtypes, ranges)."""
  V.check_floating("y", y)
  V.check_floating("z", z)
  V.check_floating("weight", weight)
  if y.ndim < 1 or z.ndim != y.ndim or z.shape[:-1] != y.shape[:-1]:
    raise ValueError(f"y [..., dim] and z [..., width] must share their "
                     f"leading axes, got {tuple(y.shape)} and "
                     f"{tuple(z.shape)}.")
  dim = y.shape[-1]
  V.check_shape("weight", weight, (dim,), "[dim]")
  if (isinstance(group_size, bool) or not isinstance(group_size, int)
      or group_size < 1 or dim % group_size):
    raise ValueError(f"group_size must be a positive int dividing dim = "
                     f"{dim}, got {group_size!r}.")
  _check_eps(eps)
  V.check_column_offset("z_offset", z_offset, dim, z.shape[-1],
                        "the gate inside z")


def _check_eps(eps):
  if not isinstance(eps, float) or not eps > 0:
    raise ValueError(f"eps must be a positive Python float, got {eps!r}.")


def rms_norm(x, weight, eps: float, out_dtype):
  """weight * x / sqrt(mean(x^2) + eps) over the last axis, in float32,
  returned in out_dtype (`models.layers.RMSNorm`)."""
  xf = x.astype(F32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
  return (weight.astype(F32) * xf).astype(out_dtype)


def add_rms_norm_reference(x, y, weight, *, eps: float, out_dtype=None):
  """(s = x + y in float32, rms_norm(s) in out_dtype (x's if None)); x, y
  [..., d], weight [d]."""
  s = x.astype(F32) + y.astype(F32)
  return s, rms_norm(s, weight, eps, x.dtype if out_dtype is None
                     else out_dtype)


def validate_add_rms_norm(x, y, weight, eps):
  """Clear errors for the op's arguments (shapes, dtypes, ranges)."""
  V.check_floating("x", x)
  V.check_floating("y", y)
  V.check_floating("weight", weight)
  if x.ndim < 1 or y.shape != x.shape:
    raise ValueError(f"x and y must have the same shape [..., d], got "
                     f"{tuple(x.shape)} and {tuple(y.shape)}.")
  V.check_shape("weight", weight, (x.shape[-1],), "[d]")
  _check_eps(eps)
