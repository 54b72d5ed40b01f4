"""Argument checks shared by the reference ops and the kernels.

All checks here are *static*: they look at shapes and dtypes only, so they run
once at trace time and cost nothing inside a jitted step. Every error names the
argument and says what was expected.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
STATE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dtype(arr: Any):
  return jnp.result_type(arr) if not hasattr(arr, "dtype") else arr.dtype


def check_array(name: str, arr: Any) -> None:
  if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
    raise TypeError(
        f"{name} must be an array (jax.Array or numpy.ndarray), got "
        f"{type(arr).__name__}.")


def check_floating(name: str, arr: Any, allowed: Sequence[Any] = FLOAT_DTYPES):
  check_array(name, arr)
  dt = jnp.dtype(arr.dtype)
  if dt not in [jnp.dtype(a) for a in allowed]:
    names = ", ".join(jnp.dtype(a).name for a in allowed)
    raise TypeError(f"{name} must have a floating dtype in ({names}), got "
                    f"{dt.name}.")


def check_dtype_arg(name: str, dtype: Any,
                    allowed: Sequence[Any] = STATE_DTYPES) -> None:
  """A dtype argument (not an array) must be one of `allowed`."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or dt not in [jnp.dtype(a) for a in allowed]:
    names = ", ".join(jnp.dtype(a).name for a in allowed)
    got = dt.name if dt is not None else repr(dtype)
    raise TypeError(f"{name} must be one of ({names}), got {got}.")


def check_integer(name: str, arr: Any) -> None:
  check_array(name, arr)
  if not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype (int32), got "
                    f"{jnp.dtype(arr.dtype).name}.")


def check_shape(name: str, arr: Any, expected: Sequence[int],
                layout: str) -> None:
  """Raises ValueError unless arr.shape == expected.

  Args:
    name: argument name used in the message.
    arr: the array.
    expected: the expected shape.
    layout: the axis names, e.g. "[batch, nheads, headdim]".
  """
  check_array(name, arr)
  if tuple(arr.shape) != tuple(expected):
    raise ValueError(f"{name} must have shape {layout} = {tuple(expected)}, "
                     f"got {tuple(arr.shape)}.")


def check_ndim(name: str, arr: Any, ndim: int, layout: str) -> None:
  check_array(name, arr)
  if arr.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D {layout}, got shape "
                     f"{tuple(arr.shape)}.")


def check_groups(nheads: int, ngroups: int, where: str = "B") -> None:
  if ngroups < 1 or nheads % ngroups != 0:
    raise ValueError(
        f"nheads ({nheads}) must be divisible by ngroups ({ngroups}, read "
        f"from {where}); each group of B/C serves nheads // ngroups heads.")


def is_concrete(arr: Any) -> bool:
  """True when the values of arr can be read on the host (not traced)."""
  return not isinstance(arr, jax.core.Tracer)


def check_count_range(count: Any, buffer_len: int, name: str = "count",
                      rows=None):
  """Value check of per-row counters; only possible outside of jit. rows:
  the state rows a step through slots reads (`replayssm_jax.slots`): only
  theirs are checked (a free slot may hold anything)."""
  if not is_concrete(count):
    return
  c = np.asarray(count)
  if rows is not None:
    if not is_concrete(rows):
      return
    r = np.asarray(rows)
    c = np.where(np.isin(np.arange(c.shape[0]), r), c, 0)
  bad = (c < 0) | (c >= buffer_len)
  if bad.any():
    rows = np.nonzero(bad)[0][:8].tolist()
    raise ValueError(
        f"{name} must lie in [0, buffer_len) = [0, {buffer_len}) for every "
        f"row; rows {rows} hold {c[rows].tolist()}.")


def check_params(nheads: int, *, A, D=None, dt_bias=None) -> None:
  """Per-head parameters: A, D, dt_bias are [nheads]."""
  check_floating("A", A)
  check_shape("A", A, (nheads,), "[nheads]")
  if D is not None:
    check_floating("D", D)
    check_shape("D", D, (nheads,), "[nheads]")
  if dt_bias is not None:
    check_floating("dt_bias", dt_bias)
    check_shape("dt_bias", dt_bias, (nheads,), "[nheads]")


def check_step_inputs(batch: int, nheads: int, headdim: int, dstate: int, *,
                      x, dt, A, B, C, D=None, z=None, dt_bias=None,
                      ngroups: int | None = None) -> int:
  """Validates one decode token's inputs; returns ngroups."""
  check_floating("x", x)
  check_shape("x", x, (batch, nheads, headdim), "[batch, nheads, headdim]")
  check_floating("dt", dt)
  check_shape("dt", dt, (batch, nheads), "[batch, nheads]")
  check_floating("B", B)
  check_ndim("B", B, 3, "[batch, ngroups, dstate]")
  g = B.shape[1] if ngroups is None else ngroups
  check_shape("B", B, (batch, g, dstate), "[batch, ngroups, dstate]")
  check_groups(nheads, g)
  check_floating("C", C)
  check_shape("C", C, (batch, g, dstate), "[batch, ngroups, dstate]")
  if z is not None:
    check_floating("z", z)
    check_shape("z", z, (batch, nheads, headdim), "[batch, nheads, headdim]")
  check_params(nheads, A=A, D=D, dt_bias=dt_bias)
  return g


def check_num_accepted(num_accepted: Any, batch: int, window: int) -> None:
  """[batch] integers in [1, window] (checked per row when concrete)."""
  check_integer("num_accepted", num_accepted)
  check_shape("num_accepted", num_accepted, (batch,), "[batch]")
  if is_concrete(num_accepted):
    n = np.asarray(num_accepted)
    bad = (n < 1) | (n > window)
    if bad.any():
      rows = np.nonzero(bad)[0][:8].tolist()
      raise ValueError(f"num_accepted must lie in [1, T] = [1, {window}] "
                       f"for every row; rows {rows} hold "
                       f"{n[rows].tolist()}.")


def check_column_offset(name: str, offset, dim: int, width: int,
                        what: str) -> None:
  """An int offset with 0 <= offset and offset + dim <= width: `what` (dim
  columns) lies inside an array of `width` columns."""
  if (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0
      or offset + dim > width):
    raise ValueError(f"{name} must be an int with 0 <= {name} and {name} + "
                     f"{dim} <= {width} ({what}: {dim} columns inside an "
                     f"array of width {width}), got {offset!r}.")


def int_at_least(name: str, v: Any, minimum: int = 1) -> int:
  """`v` (a Python or numpy int, not a bool) >= minimum as a Python int;
  ValueError naming the argument otherwise."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}.")
  return int(v)


def positive_int(name: str, value: Any) -> int:
  """`value` (any integral scalar but bool, e.g. a numpy integer) as a
  Python int >= 1; ValueError naming the argument otherwise."""
  if not isinstance(value, (bool, np.bool_)):
    try:
      v = operator.index(value)
    except TypeError:
      v = None
    if v is not None and v >= 1:
      return v
  raise ValueError(f"{name} must be a positive int, got {value!r}.")


# ------------------------------------------------------ traced-value policy
# A value the host cannot read under jit (a counter, a length, a token id,
# an accepted count) that is out of range makes the affected row invalid:
# its float outputs are NaN and a marker in the returned state keeps it so
# (a replay counter outside [0, L), a model row's position -1), never a
# plausible wrong answer; the other rows are unaffected. `debug_checks()`
# makes the public entry points raise instead.
_debug = [False]


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
  """Within the context, the public ops and the model's entry points raise
  a ValueError naming the rows whose traced inputs were out of range,
  rather than returning them NaN: at once on concrete values, through a
  `jax.debug.callback` (a host sync per call) when traced. Functions the
  caller jits must be traced inside the context."""
  old, _debug[0] = _debug[0], bool(enabled)
  try:
    yield
  finally:
    _debug[0] = old


def _raise_invalid(bad, what):
  rows = np.nonzero(np.asarray(bad))[0]
  if rows.size:
    raise ValueError(f"{what}: rows {rows[:8].tolist()} got an out-of-range "
                     f"value that could not be checked under jit; their "
                     f"outputs are NaN.")


def raise_if_invalid(bad, what: str) -> None:
  """With `debug_checks` on: raises if any row of `bad` ([batch] bool) is
  set (a debug callback when traced); a no-op otherwise."""
  if not _debug[0]:
    return
  if is_concrete(bad):
    _raise_invalid(bad, what)
  else:
    jax.debug.callback(functools.partial(_raise_invalid, what=what), bad)
