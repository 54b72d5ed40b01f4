"""KDA ReplaySSM decode (pre-decayed keys) == the baseline KDA step
(outputs, materialized state, flush cadence), the gate bound, early flushes
on out-of-bound gates, stale and poisoned slots, precision policies and the
traced-value policy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import kda
from replayssm_jax import testing
from replayssm_jax.kda import reference as R
from replayssm_jax.kda import testing as KT

TOL = testing.TOLERANCES["float32"]
B, HK, HV, K, VD = 4, 2, 4, 8, 6


def bits(a):
  a = jnp.asarray(a)
  ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  return jax.lax.bitcast_convert_type(a, ut)


def rows_changed(old, new):
  diff = bits(old) != bits(new)
  return jnp.any(diff.reshape(diff.shape[0], -1), axis=1)


def steps_for(seed, nsteps, lower_bound=-3.0):
  """[T, batch, ...] token inputs (safe gates in [lower_bound, 0] unless
  lower_bound is None: Kimi Linear's unbounded gate)."""
  inp = KT.random_inputs(jax.random.PRNGKey(seed), B, HK, HV, K, VD,
                         T=nsteps, lower_bound=lower_bound)
  return {n: jnp.swapaxes(x, 0, 1) for n, x in inp.items()}


@functools.partial(jax.jit, static_argnames=("policy",))
def run(rstate, full, steps, policy=None):
  """Baseline and replay over the same tokens in one scan."""
  def body(carry, tok):
    r, s = carry
    o_b, s = R.kda_step(s, **tok)
    o_r, new = kda.kda_replay_step(r, **tok, policy=policy)
    out = dict(o_b=o_b, o_r=o_r, s_b=s, s_r=kda.kda_materialize(new),
               wrote=rows_changed(r.checkpoint, new.checkpoint),
               count=new.count, kmax=jnp.max(jnp.abs(new.k_buf.astype(
                   jnp.float32)), axis=(1, 2, 3)))
    if r.read_copy is not None:
      out["copy_wrote"] = rows_changed(r.read_copy, new.read_copy)
    return (new, s), out

  (final, _), out = jax.lax.scan(body, (rstate, full), steps)
  return final, out


def ragged_counts(L):
  base = [0, L - 1, L // 2, (3 * L) // 4]
  return tuple(int(c) for c in base)


@pytest.mark.parametrize("L", [1, 2, 4, 16])
def test_replay_matches_baseline(L):
  """Ragged counts, every row flushes at least twice; outputs and
  materialized states equal the baseline's at every step; the checkpoint
  is written exactly on the steps (c0 + t) % L == L - 1."""
  counts = ragged_counts(L)
  rstate, full = KT.random_kda_replay_state(jax.random.PRNGKey(10 * L), B,
                                            HV, K, VD, L, counts)
  testing.assert_close(kda.kda_materialize(rstate), full, TOL, "initial")
  nsteps = 2 * L + 3
  final, out = run(rstate, full, steps_for(10 * L + 1, nsteps))
  for t in range(nsteps):
    testing.assert_close(out["o_r"][t], out["o_b"][t], TOL, f"o step {t}")
    testing.assert_close(out["s_r"][t], out["s_b"][t], TOL,
                         f"state after step {t}")
  c0 = np.asarray(counts)[None, :]
  t = np.arange(nsteps)[:, None]
  flush = (c0 + t) % L == L - 1
  np.testing.assert_array_equal(out["wrote"], flush)
  assert flush.sum(0).min() >= 2
  np.testing.assert_array_equal(out["count"], (c0 + t + 1) % L)
  assert final.g_sum.dtype == jnp.float32 and final.count.dtype == jnp.int32


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
  steps = steps_for(4, 2 * L)
  steps["g"] = jnp.full_like(steps["g"], lb)
  _, out = run(r, full, steps)
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
  steps = steps_for(6, 2 * L + 1)
  steps["g"] = jnp.maximum(steps["g"] * 4.0, r.gate_lower_bound)
  _, out = run(r, full, steps)
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
  steps = steps_for(8, nsteps, lower_bound=None)
  g = jnp.maximum(steps["g"], -1.5)
  g = g.at[3, 1, 2, 5].set(-300.0).at[5, 2, 0, 0].set(-2.5)
  _, out = run(r, full, dict(steps, g=g))
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
        x[0, :2] for x in steps_for(1, 1).values()))
  with pytest.raises(ValueError, match="gate_lower_bound is required"):
    kda.KDAReplayState(checkpoint=r.checkpoint, d_buf=r.d_buf,
                       k_buf=r.k_buf, g_sum=r.g_sum, count=r.count)


def _one_step_setup(L=8):
  counts = (0, L - 1, L // 2, 2)
  rstate, _ = KT.random_kda_replay_state(jax.random.PRNGKey(5), B, HV, K,
                                         VD, L, counts)
  tok = {n: x[0] for n, x in steps_for(6, 1).items()}
  return counts, rstate, tok


_step = jax.jit(kda.kda_replay_step, static_argnames=("policy",))


def test_stale_slots_poisoned_with_nan_change_nothing():
  _, poisoned, tok = _one_step_setup()
  clean = KT.fill_stale_slots(poisoned, 0.0, 0.0, 0.0)
  o1, n1 = _step(poisoned, **tok)
  o2, n2 = _step(clean, **tok)
  assert np.all(np.isfinite(o1))
  np.testing.assert_array_equal(bits(o1), bits(o2))
  np.testing.assert_array_equal(bits(n1.checkpoint), bits(n2.checkpoint))
  np.testing.assert_array_equal(bits(kda.kda_materialize(poisoned)),
                                bits(kda.kda_materialize(clean)))
  np.testing.assert_array_equal(bits(kda.kda_materialize(n1)),
                                bits(kda.kda_materialize(n2)))


@pytest.mark.parametrize("field", ["d_buf", "k_buf", "g_sum"])
def test_corrupting_live_state_changes_the_output(field):
  counts, rstate, tok = _one_step_setup()
  row = 2
  o_ref, _ = _step(rstate, **tok)
  buf = getattr(rstate, field)
  idx = (row,) if field == "g_sum" else (row, counts[row] - 1)
  bad = rstate.replace(**{field: buf.at[idx].add(0.7)})
  o_bad, _ = _step(bad, **tok)
  assert testing.max_rel_error(o_bad[row], o_ref[row]) > 1e-3
  others = np.array([r for r in range(B) if r != row])
  np.testing.assert_array_equal(bits(o_bad[others]), bits(o_ref[others]))


def test_non_flush_rows_never_read_the_master_with_a_read_copy():
  counts, rstate, tok = _one_step_setup()
  policy = PrecisionPolicy.preset("f32+bf16").replace(buffer_dtype="float32")
  r = rstate.with_policy(policy)  # the read copy rounded from the master
  assert r.read_copy.dtype == jnp.bfloat16
  o_ref, new_ref = _step(r, **tok, policy=policy)
  flush_row = counts.index(7)
  nan_master = r.checkpoint.at[np.array([i for i in range(B)
                                         if i != flush_row])].set(jnp.nan)
  o, new = _step(r.replace(checkpoint=nan_master), **tok, policy=policy)
  np.testing.assert_array_equal(bits(o), bits(o_ref))
  np.testing.assert_array_equal(bits(new.read_copy), bits(new_ref.read_copy))


@pytest.mark.parametrize("name", ["bf16", "f16+sr", "f32+fp8", "f32+int8+sr"])
def test_precision_presets_stay_within_tolerance_of_f32(name):
  policy = PrecisionPolicy.preset(name)
  L, nsteps = 4, 9
  full = jax.random.normal(jax.random.PRNGKey(8), (B, HV, K, VD))
  r = kda.kda_replay_state_from(full, L, policy=policy)
  assert r.checkpoint.dtype == jnp.dtype(policy.checkpoint_dtype)
  final, out = run(r, full, steps_for(9, nsteps), policy=policy)
  tol = testing.tolerance(policy.checkpoint_dtype, policy.buffer_dtype,
                          *([policy.read_dtype] if policy.read_dtype
                            else []))
  testing.assert_close(out["o_r"], out["o_b"], tol, f"{name} o")
  testing.assert_close(out["s_r"], out["s_b"], tol, f"{name} state")
  flush = (np.arange(nsteps) % L == L - 1)[:, None].repeat(B, 1)
  np.testing.assert_array_equal(out["wrote"], flush)
  if policy.stochastic_rounding:
    np.testing.assert_array_equal(final.step, np.full(B, nsteps))


def test_out_of_range_count_under_jit_gives_nan_rows():
  counts, rstate, tok = _one_step_setup()
  bad = rstate.replace(count=rstate.count.at[0].set(-1).at[3].set(8))
  o, new = _step(bad, **tok)
  assert np.all(np.isnan(o[np.array([0, 3])]))
  assert np.all(np.isfinite(o[np.array([1, 2])]))
  np.testing.assert_array_equal(new.count, [-1, 0, counts[2] + 1, 8])
  np.testing.assert_array_equal(bits(new.checkpoint[3]),
                                bits(rstate.checkpoint[3]))
  mat = jax.jit(kda.kda_materialize)(new)
  assert np.all(np.isnan(mat[0])) and np.all(np.isfinite(mat[1]))


def test_bad_states_and_inputs_are_refused():
  _, rstate, tok = _one_step_setup()
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


def test_prefill_then_replay_decode_equals_stepwise_from_the_start():
  T, nsteps, L = 9, 6, 4
  lengths = np.array([9, 4, 1, 7])
  seq = KT.random_inputs(jax.random.PRNGKey(90), B, HK, HV, K, VD, T=T,
                         lower_bound=-3.0)
  valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
  s0 = jax.random.normal(jax.random.PRNGKey(91), (B, HV, K, VD))
  _, final = jax.jit(kda.kda_chunked_prefill, static_argnames="chunk_size")(
      **seq, chunk_size=4, initial_state=s0, valid=valid)
  _, snaps = jax.jit(R.kda_step_scan)(s0, **seq)
  base = snaps[np.arange(B), lengths - 1]
  testing.assert_close(final, base, TOL, "prefill state")
  r = kda.kda_replay_state_from(final, L, buffer_dtype=jnp.float32)
  _, out = run(r, base, steps_for(92, nsteps))
  testing.assert_close(out["o_r"], out["o_b"], TOL, "decode after prefill")
  leaves, tree = jax.tree.flatten(r)
  assert len(leaves) == 5
  assert jax.tree.unflatten(tree, leaves).gate_lower_bound == r.gate_lower_bound
