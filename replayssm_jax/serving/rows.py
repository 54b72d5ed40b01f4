"""Rows of a slot pool: placing admitted rows, stepping rows, compaction.

`place_rows` writes a batch of prefilled rows into their slots (the
batched admissions of `pool.insert_many` and
`prefix_cache.insert_cached_many`). `step_rows` is one decode step of the
pool's rows, all of them or the slots `rows` in place. Compaction: a
dispatch that decodes few running slots either steps them in place
(`steps_in_place` models) or gathers their rows of every batch-leading leaf
(the pool, its controls, the speculative slots) into a smaller batch,
decodes it and scatters the rows back (`serving.Engine`'s
`compact_below`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import slots
from replayssm_jax.models import states as S


def check_dtype(pool_leaf, row_leaf):
  """A prefilled row's leaf must have its pool leaf's dtype (a scatter
  would cast it silently)."""
  if pool_leaf.dtype != row_leaf.dtype:
    raise AssertionError(f"prefill returned a {row_leaf.dtype} leaf for "
                         f"the pool's {pool_leaf.dtype}.")


def place_rows(pool, idx, rows, tok):
  """(Traceable.) A Pool with the batch-kp ModelState `rows` written into
  slots idx [kp] (out of range, e.g. capacity for a padding row: nothing
  written), those slots active with next inputs `tok` [kp] (-1 for an
  invalid row) -> (pool, tok)."""
  tok = jnp.where(rows.positions < 0, -1, tok)

  def write(p, r):
    check_dtype(p, r)
    return p.at[idx].set(r, mode="drop")

  state = jax.tree.map(write, pool.state, rows)
  return pool.replace(state=state,
                      active=pool.active.at[idx].set(True, mode="drop"),
                      tokens=pool.tokens.at[idx].set(tok, mode="drop")), tok


# Rows `idx` [k] of every (batch-leading) leaf of `tree` (a Pool, a
# ModelState or a tuple of such): `slots.gather`, jitted.
gather_rows = jax.jit(slots.gather)
# `tree` (donated) with the rows `idx` [k] of every leaf replaced by
# `rows`' (as `gather_rows` took them): `slots.scatter`, jitted.
scatter_rows = jax.jit(slots.scatter, donate_argnums=(0,))


def on_rows(fn, tree, rows):
  """fn(*tree) -> (new tree, out) applied to every row of `tree` (a tuple
  of batch-leading pytrees), or with `rows` [k] int32 to those rows alone:
  gathered into a batch of k, and the new rows scattered back (inside a
  jitted caller: one computation, the scatter in place where `tree` is
  donated). Returns (tree, out); out has the batch fn gave it."""
  if rows is None:
    return fn(*tree)
  new, out = fn(*gather_rows(tree, rows))
  return scatter_rows(tree, new, rows), out


def steps_in_place(model, state) -> bool:
  """Whether every block of `model` steps its layer of a ModelState
  through a slot per row by itself (`Block.rows_in_place`: Mamba-2 and
  Gated DeltaNet states, plain or replay, KV caches; a recurrent baseline
  stored per a precision policy is not); other layers' rows would be
  gathered and scattered back at every step."""
  return all(
      block.rows_in_place and not isinstance(getattr(s, "ssm", None),
                                             S.StoredSSMState)
      for block, s in zip(model.blocks, state.layers))


def step_rows(model, pool, active, sample, implementation, rows=None):
  """One decode step of every slot, kept for the `active` [capacity] rows
  -> (pool, tokens [capacity] int32, logits [capacity, vocab] f32).

  sample(logits) -> [capacity] int32 picks each row's next token (-1 for
  an invalid row); rows not active keep their next input and report -1,
  and their state is left unspecified (see the module docstring).

  rows: [k] int32 effective slots (`replayssm_jax.slots`; -1 pads): the
  step runs those slots alone, read and written in place in the pool
  (`HybridLM.step(rows=)`); `active`, `sample`'s logits and the results
  are then [k], and the padding rows are inactive."""
  if rows is not None:
    active = active & (rows >= 0)
    feed = jnp.where(active, slots.gather(pool.tokens, rows), 0)
    logits, new = model.step(feed, pool.state, implementation, rows)
    bad = slots.gather(new.positions, rows) < 0
    tok = jnp.where(bad, -1, sample(logits))
    put = jnp.where(active, rows, -1)  # inactive rows keep their input
    tokens = slots.scatter(pool.tokens, tok, put)
    return (pool.replace(state=new, tokens=tokens),
            jnp.where(active, tok, -1), logits)
  feed = jnp.where(active, pool.tokens, 0)
  logits, new = model.step(feed, pool.state, implementation)
  tok = jnp.where(new.positions < 0, -1, sample(logits))
  tokens = jnp.where(active, tok, pool.tokens)
  out = jnp.where(active, tok, -1)
  return pool.replace(state=new, tokens=tokens), out, logits
