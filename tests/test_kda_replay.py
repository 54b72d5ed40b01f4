"""KDA ReplaySSM decode, the cases of its own (the replay tests both
delta-rule families share: tests/test_delta_rule_replay.py): keys
pre-decayed to the gate bound stay exact, bf16 rings at the bound, early
flushes on out-of-bound gates, the bound checked against buffer_len, and
the refused states and inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import kda
from replayssm_jax import testing
from tests.delta_rule_families import (B, HV, KDA, K, VD, one_step_setup,
                                       run, steps_for)

TOL = testing.TOLERANCES["float32"]


def test_keys_decayed_to_the_bound_stay_exact():
  """Every channel at the loosest bound for L = 16 (g = -80/15 each
  token): the stored keys reach exp(80) |k| ~ 1e34, outputs and states
  still match the baseline and the cadence is every L steps."""
  L = 16
  lb = kda.safe_gate_lower_bound(L)
  assert lb == pytest.approx(-80 / 15)
  full = jax.random.normal(jax.random.PRNGKey(3), (B, HV, K, VD))
  r = kda.kda_replay_state_from(full, L, buffer_dtype=jnp.float32)
  assert r.gate_lower_bound == lb
  steps = steps_for(KDA, 4, 2 * L)
  steps["g"] = jnp.full_like(steps["g"], lb)
  _, out = run(KDA, r, full, steps)
  assert float(jnp.max(out["kmax"])) > 1e33
  assert np.all(np.isfinite(out["o_r"]))
  testing.assert_close(out["o_r"], out["o_b"], TOL, "o at the bound")
  testing.assert_close(out["s_r"], out["s_b"], TOL, "state at the bound")
  flush = (np.arange(2 * L) % L == L - 1)[:, None].repeat(B, 1)
  np.testing.assert_array_equal(out["wrote"], flush)


def test_bf16_ring_at_the_bound_stays_within_its_tolerance():
  L = 8
  full = jax.random.normal(jax.random.PRNGKey(5), (B, HV, K, VD))
  r = kda.kda_replay_state_from(full, L)
  assert r.k_buf.dtype == jnp.bfloat16
  steps = steps_for(KDA, 6, 2 * L + 1)
  steps["g"] = jnp.maximum(steps["g"] * 4.0, r.gate_lower_bound)
  _, out = run(KDA, r, full, steps)
  tol = testing.tolerance("bfloat16")
  testing.assert_close(out["o_r"], out["o_b"], tol, "o (bf16 rings)")
  testing.assert_close(out["s_r"], out["s_b"], tol, "state (bf16 rings)")


def test_unbounded_gates_flush_early_and_stay_exact():
  """Kimi Linear's gate has no lower bound: a token with a channel below
  the state's bound flushes its row (exact), the others keep the
  L-cadence."""
  L, nsteps = 8, 12
  full = jax.random.normal(jax.random.PRNGKey(7), (B, HV, K, VD))
  r = kda.kda_replay_state_from(full, L, gate_lower_bound=-2.0,
                                buffer_dtype=jnp.float32)
  steps = steps_for(KDA, 8, nsteps, lower_bound=None)
  g = jnp.maximum(steps["g"], -1.5)
  g = g.at[3, 1, 2, 5].set(-300.0).at[5, 2, 0, 0].set(-2.5)
  _, out = run(KDA, r, full, dict(steps, g=g))
  assert np.all(np.isfinite(out["o_r"]))
  testing.assert_close(out["o_r"], out["o_b"], TOL, "o")
  testing.assert_close(out["s_r"], out["s_b"], TOL, "state")
  wrote = np.zeros((nsteps, B), bool)
  wrote[L - 1, [0, 3]] = True  # the L-cadence
  wrote[[3, 3 + L], 1] = True  # early at step 3 (g = -300), then L later
  wrote[5, 2] = True  # early at step 5 (g = -2.5 < -2)
  np.testing.assert_array_equal(out["wrote"], wrote)
  np.testing.assert_array_equal(out["count"][-1], [4, 0, 6, 4])


def test_gate_bound_is_checked_against_buffer_len():
  with pytest.raises(ValueError, match=r"buffer_len \(17\).*gate_lower_bound"):
    kda.init_kda_replay_state(2, num_v_heads=HV, key_dim=K, value_dim=VD,
                              buffer_len=17, gate_lower_bound=-5.5)
  r = kda.init_kda_replay_state(2, num_v_heads=HV, key_dim=K, value_dim=VD,
                                buffer_len=17, gate_lower_bound=-5.0)
  assert r.gate_lower_bound == -5.0
  full = jnp.ones((2, HV, K, VD))
  # A float16 ring holds at most exp(11): its bound is 10.
  with pytest.raises(ValueError, match=r"buffer_len \(16\).*float16"):
    kda.kda_replay_state_from(full, 16, gate_lower_bound=-1.0,
                              buffer_dtype=jnp.float16)
  r = kda.kda_replay_state_from(full, 16, buffer_dtype=jnp.float16)
  assert r.gate_lower_bound == pytest.approx(-10 / 15)
  assert kda.kda_replay_state_from(full, 1).gate_lower_bound == -np.inf
  for bad in (0.0, 1.0, float("nan"), True, "x"):
    with pytest.raises(ValueError, match="gate_lower_bound"):
      kda.kda_replay_state_from(full, 4, gate_lower_bound=bad)
  with pytest.raises(ValueError, match="gate_lower_bound"):
    kda.kda_replay_state_from(full, 4, gate_lower_bound=-np.inf)
  with pytest.raises(ValueError, match="gate_lower_bound"):
    kda.kda_replay_step(r.replace(gate_lower_bound=-3.0), *(
        x[0, :2] for x in steps_for(KDA, 1, 1).values()))
  with pytest.raises(ValueError, match="gate_lower_bound is required"):
    kda.KDAReplayState(checkpoint=r.checkpoint, d_buf=r.d_buf,
                       k_buf=r.k_buf, g_sum=r.g_sum, count=r.count)
  # The bound is static: a flatten / unflatten round trip keeps it.
  leaves, tree = jax.tree.flatten(r)
  assert jax.tree.unflatten(tree, leaves).gate_lower_bound == (
      r.gate_lower_bound)


def test_bad_states_and_inputs_are_refused():
  _, rstate, tok = one_step_setup(KDA)
  bad = [
      ("rstate.k_buf", rstate.replace(k_buf=rstate.k_buf[:, :, :, :-1])),
      ("rstate.k_buf", rstate.replace(k_buf=rstate.k_buf[:, :, :1])),
      ("rstate.d_buf", rstate.replace(d_buf=rstate.d_buf[..., :-1])),
      ("rstate.g_sum", rstate.replace(g_sum=rstate.g_sum[..., :-1])),
      ("rstate.count", rstate.replace(count=rstate.count.at[1].set(8))),
  ]
  for name, st in bad:
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
      kda.kda_replay_step(st, **tok)
  with pytest.raises(TypeError, match="g_sum"):
    kda.kda_replay_step(rstate.replace(
        g_sum=rstate.g_sum.astype(jnp.bfloat16)), **tok)
  with pytest.raises(ValueError, match="g"):
    kda.kda_replay_step(rstate, **{**tok, "g": tok["g"][..., 0]})
  with pytest.raises(ValueError, match="policy"):
    kda.kda_replay_step(rstate, **tok,
                        policy=PrecisionPolicy.preset("f32+bf16"))
  with pytest.raises(TypeError, match="KDAReplayState"):
    kda.kda_replay_step(rstate.checkpoint, **tok)
