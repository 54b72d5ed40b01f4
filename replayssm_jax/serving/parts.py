"""A served model's nnx.split, its graph hashed once.

The serving functions are jitted with the model's `GraphDef` as a static
argument, and jax hashes static arguments on every call: an nnx GraphDef
hashes its whole node list each time, host time on every admission and
dispatch that grows with the model's blocks (benchmarks/README.md,
"Serving"). `model_parts` wraps it in a `StaticGraph` whose hash is computed
once; the jitted functions unwrap it with `merge`.

A jit cache compares a static argument of an equal hash with the one it
was compiled for: for two distinct StaticGraphs that is a comparison of
the whole GraphDefs, milliseconds on every call. `model_parts` therefore
returns one StaticGraph per distinct GraphDef (interned), so that a second
engine of the same model, or a model split again, reuses the compiled
functions through the identity check alone.
"""

from __future__ import annotations

import weakref

from flax import nnx


class StaticGraph:
  """An nnx GraphDef as a jit static argument: hashed once, equal to
  another StaticGraph of an equal GraphDef (so a model split again, or
  another engine of the same model, reuses the compiled functions)."""

  __slots__ = ("graphdef", "_hash", "__weakref__")

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, StaticGraph)
                             and self._hash == other._hash
                             and self.graphdef == other.graphdef)


# hash -> the StaticGraph of that hash handed out last (alive while used).
_INTERNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def static_graph(graphdef) -> StaticGraph:
  """The StaticGraph of `graphdef`: the one handed out before for an equal
  GraphDef while it is alive (one comparison here instead of one per
  jitted call), else a new one."""
  if isinstance(graphdef, StaticGraph):
    return graphdef
  new = StaticGraph(graphdef)
  old = _INTERNED.get(new._hash)  # pylint: disable=protected-access
  if old is not None and old.graphdef == graphdef:
    return old
  _INTERNED[new._hash] = new  # pylint: disable=protected-access
  return new


def model_parts(model, parts=None):
  """(StaticGraph, params) of `model`: `parts` when given (its
  `nnx.split`, or an earlier `model_parts`, kept by a caller that serves
  the model unchanged, as `Engine` does), else `nnx.split(model)`, which
  traverses the module graph on the host on every call (milliseconds for
  a model of tens of blocks)."""
  graphdef, params = nnx.split(model) if parts is None else parts
  return static_graph(graphdef), params


def merge(graphdef, params):
  """The model of `model_parts`' (graphdef, params), inside a jitted
  function (a plain GraphDef is taken too)."""
  if isinstance(graphdef, StaticGraph):
    graphdef = graphdef.graphdef
  return nnx.merge(graphdef, params)
