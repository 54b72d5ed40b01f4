"""GDN speculative verify: window outputs == stepwise baseline steps, commit
by counter == a fresh run on the accepted prefix, rejected drafts never
reach later outputs, and verify -> commit -> step sequences == baseline."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import testing as GT

TOL = testing.TOLERANCES["float32"]
B, HK, HV, K, VD, L = 5, 2, 4, 8, 6, 8
COUNTS = (0, 7, 4, 2, 5)  # T = 3: rows 1 and 4 flush early, row 0 has none


def bits(a):
  a = jnp.asarray(a)
  ut = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  return jax.lax.bitcast_convert_type(a, ut)


def setup(seed, buffer_dtype=jnp.float32, counts=COUNTS):
  return GT.random_gdn_replay_state(jax.random.PRNGKey(seed), B, HK, HV, K,
                                    VD, L, counts, buffer_dtype=buffer_dtype)


def window(seed, T):
  return GT.random_inputs(jax.random.PRNGKey(seed), B, HK, HV, K, VD, T=T)


_verify = jax.jit(gdn.gdn_replay_verify, static_argnames=("policy",))
_step = jax.jit(gdn.gdn_replay_step, static_argnames=("policy",))
_base_verify = jax.jit(gdn.gdn_baseline_verify)
_materialize = jax.jit(gdn.gdn_materialize)


@pytest.mark.parametrize("T", [1, 3, 5])
def test_verify_outputs_match_stepwise_baseline(T):
  rstate, full = setup(T)
  win = window(100 + T, T)
  o, pending = _verify(rstate, **win)
  o_b, snaps = _base_verify(full, **win)
  s = full
  for t in range(T):  # the baseline verify is T plain steps
    o_t, s = gdn.gdn_step(s, **{n: x[:, t] for n, x in win.items()})
    testing.assert_close(o_b[:, t], o_t, TOL, f"baseline verify o {t}")
    testing.assert_close(snaps[:, t], s, TOL, f"snapshot {t}")
  testing.assert_close(o, o_b, TOL, f"T={T} replay verify o")
  flushed = np.asarray(COUNTS) + T >= L
  np.testing.assert_array_equal(pending.count,
                                np.where(flushed, 0, COUNTS))
  assert pending.pending_window == T
  # Only rows with a history to fold write their checkpoint.
  wrote = np.any(np.asarray(bits(pending.checkpoint)
                            != bits(rstate.checkpoint)).reshape(B, -1), 1)
  np.testing.assert_array_equal(wrote, flushed & (np.asarray(COUNTS) > 0))


def test_verify_with_bf16_rings_equals_stepwise_replay():
  """Earlier window tokens enter with the rings' rounding, as the decode
  step reads them back: rows that do not flush match the stepwise replay to
  f32 tolerance; all rows match the baseline within bf16's."""
  T = 3
  rstate, full = setup(7, jnp.bfloat16)
  win = window(8, T)
  o, _ = _verify(rstate, **win)
  r, outs = rstate, []
  for t in range(T):
    o_t, r = _step(r, **{n: x[:, t] for n, x in win.items()})
    outs.append(o_t)
  o_step = jnp.stack(outs, 1)
  keep = np.nonzero(np.asarray(COUNTS) + T < L)[0]
  testing.assert_close(o[keep], o_step[keep], TOL, "non-flush rows")
  o_b, _ = _base_verify(full, **win)
  testing.assert_close(o, o_b, testing.tolerance("bfloat16"), "all rows")


def test_commit_equals_a_fresh_run_on_the_accepted_prefix():
  T = 4
  rstate, full = setup(11)
  win = window(12, T)
  rng = np.random.default_rng(0)
  for n in ([1, T, 2, 3, T], list(rng.integers(1, T + 1, B)),
            [T] * B, [1] * B):
    n = jnp.asarray(n, jnp.int32)
    _, pending = _verify(rstate, **win)
    committed = gdn.gdn_replay_commit(pending, n)
    assert committed.pending_window is None
    _, snaps = _base_verify(full, **win)
    base = gdn.gdn_baseline_commit(snaps, n)
    testing.assert_close(_materialize(committed), base, TOL,
                         f"committed state n={n}")
    np.testing.assert_array_equal(committed.count,
                                  np.asarray(pending.count) + n)
    tok = {x: y[:, 0] for x, y in window(13, 1).items()}
    o_r, _ = _step(committed, **tok)
    o_b, _ = gdn.gdn_step(base, **tok)
    testing.assert_close(o_r, o_b, TOL, f"step after commit n={n}")


def test_rejected_drafts_poisoned_with_nan_never_reach_later_outputs():
  T = 4
  rstate, _ = setup(21)
  win = window(22, T)
  n = jnp.asarray([1, 2, T, 3, 1], jnp.int32)
  rejected = np.arange(T)[None, :] >= np.asarray(n)[:, None]  # [B, T]
  bad = {x: jnp.where(jnp.asarray(rejected).reshape(
      rejected.shape + (1,) * (y.ndim - 2)), jnp.nan, y)
         for x, y in win.items()}
  o_clean, p_clean = _verify(rstate, **win)
  o_bad, p_bad = _verify(rstate, **bad)
  accepted = ~rejected
  np.testing.assert_array_equal(bits(o_bad)[accepted],
                                bits(o_clean)[accepted])
  c_clean = gdn.gdn_replay_commit(p_clean, n)
  c_bad = gdn.gdn_replay_commit(p_bad, n)
  np.testing.assert_array_equal(bits(_materialize(c_bad)),
                                bits(_materialize(c_clean)))
  tok = {x: y[:, 0] for x, y in window(23, 1).items()}
  for _ in range(2):  # decode steps, then another verify
    o1, c_clean = _step(c_clean, **tok)
    o2, c_bad = _step(c_bad, **tok)
    assert np.all(np.isfinite(o2))
    np.testing.assert_array_equal(bits(o2), bits(o1))
  win2 = window(24, 3)
  o1, _ = _verify(c_clean, **win2)
  o2, _ = _verify(c_bad, **win2)
  np.testing.assert_array_equal(bits(o2), bits(o1))


@functools.partial(jax.jit, static_argnames=("policy",))
def _round(rstate, full, win, n, tok, policy=None):
  """One speculative round (verify, commit, a decode step), replay and
  baseline."""
  o_r, pending = gdn.gdn_replay_verify(rstate, **win, policy=policy)
  rstate = gdn.gdn_replay_commit(pending, n)
  o_b, snaps = gdn.gdn_baseline_verify(full, **win)
  full = gdn.gdn_baseline_commit(snaps, n)
  y_r, rstate = gdn.gdn_replay_step(rstate, **tok, policy=policy)
  y_b, full = gdn.gdn_step(full, **tok)
  return rstate, full, (o_r, o_b, y_r, y_b, gdn.gdn_materialize(rstate),
                        full)


def _rounds(rstate, full, policy=None, rounds=5, T=3, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(rounds):
    win = window(seed + 2 * i, T)
    tok = {x: y[:, 0] for x, y in window(seed + 2 * i + 1, 1).items()}
    n = jnp.asarray(rng.integers(1, T + 1, B), jnp.int32)
    steps0 = None if rstate.step is None else np.asarray(rstate.step)
    rstate, full, res = _round(rstate, full, win, n, tok, policy=policy)
    if steps0 is not None:
      np.testing.assert_array_equal(rstate.step, steps0 + np.asarray(n) + 1)
    out.append(res)
  return out


def test_verify_commit_step_sequences_equal_the_baseline():
  rstate, full = setup(31)
  for i, (o_r, o_b, y_r, y_b, s_r, s_b) in enumerate(_rounds(rstate, full)):
    testing.assert_close(o_r, o_b, TOL, f"round {i} verify o")
    testing.assert_close(y_r, y_b, TOL, f"round {i} step o")
    testing.assert_close(s_r, s_b, TOL, f"round {i} state")


@pytest.mark.parametrize("name", ["f32+int8+sr", "f16+sr"])
def test_verify_under_precision_policies(name):
  policy = PrecisionPolicy.preset(name)
  full = jax.random.normal(jax.random.PRNGKey(41), (B, HV, K, VD))
  rstate = gdn.gdn_replay_state_from(full, L, num_k_heads=HK, policy=policy)
  tol = testing.tolerance(policy.checkpoint_dtype, policy.buffer_dtype,
                          *([policy.read_dtype] if policy.read_dtype
                            else []))
  for i, (o_r, o_b, y_r, y_b, s_r, s_b) in enumerate(
      _rounds(rstate, full, policy=policy, seed=50)):
    testing.assert_close(o_r, o_b, tol, f"{name} round {i} verify o")
    testing.assert_close(y_r, y_b, tol, f"{name} round {i} step o")
    testing.assert_close(s_r, s_b, tol, f"{name} round {i} state")


def test_out_of_range_num_accepted_under_jit_makes_the_row_nan():
  rstate, _ = setup(61)
  _, pending = _verify(rstate, **window(62, 3))
  n = jnp.asarray([1, 0, 3, 4, 2], jnp.int32)
  committed = jax.jit(gdn.gdn_replay_commit)(pending, n)
  np.testing.assert_array_equal(np.asarray(committed.count)[[1, 3]], -1)
  o, _ = _step(committed, **{x: y[:, 0] for x, y in window(63, 1).items()})
  assert np.all(np.isnan(o[np.array([1, 3])]))
  assert np.all(np.isfinite(o[np.array([0, 2, 4])]))
  snaps = jnp.ones((B, 3, HV, K, VD))
  base = jax.jit(gdn.gdn_baseline_commit)(snaps, n)
  assert np.all(np.isnan(base[1])) and np.all(base[0] == 1)


def test_bad_verify_and_commit_arguments_are_refused():
  rstate, full = setup(71)
  win = window(72, 3)
  with pytest.raises(ValueError, match="buffer_len"):
    gdn.gdn_replay_verify(rstate, **window(73, L))
  with pytest.raises(ValueError, match="v"):
    gdn.gdn_replay_verify(rstate, **{**win, "v": win["v"][:, :2]})
  with pytest.raises(ValueError, match="beta"):
    gdn.gdn_replay_verify(rstate, **{**win, "beta": win["beta"][..., :1]})
  _, pending = gdn.gdn_replay_verify(rstate, **win)
  with pytest.raises(ValueError, match="pending"):
    gdn.gdn_replay_verify(pending, **win)
  with pytest.raises(ValueError, match="pending window"):
    gdn.gdn_replay_commit(rstate, jnp.ones(B, jnp.int32))
  for n in ([0, 1, 1, 1, 1], [4, 1, 1, 1, 1]):
    with pytest.raises(ValueError, match="num_accepted"):
      gdn.gdn_replay_commit(pending, jnp.asarray(n, jnp.int32))
  with pytest.raises(ValueError, match="window"):
    gdn.gdn_replay_commit(pending, jnp.ones(B, jnp.int32), window=2)
  with pytest.raises(ValueError, match="num_accepted"):
    gdn.gdn_replay_commit(pending, jnp.ones(B - 1, jnp.int32))
  with pytest.raises(ValueError, match="q"):
    gdn.gdn_baseline_verify(full, **{**win, "q": win["q"][:, 0]})
  with pytest.raises(ValueError, match="snapshots"):
    gdn.gdn_baseline_commit(full, jnp.ones(B, jnp.int32))
