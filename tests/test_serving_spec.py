"""Speculative decoding inside the continuous-batching engine
(`serving.Engine(speculative=serving.Speculation(...))`): greedy requests
get exactly the tokens of independent greedy `generate` runs (both SSM
modes, more requests than slots, budgets that cut a window, an eos inside
an accepted window), sampled requests are reproducible whatever their
slot, a freed slot filled with NaN / garbage is never read for another
request and is never advanced, and bad settings are named.

The tiny model of tests/serving_common.py, f32. `NgramProposer` drafts
from each slot's own history; a `DraftModelProposer` whose draft is the
target itself accepts (nearly) every draft, which puts an eos inside an
accepted window and keeps per-slot draft states in the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import models, serving
from replayssm_jax.precision import PrecisionPolicy
from tests.serving_common import CFG, build_model, poison_rows, prompt

MAX_LEN, L, T = 40, 6, 4  # slot length, replay buffer, speculative window
CAP, STEPS = 2, 2  # slots, rounds per dispatch
# The prompts of the tests: name -> (seed, length) of a random prompt, or
# a tuple of them concatenated (a shared system prompt, then a tail);
# N_REF reference tokens each.
PROMPTS = {1: (1, 5), 2: (2, 9), 3: (3, 3), 4: (4, 12), 5: (5, 6),
           "e": (21, 6), "f": (22, 9), "g": (23, 4), "a": (31, 9),
           "b": (32, 5), "c": (33, 6), "s": (41, 7), "s1": (42, 5),
           "s2": (43, 4), "p0": ((51, 8), (52, 3)),
           "p1": ((51, 8), (53, 5)), "p2": ((51, 8), (54, 2))}
N_REF = 18


def tokens(name) -> np.ndarray:
  spec = PROMPTS[name]
  parts = spec if isinstance(spec[0], tuple) else (spec,)
  return np.concatenate([np.asarray(prompt(*p)) for p in parts])


@pytest.fixture(scope="module")
def model():
  return build_model(5, 11)


@pytest.fixture(scope="module")
def refs(model):
  """refs(ssm_mode) -> {name: the greedy `generate` tokens [N_REF] of
  PROMPTS[name]}: one batched call per mode (ragged prompts; rows are
  independent)."""
  done = {}

  def get(ssm_mode):
    if ssm_mode not in done:
      ps = [tokens(k) for k in PROMPTS]
      toks = np.zeros((len(ps), max(len(p) for p in ps)), np.int32)
      for i, p in enumerate(ps):
        toks[i, :len(p)] = np.asarray(p)
      out, _ = models.generate(model, jnp.asarray(toks),
                               jnp.array([len(p) for p in ps]), N_REF,
                               ssm_mode=ssm_mode, buffer_len=L)
      done[ssm_mode] = dict(zip(PROMPTS, np.asarray(out).tolist()))
    return done[ssm_mode]
  return get


def request(name, n, **kw):
  return serving.Request(name, tokens(name), max_new_tokens=n,
                         **kw)


def engine(model, proposer, ssm_mode="replay", **kw):
  return serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=STEPS,
                        ssm_mode=ssm_mode, buffer_len=L,
                        speculative=serving.Speculation(proposer, window=T),
                        **kw)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_ngram_requests_match_independent_runs(model, refs, ssm_mode):
  # Five requests through two slots, two rounds per dispatch: requests join
  # while the other slot is mid-buffer, budgets (not multiples of T) end
  # inside a window and inside a dispatch, freed slots are reused.
  specs = {1: 7, 2: 10, 3: 1, 4: 5, 5: 9}  # name -> max_new_tokens
  eng = engine(model, models.NgramProposer(n=2), ssm_mode)
  want = {}
  for name, n in specs.items():
    want[name] = refs(ssm_mode)[name][:n]
    eng.submit(request(name, n))
  streamed = {}
  got = eng.run(on_tokens=lambda rid, toks: streamed.setdefault(
      rid, []).extend(toks))
  assert got == want and streamed == want
  st = eng.stats
  assert st.finished == len(specs) and not eng.busy
  assert st.tokens == sum(specs.values())
  assert not np.asarray(eng.pool.active).any()
  assert st.steps == STEPS * st.dispatches
  # Every verify round emits >= 1 token (the first came from the prefill).
  assert 0 < st.verify_rounds <= st.tokens - len(specs)
  assert 0 <= st.accepted_drafts <= st.drafts
  assert 0.0 <= st.acceptance_rate <= 1.0


def test_draft_model_eos_inside_an_accepted_window(model, refs):
  # The target drafting for itself: windows are accepted whole, so an eos
  # at an index that is not a window's last token sits inside an accepted
  # window, and the tokens after it must be dropped.
  full = refs("replay")
  ref = full["e"]
  stop = next(i for i in range(5, 14)
              if i % T and ref.index(ref[i]) == i)  # first occurrence
  eng = engine(model, models.DraftModelProposer(model))
  eng.submit(request("e", 14, eos_id=ref[stop]))
  eng.submit(request("f", 13))
  eng.submit(request("g", 6))
  got = eng.run()
  assert got == {"e": ref[:stop + 1], "f": full["f"][:13],
                 "g": full["g"][:6]}
  st = eng.stats
  assert st.acceptance_rate > 0.9
  # Tokens the accepted windows held but the slots did not emit (after
  # the eos, past a budget): the cut happened on the device.
  assert st.accepted_drafts + st.verify_rounds > st.tokens - 3


def test_prefix_cache_with_speculation(model, refs):
  # Prompts sharing a two-block system prompt: later admissions start from
  # the cached target state; the slot's history still holds the whole
  # prompt, so the n-gram proposer sees it.
  cache = serving.PrefixCache(block=4, max_entries=8)
  eng = engine(model, models.NgramProposer(n=2), prefix_cache=cache)
  for name in ("p0", "p1", "p2"):
    eng.submit(request(name, 7))
  assert eng.run() == {k: refs("replay")[k][:7] for k in ("p0", "p1", "p2")}
  assert cache.stats()["hits"] >= 1


def _row_bytes(tree, slot):
  return [np.asarray(x)[slot].tobytes() for x in jax.tree.leaves(tree)]


def test_poisoned_free_slot_is_never_read(model, refs):
  budgets = {"a": 18, "b": 3, "c": 8}
  want = {k: refs("replay")[k][:n] for k, n in budgets.items()}
  eng = engine(model, models.DraftModelProposer(model))
  eng.submit(request("a", budgets["a"]))
  eng.submit(request("b", budgets["b"]))
  eng.dispatch()  # admits a (slot 0) and b (slot 1)
  while eng.slots[1] is not None:  # until b finished
    eng.dispatch()
  assert eng.slots[0] is not None  # a still runs
  # The freed slot holds garbage everywhere: target and draft states, the
  # next input token, the token history.
  eng.pool = eng.pool.replace(state=poison_rows(eng.pool.state, 1),
                              tokens=eng.pool.tokens.at[1].set(-77))
  eng._spec_slots = poison_rows(eng._spec_slots, 1)  # pylint: disable=protected-access
  slots = eng._spec_slots  # pylint: disable=protected-access
  before = _row_bytes((slots.history, slots.length, slots.generated), 1)
  eng.dispatch()  # a runs beside the poisoned free slot
  # The free slot emits nothing and its history stays; its target and
  # draft states are the step's (unspecified, never read).
  slots = eng._spec_slots  # pylint: disable=protected-access
  assert _row_bytes((slots.history, slots.length, slots.generated),
                    1) == before
  eng.submit(request("c", budgets["c"]))
  assert eng.run() == want


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampled_requests_reproducible_in_any_slot(model, refs, kind):
  # A sampled request alone (slot 0) and behind others (slot 1, joining
  # mid-run beside a greedy and a sampled request) draws the same tokens:
  # drafts and acceptance use the request's own key stream.
  def proposer():
    return (models.NgramProposer(n=2) if kind == "ngram"
            else models.DraftModelProposer(model))

  eng = engine(model, proposer())
  eng.submit(request("s", 11, temperature=1.5, seed=4))
  alone = eng.run()["s"]
  eng = engine(model, proposer())
  eng.submit(request("s1", 14))  # greedy
  eng.submit(request("s2", 3, temperature=0.7, seed=9))
  eng.submit(request("s", 11, temperature=1.5, seed=4))
  slot_of = {}

  def on_tokens(rid, toks):
    del toks
    if rid not in slot_of:  # its first token: its slot holds it
      slot_of[rid] = [r is not None and r.id == rid
                      for r in eng.slots].index(True)

  got = eng.run(on_tokens)
  # s2 finished first (two rounds give its 2 tokens); s took its slot.
  assert slot_of == {"s1": 0, "s2": 1, "s": 1}
  assert got["s"] == alone
  assert len(alone) == 11 and all(0 <= t < CFG.vocab_size for t in alone)
  greedy = refs("replay")
  assert alone != greedy["s"][:11]  # temperature 1.5 does sample
  assert got["s1"] == greedy["s1"][:14]  # greedy beside sampled rows
  if kind == "draft":
    assert eng.stats.accepted_drafts > 0


def test_bad_speculation_is_named(model):
  ngram = models.NgramProposer()
  with pytest.raises(ValueError, match="window"):
    serving.Speculation(ngram, window=0)
  with pytest.raises(TypeError, match="proposer"):
    serving.Speculation("ngram", window=3)
  with pytest.raises(TypeError, match="speculative"):
    serving.Engine(model, 2, MAX_LEN, speculative=ngram)
  # Replay buffers must exceed the window (a window sits behind the
  # committed history).
  with pytest.raises(ValueError, match="buffer_len"):
    serving.Engine(model, 2, MAX_LEN, buffer_len=T,
                   speculative=serving.Speculation(ngram, window=T))
  # A baseline state with an 8-bit read copy: verify cannot take it.
  with pytest.raises(ValueError, match="precision"):
    serving.Engine(model, 2, MAX_LEN, ssm_mode="baseline",
                   precision=PrecisionPolicy.preset("f32+fp8"),
                   speculative=serving.Speculation(ngram, window=T))
  other = models.HybridLM(CFG.replace(vocab_size=32), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="vocab_size"):
    engine(model, models.DraftModelProposer(other))
