"""Poisoned inputs never reach an output they must not affect.

* stale buffer slots (at or past a row's count) holding NaN, inf or values
  that overflow in a product are selected away by every implementation of
  the decode step and the verify (`testing.random_replay_state` poisons
  them for every kernel test; here the verify and a realistic trigger);
* causality: a non-finite token of a verify window, of a prefill chunk
  (Mamba-2, Gated DeltaNet, Kimi Delta Attention, attention), of a model's
  forward or of a conv window leaves every earlier position's output
  bit-identical;
* the states a user passes in are neither mutated nor deleted.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import models, ssd, testing
from replayssm_jax.models import model as model_lib
from tests import harness, serving_common

B, H, P, N, G, L, T = 4, 8, 8, 16, 2, 8, 4
# Row 3 (count 7, count + T >= L) folds its history before the window.
COUNTS = (0, 1, 2, 7)
POISONS = {"nan": np.nan, "inf": np.inf, "3e38": 3e38}
# The reference and the verify kernels (their default config).
VERIFY_IMPLS = [("reference", None), ("pallas", None)]
IMPL_IDS = ["reference", "pallas"]


def _setup(seed=0, counts=COUNTS, buffer_dtype=jnp.float32):
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"],
      buffer_dtype=buffer_dtype)
  win = testing.random_step_inputs(jax.random.fold_in(key, 2), B, H, P, N, G,
                                   seqlen=T)
  return params, rstate, win


def _verify(rstate, win, params, impl, config):
  return rs.replay_verify(rstate, **win, **params, dt_softplus=True,
                          implementation=impl, config=config)


def _assert_same(y, ref, impl, what):
  y, ref = np.asarray(y), np.asarray(ref)
  assert np.isfinite(y).all(), f"{what}: non-finite outputs"
  if impl == "reference":
    np.testing.assert_array_equal(harness.bits(y), harness.bits(ref),
                                  err_msg=what)
  else:  # the kernels' sums run in another order
    testing.assert_close(y, ref, testing.TOLERANCES["float32"], what)


def test_random_replay_state_poisons_the_stale_slots():
  """The kernel tests rely on it: every stale slot is non-finite."""
  _, rstate, _ = _setup()
  stale = np.arange(L)[None, :] >= np.asarray(COUNTS)[:, None]
  for name in ("x_buf", "b_buf", "dt_buf"):
    v = np.asarray(getattr(rstate, name), np.float32)
    assert not np.isfinite(v[stale]).any() and np.isfinite(v[~stale]).all()


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("impl,config", VERIFY_IMPLS, ids=IMPL_IDS)
def test_verify_ignores_poisoned_stale_slots(impl, config, poison):
  params, rstate, win = _setup()
  clean = testing.fill_stale_slots(rstate, 0.0)
  y_ref, p_ref = _verify(clean, win, params, impl, config)
  y, pending = _verify(testing.fill_stale_slots(rstate, POISONS[poison]), win, params,
                       impl, config)
  _assert_same(y, y_ref, impl, f"{poison} in stale slots")
  np.testing.assert_array_equal(pending.count, p_ref.count)
  folded = np.asarray(COUNTS) + T >= L
  _assert_same(np.asarray(pending.checkpoint)[folded],
               np.asarray(p_ref.checkpoint)[folded], impl, "folded history")


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_rejected_f16_draft_does_not_poison_the_next_verify(impl):
  """A rejected draft whose x overflows the f16 buffer (inf) stays in a
  stale slot after the commit; the next verify ignores it, as the decode
  step does."""
  params, rstate, win = _setup(3, counts=(0, 1, 2, 3),
                               buffer_dtype=jnp.float16)
  rstate = testing.fill_stale_slots(rstate, 0.0)
  drafts = dict(win, x=win["x"].at[:, 1:].set(1e5))
  _, pending = _verify(rstate, drafts, params, impl, None)
  assert not np.isfinite(np.asarray(pending.x_buf, np.float32)).all()
  committed = rs.replay_commit(pending, jnp.ones(B, jnp.int32))
  nxt = testing.random_step_inputs(jax.random.PRNGKey(9), B, H, P, N, G,
                                   seqlen=T)
  y, _ = _verify(committed, nxt, params, impl, None)
  y_clean, _ = _verify(testing.fill_stale_slots(committed, 0.0), nxt, params, impl,
                       None)
  _assert_same(y, y_clean, impl, "verify after a rejected inf draft")
  tok = {k: v[:, 0] for k, v in nxt.items()}
  y1, _ = rs.replay_state_update(committed, **tok, **params,
                                 dt_softplus=True, implementation=impl)
  assert np.isfinite(np.asarray(y1)).all()


@pytest.mark.parametrize("field", ["x", "B", "dt", "C", "z"])
@pytest.mark.parametrize("impl,config", VERIFY_IMPLS, ids=IMPL_IDS)
def test_verify_window_is_causal(impl, config, field):
  """NaN at window position 2: positions 0 and 1 are unchanged."""
  params, rstate, win = _setup(5)
  y_ref, _ = _verify(rstate, win, params, impl, config)
  bad = dict(win, **{field: win[field].at[:, 2].set(jnp.nan)})
  y, _ = _verify(rstate, bad, params, impl, config)
  _assert_same(np.asarray(y)[:, :2], np.asarray(y_ref)[:, :2], impl,
               f"NaN {field} at position 2")
  assert np.isnan(np.asarray(y)[:, 2]).any()


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("field", ["x", "B", "dt"])
def test_ssd_chunked_scan_is_causal_within_a_chunk(field, poison):
  """A poisoned token at position 10 (chunk 8) leaves positions 0-9
  bit-identical: within its chunk too (right-padding cannot poison the
  real tokens before it)."""
  seqlen = 20
  params = testing.random_params(jax.random.PRNGKey(0), H)
  seq = testing.random_step_inputs(jax.random.PRNGKey(1), 2, H, P, N, G,
                                   seqlen=seqlen)

  def run(s):
    return ssd.ssd_chunked_scan(s["x"], s["dt"], params["A"], s["B"],
                                s["C"], 8, params["D"], s["z"],
                                params["dt_bias"], True)[0]

  y_ref = np.asarray(run(seq))
  y = np.asarray(run(dict(seq, **{field: seq[field].at[:, 10].set(
      POISONS[poison])})))
  np.testing.assert_array_equal(harness.bits(y[:, :10]),
                                harness.bits(y_ref[:, :10]))
  if poison != "3e38":  # (a finite input need not overflow)
    assert not np.isfinite(y[:, 10:]).any()


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_conv_window_is_causal(impl):
  b, dim, k = 2, 32, 4
  key = jax.random.PRNGKey(4)
  x = jax.random.normal(key, (b, T, dim))
  state = jax.random.normal(jax.random.fold_in(key, 1), (b, k - 1, dim))
  weight = jax.random.normal(jax.random.fold_in(key, 2), (dim, k))
  start = jnp.asarray([0, 2], jnp.int32)

  def run(v):
    (y,) = rs.ops.causal_conv1d_window(v, state, start, weight,
                                       implementation=impl)
    return np.asarray(y)

  y_ref, y = run(x), run(x.at[:, 2].set(jnp.nan))
  np.testing.assert_array_equal(harness.bits(y[:, :2]),
                                harness.bits(y_ref[:, :2]))
  assert np.isnan(y[:, 2:]).all()


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("solve", ["substitution", "inverse"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_delta_rule_prefill_is_causal_within_a_chunk(family, solve, poison):
  """A non-finite key at position 5 of a chunk of 8 leaves positions 0-4
  and the other row bit-identical, whichever way the chunk's triangular
  system is solved, and makes position 5 non-finite."""
  b, t, hk, hv, dk = 2, 8, 1, 2, 8
  ks = jax.random.split(jax.random.PRNGKey(7), 5)
  q, k = (jax.random.normal(kk, (b, t, hk, dk)) for kk in ks[:2])
  v = jax.random.normal(ks[2], (b, t, hv, dk))
  a_in, b_in = jax.random.normal(ks[3], (b, t, hv)), jax.random.normal(
      ks[4], (b, t, hv))
  if family == "gdn":
    g, beta = rs.gdn.gdn_gates(a_in, b_in, jnp.zeros(hv), jnp.zeros(hv))
    run = lambda kk: rs.gdn.gdn_chunked_prefill(  # noqa: E731
        q, kk, v, g, beta, chunk_size=t, solve=solve)[0]
  else:
    a4 = jnp.broadcast_to(a_in[..., None], (b, t, hv, dk)) + jnp.arange(dk)
    g, beta = rs.kda.kda_gates(a4 / dk, b_in, jnp.zeros(hv),
                               jnp.zeros((hv, dk)))
    run = lambda kk: rs.kda.kda_chunked_prefill(  # noqa: E731
        q, kk, v, g, beta, chunk_size=t, solve=solve)[0]
  y_ref = np.asarray(run(k))
  y = np.asarray(run(k.at[0, 5].set(POISONS[poison])))
  np.testing.assert_array_equal(harness.bits(y[0, :5]),
                                harness.bits(y_ref[0, :5]))
  np.testing.assert_array_equal(harness.bits(y[1]), harness.bits(y_ref[1]))
  assert not np.isfinite(y[0, 5]).all()


def test_model_forward_and_prefill_are_causal():
  """A token id outside the vocabulary (unchecked under jit: a NaN
  embedding) at position 5 of row 0 leaves that row's earlier positions and
  the other row bit-identical through every block kind (attention, Mamba-2,
  Gated DeltaNet, Kimi Delta Attention, MoE, MLP), in the full forward and
  as a right-padded prompt's pads in a fresh prefill."""
  cfg = serving_common.CFG.replace(
      pattern="*MGKE-", gdn_chunk_size=8, n_routed_experts=4,
      num_experts_per_tok=2, moe_intermediate_size=16)
  graph = nnx.split(models.HybridLM(cfg, rngs=nnx.Rngs(0)))
  toks = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, 64)
  bad = toks.at[0, 5].set(64 + 1)
  forward = jax.jit(lambda g, t: nnx.merge(*g).forward(t)[0])
  y_ref, y = np.asarray(forward(graph, toks)), np.asarray(forward(graph, bad))
  np.testing.assert_array_equal(harness.bits(y[0, :5]),
                                harness.bits(y_ref[0, :5]))
  np.testing.assert_array_equal(harness.bits(y[1]), harness.bits(y_ref[1]))
  assert np.isnan(y[0, 5]).all()
  lengths = jnp.array([5, 12])
  prefill = jax.jit(lambda g, t: model_lib.prefill_fn(
      nnx.merge(*g), t, lengths, nnx.merge(*g).init_state(2, 16))[0])
  np.testing.assert_array_equal(harness.bits(prefill(graph, bad)),
                                harness.bits(prefill(graph, toks)))


def test_from_ssm_state_keeps_the_callers_array():
  """The checkpoint is a copy: a donated decode step does not delete the
  caller's state."""
  params, _, win = _setup()
  x = jax.random.normal(jax.random.PRNGKey(0), (B, H, P, N))
  rstate = rs.ReplayState.from_ssm_state(x, G, L)
  tok = {k: v[:, 0] for k, v in win.items()}
  step = jax.jit(lambda r: rs.replay_state_update(r, **tok, **params),
                 donate_argnums=0)
  for _ in range(L):
    _, rstate = step(rstate)
  assert not x.is_deleted()
  np.testing.assert_array_equal(np.asarray(x).shape, (B, H, P, N))


def test_numpy_integers_are_accepted():
  rstate = rs.ReplayState.create(np.int64(B), np.int32(H), np.int64(P),
                                 np.int64(N), np.int64(G), np.int64(L))
  assert rstate.buffer_len == L and isinstance(rstate.buffer_len, int)
  full = jnp.zeros((B, H, P, N))
  assert rs.ReplayState.from_ssm_state(full, np.int64(G),
                                       np.int16(L)).buffer_len == L
  params, _, win = _setup()
  y, _ = ssd.ssd_chunked_scan(win["x"], win["dt"], params["A"], win["B"],
                              win["C"], np.int64(2))
  assert y.shape == win["x"].shape
  for bad in (2.0, True, "4"):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
      ssd.ssd_chunked_scan(win["x"], win["dt"], params["A"], win["B"],
                           win["C"], bad)
