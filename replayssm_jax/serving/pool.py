"""A slot-indexed decode-state pool: one request per batch row.

  pool = init_pool(model, capacity=8, max_len=256, ssm_mode="replay")
  pool, first = insert(model, pool, slot, prompt_tokens)  # prefill a slot
  pool, firsts = insert_many(model, pool, slots, prompts)  # k at once
  pool, tokens = step(model, pool)           # one token per active slot
  pool, tokens = step_n(model, pool, n)      # n tokens, one dispatch
  pool = evict(pool, slot)                   # the slot is free again

Design.

* Dense batch. The pool is one `ModelState` of batch = capacity (every leaf
  of a ModelState is batch-leading: `init_pool` checks it), and a decode
  step runs `HybridLM.step` over all `capacity` rows at once, active or
  not, so that one compiled step serves any mix of requests. Each slot
  keeps its own replay counter, KV length and position (the decode ops
  take per-row counters): a new request does not wait for a flush.

* Free slots are decoded too, and their state is not kept. A step runs
  every row, active or not, and keeps each row's new state: a slot that is
  not active (free, or finished and awaiting eviction) holds unspecified
  contents after a step. Keeping its old state instead (a
  `where(active, new, old)` over every leaf) would cost a read of both and
  a write of the whole pool per step, KV caches included, since the old
  value stays live past the kernels that update the state in place; XLA
  then copies the pool each step. Nothing reads a free slot: the decode
  ops are row-wise (the MoE dispatch never drops a token, whatever the
  other rows route), a free slot's token is reported as -1, its next input
  is selected (`where`, never a 0/1 product: it may hold NaN or garbage
  ids) and `insert` overwrites every leaf of its row before it is used
  again. Tests fill free slots with NaN / inf / garbage integers and check
  that the active rows decode bit for bit as beside clean ones.

* What `insert` overwrites. `insert` prefills the prompt into a fresh
  batch-1 state whose layout (dtypes, shapes, static policy) is the
  pool's but whose contents are zeros built inside the jitted function
  (never read from the pool), then scatters that state into row `slot`
  of every leaf: the conv windows, the replay checkpoints, the whole
  buffers (slots past the counter too), read copies and scales, counters,
  the whole KV cache row (entries past the prompt too), KV lengths and
  the position. Nothing of a slot's previous request survives, so a slot
  may be reused after `evict` whatever it holds; the other slots' rows
  are not touched (a scatter into one row of each buffer, in place when
  the pool is donated).

* Compilation. `insert` takes the slot as a traced int32, so one compile
  serves every slot; prompts are right-padded to a bucket (`bucket_len`:
  a power of two >= 16, above 256 also 3 x 2^k, at most max_len) and
  passed with their length, as `prefill` takes them: one compile per
  bucket. `step` compiles once per pool shape and sampling mode; `step_n`
  once per n (a `lax.fori_loop`).

The pool's state is donated by `insert`, `step` and `step_n` (as
`decode_step` donates its state): use the returned pool, not the one
passed in. Out-of-range traced values follow the project's policy
(`replayssm_jax._validation`): a traced slot outside [0, capacity) writes
nothing; a slot whose prompt or tokens are out of range, or whose KV cache
is full, gets NaN logits and tokens -1 from then on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models.generate import (check_sampling, filter_logits,
                                           sample_logits, sampling_settings,
                                           seed0_key)
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.serving import rows as R
from replayssm_jax.models.parts import merge, model_parts

# Number of times each jitted entry point was traced (tests assert on it).
TRACE_COUNTS = {"insert": 0, "insert_many": 0, "step": 0, "step_n": 0}
MIN_BUCKET = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
  """A fixed-capacity decode state: row `slot` of every leaf of `state`
  belongs to the request in that slot.

  state:   ModelState of batch = capacity.
  active:  [capacity] bool, the slot holds a request.
  tokens:  [capacity] int32, each slot's next input token (its last
           sampled token; -1 for a slot whose request became invalid).
  max_len: the longest prompt + generated tokens a slot holds (static).
  """
  state: S.ModelState
  active: jax.Array
  tokens: jax.Array
  max_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def capacity(self) -> int:
    return self.active.shape[0]

  def replace(self, **kwargs) -> "Pool":
    return dataclasses.replace(self, **kwargs)


def init_pool(model: M.HybridLM, capacity: int, max_len: int, *,
              ssm_mode: str = "replay", buffer_len: int = 16,
              **state_kwargs) -> Pool:
  """An empty pool (no slot active).

  Args:
    model: the HybridLM.
    capacity: slots (the decode batch).
    max_len: prompt + generated tokens per slot (the KV-cache length;
      `models.kv_cache_len` rounds a length to one the attention kernel
      tiles).
    ssm_mode, buffer_len, **state_kwargs: as `HybridLM.init_state`
      (checkpoint_dtype, buffer_dtype, kv_dtype, conv_dtype, precision,
      row_ids).
  """
  capacity = V.positive_int("capacity", capacity)
  max_len = V.positive_int("max_len", max_len)
  state = model.init_state(capacity, max_len, ssm_mode=ssm_mode,
                           buffer_len=buffer_len, **state_kwargs)
  for path, leaf in jax.tree_util.tree_leaves_with_path(state):
    if leaf.ndim < 1 or leaf.shape[0] != capacity:
      raise ValueError(
          f"state leaf {jax.tree_util.keystr(path)} of shape {leaf.shape} "
          f"is not batch-leading; the pool writes slots along axis 0.")
  return Pool(state=state, active=jnp.zeros((capacity,), bool),
              tokens=jnp.zeros((capacity,), jnp.int32), max_len=max_len)


# ------------------------------------------------------------ validation
def check_pool(pool):
  if not isinstance(pool, Pool):
    raise TypeError(f"pool must be a Pool (from init_pool), got "
                    f"{type(pool).__name__}.")


def host_slot(slot, capacity: int, name: str = "slot") -> int:
  """A Python / NumPy int slot in [0, capacity) as an int, checked on the
  host alone (no device array is made or read); errors name `name`."""
  if (isinstance(slot, (bool, np.bool_))
      or not isinstance(slot, (int, np.integer))):
    raise ValueError(f"{name} must be a Python int in [0, {capacity}), "
                     f"got {slot!r}.")
  if not 0 <= slot < capacity:
    raise ValueError(f"{name} must lie in [0, capacity) = [0, {capacity}), "
                     f"got {slot}.")
  return int(slot)


def check_slot(slot, capacity: int):
  """A Python / NumPy int slot in [0, capacity) as a NumPy int32 scalar
  (on the host: the jitted call that takes it transfers it, no eager op);
  a jax integer scalar (possibly traced) as int32."""
  if isinstance(slot, (bool, np.bool_, int, np.integer)):
    return np.int32(host_slot(slot, capacity))
  V.check_integer("slot", slot)
  if jnp.ndim(slot) != 0:
    raise ValueError(f"slot must be a scalar, got shape "
                     f"{tuple(jnp.shape(slot))}.")
  if V.is_concrete(slot) and not 0 <= int(slot) < capacity:
    raise ValueError(f"slot must lie in [0, capacity) = [0, {capacity}), "
                     f"got {int(slot)}.")
  return jnp.asarray(slot, jnp.int32)


def check_prompt(name: str, tokens, model: M.HybridLM, pool: Pool) -> int:
  """A [T] integer prompt of valid token ids with 1 <= T <= the pool's
  max_len, errors naming `name` -> T."""
  V.check_integer(name, tokens)
  M._check_tokens(name, tokens, 1, "[seqlen]", model.config)  # pylint: disable=protected-access
  t = tokens.shape[0]
  if not 1 <= t <= pool.max_len:
    raise ValueError(f"{name} must hold 1 to the pool's max_len "
                     f"({pool.max_len}) tokens, got {t}.")
  return t


def bucket_len(length: int, max_len: int) -> int:
  """The padded prompt length `insert` compiles for: the smallest power of
  two >= max(length, MIN_BUCKET), or above 256 tokens the smallest of
  2^k and 3 * 2^(k-1) (512, 768, 1024, 1536, ...: a third more compiled
  shapes, padding at most a third of the tokens instead of half: the rest
  of a long prompt after a cached prefix is no longer padded up to the
  whole prompt's bucket), at most max_len."""
  b = max(MIN_BUCKET, 1 << (length - 1).bit_length())
  if b > 256 and 4 * length <= 3 * b:
    b = 3 * b // 4
  return min(max_len, b)


def check_row_id(row_id):
  """row_id (stochastic rounding's request identity) as int32: a host int
  stays on the host (no eager op), a jax integer (maybe traced) checked."""
  if isinstance(row_id, (int, np.integer)) and not isinstance(
      row_id, (bool, np.bool_)):
    return np.int32(row_id)
  V.check_integer("row_id", jnp.asarray(row_id))
  return jnp.asarray(row_id, jnp.int32)


def resolve_sampling(temperature, top_k, top_p, rng):
  """(SamplingSettings, rng or the key of seed 0 when None)."""
  sampling = sampling_settings(temperature, top_k, top_p, None, rng)
  return sampling, seed0_key() if rng is None else rng


# ----------------------------------------------------------------- insert
def set_row_id(row: S.ModelState, row_id) -> S.ModelState:
  """`row` with every row_id leaf (stochastic rounding's request identity)
  set to `row_id`: a scalar, or one per row ([batch])."""
  def put(path, x):
    last = path[-1]
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "row_id":
      ids = jnp.asarray(row_id, x.dtype)
      if ids.ndim:
        ids = ids.reshape((-1,) + (1,) * (x.ndim - 1))
      return jnp.broadcast_to(ids, x.shape)
    return x
  return jax.tree_util.tree_map_with_path(put, row)


def fresh_row(state: S.ModelState, row_id):
  """A batch-1 ModelState laid out as `state`, all zeros (row_id leaves:
  `row_id`): built from shapes only, never from the pool's contents."""
  return fresh_rows(state, jnp.reshape(jnp.asarray(row_id, jnp.int32), (1,)))


def fresh_rows(state: S.ModelState, row_ids):
  """`fresh_row` for k rows at once: row_ids [k] -> a batch-k ModelState."""
  k = row_ids.shape[0]
  return set_row_id(jax.tree.map(
      lambda x: jnp.zeros((k,) + x.shape[1:], x.dtype), state), row_ids)


def sample_rows(logits, keys, temps, sampled: bool, top_k, top_p):
  """Each row's next token from logits [b, vocab] f32 with its own
  temperature (temps [b]; 0: greedy) and key (keys [b, ...]): the argmax,
  or with `sampled` (static: some row samples) a draw from
  `filter_logits` for the rows whose temperature is > 0."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not sampled:
    return greedy
  t = jnp.where(temps > 0, temps, 1.0)[:, None]
  masked = filter_logits(logits, False, t, top_k, top_p)
  draw = jax.vmap(jax.random.categorical)(keys, masked)
  return jnp.where(temps > 0, draw.astype(jnp.int32), greedy)


def slot_index(slot, capacity: int):
  """The scatter index of a (traced) slot: itself in range, else
  `capacity`, which mode="drop" scatters drop (nothing is written)."""
  return jnp.where((slot >= 0) & (slot < capacity), slot, capacity)


def place_row(pool: Pool, slot, row: S.ModelState, logits, rng,
              sampling) -> tuple[Pool, jax.Array]:
  """Samples a request's first token from its prompt's last logits [1,
  vocab] (-1 for an invalid row), writes the batch-1 `row` into every
  leaf's row `slot` (a slot out of range: nothing) and marks the slot
  active with that token as its next input -> (pool, token)."""
  tok = sample_logits(logits, rng, *sampling)
  idx = slot_index(slot, pool.capacity)[None]
  pool, tok = R.place_rows(pool, idx, row, tok)
  return pool, tok[0]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _insert_jit(graphdef, params, pool, slot, tokens, length, row_id,
                sampling, rng):
  TRACE_COUNTS["insert"] += 1
  model = merge(graphdef, params)
  fresh = fresh_row(pool.state, row_id)
  logits, row = M.prefill_fn(model, tokens[None], length[None], fresh)
  pool, tok = place_row(pool, slot, row, logits, rng, sampling)
  return pool, tok, logits[0]


def insert(model: M.HybridLM, pool: Pool, slot, prompt_tokens, *,
           bucket: int | None = None, row_id=None, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, rng=None,
           return_logits: bool = False, parts=None):
  """Prefills one prompt into `slot` and marks it active.

  Only row `slot` of the pool's state changes, all of it (see the module
  docstring); the other slots keep their states, counters mid-buffer
  included. A request already in the slot is replaced.

  Args:
    model: the HybridLM the pool was built for.
    pool: the Pool (donated).
    slot: int in [0, capacity), a Python int or an int32 scalar (traced:
      one compile serves every slot; out of range: nothing is written).
    prompt_tokens: [T] int token ids, 1 <= T <= pool.max_len.
    bucket: the padded length to compile for (default `bucket_len(T,
      max_len)`), T <= bucket <= max_len.
    row_id: the request's identity for stochastic rounding (default: the
      slot); unused without such a precision policy.
    temperature, top_k, top_p, rng: sampling of the first token, as
      `generate` (default greedy).
    return_logits: also return the prefill's last logits [vocab] f32.
    parts: `nnx.split(model)`, kept by the caller (`model_parts`).

  Returns:
    (pool, first token int32 scalar [, logits [vocab] float32]); the first
    token is also the slot's next input token.
  """
  check_pool(pool)
  slot = check_slot(slot, pool.capacity)
  t = check_prompt("prompt_tokens", prompt_tokens, model, pool)
  if bucket is None:
    bucket = bucket_len(t, pool.max_len)
  bucket = V.positive_int("bucket", bucket)
  if not t <= bucket <= pool.max_len:
    raise ValueError(f"bucket must lie in [len(prompt_tokens), max_len] = "
                     f"[{t}, {pool.max_len}], got {bucket}.")
  sampling, rng = resolve_sampling(temperature, top_k, top_p, rng)
  row_id = check_row_id(slot if row_id is None else row_id)
  if V.is_concrete(prompt_tokens):
    # Padded on the host (an eager scatter would compile once per prompt
    # length) and left there: the jitted call transfers it.
    tokens = np.zeros((bucket,), np.int32)
    tokens[:t] = np.asarray(prompt_tokens)
  else:
    tokens = jnp.zeros((bucket,), jnp.int32).at[:t].set(
        jnp.asarray(prompt_tokens, jnp.int32))
  graphdef, params = model_parts(model, parts)
  pool, tok, logits = _insert_jit(graphdef, params, pool, slot, tokens,
                                  np.int32(t), row_id, sampling, rng)
  return (pool, tok, logits) if return_logits else (pool, tok)


@functools.partial(jax.jit, static_argnums=(0, 8, 9, 10),
                   donate_argnums=(2,))
def _insert_many_jit(graphdef, params, pool, idx, tokens, lengths, row_ids,
                     temps_keys, sampled, top_k, top_p):
  TRACE_COUNTS["insert_many"] += 1
  model = merge(graphdef, params)
  fresh = fresh_rows(pool.state, row_ids)
  logits, rows = M.prefill_fn(model, tokens, lengths, fresh)
  return R.place_rows(pool, idx, rows, sample_rows(
      logits, temps_keys[1], temps_keys[0], sampled, top_k, top_p))


def insert_many(model: M.HybridLM, pool: Pool, slots, prompts, *,
                temperatures=None, keys=None, top_k: int | None = None,
                top_p: float | None = None, parts=None,
                padded: bool = False):
  """Prefills k prompts into k distinct slots in one call (one batched
  prefill): `insert` for each (slot, prompt) pair, with the same effect
  on the pool up to the batch's effect on matmul rounding.

  The batch is padded to a power of two and the prompts to the longest's
  bucket: one compile per (batch, bucket) pair; padding rows write nothing.

  Args:
    model, pool: as `insert` (the pool donated).
    slots: k distinct ints in [0, capacity).
    prompts: k [T_i] int token arrays (on the host), 1 <= T_i <= max_len.
    temperatures: [k] floats (0: greedy; default all greedy).
    keys: [k] PRNG keys (a sequence, or one [k, ...] or padded [kp, ...]
      array) of the rows that sample (any for greedy rows); required when
      a temperature is > 0.
    top_k, top_p: the sampling filters of every sampling row.
    parts: `nnx.split(model)`, kept by the caller (`model_parts`).
    padded: return the padded batch's first tokens ([kp], kp the power
      of two >= k; padding rows' unspecified), sparing a slicing op.

  Returns:
    (pool, first tokens [k] (padded: [kp]) int32 on the device).
  """
  check_pool(pool)
  slots, prompts, temps, sampled = check_batch(
      model, pool, slots, prompts, temperatures, keys, top_k, top_p)
  k = len(slots)
  kp = 1 << (k - 1).bit_length()  # the batch, padded to a power of two
  idx, tokens, lengths, temps = device_batch(slots, prompts, temps, kp, pool)
  krows = key_rows(keys, k, kp)
  graphdef, params = model_parts(model, parts)
  pool, tok = _insert_many_jit(graphdef, params, pool, idx, tokens, lengths,
                               idx, (temps, krows), sampled, top_k, top_p)
  return pool, (tok if padded else tok[:k])


def check_batch(model, pool, slots, prompts, temperatures, keys, top_k,
                top_p):
  """`insert_many`'s arguments checked on the host -> (slots [k] ints,
  prompts [k] arrays, temperatures [k] float32, sampled: any > 0)."""
  slots = [host_slot(s, pool.capacity, f"slots[{i}]")
           for i, s in enumerate(slots)]
  k = len(slots)
  if k == 0 or len(set(slots)) != k:
    raise ValueError(f"slots must be one or more distinct slots, got "
                     f"{slots}.")
  prompts = [np.asarray(p) for p in prompts]
  if len(prompts) != k:
    raise ValueError(f"prompts must hold one prompt per slot ({k}), got "
                     f"{len(prompts)}.")
  for i, p in enumerate(prompts):
    check_prompt(f"prompts[{i}]", p, model, pool)
  temps = np.zeros(k, np.float32) if temperatures is None else np.asarray(
      temperatures, np.float32)
  if temps.shape != (k,) or not (np.isfinite(temps) & (temps >= 0)).all():
    raise ValueError(f"temperatures must be {k} finite floats >= 0, got "
                     f"{temperatures!r}.")
  sampled = bool((temps > 0).any())
  if sampled and keys is None:
    raise ValueError("keys are required when a temperature is > 0.")
  check_sampling(1.0, top_k, top_p)
  return slots, prompts, temps, sampled


def padded_batch(slots, prompts, kp: int, pool: Pool):
  """k slots and their host prompts as kp >= k rows on the host: idx [kp]
  (padding: `capacity`, dropped by a scatter), tokens [kp, bucket] (the
  longest prompt's) right-padded with zeros, lengths [kp] (padding: 1)."""
  bucket = bucket_len(max(p.shape[0] for p in prompts), pool.max_len)
  tokens = np.zeros((kp, bucket), np.int32)
  lengths = np.ones(kp, np.int32)
  idx = np.full(kp, pool.capacity, np.int32)
  for i, (slot, p) in enumerate(zip(slots, prompts)):
    tokens[i, :p.shape[0]], lengths[i], idx[i] = p, p.shape[0], slot
  return idx, tokens, lengths


def device_batch(slots, prompts, temps, kp: int, pool: Pool):
  """`padded_batch` and the k temperatures padded with zeros to kp, on the
  device in one host -> device call: (idx, tokens, lengths, temps)."""
  return jax.device_put((*padded_batch(slots, prompts, kp, pool),
                         np.pad(temps, (0, kp - len(slots)))))


def key_rows(keys, k: int, kp: int):
  """keys (k keys, or a [k, ...] array of them; None: zeros) as a
  [kp, ...] uint32 array, zero keys in the padding rows (an array of kp
  keys, already padded, is taken as it is)."""
  shape = seed0_key().shape
  if keys is None:
    return jnp.zeros((kp,) + shape, jnp.uint32)
  if not isinstance(keys, (jax.Array, np.ndarray)):
    keys = jnp.stack(list(keys))
  if tuple(keys.shape) not in ((k,) + shape, (kp,) + shape):
    raise ValueError(f"keys must hold {k} PRNG keys of shape {shape}, got "
                     f"shape {tuple(keys.shape)}.")
  keys = jnp.asarray(keys, jnp.uint32)
  return keys if keys.shape[0] == kp else jnp.concatenate(
      [keys, jnp.zeros((kp - k,) + shape, jnp.uint32)])


def evict(pool: Pool, slot) -> Pool:
  """Marks `slot` free. Its row is never read for another request: later
  steps decode it as a free row (contents unspecified) and `insert`
  overwrites all of it."""
  check_pool(pool)
  slot = check_slot(slot, pool.capacity)
  idx = slot_index(slot, pool.capacity)
  return pool.replace(active=pool.active.at[idx].set(False, mode="drop"))


@jax.jit
def _clear_active(active, free):
  return active & ~free


def evict_many(pool: Pool, slots) -> Pool:
  """`evict` of several slots (Python ints) in one op, compiled once for
  any number of them."""
  check_pool(pool)
  free = np.zeros(pool.capacity, bool)
  for i, s in enumerate(slots):
    free[host_slot(s, pool.capacity, f"slots[{i}]")] = True
  return pool.replace(active=_clear_active(pool.active, free))


# ------------------------------------------------------------------- step
def _step_body(model, pool, sampling, rng, implementation):
  """One decode step of every active slot (`step_rows` with the pool's
  sampling settings)."""
  return R.step_rows(model, pool, pool.active,
                     lambda lg: sample_logits(lg, rng, *sampling),
                     implementation)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(2,))
def _step_jit(graphdef, params, pool, sampling, rng, implementation):
  TRACE_COUNTS["step"] += 1
  model = merge(graphdef, params)
  return _step_body(model, pool, sampling, rng, implementation)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 7),
                   donate_argnums=(2,))
def _step_n_jit(graphdef, params, pool, n, with_logits, sampling, rng,
                implementation):
  TRACE_COUNTS["step_n"] += 1
  model = merge(graphdef, params)
  cap, vocab = pool.capacity, model.config.vocab_size
  out = jnp.full((cap, n), -1, jnp.int32)
  all_logits = (jnp.zeros((cap, n, vocab), jnp.float32) if with_logits
                else None)

  def body(i, carry):
    pool, out, all_logits, rng = carry
    rng, sub = jax.random.split(rng)
    pool, tok, logits = _step_body(model, pool, sampling, sub,
                                   implementation)
    out = out.at[:, i].set(tok)
    if with_logits:
      all_logits = all_logits.at[:, i].set(logits)
    return pool, out, all_logits, rng

  pool, out, all_logits, _ = jax.lax.fori_loop(
      0, n, body, (pool, out, all_logits, rng))
  return pool, out, all_logits


def _check_room(pool: Pool, n: int):
  pos = pool.state.positions
  if V.is_concrete(pos) and V.is_concrete(pool.active):
    full = np.asarray(pool.active) & (np.asarray(pos) + n > pool.max_len)
    if full.any():
      raise ValueError(f"n: slots {np.nonzero(full)[0].tolist()} would "
                       f"run past the pool's max_len {pool.max_len} "
                       f"within {n} step(s); evict them or build the pool "
                       f"with a larger max_len.")


def step(model: M.HybridLM, pool: Pool, *, temperature: float = 0.0,
         top_k: int | None = None, top_p: float | None = None, rng=None,
         implementation: str | None = None, return_logits: bool = False,
         parts=None):
  """One decode step over all slots (dense batch = capacity).

  Each active slot feeds its next input token and samples its next one
  (greedy by default; temperature / top_k / top_p / rng as `generate`).
  Inactive slots report -1; their states are left unspecified (the module
  docstring). parts: `nnx.split(model)`, kept by the caller
  (`model_parts`).

  Returns:
    (pool, tokens [capacity] int32 [, logits [capacity, vocab] float32;
     rows of inactive slots are meaningless]).
  """
  check_pool(pool)
  _check_room(pool, 1)
  sampling, rng = resolve_sampling(temperature, top_k, top_p, rng)
  graphdef, params = model_parts(model, parts)
  pool, tokens, logits = _step_jit(graphdef, params, pool, sampling, rng,
                                   implementation)
  return (pool, tokens, logits) if return_logits else (pool, tokens)


def step_n(model: M.HybridLM, pool: Pool, n: int, *,
           temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, rng=None,
           implementation: str | None = None, return_logits: bool = False,
           parts=None):
  """`n` decode steps in one jitted `lax.fori_loop` (one dispatch); parts
  as `step`.

  Returns:
    (pool, tokens [capacity, n] int32 (-1 for inactive slots) [, logits
     [capacity, n, vocab] float32]).
  """
  check_pool(pool)
  n = V.positive_int("n", n)
  _check_room(pool, n)
  sampling, rng = resolve_sampling(temperature, top_k, top_p, rng)
  graphdef, params = model_parts(model, parts)
  pool, tokens, logits = _step_n_jit(graphdef, params, pool, n,
                                     bool(return_logits), sampling, rng,
                                     implementation)
  return (pool, tokens, logits) if return_logits else (pool, tokens)
