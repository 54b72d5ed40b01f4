"""Ops on a slot pool's state through a slot index per row.

A decode op given `rows` [k] int32 steps k token rows against a state of
`capacity` rows (a serving pool, `replayssm_jax.serving`): token row i reads
and writes state row rows[i]; every other state row is left as it is. A
kernel that takes the slots itself (`registry.Implementation.rows`) reads
and writes the pool in place, with no gathered copy of the active rows;
for any other implementation the op gathers the k rows, runs on them and
scatters them back (`on_rows`), with the same results.

Rows policy (`effective`): a slot outside [0, capacity) marks a padding row
(a batch rounded up to a bucket): it reads and writes no state row and its
outputs are NaN. A slot repeated in `rows` is refused when `rows` is
concrete; under jit every repeat after the first is a padding row (NaN
outputs, nothing written), so two token rows never write one state row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V


def check_rows(rows, batch: int, capacity: int, name: str = "rows") -> None:
  """`rows`: [batch] integers (slots of a state of `capacity` rows); a
  concrete `rows` must not repeat a slot in [0, capacity)."""
  V.check_integer(name, rows)
  V.check_shape(name, rows, (batch,), "[batch]")
  if V.is_concrete(rows):
    r = np.asarray(rows)
    live = r[(r >= 0) & (r < capacity)]
    uniq, counts = np.unique(live, return_counts=True)
    if (counts > 1).any():
      raise ValueError(f"{name} must name each state row at most once; "
                       f"slots {uniq[counts > 1][:8].tolist()} repeat.")


def token_rows(capacity: int, x, rows):
  """(token rows, effective rows or None) of a step whose state has
  `capacity` rows and whose token input is x [k, ...]: `rows` checked
  (`check_rows`) and made `effective`, or (capacity, None) without rows
  (x then unread: the op validates it)."""
  if rows is None:
    return capacity, None
  k = x.shape[0]
  check_rows(rows, k, capacity)
  return k, effective(rows, capacity)


def effective(rows, capacity: int):
  """(Traceable.) [k] int32: rows[i], or -1 for a padding row (a slot
  outside [0, capacity), or a repeat of an earlier row's slot)."""
  r = jnp.asarray(rows).astype(jnp.int32)
  live = (r >= 0) & (r < capacity)
  k = r.shape[0]
  earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]
  repeat = jnp.any((r[:, None] == r[None, :]) & earlier & live[None, :],
                   axis=1)
  return jnp.where(live & ~repeat, r, -1)


def gather(tree, rows):
  """Rows `rows` (effective: -1 reads row 0) of every batch-leading leaf."""
  idx = jnp.maximum(rows, 0)
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


def scatter(tree, new, rows):
  """`tree` with its rows `rows` (effective: -1 writes nothing) replaced by
  `new`'s rows, leaf by leaf."""
  def put(x, n):
    cap = x.shape[0]
    return x.at[jnp.where(rows < 0, cap, rows)].set(n.astype(x.dtype),
                                                    mode="drop")
  return jax.tree.map(put, tree, new)


def nan_pad(out, rows):
  """`out` [k, ...] (floating) with the padding rows (rows == -1) NaN."""
  pad = (rows < 0).reshape((-1,) + (1,) * (out.ndim - 1))
  return jnp.where(pad, jnp.nan, out).astype(out.dtype)


def on_rows(fn, state, rows, *, returns_state: bool = True):
  """fn(state rows) run on the gathered rows `rows` (effective) of `state`.

  returns_state: fn returns (out, new state rows), and this returns (out
  with padding rows NaN, `state` with the new rows scattered in); else fn
  returns out alone (an op that only reads the state)."""
  res = fn(gather(state, rows))
  if not returns_state:
    return jax.tree.map(lambda o: nan_pad(o, rows), res)
  out, new = res
  return nan_pad(out, rows), scatter(state, new, rows)
