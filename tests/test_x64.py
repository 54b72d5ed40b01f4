"""The ops, the kernels and the decode loops with 64-bit types on
(`JAX_ENABLE_X64=1`): same results as with them off.

The variable must be set before jax starts, so `test_subset_under_x64`
runs this module's x64 tests and a few others in a subprocess with it set;
in the normal run they skip.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing

X64 = bool(jax.config.jax_enable_x64)
only_x64 = pytest.mark.skipif(not X64, reason="runs with JAX_ENABLE_X64=1")
# Tests of other modules the subprocess runs too.
SUBSET = ("tests/test_poisoned_inputs.py::test_verify_window_is_causal"
          "[pallas-x]",
          "tests/test_poisoned_inputs.py::test_verify_window_is_causal"
          "[reference-B]",
          "tests/test_traced_policy.py")


@pytest.mark.skipif(X64, reason="the subprocess itself")
def test_subset_under_x64():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_ENABLE_X64="1", PYTHONPATH=root)
  r = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       __file__, *SUBSET], cwd=root, env=env, capture_output=True,
      text=True, check=False, timeout=1200)
  tail = (r.stdout + r.stderr)[-3000:]
  assert r.returncode == 0, tail
  assert "1 skipped" in r.stdout, tail  # only the subprocess launcher


def _inputs():
  params = testing.random_params(jax.random.PRNGKey(0), 8)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(1), 4, 8, 8, 16, 2, 8, [0, 1, 2, 7], params["A"])
  tok = testing.random_step_inputs(jax.random.PRNGKey(2), 4, 8, 8, 16, 2)
  win = testing.random_step_inputs(jax.random.PRNGKey(3), 4, 8, 8, 16, 2,
                                   seqlen=4)
  return params, rstate, tok, win


def _both(fn):
  """fn() with 64-bit types on (this process) and off."""
  out = fn()
  with jax.enable_x64(False):
    ref = fn()
  return out, ref


@only_x64
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_x64_replay_ops(impl):
  params, rstate, tok, win = _inputs()

  def run():
    y, new = rs.replay_state_update(rstate, **tok, **params, dt_softplus=True,
                                    implementation=impl)
    yv, pending = rs.replay_verify(new, **win, **params, dt_softplus=True,
                                   implementation=impl)
    done = rs.replay_commit(pending, np.array([1, 2, 3, 4]))
    return y, yv, done.count, done.count.dtype
  (y, yv, count, dtype), (y32, yv32, count32, _) = _both(run)
  assert dtype == jnp.int32
  np.testing.assert_array_equal(count, count32)
  for a, b in ((y, y32), (yv, yv32)):
    testing.assert_close(a, b, testing.TOLERANCES["float32"], impl)


@only_x64
def test_x64_decode_loops():
  from replayssm_jax.models import generate  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import speculative as MS  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_model  # pylint: disable=g-import-not-at-top
  model = make_model(0)
  toks = jax.random.randint(jax.random.PRNGKey(0), (2, 6), 0, 64)
  lengths = jnp.array([6, 4])

  def run():
    spec, n, _ = MS.speculative_generate(model, MS.NgramProposer(), toks,
                                         lengths, 8, 3)
    plain, m = generate(model, toks, lengths, 8)
    return spec, n, plain, m
  out, ref = _both(run)
  for a, b in zip(out, ref):
    np.testing.assert_array_equal(a, b)
