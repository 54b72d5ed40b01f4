"""A continuous-batching engine over the slot pool.

  engine = Engine(model, capacity=64, max_len=512, steps_per_dispatch=8)
  engine.submit(Request("a", prompt_a, max_new_tokens=100, eos_id=2))
  engine.submit(Request("b", prompt_b, max_new_tokens=20, temperature=0.8,
                        seed=1))
  results = engine.run(on_tokens=lambda rid, toks: print(rid, toks))
  engine.cancel("a")  # between dispatches: stop a queued or running request

Each `dispatch` (one iteration of `run`): admit queued requests into free
slots (`pool.insert_many`: prompts of one length bucket prefilled together
and written into their slots, first tokens sampled), launch
`steps_per_dispatch` decode steps in one jitted `lax.fori_loop` over the
whole pool, or over the running slots' rows gathered into a smaller batch
when few slots run (`compact_below`), then read tokens back once, stream
them to `on_tokens`, and evict the requests that finished.

Where the host waits. One dispatch is one compiled call and one device ->
host copy of its [capacity, n] tokens: the host is synchronised once per n
steps, not per step. The stopping rules run on the device inside the loop:
each slot keeps a budget of tokens still to generate and its eos id
(`serving.controls`); a slot that emits its eos or exhausts its budget
goes inactive at once: it emits nothing more, and its row is decoded on as
a free slot's is (`pool.step`: contents unspecified, never read,
overwritten by the next `insert`). A request that finishes early in a
dispatch leaves its slot idle for the rest of it; a smaller
`steps_per_dispatch` admits sooner, a larger one pays fewer host round
trips (the trade-off `stats` measures: host time per step against the
device's).

Overlap (`overlap=True`, the default). A dispatch launches its decode call
and then reads the previous dispatch's tokens, so the device has the next
call queued while the host streams, evicts, admits and launches: the host's
work per dispatch hides behind the device's instead of adding to it. What
makes that safe: the budgets, eos ids, temperatures and keys live on the
device and are carried from call to call (`controls.SlotControls`); an
admission writes its slots' controls with one compiled op whose budget
takes the prefill's first token into account on the device, and that
token is read with the next batch of tokens instead of at admission; and
each launched call remembers which request each of its rows held, so a
row's tokens go to that request only while it still runs in that slot.
The cost: the host learns that a request stopped one dispatch late. A
request that runs out of budget costs nothing, since the host knows its
budget: a slot whose request the dispatch in flight surely finishes is
admitted into at once (the device runs that dispatch first) and left out
of the next launch. A slot whose request stops at its eos idles one more
dispatch before it is admitted into again.
The tokens are the same as with `overlap=False` (launch, then wait): a
request's key stream and rows do not depend on when it was admitted.

Sampling per request. Each slot carries its own temperature (0: greedy)
and its own PRNG key stream (from `Request.seed`, split once per step),
so a request's tokens do not depend on which slot or batch it ran in
(up to the batch's effect on matmul rounding). top_k and top_p, being
static shapes of the sampling filter, are set per engine.

With a `prefix_cache` (`serving.PrefixCache`), admissions go through
`insert_cached_many`: a prompt sharing cached whole blocks with an earlier
one starts from the cached state (`engine.prefix_cache.stats()` counts the
hits), up to `prefill_batch` prompts per call.

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
import contextlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax import sharding as SH
from replayssm_jax.models import model as M
from replayssm_jax.models.generate import check_sampling
from replayssm_jax.serving import controls as C
from replayssm_jax.serving import pool as P
from replayssm_jax.serving import rows as R
from replayssm_jax.serving import snapshot
from replayssm_jax.serving import spec as SP
from replayssm_jax.serving.prefix_cache import (PrefixCache,
                                                insert_cached_many,
                                                warmup_batches, warmup_takes)
from replayssm_jax.serving.requests import EngineStats, Request, check_request
from replayssm_jax.serving.spec import Speculation


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
    prefix_cache: a `PrefixCache` the admissions go through
      (`insert_cached_many`; None: `pool.insert_many`).
    prefill_batch: the most queued prompts admitted in one call (without
      a prefix cache, of one length bucket: one batched prefill; 1: one at
      a time).
    compact_below: a dispatch decodes only the running slots' rows
      (gathered into a batch of their number rounded up to a power of
      two, at least capacity / 16, scattered back after) when that batch
      is at most this fraction of the capacity, and the whole pool
      otherwise (0: always the whole pool; the same tokens up to the batch
      size's effect on matmul rounding). Without a mesh only.
    compact_in_place: such a dispatch (plain decoding) steps the running
      slots in the pool through a slot per row instead (the Mamba-2 and
      attention kernels read and write the pool's rows; no gathered copy
      of their state; `serving.controls.decode`). None: where every layer
      steps that way by itself (`rows.steps_in_place`: Mamba-2, Gated
      DeltaNet and attention layers; the faster form on a GPU,
      benchmarks/README.md, "A partly occupied pool").
    speculative: a `Speculation` (a proposer and a window) for speculative
      decoding inside the engine, or None (plain decode steps). The pool's
      state must be one `verify` takes: replay buffer_len > window, a
      baseline state's precision policy plain.
    mesh: a ("data", "model") `jax.sharding.Mesh` (`sharding.make_mesh`)
      or None: the pool placed on it (`sharding.shard_pool`) and every
      dispatch run under `jax.set_mesh(mesh)`, so the ops run per shard;
      pass a model placed by `sharding.shard_model` on the same mesh.
    max_eos_ids: the most eos ids a request may stop at (`Request.eos_id`
      as a sequence); each step compares a slot's token with this many.
    overlap: launch each dispatch before reading the previous one's
      tokens, so that the host's streaming, admissions and launches run
      while the device decodes (False: launch, then wait for its tokens;
      the same tokens either way, see the module docstring).
    ssm_mode, buffer_len, **state_kwargs: the pool's decode state
      (`serving.init_pool`; with `speculative`, its KV caches hold max_len
      + window - 1 entries, rounded up to `models.kv_cache_len`).
  """

  def __init__(self, model: M.HybridLM, capacity: int, max_len: int, *,
               steps_per_dispatch: int = 8, top_k: int | None = None,
               top_p: float | None = None, implementation=None,
               prefix_cache: PrefixCache | None = None,
               prefill_batch: int = 8, compact_below: float = 0.5,
               compact_in_place: bool | None = None,
               speculative: Speculation | None = None, mesh=None,
               overlap: bool = True, max_eos_ids: int = 4,
               ssm_mode: str = "replay", buffer_len: int = 16,
               **state_kwargs):
    self.model = model
    # Split once: every dispatch and admission reuses the parts.
    self._parts = P.model_parts(model)
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
    self.overlap = bool(overlap)
    self.max_eos_ids = V.positive_int("max_eos_ids", max_eos_ids)
    self._ssm = dict(ssm_mode=ssm_mode, buffer_len=buffer_len)
    kv_len = (max_len if speculative is None
              else SP.kv_len(self.max_len, speculative.window))
    self.pool = P.init_pool(model, capacity, kv_len, ssm_mode=ssm_mode,
                            buffer_len=buffer_len, **state_kwargs)
    if mesh is not None:
      self.pool = SH.shard_pool(self.pool, mesh, config=model.config)
    self.compact_in_place = (R.steps_in_place(model, self.pool.state)
                             if compact_in_place is None
                             else bool(compact_in_place))
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
    # Tokens each running request may still stream, by id (the host's
    # mirror of the device's budgets in self._ctl).
    self._budget = {}
    self._ctl = C.init_controls(cap, self.max_eos_ids)
    if mesh is not None:
      self._ctl = jax.tree.map(lambda x: SH.shard_batch(x, mesh), self._ctl)
    self._finished = []  # slots freed on the host, not yet on the device
    self._firsts = []  # admissions' first tokens, not yet read
    self._inflight = None  # the launched dispatch not yet read (overlap)

  # ------------------------------------------------------------ requests
  def submit(self, request: Request):
    """Queues a request (checked now: a bad one never reaches a slot). The
    engine keeps its own copy of the prompt: changing the caller's array
    later changes nothing."""
    request = check_request(request, self.max_len,
                            self.model.config.vocab_size, self.max_eos_ids)
    rid = request.id
    if rid in self.results or any(r.id == rid for r in self.queue) or any(
        r is not None and r.id == rid for r in self.slots):
      raise ValueError(f"Request id {rid!r} is already in use.")
    self.queue.append(request)

  def cancel(self, request_id) -> bool:
    """Stops a queued or running request: it is admitted no more, or its
    slot is freed now (what it streamed stays in `results`; tokens of a
    dispatch in flight are dropped). Returns False for an id that is
    neither queued nor running (unknown, finished or cancelled)."""
    for req in self.queue:
      if req.id == request_id:
        self.queue.remove(req)
        self.results[req.id] = []
        self.stats.cancelled += 1
        return True
    if request_id not in self._budget:
      return False
    del self._budget[request_id]
    self.stats.cancelled += 1
    slot = next((s for s, r in enumerate(self.slots)
                 if r is not None and r.id == request_id), None)
    if slot is not None:  # (not if an admission already took its slot)
      self.slots[slot] = None
      self._finished.append(slot)
      with self._on_mesh():  # evicted before an admission refills it
        self._evict_finished()
    return True

  def save(self, path, on_tokens: Callable | None = None, *,
           overwrite: bool = False) -> dict:
    """Writes the engine to the directory `path` between dispatches (the
    decode call in flight read first, its tokens streamed to `on_tokens`);
    `restore` on a new engine built with the same arguments resumes it
    exactly. See `serving.snapshot`."""
    return snapshot.save(self, path, on_tokens, overwrite)

  def restore(self, path) -> None:
    """Loads a snapshot written by `save` into this new engine (built with
    the saved engine's arguments; nothing submitted or run yet)."""
    snapshot.restore(self, path)

  def _drain(self, on_tokens):
    """Reads the decode call in flight and the pending first tokens."""
    launched, self._inflight = self._inflight, None
    self._collect(launched, on_tokens)
    self._evict_finished()

  def _on_mesh(self):
    """`jax.set_mesh(mesh)` with a mesh (the ops then run per shard)."""
    return (contextlib.nullcontext() if self.mesh is None
            else jax.set_mesh(self.mesh))

  @property
  def busy(self) -> bool:
    """Requests queued or running, or tokens not yet read."""
    return (bool(self.queue) or any(r is not None for r in self.slots)
            or self._inflight is not None or bool(self._firsts))

  def _admit(self):
    """Admits queued requests into free slots: prefills launched, their
    controls written on the device (`controls.admit`); the first tokens
    are read with the next dispatch's tokens (`_collect`)."""
    t0 = time.perf_counter()
    admitted = []  # (slot, request)
    for slot in self._free_slots():
      if not self.queue:
        break
      admitted.append((slot, self.queue.popleft()))
    if not admitted:
      return
    # Batched prefills of at most prefill_batch prompts per call: without
    # a cache prompts of one length bucket together; with one in arrival
    # order (insert_cached_many groups the rests by bucket after lookup).
    buckets = collections.defaultdict(list)
    for i, (_, req) in enumerate(admitted):
      buckets[0 if self.prefix_cache is not None else P.bucket_len(
          len(req.prompt), self.pool.max_len)].append(i)
    groups = [m[c:c + self.prefill_batch] for m in buckets.values()
              for c in range(0, len(m), self.prefill_batch)]
    for group in groups:
      rows = [admitted[i] for i in group]
      firsts = self._admit_rows([s for s, _ in rows], [r for _, r in rows])
      self._firsts.append((firsts, rows))
    for slot, req in admitted:
      self.stats.admissions += 1
      self.results[req.id] = []
      self.slots[slot] = req
      self._budget[req.id] = req.max_new_tokens
    self.stats.admit_s += time.perf_counter() - t0

  def _admit_rows(self, slots, reqs, via_cache: bool = True):
    """Prefills k requests into `slots` (one batched prefill, or with a
    prefix cache and `via_cache` through it) and writes their
    controls -> their first tokens on the device ([kp], kp the power of
    two >= k)."""
    k = len(slots)
    kp = 1 << (k - 1).bit_length()
    pad = lambda vals, fill, dtype: np.array(
        list(vals) + [fill] * (kp - k), dtype)
    idx, budgets, eos_ids, temps, seeds = jax.device_put((
        pad(slots, self.pool.capacity, np.int32),
        pad([r.max_new_tokens for r in reqs], 0, np.int32),
        pad([r.eos_id + (-1,) * (self.max_eos_ids - len(r.eos_id))
             for r in reqs], (-1,) * self.max_eos_ids, np.int32),
        pad([r.temperature for r in reqs], 0.0, np.float32),
        C.seed_words([r.seed for r in reqs] + [0] * (kp - k))))
    stream, first_keys = C.request_keys(seeds)
    kw = dict(temperatures=[r.temperature for r in reqs], keys=first_keys,
              top_k=self.top_k, top_p=self.top_p, parts=self._parts,
              padded=True)
    prompts = [r.prompt for r in reqs]
    if self.prefix_cache is not None and via_cache:
      self.pool, firsts = insert_cached_many(
          self.model, self.pool, self.prefix_cache, slots, prompts, **kw)
    else:
      self.pool, firsts = P.insert_many(self.model, self.pool, slots,
                                        prompts, **kw)
    self._ctl = C.admit(self._ctl, idx, stream, budgets, eos_ids, temps,
                        firsts)
    if self.speculative is not None:
      self._spec_slots = SP.insert_slots(
          self.speculative, self._spec_slots, self.pool, slots,
          [r.prompt for r in reqs], firsts, **self._ssm)
    return firsts

  def _finishing(self) -> set[int]:
    """The slots whose request the dispatch in flight surely finishes: a
    budget of at most n tokens (every step or round emits one at least).
    An admission may fill them (the device runs that dispatch before the
    prefill overwrites the row, and the dispatch's tokens still go to the
    old request) and the next launch leaves them out."""
    if self._inflight is None:
      return set()
    launched = set(map(id, self._inflight[2]))
    return {s for s, r in enumerate(self.slots)
            if r is not None and id(r) in launched
            and self._budget[r.id] <= self.n}

  def _free_slots(self) -> list[int]:
    """The slots an admission may fill: the free ones, then those the
    dispatch in flight frees (`_finishing`)."""
    return ([s for s, r in enumerate(self.slots) if r is None]
            + sorted(self._finishing()))

  def _emit(self, slot, req, toks, on_tokens):
    """Streams request `req`'s new tokens (from row `slot`) and applies
    the stopping rules (the device applied the same ones inside the
    dispatch); a finished request frees its slot unless an admission
    already took it."""
    left, kept = self._budget[req.id], []
    for t in toks:
      if t < 0 or left <= 0:
        break
      kept.append(int(t))
      left -= 1
      if t in req.eos_id:
        left = 0
    self._budget[req.id] = left
    if kept:
      self.results[req.id].extend(kept)
      self.stats.tokens += len(kept)
      if on_tokens is not None:
        on_tokens(req.id, kept)
    if left <= 0 or (toks and toks[0] < 0):
      del self._budget[req.id]
      self.stats.finished += 1
      if self.slots[slot] is req:
        self._finished.append(slot)  # freed on the device by _evict_finished
        self.slots[slot] = None

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
    with self._on_mesh():
      return self._dispatch_once(on_tokens)

  def _dispatch_once(self, on_tokens):
    t_start = time.perf_counter()
    self._admit()
    launched = self._launch()
    if self.overlap:  # read the previous dispatch while this one runs
      launched, self._inflight = self._inflight, launched
    self._collect(launched, on_tokens)
    self._evict_finished()
    self.stats.wall_s += time.perf_counter() - t_start

  def _launch(self):
    """Launches one compiled call of n steps over the running slots ->
    (its device output, the slot of each output row, the request each
    row held at launch), or None when no slot runs."""
    finishing = self._finishing()
    live = [i for i, r in enumerate(self.slots)
            if r is not None and i not in finishing]
    if not live:
      return None
    sampled = any(self.slots[s].temperature > 0 for s in live)
    out, slots = self._decode(self._rows(live), sampled)
    self.stats.dispatches += 1
    self.stats.compacted += len(slots) < self.pool.capacity
    self.stats.steps += self.n
    return out, slots, [self.slots[s] for s in slots]

  def _collect(self, launched, on_tokens):
    """Reads the admissions' first tokens and a launched dispatch's tokens
    in one device -> host copy, streams them and applies the stopping
    rules. A row's tokens go to the request its slot held at launch, and
    only while that request runs."""
    firsts, self._firsts = self._firsts, []
    arrays = [f for f, _ in firsts] + ([launched[0]] if launched else [])
    if not arrays:
      return
    t_wait = time.perf_counter()
    host = jax.device_get(arrays)
    self.stats.wait_s += time.perf_counter() - t_wait
    for (_, rows), toks in zip(firsts, host):
      for (slot, req), tok in zip(rows, toks.tolist()):
        if req.id in self._budget:  # not cancelled
          self._emit(slot, req, [tok], on_tokens)
    if launched is None:
      return
    out, slots, reqs = host[-1], launched[1], launched[2]
    if self.speculative is not None:
      # The per-slot statistics columns after the tokens.
      out, counts = out[:, :-SP.STAT_COLUMNS], out[:, -SP.STAT_COLUMNS:]
      rounds, drafts, accepted = counts.sum(axis=0).tolist()
      self.stats.verify_rounds += rounds
      self.stats.drafts += drafts
      self.stats.accepted_drafts += accepted
    for row, (slot, req) in enumerate(zip(slots, reqs)):
      if req is not None and req.id in self._budget:
        self._emit(slot, req, out[row].tolist(), on_tokens)

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
    over its `rows` (a numpy array) gathered into a smaller batch and
    scattered back within the call -> (the device's [len(rows) or
    capacity, cols] int32 output, the slot of each of its rows)."""
    graphdef, params = self._parts
    spec = self.speculative
    if spec is None:
      self.pool, out, self._ctl = C.decode(
          graphdef, params, self.pool, self._ctl, self.n, sampled,
          self.top_k, self.top_p, self.implementation, rows,
          self.compact_in_place)
    else:
      (self.pool, self._spec_slots, out, self._ctl,
       self._batch_key) = SP.dispatch(
           graphdef, params, self.pool, self._spec_slots, spec.proposer,
           self.n, spec.window, sampled, self.top_k, self.top_p,
           self.implementation, self._ctl, self._batch_key, rows)
    return out, (list(range(self.pool.capacity)) if rows is None
                 else rows.tolist())

  def precompile(self, max_prompt_len: int, sampled: bool = False,
                 min_prompt_len: int = 1):
    """Compiles what serving prompts of `min_prompt_len` to
    `max_prompt_len` tokens may run, so that no later dispatch compiles:
    the batched prefills of their length buckets and of every padded batch
    size up to `prefill_batch`, and the decode call over the whole pool and over
    every compacted batch size (`compact_below`), greedy or with `sampled`
    rows. An idle engine only (nothing queued or running); the slots stay
    free and the statistics zero. With a prefix cache, its paths instead
    of plain prefills past one block (`warmup_batches`, run on a
    throwaway cache: the engine's is not touched)."""
    if self.busy:
      raise ValueError("precompile needs an idle engine (no queued or "
                       "running requests).")
    cap, max_prompt_len = self.pool.capacity, V.positive_int(
        "max_prompt_len", max_prompt_len)
    min_prompt_len = V.positive_int("min_prompt_len", min_prompt_len)
    if max_prompt_len > self.max_len:
      raise ValueError(f"max_prompt_len ({max_prompt_len}) exceeds the "
                       f"engine's max_len ({self.max_len}).")
    if min_prompt_len > max_prompt_len:
      raise ValueError(f"min_prompt_len ({min_prompt_len}) exceeds "
                       f"max_prompt_len ({max_prompt_len}).")
    buckets = sorted({P.bucket_len(t, self.pool.max_len)
                      for t in range(min_prompt_len, max_prompt_len + 1)})
    temp = 1.0 if sampled else 0.0
    most = min(self.prefill_batch, cap)
    if self.prefix_cache is not None:  # plain prefills: no whole block
      buckets = [b for b in buckets if b <= P.bucket_len(
          self.prefix_cache.block, self.pool.max_len)]
    request = lambda tokens: Request(None, tokens, 1, eos_id=(),
                                     temperature=temp)
    k = 1
    while k <= most:
      for b in buckets:
        self._admit_rows(list(range(k)), [request(np.zeros(b, np.int32))] * k,
                         via_cache=False)
      k *= 2
    if self.prefix_cache is not None:  # its paths, on a throwaway cache
      real = self.prefix_cache
      self.prefix_cache = PrefixCache(real.block, max_entries=2)
      try:
        for batches in warmup_batches(real.block, max_prompt_len,
                                      self.pool.max_len, most,
                                      self.model.config.vocab_size):
          self.prefix_cache.clear()
          for batch in batches:
            self._admit_rows(list(range(len(batch))),
                             [request(t) for t in batch])
      finally:
        self.prefix_cache = real
      warmup_takes(self.pool.tokens, C.request_keys(
          C.seed_words([0]))[1], most)
    self._firsts = []
    self._ctl = self._ctl.replace(left=jnp.zeros_like(self._ctl.left))
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
