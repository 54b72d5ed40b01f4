"""Batched admission (`serving.insert_many`): k prompts prefilled into k
slots in one call act as k `insert`s (first tokens, the slots' states,
the decoding after), write nothing else, compile once per (padded batch,
bucket), sample each row with its own key; the engine admits through it.
The engine's compacted dispatches (only the running slots' rows, beside
poisoned free slots) give the whole pool's tokens, and `precompile`
leaves nothing to compile.

The serving tests' tiny hybrid model (Mamba-2, attention, Gated DeltaNet
and MLP blocks), f32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.serving import controls

from replayssm_jax import serving, testing
from replayssm_jax.serving import pool as pool_mod
from replayssm_jax.serving import prefix_cache as pc_mod
from tests.serving_common import CFG, build_model, poison, prompt

CAP, MAX_LEN, L = 6, 48, 4
TOL = testing.tolerance(jnp.float32)


@pytest.fixture(scope="module")
def model():
  return build_model(5, 9)


def rows(tree, slots):
  return jax.tree.map(lambda x: np.asarray(x)[np.asarray(slots)], tree)


def row_bytes(tree, row):
  return [np.asarray(x)[row].tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("ssm_mode", ("replay", "baseline"))
def test_insert_many_acts_as_inserts(model, ssm_mode):
  """Three prompts of one bucket (lengths 9, 3, 12) into slots 3, 1, 2 (2
  poisoned) beside a request mid-buffer in slot 0: first tokens equal,
  states within the f32 tolerance, slot 0 and the free slots untouched,
  and the next steps' tokens equal."""
  slots, lens = [3, 1, 2], [9, 3, 12]
  prompts = [prompt(60 + i, t) for i, t in enumerate(lens)]
  base = serving.init_pool(model, CAP, MAX_LEN, ssm_mode=ssm_mode,
                           buffer_len=L)
  base, _ = serving.insert(model, base, 0, prompt(59, 5))
  base, _ = serving.step_n(model, base, 2)
  base = poison(base, 2)
  one = jax.tree.map(jnp.copy, base)
  firsts = []
  for s, p in zip(slots, prompts):
    one, tok = serving.insert(model, one, s, p)
    firsts.append(int(tok))
  before = [row_bytes(base.state, r) for r in range(CAP)]
  traces = pool_mod.TRACE_COUNTS["insert_many"]
  many, toks = serving.insert_many(model, base, slots, prompts)
  assert np.asarray(toks).tolist() == firsts
  assert pool_mod.TRACE_COUNTS["insert_many"] == traces + 1
  for r in range(CAP):
    if r not in slots:
      assert row_bytes(many.state, r) == before[r], r
  for a, b in zip(jax.tree.leaves(rows(many.state, slots)),
                  jax.tree.leaves(rows(one.state, slots))):
    if jnp.issubdtype(a.dtype, jnp.floating):
      testing.assert_close(a, b, TOL, "inserted rows")
    else:
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(many.active, one.active)
  _, t_many = serving.step_n(model, many, 4)
  _, t_one = serving.step_n(model, one, 4)
  np.testing.assert_array_equal(t_many, t_one)


def test_insert_many_compiles_per_padded_batch_and_bucket(model):
  # A pool layout of its own (max_len 40), so nothing is compiled yet.
  pool = serving.init_pool(model, CAP, 40, buffer_len=L)
  traces = pool_mod.TRACE_COUNTS["insert_many"]
  pool, _ = serving.insert_many(model, pool, [0, 1, 2],
                                [prompt(1, 4), prompt(2, 7), prompt(3, 2)])
  assert pool_mod.TRACE_COUNTS["insert_many"] == traces + 1
  # 3 rows padded to 4 compiled what 4 rows of that bucket (16) run; two
  # rows of bucket 32 compile once more.
  pool, _ = serving.insert_many(model, pool, [5, 4, 3, 0],
                                [prompt(4, 6), prompt(5, 1), prompt(6, 16),
                                 prompt(7, 3)])
  assert pool_mod.TRACE_COUNTS["insert_many"] == traces + 1
  pool, _ = serving.insert_many(model, pool, [1, 2],
                                [prompt(8, 20), prompt(9, 30)])
  assert pool_mod.TRACE_COUNTS["insert_many"] == traces + 2
  assert np.asarray(pool.active).all()


def test_insert_many_samples_each_row_with_its_key(model):
  """A sampled row draws the token `insert` draws with the same key and
  temperature; a greedy row beside it takes the argmax."""
  prompts = [prompt(70 + i, 6 + i) for i in range(3)]
  keys = [jax.random.PRNGKey(100 + i) for i in range(3)]
  temps = [1.5, 0.0, 2.0]
  pool = serving.init_pool(model, CAP, MAX_LEN, buffer_len=L)
  _, toks = serving.insert_many(model, pool, [0, 1, 2], prompts,
                                temperatures=temps, keys=keys)
  for i, (p, k, t) in enumerate(zip(prompts, keys, temps)):
    one = serving.init_pool(model, CAP, MAX_LEN, buffer_len=L)
    _, tok = serving.insert(model, one, i, p, temperature=t,
                            rng=k if t > 0 else None)
    assert int(toks[i]) == int(tok), i


def test_insert_many_bad_arguments_are_named(model):
  pool = serving.init_pool(model, CAP, 8, buffer_len=L)
  with pytest.raises(ValueError, match="distinct"):
    serving.insert_many(model, pool, [1, 1], [prompt(0, 3), prompt(1, 3)])
  with pytest.raises(ValueError, match="one prompt per slot"):
    serving.insert_many(model, pool, [0, 1], [prompt(0, 3)])
  with pytest.raises(ValueError, match="slot"):
    serving.insert_many(model, pool, [CAP], [prompt(0, 3)])
  with pytest.raises(ValueError, match=r"prompts\[1\]"):
    serving.insert_many(model, pool, [0, 1], [prompt(0, 3), prompt(1, 9)])
  with pytest.raises(ValueError, match=r"prompts\[0\]"):
    serving.insert_many(model, pool, [0], [np.array([CFG.vocab_size])])
  with pytest.raises(ValueError, match="temperatures"):
    serving.insert_many(model, pool, [0], [prompt(0, 3)],
                        temperatures=[-1.0])
  with pytest.raises(ValueError, match="keys"):
    serving.insert_many(model, pool, [0], [prompt(0, 3)],
                        temperatures=[0.5])


def test_engine_batches_its_admissions(model):
  """Eight requests at once: admitted in batched prefills (prefill_batch
  4) or one by one, the same greedy tokens."""
  reqs = [(f"r{i}", prompt(80 + i, 3 + 2 * i), 4 + i % 3) for i in range(8)]
  out = {}
  for batch in (4, 1):
    eng = serving.Engine(model, CAP, MAX_LEN, steps_per_dispatch=3,
                         buffer_len=L, prefill_batch=batch)
    for rid, p, n in reqs:
      eng.submit(serving.Request(rid, p, n))
    traces = pool_mod.TRACE_COUNTS["insert_many"]
    out[batch] = eng.run()
    assert eng.stats.admissions == len(reqs)
    if batch == 4:
      assert pool_mod.TRACE_COUNTS["insert_many"] > traces
  assert out[4] == out[1]


def run_engine(model, reqs, poison_free=False, **kw):
  eng = serving.Engine(model, 8, MAX_LEN, steps_per_dispatch=3,
                       buffer_len=L, **kw)
  for rid, p, n, temp in reqs:
    eng.submit(serving.Request(rid, p, n, temperature=temp, seed=len(rid)))
  eng.dispatch()
  if poison_free:  # every free slot's row NaN / inf / garbage
    for slot, req in enumerate(eng.slots):
      if req is None:
        eng.pool = poison(eng.pool, slot)
  return eng, eng.run()


@pytest.mark.parametrize("ssm_mode", ("replay", "baseline"))
def test_compacted_dispatches_give_the_pools_tokens(model, ssm_mode):
  """Three requests in eight slots, one sampled: decoded as a batch of 4
  gathered rows (padded with a poisoned free slot), as 4 rows stepped in
  the pool through their slots (`compact_in_place`) or as the whole pool,
  the same tokens."""
  reqs = [("a", prompt(90, 5), 7, 0.0), ("bb", prompt(91, 9), 4, 0.0),
          ("ccc", prompt(92, 3), 8, 1.3)]
  eng, compact = run_engine(model, reqs, poison_free=True,
                            compact_in_place=False, ssm_mode=ssm_mode)
  assert eng.stats.compacted == eng.stats.dispatches > 0
  eng, in_place = run_engine(model, reqs, poison_free=True,
                             compact_in_place=True, ssm_mode=ssm_mode)
  assert eng.stats.compacted == eng.stats.dispatches > 0
  eng, whole = run_engine(model, reqs, compact_below=0.0, ssm_mode=ssm_mode)
  assert eng.stats.compacted == 0
  assert compact == whole
  assert in_place == whole


def test_in_place_compaction_default(model):
  """Compacted dispatches step the pool's rows in place where every layer
  takes a slot per row itself (Mamba-2, Gated DeltaNet, attention), else
  gather them (a Kimi Delta Attention layer would be gathered at every
  step); in place, the whole pool's tokens."""
  for mode in ("replay", "baseline"):
    assert serving.Engine(model, 4, MAX_LEN, ssm_mode=mode).compact_in_place
  kda = build_model(5, 9, dataclasses.replace(CFG, pattern="M*K-M"))
  assert not serving.Engine(kda, 4, MAX_LEN).compact_in_place
  assert not serving.Engine(model, 4, MAX_LEN,
                            compact_in_place=False).compact_in_place
  reqs = [("a", prompt(80, 6), 6, 0.0), ("b", prompt(81, 4), 5, 0.9)]
  eng, in_place = run_engine(model, reqs, poison_free=True)
  assert eng.compact_in_place and eng.stats.compacted > 0
  assert in_place == run_engine(model, reqs, compact_below=0.0)[1]


def test_precompile_leaves_nothing_to_compile(model):
  reqs = [(f"r{i}", prompt(95 + i, 2 + 3 * i), 3 + i, 0.0) for i in range(5)]
  eng = serving.Engine(model, 8, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L, prefill_batch=2)
  eng.precompile(max(len(p) for _, p, _, _ in reqs))
  assert not eng.busy and eng.stats.dispatches == 0
  jitted = (controls.decode, controls.admit, controls.request_keys,
            pool_mod._insert_many_jit)  # pylint: disable=protected-access
  sizes = [f._cache_size() for f in jitted]  # pylint: disable=protected-access
  for i, (rid, p, n, temp) in enumerate(reqs):  # arrivals one by one
    eng.submit(serving.Request(rid, p, n, temperature=temp))
    if i % 2:
      eng.dispatch()
  eng.run()
  assert [f._cache_size() for f in jitted] == sizes  # pylint: disable=protected-access
  assert eng.stats.compacted > 0


def test_precompile_from_a_shortest_prompt():
  """precompile(min_prompt_len=m) compiles the prefills of prompts of m
  tokens and more (one bucket here, batches of 1 and 2): such prompts then
  compile nothing, while a shorter prompt's smaller bucket compiles."""
  # A model of its own (a graph no other test's jitted calls have seen),
  # so that the trace counts are this test's.
  own = build_model(5, 6, dataclasses.replace(CFG, norm_eps=2e-5))
  eng = serving.Engine(own, 4, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L, prefill_batch=2)
  lo = serving.bucket_len(1, MAX_LEN) + 1  # past the smallest bucket
  count = lambda: pool_mod.TRACE_COUNTS["insert_many"]
  before = count()
  eng.precompile(lo + 4, min_prompt_len=lo)
  assert count() == before + 2  # one bucket, batches of 1 and 2
  for i, t in enumerate((lo, lo + 4, lo + 2)):
    eng.submit(serving.Request(f"r{i}", prompt(170 + i, t), 3))
  eng.run()
  assert count() == before + 2
  eng.submit(serving.Request("short", prompt(180, 2), 2))
  eng.run()
  assert count() == before + 3


def test_precompile_covers_the_prefix_cache(model):
  """With a prefix cache: precompile runs every shape its admissions need
  (misses, hits, extensions of a cached prefix, prompts shorter than a
  block, a miss stored where the prompt parts from an earlier one with
  the rest's prefill in a larger bucket; admitted one by one, then in
  batches) on a throwaway cache, leaving the engine's cache empty."""
  cache = serving.PrefixCache(block=4, max_entries=8)
  eng = serving.Engine(model, 4, MAX_LEN, steps_per_dispatch=2,
                       buffer_len=L, prefix_cache=cache)
  system = np.asarray(prompt(130, 9))
  reqs = [np.concatenate([system[:n], np.asarray(prompt(131 + i, t))])
          for i, (n, t) in enumerate([(9, 3), (9, 6), (4, 1), (0, 3),
                                      (8, 9), (0, 14)])]
  other = np.asarray(prompt(150, 21))  # then 4 of its tokens + 17 others
  reqs += [other, np.concatenate([other[:4], np.asarray(prompt(151, 17))])]
  eng.precompile(max(len(p) for p in reqs))
  assert len(cache) == 0 and cache.stats()["lookups"] == 0
  jitted = (pc_mod._prefill_jit, pc_mod._extend_jit,  # pylint: disable=protected-access
            pc_mod._finish_many_jit, pc_mod._take_jit,  # pylint: disable=protected-access
            pool_mod._insert_many_jit, controls.admit, controls.request_keys)  # pylint: disable=protected-access
  sizes = [f._cache_size() for f in jitted]  # pylint: disable=protected-access
  for i, p in enumerate(reqs):  # one by one: hits, misses, extensions
    eng.submit(serving.Request(i, p, 3))
    eng.dispatch()
  eng.run()
  hits = cache.stats()["hits"]
  assert hits > 0
  for i, p in enumerate(reqs):  # then at once: batches of up to 4, hits
    eng.submit(serving.Request(f"again{i}", p, 3))  # beside short prompts
  eng.run()
  assert cache.stats()["hits"] > hits + 2
  assert pc_mod.TRACE_COUNTS["finish_many"] > 0
  assert [f._cache_size() for f in jitted] == sizes  # pylint: disable=protected-access


def test_compacted_batches_are_at_least_a_sixteenth(model):
  eng = serving.Engine(model, 64, MAX_LEN, buffer_len=L)
  assert eng._rows([3]).tolist() == [3, 0, 1, 2]  # pylint: disable=protected-access
  assert len(eng._rows(list(range(5)))) == 8  # pylint: disable=protected-access
  assert eng._rows(list(range(33))) is None  # pylint: disable=protected-access


def test_engine_arguments_are_named(model):
  with pytest.raises(ValueError, match="compact_below"):
    serving.Engine(model, 4, MAX_LEN, compact_below=1.5)
  with pytest.raises(ValueError, match="prefill_batch"):
    serving.Engine(model, 4, MAX_LEN, prefill_batch=0)
  eng = serving.Engine(model, 4, MAX_LEN, buffer_len=L)
  with pytest.raises(ValueError, match="max_prompt_len"):
    eng.precompile(MAX_LEN + 1)
  with pytest.raises(ValueError, match="min_prompt_len"):
    eng.precompile(8, min_prompt_len=9)
  eng.submit(serving.Request("x", prompt(1, 3), 2))
  with pytest.raises(ValueError, match="idle"):
    eng.precompile(8)
