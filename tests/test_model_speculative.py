"""Speculative decoding loop of the hybrid LM
(replayssm_jax.models.speculative), greedy.

* greedy `speculative_generate` == greedy `generate` token for token, for
  both SSM modes and both proposers, and with scripted drafts forcing 0
  accepted, all accepted, partial and no drafts (stats checked against a
  simulation of the script), eos handling, one compilation per shape;
* batch compaction keeps output and state; the loops hold no conditional;
* bad inputs raise clear errors.

verify / commit: tests/test_model_verify_commit.py; sampling:
tests/test_model_speculative_sampling.py. The tiny config of
tests/test_models.py; f32; ragged prompts throughout.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax.models import (DraftModelProposer, NgramProposer,
                                  Proposal, ProposalContext, Proposer,
                                  decode_step, speculative_generate)
from replayssm_jax.models import model as M
from replayssm_jax.models.generate import generate, sampling_settings
from replayssm_jax.models.states import kv_cache_len
from tests.model_spec_common import (  # noqa: F401  (fixtures)
    B, BUFFER_LEN, LENGTHS, MAX_NEW, P, VOCAB, WINDOW, draft, model, prompts,
    small_models)
from tests.test_models import random_tokens


# ------------------------------------------------------ decode loop: greedy


@pytest.fixture(scope="module")
def reference(model, prompts):
  """Non-speculative greedy tokens."""
  out, n = generate(model, *prompts, MAX_NEW, buffer_len=BUFFER_LEN)
  assert np.all(np.asarray(n) == MAX_NEW)
  return np.asarray(out)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_greedy_equals_generate(model, draft, prompts, reference, ssm_mode,
                                kind):
  proposer = (DraftModelProposer(draft) if kind == "draft"
              else NgramProposer(n=2))
  out, n, stats, state = speculative_generate(
      model, proposer, *prompts, MAX_NEW, WINDOW, ssm_mode=ssm_mode,
      buffer_len=BUFFER_LEN, return_state=True)
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(n, MAX_NEW)
  # The final state holds everything but each row's last token.
  np.testing.assert_array_equal(state.positions,
                                np.array(LENGTHS) + MAX_NEW - 1)
  # The KV cache holds prompt + new tokens + window, rounded up so the
  # attention kernel tiles it (an untiled length sent verify to XLA).
  assert state.max_len == kv_cache_len(P + MAX_NEW + WINDOW)
  assert state.max_len % 64 == 0
  steps = np.asarray(stats.verify_steps)
  acc = np.asarray(stats.accepted_drafts)
  # Every verify step emits accepted drafts + 1 tokens (capped at the end).
  assert np.all(acc + steps >= MAX_NEW - 1)
  assert np.all(acc + steps <= MAX_NEW - 1 + WINDOW - 1)
  assert int(stats.iterations) == steps.max()
  np.testing.assert_allclose(float(stats.mean_accepted_length),
                             (acc + steps).sum() / steps.sum(), rtol=1e-6)
  # Compiled once per shape and sampling mode: sampling (not greedy) with
  # top-k and top-p on compiles once, then new prompts, lengths, sampling
  # values, eos and rng reuse it.
  before = M.TRACE_COUNTS["speculative_generate"]
  traces = []
  for seed in (1, 2, 3):
    out, n, _ = speculative_generate(
        model, proposer, random_tokens(seed, (B, P)),
        jnp.asarray([seed, P, 2], jnp.int32), MAX_NEW, WINDOW,
        ssm_mode=ssm_mode, buffer_len=BUFFER_LEN, temperature=0.5 * seed,
        top_k=seed + 1, top_p=0.9, rng=jax.random.PRNGKey(seed),
        eos_id=seed)
    assert np.all((np.asarray(n) >= 1) & (np.asarray(n) <= MAX_NEW))
    traces.append(M.TRACE_COUNTS["speculative_generate"] - before)
  assert traces == [1, 1, 1]


@pytest.mark.parametrize("ssm_mode,kind", [("replay", "draft"),
                                           ("baseline", "ngram")])
def test_compaction_keeps_output_and_state(model, draft, ssm_mode, kind):
  """A compacting loop (the batch of 5 halved to 3, 2, 1 as rows finish:
  ragged prompts, an eos that stops some rows early) gives the tokens,
  counts and stats of the plain loop, and final states that continue
  decoding alike (logits of 3 more steps; positions). Slots past each
  row's history are scratch (verify writes every row's window there), so
  the states are compared by what they decode, not leaf by leaf."""
  from replayssm_jax.models.speculative import compaction_sizes  # pylint: disable=g-import-not-at-top
  assert compaction_sizes(5, 3) == (5, 3, 2, 1)
  assert compaction_sizes(256, 2) == (256, 128, 64)
  assert compaction_sizes(1, 2) == (1,)
  proposer = (DraftModelProposer(draft) if kind == "draft"
              else NgramProposer(n=2))
  prompts = random_tokens(41, (5, P))
  lengths = jnp.asarray([8, 3, 6, 5, 8], jnp.int32)
  runs = [speculative_generate(model, proposer, prompts, lengths, MAX_NEW,
                               WINDOW, ssm_mode=ssm_mode,
                               buffer_len=BUFFER_LEN, eos_id=5,
                               return_state=True, compaction=c)
          for c in (0, 3)]
  (out, n, stats, state), (out_c, n_c, stats_c, state_c) = runs
  np.testing.assert_array_equal(out_c, out)
  np.testing.assert_array_equal(n_c, n)
  assert len(set(np.asarray(stats.verify_steps).tolist())) > 1  # ragged
  for f in ("verify_steps", "accepted_drafts", "iterations",
            "mean_accepted_length"):
    np.testing.assert_array_equal(getattr(stats_c, f), getattr(stats, f))
  np.testing.assert_array_equal(state_c.positions, state.positions)
  last = jnp.asarray(out)[jnp.arange(5), jnp.asarray(n) - 1]
  for _ in range(3):
    lg, state = decode_step(model, last, state)
    lg_c, state_c = decode_step(model, last, state_c)
    np.testing.assert_array_equal(lg_c, lg)
    last = jnp.argmax(lg, -1).astype(jnp.int32)
  # Without return_state, the same tokens.
  out_n, _, _ = speculative_generate(model, proposer, prompts, lengths,
                                     MAX_NEW, WINDOW, ssm_mode=ssm_mode,
                                     buffer_len=BUFFER_LEN, eos_id=5,
                                     compaction=1)
  np.testing.assert_array_equal(out_n, out)
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="compaction"):
      speculative_generate(model, proposer, prompts, lengths, MAX_NEW,
                           WINDOW, compaction=bad)


@pytest.mark.parametrize("setting", [dict(temperature=0.0),
                                     dict(temperature=0.8),
                                     dict(temperature=0.8, top_p=0.9)])
def test_decode_loops_hold_no_conditional(model, setting):
  """With `SamplingSettings` (greedy and the filters static) neither the
  plain nor the speculative loop lowers to a conditional (an XLA GPU
  conditional outside a CUDA graph syncs the host every iteration), and
  the speculative loop's acceptance traces one form."""
  from tests.test_models import G  # pylint: disable=g-import-not-at-top
  SP = importlib.import_module("replayssm_jax.models.speculative")
  sampling = sampling_settings(setting["temperature"], None,
                               setting.get("top_p"), None,
                               jax.random.PRNGKey(0))
  assert sampling.greedy == (setting["temperature"] == 0)
  tokens, lengths = random_tokens(3, (B, P)), jnp.asarray(LENGTHS, jnp.int32)
  graphdef, params = nnx.split(model)
  eos, rng = jnp.array([-1], jnp.int32), jax.random.PRNGKey(1)
  state = model.init_state(B, kv_cache_len(P + 8 + WINDOW),
                           buffer_len=BUFFER_LEN)
  plain = G._generate_jit.lower(graphdef, params, tokens, lengths, state, 8,  # pylint: disable=protected-access
                                None, sampling, eos, rng).as_text()
  spec = SP._spec_jit.lower(  # pylint: disable=protected-access
      graphdef, params, tokens, lengths, state, 8, WINDOW, None, "replay",
      BUFFER_LEN, NgramProposer(n=2), sampling, eos, rng, 1,
      False).as_text()
  for text in (plain, spec):
    assert "stablehlo.while" in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
  # A traced greedy flag (a plain tuple) keeps the conditional.
  traced = (jnp.asarray(False),) + tuple(sampling)[1:]
  text = G._generate_jit.lower(graphdef, params, tokens, lengths, state, 8,  # pylint: disable=protected-access
                               None, traced, eos, rng).as_text()
  assert "stablehlo.case" in text


@jax.tree_util.register_pytree_node_class
class ScriptedProposer(Proposer):
  """Test proposer: at iteration i row r proposes schedule[i, r] = (nd, k):
  nd drafts, the first k of them the target's true greedy continuation
  (from `reference`), the rest wrong tokens; never past the reference.
  Hence exactly min(nd, k, tokens left) drafts are accepted (greedy)."""

  def __init__(self, reference, schedule):
    self.reference = jnp.asarray(reference, jnp.int32)  # [b, max_new]
    self.schedule = jnp.asarray(schedule, jnp.int32)  # [iters, b, 2]

  def tree_flatten(self):
    return (self.reference, self.schedule), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)

  def init(self, prompt_tokens, prompt_lengths, **unused):
    return ()

  def propose(self, pstate, ctx, window, rng, sampling):
    t1 = window - 1
    it = jnp.minimum(ctx.iteration, self.schedule.shape[0] - 1)
    nd, k = self.schedule[it, :, 0], self.schedule[it, :, 1]
    j = jnp.arange(t1)[None, :]
    idx = jnp.clip(ctx.num_generated[:, None] + j, 0,
                   self.reference.shape[1] - 1)
    right = jnp.take_along_axis(self.reference, idx, axis=1)
    wrong = (right + 1 + j) % VOCAB
    nd = jnp.minimum(nd, self.reference.shape[1] - ctx.num_generated)
    return Proposal(jnp.where(j < k[:, None], right, wrong), nd, None), pstate


def _simulate(schedule, max_new, window):
  """(iterations, verify steps [b], accepted drafts [b]) the script implies."""
  b = schedule.shape[1]
  gen, steps, acc = np.ones(b, int), np.zeros(b, int), np.zeros(b, int)
  it = 0
  while (gen < max_new).any():
    for r in np.nonzero(gen < max_new)[0]:
      nd, k = schedule[min(it, len(schedule) - 1), r]
      a = min(nd, k, window - 1, max_new - gen[r])
      acc[r] += a
      steps[r] += 1
      gen[r] += min(a + 1, max_new - gen[r])
    it += 1
  return it, steps, acc


def _schedule(seed, iters=MAX_NEW):
  """Forced rounds first (no drafts, all wrong, all right, ragged counts),
  then random (nd, k) per row."""
  rng = np.random.default_rng(seed)
  t1 = WINDOW - 1
  sched = np.stack([rng.integers(0, t1 + 1, (iters, B)),
                    rng.integers(0, t1 + 1, (iters, B))], axis=-1)
  sched[0] = [0, 0]  # no drafts
  sched[1] = [t1, 0]  # every draft wrong: 0 accepted
  sched[2] = [t1, t1]  # all accepted (bonus token)
  sched[3] = [[1, 1], [2, 1], [0, 3]]  # ragged
  return sched


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_forced_acceptance_patterns(model, prompts, reference, ssm_mode):
  """Scripted drafts: 0 accepted, all accepted, partial, no drafts, ragged
  draft counts; output == generate, stats == the script's simulation; with
  an eos == generate with that eos."""
  sched = _schedule(ssm_mode == "baseline")
  out, n, stats = speculative_generate(
      model, ScriptedProposer(reference, sched), *prompts, MAX_NEW, WINDOW,
      ssm_mode=ssm_mode, buffer_len=BUFFER_LEN)
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(n, MAX_NEW)
  it, steps, acc = _simulate(sched, MAX_NEW, WINDOW)
  assert int(stats.iterations) == it
  np.testing.assert_array_equal(stats.verify_steps, steps)
  np.testing.assert_array_equal(stats.accepted_drafts, acc)
  # eos: the token row 0 emits at step 9 (no recompilation: eos is traced).
  eos = int(reference[0, 9])
  ref_eos, n_eos = generate(model, *prompts, MAX_NEW, buffer_len=BUFFER_LEN,
                            eos_id=eos)
  before = M.TRACE_COUNTS["speculative_generate"]
  out, n, _ = speculative_generate(
      model, ScriptedProposer(reference, sched), *prompts, MAX_NEW, WINDOW,
      ssm_mode=ssm_mode, buffer_len=BUFFER_LEN, eos_id=eos)
  assert M.TRACE_COUNTS["speculative_generate"] == before
  np.testing.assert_array_equal(out, ref_eos)
  np.testing.assert_array_equal(n, n_eos)
  assert int(n[0]) <= 10
  # Two eos ids: a row stops at either (as generate does).
  two = (int(reference[1, 4]), eos)
  ref_two, n_two = generate(model, *prompts, MAX_NEW, buffer_len=BUFFER_LEN,
                            eos_id=two)
  out, n, _ = speculative_generate(
      model, ScriptedProposer(reference, sched), *prompts, MAX_NEW, WINDOW,
      ssm_mode=ssm_mode, buffer_len=BUFFER_LEN, eos_id=two)
  np.testing.assert_array_equal(out, ref_two)
  np.testing.assert_array_equal(n, n_two)
  assert int(n[1]) <= 5


def test_ngram_proposer_lookup():
  """Longest suffix first, most recent earlier occurrence, continuation
  limited to the known history, nothing when nothing matches."""
  hist = np.zeros((5, 10), np.int32)
  rows = [[5, 6, 7, 8, 5, 6],  # [5 6] at 0 -> 7 8 5
          [1, 2, 3, 4],  # no repeat -> nothing
          [1, 2, 9, 1, 2, 8, 1, 2],  # most recent [1 2] at 3 -> 8 1 2
          [4, 9, 3, 7, 3],  # no [7 3]; [3] at 2 -> 7 3 (2 known)
          [1, 2, 1, 2]]  # [1 2] at 0 -> 1 2 (2 known)
  for r, h in enumerate(rows):
    hist[r, :len(h)] = h
  ln = jnp.asarray([len(h) for h in rows], jnp.int32)
  ctx = ProposalContext(history=jnp.asarray(hist), length=ln,
                        last=jnp.asarray(hist)[jnp.arange(5), ln - 1],
                        num_generated=jnp.ones(5, jnp.int32),
                        active=jnp.ones(5, bool), iteration=jnp.int32(0))
  prop, _ = NgramProposer(n=2).propose((), ctx, 4, None, None)
  np.testing.assert_array_equal(prop.num_drafts, [3, 0, 3, 2, 2])
  assert prop.q is None
  d = np.asarray(prop.drafts)
  np.testing.assert_array_equal(d[0], [7, 8, 5])
  np.testing.assert_array_equal(d[2], [8, 1, 2])
  np.testing.assert_array_equal(d[3, :2], [7, 3])
  np.testing.assert_array_equal(d[4, :2], [1, 2])
  prop, _ = NgramProposer(n=2, min_n=2).propose((), ctx, 4, None, None)
  np.testing.assert_array_equal(prop.num_drafts, [3, 0, 3, 0, 2])


# ------------------------------------------------------------ bad inputs
def test_bad_inputs_raise_clear_errors(model, draft, prompts, small_models):
  """Every check runs before compiling (no jit below)."""
  toks, lengths = prompts
  ngram = NgramProposer()
  run = functools.partial(speculative_generate, model, ngram, toks, lengths,
                          4)
  with pytest.raises(ValueError, match="window must be a positive int"):
    run(0)
  with pytest.raises(ValueError, match=r"buffer_len \(4\) must exceed window "
                     r"\(4\)"):
    run(4, buffer_len=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    speculative_generate(model, ngram, toks, lengths, 0, 2)
  with pytest.raises(TypeError, match="proposer must be a Proposer"):
    speculative_generate(model, draft, toks, lengths, 4, 2)
  with pytest.raises(TypeError, match="target must be a HybridLM"):
    speculative_generate(ngram, ngram, toks, lengths, 4, 2)
  with pytest.raises(ValueError, match="rng"):
    run(2, temperature=1.0)
  with pytest.raises(ValueError, match="eos_id"):
    run(2, eos_id=VOCAB)
  with pytest.raises(ValueError, match="ssm_mode"):
    run(2, ssm_mode="fast")
  with pytest.raises(ValueError, match="lengths"):
    speculative_generate(model, ngram, toks, jnp.array([0, 1, 1]), 4, 2)
  with pytest.raises(ValueError, match=r"vocab_size \(4\) must equal"):
    speculative_generate(model, DraftModelProposer(small_models[1]), toks,
                         lengths, 4, 2)
  with pytest.raises(ValueError, match=r"draft model's replay buffer_len "
                     r"\(3\) must exceed the window \(3\)"):
    speculative_generate(model, DraftModelProposer(draft, buffer_len=3),
                         toks, lengths, 4, 3)
  with pytest.raises(TypeError, match="draft_model must be a HybridLM"):
    DraftModelProposer(ngram)
  with pytest.raises(ValueError, match="n must be a positive int"):
    NgramProposer(n=0)
  with pytest.raises(ValueError, match=r"min_n \(3\) must be <= n \(2\)"):
    NgramProposer(n=2, min_n=3)
