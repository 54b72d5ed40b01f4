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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing
from tests import harness
from tests.speculative_common import (B, G, H, N, P, TOL, baseline_window,
                                      random_window, replay_setup,
                                      verify_commit)


@pytest.mark.parametrize("L,T", [(2, 1), (5, 2), (8, 4), (16, 4), (9, 8)])
def test_verify_matches_baseline_and_commit_rolls_back(L, T):
  counts = [0, L - 1, L - T, (L - T) // 2]
  params, rstate, full = replay_setup(L, 10 * L + T, counts)
  win = random_window(L + 100 * T, T)
  y_base, states = baseline_window(full, win, params)
  n = np.array([1, T, max(1, T // 2), max(1, T - 1)], np.int32)
  y, pending, committed = verify_commit(rstate, win, params, n, T=T)
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
  params, rstate, full = replay_setup(L, 7, [0, 3, 5, 7])
  writes = np.zeros(B, int)
  count = np.asarray(rstate.count).copy()
  for w in range(windows):
    win = random_window(1000 + w, T)
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    if w % 6 == 0:
      n[:] = 1  # every draft rejected
    if w % 6 == 3:
      n[:] = T  # every draft accepted
    y_base, states = baseline_window(full, win, params)
    y, pending, committed = verify_commit(rstate, win, params, n, T=T)
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
  params, rstate, _ = replay_setup(L, 3, [0, 2, 5, 7])
  traces = []

  @jax.jit
  def spec_step(r, win, n):
    traces.append(1)
    _, pending = rs.replay_verify(r, **win, **params, dt_softplus=True)
    return rs.replay_commit(pending, n, T)

  rng = np.random.default_rng(1)
  for w in range(6):
    rstate = spec_step(rstate, random_window(w, T),
                       jnp.asarray(rng.integers(1, T + 1, B), jnp.int32))
  assert len(traces) == 1
  assert np.all((np.asarray(rstate.count) >= 0)
                & (np.asarray(rstate.count) < L))


def test_capacity_and_bad_inputs():
  params, rstate, _ = replay_setup(4, 1, [0, 1, 2, 3])
  with pytest.raises(ValueError, match=r"buffer_len \(4\) must exceed the "
                     r"window length T \(4\)"):
    rs.replay_verify(rstate, **random_window(0, 4), **params)
  win = random_window(0, 2)
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
  params, rstate, full = replay_setup(L, 21, [0, 2, 5, 7])
  win = random_window(77, T)
  n = np.array([1, 4, 2, 3], np.int32)
  y_r, _, committed = verify_commit(rstate, win, params, n, T=T)
  y_b, snaps = rs.baseline_verify(full, **win, **params, dt_softplus=True)
  assert snaps.shape == (B, T, H, P, N)
  testing.assert_close(y_r, y_b, TOL, "verify outputs")
  testing.assert_close(rs.materialize(committed, params["A"]),
                       rs.baseline_commit(snaps, jnp.asarray(n)), TOL,
                       "committed state")
  with pytest.raises(ValueError, match=r"num_accepted must lie in \[1, T\]"):
    rs.baseline_commit(snaps, jnp.asarray([0, 1, 1, 1], jnp.int32))
