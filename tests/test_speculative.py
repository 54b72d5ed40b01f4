"""Speculative verify/commit on a ReplayState vs the token-by-token baseline.

* `replay_verify` outputs == baseline steps over the window from the
  committed state, for ragged counts (rows that must flush first and rows
  that need not);
* after `replay_commit(n)` the state equals a fresh baseline run over the
  accepted prefix (property test over random acceptance sequences, also
  continuing with the standard decode step afterwards);
* the checkpoint is written at most once per window, only on flush rows;
* capacity rules and bad inputs raise clear errors.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import precision as prec
from replayssm_jax import testing
from tests import harness

B, H, P, N, G = 4, 4, 8, 8, 2
TOL = testing.TOLERANCES["float32"]


def _setup(L, seed, counts):
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  rstate, full = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"])
  return params, rstate, full


def _window(seed, T):
  return testing.random_step_inputs(jax.random.PRNGKey(seed), B, H, P, N, G,
                                    seqlen=T)


@functools.partial(jax.jit, compiler_options=harness.FAST_COMPILE)
def _baseline_window(state, win, params):
  """Baseline steps over the window: (y [b, T, h, p], states [T, b, ...])."""
  def step(s, tok):
    y, s = rs.selective_state_update(s, **tok, **params, dt_softplus=True,
                                     implementation="reference")
    return s, (y, s)
  _, (ys, states) = jax.lax.scan(step, state, harness.time_major(win))
  return jnp.swapaxes(ys, 0, 1), states


@functools.partial(jax.jit, static_argnames=("T",),
                   compiler_options=harness.FAST_COMPILE)
def _verify_commit(rstate, win, params, n, *, T):
  y, pending = rs.replay_verify(rstate, **win, **params, dt_softplus=True)
  return y, pending, rs.replay_commit(pending, n, T)


@pytest.mark.parametrize("L,T", [(2, 1), (5, 2), (8, 4), (16, 4), (9, 8)])
def test_verify_matches_baseline_and_commit_rolls_back(L, T):
  counts = [0, L - 1, L - T, (L - T) // 2]
  params, rstate, full = _setup(L, 10 * L + T, counts)
  win = _window(L + 100 * T, T)
  y_base, states = _baseline_window(full, win, params)
  n = np.array([1, T, max(1, T // 2), max(1, T - 1)], np.int32)
  y, pending, committed = _verify_commit(rstate, win, params, n, T=T)
  testing.assert_close(y, y_base, TOL, f"verify y (L={L}, T={T})")
  # Rows whose window did not fit flushed their committed history (once).
  flush = np.array(counts) + T >= L
  wrote = np.asarray(harness.rows_changed(rstate.checkpoint,
                                          pending.checkpoint))
  np.testing.assert_array_equal(wrote, flush & (np.array(counts) > 0))
  np.testing.assert_array_equal(pending.count, np.where(flush, 0, counts))
  # Commit: the state is that of the accepted prefix.
  expect = np.stack([np.asarray(states[k - 1, r]) for r, k in enumerate(n)])
  testing.assert_close(rs.materialize(committed, params["A"]), expect, TOL,
                       "state after commit")
  assert np.all(np.asarray(committed.count) < L)


def test_random_acceptance_equals_fresh_run_on_accepted_prefix():
  """Property test: 24 windows with random acceptance (1..T tokens, i.e. 0
  to all drafts accepted), then standard decode steps; outputs and state
  always equal a baseline run over the accepted token stream only. The
  checkpoint is written in exactly the windows the flush policy names
  (count + T >= L before the window: at most once per window), and the
  count follows the accepted tokens without ever reaching L."""
  L, T, windows = 8, 3, 24
  rng = np.random.default_rng(0)
  params, rstate, full = _setup(L, 7, [0, 3, 5, 7])
  writes = np.zeros(B, int)
  count = np.asarray(rstate.count).copy()
  for w in range(windows):
    win = _window(1000 + w, T)
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    if w % 6 == 0:
      n[:] = 1  # every draft rejected
    if w % 6 == 3:
      n[:] = T  # every draft accepted
    y_base, states = _baseline_window(full, win, params)
    y, pending, committed = _verify_commit(rstate, win, params, n, T=T)
    for r in range(B):  # accepted outputs match
      testing.assert_close(y[r, :n[r]], y_base[r, :n[r]], TOL,
                           f"window {w} row {r}")
    changed = np.asarray(harness.rows_changed(rstate.checkpoint,
                                              committed.checkpoint))
    flush = count + T >= L
    np.testing.assert_array_equal(changed, flush, f"writes in window {w}")
    count = np.where(flush, 0, count) + n
    np.testing.assert_array_equal(committed.count, count, f"window {w}")
    assert np.all(count < L)
    writes += changed
    full = jnp.stack([states[k - 1, r] for r, k in enumerate(n)])
    rstate = committed
    testing.assert_close(rs.materialize(rstate, params["A"]), full, TOL,
                         f"state after window {w}")
  # The count grows by >= 1 per window and flushes at >= L - T = 5: at
  # least one write per 5 windows.
  assert np.all(writes >= windows // 5), writes
  # Standard decode continues from the committed state.
  step = jax.jit(lambda r, s, tok: (
      rs.replay_state_update(r, **tok, **params, dt_softplus=True),
      rs.selective_state_update(s, **tok, **params, dt_softplus=True)))
  for t in range(2 * L):
    tok = testing.random_step_inputs(jax.random.PRNGKey(5000 + t), B, H, P,
                                     N, G)
    (y_r, rstate), (y_b, full) = step(rstate, full, tok)
    testing.assert_close(y_r, y_b, TOL, f"decode step {t}")


def test_verify_commit_compiles_once():
  L, T = 8, 4
  params, rstate, _ = _setup(L, 3, [0, 2, 5, 7])
  traces = []

  @jax.jit
  def spec_step(r, win, n):
    traces.append(1)
    _, pending = rs.replay_verify(r, **win, **params, dt_softplus=True)
    return rs.replay_commit(pending, n, T)

  rng = np.random.default_rng(1)
  for w in range(6):
    rstate = spec_step(rstate, _window(w, T),
                       jnp.asarray(rng.integers(1, T + 1, B), jnp.int32))
  assert len(traces) == 1
  assert np.all((np.asarray(rstate.count) >= 0)
                & (np.asarray(rstate.count) < L))


def test_capacity_and_bad_inputs():
  params, rstate, _ = _setup(4, 1, [0, 1, 2, 3])
  with pytest.raises(ValueError, match=r"buffer_len \(4\) must exceed the "
                     r"window length T \(4\)"):
    rs.replay_verify(rstate, **_window(0, 4), **params)
  win = _window(0, 2)
  with pytest.raises(ValueError, match=r"dt must have shape"):
    rs.replay_verify(rstate, **dict(win, dt=win["dt"][:, :1]), **params)
  with pytest.raises(ValueError, match=r"x must be 4-D"):
    rs.replay_verify(rstate, **dict(win, x=win["x"][:, 0]), **params)
  with pytest.raises(TypeError, match="rstate must be a ReplayState"):
    rs.replay_verify(rstate.checkpoint, **win, **params)
  _, pending = rs.replay_verify(rstate, **win, **params)
  with pytest.raises(ValueError, match=r"num_accepted must lie in \[1, "
                     r"T\] = \[1, 2\] for every row; rows \[1\] hold \[3\]"):
    rs.replay_commit(pending, jnp.asarray([1, 3, 2, 1], jnp.int32), 2)
  with pytest.raises(ValueError, match=r"num_accepted must lie in"):
    rs.replay_commit(pending, jnp.asarray([0, 1, 1, 1], jnp.int32), 2)
  with pytest.raises(TypeError, match="num_accepted must have an integer"):
    rs.replay_commit(pending, jnp.ones(4), 2)
  with pytest.raises(ValueError, match=r"num_accepted must have shape"):
    rs.replay_commit(pending, jnp.ones(3, jnp.int32), 2)
  # The pending state carries its window: a commit of another window, of a
  # committed state, or a second verify before the commit is refused.
  assert pending.pending_window == 2 and rstate.pending_window is None
  with pytest.raises(ValueError, match=r"window \(4\) does not match the "
                     r"pending window of rstate \(2 tokens"):
    rs.replay_commit(pending, jnp.full(4, 4, jnp.int32), 4)
  with pytest.raises(ValueError, match="rstate has no pending window"):
    rs.replay_commit(rstate, jnp.ones(4, jnp.int32), 2)
  with pytest.raises(ValueError, match="replay_commit it before the next"):
    rs.replay_verify(pending, **win, **params)
  committed = rs.replay_commit(pending, jnp.ones(4, jnp.int32))
  assert committed.pending_window is None
  # (Rows 2 and 3 fold their history first: count + T >= L.)
  np.testing.assert_array_equal(committed.count, [1, 2, 1, 1])
  # Under jit a bad acceptance count poisons the row (NaN later), not a
  # silently wrong state.
  bad = jax.jit(lambda p, n: rs.replay_commit(p, n, 2))(
      pending, jnp.asarray([1, 5, 1, 1], jnp.int32))
  assert int(bad.count[1]) == -1
  y, _ = jax.jit(lambda r: rs.replay_verify(r, **win, **params))(bad)
  assert np.all(np.isnan(np.asarray(y[1])))
  assert np.all(np.isfinite(np.asarray(y)[[0, 2, 3]]))


def test_snapshot_baseline_matches_replay_spec():
  """The snapshot-per-draft baseline and replay verify/commit agree."""
  L, T = 8, 4
  params, rstate, full = _setup(L, 21, [0, 2, 5, 7])
  win = _window(77, T)
  n = np.array([1, 4, 2, 3], np.int32)
  y_r, _, committed = _verify_commit(rstate, win, params, n, T=T)
  y_b, snaps = rs.baseline_verify(full, **win, **params, dt_softplus=True)
  assert snaps.shape == (B, T, H, P, N)
  testing.assert_close(y_r, y_b, TOL, "verify outputs")
  testing.assert_close(rs.materialize(committed, params["A"]),
                       rs.baseline_commit(snaps, jnp.asarray(n)), TOL,
                       "committed state")
  with pytest.raises(ValueError, match=r"num_accepted must lie in \[1, T\]"):
    rs.baseline_commit(snaps, jnp.asarray([0, 1, 1, 1], jnp.int32))


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
  win = _window(L + T, T)
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
  params, rstate, _ = _setup(8, 3, [0, 1, 2, 3])
  with pytest.raises(NotImplementedError, match="T = 3 is not a power"):
    rs.replay_verify(rstate, **_window(1, 3), **params,
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
  from tests.test_pallas_kernels import _lower_for_cuda  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(0)
  params = testing.random_params(key, H)
  state = jax.random.normal(key, (B, H, P, N)).astype(jnp.float16)
  win = _window(3, 4)
  _lower_for_cuda(
      lambda s, w: ssu_kernel.baseline_verify(s, **w, **params,
                                              dt_softplus=True),
      state, win)


# ------------------------------------------------------ precision policies
def _policy_setup(L, seed, counts, name):
  """(policy, params, ragged replay state of preset `name` with f32
  buffers: its read copy stored from the master, random row ids and steps
  with stochastic rounding; the f32 full state it stands for)."""
  pol = prec.PrecisionPolicy.preset(name).replace(buffer_dtype="float32",
                                                seed=5)
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  rstate, full = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"],
      checkpoint_dtype=pol.checkpoint_dtype)
  return pol, params, harness.with_policy_fields(
      rstate, pol, [11, 3, 7, 20], [40, 0, 9, 13]), full


@functools.partial(jax.jit, static_argnames=("T", "policy"),
                   compiler_options=harness.FAST_COMPILE)
def _verify_commit_policy(rstate, win, params, n, *, T, policy):
  y, pending = rs.replay_verify(rstate, **win, **params, dt_softplus=True,
                                policy=policy, layer=2)
  return y, pending, rs.replay_commit(pending, n, T)


def _assert_copy_restored(before, after, pol, rows):
  """after's read copy (and scales) of `rows` == the store of after's
  master, with the bits of before's steps at the read-copy site (SR)."""
  bits = None
  if pol.stochastic_rounding:
    bits = prec.random_bits(pol.seed, 2, before.row_id, before.step,
                            before.checkpoint.shape[1:],
                            prec.SITE_READ_COPY, pol.sr_rng)
  copy, scale = prec.store(after.checkpoint.astype(jnp.float32),
                           pol.read_dtype, bits)
  np.testing.assert_array_equal(_np_bits(after.read_copy)[rows],
                                _np_bits(copy)[rows])
  if scale is not None:
    np.testing.assert_array_equal(_np_bits(after.read_scale)[rows],
                                  _np_bits(scale)[rows])


def _np_bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("name", ["f32+int8", "f16+fp8", "f16+fp8+sr:hash32"])
def test_verify_with_a_read_copy_reads_the_copy_and_restores_it(name):
  """Rows that need no early flush read only the copy: their outputs equal
  a plain state's whose checkpoint is the dequantized copy, and stay finite
  with the master poisoned (NaN). Early-flushing rows fold the master (as
  the plain verify does, within the master dtype's tolerance), read the
  window out from it, and store the copy re-quantized from the stored
  master (bit for bit; with stochastic rounding, with the bits of the
  row's step at the read-copy site). Commit advances the SR step by the
  accepted tokens."""
  L, T = 8, 3
  counts = [0, L - 1, L - T, 2]  # rows 1 and 2 flush early
  pol, params, st, _ = _policy_setup(L, 31, counts, name)
  win = _window(77, T)
  flush = np.array(counts) + T >= L
  n = np.array([1, T, 2, 2], np.int32)
  poisoned = st.replace(checkpoint=jnp.where(
      jnp.asarray(flush)[:, None, None, None], st.checkpoint,
      jnp.nan).astype(st.checkpoint.dtype))
  y, pend, comm = _verify_commit_policy(poisoned, win, params, n, T=T,
                                        policy=pol)
  y = np.asarray(y)
  assert np.all(np.isfinite(y)), "a non-flushing row read the master"
  # Non-flushing rows: exactly the plain verify from the copy.
  plain_copy = rs.ReplayState(
      checkpoint=prec.load(st.read_copy, st.read_scale), x_buf=st.x_buf,
      b_buf=st.b_buf, dt_buf=st.dt_buf, count=st.count)
  y_c, _, _ = _verify_commit(plain_copy, win, params, n, T=T)
  testing.assert_close(y[~flush], np.asarray(y_c)[~flush], TOL,
                       "non-flushing rows: the plain verify from the copy")
  for field in ("checkpoint", "read_copy", "read_scale"):
    np.testing.assert_array_equal(
        _np_bits(getattr(pend, field))[~flush],
        _np_bits(getattr(poisoned, field))[~flush],
        err_msg=f"{name}: a non-flushing row's {field} was written")
  # Flushing rows: the plain verify's fold and readout of the master.
  plain = rs.ReplayState(checkpoint=st.checkpoint, x_buf=st.x_buf,
                         b_buf=st.b_buf, dt_buf=st.dt_buf, count=st.count)
  y_m, pend_m, _ = _verify_commit(plain, win, params, n, T=T)
  master_tol = testing.tolerance(pol.checkpoint_dtype)
  testing.assert_close(y[flush], np.asarray(y_m)[flush], master_tol,
                       "flushing rows: the verify from the folded master")
  if not pol.stochastic_rounding:
    testing.assert_close(pend.checkpoint[flush], pend_m.checkpoint[flush],
                         master_tol, "flushed master")
  _assert_copy_restored(st, pend, pol, flush)
  np.testing.assert_array_equal(comm.count, np.where(flush, 0, counts) + n)
  if pol.stochastic_rounding:
    np.testing.assert_array_equal(pend.step, st.step)
    np.testing.assert_array_equal(comm.step, np.asarray(st.step) + n)
    np.testing.assert_array_equal(comm.row_id, st.row_id)
    rn, _ = prec.store(pend.checkpoint.astype(jnp.float32), pol.read_dtype)
    assert not np.array_equal(_np_bits(rn)[flush],
                              _np_bits(pend.read_copy)[flush])  # teeth


def test_stochastic_verify_is_bit_reproducible_across_batches():
  """A row's early-flush stores and outputs are the same bits alone and in
  a batch (keys: seed, layer, row id, step; never the batch index)."""
  L, T = 8, 4
  pol, params, st, _ = _policy_setup(L, 5, [L - 1, 2, L - 2, 6],
                                     "f16+fp8+sr")
  win = _window(9, T)
  n = np.array([2, 4, 1, 3], np.int32)
  y, pend, comm = _verify_commit_policy(st, win, params, n, T=T, policy=pol)
  for r in (0, 2):
    one = jax.tree.map(lambda a, r=r: a[r:r + 1], st)
    y1, p1, c1 = _verify_commit_policy(
        one, jax.tree.map(lambda a, r=r: a[r:r + 1], win), params,
        n[r:r + 1], T=T, policy=pol)
    np.testing.assert_array_equal(_np_bits(y1[0]), _np_bits(y[r]))
    for field in ("checkpoint", "read_copy", "read_scale"):
      np.testing.assert_array_equal(_np_bits(getattr(p1, field)[0]),
                                    _np_bits(getattr(pend, field)[r]),
                                    err_msg=f"row {r} {field}")
    np.testing.assert_array_equal(c1.step[0], comm.step[r])


def test_random_acceptance_with_a_read_copy_keeps_the_f32_master_exact():
  """f32 master + int8 copy over 12 windows of random acceptance: the
  master and buffers (materialized) equal a fresh f32 baseline run over the
  accepted tokens; accepted outputs are within the int8 copy's tolerance
  of it; the copy is the re-quantized master of every row's last flush."""
  L, T, windows = 8, 3, 12
  rng = np.random.default_rng(1)
  pol, params, st, full = _policy_setup(L, 13, [0, 3, 5, 7], "f32+int8")
  tol8 = testing.tolerance("int8")
  for w in range(windows):
    win = _window(2000 + w, T)
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    y_base, states = _baseline_window(full, win, params)
    y, _, st = _verify_commit_policy(st, win, params, n, T=T, policy=pol)
    for r in range(B):
      testing.assert_close(y[r, :n[r]], y_base[r, :n[r]], tol8,
                           f"window {w} row {r}")
    full = jnp.stack([states[k - 1, r] for r, k in enumerate(n)])
    testing.assert_close(rs.materialize(st, params["A"]), full, TOL,
                         f"state after window {w}")
    copy, scale = prec.store(st.checkpoint, "int8")
    np.testing.assert_array_equal(_np_bits(st.read_copy), _np_bits(copy))
    np.testing.assert_array_equal(_np_bits(st.read_scale), _np_bits(scale))


def test_verify_policy_errors():
  L, T = 8, 2
  pol, params, st, _ = _policy_setup(L, 3, [0, 1, 2, 3], "f32+int8")
  win = _window(4, T)
  kw = dict(**win, **params, dt_softplus=True)
  with pytest.raises(ValueError, match="rstate does not match policy "
                     "'f32\\+bf16'"):
    rs.replay_verify(st, **kw, policy=prec.PrecisionPolicy.preset("f32+bf16"))
  with pytest.raises(TypeError, match="layer must be"):
    rs.replay_verify(st, **kw, policy=pol, layer=1.5)


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
  pol, params, st, _ = _policy_setup(L, 41, counts, name)
  st = st.replace(x_buf=st.x_buf.astype(jnp.bfloat16),
                  b_buf=st.b_buf.astype(jnp.bfloat16))
  pol = pol.replace(buffer_dtype="bfloat16")
  win = _window(42, T)
  (y_k, k), (y_r, r) = _kernel_and_reference_verify(st, win, params,
                                                     policy=pol,
                                                     config=config)
  testing.assert_close(y_k, y_r, TOL, f"{name}: y")
  folds = (np.array(counts) + T >= L) & (np.array(counts) > 0)
  for field in ("checkpoint", "read_copy", "read_scale"):
    if getattr(st, field) is not None:
      np.testing.assert_array_equal(
          _np_bits(getattr(k, field))[~folds],
          _np_bits(getattr(st, field))[~folds],
          err_msg=f"{name}: a row that did not fold had its {field} written")
  testing.assert_close(k.checkpoint[folds], r.checkpoint[folds],
                       testing.tolerance(pol.checkpoint_dtype),
                       f"{name}: folded master")
  _assert_copy_restored(st, k, pol, folds)
  for field in ("count", "row_id", "step", "x_buf", "b_buf", "dt_buf"):
    a, b = getattr(k, field), getattr(r, field)
    assert (a is None) == (b is None), field
    if a is not None:
      np.testing.assert_array_equal(_np_bits(a), _np_bits(b), err_msg=field)
