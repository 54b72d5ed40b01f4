"""KDA ReplaySSM speculative verify / commit == stepping `kda_replay_step`
over the window: outputs, the committed state for every accepted count
(counter moves and refolds of tokens whose gates left the bound), early
flushes, poisoned stale slots and drafts, precision policies, the traced-
value policy and argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import kda
from replayssm_jax import testing
from replayssm_jax.kda import testing as KT

TOL = testing.TOLERANCES["float32"]
B, HK, HV, K, VD, L, T = 6, 2, 4, 8, 6, 8, 4
# Row counts: empty, mid-ring, and c + T >= L (the window flushes early).
COUNTS = (0, 1, 3, 4, 5, 7)
LB = -1.0  # a tight gate bound, so that test gates can leave it


def setup(seed=0, buffer_dtype=jnp.float32, policy=None):
  """A ragged state (stale slots poisoned) and a window whose gates stay
  within LB except in rows 1 (position 2) and 4 (position 0)."""
  rstate, full = KT.random_kda_replay_state(
      jax.random.PRNGKey(seed), B, HV, K, VD, L, COUNTS,
      gate_lower_bound=LB, buffer_dtype=buffer_dtype)
  if policy is not None:
    rstate = kda.kda_replay_state_from(full, L, gate_lower_bound=LB,
                                       policy=policy)
  win = KT.random_inputs(jax.random.PRNGKey(seed + 1), B, HK, HV, K, VD, T=T,
                         lower_bound=LB)
  win["g"] = win["g"].at[1, 2, 0, 3].set(-5.0).at[4, 0, 1, 1].set(-3.0)
  return rstate, win


def stepwise(rstate, win, policy=None):
  """kda_replay_step over the window: (outputs [b, T, ...], the state
  after each position)."""
  outs, states = [], []
  for s in range(T):
    o, rstate = kda.kda_replay_step(
        rstate, *(win[n][:, s] for n in ("q", "k", "v", "g", "beta")),
        policy=policy)
    outs.append(o)
    states.append(rstate)
  return jnp.stack(outs, 1), states


def verify(rstate, win, **kw):
  return kda.kda_replay_verify(rstate, win["q"], win["k"], win["v"],
                               win["g"], win["beta"], **kw)


@pytest.mark.parametrize("buffer_dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32_ring", "bf16_ring"])
def test_verify_and_commit_equal_decode_steps(buffer_dtype):
  """Outputs == the decode steps'; commit of every n == n decode steps
  (materialized state, the next step's output); rows whose accepted tokens
  kept their gates within the bound commit by a counter move (count and
  g_sum as the steps leave them), the others (rows 1, 4) by a refold."""
  tol = testing.tolerance(buffer_dtype)
  rstate, win = setup(buffer_dtype=buffer_dtype)
  want_o, states = stepwise(rstate, win)
  o, pending, window = verify(rstate, win)
  testing.assert_close(o, want_o, tol, "outputs")
  np.testing.assert_array_equal(window.stored, [4, 2, 4, 4, 0, 4])
  np.testing.assert_array_equal(pending.count, [0, 1, 3, 0, 0, 0])
  nxt = KT.random_inputs(jax.random.PRNGKey(9), B, HK, HV, K, VD,
                         lower_bound=LB)
  for n in range(1, T + 1):
    got = kda.kda_replay_commit(pending, window, jnp.full((B,), n))
    want = states[n - 1]
    testing.assert_close(kda.kda_materialize(got),
                         kda.kda_materialize(want), tol, f"state, n {n}")
    moved = np.asarray(window.stored) >= n
    np.testing.assert_array_equal(
        np.asarray(got.count),
        np.where(moved, np.asarray(pending.count) + n, 0))
    same = np.asarray(got.count) == np.asarray(want.count)
    np.testing.assert_array_equal(np.asarray(got.g_sum)[same],
                                  np.asarray(want.g_sum)[same])
    o_got, _ = kda.kda_replay_step(got, **nxt)
    o_want, _ = kda.kda_replay_step(want, **nxt)
    testing.assert_close(o_got, o_want, tol, f"next output, n {n}")


def test_ragged_acceptance_per_row():
  rstate, win = setup(seed=3)
  _, states = stepwise(rstate, win)
  _, pending, window = verify(rstate, win)
  n = jnp.asarray([1, 4, 2, 3, 1, 4])
  got = kda.kda_replay_commit(pending, window, n)
  want = np.stack([np.asarray(kda.kda_materialize(states[int(m) - 1]))[r]
                   for r, m in enumerate(n)])
  testing.assert_close(kda.kda_materialize(got), want, TOL, "state")


def test_poisoned_stale_slots_and_later_drafts_change_nothing_before():
  """Stale ring slots hold NaN / inf (setup); a draft holding NaN at
  position 2 leaves positions 0-1 and a commit of 1-2 tokens unchanged."""
  rstate, win = setup(seed=5)
  o, pending, window = verify(rstate, win)
  bad = dict(win, v=win["v"].at[:, 2].set(jnp.nan),
             k=win["k"].at[:, 2].set(jnp.inf))
  o_bad, pending_bad, window_bad = verify(rstate, bad)
  np.testing.assert_array_equal(o_bad[:, :2], o[:, :2])
  assert np.all(np.isnan(np.asarray(o_bad[:, 2:])))
  for n in (1, 2):
    a = kda.kda_replay_commit(pending, window, jnp.full((B,), n))
    b = kda.kda_replay_commit(pending_bad, window_bad, jnp.full((B,), n))
    np.testing.assert_array_equal(kda.kda_materialize(a),
                                  kda.kda_materialize(b))


@pytest.mark.parametrize("name", ["f32+bf16", "f16+sr"])
def test_precision_policies_stay_within_tolerance_of_the_steps(name):
  """A read copy (early-flushing rows read the stored master) and
  stochastic rounding (a refold stores as a flush does, keyed at the last
  accepted token's step)."""
  policy = PrecisionPolicy.preset(name)
  rstate, win = setup(seed=7, policy=policy)
  tol = testing.tolerance(policy.checkpoint_dtype, policy.buffer_dtype,
                          *([policy.read_dtype] if policy.read_dtype
                            else []))
  want_o, states = stepwise(rstate, win, policy)
  o, pending, window = verify(rstate, win, policy=policy)
  testing.assert_close(o, want_o, tol, f"{name} outputs")
  for n in (1, T):
    got = kda.kda_replay_commit(pending, window, jnp.full((B,), n),
                                policy=policy)
    testing.assert_close(kda.kda_materialize(got),
                         kda.kda_materialize(states[n - 1]), tol,
                         f"{name} state, n {n}")
    if policy.stochastic_rounding:
      np.testing.assert_array_equal(got.step, states[n - 1].step)
    if got.read_copy is not None:
      refold = np.asarray(got.count) == 0
      testing.assert_close(got.read_copy[refold],
                           got.checkpoint[refold], tol, "read copy")


def test_out_of_range_counts_and_acceptances_under_jit():
  rstate, win = setup(seed=11)
  bad = rstate.replace(count=rstate.count.at[0].set(-1).at[2].set(L))
  o, pending, window = jax.jit(verify)(bad, win)
  assert np.all(np.isnan(np.asarray(o[np.array([0, 2])])))
  assert np.all(np.isfinite(np.asarray(o[np.array([1, 3, 4, 5])])))
  np.testing.assert_array_equal(pending.count[np.array([0, 2])], [-1, L])
  _, pending, window = verify(rstate, win)
  got = jax.jit(kda.kda_replay_commit)(pending, window,
                                       jnp.asarray([0, 1, T + 1, 2, 1, 1]))
  np.testing.assert_array_equal(np.asarray(got.count)[np.array([0, 2])],
                                [-1, -1])
  with pytest.raises(ValueError, match="num_accepted"):
    kda.kda_replay_commit(pending, window, jnp.asarray([0, 1, 1, 1, 1, 1]))


def test_bad_arguments_are_refused_by_name():
  rstate, win = setup()
  short = KT.random_kda_replay_state(jax.random.PRNGKey(0), B, HV, K, VD, T,
                                     (0,) * B, gate_lower_bound=LB)[0]
  with pytest.raises(ValueError, match=r"buffer_len \(4\) must exceed"):
    verify(short, win)
  with pytest.raises(ValueError, match="g must have shape"):
    verify(rstate, dict(win, g=win["g"][..., 0]))
  _, pending, window = verify(rstate, win)
  with pytest.raises(TypeError, match="window must be the KDAWindow"):
    kda.kda_replay_commit(pending, win, jnp.ones((B,), jnp.int32))
  other = jax.tree.map(lambda x: x[:2], window)
  with pytest.raises(ValueError, match="does not belong to rstate"):
    kda.kda_replay_commit(pending, other, jnp.ones((B,), jnp.int32))
