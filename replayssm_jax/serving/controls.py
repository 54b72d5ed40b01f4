"""The engine's per-slot controls on the device, and its plain decode call.

`SlotControls` holds what the engine's compiled decode loop reads per slot
besides the pool: the tokens each slot may still emit (`left`), its eos ids,
its temperature and its PRNG key stream. They live on the device and are
carried from one dispatch to the next, so that a dispatch can be launched
before the host has read the previous one's tokens (`Engine(overlap=True)`):
the budgets the device spent are already in `left`, and an admission
writes its slots' rows with one compiled op (`admit`) whose budget
accounts for the request's first token without the host reading it.

  ctl = init_controls(capacity)
  stream, first = request_keys(seeds)      # [k] key streams, first keys
  ctl = admit(ctl, idx, stream, budgets, eos_ids, temps, first_tokens)
  pool, out, ctl = decode(graphdef, params, pool, ctl, n, ...)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import slots
from replayssm_jax.models.generate import is_eos as eos_hit
from replayssm_jax.models.generate import seed0_key
from replayssm_jax.serving import pool as P
from replayssm_jax.serving import rows as R


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotControls:
  """Per-slot decode controls (every leaf [capacity, ...], batch-leading,
  so that `rows.gather_rows` / `scatter_rows` take them with the pool).

  left [cap] int32: tokens the slot may still emit (0: it emits nothing).
  eos [cap, E] int32: its eos ids (-1: an unused column).
  temps [cap] f32: its temperature (0: greedy).
  keys [cap, ...] uint32: its raw PRNG key (split once per decode step).
  """
  left: jax.Array
  eos: jax.Array
  temps: jax.Array
  keys: jax.Array

  def replace(self, **kwargs) -> "SlotControls":
    return dataclasses.replace(self, **kwargs)


def init_controls(capacity: int, max_eos_ids: int = 1) -> SlotControls:
  """Controls of `capacity` idle slots (no budget, greedy, zero keys), up
  to `max_eos_ids` eos ids per slot."""
  key_shape = seed0_key().shape
  # Separate buffers: `admit` and the decode calls donate every leaf.
  return SlotControls(left=jnp.zeros((capacity,), jnp.int32),
                      eos=jnp.full((capacity, max_eos_ids), -1, jnp.int32),
                      temps=jnp.zeros((capacity,), jnp.float32),
                      keys=jnp.zeros((capacity,) + key_shape, jnp.uint32))


def seed_words(seeds) -> np.ndarray:
  """Request seeds (Python ints) as the uint32 words `request_keys` takes:
  each seed modulo 2**32, which is what `jax.random.PRNGKey(seed)` keeps
  of a Python int seed (64-bit mode off)."""
  return np.array([int(s) & 0xFFFFFFFF for s in seeds], np.uint32)


@jax.jit
def request_keys(seeds):
  """seeds [k] uint32 (`seed_words`) -> (key streams [k, ...], first-token
  keys [k, ...]): `jax.random.split(jax.random.PRNGKey(seed))` of each
  seed, in one compiled op rather than a few eager ops per request."""
  split = jax.vmap(lambda s: jax.random.split(jax.random.PRNGKey(s)))(seeds)
  return split[:, 0], split[:, 1]


def is_eos(tokens, eos):
  """tokens [k] (or [k, T]) against each row's eos ids eos [k, E] (-1:
  unused) -> bool [k] (or [k, T])."""
  return jax.vmap(eos_hit)(tokens, eos)


@functools.partial(jax.jit, donate_argnums=(0,))
def admit(ctl: SlotControls, idx, keys, budgets, eos_ids, temps,
          first) -> SlotControls:
  """Writes the controls of k admitted requests (rows idx [k]; an index of
  `capacity` or more writes nothing): their key streams keys [k, ...],
  eos ids [k, E] (-1: unused) and temperatures [k], and their budgets [k]
  (max_new_tokens) less the first token first [k] (the prefill's, still on
  the device): 0 when that token is one of the request's eos ids or -1 (an
  invalid row), the budget - 1 otherwise."""
  stop = (first < 0) | is_eos(first, eos_ids)
  left = jnp.where(stop, 0, budgets - 1)
  put = lambda x, v: x.at[idx].set(v.astype(x.dtype), mode="drop")
  return SlotControls(left=put(ctl.left, left), eos=put(ctl.eos, eos_ids),
                      temps=put(ctl.temps, temps), keys=put(ctl.keys, keys))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8, 10),
                   donate_argnums=(2, 3))
def decode(graphdef, params, pool, ctl: SlotControls, n, sampled, top_k,
           top_p, implementation, rows=None, in_place=False):
  """n decode steps of every slot, or of the slots `rows` [k] int32, with
  on-device stopping.

  The slots `rows` (capacity or beyond for a padding row) are decoded as
  a batch of k: gathered from the pool, decoded and scattered back within
  the call, or with `in_place` (static) stepped in the pool through a slot
  per row (`rows.step_rows`: the Mamba-2 and attention kernels read and
  write the pool's rows themselves; only the controls are gathered).

  A slot decodes while it is active in the pool and has budget left; each
  step splits every slot's key, samples its token (sampled (static): some
  slot samples, else the loop is argmax only, with no conditional: an XLA
  GPU conditional reads its predicate on the host) and spends one token of
  its budget, all of it at one of its eos ids or an invalid row.
  Returns (pool, tokens [cap or k, n] int32 (-1 where a slot emitted
  nothing), ctl with the budgets and keys after the n steps).
  """
  args = (graphdef, params, n, sampled, top_k, top_p, implementation)
  if rows is not None and in_place:
    live = slots.effective(rows, pool.capacity)
    ctl_rows, out = _decode(*args, pool, slots.gather(ctl, live), live)
    pool, ctl_rows = ctl_rows
    return pool, out, slots.scatter(ctl, ctl_rows, live)
  (pool, ctl), out = R.on_rows(lambda pool, ctl: _decode(
      *args, pool, ctl), (pool, ctl), rows)
  return pool, out, ctl


def _decode(graphdef, params, n, sampled, top_k, top_p, implementation,
            pool, ctl, rows=None):
  """`decode` of every row of `pool` and `ctl`, or of the pool's slots
  `rows` (effective) with `ctl` their rows -> ((pool, ctl), out)."""
  model = P.merge(graphdef, params)
  k = pool.capacity if rows is None else rows.shape[0]
  eos, temps = ctl.eos, ctl.temps

  def body(i, carry):
    pool, out, left, keys = carry
    on = (pool.active if rows is None
          else slots.gather(pool.active, rows) & (rows >= 0))
    active = on & (left > 0)
    split = jax.vmap(jax.random.split)(keys)  # [k, 2, key]
    keys, sub = split[:, 0], split[:, 1]

    def sample(logits):
      return P.sample_rows(logits, sub, temps, sampled, top_k, top_p)

    pool, emitted, _ = R.step_rows(model, pool, active, sample,
                                   implementation, rows)
    stop = (emitted < 0) | is_eos(emitted, eos)
    left = jnp.where(active, jnp.where(stop, 0, left - 1), left)
    return pool, out.at[:, i].set(emitted), left, keys

  out = jnp.full((k, n), -1, jnp.int32)
  pool, out, left, keys = jax.lax.fori_loop(
      0, n, body, (pool, out, ctl.left, ctl.keys))
  return (pool, ctl.replace(left=left, keys=keys)), out
