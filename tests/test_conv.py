"""causal_conv1d (prefill) == causal_conv1d_update (steps) == numpy; the
ring-buffer step; ops.causal_conv1d_step's kernel (interpret mode) against
its reference, its checks and its Triton lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import conv
from replayssm_jax import ops
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


# ops.causal_conv1d_step: (batch, dim, split, kernel_size, bias, activation,
# dtype, x_offset). Batches 3 / 6 / 8 give 1- / 2- / 8-row programs; dims
# whose pieces share a power-of-two divisor >= 16 (the kernel's channel
# block); the input inside a wider array at a column offset (unaligned too).
CONV_STEP_CASES = [
    (3, 64, (32, 16, 16), 4, True, "silu", "float32", 0),
    (6, 48, None, 3, False, None, "float32", 5),
    (8, 96, (64, 16, 16), 2, True, "silu", "bfloat16", 32),
    (6, 64, (32, 16, 16), 4, True, "silu", "bfloat16", 0),
]


def _conv_step_inputs(batch, dim, kernel_size, bias, dtype, seed=0,
                      x_offset=0):
  """5 steps' inputs x [5, batch, x_offset + dim + 3] (the conv's in
  columns x_offset ..), a ring, ragged start slots, weight, bias."""
  kx, ks, kw, kb, kt = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = jax.random.normal(kx, (5, batch, x_offset + dim + 3)).astype(dtype)
  state = jax.random.normal(ks, (batch, kernel_size - 1, dim)).astype(dtype)
  w = (jax.random.normal(kw, (dim, kernel_size)) / np.sqrt(kernel_size)
       ).astype(dtype)
  b = jax.random.normal(kb, (dim,)).astype(dtype) if bias else None
  start = jax.random.randint(kt, (batch,), 0, 7, jnp.int32)  # any ints
  return x, state, start, w, b


def _conv_step_scan(impl, x, state, start, w, b, activation, split,
                    x_offset):
  def body(carry, xt):
    pieces, st, sp = ops.causal_conv1d_step(
        xt, *carry, w, b, activation=activation, split=split,
        x_offset=x_offset, implementation=impl)
    return (st, sp), pieces

  return jax.lax.scan(body, (state, start), x)


@pytest.mark.parametrize("case", CONV_STEP_CASES, ids=str)
def test_conv_step_kernel_matches_reference(case):
  """Five ring steps with ragged start slots: the kernel's pieces within the
  dtype's tolerance of the reference's, its ring and start bit for bit (the
  new input copied into each row's oldest slot), the arguments untouched."""
  batch, dim, split, k, bias, activation, dtype, off = case
  x, state, start, w, b = _conv_step_inputs(batch, dim, k, bias, dtype,
                                            x_offset=off)
  before = np.asarray(state, np.float32).copy()
  outs = {impl: _conv_step_scan(impl, x, state, start, w, b, activation,
                                split, off)
          for impl in ("reference", "pallas")}
  (st_r, sp_r), pieces_r = outs["reference"]
  (st_k, sp_k), pieces_k = outs["pallas"]
  sizes = split or (dim,)
  assert len(pieces_k) == len(sizes)
  for i, (pk_, pr) in enumerate(zip(pieces_k, pieces_r)):
    assert pk_.shape == (5, batch, sizes[i]) and pk_.dtype == x.dtype
    testing.assert_close(pk_, pr, testing.tolerance(dtype), f"piece {i}")
  np.testing.assert_array_equal(np.asarray(st_k, np.float32),
                                np.asarray(st_r, np.float32))
  np.testing.assert_array_equal(sp_k, sp_r)
  np.testing.assert_array_equal(np.asarray(state, np.float32), before)


def test_conv_step_reference_is_the_ring_step_cut():
  """The reference's pieces are the ring step's output, cut at split."""
  x, state, start, w, b = _conv_step_inputs(3, 64, 4, True, "float32",
                                            x_offset=7)
  pieces, st, sp = conv.causal_conv1d_step_reference(
      x[0], state, start, w, b, split=(32, 16, 16), x_offset=7)
  y, st_ring, sp_ring = rs.causal_conv1d_update_ring(x[0, :, 7:71], state,
                                                     start, w, b)
  np.testing.assert_array_equal(jnp.concatenate(pieces, -1), y)
  np.testing.assert_array_equal(st, st_ring)
  np.testing.assert_array_equal(sp, sp_ring)


def test_conv_step_rejects_bad_arguments():
  x, state, start, w, b = _conv_step_inputs(3, 64, 4, True, "float32")
  x = x[0]  # [3, 67]
  for off in (4, -1, 1.0):
    with pytest.raises(ValueError, match="x_offset must be an int"):
      ops.causal_conv1d_step(x, state, start, w, b, x_offset=off)
  with pytest.raises(ValueError, match="split must be positive ints summing "
                     "to dim = 64"):
    ops.causal_conv1d_step(x, state, start, w, b, split=(32, 16))
  with pytest.raises(ValueError, match="kernel_size >= 2"):
    ops.causal_conv1d_step(x, state[:, :0], start, w[:, :1], b)
  with pytest.raises(ValueError, match="conv_state"):
    ops.causal_conv1d_step(x, state[:, :2], start, w, b)
  with pytest.raises(TypeError, match="start must be an integer"):
    ops.causal_conv1d_step(x, state, start.astype(jnp.float32), w, b)
  # Pieces with no common power-of-two divisor >= 16: the kernel says so
  # and names the reference, which takes them.
  with pytest.raises(NotImplementedError, match="implementation='reference'"):
    ops.causal_conv1d_step(x, state, start, w, b, split=(40, 12, 12),
                           implementation="pallas")
  pieces, _, _ = ops.causal_conv1d_step(x, state, start, w, b,
                                        split=(40, 12, 12))
  assert [p.shape[1] for p in pieces] == [40, 12, 12]


@pytest.mark.parametrize("kernel_size,bias,activation",
                         [(4, True, "silu"), (3, False, None)])
def test_conv_step_kernel_lowers_to_triton(kernel_size, bias, activation):
  """The kernel lowers for the GPU (Triton IR, cross-lowered on this CPU) at
  hybrid_1b's Mamba shapes (the input inside the in_proj output): the
  masked ring stores and the piece stores."""
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  x, state, start, w, b = _conv_step_inputs(32, 6144, kernel_size, bias,
                                            "bfloat16", x_offset=4096)
  text = _lower_for_cuda(
      lambda *a: pk.conv.causal_conv1d_step(
          *a, activation=activation, split=(4096, 1024, 1024),
          x_offset=4096),
      x[0], state, start, w, b)
  assert "replayssm_conv_step" in text


# ops.causal_conv1d_window: the step cases with windows of 1-5 tokens.
@pytest.mark.parametrize("case,window",
                         list(zip(CONV_STEP_CASES, (4, 1, 5, 2))),
                         ids=str)
def test_conv_window_kernel_matches_reference(case, window):
  """A window of T inputs from a ring with ragged start slots: the kernel's
  pieces within the dtype's tolerance of the reference's, the ring and the
  inputs untouched; the reference equals T ring steps (the window's
  outputs do not depend on how the state would be advanced)."""
  batch, dim, split, k, bias, activation, dtype, off = case
  x, state, start, w, b = _conv_step_inputs(batch, dim, k, bias, dtype,
                                            seed=3, x_offset=off)
  xw = jnp.swapaxes(x[:window], 0, 1)  # [batch, T, width]
  before = np.asarray(state, np.float32).copy()
  kw = dict(activation=activation, split=split, x_offset=off)
  pieces = {impl: ops.causal_conv1d_window(xw, state, start, w, b, **kw,
                                           implementation=impl)
            for impl in ("reference", "pallas")}
  _, steps = _conv_step_scan("reference", x[:window], state, start, w, b,
                             activation, split, off)
  sizes = split or (dim,)
  tol = testing.tolerance(dtype)
  for i, n in enumerate(sizes):
    got, ref = pieces["pallas"][i], pieces["reference"][i]
    assert got.shape == (batch, window, n) and got.dtype == x.dtype
    testing.assert_close(got, ref, tol, f"piece {i}")
    testing.assert_close(ref, jnp.swapaxes(steps[i], 0, 1), tol,
                         f"piece {i} vs steps")
  np.testing.assert_array_equal(np.asarray(state, np.float32), before)


def test_conv_window_rejects_bad_arguments():
  x, state, start, w, b = _conv_step_inputs(3, 64, 4, True, "float32")
  xw = jnp.swapaxes(x[:2], 0, 1)  # [3, 2, 67]
  with pytest.raises(ValueError, match=r"x must be 3-D \[batch, T, width\]"):
    ops.causal_conv1d_window(x[0], state, start, w, b)
  with pytest.raises(ValueError, match="x_offset must be an int"):
    ops.causal_conv1d_window(xw, state, start, w, b, x_offset=4)
  with pytest.raises(ValueError, match="split must be positive ints"):
    ops.causal_conv1d_window(xw, state, start, w, b, split=(32, 16))
  with pytest.raises(TypeError, match="start must be an integer"):
    ops.causal_conv1d_window(xw, state, start.astype(jnp.float32), w, b)
  with pytest.raises(NotImplementedError, match="implementation='reference'"):
    ops.causal_conv1d_window(xw, state, start, w, b, split=(40, 12, 12),
                             implementation="pallas")


def test_conv_window_kernel_lowers_to_triton():
  """The window kernel lowers for the GPU at hybrid_1b's Mamba shapes (a
  verify window of 4 inside the in_proj output)."""
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  x, state, start, w, b = _conv_step_inputs(32, 6144, 4, True, "bfloat16",
                                            x_offset=4096)
  text = _lower_for_cuda(
      lambda *a: pk.conv.causal_conv1d_window(
          *a, split=(4096, 1024, 1024), x_offset=4096),
      jnp.swapaxes(x[:4], 0, 1), state, start, w, b)
  assert "replayssm_conv_window" in text
