"""The Pallas verify kernels (interpret mode) against the reference
`replay_verify`: shapes, buffer dtypes, fold modes and window variants, the
snapshot-verify kernel of baseline mode, and the kernels under precision
policies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import testing
from tests import harness
from tests.speculative_common import (B, G, H, N, P, TOL, assert_copy_restored,
                                      np_bits, policy_setup, random_window,
                                      replay_setup)


# ------------------------------------------------------- Pallas verify kernel
def _pallas_verify_vs_reference(rstate, kw, counts, L, tol, config):
  """The verify kernels with `config` == the reference (outputs, folded
  checkpoint, counts); exactly the folding rows' checkpoints change.
  Returns (kernel state, reference state)."""
  T = kw["x"].shape[1]
  y_ref, r_ref = rs.replay_verify(rstate, **kw, implementation="reference")
  y, r = rs.replay_verify(rstate, **kw, implementation="pallas",
                          config=config)
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(r.checkpoint, r_ref.checkpoint, tol, "checkpoint")
  np.testing.assert_array_equal(r.count, r_ref.count)
  folds = (counts + T >= L) & (counts > 0)
  same = ~np.asarray(harness.rows_changed(rstate.checkpoint, r.checkpoint))
  np.testing.assert_array_equal(same, ~folds)
  return r, r_ref


@pytest.mark.parametrize("L,T,buffer_dtype,block_p",
                         [(8, 4, "float32", 8), (8, 2, "bfloat16", 4),
                          (4, 1, "float32", None), (16, 8, "bfloat16", 8)])
def test_pallas_verify_matches_reference(L, T, buffer_dtype, block_p):
  """The verify kernels (interpret mode) == the reference: outputs, folded
  checkpoint, appended window, counts; non-flush rows' checkpoint and stale
  slots are bit-identical."""
  key = jax.random.PRNGKey(L * 10 + T)
  params = testing.random_params(key, H)
  counts = np.array([0, L - 1, L - T, max(0, L - T - 1)])
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"],
      buffer_dtype=jnp.dtype(buffer_dtype))
  win = random_window(L + T, T)
  kw = dict(**win, **params, dt_softplus=True)
  tol = testing.tolerance(buffer_dtype)
  r, r_ref = _pallas_verify_vs_reference(rstate, kw, counts, L, tol,
                                         pk.VerifyConfig(block_p=block_p))
  n = jnp.full((B,), T, jnp.int32)  # accept all: the window is history
  testing.assert_close(
      rs.materialize(rs.replay_commit(r, n, T), params["A"]),
      rs.materialize(rs.replay_commit(r_ref, n, T), params["A"]), tol,
      "state after commit")
  for row in range(B):  # slots past the new window are untouched
    end = int(r.count[row]) + T
    np.testing.assert_array_equal(
        harness.bits(r.x_buf[row, end:]), harness.bits(rstate.x_buf[row, end:]))


@pytest.mark.parametrize("config", [
    dict(fold="dot_tf32x3"),  # exact f32 dot in interpret
    dict(fold="dot_bf16x3"),  # bf16 B buffer
    dict(fold="rank1")], ids=str)
def test_pallas_verify_fold_modes(config):
  """The early flush's folds on the persistent grid (5 rows: padded
  counters; 12 items on the 8 programs of interpret mode: several items
  for some) == the reference."""
  b, h, p, n, g, L, T = 5, 4, 16, 16, 2, 16, 4
  key = jax.random.PRNGKey(41)
  params = testing.random_params(key, h)
  counts = np.array([L - 1, 3, L - T, L - 2, 0])  # 3 rows fold
  bf16 = config["fold"].startswith("dot_bf16")
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), b, h, p, n, g, L, counts, params["A"],
      buffer_dtype=jnp.bfloat16 if bf16 else jnp.float32)
  win = testing.random_step_inputs(jax.random.PRNGKey(42), b, h, p, n, g,
                                   seqlen=T)
  kw = dict(**win, **params, dt_softplus=True)
  _pallas_verify_vs_reference(rstate, kw, counts, L,
                              testing.tolerance("bfloat16") if bf16 else TOL,
                              pk.VerifyConfig(block_p=16, **config))
  if bf16:  # an f32 buffer does not hold its B in bf16
    with pytest.raises(NotImplementedError, match="needs bf16 B"):
      rs.replay_verify(
          rstate.replace(b_buf=rstate.b_buf.astype(jnp.float32)), **kw,
          implementation="pallas", config=pk.VerifyConfig(block_p=16,
                                                          **config))
  with pytest.raises(NotImplementedError, match="block_p >= 16"):
    rs.replay_verify(rstate, **kw, implementation="pallas",
                     config=pk.VerifyConfig(block_p=8, fold="dot_tf32x3"))


# Each option value at least once, on (L, T, buffer dtype) cases in turn
# (not the full product: interpret mode compiles each case apart).
@pytest.mark.parametrize("L,T,buffer_dtype,config", [
    (16, 4, "bfloat16", {}),
    (32, 16, "float32", dict(fold="rank1")),
    (8, 2, "bfloat16", dict(fold="rank1")),
    (32, 8, "float32", dict(readout_chunk=16)),  # the whole dstate
    (16, 4, "bfloat16", dict(readout_chunk=4)),
    (8, 2, "bfloat16", dict(readout_chunk=64)),
    (32, 8, "float32", dict(fold="rank1", readout_chunk=4))],
    ids=str)
def test_pallas_verify_window_variants(L, T, buffer_dtype, config):
  """The window kernel (readouts over dstate column blocks of each width,
  the whole row in one) == the reference, with rows that fold, rows that
  do not, and buffer rounding of the earlier window tokens."""
  b, h, p, n, g = 5, 4, 16, 16, 2
  key = jax.random.PRNGKey(43 + T)
  params = testing.random_params(key, h)
  counts = np.array([L - 1, 3, L - T, 0, L - T - 1])
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), b, h, p, n, g, L, counts, params["A"],
      buffer_dtype=jnp.dtype(buffer_dtype))
  win = testing.random_step_inputs(jax.random.PRNGKey(44), b, h, p, n, g,
                                   seqlen=T)
  kw = dict(**win, **params, dt_softplus=True)
  _pallas_verify_vs_reference(rstate, kw, counts, L,
                              testing.tolerance(buffer_dtype),
                              pk.VerifyConfig(**config))
  with pytest.raises(ValueError, match="fold must be one of"):
    pk.VerifyConfig(fold="dot_f32")
  with pytest.raises(ValueError, match="readout_chunk must be a power"):
    pk.VerifyConfig(readout_chunk=24)


def test_verify_bc_forms_agree():
  """speculative.verify_bc as einsums and as products summed over dstate:
  the same B.C products (f32 either way), on fresh random inputs with a
  bf16 buffer (the window tokens rounded to it)."""
  from replayssm_jax import speculative as spec  # pylint: disable=g-import-not-at-top
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(71), 3)
  b_buf = jax.random.normal(k1, (3, 8, 2, 16), jnp.bfloat16)
  B = jax.random.normal(k2, (3, 4, 2, 16), jnp.float32)
  C = jax.random.normal(k3, (3, 4, 2, 16), jnp.float32)
  dot = spec.verify_bc(b_buf, B, C)
  red = spec.verify_bc(b_buf, B, C, form="reduce")
  for name, d, r in zip(("hist", "win", "own"), dot, red):
    assert d.shape == r.shape, (name, d.shape, r.shape)
    testing.assert_close(r, d, testing.TOLERANCES["float32"], name)
  with pytest.raises(ValueError, match="form must be"):
    spec.verify_bc(b_buf, B, C, form="tf32")


def test_pallas_verify_refuses_non_pow2_window():
  params, rstate, _ = replay_setup(8, 3, [0, 1, 2, 3])
  with pytest.raises(NotImplementedError, match="T = 3 is not a power"):
    rs.replay_verify(rstate, **random_window(1, 3), **params,
                     implementation="pallas")


# --------------------------------------------- Pallas snapshot-verify kernel
@pytest.mark.parametrize("state_dtype,T,with_z,with_optional,block_p", [
    ("float32", 4, False, True, None), ("bfloat16", 3, True, True, 4),
    ("float16", 1, False, False, 8), ("float32", 8, True, False, 4)])
def test_pallas_snapshot_verify_matches_reference(state_dtype, T, with_z,
                                                  with_optional, block_p):
  """The one-pass snapshot kernel (interpret mode) == T reference steps:
  outputs and every snapshot; the input state is left as it was."""
  key = jax.random.PRNGKey(T + 7 * with_z)
  k1, k2, k3 = jax.random.split(key, 3)
  params = testing.random_params(k1, H, with_D=with_optional,
                                 with_dt_bias=with_optional)
  state = (jax.random.normal(k2, (B, H, P, N)) * 2.0).astype(state_dtype)
  win = testing.random_step_inputs(k3, B, H, P, N, G, jnp.bfloat16,
                                   dt_softplus=True, with_z=with_z,
                                   seqlen=T)  # [B, T, ...]
  before = np.asarray(state)
  kw = dict(**win, **params, dt_softplus=True)
  y_ref, s_ref = rs.baseline_verify(state, **kw, implementation="reference")
  y, snaps = rs.baseline_verify(state, **kw, implementation="pallas",
                                config=pk.SSUConfig(block_p=block_p))
  assert y.shape == (B, T, H, P) and y.dtype == y_ref.dtype
  assert snaps.shape == (B, T, H, P, N) and snaps.dtype == state.dtype
  tol = testing.tolerance(state_dtype, jnp.bfloat16)
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(snaps, s_ref, tol, "snapshots")
  np.testing.assert_array_equal(np.asarray(state), before)
  # And the reference itself is T single steps.
  first = {k: None if v is None else v[:, 0] for k, v in win.items()}
  y0, s0 = rs.selective_state_update(state, **first, **params,
                                     dt_softplus=True,
                                     implementation="reference")
  testing.assert_close(y_ref[:, 0], y0, tol, "first position")
  testing.assert_close(s_ref[:, 0], s0, tol, "first snapshot")


def test_snapshot_verify_lowers_to_triton():
  """The snapshot kernel lowers for the GPU (Triton IR, cross-lowered)."""
  from pallas_kernels import ssu as ssu_kernel  # pylint: disable=g-import-not-at-top
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(0)
  params = testing.random_params(key, H)
  state = jax.random.normal(key, (B, H, P, N)).astype(jnp.float16)
  win = random_window(3, 4)
  _lower_for_cuda(
      lambda s, w: ssu_kernel.baseline_verify(s, **w, **params,
                                              dt_softplus=True),
      state, win)


# A copy with each scale form, SR of both stores, rank-1 and dot folds,
# several headdim blocks and readout column blocks.
KERNEL_POLICY_CASES = [
    ("f32+int8", pk.VerifyConfig()),
    ("f32+bf16", pk.VerifyConfig(fold="rank1")),
    ("f16+fp8+sr", pk.VerifyConfig()),
    ("f32+fp8+sr:hash32", pk.VerifyConfig(block_p=4)),
    ("f32+fp8", pk.VerifyConfig()),
    ("f16+fp8", pk.VerifyConfig(readout_chunk=4)),
    ("f32+bf16", pk.VerifyConfig(block_p=4)),
]


@functools.partial(jax.jit, static_argnames=("policy", "config"),
                   compiler_options=harness.FAST_COMPILE)
def _kernel_and_reference_verify(rstate, win, params, *, policy, config):
  kw = dict(**win, **params, dt_softplus=True, policy=policy, layer=2)
  return (rs.replay_verify(rstate, **kw, implementation="pallas",
                           config=config),
          rs.replay_verify(rstate, **kw, implementation="reference"))


@pytest.mark.parametrize("name,config", KERNEL_POLICY_CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in
                              enumerate(KERNEL_POLICY_CASES)])
def test_pallas_verify_with_policies_matches_reference(name, config):
  """The verify kernels (interpret mode) under a precision policy: y within
  f32 tolerance of the reference; folding rows' master within the master
  dtype's tolerance and their copy exactly the store of the kernel's
  master (with SR: with the reference's bits); the other rows' master,
  copy and scales untouched (bit for bit); counters equal."""
  L, T = 16, 4
  counts = [0, 13, 15, 5]  # rows 1 and 2 fold their history first
  pol, params, st, _ = policy_setup(L, 41, counts, name)
  st = st.replace(x_buf=st.x_buf.astype(jnp.bfloat16),
                  b_buf=st.b_buf.astype(jnp.bfloat16))
  pol = pol.replace(buffer_dtype="bfloat16")
  win = random_window(42, T)
  (y_k, k), (y_r, r) = _kernel_and_reference_verify(st, win, params,
                                                     policy=pol,
                                                     config=config)
  testing.assert_close(y_k, y_r, TOL, f"{name}: y")
  folds = (np.array(counts) + T >= L) & (np.array(counts) > 0)
  for field in ("checkpoint", "read_copy", "read_scale"):
    if getattr(st, field) is not None:
      np.testing.assert_array_equal(
          np_bits(getattr(k, field))[~folds],
          np_bits(getattr(st, field))[~folds],
          err_msg=f"{name}: a row that did not fold had its {field} written")
  testing.assert_close(k.checkpoint[folds], r.checkpoint[folds],
                       testing.tolerance(pol.checkpoint_dtype),
                       f"{name}: folded master")
  assert_copy_restored(st, k, pol, folds)
  for field in ("count", "row_id", "step", "x_buf", "b_buf", "dt_buf"):
    a, b = getattr(k, field), getattr(r, field)
    assert (a is None) == (b is None), field
    if a is not None:
      np.testing.assert_array_equal(np_bits(a), np_bits(b), err_msg=field)
