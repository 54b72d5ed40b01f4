"""The continuous-batching engine (replayssm_jax.serving.Engine): more
requests than slots, of different prompt lengths, budgets and eos ids,
each get exactly the tokens of an independent greedy `generate`; streamed
tokens arrive in order; sampled requests are reproducible and independent
of their slot; bad requests are named before they reach a slot."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from replayssm_jax import models, serving
from replayssm_jax.models import parts as parts_mod
from tests.serving_common import CFG, build_model, greedy_tokens, prompt

CAP, MAX_LEN, L = 3, 48, 4


@pytest.fixture(scope="module")
def model():
  return build_model(5, 11)


def reference(model, tokens, n, ssm_mode):
  return greedy_tokens(model, tokens, n, ssm_mode, buffer_len=L)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_requests_match_independent_runs(model, ssm_mode):
  # Six requests through three slots, 3 steps per dispatch: requests join
  # while others are mid-buffer and mid-dispatch, finish inside a dispatch
  # (budgets not multiples of 3), and reuse freed slots.
  specs = [(1, 5, 7), (2, 9, 4), (3, 3, 10), (4, 12, 1), (5, 6, 8),
           (6, 8, 5)]  # (seed, prompt length, max_new_tokens)
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=3,
                       ssm_mode=ssm_mode, buffer_len=L)
  want = {}
  for seed, t, n in specs:
    p = prompt(seed, t)
    want[seed] = reference(model, p, n, ssm_mode)
    eng.submit(serving.Request(seed, p, max_new_tokens=n))
  streamed = {}
  got = eng.run(on_tokens=lambda rid, toks: streamed.setdefault(
      rid, []).extend(toks))
  assert got == want
  assert streamed == want
  assert eng.stats.finished == len(specs) and not eng.busy
  assert eng.stats.tokens == sum(n for _, _, n in specs)
  assert not np.asarray(eng.pool.active).any()


def test_eos_stops_a_request(model):
  p = prompt(21, 6)
  full = reference(model, p, 10, "replay")
  eos = full[4]
  stop = full.index(eos)  # its first occurrence
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=4,
                       buffer_len=L)
  eng.submit(serving.Request("e", p, max_new_tokens=10, eos_id=eos))
  eng.submit(serving.Request("f", p, max_new_tokens=10))
  got = eng.run()
  assert got["e"] == full[:stop + 1]
  assert got["f"] == full


@pytest.mark.parametrize("speculative", [False, True])
def test_a_request_stops_at_any_of_its_eos_ids(model, speculative):
  p = prompt(22, 5)
  full = reference(model, p, 12, "replay")
  stops = (full[7], full[3])  # the earlier of the two ends the request
  cut = min(full.index(t) for t in stops) + 1
  spec = (serving.Speculation(models.NgramProposer(n=2), window=3)
          if speculative else None)
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L, max_eos_ids=2, speculative=spec)
  eng.submit(serving.Request("two", p, max_new_tokens=12, eos_id=stops))
  eng.submit(serving.Request("one", p, max_new_tokens=12,
                             eos_id=np.int64(stops[0])))
  got = eng.run()
  assert got["two"] == full[:cut]
  assert got["one"] == full[:full.index(stops[0]) + 1]
  with pytest.raises(ValueError, match="at most max_eos_ids = 2"):
    eng.submit(serving.Request("x", p, 3, eos_id=[1, 2, 3]))


def test_sampled_requests_reproducible_in_any_slot(model):
  # The same sampled request alone and behind other requests (another
  # slot, other batch-mates) draws the same tokens.
  req = lambda rid: serving.Request(rid, prompt(31, 7), max_new_tokens=9,
                                    temperature=1.5, seed=4)
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=4,
                       buffer_len=L)
  eng.submit(req("alone"))
  alone = eng.run()["alone"]
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=4,
                       buffer_len=L)
  eng.submit(serving.Request("g1", prompt(32, 5), max_new_tokens=3))
  eng.submit(serving.Request("g2", prompt(33, 4), max_new_tokens=6))
  eng.submit(req("behind"))
  got = eng.run()
  assert got["behind"] == alone
  assert len(alone) == 9 and all(0 <= t < CFG.vocab_size for t in alone)
  greedy = reference(model, prompt(31, 7), 9, "replay")
  assert alone != greedy  # temperature 1.5 does sample


def test_bad_requests_are_named(model):
  eng = serving.Engine(model, CAP, 16, buffer_len=L)
  with pytest.raises(ValueError, match="max_new_tokens"):
    eng.submit(serving.Request("a", prompt(1, 10), max_new_tokens=10))
  with pytest.raises(ValueError, match="prompt"):
    eng.submit(serving.Request("b", prompt(1, 20), max_new_tokens=1))
  with pytest.raises(ValueError, match="max_new_tokens"):
    eng.submit(serving.Request("c", prompt(1, 4), max_new_tokens=0))
  with pytest.raises(ValueError, match="temperature"):
    eng.submit(serving.Request("d", prompt(1, 4), max_new_tokens=2,
                               temperature=-1.0))
  eng.submit(serving.Request("e", prompt(1, 4), max_new_tokens=2))
  with pytest.raises(ValueError, match="'e' is already in use"):
    eng.submit(serving.Request("e", prompt(2, 4), max_new_tokens=2))
  with pytest.raises(ValueError, match="steps_per_dispatch"):
    serving.Engine(model, CAP, 16, steps_per_dispatch=0)
  vocab = CFG.vocab_size
  for field, bad, match in (
      ("prompt", np.array([1, vocab]), "'f': prompt tokens must lie in"),
      ("prompt", np.array([-1, 2]), "'f': prompt tokens must lie in"),
      ("prompt", np.array([1.0, 2.0]), "'f': prompt must be a \\[T\\] "
       "integer"),
      ("eos_id", vocab, "'f': eos_id must be None, an int or a sequence"),
      ("eos_id", True, "'f': eos_id"),
      ("eos_id", [3, -1], "'f': eos_id must be"),
      ("seed", 1.5, "'f': seed must be an int")):
    req = serving.Request("f", prompt(1, 4), max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
      eng.submit(dataclasses.replace(req, **{field: bad}))
  assert [r.id for r in eng.queue] == ["e"]  # none of them was queued


def test_the_engine_keeps_its_own_prompt(model):
  p = np.asarray(prompt(3, 6)).copy()
  want = reference(model, p, 4, "replay")
  eng = serving.Engine(model, CAP, MAX_LEN, buffer_len=L)
  eng.submit(serving.Request("a", p, max_new_tokens=4))
  p[:] = 0  # the caller reuses its array
  assert eng.run()["a"] == want


@pytest.mark.parametrize("overlap", [True, False])
def test_cancel(model, overlap):
  """A queued request cancelled is never admitted; a running one stops
  with a prefix of its tokens, its slot is freed at once and taken by a
  queued request, which gets exactly its own tokens."""
  specs = {"a": (50, 5, 20), "b": (51, 7, 6), "c": (52, 4, 20),
           "d": (53, 6, 9), "e": (54, 3, 7)}  # id -> seed, length, budget
  eng = serving.Engine(model, 2, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L, overlap=overlap)
  for rid, (seed, t, n) in specs.items():
    eng.submit(serving.Request(rid, prompt(seed, t), max_new_tokens=n))
  assert eng.cancel("d")  # queued
  eng.dispatch()
  eng.dispatch()
  assert eng.cancel("a")  # running
  assert not eng.cancel("a") and not eng.cancel("zz")
  got = eng.run()
  want = {rid: reference(model, prompt(seed, t), n, "replay")
          for rid, (seed, t, n) in specs.items()}
  assert got["d"] == []
  assert 1 <= len(got["a"]) < 20 and got["a"] == want["a"][:len(got["a"])]
  assert {k: got[k] for k in "bce"} == {k: want[k] for k in "bce"}
  assert eng.stats.cancelled == 2 and eng.stats.finished == 3
  assert not eng.busy and not np.asarray(eng.pool.active).any()


def test_engine_splits_the_model_once(model, monkeypatch):
  """Dispatches and admissions reuse the engine's nnx.split of the model
  (a split traverses the module graph on the host each time)."""
  eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L)
  calls = []
  real = parts_mod.nnx.split
  monkeypatch.setattr(parts_mod.nnx, "split",
                      lambda *a: calls.append(1) or real(*a))
  for i in range(4):
    eng.submit(serving.Request(i, prompt(70 + i, 4 + i), max_new_tokens=3))
  eng.run()
  assert eng.stats.finished == 4 and not calls
  assert not np.asarray(eng.pool.active).any()  # evicted in batches


def test_sampled_requests_through_the_cache_keep_their_keys(model):
  """Sampled requests (temperature 1, their own seeds) admitted in batches
  through a prefix cache draw the tokens they draw without one: each row's
  first-token key and key stream follow its request, whatever group of
  the batched admission it lands in (short prompts beside hits)."""
  system = prompt(61, 8).tolist()
  prompts = [system + prompt(62 + i, 2 + i).tolist() for i in range(4)]
  prompts.insert(1, prompt(70, 3).tolist())  # no whole block: plain
  runs = []
  for cache in (None, serving.PrefixCache(block=4, max_entries=8)):
    eng = serving.Engine(model, 4, MAX_LEN, steps_per_dispatch=2,
                         prefix_cache=cache, buffer_len=L)
    for i, p in enumerate(prompts):
      eng.submit(serving.Request(i, np.array(p), 5, temperature=1.0,
                                 seed=100 + i))
    runs.append(eng.run())
    if cache is not None:
      assert cache.stats()["hits"] >= 2
  assert runs[0] == runs[1]


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_prefix_cache_in_the_engine(model, ssm_mode):
  # Requests sharing a 2-block system prompt: the later ones hit the cache
  # and still produce the tokens of independent runs.
  system = prompt(41, 8).tolist()
  tails = [prompt(42 + i, 3 + i).tolist() for i in range(4)]
  cache = serving.PrefixCache(block=4, max_entries=8)
  eng = serving.Engine(model, 2, MAX_LEN, steps_per_dispatch=3,
                       prefix_cache=cache, ssm_mode=ssm_mode, buffer_len=L)
  want = {}
  for i, tail in enumerate(tails):
    p = np.array(system + tail)
    want[i] = reference(model, p, 6, ssm_mode)
    eng.submit(serving.Request(i, p, max_new_tokens=6))
  assert eng.run() == want
  st = cache.stats()
  assert st["hits"] >= len(tails) - 2  # two slots fill the cache first
  assert st["reused_tokens"] >= st["hits"] * len(system)
  with pytest.raises(TypeError, match="prefix_cache"):
    serving.Engine(model, 2, MAX_LEN, prefix_cache={})
