"""The baseline decode step's Pallas kernels (Triton, and Mosaic GPU as
implementation "pallas_mosaic_gpu"; interpret mode on CPU) against the
reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import ops as rs_ops
from replayssm_jax import testing
from tests import harness
from tests.kernel_harness import DIMS
from tests.kernel_harness import step_inputs as _step_inputs

SSU_CONFIGS = [pk.SSUConfig(), pk.SSUConfig(block_p=4),
               pk.SSUConfig(block_p=None, num_warps=2)]


# Every config, state dtype and option set appears (not the full product:
# interpret mode compiles each combination separately).
SSU_CASES = [
    (SSU_CONFIGS[0], "float32", (True, True, True)),
    (SSU_CONFIGS[0], "bfloat16", (False, False, False)),
    (SSU_CONFIGS[1], "float16", (True, True, True)),
    (SSU_CONFIGS[1], "float32", (True, False, True)),
    (SSU_CONFIGS[2], "bfloat16", (True, False, True)),
    (SSU_CONFIGS[2], "float16", (False, False, False)),
]


# Mosaic GPU baseline kernel (implementation "pallas_mosaic_gpu"): every
# state dtype, option set and tuning field, in interpret mode.
MOSAIC_CASES = [
    (pk.MosaicSSUConfig(), "float32", (True, True, True)),
    (pk.MosaicSSUConfig(heads_per_program=1), "bfloat16", (False, False,
                                                           False)),
    (pk.MosaicSSUConfig(heads_per_program=4, max_concurrent_steps=3),
     "float16", (True, True, True)),
    (pk.MosaicSSUConfig(heads_per_program=2), "float32", (True, False,
                                                          True)),
]


@pytest.mark.parametrize(
    "impl,config,state_dtype,options",
    [("pallas",) + c for c in SSU_CASES]
    + [("pallas_mosaic_gpu",) + c for c in MOSAIC_CASES], ids=str)
def test_baseline_kernel_step(impl, config, state_dtype, options):
  with_D, with_z, with_bias = options
  params, tok = _step_inputs(7, with_D=with_D, with_z=with_z,
                             with_dt_bias=with_bias)
  state = harness.random_state(jax.random.PRNGKey(3), DIMS,
                               jnp.dtype(state_dtype))
  state_before = np.asarray(state)
  kw = dict(**tok, **params, dt_softplus=with_bias)
  y_ref, s_ref = rs.selective_state_update(state, **kw,
                                           implementation="reference")
  y, s = rs.selective_state_update(state, **kw, implementation=impl,
                                   config=config)
  tol = testing.tolerance(state_dtype)
  assert y.dtype == y_ref.dtype
  testing.assert_close(y, y_ref, testing.TOLERANCES["float32"], "y")
  assert s.dtype == s_ref.dtype
  testing.assert_close(s, s_ref, tol, "state")
  np.testing.assert_array_equal(np.asarray(state), state_before)  # no mutation


def test_mosaic_kernel_refusals():
  state = jnp.zeros((2, 8, 16, 16), jnp.float32)
  assert pk.mosaic_kernel.shape_problem(state, on_gpu=False) is None
  assert "headdim = 16 is not a multiple of 64" in (
      pk.mosaic_kernel.shape_problem(state))
  narrow = jnp.zeros((2, 8, 64, 16), jnp.float16)  # 32-byte state rows
  assert "not a multiple of 128" in pk.mosaic_kernel.shape_problem(narrow)
  assert pk.mosaic_kernel.shape_problem(
      jnp.zeros((2, 8, 64, 128), jnp.float16)) is None
  with pytest.raises(ValueError, match="max_concurrent_steps must be"):
    pk.MosaicSSUConfig(max_concurrent_steps=0)
  params, tok = _step_inputs(9)
  state = harness.random_state(jax.random.PRNGKey(5), DIMS)
  with pytest.raises(NotImplementedError, match="does not divide nheads"):
    rs.selective_state_update(state, **tok, **params,
                              implementation="pallas_mosaic_gpu",
                              config=pk.MosaicSSUConfig(heads_per_program=3))
  with pytest.raises(NotImplementedError, match="runs on the GPU only"):
    rs.selective_state_update(state, **tok, **params,
                              implementation="pallas_mosaic_gpu",
                              config=pk.MosaicSSUConfig(entry="kernel"))
  with pytest.raises(ValueError, match="entry must be"):
    pk.MosaicSSUConfig(entry="triton")
  # Never picked by implementation=None: no in-place state update
  # (ssu/mosaic.py).
  table = rs_ops._REGISTRY["selective_state_update"]  # pylint: disable=protected-access
  assert not table["pallas_mosaic_gpu"].preferred()
