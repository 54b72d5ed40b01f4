"""ReplaySSM decode == baseline decode (outputs, materialized state, cadence).

Each case of `cases.REPLAY_CASES` starts from a ragged ReplayState (per-row
counts 0, L-1, L//2, ...) whose baseline-equivalent full state is known, and
runs 3L+2 decode steps with both the baseline and the replay step in one
jitted scan (`harness.run_decode`); the tests below check different aspects
of that one run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing
from tests import cases as C
from tests import harness


@pytest.fixture(scope="module", params=C.REPLAY_CASES, ids=C.case_id)
def decode_run(request):
  """(case, inputs, final ReplayState, per-step outputs) of one case."""
  case = request.param
  inputs, final, out = harness.run_decode(case)
  return case, inputs, final, out


def test_case_list_covers_required_buffer_lens():
  lens = {c.buffer_len for c in C.REPLAY_CASES}
  assert set(C.REQUIRED_BUFFER_LENS) <= lens
  for c in C.REPLAY_CASES:
    assert c.dims.ngroups < c.dims.nheads, c.id
    assert c.nsteps >= 3 * c.buffer_len, c.id
    if c.buffer_len > 2:
      assert len(set(c.counts)) > 1, f"{c.id}: counts are not ragged"


def test_f32_tolerance_is_tight():
  tol = testing.TOLERANCES["float32"]
  assert tol.rtol <= 1e-5 and tol.atol <= 1e-5
  for name, t in testing.TOLERANCES.items():
    assert t.why, f"TOLERANCES[{name!r}] has no reason"


def test_replay_outputs_match_baseline(decode_run):
  case, _, _, out = decode_run
  tol = testing.tolerance(*case.dtypes)
  assert out["y_replay"].dtype == jnp.dtype(case.input_dtype)
  for t in range(case.nsteps):
    testing.assert_close(out["y_replay"][t], out["y_base"][t], tol,
                         f"{case.id} y at step {t}")


def test_materialize_matches_baseline(decode_run):
  case, inputs, final, out = decode_run
  tol = testing.tolerance(*case.dtypes)
  testing.assert_close(rs.materialize(inputs.rstate, inputs.params["A"]),
                       inputs.full_state, tol, f"{case.id} initial state")
  for t in range(case.nsteps):
    testing.assert_close(out["state_replay"][t], out["state_base"][t], tol,
                         f"{case.id} materialized state after step {t}")
  mat = rs.materialize(final, inputs.params["A"])
  assert mat.dtype == jnp.float32
  mat16 = rs.materialize(final, inputs.params["A"], dtype=jnp.bfloat16)
  assert mat16.dtype == jnp.bfloat16


def test_checkpoint_written_once_every_buffer_len(decode_run):
  """Row r writes its checkpoint at step t iff (c0 + t) % L == L - 1, i.e.
  floor((c0 + T) / L) times in T steps; other steps leave it bit-identical."""
  case, inputs, final, out = decode_run
  L, T = case.buffer_len, case.nsteps
  c0 = np.asarray(case.counts)[None, :]
  t = np.arange(T)[:, None]
  expect_flush = (c0 + t) % L == L - 1
  np.testing.assert_array_equal(out["wrote"], expect_flush,
                                err_msg=f"{case.id}: flush pattern")
  np.testing.assert_array_equal(out["wrote"].sum(0), (c0[0] + T) // L)
  np.testing.assert_array_equal(out["count"], (c0 + t + 1) % L)
  assert final.count.dtype == jnp.int32
  assert final.checkpoint.dtype == jnp.dtype(case.checkpoint_dtype)
  assert final.x_buf.dtype == jnp.dtype(case.buffer_dtype)
  assert final.dt_buf.dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_buffer_len_1_is_the_baseline_step(dtype):
  """L = 1 flushes every step: replay == baseline with the state stored in
  the checkpoint dtype, step after step (y and the stored state)."""
  d = C.DIMS
  kp, ks, kx = jax.random.split(jax.random.PRNGKey(7), 3)
  params = harness.make_params(kp, d.nheads, with_D=True, with_dt_bias=True,
                               dt_softplus=True)
  state = jax.random.normal(ks, (d.batch, d.nheads, d.headdim, d.dstate),
                            jnp.float32).astype(dtype)
  steps = harness.time_major(testing.random_step_inputs(
      kx, d.batch, d.nheads, d.headdim, d.dstate, d.ngroups, seqlen=4))
  rstate = rs.ReplayState.from_ssm_state(state, d.ngroups, 1)
  final_base, y_base = harness.baseline_scan(state, steps, params,
                                             dt_softplus=True)
  final_rep, y_rep = harness.replay_scan(rstate, steps, params,
                                         dt_softplus=True)
  tol = testing.tolerance(dtype)
  testing.assert_close(y_rep, y_base, tol, f"L=1 {dtype} y")
  assert final_rep.checkpoint.dtype == final_base.dtype
  testing.assert_close(final_rep.checkpoint, final_base, tol,
                       f"L=1 {dtype} state")
  np.testing.assert_array_equal(final_rep.count, np.zeros(d.batch))


# --------------------------------------------------------------------- teeth
_TEETH_CASE = C.ReplayCase(8, seed=55)  # counts (0, 7, 4, 2)
_FLUSH_ROW, _MID_ROW, _EMPTY_ROW = 1, 2, 0


@jax.jit
def _one_step(rstate, tok, params):
  return rs.replay_state_update(rstate, **harness.step_kwargs(
      tok, params, True), implementation="reference")


def _teeth_setup():
  inputs = harness.decode_inputs(_TEETH_CASE)
  tok = jax.tree.map(lambda v: v[0], inputs.steps)
  assert _TEETH_CASE.counts[_FLUSH_ROW] == _TEETH_CASE.buffer_len - 1
  assert 0 < _TEETH_CASE.counts[_MID_ROW] < _TEETH_CASE.buffer_len - 1
  assert _TEETH_CASE.counts[_EMPTY_ROW] == 0
  return inputs, tok


def _corrupt(rstate, field, row, slot):
  buf = getattr(rstate, field)
  if field == "dt_buf":
    new = buf.at[row, slot].multiply(3.0)
  else:
    new = buf.at[row, slot].add(jnp.asarray(5.0, buf.dtype))
  return rstate.replace(**{field: new})


@pytest.mark.parametrize("row", [_FLUSH_ROW, _MID_ROW], ids=["flush", "mid"])
@pytest.mark.parametrize("field", ["x_buf", "b_buf", "dt_buf"])
def test_corrupting_a_valid_buffer_entry_changes_the_output(field, row):
  """Teeth: a kernel that ignored (part of) the buffer would fail the
  equivalence tests, because a valid entry moves the output far beyond the
  tolerance; other rows stay bit-identical."""
  inputs, tok = _teeth_setup()
  slot = _TEETH_CASE.counts[row] - 1  # the newest, least decayed, entry
  y_ref, new_ref = _one_step(inputs.rstate, tok, inputs.params)
  bad = _corrupt(inputs.rstate, field, row, slot)
  y_bad, new_bad = _one_step(bad, tok, inputs.params)
  err = testing.max_rel_error(y_bad[row], y_ref[row])
  assert err > 100 * testing.TOLERANCES["float32"].rtol, (
      f"corrupting {field}[{row}, {slot}] changed y by only {err:.2e}")
  others = [r for r in range(_TEETH_CASE.dims.batch) if r != row]
  np.testing.assert_array_equal(harness.bits(y_bad[others, ...]),
                                harness.bits(y_ref[others, ...]))
  if row == _FLUSH_ROW:  # the new checkpoint folds the corrupted entry in
    assert testing.max_rel_error(new_bad.checkpoint[row],
                                 new_ref.checkpoint[row]) > 1e-3
  else:  # the materialized state still sees it
    a = inputs.params["A"]
    assert testing.max_rel_error(rs.materialize(new_bad, a)[row],
                                 rs.materialize(new_ref, a)[row]) > 1e-3


@pytest.mark.parametrize("field", ["x_buf", "b_buf", "dt_buf"])
def test_stale_buffer_slots_are_never_read(field):
  """Slots >= count are stale: changing them (to NaN even) changes nothing."""
  inputs, tok = _teeth_setup()
  y_ref, new_ref = _one_step(inputs.rstate, tok, inputs.params)
  buf = getattr(inputs.rstate, field)
  stale = (np.arange(_TEETH_CASE.buffer_len)[None, :]
           >= np.asarray(_TEETH_CASE.counts)[:, None])
  mask = stale.reshape(stale.shape + (1,) * (buf.ndim - 2))
  bad = inputs.rstate.replace(**{field: jnp.where(mask, jnp.nan, buf)})
  y_bad, new_bad = _one_step(bad, tok, inputs.params)
  np.testing.assert_array_equal(harness.bits(y_bad), harness.bits(y_ref))
  np.testing.assert_array_equal(harness.bits(new_bad.checkpoint),
                                harness.bits(new_ref.checkpoint))
  a = inputs.params["A"]
  np.testing.assert_array_equal(
      harness.bits(rs.materialize(bad, a)),
      harness.bits(rs.materialize(inputs.rstate, a)))
