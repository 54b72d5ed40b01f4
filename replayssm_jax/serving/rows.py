"""Compaction: a step over some rows of a slot pool, as a batch of its own.

A dispatch that decodes few running slots gathers their rows of every
batch-leading leaf (the pool, its controls, the speculative slots) into a
smaller batch, decodes it and scatters the rows back (`serving.Engine`'s
`compact_below`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.jit
def gather_rows(tree, idx):
  """Rows `idx` [k] of every (batch-leading) leaf of `tree`: a Pool, a
  ModelState or a tuple of such."""
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_rows(tree, rows, idx):
  """`tree` (donated) with the rows `idx` [k] of every leaf replaced by
  `rows`' (as `gather_rows` took them)."""
  return jax.tree.map(lambda x, r: x.at[idx].set(r), tree, rows)


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
