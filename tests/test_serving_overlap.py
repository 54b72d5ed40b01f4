"""The engine's overlap of host and device (`Engine(overlap=True)`) and the
per-slot controls it carries on the device (`serving.controls`).

Overlapped and synchronous engines give every request the same tokens and
the same stream (greedy, sampled, eos on the first token, a budget of one,
speculative rounds); a dispatch launches before it reads; a slot reused
while a dispatch launched for its old request is in flight never passes
that dispatch's tokens to the new request; the controls' admission op and
key streams are checked against their definitions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import models, serving
from replayssm_jax.serving import controls as C
from tests.serving_common import build_model, greedy_tokens, prompt

CAP, MAX_LEN, L = 3, 48, 4


@pytest.fixture(scope="module")
def model():
  return build_model(5, 11)


def reference(model, tokens, n):
  return greedy_tokens(model, tokens, n, buffer_len=L)


def run(model, reqs, **kw):
  """Runs `reqs` through an engine -> (results, {id: streamed tokens},
  stats)."""
  eng = serving.Engine(model, CAP, MAX_LEN, buffer_len=L, **kw)
  for r in reqs:
    eng.submit(r)
  streamed = {}
  got = eng.run(on_tokens=lambda rid, toks: streamed.setdefault(
      rid, []).extend(toks))
  assert not eng.busy and eng._inflight is None  # pylint: disable=protected-access
  assert not np.asarray(eng.pool.active).any()
  return got, streamed, eng.stats


def mixed_requests(model):
  """Seven requests for three slots: greedy and sampled, an eos that is
  the first token, a budget of one, budgets ending mid-dispatch."""
  first = reference(model, prompt(64, 5), 1)[0]
  return [
      serving.Request("g1", prompt(60, 6), 7),
      serving.Request("s1", prompt(61, 4), 9, temperature=1.3, seed=2),
      serving.Request("one", prompt(62, 8), 1),
      serving.Request("g2", prompt(63, 3), 5, eos_id=7),
      serving.Request("eos0", prompt(64, 5), 6, eos_id=first),
      serving.Request("s2", prompt(65, 9), 4, temperature=0.9, seed=-3),
      serving.Request("g3", prompt(66, 7), 8),
  ]


@pytest.mark.parametrize("steps", [1, 3])
def test_overlap_gives_the_synchronous_tokens(model, steps):
  reqs = mixed_requests(model)
  runs = [run(model, reqs, steps_per_dispatch=steps, overlap=o)
          for o in (True, False)]
  (got, streamed, st), (got_sync, streamed_sync, st_sync) = runs
  assert got == got_sync and streamed == streamed_sync == got
  assert got["one"] == reference(model, prompt(62, 8), 1)
  assert len(got["eos0"]) == 1
  assert got["g1"] == reference(model, prompt(60, 6), 7)
  assert st.tokens == st_sync.tokens == sum(len(v) for v in got.values())
  assert st.finished == st_sync.finished == len(reqs)


def test_overlap_with_speculation(model):
  reqs = [serving.Request(i, prompt(70 + i, 4 + i), 5 + 2 * i)
          for i in range(5)]
  spec = serving.Speculation(models.NgramProposer(n=2), window=3)
  got = [run(model, reqs, steps_per_dispatch=2, speculative=spec,
             overlap=o)[0] for o in (True, False)]
  assert got[0] == got[1]
  assert got[0][0] == reference(model, prompt(70, 4), 5)


def test_a_dispatch_launches_before_it_reads(model):
  eng = serving.Engine(model, CAP, MAX_LEN, buffer_len=L,
                       steps_per_dispatch=4)
  for i in range(2):
    eng.submit(serving.Request(i, prompt(80 + i, 5), 9))
  streamed = {}
  eng.dispatch(lambda rid, toks: streamed.setdefault(rid, []).extend(toks))
  # The first tokens (the prefills') are read; the decode call is in
  # flight and its tokens come with the next dispatch.
  assert {k: len(v) for k, v in streamed.items()} == {0: 1, 1: 1}
  assert eng._inflight is not None and eng.stats.dispatches == 1  # pylint: disable=protected-access
  eng.dispatch(lambda rid, toks: streamed.setdefault(rid, []).extend(toks))
  assert {k: len(v) for k, v in streamed.items()} == {0: 5, 1: 5}
  eng.run(lambda rid, toks: streamed.setdefault(rid, []).extend(toks))
  assert streamed[0] == reference(model, prompt(80, 5), 9)


def test_a_reused_slot_never_gets_the_old_requests_tokens(model):
  """One slot, two steps per dispatch: a (budget 2) surely finishes in the
  first decode call, so b is admitted into its slot before that call's
  tokens are read. Those tokens are replaced by valid ids (7) here: they
  reach a, and none of them b."""
  eng = serving.Engine(model, 1, MAX_LEN, buffer_len=L, steps_per_dispatch=2)
  eng.submit(serving.Request("a", prompt(90, 4), 2))
  eng.submit(serving.Request("b", prompt(91, 6), 5))
  eng.dispatch()  # a admitted; D1 launched
  out, slots, reqs = eng._inflight  # pylint: disable=protected-access
  assert [r.id for r in reqs] == ["a"]
  eng._inflight = (jnp.full_like(out, 7), slots, reqs)  # pylint: disable=protected-access
  eng.dispatch()  # b admitted into the slot, D2 launched, D1 read
  assert eng.slots[0].id == "b"
  got = eng.run()
  assert got["a"] == reference(model, prompt(90, 4), 1) + [7]
  assert got["b"] == reference(model, prompt(91, 6), 5)


def test_overlap_admits_into_slots_it_knows_will_finish(model):
  """Budgets the host knows run out in the dispatch in flight: the next
  request is admitted into the slot at once, and no dispatch is launched
  for a request that is surely done, so overlap runs as many dispatches
  as the synchronous loop."""
  reqs = [serving.Request(i, prompt(100 + i, 5), 3) for i in range(3)]
  runs = {}
  for o in (True, False):
    eng = serving.Engine(model, 1, MAX_LEN, buffer_len=L,
                         steps_per_dispatch=2, overlap=o)
    for r in reqs:
      eng.submit(r)
    runs[o] = (eng.run(), eng.stats.dispatches)
  assert runs[True] == runs[False]
  assert runs[True][1] == 3


@pytest.mark.parametrize("seed", [0, 5, -3, 2**31, 2**40 + 9])
def test_request_keys_are_prngkey_splits(seed):
  stream, first = C.request_keys(jnp.asarray(C.seed_words([seed, 1])))
  want = jax.random.split(jax.random.PRNGKey(seed))
  np.testing.assert_array_equal(stream[0], want[0])
  np.testing.assert_array_equal(first[0], want[1])


def test_admit_writes_the_rows_budgets_after_the_first_token():
  cap = 5
  ctl = C.init_controls(cap, max_eos_ids=2)
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  idx = jnp.array([4, 0, 2, cap], jnp.int32)  # the last: dropped
  ctl = C.admit(ctl, idx, keys, budgets=jnp.array([6, 3, 1, 9]),
                eos_ids=jnp.array([[7, 11], [-1, -1], [8, -1], [2, -1]]),
                temps=jnp.array([0.5, 0.0, 2.0, 1.0], jnp.float32),
                first=jnp.array([11, 40, 3, 5]))
  # Row 4: first is its second eos -> 0; row 0: 3 - 1; row 2: budget 1.
  assert np.asarray(ctl.left).tolist() == [2, 0, 0, 0, 0]
  assert np.asarray(ctl.eos).tolist() == [[-1, -1], [-1, -1], [8, -1],
                                          [-1, -1], [7, 11]]
  np.testing.assert_array_equal(ctl.keys[4], keys[0])
  np.testing.assert_array_equal(ctl.keys[1], 0)  # untouched rows
  ctl = C.admit(ctl, jnp.array([1], jnp.int32), keys[:1], jnp.array([4]),
                jnp.array([[-1, -1]]), jnp.array([0.0], jnp.float32),
                jnp.array([-1]))  # an invalid row's -1: no budget
  assert int(ctl.left[1]) == 0
