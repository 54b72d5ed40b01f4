"""Values jit cannot check follow one policy: the affected row's outputs are
NaN (generated tokens -1) and it stays marked (a replay counter outside
[0, L), a model row's position -1); the other rows are unaffected;
`debug_checks()` raises instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing
from replayssm_jax.models import decode_step, generate
from replayssm_jax.models import model as M
from replayssm_jax.models import speculative as MS
from tests.test_models import make_model



@pytest.fixture(scope="module")
def model():
  return make_model(3)


def _prompt(model, b=2, t=6, seed=0):
  return jax.random.randint(jax.random.PRNGKey(seed), (b, t), 0,
                            model.config.vocab_size)


def test_generate_with_a_prompt_length_past_the_width_under_jit(model):
  toks = _prompt(model)
  f = jax.jit(lambda ln: generate(model, toks, ln, 4))
  out, n = f(jnp.array([11, 4]))
  ref, n_ref = generate(model, toks[1:], jnp.array([4]), 4)
  np.testing.assert_array_equal(out[0], -1)
  assert int(n[0]) == 0
  np.testing.assert_array_equal(out[1], ref[0])
  assert int(n[1]) == int(n_ref[0])


def _prefilled(model, b=2, max_len=16):
  state = model.init_state(b, max_len)
  logits, state = M.prefill(model, _prompt(model, b), jnp.full((b,), 6),
                            state)
  return logits, state


@pytest.mark.parametrize("bad_token", [-5, 64, 2 ** 31 - 1])
def test_decode_step_token_out_of_range_under_jit(model, bad_token):
  _, state = _prefilled(model)
  step = jax.jit(lambda tok, s: M.decode_step(model, tok, s))
  good, _ = step(jnp.array([3, 7]), jax.tree.map(jnp.copy, state))
  logits, new = step(jnp.array([bad_token, 7]), state)
  assert np.isnan(np.asarray(logits[0])).all()
  np.testing.assert_array_equal(logits[1], good[1])
  assert int(new.positions[0]) == -1 and int(new.positions[1]) == 7
  # The row stays invalid, even with a good token.
  logits, new = step(jnp.array([3, 7]), new)
  assert np.isnan(np.asarray(logits[0])).all()
  assert np.isfinite(np.asarray(logits[1])).all()


def test_full_kv_cache_under_jit_is_nan_not_clamped(model):
  _, state = _prefilled(model, max_len=8)
  step = jax.jit(lambda tok, s: M.decode_step(model, tok, s))
  tok = jnp.array([3, 7])
  for _ in range(2):  # positions 6, 7: the cache's last two entries
    logits, state = step(tok, state)
    assert np.isfinite(np.asarray(logits)).all()
  logits, state = step(tok, state)  # no room
  assert np.isnan(np.asarray(logits)).all()
  np.testing.assert_array_equal(state.positions, [-1, -1])


def test_commit_out_of_range_under_jit_marks_the_row(model):
  for mode in ("replay", "baseline"):
    state = model.init_state(2, 16, ssm_mode=mode)
    _, state = M.prefill(model, _prompt(model), jnp.full((2,), 6), state)
    _, pending = MS.verify(model, jnp.array([[1, 2, 3], [4, 5, 6]]), state)
    new = jax.jit(MS.commit_fn)(pending, jnp.array([0, 2]))
    np.testing.assert_array_equal(new.positions, [-1, 8])
    logits, _ = M.decode_step(model, jnp.array([1, 2]), new)
    assert np.isnan(np.asarray(logits[0])).all(), mode
    assert np.isfinite(np.asarray(logits[1])).all(), mode


def test_baseline_commit_out_of_range_is_nan():
  snaps = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 2, 4, 8))
  f = jax.jit(rs.baseline_commit)
  out = np.asarray(f(snaps, jnp.array([0, 2, 5], jnp.int32)))
  assert np.isnan(out[[0, 2]]).all()
  np.testing.assert_array_equal(out[1], np.asarray(snaps[1, 1]))


def test_decode_attention_lengths_out_of_range_under_jit():
  key = jax.random.PRNGKey(1)
  q = jax.random.normal(key, (3, 4, 8))
  k = jax.random.normal(jax.random.fold_in(key, 1), (3, 2, 16, 8))
  v = jax.random.normal(jax.random.fold_in(key, 2), (3, 2, 16, 8))
  f = jax.jit(rs.decode_attention)
  out = np.asarray(f(q, k, v, jnp.array([-1, 5, 17], jnp.int32)))
  assert np.isnan(out[[0, 2]]).all() and np.isfinite(out[1]).all()
  np.testing.assert_array_equal(
      out[1], np.asarray(rs.decode_attention(q, k, v, jnp.array(
          [0, 5, 16], jnp.int32)))[1])


def test_debug_checks_raise_instead(model):
  toks = _prompt(model)
  with rs.debug_checks():
    f = jax.jit(lambda ln: generate(model, toks, ln, 4))
    with pytest.raises(Exception, match=r"generate: rows \[0\] got an "
                       r"out-of-range value"):
      jax.block_until_ready(f(jnp.array([11, 4])))
    _, state = _prefilled(model)
    step = jax.jit(lambda t, s: decode_step(model, t, s))
    with pytest.raises(Exception, match=r"decode_step: rows \[0\]"):
      jax.block_until_ready(step(jnp.array([-5, 7]), state))
    params = testing.random_params(jax.random.PRNGKey(0), 4)
    rstate = rs.ReplayState.create(2, 4, 8, 8, 2, 4)
    tok = testing.random_step_inputs(jax.random.PRNGKey(1), 2, 4, 8, 8, 2)
    step = jax.jit(lambda r: rs.replay_state_update(r, **tok, **params))
    with pytest.raises(Exception, match=r"replay_state_update: rows \[1\]"):
      jax.block_until_ready(step(rstate.replace(
          count=jnp.array([0, 9], jnp.int32))))
  # Outside the context: no raise, the row is NaN.
  y, _ = jax.jit(lambda r: rs.replay_state_update(r, **tok, **params))(
      rstate.replace(count=jnp.array([0, 9], jnp.int32)))
  assert np.isnan(np.asarray(y[1])).all()
