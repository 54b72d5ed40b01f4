"""Speculative decoding inside the continuous-batching engine.

  spec = Speculation(NgramProposer(n=3), window=4)
  engine = Engine(model, capacity=64, max_len=512, steps_per_dispatch=4,
                  speculative=spec)

`Engine(speculative=...)` replaces the engine's decode step by a
speculative round over the whole pool, `steps_per_dispatch` rounds per
compiled call. One round, for every slot at once:

  1. the proposer drafts up to window - 1 tokens per slot from the slot's
     token history (`Proposer.propose`);
  2. one `verify_fn` of [next input token, drafts] over the pool's state
     (the dense batch of `capacity` rows, as `pool.step` runs);
  3. `accept` per row: greedy rows accept the longest prefix of drafts
     equal to the target's argmax, sampled rows by speculative sampling
     with their own temperature and PRNG stream;
  4. the slot emits its accepted drafts and the target's next token, cut at
     its budget and after its eos (tokens past either are dropped: never
     emitted, never committed);
  5. `commit_fn` of the tokens that became history (replay: a counter
     move; baseline: the snapshot after them) and `Proposer.update`.

Rows that are free, finished or out of budget emit nothing and keep their
history and next input token; their target and proposer states are left
unspecified, as the plain loop leaves a free slot's (`rows.step_rows`). A
free slot may hold anything (NaN included) and `where` never lets it
through.

Per-slot device state beside the pool (`SpecSlots`): the token history
(prompt, then generated tokens; `NgramProposer` searches it), its length,
the tokens generated and the proposer's state (a `DraftModelProposer`'s
draft ModelState: each leaf batch-leading, row `slot` belongs to the
slot's request). `insert_slots` writes a whole row of it when a request is
admitted (the proposer's state from `Proposer.init` on the prompt), so a
reused slot keeps nothing of its previous request.

KV room: a round verifies `window` tokens past a slot's history, so the
pool's caches hold `kv_cache_len(max_len + window - 1)` entries for
requests of at most max_len prompt + generated tokens.

Random numbers: the per-slot key stream is split once per round into a
proposal key and an acceptance key. Dispatches where some active slot
samples call the proposer per row (vmapped, batch 1; the row's greedy
flag and temperature as the proposer's sampling settings, the greedy flag
traced), so a sampled request's draws depend on its own seed only, not on
its slot or batch-mates; greedy-only dispatches call it once for the pool.
"""

# pylint: disable=protected-access  (verify's state checks are shared)

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.models.proposers import ProposalContext, Proposer
from replayssm_jax.models.speculative import accept
from replayssm_jax.models.verify_commit import (_check_window_room,
                                                commit_fn, verify_fn)
from replayssm_jax.serving import controls as C
from replayssm_jax.serving import pool as P
from replayssm_jax.serving import rows as R

# Per-slot statistics columns after the tokens of a dispatch's output:
# slot-rounds verified, drafts proposed, drafts accepted.
STAT_COLUMNS = 3


@dataclasses.dataclass(frozen=True)
class Speculation:
  """The engine's speculative decoding settings.

  proposer: a `models.Proposer` (`NgramProposer`, `DraftModelProposer`,
    ...): drafts up to window - 1 tokens per slot and round.
  window: T >= 1 tokens verified per slot and round (the next input token
    and T - 1 drafts; T = 1 verifies one token per round, no drafts).
  """
  proposer: Proposer
  window: int = 4

  def __post_init__(self):
    if not isinstance(self.proposer, Proposer):
      raise TypeError(f"Speculation.proposer must be a models.Proposer "
                      f"(NgramProposer, DraftModelProposer, ...), got "
                      f"{type(self.proposer).__name__}.")
    object.__setattr__(self, "window",
                       V.positive_int("Speculation.window", self.window))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecSlots:
  """Per-slot state of speculative decoding (row `slot` of every leaf
  belongs to the request in that slot).

  history:   [capacity, max_len] int32 prompt then generated tokens
             (entries at or past `length` are meaningless).
  length:    [capacity] int32 valid history, the pool's next input token
             (the last generated one) included.
  generated: [capacity] int32 tokens generated, the first included.
  pstate:    the proposer's state, every array leaf batch-leading.
  """
  history: jax.Array
  length: jax.Array
  generated: jax.Array
  pstate: Any


def check_speculation(speculative: Speculation, model: M.HybridLM,
                      pool: P.Pool, ssm_mode: str,
                      buffer_len: int) -> Speculation:
  """`speculative` checked against the model and the pool's state: a
  proposer that serves the model, a state `verify` can take (replay
  buffers longer than the window; a baseline state's precision policy
  plain)."""
  _check_window_room(pool.state, speculative.window,
                     "Engine(speculative=...)")
  speculative.proposer.validate(model, window=speculative.window,
                                ssm_mode=ssm_mode, buffer_len=buffer_len)
  return speculative


def kv_len(max_len: int, window: int) -> int:
  """The pool's KV-cache length for requests of max_len tokens: room for a
  window verified past the last history token."""
  return S.kv_cache_len(max_len + window - 1)


def _init_args(spec: Speculation, pool: P.Pool, ssm_mode, buffer_len):
  return dict(max_len=pool.max_len, window=spec.window, ssm_mode=ssm_mode,
              buffer_len=buffer_len)


def init_slots(spec: Speculation, pool: P.Pool, max_len: int, ssm_mode: str,
               buffer_len: int) -> SpecSlots:
  """Empty per-slot state (zeros; the proposer state laid out as
  `Proposer.init` returns it for one prompt, `capacity` rows). The
  proposer's state must be batch-leading and its shapes must not depend on
  the prompt's length (every admission writes one row of it)."""
  cap = pool.capacity
  kw = _init_args(spec, pool, ssm_mode, buffer_len)
  shapes = jax.eval_shape(
      lambda: spec.proposer.init(jnp.zeros((1, P.MIN_BUCKET), jnp.int32),
                                 jnp.ones((1,), jnp.int32), **kw))
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    if len(leaf.shape) < 1 or leaf.shape[0] != 1:
      raise ValueError(
          f"Speculation.proposer: its state leaf "
          f"{jax.tree_util.keystr(path)} of shape {leaf.shape} (one prompt) "
          f"is not batch-leading; the engine writes it per slot.")
  pstate = jax.tree.map(
      lambda s: jnp.zeros((cap,) + tuple(s.shape[1:]), s.dtype), shapes)
  # Separate buffers: the dispatch donates every leaf.
  return SpecSlots(history=jnp.zeros((cap, max_len), jnp.int32),
                   length=jnp.zeros((cap,), jnp.int32),
                   generated=jnp.zeros((cap,), jnp.int32), pstate=pstate)


@functools.partial(jax.jit, static_argnums=(6,), donate_argnums=(1,))
def _insert_jit(proposer, slots, idx, tokens, lengths, firsts, init_kw):
  """Rows idx [k] (out of range: nothing written) of `slots` for prompts
  tokens [k, bucket] of `lengths` [k] and first tokens firsts [k]."""
  cols = jnp.arange(tokens.shape[1])
  width = slots.history.shape[1]
  rows = jnp.zeros((tokens.shape[0], width), jnp.int32).at[:, cols].set(
      jnp.where(cols < lengths[:, None], tokens, 0), mode="drop")
  rows = rows.at[jnp.arange(tokens.shape[0]), lengths].set(firsts,
                                                           mode="drop")
  prow = proposer.init(tokens, lengths, **dict(init_kw))
  put = lambda p, r: p.at[idx].set(r, mode="drop")
  return SpecSlots(
      history=put(slots.history, rows),
      length=put(slots.length, lengths + 1),
      generated=put(slots.generated, jnp.ones_like(lengths)),
      pstate=jax.tree.map(put, slots.pstate, prow))


def insert_slots(spec: Speculation, slots: SpecSlots, pool: P.Pool,
                 slot_list, prompts, firsts, ssm_mode: str,
                 buffer_len: int) -> SpecSlots:
  """Writes rows `slot_list` (k distinct slots) of `slots` (donated) for
  requests admitted with `prompts` (k [T_i] token arrays on the host) and
  first tokens `firsts` (a device array of k or more: the first k are
  theirs), in one call: their histories, and the proposer's states after
  the prompts."""
  k, kp = len(slot_list), firsts.shape[0]
  if not 0 < k <= kp:
    raise ValueError(f"firsts must hold a first token for each of the "
                     f"{k} slots, got {kp}.")
  # Padding rows: one token, written nowhere.
  idx, tokens, lengths = P.padded_batch(
      slot_list, [np.asarray(x, np.int32) for x in prompts], kp, pool)
  init_kw = tuple(sorted(_init_args(spec, pool, ssm_mode,
                                    buffer_len).items()))
  return _insert_jit(spec.proposer, slots, idx, tokens, lengths, firsts,
                     init_kw)


def _row_sampling(temps, top_k, top_p):
  """Per-row sampling settings (greedy flag, temperature) of the rows'
  temperatures (0: greedy)."""
  return (temps <= 0, jnp.where(temps > 0, temps, 1.0), top_k, top_p)


def _propose(proposer, pstate, ctx, window, keys, batch_key, sampled, temps,
             top_k, top_p):
  """The proposer's drafts for the pool: one call (greedy-only dispatch),
  or one batch-1 call per row with the row's key and settings (vmapped)."""
  if not sampled:
    return proposer.propose(pstate, ctx, window, batch_key,
                            (True, 1.0, None, None))

  def one(ps, hist, ln, last, gen, act, key, temp):
    add = lambda x: x[None]
    row_ctx = ProposalContext(history=add(hist), length=add(ln),
                              last=add(last), num_generated=add(gen),
                              active=add(act), iteration=ctx.iteration)
    prop, ps = proposer.propose(jax.tree.map(add, ps), row_ctx, window, key,
                                _row_sampling(temp, top_k, top_p))
    return jax.tree.map(lambda x: x[0], (prop, ps))

  return jax.vmap(one)(pstate, ctx.history, ctx.length, ctx.last,
                       ctx.num_generated, ctx.active, keys, temps)


def _accept(logits, drafts, nd, q, keys, sampled, temps, top_k, top_p):
  """`accept` of every row: batched greedy (greedy-only dispatch), or per
  row with the row's key and settings (vmapped)."""
  if not sampled:
    return accept(logits, drafts, nd, q, (True, 1.0, None, None), None)

  def one(lg, d, n, qr, key, temp):
    a, nxt = accept(lg[None], d[None], n[None],
                    None if qr is None else qr[None], _row_sampling(
                        temp, top_k, top_p), key)
    return a[0], nxt[0]

  return jax.vmap(one)(logits, drafts, nd, q, keys, temps)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 10),
                   donate_argnums=(2, 3, 11))
def dispatch(graphdef, params, pool, slots, proposer, n, window, sampled,
             top_k, top_p, implementation, ctl, batch_key, rows=None):
  """n speculative rounds of every slot, or of the slots `rows` [k] int32
  (gathered into a batch of k and scattered back within the call:
  `rows.on_rows`), with on-device stopping.

  ctl: the slots' `controls.SlotControls` (budgets, eos ids, temperatures
  (0: greedy), raw uint32 key streams); batch_key: the key of whole-pool
  proposals; sampled (static): some slot samples.
  Returns (pool, slots, out [cap or k, n * window + STAT_COLUMNS] int32:
  each slot's emitted tokens packed from column 0 (-1 after them; a -1
  first for a slot whose row became invalid), then its verify rounds,
  drafts proposed and drafts accepted; ctl with the budgets and keys after
  the rounds, batch_key).
  """
  (pool, slots, ctl), (out, batch_key) = R.on_rows(
      lambda pool, slots, ctl: _dispatch(
          graphdef, params, pool, slots, proposer, n, window, sampled,
          top_k, top_p, implementation, ctl, batch_key),
      (pool, slots, ctl), rows)
  return pool, slots, out, ctl, batch_key


def _dispatch(graphdef, params, pool, slots, proposer, n, window, sampled,
              top_k, top_p, implementation, ctl, batch_key):
  """`dispatch` of every row -> ((pool, slots, ctl), (out, batch_key))."""
  model = P.merge(graphdef, params)
  eos, temps = ctl.eos, ctl.temps
  cap, width = slots.history.shape
  t, t1 = window, window - 1
  ncols = n * t
  rows = jnp.arange(cap)
  j = jnp.arange(t)[None, :]
  vocab = model.config.vocab_size

  def body(i, carry):
    pool, slots, out, cursor, stats, left, keys, batch_key = carry
    active = pool.active & (left > 0)
    split = jax.vmap(lambda k: jax.random.split(k, 3))(keys)
    keys, k_prop, k_acc = split[:, 0], split[:, 1], split[:, 2]
    batch_key, k_batch = jax.random.split(batch_key)
    last = jnp.where(active, pool.tokens, 0)
    ctx = ProposalContext(history=slots.history, length=slots.length,
                          last=last, num_generated=slots.generated,
                          active=active, iteration=i)
    prop, pstate = _propose(proposer, slots.pstate, ctx, t, k_prop,
                            k_batch, sampled, temps, top_k, top_p)
    nd = jnp.clip(jnp.asarray(prop.num_drafts, jnp.int32), 0, t1)
    nd = jnp.where(active, nd, 0)
    drafts = jnp.where(jnp.arange(t1)[None, :] < nd[:, None],
                       jnp.asarray(prop.drafts, jnp.int32), 0)
    drafts = jnp.clip(drafts, 0, vocab - 1)
    win = jnp.concatenate([last[:, None], drafts], axis=1)  # [cap, T]
    logits, pending = verify_fn(model, win, pool.state, implementation)
    a, nxt = _accept(logits, drafts, nd, prop.q, k_acc, sampled, temps,
                     top_k, top_p)
    a = jnp.asarray(a, jnp.int32)
    # Emitted: the a accepted drafts, then the target's token; cut at the
    # budget and just after the first eos.
    emitted = jnp.where(j < a[:, None], jnp.roll(win, -1, axis=1),
                        jnp.asarray(nxt, jnp.int32)[:, None])
    count = jnp.minimum(a + 1, left)
    is_eos = C.is_eos(emitted, eos) & (j < count[:, None])
    hit = jnp.any(is_eos, axis=1)
    count = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, count)
    # Window tokens that become history: the first count (last + the
    # emitted ones but the final one, which is the next input).
    n_commit = jnp.where(active, jnp.minimum(a + 1, count), 1)
    committed = commit_fn(pending, n_commit, active)
    invalid = active & (committed.positions < 0)
    ok = active & ~invalid
    count = jnp.where(ok, count, 0)
    pstate = proposer.update(pstate, ctx, win, n_commit, active)
    nxt_in = emitted[rows, jnp.maximum(count - 1, 0)]
    tokens = jnp.where(ok, nxt_in, jnp.where(invalid, -1, pool.tokens))
    pool = pool.replace(state=committed, tokens=tokens)
    # Tokens to the output (packed per slot) and to the history.
    opos = jnp.where(j < count[:, None], cursor[:, None] + j, ncols)
    out = out.at[rows[:, None], opos].set(emitted, mode="drop")
    out = out.at[rows, jnp.where(invalid, cursor, ncols)].set(-1,
                                                              mode="drop")
    hpos = jnp.where(j < count[:, None], slots.length[:, None] + j, width)
    slots = SpecSlots(
        history=slots.history.at[rows[:, None], hpos].set(emitted,
                                                          mode="drop"),
        length=slots.length + count, generated=slots.generated + count,
        pstate=pstate)
    left = jnp.where(active, jnp.where(hit | invalid, 0, left - count),
                     left)
    stats = stats + jnp.stack([ok.astype(jnp.int32), jnp.where(ok, nd, 0),
                               jnp.where(ok, a, 0)], axis=1)
    return (pool, slots, out, cursor + count, stats, left, keys, batch_key)

  zeros = jnp.zeros((cap,), jnp.int32)
  carry = (pool, slots, jnp.full((cap, ncols), -1, jnp.int32), zeros,
           jnp.zeros((cap, STAT_COLUMNS), jnp.int32), ctl.left, ctl.keys,
           batch_key)
  pool, slots, out, _, stats, left, keys, batch_key = jax.lax.fori_loop(
      0, n, body, carry)
  return ((pool, slots, ctl.replace(left=left, keys=keys)),
          (jnp.concatenate([out, stats], axis=1), batch_key))
