"""HBM-traffic model of one Mamba-2 decode step: baseline vs ReplaySSM.

Counts the bytes that one call of the decode-step kernel moves through device
memory (HBM) for a batch of rows, assuming each input is read once and each
output written once (an ideal kernel; research notes §1.3 and §2.6).

Notation (per layer; H = nheads, P = headdim, N = dstate, G = ngroups,
L = buffer_len):
  S = H*P*N*s      one row's full state (s = itemsize of the state dtype);
  a                itemsize of the activations (x, z, y, dt, B, C);
  r = H*P*b + G*N*b + 4H
                   one buffered token (x and B in the buffer dtype, itemsize b,
                   B once per group; the processed dt' always float32).

Baseline step, per row:  S (state read) + S (state write) + token I/O, where
token I/O = x read H*P*a (+ z read H*P*a) + y write H*P*a + B, C reads
2*G*N*a + dt read H*a. Per call (shared by all rows): A, D, dt_bias reads of
4H bytes each.

ReplaySSM step, per row with fill f (the row's count before the step, in
[0, L)):
  non-flush (f < L-1):  S (checkpoint read) + f*r (history read) + token I/O
                        + r (append) + 8 (count read + write);
  flush     (f == L-1): 2S (checkpoint read + write) + (L-1)*r (history read)
                        + token I/O + 8 (no append: the buffer empties).
Amortized over one L-step cycle (every fill once, one flush):
  S*(1 + 1/L) + r*(L-1)*(L+2)/(2L) + token I/O + 8,
minimized near L* ~= sqrt(2S/r) (research notes §2.6).

Dual precision (`read_dtype`, a `precision.PrecisionPolicy` read copy):
  R = H*P*N*q (+ 4*H*P)  one row's read copy (q = itemsize of the read dtype;
                         8-bit copies add one f32 scale per (head, P-row));
  non-flush: R (copy + scales read, never the checkpoint) + f*r + token I/O
             + r + 8;
  flush:     2S (master read + write) + R (copy + scales write) + (L-1)*r
             + token I/O + 8.
Stochastic rounding adds only per-row counters and keys (a few bytes per
row, ignored here).

The model deliberately ignores caches: B history is counted once per group
(the per-group bc pre-computation of §2.4), and the flush route's per-head
re-reads of B are assumed to hit L2.

This module is pure Python (no ml_collections, no device work).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import jax.numpy as jnp

_F32_BYTES = 4  # dt' in the buffer and the A/D/dt_bias parameters
_COUNT_BYTES = 4  # int32 per-row counter


# ---------------------------------------------------------------- arguments
_READ_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "int8")
_SCALED_READ_DTYPES = ("float8_e4m3fn", "int8")  # + f32 per (head, P-row)


def _check_pos_int(name: str, value: Any, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {type(value).__name__} "
                    f"{value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


def itemsize(dtype: Any, name: str = "dtype") -> int:
  """Bytes per element of a floating dtype (TypeError names `name`)."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{name} must be a floating dtype, got {dtype!r}.") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{name} must be a floating dtype, got {dt.name}.")
  return dt.itemsize


@dataclasses.dataclass(frozen=True)
class LayerDims:
  """Shape of one Mamba-2 layer's SSM (per tensor-parallel shard)."""

  nheads: int  # H
  headdim: int  # P
  dstate: int  # N
  ngroups: int  # G; H % G == 0

  def __post_init__(self):
    for name in ("nheads", "headdim", "dstate", "ngroups"):
      _check_pos_int(name, getattr(self, name))
    if self.nheads % self.ngroups != 0:
      raise ValueError(f"nheads ({self.nheads}) must be divisible by ngroups "
                       f"({self.ngroups}).")

  @classmethod
  def nemotron_h_8b(cls) -> "LayerDims":
    """Nemotron-H 8B (and Nemotron-3-Super) Mamba layer at TP=1."""
    return cls(nheads=128, headdim=64, dstate=128, ngroups=8)

  @property
  def state_elems(self) -> int:
    return self.nheads * self.headdim * self.dstate


# --------------------------------------------------------------- components
def state_bytes(dims: LayerDims, dtype) -> int:
  """S: one row's full state (or checkpoint) in `dtype`."""
  return dims.state_elems * itemsize(dtype, "state dtype")


def buffered_token_bytes(dims: LayerDims, buffer_dtype=jnp.bfloat16) -> int:
  """r: one buffered token (x, B once per group, f32 dt')."""
  b = itemsize(buffer_dtype, "buffer_dtype")
  return (dims.nheads * dims.headdim * b + dims.ngroups * dims.dstate * b
          + _F32_BYTES * dims.nheads)


def token_io_bytes(dims: LayerDims, act_dtype=jnp.bfloat16, *,
                   has_z: bool = False) -> int:
  """Current-token I/O of one row: x (+z) read, y write, B, C, dt read."""
  a = itemsize(act_dtype, "act_dtype")
  hp = dims.nheads * dims.headdim
  return ((3 if has_z else 2) * hp * a + 2 * dims.ngroups * dims.dstate * a
          + dims.nheads * a)


def param_bytes(dims: LayerDims, *, has_D: bool = True,
                has_dt_bias: bool = True) -> int:
  """Per-call parameter reads: A, D, dt_bias (float32 [nheads] each)."""
  return _F32_BYTES * dims.nheads * (1 + int(has_D) + int(has_dt_bias))


def _read_dtype_name(read_dtype) -> str | None:
  if read_dtype is None:
    return None
  try:
    name = jnp.dtype(read_dtype).name
  except TypeError:
    name = None
  if name not in _READ_DTYPES:
    raise TypeError(f"read_dtype must be None or one of "
                    f"({', '.join(_READ_DTYPES)}), got {read_dtype!r}.")
  return name


def read_copy_bytes(dims: LayerDims, read_dtype) -> int:
  """R: one row's read copy in `read_dtype` (bfloat16, float16,
  float8_e4m3fn, int8), with the f32 scale per (head, headdim-row) of an
  8-bit copy; 0 for read_dtype None."""
  name = _read_dtype_name(read_dtype)
  if name is None:
    return 0
  scales = (_F32_BYTES * dims.nheads * dims.headdim
            if name in _SCALED_READ_DTYPES else 0)
  return dims.state_elems * jnp.dtype(name).itemsize + scales


def replay_state_bytes(dims: LayerDims, buffer_len: int, checkpoint_dtype,
                       buffer_dtype=jnp.bfloat16, *,
                       read_dtype=None) -> int:
  """Memory footprint of one row's ReplayState (checkpoint + read copy if
  any + L slots + counter), for capacity planning; compare `state_bytes`.
  (Stochastic rounding's row_id/step add 8 bytes, not counted.)"""
  _check_pos_int("buffer_len", buffer_len)
  return (state_bytes(dims, checkpoint_dtype)
          + read_copy_bytes(dims, read_dtype)
          + buffer_len * buffered_token_bytes(dims, buffer_dtype)
          + _COUNT_BYTES)


# -------------------------------------------------------------------- steps
def baseline_step_bytes(dims: LayerDims, batch: int, state_dtype,
                        act_dtype=jnp.bfloat16, *, has_z: bool = False,
                        has_D: bool = True, has_dt_bias: bool = True) -> int:
  """Bytes moved by one baseline `selective_state_update` call.

  Args:
    dims: layer shape.
    batch: rows in the call.
    state_dtype: storage dtype of the full state.
    act_dtype: dtype of x, z, y, dt, B, C.
    has_z, has_D, has_dt_bias: whether the optional inputs are present.

  Returns:
    batch * (2S + token I/O) + per-call parameter bytes.
  """
  batch = _check_pos_int("batch", batch)
  row = (2 * state_bytes(dims, state_dtype)
         + token_io_bytes(dims, act_dtype, has_z=has_z))
  return batch * row + param_bytes(dims, has_D=has_D, has_dt_bias=has_dt_bias)


def replay_step_bytes(dims: LayerDims, batch: int, buffer_len: int, fill: int,
                      checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                      act_dtype=jnp.bfloat16, *, has_z: bool = False,
                      has_D: bool = True, has_dt_bias: bool = True,
                      read_dtype=None) -> int:
  """Bytes moved by one `replay_state_update` call with every row at `fill`.

  Args:
    dims: layer shape.
    batch: rows in the call.
    buffer_len: L >= 1.
    fill: each row's count before the step, in [0, L); fill == L-1 flushes.
    checkpoint_dtype: storage dtype of the checkpoint.
    buffer_dtype: storage dtype of the x and B buffers (dt' is float32).
    act_dtype: dtype of x, z, y, dt, B, C.
    has_z, has_D, has_dt_bias: whether the optional inputs are present.
    read_dtype: None, or the dtype of a read copy (dual precision):
      non-flush steps read the copy (+ scales) instead of the checkpoint,
      flush steps also write it.

  Returns:
    batch * per-row bytes (see module docstring) + per-call parameter bytes.
  """
  batch = _check_pos_int("batch", batch)
  L = _check_pos_int("buffer_len", buffer_len)
  fill = _check_pos_int("fill", fill, minimum=0)
  if fill >= L:
    raise ValueError(f"fill must be in [0, buffer_len) = [0, {L}), got "
                     f"{fill}.")
  S = state_bytes(dims, checkpoint_dtype)
  R = read_copy_bytes(dims, read_dtype)
  r = buffered_token_bytes(dims, buffer_dtype)
  io = token_io_bytes(dims, act_dtype, has_z=has_z)
  count = 2 * _COUNT_BYTES
  if fill == L - 1:  # flush: rebuild over all L tokens, write the checkpoint
    row = 2 * S + R + (L - 1) * r + io + count  # (+ the copy write)
  else:  # output-only: read checkpoint (or copy) + history, append the token
    row = (R if R else S) + fill * r + io + r + count
  return batch * row + param_bytes(dims, has_D=has_D, has_dt_bias=has_dt_bias)


def replay_amortized_bytes(dims: LayerDims, batch: int, buffer_len: int,
                           checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                           act_dtype=jnp.bfloat16, *, has_z: bool = False,
                           has_D: bool = True, has_dt_bias: bool = True,
                           read_dtype=None) -> float:
  """Mean bytes per replay step over one L-step cycle (one flush per L)."""
  steps = _cycle_bytes(dims, batch, buffer_len, checkpoint_dtype,
                       buffer_dtype, act_dtype, has_z=has_z, has_D=has_D,
                       has_dt_bias=has_dt_bias, read_dtype=read_dtype)
  return sum(steps) / len(steps)


def _cycle_bytes(dims, batch, buffer_len, checkpoint_dtype, buffer_dtype,
                 act_dtype, **kw) -> list[int]:
  """replay_step_bytes for every fill 0..L-1 (the last one flushes)."""
  L = _check_pos_int("buffer_len", buffer_len)
  return [replay_step_bytes(dims, batch, L, f, checkpoint_dtype,
                            buffer_dtype, act_dtype, **kw) for f in range(L)]


@dataclasses.dataclass(frozen=True)
class ReplayTraffic:
  """Bytes per step of one configuration (see `replay_breakdown`).

  Attributes:
    buffer_len: L.
    batch: rows per call.
    baseline: baseline step bytes (state in the checkpoint dtype).
    non_flush_mean: mean over the non-flush fills 0..L-2 (None when L == 1).
    flush: the flush step (fill L-1).
    amortized: mean over the L-step cycle.
    ratio: amortized / baseline.
    speedup: baseline / amortized, the predicted speed-up of a
      bandwidth-bound kernel.
  """
  buffer_len: int
  batch: int
  baseline: int
  non_flush_mean: float | None
  flush: int
  amortized: float
  ratio: float
  speedup: float

  def asdict(self) -> dict:
    return dataclasses.asdict(self)


def replay_breakdown(dims: LayerDims, batch: int, buffer_len: int,
                     checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                     act_dtype=jnp.bfloat16, *, has_z: bool = False,
                     has_D: bool = True, has_dt_bias: bool = True,
                     read_dtype=None) -> ReplayTraffic:
  """Non-flush, flush and amortized replay bytes against the baseline
  (whose full state is stored in the checkpoint dtype)."""
  kw = dict(has_z=has_z, has_D=has_D, has_dt_bias=has_dt_bias)
  base = baseline_step_bytes(dims, batch, checkpoint_dtype, act_dtype, **kw)
  steps = _cycle_bytes(dims, batch, buffer_len, checkpoint_dtype,
                       buffer_dtype, act_dtype, read_dtype=read_dtype, **kw)
  L = len(steps)
  amortized = sum(steps) / L
  return ReplayTraffic(
      buffer_len=L,
      batch=batch,
      baseline=base,
      non_flush_mean=(sum(steps[:-1]) / (L - 1)) if L > 1 else None,
      flush=steps[-1],
      amortized=amortized,
      ratio=amortized / base,
      speedup=base / amortized,
  )


# ----------------------------------------------------------------- optimum
def optimal_buffer_len(dims: LayerDims, checkpoint_dtype,
                       buffer_dtype=jnp.bfloat16, act_dtype=jnp.bfloat16,
                       max_len: int = 64, *, has_z: bool = False,
                       has_D: bool = True, has_dt_bias: bool = True,
                       read_dtype=None) -> int:
  """The L in [1, max_len] with the fewest amortized bytes per step.

  Independent of the batch size (the per-call terms do not depend on L).
  Ties go to the smaller L (less buffer memory).
  """
  max_len = _check_pos_int("max_len", max_len)
  kw = dict(has_z=has_z, has_D=has_D, has_dt_bias=has_dt_bias,
            read_dtype=read_dtype)
  costs = [replay_amortized_bytes(dims, 1, L, checkpoint_dtype, buffer_dtype,
                                  act_dtype, **kw)
           for L in range(1, max_len + 1)]
  return 1 + min(range(max_len), key=lambda i: (costs[i], i))


def approx_optimal_buffer_len(dims: LayerDims, checkpoint_dtype,
                              buffer_dtype=jnp.bfloat16, *,
                              read_dtype=None) -> float:
  """sqrt(2S/r), the continuous optimum of S/L + L*r/2 (research §2.6).

  With a read copy the flush costs 2S (master read + write) over the
  non-flush step's copy read, so the L-dependent term is 2S/L + L*r/2 and
  the optimum sqrt(4S/r).
  """
  S = state_bytes(dims, checkpoint_dtype)
  if _read_dtype_name(read_dtype) is not None:
    S *= 2
  return math.sqrt(2 * S / buffered_token_bytes(dims, buffer_dtype))


# ------------------------------------------------------------------- tables
def traffic_table(dims: LayerDims, batch: int, buffer_lens: Sequence[int],
                  checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                  act_dtype=jnp.bfloat16, *, has_z: bool = False,
                  has_D: bool = True, has_dt_bias: bool = True,
                  read_dtype=None) -> list[dict]:
  """One row per L: baseline vs replay bytes per step and predicted speed-up.

  Returns:
    list of JSON-serializable dicts with keys L, batch, checkpoint_dtype,
    read_dtype (None without a read copy), buffer_dtype, act_dtype,
    baseline_bytes, replay_non_flush_bytes (mean over the non-flush fills,
    None for L=1), replay_flush_bytes, replay_amortized_bytes, ratio,
    predicted_speedup.
  """
  if isinstance(buffer_lens, int) or not len(buffer_lens):
    raise ValueError(f"buffer_lens must be a non-empty sequence of ints, got "
                     f"{buffer_lens!r}.")
  rows = []
  for L in buffer_lens:
    t = replay_breakdown(dims, batch, L, checkpoint_dtype, buffer_dtype,
                         act_dtype, has_z=has_z, has_D=has_D,
                         has_dt_bias=has_dt_bias, read_dtype=read_dtype)
    rows.append(dict(
        L=L,
        batch=batch,
        checkpoint_dtype=jnp.dtype(checkpoint_dtype).name,
        read_dtype=_read_dtype_name(read_dtype),
        buffer_dtype=jnp.dtype(buffer_dtype).name,
        act_dtype=jnp.dtype(act_dtype).name,
        baseline_bytes=t.baseline,
        replay_non_flush_bytes=t.non_flush_mean,
        replay_flush_bytes=t.flush,
        replay_amortized_bytes=t.amortized,
        ratio=t.ratio,
        predicted_speedup=t.speedup,
    ))
  return rows
