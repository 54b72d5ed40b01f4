"""Prefix caching (replayssm_jax.serving.insert_cached): a request that
starts from a cached block-aligned state decodes as `insert` of its whole
prompt; the counters, the LRU order and the snapshots' isolation from the
(donated) pool; a poisoned slot reused; bad arguments are named.

A tiny hybrid model with Mamba-2 ('M'), attention ('*'), Gated DeltaNet
('G') and MLP ('-') blocks, random weights (norm weights randomized too),
f32, as tests/test_serving_pool.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import serving
from replayssm_jax.serving import prefix_cache as pc
from tests.serving_common import build_model, poison, prompt

CAP, MAX_LEN, L, BLOCK = 4, 48, 4, 4
MODES = ("replay", "baseline")
# A prefill split at a block boundary (the cached prefix, then the rest
# continued from it) vs one over the whole prompt: the summation order
# only, the f32 tolerance of tests/test_chunked_prefill.py; the decode
# steps after them start from states that differ by that much.
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def model():
  return build_model(3, 7)


def prompts():
  a = prompt(1, 11)  # ends inside a block (K = 2)
  b = prompt(2, 2 * BLOCK + 1)  # a block boundary + 1
  c = jnp.concatenate([a[:2 * BLOCK], prompt(3, 5)])  # shares a's 2 blocks
  return {"a": a, "b": b, "c": c}


def new_pool(model, ssm_mode):
  return serving.init_pool(model, CAP, MAX_LEN, ssm_mode=ssm_mode,
                           buffer_len=L)


def run(model, ssm_mode, inserts, n=5, pool=None, cache=None):
  """Inserts (name, slot, tokens) through `insert_cached` (cache given) or
  `insert`, then n steps -> (pool, {name: tokens [1 + n]}, {name: logits
  [1 + n, vocab]})."""
  pool = new_pool(model, ssm_mode) if pool is None else pool
  toks, lgs, slots = {}, {}, {}
  for name, slot, tokens in inserts:
    if cache is None:
      pool, t, lg = serving.insert(model, pool, slot, tokens,
                                   return_logits=True)
    else:
      pool, t, lg = serving.insert_cached(model, pool, cache, slot, tokens,
                                          return_logits=True)
    toks[name], lgs[name], slots[name] = [int(t)], [np.asarray(lg)], slot
  pool, st, sl = serving.step_n(model, pool, n, return_logits=True)
  for name, slot in slots.items():
    toks[name] = np.array(toks[name] + np.asarray(st)[slot].tolist())
    lgs[name] = np.concatenate([np.stack(lgs[name]),
                                np.asarray(sl)[slot]])
  return pool, toks, lgs


def assert_same(got, want, what):
  (gt, gl), (wt, wl) = got, want
  for name in wt:
    np.testing.assert_array_equal(gt[name], wt[name],
                                  err_msg=f"{what}: {name} tokens")
    np.testing.assert_allclose(gl[name], wl[name], atol=ATOL, rtol=RTOL,
                               err_msg=f"{what}: {name} logits")


def leaf_bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("ssm_mode", MODES)
def test_cache_hits_equal_plain_insert(model, ssm_mode):
  """a (ends inside a block), b (block boundary + 1) and c (a's first two
  blocks + its own tail) through the cache, once filling it, then again
  hitting it: the same first tokens, step_n tokens and logits as `insert`
  without a cache."""
  p = prompts()
  inserts = [("a", 0, p["a"]), ("b", 1, p["b"]), ("c", 2, p["c"])]
  _, *want = run(model, ssm_mode, inserts)
  cache = serving.PrefixCache(BLOCK, 8)
  pool, *got = run(model, ssm_mode, inserts, cache=cache)
  assert_same(got, want, "filling")
  assert cache.stats()["hits"] == 1  # c hit a's blocks
  for s in range(3):
    pool = serving.evict(pool, s)
  # Other slots this time (the rows go wherever asked).
  again = [("a", 3, p["a"]), ("b", 0, p["b"]), ("c", 1, p["c"])]
  _, *want2 = run(model, ssm_mode, again)
  _, *got2 = run(model, ssm_mode, again, pool=pool, cache=cache)
  assert_same(got2, want2, "hitting")
  st = cache.stats()
  assert (st["lookups"], st["hits"], st["misses"]) == (6, 4, 2), st


def test_stats_count_hits_misses_and_reused_tokens(model):
  p = prompts()
  cache = serving.PrefixCache(BLOCK, 8)
  pool = new_pool(model, "replay")
  seq = [(p["a"], False, 0), (p["a"], True, 8), (p["c"], True, 8),
         (prompt(4, 3), False, 0), (p["b"], False, 0), (p["c"], True, 8)]
  lookups = hits = reused = 0
  for i, (tokens, hit, saved) in enumerate(seq):
    pool, _ = serving.insert_cached(model, pool, cache, i % CAP, tokens)
    lookups, hits, reused = lookups + 1, hits + hit, reused + saved
    st = cache.stats()
    assert (st["lookups"], st["hits"], st["misses"],
            st["reused_tokens"]) == (lookups, hits, lookups - hits,
                                     reused), (i, st)
  assert st["hit_rate"] == pytest.approx(3 / 6)
  # a at 2 blocks, b at 2; c hit a's 2 blocks, the first time storing
  # nothing (its third block seen in no earlier prompt), the second
  # extending them to its third; the 3-token prompt has no whole block
  # before its last token.
  assert st["entries"] == 3 and st["evictions"] == 0
  ka, kc, kb = cache.keys(p["a"]), cache.keys(p["c"]), cache.keys(p["b"])
  assert ka[:2] == kc[:2] and ka[0] != kb[0]
  assert all(k in cache for k in (ka[1], kc[2], kb[1]))
  assert ka[0] not in cache  # one row per miss


def test_lru_eviction_at_max_entries(model):
  cache = serving.PrefixCache(BLOCK, 2)
  pool = new_pool(model, "replay")
  p1, p2, p3 = prompt(11, 6), prompt(12, 7), prompt(13, 5)  # 1 block each
  k1, k2, k3 = (cache.keys(q)[0] for q in (p1, p2, p3))
  pool, _ = serving.insert_cached(model, pool, cache, 0, p1)
  pool, _ = serving.insert_cached(model, pool, cache, 1, p2)
  assert k1 in cache and k2 in cache
  pool, _ = serving.insert_cached(model, pool, cache, 2, p1)  # p1 used last
  pool, _ = serving.insert_cached(model, pool, cache, 3, p3)
  assert k1 in cache and k3 in cache and k2 not in cache
  st = cache.stats()
  assert st["entries"] == 2 and st["evictions"] == 1 and st["hits"] == 1


@pytest.mark.parametrize("ssm_mode", MODES)
def test_snapshot_unchanged_by_later_pool_work(model, ssm_mode):
  """The pool is donated by insert / step_n: the cached row is a copy that
  later steps, inserts into the same slot and hits never change."""
  tokens = prompt(21, 10)
  cache = serving.PrefixCache(BLOCK, 4)
  pool = new_pool(model, ssm_mode)
  pool, _ = serving.insert_cached(model, pool, cache, 0, tokens)
  key = cache.keys(tokens)[1]
  before = leaf_bytes(cache.get(key))
  pool, _ = serving.step_n(model, pool, 6)
  pool, _ = serving.insert_cached(model, pool, cache, 0, tokens)  # a hit
  pool, _ = serving.step_n(model, pool, 3)
  pool, _ = serving.insert_cached(model, pool, cache, 1, tokens)
  pool, _ = serving.step(model, pool)
  assert leaf_bytes(cache.get(key)) == before
  assert cache.stats()["hits"] == 2


@pytest.mark.parametrize("ssm_mode", MODES)
def test_poisoned_slot_reused_through_the_cache(model, ssm_mode):
  p = prompts()
  cache = serving.PrefixCache(BLOCK, 4)
  pool = new_pool(model, ssm_mode)
  pool, _ = serving.insert_cached(model, pool, cache, 0, p["a"])
  pool, _ = serving.step_n(model, pool, 2)
  pool = serving.evict(pool, 0)
  pool = poison(pool, 1)
  pool = poison(pool, 0)
  inserts = [("c", 1, p["c"]), ("a", 0, p["a"])]  # both hit
  _, *want = run(model, ssm_mode, inserts)
  _, *got = run(model, ssm_mode, inserts, pool=pool, cache=cache)
  for name in ("a", "c"):
    assert np.isfinite(got[1][name]).all() and (got[0][name] >= 0).all()
  assert_same(got, want, "poisoned slots")
  assert cache.stats()["hits"] == 2


def test_bad_arguments_are_named(model):
  with pytest.raises(ValueError, match="block"):
    serving.PrefixCache(0, 4)
  with pytest.raises(ValueError, match="block"):
    serving.PrefixCache(-2, 4)
  with pytest.raises(ValueError, match="max_entries"):
    serving.PrefixCache(4, 0)
  cache = serving.PrefixCache(BLOCK, 4)
  pool = serving.init_pool(model, CAP, 8, buffer_len=L)
  with pytest.raises(ValueError, match="prompt_tokens"):
    serving.insert_cached(model, pool, cache, 0, prompt(0, 9))  # > 8
  with pytest.raises(ValueError, match="prompt_tokens"):
    serving.insert_cached(model, pool, cache, 0, jnp.zeros((0,), jnp.int32))
  with pytest.raises(TypeError, match="prompt_tokens"):
    serving.insert_cached(model, pool, cache, 0, jnp.ones((3,), jnp.float32))
  with pytest.raises(ValueError, match="slot"):
    serving.insert_cached(model, pool, cache, CAP, prompt(0, 3))
  with pytest.raises(TypeError, match="cache"):
    serving.insert_cached(model, pool, {}, 0, prompt(0, 3))
  pool, _ = serving.insert_cached(model, pool, cache, 0, prompt(0, 6))
  other = serving.init_pool(model, CAP, 16, buffer_len=L)  # another max_len
  with pytest.raises(ValueError, match="cache"):
    serving.insert_cached(model, other, cache, 0, prompt(0, 6))
  assert pc.TRACE_COUNTS["finish"] >= 1


def test_a_hit_runs_only_the_rest_from_the_cached_row(model):
  """A hit starts from the cached row: with b's 2-block state planted
  under a's key, a's request continues b's prefix with a's tail, as
  `insert` of b[:8] + a[8:] does."""
  p = prompts()
  cache = serving.PrefixCache(BLOCK, 4)
  pool = new_pool(model, "replay")
  pool, _ = serving.insert_cached(model, pool, cache, 0, p["a"])
  pool, _ = serving.insert_cached(model, pool, cache, 1, p["b"])
  ka, kb = cache.keys(p["a"])[1], cache.keys(p["b"])[1]
  cache.put(ka, cache.get(kb))
  mixed = jnp.concatenate([p["b"][:2 * BLOCK], p["a"][2 * BLOCK:]])
  _, *want = run(model, "replay", [("x", 2, mixed)])
  _, *got = run(model, "replay", [("x", 2, p["a"])], pool=pool, cache=cache)
  assert_same(got, want, "planted row")


@pytest.mark.parametrize("ssm_mode", MODES)
def test_a_shared_prefix_is_stored_where_prompts_part(model, ssm_mode):
  """Three prompts of a shared 2-block header and 3-block tails of their
  own: the first stores its row at its last block (3), the second, which
  misses, where it parts from the first (2: the header's state), the
  third hits the header; each equals `insert` (tokens, logits). A cache
  remembering too few keys stores at the last block again."""
  header = prompt(50, 2 * BLOCK)
  ps = [jnp.concatenate([header, prompt(51 + i, BLOCK + 1)])
        for i in range(3)]
  inserts = [(f"p{i}", i, p) for i, p in enumerate(ps)]
  _, *want = run(model, ssm_mode, inserts)
  cache = serving.PrefixCache(BLOCK, 8)
  _, *got = run(model, ssm_mode, inserts, cache=cache)
  assert_same(got, want, "shared header")
  keys = [cache.keys(p) for p in ps]
  assert keys[0][:2] == keys[1][:2] == keys[2][:2]
  assert keys[0][2] in cache and keys[1][1] in cache
  assert keys[1][2] not in cache and keys[2][2] not in cache
  st = cache.stats()
  assert (st["hits"], st["misses"], st["reused_tokens"]) == (
      1, 2, 2 * BLOCK), st
  # p1 again hits the header and, its third block seen before, extends the
  # row to 3 blocks; a third time it hits those.
  again = [("p1", 0, ps[1]), ("p1 again", 1, ps[1])]
  _, *want = run(model, ssm_mode, again)
  _, *got = run(model, ssm_mode, again, cache=cache)
  assert_same(got, want, "extended")
  assert keys[1][2] in cache
  st = cache.stats()
  assert (st["hits"], st["reused_tokens"]) == (3, 7 * BLOCK), st

  forgetful = serving.PrefixCache(BLOCK, 8, max_seen=1)  # p0's last key
  pool = new_pool(model, ssm_mode)
  for i, p in enumerate(ps[:2]):
    pool, _ = serving.insert_cached(model, pool, forgetful, i, p)
  assert keys[1][2] in forgetful and keys[1][1] not in forgetful
  with pytest.raises(ValueError, match="max_seen"):
    serving.PrefixCache(BLOCK, 8, max_seen=0)


@pytest.mark.parametrize("ssm_mode", MODES)
def test_hits_ending_inside_a_block_equal_insert(model, ssm_mode):
  """Prompts of a shared 2-block prefix and tails of 1, 3, 5 and 7 tokens
  (ending inside a block; the 13- and 15-token prompts share their third
  block with no other prompt, so nothing extends the cached 2 blocks)
  after one request filled the cache: each hit's first token is
  `insert`'s and its logits are within the f32 tolerance; the rest of the
  prompt runs as one continued prefill compiled once for the bucket (no
  retrace after the filling request)."""
  shared = prompt(30, 2 * BLOCK)
  cache = serving.PrefixCache(BLOCK, 8)
  pool = new_pool(model, ssm_mode)
  pool, _ = serving.insert_cached(model, pool, cache, 0,
                                  jnp.concatenate([shared, prompt(31, 2)]))
  before = dict(pc.TRACE_COUNTS)
  for i, tail in enumerate((1, 3, 5, 7)):
    tokens = jnp.concatenate([shared, prompt(40 + i, tail)])
    pool, tok, lg = serving.insert_cached(model, pool, cache, 1 + i % 3,
                                          tokens, return_logits=True)
    _, want_tok, want_lg = serving.insert(model, new_pool(model, ssm_mode),
                                          1, tokens, return_logits=True)
    assert int(tok) == int(want_tok), tail
    np.testing.assert_allclose(lg, want_lg, atol=ATOL, rtol=RTOL,
                               err_msg=f"tail {tail}")
  st = cache.stats()
  assert (st["hits"], st["reused_tokens"]) == (4, 4 * 2 * BLOCK), st
  grew = {k: pc.TRACE_COUNTS[k] - before[k] for k in before}
  assert grew["finish"] == 0 and grew["extend"] == 0, grew


@pytest.mark.parametrize("ssm_mode", MODES)
def test_batched_admission_equals_one_at_a_time(model, ssm_mode):
  """insert_cached_many of a short prompt (no whole block: through
  insert_many), a miss (a), another miss (b) and c, which hits the row a
  stored earlier in the same batch: the first tokens, step_n tokens and
  logits and the cache's statistics of insert_cached one prompt at a time;
  then a second batch, every prompt but the short one hitting, in other
  slots."""
  p = prompts()
  p["s"] = prompt(5, BLOCK - 1)
  first = [("a", 0, p["a"]), ("s", 1, p["s"]), ("b", 2, p["b"]),
           ("c", 3, p["c"])]
  again = [("c", 0, p["c"]), ("a", 2, p["a"]), ("s", 3, p["s"])]

  def many(cache, inserts, pool=None):
    pool = new_pool(model, ssm_mode) if pool is None else pool
    names, slots, toks = zip(*inserts)
    pool, firsts = serving.insert_cached_many(
        model, pool, cache, list(slots), [np.asarray(t) for t in toks])
    assert firsts.shape == (len(slots),)
    pool, st, sl = serving.step_n(model, pool, 5, return_logits=True)
    return pool, (
        {n: np.array([int(f)] + np.asarray(st)[s].tolist())
         for n, s, f in zip(names, slots, np.asarray(firsts))},
        {n: np.asarray(sl)[s] for n, s in zip(names, slots)})

  def one_at_a_time(cache, inserts, pool=None):
    pool, toks, lgs = run(model, ssm_mode, inserts, pool=pool, cache=cache)
    return pool, (toks, {n: lg[1:] for n, lg in lgs.items()})

  caches = serving.PrefixCache(BLOCK, 8), serving.PrefixCache(BLOCK, 8)
  pools = []
  for cache, fn in zip(caches, (many, one_at_a_time)):
    pool, res = fn(cache, first)
    pools.append((pool, res))
  assert_same(pools[0][1], pools[1][1], "first batch")
  assert caches[0].stats() == caches[1].stats()
  assert caches[0].stats()["hits"] == 1  # c, on a's row of this batch
  results = []
  for (pool, _), cache, fn in zip(pools, caches, (many, one_at_a_time)):
    pool = serving.evict_many(pool, [0, 1, 2, 3])
    results.append(fn(cache, again, pool)[1])
  assert_same(results[0], results[1], "second batch")
  st = caches[0].stats()
  assert st == caches[1].stats() and st["hits"] == 3, st


def test_batched_admission_pads_and_checks(model):
  """padded=True returns the power-of-two batch's tokens; the batch's
  arguments are checked as insert_many's, errors naming them."""
  p = prompts()
  cache = serving.PrefixCache(BLOCK, 8)
  pool = new_pool(model, "replay")
  pool, firsts = serving.insert_cached_many(
      model, pool, cache, [2, 0, 1],
      [np.asarray(p[n]) for n in "abc"], padded=True)
  assert firsts.shape == (4,) and (np.asarray(firsts)[:3] >= 0).all()
  with pytest.raises(ValueError, match="slots"):
    serving.insert_cached_many(model, pool, cache, [1, 1],
                               [np.asarray(p["a"])] * 2)
  with pytest.raises(TypeError, match="cache"):
    serving.insert_cached_many(model, pool, {}, [1], [np.asarray(p["a"])])
