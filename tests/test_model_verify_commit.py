"""verify / commit of a speculative window of the hybrid LM
(replayssm_jax.models.verify_commit).

* `verify` logits == stepping `decode_step` over the window; `commit(n)`
  == the state after n steps (replay and baseline modes);
* property test: random acceptance over many windows (ragged rows, 1 and T
  accepted included); after each commit the state equals a fresh prefill of
  the accepted stream and every verified position's logits equal a full
  forward over it;
* bad inputs raise clear errors.

The tiny config of tests/test_models.py; f32; ragged prompts throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import materialize, testing
from replayssm_jax.models import (MambaState, NgramProposer, PendingState,
                                  commit, decode_step, prefill, verify)
from replayssm_jax.models.states import AttentionState
from tests.model_spec_common import (  # noqa: F401  (fixtures)
    B, LENGTHS, P, TOL, VOCAB, full_logits, model, prompts)
from tests.test_models import random_tokens


def _mamba_A(model):
  return {i: -jnp.exp(blk.mixer.A_log[...].astype(jnp.float32))
          for i, blk in enumerate(model.blocks) if blk.kind == "mamba"}



# -------------------------------------------------------- verify / commit
T_VERIFY, WINDOWS, L_VERIFY = 4, 7, 6  # L: replay buffer_len
WIDTH = P + WINDOWS * T_VERIFY  # KV room of the verify tests


def _assert_states_close(actual, expected, model, what):
  """Committed states agree: positions, conv, materialized SSM state, KV
  cache up to each row's length."""
  np.testing.assert_array_equal(actual.positions, expected.positions,
                                err_msg=what)
  A = _mamba_A(model)
  for i, (sa, se) in enumerate(zip(actual.layers, expected.layers)):
    if isinstance(sa, MambaState):
      # The same inputs, whatever slot each ring holds them in.
      testing.assert_close(sa.ordered_conv(), se.ordered_conv(), TOL,
                           f"{what}: conv layer {i}")
      mat = lambda s: (materialize(s, A[i]) if not isinstance(s, jax.Array)
                       else s)
      testing.assert_close(mat(sa.ssm), mat(se.ssm), TOL,
                           f"{what}: SSM state layer {i}")
    elif isinstance(sa, AttentionState):
      np.testing.assert_array_equal(sa.length, se.length, err_msg=what)
      for r, n in enumerate(np.asarray(se.length)):
        testing.assert_close(sa.k[r, :, :n], se.k[r, :, :n], TOL,
                             f"{what}: keys layer {i} row {r}")
        testing.assert_close(sa.v[r, :, :n], se.v[r, :, :n], TOL,
                             f"{what}: values layer {i} row {r}")


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_verify_equals_stepwise_decode(model, ssm_mode):
  """Window logits == decode_step logits of the same tokens; committing n
  (1, T and in between, per row) == the state after n decode steps."""
  T = T_VERIFY
  prompts = random_tokens(20, (B, P))
  cont = random_tokens(21, (B, T))
  state = model.init_state(B, WIDTH, ssm_mode=ssm_mode, buffer_len=L_VERIFY)
  _, state = prefill(model, prompts, jnp.asarray(LENGTHS), state)
  logits, pending = verify(model, cont, _copy(state))  # both donate
  step_logits, steps = [], []
  for s in range(T):
    lg, state = decode_step(model, cont[:, s], state)
    step_logits.append(lg)
    steps.append(_copy(state))
  assert isinstance(pending, PendingState) and pending.window == T
  assert logits.shape == (B, T, VOCAB) and logits.dtype == jnp.float32
  testing.assert_close(logits, jnp.stack(step_logits, 1), TOL,
                       f"{ssm_mode} verify logits")
  n = np.array([1, T, 2])
  expected = jax.tree.map(lambda *a: jnp.stack(a)[n - 1, np.arange(B)],
                          *steps)
  _assert_states_close(commit(pending, jnp.asarray(n, jnp.int32)), expected,
                       model, f"{ssm_mode} commit {n}")


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_random_acceptance_equals_fresh_run_on_accepted_prefix(model,
                                                               ssm_mode):
  """Property test: 7 windows of T = 4 with random per-row acceptance
  (rounds forcing 1 and T for every row; buffer_len 6 so that replay rows
  flush early often). After every commit the state equals a fresh prefill
  of the accepted stream (SSM state materialized), and every verified
  window position that was accepted (the first one included: what the
  committed state predicts next) has the logits of a full forward pass
  over the accepted stream."""
  T, windows, L, width = T_VERIFY, WINDOWS, L_VERIFY, WIDTH
  rng = np.random.default_rng(1)
  lengths = np.array(LENGTHS)
  prompts = np.asarray(random_tokens(30, (B, P)))
  stream = [list(prompts[r, :n]) for r, n in enumerate(lengths)]
  state = model.init_state(B, width, ssm_mode=ssm_mode, buffer_len=L)
  _, state = prefill(model, jnp.asarray(prompts), jnp.asarray(lengths), state)
  checks = []  # (row, stream position of the token consumed, logits)
  for w in range(windows):
    win = np.asarray(random_tokens(100 + w, (B, T)))
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    if w % 3 == 0:
      n[:] = 1 if w % 2 else T
    logits, pending = verify(model, jnp.asarray(win), state)
    state = commit(pending, jnp.asarray(n))
    for r in range(B):  # logits[r, s]: after window token s (accepted)
      checks += [(r, len(stream[r]) + s, logits[r, s]) for s in range(n[r])]
      stream[r] += list(win[r, :n[r]])
    padded = np.zeros((B, width), np.int32)
    for r in range(B):
      padded[r, :len(stream[r])] = stream[r]
    fresh = model.init_state(B, width, ssm_mode=ssm_mode, buffer_len=L)
    _, fresh = prefill(model, jnp.asarray(padded),
                       jnp.asarray([len(s) for s in stream]), fresh)
    _assert_states_close(state, fresh, model, f"after window {w}")
  full = full_logits(*nnx.split(model), jnp.asarray(padded))
  for r, pos, lg in checks:
    testing.assert_close(lg, full[r, pos], TOL,
                         f"row {r} logits after stream position {pos}")


# ------------------------------------------------------------ bad inputs
def test_verify_commit_bad_inputs_raise_clear_errors(model, prompts):
  """Every check runs before compiling (no jit below)."""
  toks, lengths = prompts
  ngram = NgramProposer()
  # A state as prefill leaves it, built by hand.
  state = model.init_state(B, P + 2, buffer_len=4)
  state = state.replace(
      positions=lengths,
      layers=tuple(s.replace(length=lengths) if isinstance(s, AttentionState)
                   else s for s in state.layers))
  with pytest.raises(ValueError, match=r"buffer_len \(4, layer 0\) must "
                     r"exceed the window T \(4\)"):
    verify(model, toks[:, :4], state)
  with pytest.raises(ValueError, match=r"no room for a window of T = 3 "
                     r"tokens: rows \[0\] hold \[8\]"):
    verify(model, toks[:, :3], state)
  with pytest.raises(ValueError, match="vocab_size"):
    verify(model, toks[:, :2] + VOCAB, state)
  with pytest.raises(TypeError, match="tokens"):
    verify(model, jnp.ones((B, 2)), state)
  with pytest.raises(ValueError, match="batch"):
    verify(model, toks[:2, :2], state)
  with pytest.raises(ValueError, match="T >= 1"):
    verify(model, toks[:, :0], state)
  with pytest.raises(TypeError, match="model must be a HybridLM"):
    verify(ngram, toks[:, :2], state)
  pending = PendingState(state=state, window_conv_inputs=(), snapshots=(),
                         window=2)
  with pytest.raises(ValueError, match=r"num_accepted must lie in \[1, T\] "
                     r"= \[1, 2\] for every row; rows \[1\] hold \[0\]"):
    commit(pending, jnp.asarray([1, 0, 2], jnp.int32))
  with pytest.raises(ValueError, match=r"rows \[2\] hold \[3\]"):
    commit(pending, jnp.asarray([1, 1, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"num_accepted must have shape"):
    commit(pending, jnp.ones((2,), jnp.int32))
  with pytest.raises(TypeError, match="num_accepted must have an integer"):
    commit(pending, jnp.ones((B,)))
  with pytest.raises(TypeError, match="pending must be a PendingState"):
    commit(state, jnp.ones((B,), jnp.int32))
