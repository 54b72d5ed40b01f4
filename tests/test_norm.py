"""ops.gated_rms_norm and ops.add_rms_norm: the references against float64
numpy, the Pallas kernels (interpret mode) against the references, argument
checks and the Triton lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from replayssm_jax import ops
from replayssm_jax import testing

# (leading shape, dim, group_size, z_offset, dtype, out_dtype)
CASES = [
    ((6,), 64, 16, 0, "float32", None),
    ((3,), 96, 32, 7, "float32", "float32"),
    ((8,), 64, 32, 64, "bfloat16", "bfloat16"),
    ((2, 5), 32, 16, 3, "bfloat16", "float32"),
]


def _inputs(lead, dim, z_offset, dtype, seed=0):
  ky, kz, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  y = jax.random.normal(ky, lead + (dim,)).astype(dtype)
  z = (2.0 * jax.random.normal(kz, lead + (z_offset + dim + 5,))).astype(
      dtype)
  w = (1.0 + 0.3 * jax.random.normal(kw, (dim,))).astype(dtype)
  return y, z, w


def _numpy(y, z, w, group_size, eps, z_offset):
  f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
  y, z, w = f(y), f(z), f(w)
  dim = y.shape[-1]
  z = z[..., z_offset:z_offset + dim]
  h = y * z / (1.0 + np.exp(-z))
  g = h.reshape(h.shape[:-1] + (-1, group_size))
  g = g / np.sqrt(np.mean(g * g, -1, keepdims=True) + eps)
  return w * g.reshape(h.shape)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_and_reference_match_numpy(case):
  lead, dim, gs, off, dtype, out_dtype = case
  y, z, w = _inputs(lead, dim, off, dtype)
  want = _numpy(y, z, w, gs, 1e-5, off)
  ref = ops.gated_rms_norm(y, z, w, group_size=gs, eps=1e-5, z_offset=off,
                           out_dtype=out_dtype, implementation="reference")
  got = ops.gated_rms_norm(y, z, w, group_size=gs, eps=1e-5, z_offset=off,
                           out_dtype=out_dtype, implementation="pallas")
  out = jnp.dtype(out_dtype or dtype)
  assert ref.dtype == got.dtype == out and got.shape == y.shape
  # Both round their float32 result to the output dtype once.
  tol = testing.tolerance(out)
  testing.assert_close(ref, want, tol, "reference vs numpy")
  testing.assert_close(got, ref, tol, "kernel vs reference")


def test_rejects_bad_arguments():
  y, z, w = _inputs((4,), 64, 0, "float32")
  kw = dict(group_size=16, eps=1e-5)
  with pytest.raises(ValueError, match="group_size must be a positive int "
                     "dividing dim = 64"):
    ops.gated_rms_norm(y, z, w, group_size=24, eps=1e-5)
  with pytest.raises(ValueError, match="eps must be a positive"):
    ops.gated_rms_norm(y, z, w, group_size=16, eps=0.0)
  with pytest.raises(ValueError, match="z_offset must be an int"):
    ops.gated_rms_norm(y, z, w, z_offset=6, **kw)
  with pytest.raises(ValueError, match="share their leading axes"):
    ops.gated_rms_norm(y, z[:3], w, **kw)
  with pytest.raises(ValueError, match="weight"):
    ops.gated_rms_norm(y, z, w[:32], **kw)
  with pytest.raises(NotImplementedError, match="implementation='reference'"):
    ops.gated_rms_norm(y, z, w, group_size=8, eps=1e-5,
                       implementation="pallas")


def test_kernel_lowers_to_triton():
  """hybrid_1b's decode norm (8 groups of 512, the gate inside the in_proj
  output) lowers for the GPU (Triton IR, cross-lowered on this CPU)."""
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  y, z, w = _inputs((32,), 4096, 0, "bfloat16")
  z = jnp.concatenate([z, z], -1)
  text = _lower_for_cuda(
      lambda *a: pk.norm.gated_rms_norm(*a, group_size=512, eps=1e-5),
      y, z, w)
  assert "replayssm_gated_rms_norm" in text


# ops.add_rms_norm: (leading shape, d, x dtype, y dtype, out_dtype)
ADD_CASES = [
    ((6,), 64, "float32", "bfloat16", "bfloat16"),
    ((3,), 32, "float32", "float32", None),
    ((2, 5), 128, "bfloat16", "bfloat16", "float32"),
]


@pytest.mark.parametrize("case", ADD_CASES, ids=str)
def test_add_norm_kernel_and_reference_match_numpy(case):
  """The sum exactly as float32 adds; the normed output within the output
  dtype's tolerance of float64 numpy, the kernel's within it of the
  reference's."""
  lead, d, xdt, ydt, out_dtype = case
  kx, ky, kw = jax.random.split(jax.random.PRNGKey(3), 3)
  x = (3.0 * jax.random.normal(kx, lead + (d,))).astype(xdt)
  y = jax.random.normal(ky, lead + (d,)).astype(ydt)
  w = (1.0 + 0.3 * jax.random.normal(kw, (d,))).astype(xdt)
  f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
  s64 = f(x) + f(y)
  want = f(w) * s64 / np.sqrt(np.mean(s64 * s64, -1, keepdims=True) + 1e-5)
  outs = {impl: ops.add_rms_norm(x, y, w, eps=1e-5, out_dtype=out_dtype,
                                 implementation=impl)
          for impl in ("reference", "pallas")}
  out = jnp.dtype(out_dtype or xdt)
  tol = testing.tolerance(out)
  for impl, (s, h) in outs.items():
    assert s.dtype == jnp.float32 and h.dtype == out and h.shape == x.shape
    np.testing.assert_array_equal(
        s, x.astype(jnp.float32) + y.astype(jnp.float32))
    testing.assert_close(h, want, tol, f"{impl} vs numpy")
  testing.assert_close(outs["pallas"][1], outs["reference"][1], tol,
                       "kernel vs reference")


def test_add_norm_rejects_bad_arguments():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32))
  w = jnp.ones((32,))
  with pytest.raises(ValueError, match="same shape"):
    ops.add_rms_norm(x, x[:, :16], w, eps=1e-5)
  with pytest.raises(ValueError, match="weight"):
    ops.add_rms_norm(x, x, w[:16], eps=1e-5)
  with pytest.raises(ValueError, match="eps must be a positive"):
    ops.add_rms_norm(x, x, w, eps=1)
  with pytest.raises(NotImplementedError, match="implementation='reference'"):
    ops.add_rms_norm(x[:, :24], x[:, :24], w[:24], eps=1e-5,
                     implementation="pallas")


def test_add_norm_kernel_lowers_to_triton():
  """hybrid_1b's residual rows (d 2048, f32 stream, bf16 block output)
  lower for the GPU (Triton IR, cross-lowered on this CPU)."""
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  x = jnp.ones((32, 2048), jnp.float32)
  y = jnp.ones((32, 2048), jnp.bfloat16)
  text = _lower_for_cuda(
      lambda *a: pk.norm.add_rms_norm(*a, eps=1e-5, out_dtype=jnp.bfloat16),
      x, y, jnp.ones((2048,), jnp.bfloat16))
  assert "replayssm_add_rms_norm" in text
