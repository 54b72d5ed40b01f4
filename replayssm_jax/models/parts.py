"""A model's nnx.split for jitted calls: its graph hashed once and its
parameters flat.

The serving functions are jitted with the model's `GraphDef` as a static
argument (a draft-model proposer, an argument of the speculative calls,
carries its own as pytree metadata), and jax hashes it on every call: an
nnx GraphDef hashes its whole node list each time, host time on every
admission and dispatch that grows with the model's blocks
(benchmarks/README.md, "Serving"). `model_parts` wraps it in a
`StaticGraph` whose hash is computed once; the jitted functions unwrap it
with `merge`.

A jit cache compares a static argument of an equal hash with the one it
was compiled for: for two distinct StaticGraphs that is a comparison of
the whole GraphDefs, milliseconds on every call. `model_parts` therefore
returns one StaticGraph per distinct GraphDef (interned), so that a second
engine of the same model, or a model split again, reuses the compiled
functions through the identity check alone.

The parameters travel as the flat tuple of the nnx State's leaves, the
State's tree structure held by the StaticGraph: jax flattens a tuple of
arrays in C++, where an nnx State's Variables are flattened in Python
(about 1 µs per parameter on every jitted call).
"""

from __future__ import annotations

import weakref

import jax
from flax import nnx


class StaticGraph:
  """An nnx GraphDef (and the tree structure of its parameter State) as a
  jit static argument: hashed once, equal to another StaticGraph of an
  equal GraphDef and structure (so a model split again, or another engine
  of the same model, reuses the compiled functions)."""

  __slots__ = ("graphdef", "treedef", "_hash", "__weakref__")

  def __init__(self, graphdef, treedef=None):
    self.graphdef = graphdef
    self.treedef = treedef
    self._hash = hash((graphdef, treedef))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, StaticGraph)
                             and self._hash == other._hash
                             and self.treedef == other.treedef
                             and self.graphdef == other.graphdef)


# hash -> the StaticGraph of that hash handed out last (alive while used).
_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def static_graph(graphdef, treedef=None) -> StaticGraph:
  """The StaticGraph of `graphdef` and `treedef`: the one handed out
  before for equal ones while it is alive (one comparison here instead of
  one per jitted call), else a new one."""
  new = StaticGraph(graphdef, treedef)
  old = _INTERNED.get(new._hash)  # pylint: disable=protected-access
  if old is not None and old.treedef == treedef and old.graphdef == graphdef:
    return old
  _INTERNED[new._hash] = new  # pylint: disable=protected-access
  return new


def flat_parts(graphdef, state):
  """(StaticGraph, the State's leaves as a tuple) of an nnx.split."""
  leaves, treedef = jax.tree_util.tree_flatten(state)
  return static_graph(graphdef, treedef), tuple(leaves)


def model_parts(model, parts=None):
  """(StaticGraph, params: the State's leaves as a tuple) of `model`:
  `parts` when it is an earlier `model_parts` (kept by a caller that
  serves the model unchanged, as `Engine` does), else from `parts` as an
  `nnx.split(model)`, or from `nnx.split(model)`, which traverses the
  module graph on the host on every call (milliseconds for a model of
  tens of blocks)."""
  if parts is not None and isinstance(parts[0], StaticGraph):
    return parts
  return flat_parts(*(nnx.split(model) if parts is None else parts))


def merge(graphdef, params):
  """The model of `model_parts`' (graphdef, params), inside a jitted
  function (a plain GraphDef with its State is taken too)."""
  if isinstance(graphdef, StaticGraph):
    graphdef, params = graphdef.graphdef, jax.tree_util.tree_unflatten(
        graphdef.treedef, params)
  return nnx.merge(graphdef, params)
