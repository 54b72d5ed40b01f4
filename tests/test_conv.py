"""causal_conv1d (prefill) == causal_conv1d_update (steps) == numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
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


def _to_ring(ordered, start):
  """The ring buffer whose row r holds `ordered` [b, k-1, dim] (oldest
  first) starting at slot start[r]."""
  k1 = ordered.shape[1]
  ring = np.zeros_like(np.asarray(ordered, np.float32))
  for r, s in enumerate(np.asarray(start)):
    for age in range(k1):
      ring[r, (s + age) % k1] = np.asarray(ordered[r, age], np.float32)
  return jnp.asarray(ring, ordered.dtype)


@pytest.mark.parametrize("case", C.CONV_CASES, ids=C.case_id)
def test_conv_ring_steps_equal_shifting_steps_bit_for_bit(case):
  """The ring-buffer decode step (per-row start slots, ragged) gives the
  shifting step's outputs and final window exactly."""
  x, w, bias, init = harness.conv_inputs(case)
  init = _zero_state_if_none(init, x, case.kernel_size)
  k1 = case.kernel_size - 1
  start = (jnp.arange(case.batch, dtype=jnp.int32) * 2 + case.seed) % max(
      k1, 1)
  ring = _to_ring(init, start)
  np.testing.assert_array_equal(rs.conv_ring_ordered(ring, start), init)
  y, st = harness.conv_steps(x, init, w, bias, activation=case.activation)
  y_r, st_r, start_r = harness.conv_steps_ring(
      x, ring, start, w, bias, activation=case.activation)
  assert y_r.dtype == x.dtype and st_r.dtype == init.dtype
  np.testing.assert_array_equal(np.asarray(y_r, np.float32),
                                np.asarray(y, np.float32))
  np.testing.assert_array_equal(
      np.asarray(rs.conv_ring_ordered(st_r, start_r), np.float32),
      np.asarray(st, np.float32))
  if k1:
    np.testing.assert_array_equal(start_r, (start + case.seqlen) % k1)


def test_conv_ring_rejects_bad_start():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 8))
  w = jax.random.normal(jax.random.PRNGKey(1), (8, 4))
  st = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 8))
  with pytest.raises(ValueError, match=r"start.*\[batch\]"):
    rs.causal_conv1d_update_ring(x, st, jnp.zeros((2,), jnp.int32), w)
  with pytest.raises(TypeError, match="start must be an integer"):
    rs.causal_conv1d_update_ring(x, st, jnp.zeros((3,)), w)
  with pytest.raises(ValueError, match="conv_state"):
    rs.conv_ring_ordered(st[0], jnp.zeros((3,), jnp.int32))
