"""causal_conv1d (prefill) == causal_conv1d_update (steps) == numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import testing
from tests import cases as C
from tests import harness


def np_causal_conv1d(x, weight, bias, init, activation):
  """Direct float64 numpy: y[t] = sum_j w[:, k-1-j] * x[t-j] (+ bias)."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  w = np.asarray(weight, np.float64)
  b, t, dim = x.shape
  k = w.shape[1]
  hist = (np.zeros((b, k - 1, dim)) if init is None
          else np.asarray(jnp.asarray(init, jnp.float32), np.float64))
  full = np.concatenate([hist, x], axis=1)  # token t sits at k - 1 + t
  y = np.zeros((b, t, dim))
  for s in range(t):
    for j in range(k):  # j tokens back
      y[:, s] += w[:, k - 1 - j] * full[:, k - 1 + s - j]
  if bias is not None:
    y += np.asarray(bias, np.float64)
  if activation is not None:
    y = y / (1.0 + np.exp(-y))
  return y, full[:, t:]


def _zero_state_if_none(init, x, k):
  if init is not None:
    return init
  return jnp.zeros((x.shape[0], k - 1, x.shape[2]), x.dtype)


@pytest.mark.parametrize("case", C.CONV_CASES, ids=C.case_id)
def test_conv_prefill_matches_steps_and_numpy(case):
  x, w, bias, init = harness.conv_inputs(case)
  y, st = harness.conv_prefill(x, w, bias, init, activation=case.activation)
  y_step, st_step = harness.conv_steps(
      x, _zero_state_if_none(init, x, case.kernel_size), w, bias,
      activation=case.activation)
  y_np, st_np = np_causal_conv1d(x, w, bias, init, case.activation)

  assert y.dtype == x.dtype and y.shape == x.shape
  assert st.shape == (case.batch, case.kernel_size - 1, case.dim)
  tol = testing.tolerance(case.dtype)
  testing.assert_close(y, y_step, tol, f"{case.id} prefill vs steps")
  testing.assert_close(y, y_np, tol, f"{case.id} prefill vs numpy")
  testing.assert_close(y_step, y_np, tol, f"{case.id} steps vs numpy")
  # The conv state is the last k-1 inputs, copied exactly.
  np.testing.assert_array_equal(np.asarray(st, np.float32),
                                st_np.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(st_step, np.float32),
                                st_np.astype(np.float32))


@pytest.mark.parametrize("seqlen,split,kernel_size", C.CONV_SPLITS,
                         ids=[f"T{t}-at{s}-k{k}" for t, s, k in C.CONV_SPLITS])
def test_conv_split_sequence_with_carried_state(seqlen, split, kernel_size):
  case = C.ConvCase(seqlen, kernel_size, seed=3000 + split)
  x, w, bias, init = harness.conv_inputs(case)
  y, st = harness.conv_prefill(x, w, bias, init, activation="silu")
  y1, st1 = harness.conv_prefill(x[:, :split], w, bias, init,
                                 activation="silu")
  y2, st2 = harness.conv_prefill(x[:, split:], w, bias, st1,
                                 activation="silu")
  testing.assert_close(jnp.concatenate([y1, y2], axis=1), y,
                       testing.TOLERANCES["float32"], "split y")
  np.testing.assert_array_equal(np.asarray(st2), np.asarray(st))
