"""GDN ReplaySSM decode == the baseline GDN step (outputs, materialized
state, flush cadence), stale and poisoned slots, precision policies and the
traced-value policy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import reference as R
from replayssm_jax.gdn import testing as GT

TOL = testing.TOLERANCES["float32"]
B, HK, HV, K, VD = 4, 2, 4, 8, 6
TOKS = ("q", "k", "v", "g", "beta")


def bits(a):
  a = jnp.asarray(a)
  ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  return jax.lax.bitcast_convert_type(a, ut)


def rows_changed(old, new):
  diff = bits(old) != bits(new)
  return jnp.any(diff.reshape(diff.shape[0], -1), axis=1)


def steps_for(seed, nsteps, dtype=jnp.float32):
  """[T, batch, ...] token inputs."""
  inp = GT.random_inputs(jax.random.PRNGKey(seed), B, HK, HV, K, VD,
                         T=nsteps, dtype=dtype)
  return {n: jnp.swapaxes(x, 0, 1) for n, x in inp.items()}


@functools.partial(jax.jit, static_argnames=("policy",))
def run(rstate, full, steps, policy=None):
  """Baseline and replay over the same tokens in one scan."""
  def body(carry, tok):
    r, s = carry
    o_b, s = R.gdn_step(s, **tok)
    o_r, new = gdn.gdn_replay_step(r, **tok, policy=policy)
    out = dict(o_b=o_b, o_r=o_r, s_b=s, s_r=gdn.gdn_materialize(new),
               wrote=rows_changed(r.checkpoint, new.checkpoint),
               count=new.count)
    if r.read_copy is not None:
      out["copy_wrote"] = rows_changed(r.read_copy, new.read_copy)
    return (new, s), out

  (final, _), out = jax.lax.scan(body, (rstate, full), steps)
  return final, out


def ragged_run(L, seed, buffer_dtype=jnp.float32):
  counts = GT.ragged_counts(B, L)
  rstate, full = GT.random_gdn_replay_state(
      jax.random.PRNGKey(seed), B, HK, HV, K, VD, L, counts,
      buffer_dtype=buffer_dtype)
  nsteps = 2 * L + 3
  final, out = run(rstate, full, steps_for(seed + 1, nsteps))
  return counts, rstate, full, final, out


@pytest.mark.parametrize("L", [1, 2, 4, 16])
def test_replay_matches_baseline(L):
  """Every row flushes at least twice; outputs and materialized states
  equal the baseline's at every step; the checkpoint is written exactly on
  the flush steps (c0 + t) % L == L - 1 and left bit-identical otherwise."""
  counts, rstate, full, final, out = ragged_run(L, 10 * L)
  testing.assert_close(gdn.gdn_materialize(rstate), full, TOL, "initial")
  nsteps = out["o_b"].shape[0]
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
  assert final.count.dtype == jnp.int32 and final.g_buf.dtype == jnp.float32


def test_buffer_len_1_is_the_baseline_step_in_the_checkpoint_dtype():
  inp = steps_for(3, 4)
  state = jax.random.normal(jax.random.PRNGKey(4), (B, HV, K, VD))
  for dtype in ("bfloat16", "float16"):
    st = state.astype(dtype)
    r = gdn.gdn_replay_state_from(st, 1, num_k_heads=HK)
    assert r.checkpoint.dtype == jnp.dtype(dtype)
    for t in range(4):
      tok = {n: x[t] for n, x in inp.items()}
      o_b, st = gdn.gdn_step(st, **tok)
      o_r, r = gdn.gdn_replay_step(r, **tok)
      testing.assert_close(o_r, o_b, testing.tolerance(dtype), f"o {t}")
      testing.assert_close(r.checkpoint, st, testing.tolerance(dtype),
                           f"state {t}")


def test_bf16_buffer_stays_within_its_tolerance():
  _, _, _, _, out = ragged_run(4, 77, buffer_dtype=jnp.bfloat16)
  tol = testing.tolerance("bfloat16")
  testing.assert_close(out["o_r"], out["o_b"], tol, "o (bf16 rings)")
  testing.assert_close(out["s_r"], out["s_b"], tol, "state (bf16 rings)")


def _one_step_setup(L=8):
  counts = (0, L - 1, L // 2, 2)
  rstate, _ = GT.random_gdn_replay_state(jax.random.PRNGKey(5), B, HK, HV,
                                         K, VD, L, counts)
  tok = {n: x[0] for n, x in steps_for(6, 1).items()}
  return counts, rstate, tok


_step = jax.jit(gdn.gdn_replay_step, static_argnames=("policy",))


def test_stale_slots_poisoned_with_nan_change_nothing():
  counts, poisoned, tok = _one_step_setup()
  clean = GT.fill_stale_slots(poisoned, 0.0, 0.0, 0.0)
  o1, n1 = _step(poisoned, **tok)
  o2, n2 = _step(clean, **tok)
  assert np.all(np.isfinite(o1))
  np.testing.assert_array_equal(bits(o1), bits(o2))
  np.testing.assert_array_equal(bits(n1.checkpoint), bits(n2.checkpoint))
  np.testing.assert_array_equal(bits(gdn.gdn_materialize(poisoned)),
                                bits(gdn.gdn_materialize(clean)))
  np.testing.assert_array_equal(bits(gdn.gdn_materialize(n1)),
                                bits(gdn.gdn_materialize(n2)))


@pytest.mark.parametrize("field", ["d_buf", "k_buf", "g_buf"])
def test_corrupting_a_live_slot_changes_the_output(field):
  """Teeth: the newest live slot of a mid row moves its output far beyond
  the tolerance; the other rows stay bit-identical."""
  counts, rstate, tok = _one_step_setup()
  row, slot = 2, counts[2] - 1
  o_ref, _ = _step(rstate, **tok)
  buf = getattr(rstate, field)
  bad = rstate.replace(**{field: buf.at[row, slot].add(0.7)})
  o_bad, _ = _step(bad, **tok)
  assert testing.max_rel_error(o_bad[row], o_ref[row]) > 1e-3
  others = np.array([r for r in range(B) if r != row])
  np.testing.assert_array_equal(bits(o_bad[others]), bits(o_ref[others]))


def test_non_flush_rows_never_read_the_master_with_a_read_copy():
  counts, rstate, tok = _one_step_setup()
  policy = PrecisionPolicy.preset("f32+bf16").replace(buffer_dtype="float32")
  r = rstate.with_policy(policy)
  o_ref, new_ref = _step(r, **tok, policy=policy)
  flush_row = counts.index(7)
  nan_master = r.checkpoint.at[np.array([i for i in range(B)
                                         if i != flush_row])].set(jnp.nan)
  o, new = _step(r.replace(checkpoint=nan_master), **tok, policy=policy)
  np.testing.assert_array_equal(bits(o), bits(o_ref))
  np.testing.assert_array_equal(bits(new.read_copy), bits(new_ref.read_copy))


PRESETS = ["bf16", "f16+sr", "f32+bf16", "f32+fp8", "f32+int8+sr",
           "f16+fp8+sr"]


@pytest.mark.parametrize("name", PRESETS)
def test_precision_presets_stay_within_tolerance_of_f32(name):
  policy = PrecisionPolicy.preset(name)
  L, nsteps = 4, 11
  full = jax.random.normal(jax.random.PRNGKey(8), (B, HV, K, VD))
  r = gdn.gdn_replay_state_from(full, L, num_k_heads=HK, policy=policy)
  assert r.checkpoint.dtype == jnp.dtype(policy.checkpoint_dtype)
  assert (r.read_copy is None) == (policy.read_dtype is None)
  assert (r.step is None) == (not policy.stochastic_rounding)
  final, out = run(r, full, steps_for(9, nsteps), policy=policy)
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


def test_out_of_range_count_under_jit_gives_nan_rows():
  counts, rstate, tok = _one_step_setup()
  bad = rstate.replace(count=rstate.count.at[0].set(-1).at[3].set(8))
  o, new = _step(bad, **tok)
  assert np.all(np.isnan(o[np.array([0, 3])]))
  assert np.all(np.isfinite(o[np.array([1, 2])]))
  np.testing.assert_array_equal(new.count, [-1, 0, counts[2] + 1, 8])
  mat = jax.jit(gdn.gdn_materialize)(new)
  assert np.all(np.isnan(mat[0])) and np.all(np.isfinite(mat[1]))


def test_constructors():
  r = gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK,
                                key_dim=K, value_dim=VD, buffer_len=5)
  assert r.checkpoint.shape == (2, HV, K, VD) and r.buffer_len == 5
  assert r.d_buf.shape == (2, 5, HV, VD) and r.d_buf.dtype == jnp.bfloat16
  assert r.k_buf.shape == (2, 5, HK, K) and r.g_buf.dtype == jnp.float32
  p = PrecisionPolicy.preset("f32+int8+sr")
  r = gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK,
                                key_dim=K, value_dim=VD, buffer_len=5,
                                policy=p)
  assert r.read_copy.dtype == jnp.int8 and r.read_scale.shape == (2, HV, K)
  np.testing.assert_array_equal(r.row_id, [0, 1])
  full = jax.random.normal(jax.random.PRNGKey(0), (2, HV, K, VD))
  r = gdn.gdn_replay_state_from(full, 3, num_k_heads=HK)
  assert r.checkpoint is not full
  np.testing.assert_array_equal(gdn.gdn_materialize(r), full)
  leaves, tree = jax.tree.flatten(r)
  assert len(leaves) == 5
  assert jax.tree.unflatten(tree, leaves).buffer_len == 3


def test_bad_states_and_inputs_are_refused():
  _, rstate, tok = _one_step_setup()
  bad = [
      ("rstate.k_buf", rstate.replace(k_buf=rstate.k_buf[:, :, :, :-1])),
      ("rstate.k_buf", rstate.replace(k_buf=jnp.concatenate(
          [rstate.k_buf, rstate.k_buf[:, :, :1]], axis=2))),
      ("rstate.d_buf", rstate.replace(d_buf=rstate.d_buf[..., :-1])),
      ("rstate.g_buf", rstate.replace(g_buf=rstate.g_buf[..., :-1])),
      ("rstate.count", rstate.replace(count=rstate.count.at[1].set(8))),
      ("rstate.count", rstate.replace(count=rstate.count[:-1])),
  ]
  for name, st in bad:
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
      gdn.gdn_replay_step(st, **tok)
  with pytest.raises(TypeError, match="g_buf"):
    gdn.gdn_replay_step(rstate.replace(
        g_buf=rstate.g_buf.astype(jnp.bfloat16)), **tok)
  with pytest.raises(TypeError, match="k_buf"):
    gdn.gdn_replay_step(rstate.replace(
        k_buf=rstate.k_buf.astype(jnp.bfloat16)), **tok)
  with pytest.raises(ValueError, match="q"):
    gdn.gdn_replay_step(rstate, **{**tok, "q": tok["q"][:, :1]})
  with pytest.raises(ValueError, match="v"):
    gdn.gdn_replay_step(rstate, **{**tok, "v": tok["v"][..., :-1]})
  with pytest.raises(ValueError, match="policy"):
    gdn.gdn_replay_step(rstate, **tok,
                        policy=PrecisionPolicy.preset("f32+bf16"))
  with pytest.raises(ValueError, match="pending"):
    gdn.gdn_replay_step(rstate.replace(pending_window=2), **tok)
  with pytest.raises(ValueError, match="pending_window"):
    rstate.replace(pending_window=0)
  with pytest.raises(TypeError, match="GDNReplayState"):
    gdn.gdn_replay_step(rstate.checkpoint, **tok)
  with pytest.raises(ValueError, match="num_k_heads"):
    gdn.gdn_replay_state_from(rstate.checkpoint, 4, num_k_heads=3)
  with pytest.raises(ValueError, match="buffer_len"):
    gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK, key_dim=K,
                              value_dim=VD, buffer_len=0)


def test_prefill_then_replay_decode_equals_stepwise_from_the_start():
  """A ragged prefill (valid mask), its final state wrapped by
  gdn_replay_state_from, then replay decode == gdn_step all along."""
  T, nsteps, L = 9, 6, 4
  lengths = np.array([9, 4, 1, 7])
  seq = GT.random_inputs(jax.random.PRNGKey(90), B, HK, HV, K, VD, T=T)
  valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
  s0 = jax.random.normal(jax.random.PRNGKey(91), (B, HV, K, VD))
  _, final = jax.jit(gdn.gdn_chunked_prefill, static_argnames="chunk_size")(
      **seq, chunk_size=4, initial_state=s0, valid=valid)
  _, snaps = jax.jit(R.gdn_step_scan)(s0, **seq)
  base = snaps[np.arange(B), lengths - 1]
  testing.assert_close(final, base, TOL, "prefill state")
  r = gdn.gdn_replay_state_from(final, L, num_k_heads=HK,
                                buffer_dtype=jnp.float32)
  _, out = run(r, base, steps_for(92, nsteps))
  testing.assert_close(out["o_r"], out["o_b"], TOL, "decode after prefill")
