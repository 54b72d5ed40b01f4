"""Prefix caching of decode states at block-aligned prompt positions.

  cache = PrefixCache(block=16, max_entries=64)
  pool, first = insert_cached(model, pool, cache, slot, prompt_tokens)
  cache.stats()  # lookups, hits, misses, reused_tokens, hit_rate, ...

Design.

* What is cached. The whole decode state of one request after a prompt
  prefix, as a batch-1 `ModelState` row laid out as the pool's rows: the
  SSM states (replay checkpoint + buffers and counter, or the full
  baseline state), the conv windows, the attention layers' KV-cache rows
  (the whole max_len row) with their lengths, and the position. Such a row
  is a complete state: a request whose prompt starts with the prefix
  continues from it and processes only the rest of its prompt.

* Keys: a hash chain per block of `block` tokens, as vLLM's block hashes:
  the key of the first k blocks is h_k = sha256(h_{k-1} || tokens of block
  k), h_0 fixed by `block`. A key identifies the whole prefix (every
  earlier block is folded into it), so the longest cached prefix of a
  prompt is the largest k whose h_k is in the cache, found with one dict
  lookup per block on the host. Rows are stored only at whole-block
  prefixes, which bounds the keys a prompt can produce to len // block
  and lets two prompts meet at the same keys whatever their lengths.

* Where rows are stored. A prefill yields the state at its end only, so
  a prompt stores at most one row, at a boundary chosen from the keys
  earlier prompts produced (kept without rows, a bounded LRU set, as a
  radix tree keeps its branch points): the deepest block past the cached
  prefix whose key an earlier prompt shared, i.e. where this prompt's
  tokens part from a known prompt's. Without one, a miss stores its last
  whole block (a repeated prompt then hits it whole) and a hit stores
  nothing (its tail is its own: the rest runs from the cached row in one
  pass). The second request of a shared system prompt or few-shot header
  thereby stores the header's state, which every later request of it hits
  in one pass, whatever their tails.

* Why block-aligned states are exact. A snapshot is taken right after a
  prefill of the aligned prefix, from an empty row or continued from an
  earlier snapshot; either way its replay states have count 0
  (checkpoint = the full state, empty buffer: exactly what a baseline pool
  holds). The row is exact for "replay" and "baseline" pools alike; a
  snapshot is never a state that needs a flush it cannot do. (A continued
  prefill also starts from a replay state mid-buffer, materializing it, so
  a row planted from a decoded state would serve as well.)

* What insert_cached does. Of a prompt of T tokens, at most
  K = (T - 1) // block whole blocks are looked up (one token at least is
  left to produce the first token's logits). On a hit at k blocks, the
  row starts from the cached snapshot (a copy is written into the pool:
  the pool is donated by the pool functions and the snapshot never
  aliases it). If a boundary K > k is chosen above (at most
  (T - 1) // block), the state at K blocks is built and cached: on a miss
  by a prefill of the K * block tokens (as `insert` does, from an empty
  row), after a hit by a chunked prefill of blocks k + 1 .. K continued
  from the k-block snapshot (`models.prefill_from_state`). Then the
  remaining T - K * block tokens (or T - k * block with no K) run as one
  chunked prefill
  continued from that state, whose last logits give the first token, and
  the row overwrites row `slot` of every pool leaf, as `insert` does.
  Every state kind continues (Mamba-2, attention, Gated DeltaNet, KDA; replay
  and baseline), so no prompt token runs as a decode step. A prompt
  shorter than block + 1 tokens has no whole block to look up and goes
  through `insert` directly.

* Cost model. A hit saves the prefill of k * block tokens: the rest runs
  as one parallel pass of T - k * block tokens (its attention layers also
  read the row's live cache entries, and only those:
  `models.cached_attention`), so the time to the first token falls with
  the cached fraction, down to the fixed cost of a prefill pass. A miss
  costs a prefill of K * block tokens and a continued one of the rest; a
  partial hit two continued prefills. The passes are padded to the
  pool's buckets (`pool.bucket_len`) and take the real lengths as traced
  values: one compile per bucket. A miss stores one row (a prefill yields its
  final state only): a later prompt sharing fewer blocks than it holds
  misses, stores the row at the blocks they share, and is the last one
  to miss there.

* Equality. The result equals `insert` of the same prompt: tokens exactly,
  logits up to the summation order by which a prefill split at the block
  boundary differs from one over the whole prompt
  (tests/test_chunked_prefill.py). With a stochastically rounding
  precision policy the cached prefix keeps the rounding bits of the
  request that filled the cache (the row_id leaves are set to the new
  request's id).

A cache serves one model and one pool layout (ssm_mode, dtypes, max_len,
buffer_len): a pool whose row layout differs from the cached rows' is an
error; a different model of the same layout is not detected.
"""

from __future__ import annotations

import collections
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models import chunked_prefill as CP
from replayssm_jax.models import model as M
from replayssm_jax.serving import pool as P
from replayssm_jax.serving import rows as R

# Number of times each jitted entry point was traced (tests assert on it).
TRACE_COUNTS = {"prefill": 0, "extend": 0, "finish": 0, "finish_many": 0}


class PrefixCache:
  """Host-side LRU map: block-hash-chain key -> batch-1 ModelState row.

  Args:
    block: tokens per block (> 0); rows are cached at whole-block prefixes.
    max_entries: the most rows held (> 0); the least recently used row is
      dropped past it.
    max_seen: the most block keys of earlier prompts remembered without
      rows (> 0; default 256 * max_entries, ~100 bytes each), which choose
      where a miss stores its row (module docstring).
  """

  def __init__(self, block: int, max_entries: int,
               max_seen: int | None = None):
    self.block = V.positive_int("block", block)
    self.max_entries = V.positive_int("max_entries", max_entries)
    self.max_seen = (256 * self.max_entries if max_seen is None
                     else V.positive_int("max_seen", max_seen))
    self._rows: collections.OrderedDict = collections.OrderedDict()
    self._seen: collections.OrderedDict = collections.OrderedDict()
    self._layout = None
    self.lookups = self.hits = self.misses = 0
    self.reused_tokens = self.evictions = 0

  def __len__(self) -> int:
    return len(self._rows)

  def __contains__(self, key) -> bool:
    return key in self._rows

  def keys(self, prompt_tokens) -> list[bytes]:
    """The chain keys h_1 .. h_n of the whole blocks of `prompt_tokens`
    [T] (n = T // block)."""
    toks = np.asarray(prompt_tokens).astype(np.int64)
    h = hashlib.sha256(f"prefix-cache/block={self.block}".encode()).digest()
    out = []
    for k in range(len(toks) // self.block):
      blk = toks[k * self.block:(k + 1) * self.block]
      h = hashlib.sha256(h + blk.tobytes()).digest()
      out.append(h)
    return out

  def get(self, key):
    """The row cached under `key` (now the most recently used), or None."""
    row = self._rows.get(key)
    if row is not None:
      self._rows.move_to_end(key)
    return row

  def put(self, key, row) -> None:
    """Caches `row` (a batch-1 ModelState, not to be modified afterwards)
    under `key`, dropping the least recently used rows past max_entries."""
    self._rows[key] = row
    self._rows.move_to_end(key)
    while len(self._rows) > self.max_entries:
      self._rows.popitem(last=False)
      self.evictions += 1

  def store_at(self, keys: list[bytes], hit: int) -> int:
    """The number of blocks at which a prompt with chain keys `keys`
    (h_1 .. h_K), whose longest cached prefix is `hit` < K blocks, stores
    a row: the deepest k in (hit, K] whose key an earlier prompt produced;
    else K on a miss (hit 0), `hit` (nothing to store) on a hit. Then
    remembers the prompt's keys (the least recently seen dropped past
    max_seen)."""
    at = next((k for k in range(len(keys), hit, -1)
               if keys[k - 1] in self._seen), hit or len(keys))
    for key in keys:
      self._seen[key] = None
      self._seen.move_to_end(key)
    while len(self._seen) > self.max_seen:
      self._seen.popitem(last=False)
    return at

  def clear(self) -> None:
    self._rows.clear()
    self._seen.clear()

  def stats(self) -> dict:
    """lookups (insert_cached calls), hits (a cached prefix was reused),
    misses, reused_tokens (prompt tokens taken from the cache instead of
    being processed), hit_rate (hits / lookups), entries, evictions."""
    return dict(lookups=self.lookups, hits=self.hits, misses=self.misses,
                reused_tokens=self.reused_tokens,
                hit_rate=self.hits / self.lookups if self.lookups else 0.0,
                entries=len(self._rows), evictions=self.evictions)

  def _check_layout(self, pool: P.Pool):
    """The pool's row layout (tree structure, per-row shapes and dtypes)
    must be the cached rows'."""
    leaves, treedef = jax.tree_util.tree_flatten(pool.state)
    layout = (treedef, tuple((x.shape[1:], x.dtype) for x in leaves))
    if self._layout is None:
      self._layout = layout
    elif layout != self._layout:
      raise ValueError("cache holds rows of another pool layout (ssm_mode, "
                       "dtypes, max_len or buffer_len differ); use one "
                       "PrefixCache per pool layout.")


# --------------------------------------------------------------- jitted
@functools.partial(jax.jit, static_argnums=(0,))
def _prefill_jit(graphdef, params, tokens, length, pool_state, row_id):
  """tokens[:length] prefilled from an empty row laid out as the pool's
  (built here from the pool state's shapes, not its contents: built
  eagerly it takes two host dispatches per state leaf)."""
  TRACE_COUNTS["prefill"] += 1
  model = P.merge(graphdef, params)
  fresh = P.fresh_row(pool_state, row_id)
  return M.prefill_fn(model, tokens[None], length[None], fresh)


@functools.partial(jax.jit, static_argnums=(0,))
def _extend_jit(graphdef, params, row, tokens, length):
  """tokens[:length] (length traced) continued from a cached row, which is
  not donated: it stays cached."""
  TRACE_COUNTS["extend"] += 1
  model = P.merge(graphdef, params)
  return CP.prefill_from_state_fn(model, tokens[None], length[None], row)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _finish_jit(graphdef, params, pool, row, slot, tokens, length, row_id,
                sampling, rng):
  """The rest of the prompt continued from `row` (not donated: it may be
  a cached row), the first token sampled, the row written into `slot` of
  the (donated) pool."""
  TRACE_COUNTS["finish"] += 1
  model = P.merge(graphdef, params)
  row = P.set_row_id(row, row_id)
  logits, row = CP.prefill_from_state_fn(model, tokens[None], length[None],
                                         row)
  pool, tok = P.place_row(pool, slot, row, logits, rng, sampling)
  return pool, tok, logits[0]


@functools.partial(jax.jit, static_argnums=(0, 9, 10, 11),
                   donate_argnums=(2,))
def _finish_many_jit(graphdef, params, pool, rows, idx, tokens, lengths,
                     temps, keys, sampled, top_k, top_p):
  """`_finish_jit` for a batch: the batch-1 `rows` (a tuple, not donated)
  stacked, their rests continued in one prefill, their first tokens
  sampled as `insert_many`'s, the rows written at idx (their row ids)."""
  TRACE_COUNTS["finish_many"] += 1
  model = P.merge(graphdef, params)
  state = P.set_row_id(jax.tree.map(lambda *r: jnp.concatenate(r), *rows),
                       idx)
  logits, state = CP.prefill_from_state_fn(model, tokens, lengths, state)
  return R.place_rows(pool, idx, state, P.sample_rows(
      logits, keys, temps, sampled, top_k, top_p))


@jax.jit
def _take_jit(x, idx):
  """x[idx] along the leading axis (idx clipped): a group's keys of a
  batch's, the first tokens at the batch's slots (padding: capacity,
  clipped: unspecified)."""
  return jnp.take(x, idx, axis=0, mode="clip")


def warmup_takes(tokens, keys, most: int) -> None:
  """Compiles `insert_cached_many`'s gathers for batches of up to `most`
  prompts: the first tokens of kp slots and a group's mp <= kp keys, kp
  and mp powers of two (tokens: a pool's next inputs; keys [1, ...]: a
  key row)."""
  kp = 1
  while kp <= most:
    _take_jit(tokens, np.zeros(kp, np.int32))
    batch_keys = jnp.repeat(keys, kp, axis=0)
    mp = 1
    while mp <= kp:
      _take_jit(batch_keys, np.zeros(mp, np.int32))
      mp *= 2
    kp *= 2


def _padded(tokens: np.ndarray, max_len: int):
  """tokens [n] right-padded with zeros to `bucket_len(n, max_len)`, and
  n, on the host (the jitted call transfers them: no eager op)."""
  n = tokens.shape[0]
  out = np.zeros((P.bucket_len(n, max_len),), np.int32)
  out[:n] = tokens
  return out, np.int32(n)


def warmup_prompts(block: int, max_prompt_len: int,
                   max_len: int) -> list[list[np.ndarray]]:
  """Sequences of prompts whose `insert_cached` calls, each sequence on an
  emptied cache of 2 entries, run every jitted shape that prompts of up to
  max_prompt_len tokens can need: the plain insert per bucket (no whole
  block), the prefill of a prefix per bucket (a miss), the extension of a
  cached prefix per bucket (a hit short of where the prompt parts from an
  earlier one), and the rest's prefill per bucket, up to all but one
  block of the prompt."""
  bucket = lambda n: P.bucket_len(n, max_len)
  zeros = lambda t: np.zeros((t,), np.int32)

  def parting(t, after):  # the zeros prompt's first `after` blocks only
    x = zeros(t)
    x[after * block] = 1
    return x

  seen, out = set(), []
  for t in range(1, max_prompt_len + 1):
    n = (t - 1) // block
    if n == 0:
      plans = [({("insert", bucket(t))}, [zeros(t)])]
    else:
      last = {("prefill", bucket(n * block)),
              ("finish", bucket(t - n * block))}
      plans = [(last, [zeros(t)])]
    if n >= 2:
      one = {("prefill", bucket(block)), ("finish", bucket(1))}
      plans += [
          # stored where it parts from the first prompt: 1 block
          (last | one | {("finish", bucket(t - block))},
           [zeros(t), parting(t, 1)]),
          # rows at 1 block (a parting miss) and at another prompt's block
          # evict the first prompt's row: the last one extends 1 to n
          (last | one | {("extend", bucket((n - 1) * block))},
           [zeros(t), zeros(block + 1), np.ones((block + 1,), np.int32),
            zeros(t)])]
    for shapes, prompts in plans:
      if not shapes <= seen:
        seen |= shapes
        out.append(prompts)
  return out


def warmup_batches(block: int, max_prompt_len: int, max_len: int,
                   most: int, vocab_size: int) -> list[list[list]]:
  """Sequences of prompt batches whose `insert_cached_many` calls, each
  sequence on an emptied cache of 2 entries, run every jitted shape that
  batches of up to `most` prompts of up to max_prompt_len tokens can need:
  `warmup_prompts`' sequences one prompt per batch, then for each batch
  size 2, 4, ... <= most and each bucket of a hit's rest, a prompt that
  stores one block followed by a batch of that size hitting it (tails
  that differ in their first token, so that none stores a row)."""
  out = [[[t] for t in seq]
         for seq in warmup_prompts(block, max_prompt_len, max_len)]
  rests = sorted({P.bucket_len(r, max_len): r
                  for r in range(1, max_prompt_len - block + 1)}.items())
  kp = 2
  while kp <= most:
    for _, r in rests:
      tails = [np.ones((r,), np.int32) for _ in range(kp)]
      for i, t in enumerate(tails):
        t[0] = i % vocab_size
      out.append([[np.zeros((block + 1,), np.int32)],
                  [np.concatenate([np.zeros((block,), np.int32), t])
                   for t in tails]])
    kp *= 2
  return out


def _plan(cache: PrefixCache, graphdef, params, pool: P.Pool,
          toks: np.ndarray, row_id):
  """A checked prompt's lookup (counted in the cache's statistics) and the
  row it stores, if any (module docstring) -> (the row its rest continues
  from, the tokens that row holds), or (None, 0) for a prompt without a
  whole block before its last token."""
  block = cache.block
  n_blocks = (toks.shape[0] - 1) // block
  keys = cache.keys(toks[:n_blocks * block])
  hit, row = 0, None
  for k in range(n_blocks, 0, -1):
    row = cache.get(keys[k - 1])
    if row is not None:
      hit = k
      break
  cache.lookups += 1
  if hit:
    cache.hits += 1
    cache.reused_tokens += hit * block
  else:
    cache.misses += 1
  if n_blocks == 0:
    return None, 0
  start = hit * block
  at = cache.store_at(keys, hit) if hit < n_blocks else hit
  if at > hit:
    end = at * block
    seg, n = _padded(toks[start:end], pool.max_len)
    if row is None:
      _, row = _prefill_jit(graphdef, params, seg, n, pool.state, row_id)
    else:
      _, row = _extend_jit(graphdef, params, row, seg, n)
    # The prompt's tokens and length were checked, so the row is valid
    # (positions >= 0) without reading it back: a read here would wait for
    # this prefill and for everything the device runs before it (an
    # engine's decode call in flight).
    cache.put(keys[at - 1], row)
    start = end
  return row, start


# ------------------------------------------------------------------ API
def insert_cached(model: M.HybridLM, pool: P.Pool, cache: PrefixCache, slot,
                  prompt_tokens, *, row_id=None, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None,
                  rng=None, implementation: str | None = None,
                  return_logits: bool = False, parts=None):
  """`insert` through a prefix cache (see the module docstring).

  Starts from the longest cached whole-block prefix of the prompt (at most
  len - 1 tokens), caches the state at a deeper whole-block boundary
  where the prompt parts from an earlier one (on a miss without one, at
  its last: `PrefixCache.store_at`), runs the rest of the prompt as a
  prefill continued from it and writes the row into `slot`.

  Args:
    model: the HybridLM the pool (and the cache) was built for.
    pool: the Pool (donated).
    cache: the PrefixCache (updated: rows, LRU order, counters).
    slot: int in [0, capacity), or an int32 scalar (out of range: nothing
      is written).
    prompt_tokens: [T] int token ids on the host (concrete: the keys are
      hashed on the host), 1 <= T <= pool.max_len; not modified.
    row_id, temperature, top_k, top_p, rng, return_logits, parts: as
      `insert`.
    implementation: no effect: the prompt runs as prefill passes, whose
      ops have one implementation each (kept so that callers passing their
      decode setting, such as `Engine`, run unchanged).

  Returns:
    (pool, first token int32 scalar [, logits [vocab] float32]), as
    `insert`.
  """
  P.check_pool(pool)
  if not isinstance(cache, PrefixCache):
    raise TypeError(f"cache must be a PrefixCache, got "
                    f"{type(cache).__name__}.")
  slot = P.check_slot(slot, pool.capacity)
  V.check_integer("prompt_tokens", prompt_tokens)
  if not V.is_concrete(prompt_tokens):
    raise TypeError("prompt_tokens must be concrete (not traced): "
                    "insert_cached hashes its blocks on the host.")
  P.check_prompt("prompt_tokens", prompt_tokens, model, pool)
  toks = np.asarray(prompt_tokens).astype(np.int32)  # a copy
  cache._check_layout(pool)
  row_id = P.check_row_id(slot if row_id is None else row_id)

  graphdef, params = P.model_parts(model, parts)
  row, start = _plan(cache, graphdef, params, pool, toks, row_id)
  if row is None:  # no whole block before the last token
    return P.insert(model, pool, slot, prompt_tokens, row_id=row_id,
                    temperature=temperature, top_k=top_k, top_p=top_p,
                    rng=rng, return_logits=return_logits,
                    parts=(graphdef, params))
  sampling, rng = P.resolve_sampling(temperature, top_k, top_p, rng)
  rest, n = _padded(toks[start:], pool.max_len)
  pool, tok, logits = _finish_jit(graphdef, params, pool, row, slot, rest,
                                  n, row_id, sampling, rng)
  return (pool, tok, logits) if return_logits else (pool, tok)


def insert_cached_many(model: M.HybridLM, pool: P.Pool, cache: PrefixCache,
                       slots, prompts, *, temperatures=None, keys=None,
                       top_k: int | None = None, top_p: float | None = None,
                       parts=None, padded: bool = False):
  """`insert_cached` for k prompts into k distinct slots, batched as
  `pool.insert_many`: each prompt's lookup and store on the host in turn
  (a prompt may hit a row an earlier one of the batch stored), then the
  rests continued from their rows in one prefill per rest bucket, and the
  prompts without a whole block before their last token through
  `insert_many`, one call per bucket.

  Args:
    model, pool, cache: as `insert_cached` (the pool donated, the cache
      updated).
    slots, prompts, temperatures, keys, top_k, top_p, parts, padded: as
      `pool.insert_many`.

  Returns:
    (pool, first tokens [k] (padded: [kp], kp the power of two >= k)
     int32 on the device, in the order of `slots`).
  """
  P.check_pool(pool)
  if not isinstance(cache, PrefixCache):
    raise TypeError(f"cache must be a PrefixCache, got "
                    f"{type(cache).__name__}.")
  slots, prompts, temps, sampled = P.check_batch(
      model, pool, slots, prompts, temperatures, keys, top_k, top_p)
  cache._check_layout(pool)
  graphdef, params = P.model_parts(model, parts)
  k = len(slots)
  kp = 1 << (k - 1).bit_length()
  groups = collections.defaultdict(list)  # (cached, rest bucket) -> rows
  plans = []
  for i, (slot, p) in enumerate(zip(slots, prompts)):
    plans.append(_plan(cache, graphdef, params, pool, p.astype(np.int32),
                       np.int32(slot)))
    rest = p.shape[0] - plans[-1][1]
    groups[(plans[-1][0] is not None,
            P.bucket_len(rest, pool.max_len))].append(i)
  krows = P.key_rows(keys, k, kp)
  for (cached, _), members in groups.items():
    m = len(members)
    mp = 1 << (m - 1).bit_length()
    sub = np.array(members + [members[0]] * (mp - m), np.int32)
    sub_keys = krows if m == k else _take_jit(krows, sub)  # [mp]
    if not cached:
      pool, _ = P.insert_many(
          model, pool, [slots[i] for i in members],
          [prompts[i] for i in members], temperatures=temps[members],
          keys=sub_keys, top_k=top_k, top_p=top_p,
          parts=(graphdef, params), padded=True)
    else:
      idx, tokens, lengths, sub_temps = P.device_batch(
          [slots[i] for i in members],
          [prompts[i][plans[i][1]:] for i in members], temps[members], mp,
          pool)
      rows = tuple(plans[i][0] for i in sub)
      pool, _ = _finish_many_jit(graphdef, params, pool, rows, idx, tokens,
                                 lengths, sub_temps, sub_keys, sampled,
                                 top_k, top_p)
  # Every group wrote its first tokens into the pool's next inputs: one
  # gather of a fixed shape, whatever the groups.
  idx = np.full(kp, pool.capacity, np.int32)
  idx[:k] = slots
  tok = _take_jit(pool.tokens, idx)
  return pool, (tok if padded else tok[:k])
