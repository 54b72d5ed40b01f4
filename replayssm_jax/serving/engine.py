"""A continuous-batching engine over the slot pool.

  engine = Engine(model, capacity=64, max_len=512, steps_per_dispatch=8)
  engine.submit(Request("a", prompt_a, max_new_tokens=100, eos_id=2))
  engine.submit(Request("b", prompt_b, max_new_tokens=20, temperature=0.8,
                        seed=1))
  results = engine.run(on_tokens=lambda rid, toks: print(rid, toks))

Each `dispatch` (one iteration of `run`): admit queued requests into free
slots (`pool.insert_many`: prompts of one length bucket prefilled together
and written into their slots, first tokens sampled), then run
`steps_per_dispatch` decode steps in one jitted `lax.fori_loop` over the
whole pool, or over the running slots' rows gathered into a smaller batch
when few slots run (`compact_below`), then read the tokens back once and
stream them to `on_tokens`, and evict the requests that finished.

Where the host waits. One dispatch is one compiled call and one device ->
host copy of its [capacity, n] tokens: the host is synchronised once per n
steps, not per step. The stopping rules run on the device inside the loop:
each slot keeps a budget of tokens still to generate and its eos id; a
slot that emits its eos or exhausts its budget goes inactive at once: it
emits nothing more, and its row is decoded on as a free slot's is
(`pool.step`: contents unspecified, never read, overwritten by the next
`insert`). A
request that finishes early in a dispatch leaves its slot idle for the
rest of it; a smaller `steps_per_dispatch` admits sooner, a larger one
pays fewer host round trips (the trade-off `stats` measures: host time
per step against the device's).

Sampling per request. Each slot carries its own temperature (0: greedy)
and its own PRNG key stream (from `Request.seed`, split once per step),
so a request's tokens do not depend on which slot or batch it ran in
(up to the batch's effect on matmul rounding). top_k and top_p, being
static shapes of the sampling filter, are set per engine.

With a `prefix_cache` (`serving.PrefixCache`), admissions go through
`insert_cached`: a prompt sharing cached whole blocks with an earlier one
starts from the cached state (`engine.prefix_cache.stats()` counts the
hits).

Speculative decoding. With `speculative=Speculation(proposer, window)`
each of a dispatch's `steps_per_dispatch` iterations is a speculative
round of every active slot instead of one decode step: the proposer
drafts up to window - 1 tokens per slot (`NgramProposer` from the slot's
own token history, `DraftModelProposer` from a draft model whose per-slot
state is written at admission), one `verify` of the pool checks them, each
row accepts (greedy: the longest prefix of drafts equal to the target's
argmax; sampled: speculative sampling with the request's temperature and
key stream), and target and proposer commit the accepted prefix (replay
states by a counter move, baseline states by a snapshot). Budgets and eos
ids are applied per round on the device as in the plain loop: a slot
never emits past its budget or its eos, and the tokens of an accepted
window after either are dropped. Greedy requests get `generate`'s tokens
(up to argmax near-ties that a parallel verify rounds differently); the
host loop is the plain one (one compiled call, one device -> host
copy per dispatch); `stats` adds verify rounds, drafts and accepted drafts
(`acceptance_rate`, `mean_accepted_length`). See `serving.spec`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax import sharding as SH
from replayssm_jax.models import model as M
from replayssm_jax.models.generate import check_sampling
from replayssm_jax.serving import pool as P
from replayssm_jax.serving import spec as SP
from replayssm_jax.serving.prefix_cache import PrefixCache, insert_cached
from replayssm_jax.serving.spec import Speculation

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  id: any hashable name (results and streamed tokens are keyed by it).
  prompt: [T] int token ids.
  max_new_tokens: tokens to generate (the first, from the prefill,
    included), >= 1.
  eos_id: the request stops after emitting it (None: never).
  temperature: 0 greedy, > 0 sampling.
  seed: the request's PRNG seed (sampling).
  """
  id: object
  prompt: object
  max_new_tokens: int
  eos_id: int | None = None
  temperature: float = 0.0
  seed: int = 0


@dataclasses.dataclass
class EngineStats:
  """Counters of `Engine.run`: dispatches, decode steps (loop iterations:
  speculative rounds with `speculative`), tokens streamed, requests
  finished, and the wall time split into the host's own work (admission,
  launching, streaming) and its waits for the device's tokens (the
  dispatches' and the prefills' first tokens; `admit_s`: the admissions'
  wall time, their waits included). With
  `speculative`: slot-rounds verified (`verify_rounds`), drafts proposed
  and drafts accepted (before the cut at a budget or an eos). compacted:
  the dispatches that decoded only the running slots' rows
  (`compact_below`)."""
  dispatches: int = 0
  steps: int = 0
  tokens: int = 0
  finished: int = 0
  admissions: int = 0
  wall_s: float = 0.0
  wait_s: float = 0.0
  admit_s: float = 0.0
  verify_rounds: int = 0
  drafts: int = 0
  accepted_drafts: int = 0
  compacted: int = 0

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts over proposed drafts (0 without drafts)."""
    return self.accepted_drafts / max(self.drafts, 1)

  @property
  def mean_accepted_length(self) -> float:
    """Tokens per slot and verify round: accepted drafts + the target's
    own token (before the cut at a budget or an eos)."""
    return (self.accepted_drafts + self.verify_rounds) / max(
        self.verify_rounds, 1)

  @property
  def host_us_per_step(self) -> float:
    """Host time per decode step, waits for the device excluded."""
    return (self.wall_s - self.wait_s) / max(self.steps, 1) * 1e6

  @property
  def wall_us_per_step(self) -> float:
    return self.wall_s / max(self.steps, 1) * 1e6


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7),
                   donate_argnums=(2,))
def _dispatch(graphdef, params, pool, n, sampled, top_k, top_p,
              implementation, left, eos, temps, keys):
  """n decode steps of every slot with on-device stopping.

  left [cap] int32: tokens each slot may still emit (0: stop); eos [cap]
  int32 (-1: none); temps [cap] f32 (0: greedy); keys [cap, ...] raw uint32 keys;
  sampled (static): some slot samples (else the loop is argmax only, with
  no conditional: an XLA GPU conditional reads its predicate on the host).
  Returns (pool, tokens [cap, n] (-1 where a slot emitted nothing), left,
  keys).
  """
  model = nnx.merge(graphdef, params)
  cap = pool.capacity

  def body(i, carry):
    pool, out, left, keys = carry
    active = pool.active & (left > 0)
    split = jax.vmap(jax.random.split)(keys)  # [cap, 2, key]
    keys, sub = split[:, 0], split[:, 1]

    def sample(logits):
      return P.sample_rows(logits, sub, temps, sampled, top_k, top_p)

    pool, emitted, _ = P.step_rows(model, pool, active, sample,
                                   implementation)
    stop = (emitted < 0) | ((eos >= 0) & (emitted == eos))
    left = jnp.where(active, jnp.where(stop, 0, left - 1), left)
    return pool, out.at[:, i].set(emitted), left, keys

  out = jnp.full((cap, n), -1, jnp.int32)
  return jax.lax.fori_loop(0, n, body, (pool, out, left, keys))


class Engine:
  """Continuous batching over a `Pool` (see the module docstring).

  Args:
    model: the HybridLM, served with its parameters as they are when the
      engine is built (split once; a model changed later needs a new
      engine).
    capacity: slots (the decode batch).
    max_len: prompt + generated tokens a slot holds.
    steps_per_dispatch: decode steps (speculative rounds with
      `speculative`) per compiled call (one host sync each).
    top_k, top_p: the sampling filters of every sampled request (None:
      off).
    implementation: the ops' implementation (dispatcher name).
    prefix_cache: a `PrefixCache` the admissions go through, one prompt
      at a time (None: batched prefills, `prefill_batch`).
    prefill_batch: the most queued prompts of one length bucket admitted
      in one batched prefill (`pool.insert_many`; 1: one at a time).
    compact_below: a dispatch decodes only the running slots' rows
      (gathered into a batch of their number rounded up to a power of
      two, at least capacity / 16, scattered back after) when that batch
      is at most this fraction of the capacity, and the whole pool
      otherwise (0: always the whole pool; the same tokens up to the batch
      size's effect on matmul rounding). Without a mesh only.
    speculative: a `Speculation` (a proposer and a window) for speculative
      decoding inside the engine, or None (plain decode steps). The pool's
      state must be one `verify` takes: replay buffer_len > window, a
      baseline state's precision policy plain.
    mesh: a ("data", "model") `jax.sharding.Mesh` (`sharding.make_mesh`)
      or None: the pool placed on it (`sharding.shard_pool`) and every
      dispatch run under `jax.set_mesh(mesh)`, so the ops run per shard;
      pass a model placed by `sharding.shard_model` on the same mesh.
    ssm_mode, buffer_len, **state_kwargs: the pool's decode state
      (`serving.init_pool`; with `speculative`, its KV caches hold max_len
      + window - 1 entries, rounded up to `models.kv_cache_len`).
  """

  def __init__(self, model: M.HybridLM, capacity: int, max_len: int, *,
               steps_per_dispatch: int = 8, top_k: int | None = None,
               top_p: float | None = None, implementation=None,
               prefix_cache: PrefixCache | None = None,
               prefill_batch: int = 8, compact_below: float = 0.5,
               speculative: Speculation | None = None, mesh=None,
               ssm_mode: str = "replay", buffer_len: int = 16,
               **state_kwargs):
    self.model = model
    # Split once: every dispatch and admission reuses the parts.
    self._parts = nnx.split(model)
    self.mesh = mesh
    self.n = V.positive_int("steps_per_dispatch", steps_per_dispatch)
    self.prefill_batch = V.positive_int("prefill_batch", prefill_batch)
    if not 0 <= compact_below <= 1:
      raise ValueError(f"compact_below must lie in [0, 1], got "
                       f"{compact_below!r}.")
    self.compact_below = float(compact_below)
    check_sampling(1.0, top_k, top_p)
    self.top_k = None if top_k is None else int(top_k)
    self.top_p = None if top_p is None else float(top_p)
    self.implementation = implementation
    if prefix_cache is not None and not isinstance(prefix_cache,
                                                   PrefixCache):
      raise TypeError(f"prefix_cache must be a PrefixCache or None, got "
                      f"{type(prefix_cache).__name__}.")
    self.prefix_cache = prefix_cache
    self.max_len = V.positive_int("max_len", max_len)
    if speculative is not None and not isinstance(speculative, Speculation):
      raise TypeError(f"speculative must be a serving.Speculation (a "
                      f"proposer and a window) or None, got "
                      f"{type(speculative).__name__}.")
    self.speculative = speculative
    self._ssm = dict(ssm_mode=ssm_mode, buffer_len=buffer_len)
    kv_len = (max_len if speculative is None
              else SP.kv_len(self.max_len, speculative.window))
    self.pool = P.init_pool(model, capacity, kv_len, ssm_mode=ssm_mode,
                            buffer_len=buffer_len, **state_kwargs)
    if mesh is not None:
      self.pool = SH.shard_pool(self.pool, mesh, config=model.config)
    if speculative is not None:
      SP.check_speculation(speculative, model, self.pool, ssm_mode,
                           buffer_len)
      self._spec_slots = SP.init_slots(speculative, self.pool, self.max_len,
                                       ssm_mode, buffer_len)
      self._batch_key = jax.random.PRNGKey(0)
    cap = self.pool.capacity
    self.queue = collections.deque()
    self.slots: list[Request | None] = [None] * cap
    self.results: dict = {}
    self.stats = EngineStats()
    self._left = np.zeros(cap, np.int32)
    self._finished = []  # slots freed on the host, not yet on the device
    self._eos = np.full(cap, -1, np.int32)
    self._temps = np.zeros(cap, np.float32)
    # Raw PRNG keys per slot (the default impl's shape), kept on the device.
    self._keys = jnp.zeros((cap,) + jax.random.PRNGKey(0).shape, jnp.uint32)

  # ------------------------------------------------------------ requests
  def submit(self, request: Request):
    """Queues a request (checked now: a bad one never reaches a slot)."""
    if not isinstance(request, Request):
      raise TypeError(f"request must be a Request, got "
                      f"{type(request).__name__}.")
    prompt = np.asarray(request.prompt)
    if prompt.ndim != 1 or not 1 <= prompt.shape[0] <= self.max_len:
      raise ValueError(f"Request {request.id!r}: prompt must be a [T] "
                       f"token array with 1 <= T <= max_len "
                       f"({self.max_len}), got shape {prompt.shape}.")
    n = V.positive_int("max_new_tokens", request.max_new_tokens)
    if prompt.shape[0] + n > self.max_len:
      raise ValueError(
          f"Request {request.id!r}: prompt ({prompt.shape[0]} tokens) + "
          f"max_new_tokens ({n}) exceeds the engine's max_len "
          f"({self.max_len}).")
    check_sampling(request.temperature, None, None)
    if request.id in self.results or any(
        r.id == request.id for r in self.queue) or any(
            r is not None and r.id == request.id for r in self.slots):
      raise ValueError(f"Request id {request.id!r} is already in use.")
    self.queue.append(request)

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r is not None for r in self.slots)

  def _admit(self, on_tokens):
    t0 = time.perf_counter()
    admitted = []  # (slot, request, its key stream, its first token's key)
    for slot in range(self.pool.capacity):
      if not self.queue:
        break
      if self.slots[slot] is None:
        req = self.queue.popleft()
        key, first_key = jax.random.split(jax.random.PRNGKey(req.seed))
        admitted.append((slot, req, key, first_key))
    if not admitted:
      return
    # The first tokens (the prefills'): one sync per admission round.
    firsts = self._prefill(admitted)
    if self.speculative is not None:
      for (slot, req, _, _), tok in zip(admitted, firsts):
        self._spec_slots = SP.insert_slot(self.speculative, self._spec_slots,
                                          self.pool, slot, req.prompt, tok,
                                          **self._ssm)
    for (slot, req, key, _), tok in zip(admitted, firsts):
      self.stats.admissions += 1
      self.results[req.id] = []
      self.slots[slot] = req
      self._eos[slot] = -1 if req.eos_id is None else req.eos_id
      self._temps[slot] = req.temperature
      # A traced index: one compiled update serves every slot.
      self._keys = self._keys.at[jnp.int32(slot)].set(key)
      self._left[slot] = req.max_new_tokens
      self._emit(slot, [tok], on_tokens)
    self._evict_finished()
    self.stats.admit_s += time.perf_counter() - t0

  def _prefill(self, admitted) -> list[int]:
    """Prefills the admitted requests into their slots -> each one's first
    token (in `admitted` order), read back in one device -> host copy."""
    parts, order = [], []  # device token arrays, and whose tokens they are
    if self.prefix_cache is not None:  # a cache lookup per prompt
      for i, (slot, req, _, first_key) in enumerate(admitted):
        self.pool, tok = insert_cached(
            self.model, self.pool, self.prefix_cache, slot,
            jnp.asarray(req.prompt, jnp.int32),
            implementation=self.implementation,
            temperature=req.temperature, top_k=self.top_k, top_p=self.top_p,
            rng=first_key if req.temperature > 0 else None, parts=self._parts)
        parts.append(jnp.reshape(tok, (1,)))
        order.append(i)
    else:
      # Batched prefills: prompts of one length bucket together, at most
      # prefill_batch per call.
      groups = collections.defaultdict(list)
      for i, (_, req, _, _) in enumerate(admitted):
        groups[P.bucket_len(len(req.prompt), self.pool.max_len)].append(i)
      for members in groups.values():
        for c in range(0, len(members), self.prefill_batch):
          chunk = members[c:c + self.prefill_batch]
          rows = [admitted[i] for i in chunk]
          self.pool, toks = P.insert_many(
              self.model, self.pool, [a[0] for a in rows],
              [a[1].prompt for a in rows],
              temperatures=[a[1].temperature for a in rows],
              keys=[a[3] for a in rows], top_k=self.top_k, top_p=self.top_p,
              parts=self._parts)
          parts.append(toks)
          order += chunk
    t_wait = time.perf_counter()
    # (device_get of the parts: a concatenate would compile per count)
    toks = np.concatenate(jax.device_get(parts)).tolist()
    self.stats.wait_s += time.perf_counter() - t_wait
    firsts = [0] * len(admitted)
    for i, t in zip(order, toks):
      firsts[i] = t
    return firsts

  def _emit(self, slot, toks, on_tokens):
    """Streams a slot's new tokens and applies the stopping rules (the
    device applied the same ones inside the dispatch)."""
    req = self.slots[slot]
    kept = []
    for t in toks:
      if t < 0 or self._left[slot] <= 0:
        break
      kept.append(int(t))
      self._left[slot] -= 1
      if t == self._eos[slot]:
        self._left[slot] = 0
    if kept:
      self.results[req.id].extend(kept)
      self.stats.tokens += len(kept)
      if on_tokens is not None:
        on_tokens(req.id, kept)
    if self._left[slot] <= 0 or (toks and toks[0] < 0):
      self._finished.append(slot)  # freed on the device by _evict_finished
      self.slots[slot] = None
      self._left[slot] = 0
      self.stats.finished += 1

  def _evict_finished(self):
    """Frees the slots that finished since the last call, in one op."""
    if self._finished:
      self.pool = P.evict_many(self.pool, self._finished)
      self._finished = []

  # ----------------------------------------------------------------- run
  def dispatch(self, on_tokens: Callable | None = None):
    """Admits what fits, then one compiled call of `steps_per_dispatch`
    decode steps; streams its tokens and evicts finished requests (under
    `jax.set_mesh(mesh)` with a mesh: the ops per shard)."""
    if self.mesh is None:
      return self._dispatch_once(on_tokens)
    with jax.set_mesh(self.mesh):
      return self._dispatch_once(on_tokens)

  def _dispatch_once(self, on_tokens):
    t_start = time.perf_counter()
    self._admit(on_tokens)
    live = [i for i, r in enumerate(self.slots) if r is not None]
    if not live:
      self.stats.wall_s += time.perf_counter() - t_start
      return
    sampled = bool(np.any(self._temps[live] > 0))
    out, slots = self._decode(self._rows(live), sampled)
    t_wait = time.perf_counter()
    out = np.asarray(out)  # the dispatch's one device -> host copy
    self.stats.wait_s += time.perf_counter() - t_wait
    if self.speculative is not None:
      # The per-slot statistics columns after the tokens.
      out, counts = out[:, :-SP.STAT_COLUMNS], out[:, -SP.STAT_COLUMNS:]
      rounds, drafts, accepted = counts.sum(axis=0).tolist()
      self.stats.verify_rounds += rounds
      self.stats.drafts += drafts
      self.stats.accepted_drafts += accepted
    self.stats.dispatches += 1
    self.stats.compacted += len(slots) < self.pool.capacity
    self.stats.steps += self.n
    for row, slot in enumerate(slots):
      if self.slots[slot] is not None:
        self._emit(slot, out[row].tolist(), on_tokens)
    self._evict_finished()
    self.stats.wall_s += time.perf_counter() - t_start

  def _rows(self, live: list[int]):
    """The slots a dispatch decodes: None (the whole pool), or, when the
    live slots padded to a power of two fit in compact_below x capacity,
    those slots (padded with free ones) as an int32 array."""
    cap = self.pool.capacity
    k = max(1 << (len(live) - 1).bit_length(), self._min_rows())
    if self.mesh is not None or k > self.compact_below * cap:
      return None
    free = [i for i in range(cap) if self.slots[i] is None]
    return np.array(live + free[:k - len(live)], np.int32)

  def _min_rows(self) -> int:
    """The smallest compacted batch: capacity / 16 rounded down to a power
    of two (at least 1), which bounds the decode shapes to compile."""
    return 1 << max(0, (self.pool.capacity // 16).bit_length() - 1)

  def _decode(self, rows, sampled: bool):
    """One compiled call of n steps (speculative rounds) over the pool, or
    over its `rows` gathered into a smaller batch and scattered back ->
    (the device's [len(rows) or capacity, cols] int32 output, the slot of
    each of its rows)."""
    graphdef, params = self._parts
    spec = self.speculative
    carried = (self.pool, self._keys,
               self._spec_slots if spec is not None else None)
    left, eos, temps = self._left, self._eos, self._temps
    if rows is not None:
      idx = jnp.asarray(rows)
      carried = P.gather_rows(carried, idx)
      left, eos, temps = left[rows], eos[rows], temps[rows]
    pool, keys, slots = carried
    args = (jnp.asarray(left), jnp.asarray(eos), jnp.asarray(temps), keys)
    if spec is None:
      pool, out, _, keys = _dispatch(
          graphdef, params, pool, self.n, sampled, self.top_k, self.top_p,
          self.implementation, *args)
    else:
      pool, slots, out, keys, self._batch_key = SP.dispatch(
          graphdef, params, pool, slots, spec.proposer, self.n, spec.window,
          sampled, self.top_k, self.top_p, self.implementation, *args,
          self._batch_key)
    if rows is None:
      self.pool, self._keys = pool, keys
    else:
      self.pool, self._keys, slots = P.scatter_rows(
          (self.pool, self._keys, self._spec_slots if spec is not None
           else None), (pool, keys, slots), idx)
    if spec is not None:
      self._spec_slots = slots
    return out, (range(self.pool.capacity) if rows is None
                 else rows.tolist())

  def precompile(self, max_prompt_len: int, sampled: bool = False):
    """Compiles what serving prompts of up to `max_prompt_len` tokens may
    run, so that no later dispatch compiles: the batched prefills of every
    length bucket and padded batch size up to `prefill_batch`, and the
    decode call over the whole pool and over every compacted batch size
    (`compact_below`), greedy or with `sampled` rows. An idle engine only
    (nothing queued or running); the slots stay free and the statistics
    zero. Prefix-cache admissions still compile per remainder bucket on
    first use."""
    if self.busy:
      raise ValueError("precompile needs an idle engine (no queued or "
                       "running requests).")
    cap, max_prompt_len = self.pool.capacity, V.positive_int(
        "max_prompt_len", max_prompt_len)
    if max_prompt_len > self.max_len:
      raise ValueError(f"max_prompt_len ({max_prompt_len}) exceeds the "
                       f"engine's max_len ({self.max_len}).")
    buckets = sorted({P.bucket_len(t, self.pool.max_len)
                      for t in range(1, max_prompt_len + 1)})
    key = jax.random.PRNGKey(0)
    k = 1
    while k <= min(self.prefill_batch, cap):
      for b in buckets:
        self.pool, _ = P.insert_many(
            self.model, self.pool, list(range(k)),
            [np.zeros(b, np.int32)] * k, keys=[key] * k,
            temperatures=[1.0 if sampled else 0.0] * k, top_k=self.top_k,
            top_p=self.top_p, parts=self._parts)
      k *= 2
    if self.speculative is not None:
      for b in buckets:
        self._spec_slots = SP.insert_slot(self.speculative, self._spec_slots,
                                          self.pool, 0, np.zeros(b, np.int32),
                                          0, **self._ssm)
    self.pool = self.pool.replace(active=jnp.zeros_like(self.pool.active))
    sizes = [cap] + [1 << j for j in range(cap.bit_length())
                     if self._min_rows() <= (1 << j) < cap
                     and (1 << j) <= self.compact_below * cap]
    for size in sizes:
      rows = None if size == cap else np.arange(size, dtype=np.int32)
      jax.block_until_ready(self._decode(rows, sampled)[0])
    self.stats = EngineStats()

  def run(self, on_tokens: Callable | None = None) -> dict:
    """Dispatches until every submitted request finished; returns {id:
    generated tokens}. on_tokens(id, tokens) streams each request's new
    tokens as they arrive, in order."""
    while self.busy:
      self.dispatch(on_tokens)
    return dict(self.results)
