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


def replay_state_bytes(dims: LayerDims, buffer_len: int, checkpoint_dtype,
                       buffer_dtype=jnp.bfloat16) -> int:
  """Memory footprint of one row's ReplayState (checkpoint + L slots +
  counter), for capacity planning; compare `state_bytes`."""
  _check_pos_int("buffer_len", buffer_len)
  return (state_bytes(dims, checkpoint_dtype)
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
                      has_D: bool = True, has_dt_bias: bool = True) -> int:
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
  r = buffered_token_bytes(dims, buffer_dtype)
  io = token_io_bytes(dims, act_dtype, has_z=has_z)
  count = 2 * _COUNT_BYTES
  if fill == L - 1:  # flush: rebuild over all L tokens, write the checkpoint
    row = 2 * S + (L - 1) * r + io + count
  else:  # output-only: read checkpoint + history, append the token
    row = S + fill * r + io + r + count
  return batch * row + param_bytes(dims, has_D=has_D, has_dt_bias=has_dt_bias)


def replay_amortized_bytes(dims: LayerDims, batch: int, buffer_len: int,
                           checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                           act_dtype=jnp.bfloat16, *, has_z: bool = False,
                           has_D: bool = True,
                           has_dt_bias: bool = True) -> float:
  """Mean bytes per replay step over one L-step cycle (one flush per L)."""
  steps = _cycle_bytes(dims, batch, buffer_len, checkpoint_dtype,
                       buffer_dtype, act_dtype, has_z=has_z, has_D=has_D,
                       has_dt_bias=has_dt_bias)
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
                     has_D: bool = True,
                     has_dt_bias: bool = True) -> ReplayTraffic:
  """Non-flush, flush and amortized replay bytes against the baseline."""
  kw = dict(has_z=has_z, has_D=has_D, has_dt_bias=has_dt_bias)
  base = baseline_step_bytes(dims, batch, checkpoint_dtype, act_dtype, **kw)
  steps = _cycle_bytes(dims, batch, buffer_len, checkpoint_dtype,
                       buffer_dtype, act_dtype, **kw)
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
                       has_D: bool = True, has_dt_bias: bool = True) -> int:
  """The L in [1, max_len] with the fewest amortized bytes per step.

  Independent of the batch size (the per-call terms do not depend on L).
  Ties go to the smaller L (less buffer memory).
  """
  max_len = _check_pos_int("max_len", max_len)
  kw = dict(has_z=has_z, has_D=has_D, has_dt_bias=has_dt_bias)
  costs = [replay_amortized_bytes(dims, 1, L, checkpoint_dtype, buffer_dtype,
                                  act_dtype, **kw)
           for L in range(1, max_len + 1)]
  return 1 + min(range(max_len), key=lambda i: (costs[i], i))


def approx_optimal_buffer_len(dims: LayerDims, checkpoint_dtype,
                              buffer_dtype=jnp.bfloat16) -> float:
  """sqrt(2S/r), the continuous optimum of S/L + L*r/2 (research §2.6)."""
  return math.sqrt(2 * state_bytes(dims, checkpoint_dtype)
                   / buffered_token_bytes(dims, buffer_dtype))


# ------------------------------------------------------------------- tables
def traffic_table(dims: LayerDims, batch: int, buffer_lens: Sequence[int],
                  checkpoint_dtype, buffer_dtype=jnp.bfloat16,
                  act_dtype=jnp.bfloat16, *, has_z: bool = False,
                  has_D: bool = True,
                  has_dt_bias: bool = True) -> list[dict]:
  """One row per L: baseline vs replay bytes per step and predicted speed-up.

  Returns:
    list of JSON-serializable dicts with keys L, batch, checkpoint_dtype,
    buffer_dtype, act_dtype, baseline_bytes, replay_non_flush_bytes (mean over
    the non-flush fills, None for L=1), replay_flush_bytes,
    replay_amortized_bytes, ratio, predicted_speedup.
  """
  if isinstance(buffer_lens, int) or not len(buffer_lens):
    raise ValueError(f"buffer_lens must be a non-empty sequence of ints, got "
                     f"{buffer_lens!r}.")
  rows = []
  for L in buffer_lens:
    t = replay_breakdown(dims, batch, L, checkpoint_dtype, buffer_dtype,
                         act_dtype, has_z=has_z, has_D=has_D,
                         has_dt_bias=has_dt_bias)
    rows.append(dict(
        L=L,
        batch=batch,
        checkpoint_dtype=jnp.dtype(checkpoint_dtype).name,
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
