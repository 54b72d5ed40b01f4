"""ReplaySSM decode of both delta-rule families (Gated DeltaNet, Kimi Delta
Attention; tests/delta_rule_families.py) == their baseline step: outputs,
materialized state and flush cadence at ragged counts, after a ragged
prefill and under every precision preset; stale and poisoned slots; the
traced-value policy. Each family's own cases: tests/test_gdn_replay.py,
tests/test_kda_replay.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import testing
from replayssm_jax.gdn import testing as GT
from tests.delta_rule_families import (B, FAMILIES, HV, K, VD,
                                       one_step_setup, run, steps_for)
from tests.harness import bits

TOL = testing.TOLERANCES["float32"]
fams = pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)


@fams
@pytest.mark.parametrize("L", [1, 2, 4, 16])
def test_replay_matches_baseline(fam, L):
  """Ragged counts, every row flushes at least twice; outputs and
  materialized states equal the baseline's at every step; the checkpoint
  is written exactly on the flush steps (c0 + t) % L == L - 1 and left
  bit-identical otherwise."""
  counts = GT.ragged_counts(B, L)
  rstate, full = fam.random_state(jax.random.PRNGKey(10 * L), L, counts)
  testing.assert_close(fam.materialize(rstate), full, TOL, "initial")
  nsteps = 2 * L + 3
  final, out = run(fam, rstate, full, steps_for(fam, 10 * L + 1, nsteps))
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
  assert final.count.dtype == jnp.int32
  assert getattr(final, fam.decays).dtype == jnp.float32


@fams
def test_stale_slots_poisoned_with_nan_change_nothing(fam):
  _, poisoned, tok = one_step_setup(fam)
  clean = fam.fill_stale_slots(poisoned, 0.0, 0.0, 0.0)
  step = jax.jit(fam.replay_step)
  o1, n1 = step(poisoned, **tok)
  o2, n2 = step(clean, **tok)
  assert np.all(np.isfinite(o1))
  np.testing.assert_array_equal(bits(o1), bits(o2))
  np.testing.assert_array_equal(bits(n1.checkpoint), bits(n2.checkpoint))
  for a, b in ((poisoned, clean), (n1, n2)):
    np.testing.assert_array_equal(bits(fam.materialize(a)),
                                  bits(fam.materialize(b)))


@pytest.mark.parametrize("fam,field", [(f, x) for f in FAMILIES
                                       for x in f.buffers],
                         ids=lambda v: getattr(v, "name", v))
def test_corrupting_live_state_changes_the_output(fam, field):
  """Teeth: the newest live slot of a mid row (or its per-row entry) moves
  its output far beyond the tolerance; the other rows stay bit-identical."""
  counts, rstate, tok = one_step_setup(fam)
  row = 2
  step = jax.jit(fam.replay_step)
  o_ref, _ = step(rstate, **tok)
  buf = getattr(rstate, field)
  per_row = field == fam.decays and fam.decays_per_row
  idx = (row,) if per_row else (row, counts[row] - 1)
  o_bad, _ = step(rstate.replace(**{field: buf.at[idx].add(0.7)}), **tok)
  assert testing.max_rel_error(o_bad[row], o_ref[row]) > 1e-3
  others = np.array([r for r in range(B) if r != row])
  np.testing.assert_array_equal(bits(o_bad[others]), bits(o_ref[others]))


@fams
def test_non_flush_rows_never_read_the_master_with_a_read_copy(fam):
  counts, rstate, tok = one_step_setup(fam)
  policy = PrecisionPolicy.preset("f32+bf16").replace(buffer_dtype="float32")
  r = rstate.with_policy(policy)  # the read copy rounded from the master
  assert r.read_copy.dtype == jnp.bfloat16
  step = jax.jit(fam.replay_step, static_argnames=("policy",))
  o_ref, new_ref = step(r, **tok, policy=policy)
  flush_row = counts.index(7)
  nan_master = r.checkpoint.at[np.array([i for i in range(B)
                                         if i != flush_row])].set(jnp.nan)
  o, new = step(r.replace(checkpoint=nan_master), **tok, policy=policy)
  np.testing.assert_array_equal(bits(o), bits(o_ref))
  np.testing.assert_array_equal(bits(new.read_copy), bits(new_ref.read_copy))


@fams
@pytest.mark.parametrize("name", ["bf16", "f16+sr", "f32+bf16", "f32+fp8",
                                  "f32+int8+sr", "f16+fp8+sr"])
def test_precision_presets_stay_within_tolerance_of_f32(fam, name):
  policy = PrecisionPolicy.preset(name)
  L, nsteps = 4, 11
  full = jax.random.normal(jax.random.PRNGKey(8), (B, HV, K, VD))
  r = fam.replay_from(full, L, policy=policy)
  assert r.checkpoint.dtype == jnp.dtype(policy.checkpoint_dtype)
  assert (r.read_copy is None) == (policy.read_dtype is None)
  assert (r.step is None) == (not policy.stochastic_rounding)
  final, out = run(fam, r, full, steps_for(fam, 9, nsteps), policy=policy)
  tol = testing.tolerance(policy.checkpoint_dtype, policy.buffer_dtype,
                          *([policy.read_dtype] if policy.read_dtype
                            else []))
  testing.assert_close(out["o_r"], out["o_b"], tol, f"{name} o")
  testing.assert_close(out["s_r"], out["s_b"], tol, f"{name} state")
  flush = (np.arange(nsteps) % L == L - 1)[:, None].repeat(B, 1)
  np.testing.assert_array_equal(out["wrote"], flush)
  if policy.read_dtype is not None:
    np.testing.assert_array_equal(out["copy_wrote"], flush)
  if policy.stochastic_rounding:
    np.testing.assert_array_equal(final.step, np.full(B, nsteps))


@fams
def test_out_of_range_count_under_jit_gives_nan_rows(fam):
  """Rows whose count lies outside [0, L) get NaN outputs and keep their
  count and checkpoint; the others step."""
  counts, rstate, tok = one_step_setup(fam)
  bad = rstate.replace(count=rstate.count.at[0].set(-1).at[3].set(8))
  o, new = jax.jit(fam.replay_step)(bad, **tok)
  assert np.all(np.isnan(o[np.array([0, 3])]))
  assert np.all(np.isfinite(o[np.array([1, 2])]))
  np.testing.assert_array_equal(new.count, [-1, 0, counts[2] + 1, 8])
  np.testing.assert_array_equal(bits(new.checkpoint[3]),
                                bits(rstate.checkpoint[3]))
  mat = jax.jit(fam.materialize)(new)
  assert np.all(np.isnan(mat[0])) and np.all(np.isfinite(mat[1]))


@fams
def test_prefill_then_replay_decode_equals_stepwise_from_the_start(fam):
  """A ragged prefill (valid mask), its final state wrapped as a replay
  state, then replay decode == the baseline step all along."""
  T, nsteps, L = 9, 6, 4
  lengths = np.array([9, 4, 1, 7])
  seq = fam.inputs(jax.random.PRNGKey(90), T)
  valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
  s0 = jax.random.normal(jax.random.PRNGKey(91), (B, HV, K, VD))
  _, final = jax.jit(fam.chunked_prefill, static_argnames="chunk_size")(
      **seq, chunk_size=4, initial_state=s0, valid=valid)
  _, snaps = jax.jit(fam.step_scan)(s0, **seq)
  base = snaps[np.arange(B), lengths - 1]
  testing.assert_close(final, base, TOL, "prefill state")
  r = fam.replay_from(final, L, buffer_dtype=jnp.float32)
  _, out = run(fam, r, base, steps_for(fam, 92, nsteps))
  testing.assert_close(out["o_r"], out["o_b"], TOL, "decode after prefill")
  leaves, tree = jax.tree.flatten(r)
  assert len(leaves) == 5
  assert jax.tree.unflatten(tree, leaves).buffer_len == L
