"""A served model's nnx.split, its graph hashed once.

The serving functions are jitted with the model's `GraphDef` as a static
argument, and jax hashes static arguments on every call: an nnx GraphDef
hashes its whole node list each time, host time on every admission and
dispatch that grows with the model's blocks (benchmarks/README.md,
"Serving"). `model_parts` wraps it in a `StaticGraph` whose hash is computed
once; the jitted functions unwrap it with `merge`.
"""

from __future__ import annotations

from flax import nnx


class StaticGraph:
  """An nnx GraphDef as a jit static argument: hashed once, equal to
  another StaticGraph of an equal GraphDef (so a model split again, or
  another engine of the same model, reuses the compiled functions)."""

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef):
    self.graphdef = graphdef
    self._hash = hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, StaticGraph)
                             and self._hash == other._hash
                             and self.graphdef == other.graphdef)


def model_parts(model, parts=None):
  """(StaticGraph, params) of `model`: `parts` when given (its
  `nnx.split`, or an earlier `model_parts`, kept by a caller that serves
  the model unchanged, as `Engine` does), else `nnx.split(model)`, which
  traverses the module graph on the host on every call (milliseconds for
  a model of tens of blocks)."""
  graphdef, params = nnx.split(model) if parts is None else parts
  if not isinstance(graphdef, StaticGraph):
    graphdef = StaticGraph(graphdef)
  return graphdef, params


def merge(graphdef, params):
  """The model of `model_parts`' (graphdef, params), inside a jitted
  function (a plain GraphDef is taken too)."""
  if isinstance(graphdef, StaticGraph):
    graphdef = graphdef.graphdef
  return nnx.merge(graphdef, params)
