"""The slot pool (replayssm_jax.serving): requests inserted at different
times decode exactly as independent batch-1 runs; insert writes only its
slot; a reused slot's stale (poisoned) contents never reach the new
request; free slots never reach active rows and the step updates the
pool in place; bad arguments are named.

A tiny hybrid model with Mamba-2 ('M'), attention ('*'), Gated DeltaNet
('G') and MLP ('-') blocks, random weights (norm weights randomized too,
so that greedy tokens vary), f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import models, serving, testing
from replayssm_jax.precision import PrecisionPolicy
from replayssm_jax.serving import pool as pool_mod
from tests.serving_common import CFG, build_model, poison, prompt

CAP, MAX_LEN, L = 4, 48, 4
MODES = ("replay", "baseline")
TOL = testing.tolerance(jnp.float32)


@pytest.fixture(scope="module")
def model():
  return build_model(3, 7)


def reference(model, tokens, n, ssm_mode, **state_kwargs):
  """Greedy tokens [n] and logits [n, vocab] of a batch-1 prefill +
  decode_step run (first: the prefill's)."""
  state = model.init_state(1, MAX_LEN, ssm_mode=ssm_mode, buffer_len=L,
                           **state_kwargs)
  logits, state = models.prefill(model, tokens[None],
                                 jnp.array([tokens.shape[0]]), state)
  toks, lgs = [], []
  for _ in range(n):
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    toks.append(int(tok[0]))
    lgs.append(np.asarray(logits[0]))
    logits, state = models.decode_step(model, tok, state)
  return np.array(toks), np.stack(lgs)


class Driver:
  """Runs a pool and records each request's (token, logits) stream."""

  def __init__(self, model, ssm_mode, **state_kwargs):
    self.model = model
    self.pool = serving.init_pool(model, CAP, MAX_LEN, ssm_mode=ssm_mode,
                                  buffer_len=L, **state_kwargs)
    self.row_ids = {}  # name -> row_id given to insert
    self.owner = {}  # slot -> request name
    self.out = {}  # name -> ([tokens], [logits])

  def insert(self, name, slot, tokens, traced_slot=False, row_id=None):
    s = jnp.int32(slot) if traced_slot else slot
    self.pool, tok, logits = serving.insert(self.model, self.pool, s, tokens,
                                            row_id=row_id, return_logits=True)
    self.row_ids[name] = row_id
    self.owner[slot] = name
    self.out[name] = ([int(tok)], [np.asarray(logits)])

  def evict(self, slot):
    self.pool = serving.evict(self.pool, slot)
    del self.owner[slot]

  def step_n(self, n):
    if n == 1:
      self.pool, toks, logits = serving.step(self.model, self.pool,
                                             return_logits=True)
      toks, logits = toks[:, None], logits[:, None]
    else:
      self.pool, toks, logits = serving.step_n(self.model, self.pool, n,
                                               return_logits=True)
    toks, logits = np.asarray(toks), np.asarray(logits)
    for slot in range(CAP):
      if slot not in self.owner:
        assert (toks[slot] == -1).all(), f"inactive slot {slot} emitted"
        continue
      t, lg = self.out[self.owner[slot]]
      t.extend(toks[slot].tolist())
      lg.extend(logits[slot])

  def check(self, model, prompts, ssm_mode, tol=TOL, **state_kwargs):
    for name, (toks, lgs) in self.out.items():
      if self.row_ids[name] is not None:
        state_kwargs["row_ids"] = np.array([self.row_ids[name]])
      ref_t, ref_l = reference(model, prompts[name], len(toks), ssm_mode,
                               **state_kwargs)
      np.testing.assert_array_equal(np.array(toks), ref_t,
                                    err_msg=f"request {name} tokens")
      testing.assert_close(np.stack(lgs), ref_l, tol, f"request {name}")


def row_bytes(tree, row):
  return [np.asarray(x)[row].tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("ssm_mode", MODES)
def test_staggered_requests_match_independent_runs(model, ssm_mode):
  """Requests arrive while others are mid-buffer (L = 4), and a slot is
  reused after an eviction; every request's stream equals its own batch-1
  run, tokens exactly, logits to the f32 tolerance."""
  prompts = {"a": prompt(1, 5), "b": prompt(2, 11), "c": prompt(3, 3),
             "d": prompt(4, 17), "e": prompt(5, 7)}
  d = Driver(model, ssm_mode)
  d.insert("a", 0, prompts["a"])
  d.step_n(3)  # a at count 3 of 4
  d.insert("b", 2, prompts["b"], traced_slot=True)
  d.step_n(1)
  d.insert("c", 1, prompts["c"])  # a, b mid-buffer
  d.step_n(5)
  d.evict(0)
  d.insert("d", 3, prompts["d"])
  d.step_n(2)
  d.insert("e", 0, prompts["e"])  # the freed slot, reused
  d.step_n(6)
  if ssm_mode == "replay":
    counts = np.asarray(d.pool.state.layers[0].ssm.count)
    assert len(set(counts.tolist())) > 1, counts  # staggered counters
  d.check(model, prompts, ssm_mode)


def test_stochastic_rounding_keys_on_the_request_row_id(model):
  """With a stochastically rounding policy, insert stores the given row_id
  in the slot: each request decodes as a batch-1 run built with that row
  id (to the policy's tolerance: matmuls of another batch size may
  associate differently)."""
  pol = PrecisionPolicy.preset("bf16+sr").replace(seed=5)
  prompts = {"a": prompt(31, 7), "b": prompt(32, 5)}
  d = Driver(model, "replay", precision=pol)
  d.insert("a", 1, prompts["a"], row_id=9)
  d.step_n(3)
  d.insert("b", 3, prompts["b"], row_id=40)
  d.step_n(5)
  np.testing.assert_array_equal(
      np.asarray(d.pool.state.layers[0].ssm.row_id)[[1, 3]], [9, 40])
  d.check(model, prompts, "replay", tol=testing.tolerance(jnp.bfloat16),
          precision=pol)


def test_insert_writes_only_its_slot_and_compiles_once(model):
  pool = serving.init_pool(model, CAP, MAX_LEN, buffer_len=L)
  pool, _ = serving.insert(model, pool, 0, prompt(1, 6))
  pool, _ = serving.insert(model, pool, 3, prompt(2, 9))
  pool, _ = serving.step_n(model, pool, 3)
  traces = pool_mod.TRACE_COUNTS["insert"]
  for slot in (1, 2):
    before = [row_bytes(pool.state, r) for r in range(CAP)]
    pool, _ = serving.insert(model, pool, jnp.int32(slot), prompt(slot, 7))
    for r in range(CAP):
      same = row_bytes(pool.state, r) == before[r]
      assert same == (r != slot), (slot, r)
  assert pool_mod.TRACE_COUNTS["insert"] - traces <= 1  # one per bucket
  assert np.asarray(pool.active).all()


@pytest.mark.parametrize("ssm_mode", MODES)
def test_poisoned_evicted_slot_reuse(model, ssm_mode):
  """An evicted slot filled with NaN / inf / garbage ints is reused: the
  new request decodes as a fresh batch-1 run, finite; the other slot
  decodes as its own run too."""
  prompts = {"a": prompt(11, 9), "b": prompt(12, 5), "c": prompt(13, 6)}
  d = Driver(model, ssm_mode)
  d.insert("a", 0, prompts["a"])
  d.insert("b", 1, prompts["b"])
  d.step_n(3)
  d.evict(1)
  d.pool = poison(d.pool, 1)
  d.step_n(2)  # a decodes beside the poisoned free slot
  d.insert("c", 1, prompts["c"])
  d.step_n(6)
  for name, (toks, lgs) in d.out.items():
    assert np.isfinite(np.stack(lgs)).all(), name
    assert (np.array(toks) >= 0).all(), name
  d.check(model, prompts, ssm_mode)


@pytest.mark.parametrize("ssm_mode", MODES)
def test_free_slots_never_reach_active_rows(model, ssm_mode):
  """Free slots are decoded with the pool and their states left as the
  step makes them: an active row's state and tokens are bit for bit the
  same whether the free slots hold stale rows or NaN / inf / garbage."""
  pool = serving.init_pool(model, CAP, MAX_LEN, ssm_mode=ssm_mode,
                           buffer_len=L)
  pool, _ = serving.insert(model, pool, 0, prompt(21, 6))
  pool, _ = serving.insert(model, pool, 2, prompt(22, 4))
  pool, _ = serving.step_n(model, pool, 2)
  pool = serving.evict(pool, 2)
  runs = []
  for poisoned in (False, True):
    p = jax.tree.map(jnp.copy, pool)
    if poisoned:
      for slot in (1, 2, 3):
        p = poison(p, slot)
    p, toks = serving.step(model, p)
    p, toks_n = serving.step_n(model, p, 3)
    runs.append((row_bytes(p.state, 0), np.asarray(toks), np.asarray(toks_n)))
  (clean, toks, toks_n), (dirty, toks_p, toks_np) = runs
  assert clean == dirty
  np.testing.assert_array_equal(toks, toks_p)
  np.testing.assert_array_equal(toks_n, toks_np)
  assert (toks[1:] == -1).all() and (toks_n[1:] == -1).all()
  assert (toks_n[0] >= 0).all()


def test_step_does_not_copy_the_pool(model):
  """The compiled step_n updates the donated pool in place: its temporary
  buffers stay well below the pool's state bytes (selecting free slots'
  old state back would keep a second copy of every leaf live)."""
  pool = serving.init_pool(model, 16, 256, buffer_len=L)
  graphdef, params = nnx.split(model)
  sampling, rng = pool_mod.resolve_sampling(0.0, None, None, None)
  compiled = pool_mod._step_n_jit.lower(  # pylint: disable=protected-access
      graphdef, params, pool, 4, False, sampling, rng, None).compile()
  mem = compiled.memory_analysis()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(pool.state))
  assert mem.temp_size_in_bytes < 0.5 * state_bytes, (
      mem.temp_size_in_bytes, state_bytes)


def test_model_parts_hash_the_graph_once(model, monkeypatch):
  """The jitted pool functions take the graph as a static argument: with
  `model_parts` kept, calls never hash the nnx GraphDef again; the same
  model split again gets the same StaticGraph (interned), so calls
  through either never compare GraphDefs either (a jit cache compares a
  static argument of an equal hash that is not the same object)."""
  parts = serving.model_parts(model)
  assert serving.model_parts(model, parts)[0] is parts[0]
  again = serving.model_parts(model, nnx.split(model))
  assert again[0] is parts[0]
  pool = serving.init_pool(model, CAP, 16, buffer_len=L)
  pool, _ = serving.insert(model, pool, 0, prompt(5, 4), parts=parts)
  pool, _ = serving.step_n(model, pool, 2, parts=parts)  # compiled
  calls = []
  graph_type = type(parts[0].graphdef)
  real_hash, real_eq = graph_type.__hash__, graph_type.__eq__
  monkeypatch.setattr(graph_type, "__hash__",
                      lambda g: calls.append("hash") or real_hash(g))
  monkeypatch.setattr(graph_type, "__eq__",
                      lambda g, o: calls.append("eq") or real_eq(g, o))
  pool, _ = serving.insert(model, pool, 1, prompt(6, 4), parts=parts)
  pool, toks = serving.step_n(model, pool, 2, parts=again)
  assert not calls and (np.asarray(toks)[:2] >= 0).all()


def test_bad_arguments_are_named(model):
  pool = serving.init_pool(model, CAP, 8, buffer_len=L)
  with pytest.raises(ValueError, match="slot"):
    serving.insert(model, pool, CAP, prompt(0, 3))
  with pytest.raises(ValueError, match="slot"):
    serving.insert(model, pool, -1, prompt(0, 3))
  with pytest.raises(ValueError, match="slot"):
    serving.evict(pool, CAP)
  with pytest.raises(ValueError, match="prompt_tokens"):
    serving.insert(model, pool, 0, prompt(0, 9))  # > max_len 8
  with pytest.raises(ValueError, match="prompt_tokens"):
    serving.insert(model, pool, 0, jnp.zeros((0,), jnp.int32))
  with pytest.raises(ValueError, match="prompt_tokens"):
    serving.insert(model, pool, 0, jnp.array([1, CFG.vocab_size]))
  # A dtype error is a TypeError, as everywhere in the project.
  with pytest.raises(TypeError, match="prompt_tokens"):
    serving.insert(model, pool, 0, jnp.ones((3,), jnp.float32))
  with pytest.raises(ValueError, match="capacity"):
    serving.init_pool(model, 0, 8)
  with pytest.raises(ValueError, match="bucket"):
    serving.insert(model, pool, 0, prompt(0, 3), bucket=9)
  pool, _ = serving.insert(model, pool, 0, prompt(0, 6))
  with pytest.raises(ValueError, match="n: slots \\[0\\]"):
    serving.step_n(model, pool, 3)  # 6 + 3 > max_len 8
  with pytest.raises(ValueError, match="slot"):
    serving.evict_many(pool, [0, CAP])
  with pytest.raises(ValueError, match="slots\\[0\\] must be a Python int"):
    serving.evict_many(pool, [jnp.int32(0)])


def test_evict_many_equals_evicts_and_parts_are_reused(model):
  """evict_many frees exactly its slots, as one evict each; insert with
  parts= (a kept nnx.split) equals insert without."""
  pool = serving.init_pool(model, CAP, 16, buffer_len=L)
  parts = serving.model_parts(model)
  for slot in range(CAP):
    pool, tok = serving.insert(model, pool, slot, prompt(60 + slot, 5),
                               parts=parts)
    _, want = serving.insert(model, serving.init_pool(model, CAP, 16,
                                                      buffer_len=L),
                             slot, prompt(60 + slot, 5))
    assert int(tok) == int(want)
  one_by_one = serving.evict(serving.evict(pool, 0), 2)
  both = serving.evict_many(pool, [0, 2])
  np.testing.assert_array_equal(np.asarray(both.active),
                                np.asarray(one_by_one.active))
  np.testing.assert_array_equal(np.asarray(both.active),
                                [s not in (0, 2) for s in range(CAP)])


def test_traced_slot_under_jit_out_of_range_writes_nothing(model):
  """insert under a caller's jit takes a traced slot: in range it writes
  that slot; out of range (not checkable on the host) nothing."""
  tokens = prompt(41, 5)

  @jax.jit
  def put(pool, slot):
    return serving.insert(model, pool, slot, tokens)

  pool = serving.init_pool(model, CAP, MAX_LEN, buffer_len=L)
  pool, _ = serving.insert(model, pool, 0, prompt(42, 6))
  for slot in (CAP, -1):
    before = [row_bytes(pool, r) for r in range(CAP)]
    pool, _ = put(pool, jnp.int32(slot))
    assert [row_bytes(pool, r) for r in range(CAP)] == before, slot
  pool, first = put(pool, jnp.int32(2))
  assert np.asarray(pool.active).tolist() == [True, False, True, False]
  assert int(first) == reference(model, tokens, 1, "replay")[0][0]
