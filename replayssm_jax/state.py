"""The ReplaySSM decode state of one Mamba-2 layer.

A `ReplayState` replaces the full SSM state `[batch, nheads, headdim, dstate]`
by a *checkpoint* (the state as of the last flush) plus a buffer of the inputs
of the tokens decoded since (x, B and the processed dt') and a per-row
counter. The current state is never stored between flushes; `materialize`
rebuilds it when it is needed (prefix caching, debugging, tests).

Shapes (L = buffer_len, G = ngroups):
  checkpoint: [batch, nheads, headdim, dstate]  checkpoint dtype (f32/bf16/f16)
  x_buf:      [batch, L, nheads, headdim]       buffer dtype
  b_buf:      [batch, L, ngroups, dstate]       buffer dtype
  dt_buf:     [batch, L, nheads]                float32, dt after bias+softplus
  count:      [batch]                           int32, in [0, L)

Row r holds `count[r]` buffered tokens in slots [0, count[r]); the contents of
slots >= count[r] are stale and never read.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayState:
  """Checkpoint + input buffer + per-row counter (a registered pytree)."""

  checkpoint: jax.Array  # [batch, nheads, headdim, dstate]
  x_buf: jax.Array  # [batch, L, nheads, headdim]
  b_buf: jax.Array  # [batch, L, ngroups, dstate]
  dt_buf: jax.Array  # [batch, L, nheads] float32
  count: jax.Array  # [batch] int32

  # ---------------------------------------------------------------- shapes
  @property
  def batch(self) -> int:
    return self.checkpoint.shape[0]

  @property
  def nheads(self) -> int:
    return self.checkpoint.shape[1]

  @property
  def headdim(self) -> int:
    return self.checkpoint.shape[2]

  @property
  def dstate(self) -> int:
    return self.checkpoint.shape[3]

  @property
  def ngroups(self) -> int:
    return self.b_buf.shape[2]

  @property
  def buffer_len(self) -> int:
    return self.x_buf.shape[1]

  # ---------------------------------------------------------- constructors
  @classmethod
  def create(cls, batch: int, nheads: int, headdim: int, dstate: int,
             ngroups: int, buffer_len: int, checkpoint_dtype=jnp.float32,
             buffer_dtype=jnp.bfloat16) -> "ReplayState":
    """An all-zero state (zero checkpoint, empty buffers)."""
    for name, v in (("batch", batch), ("nheads", nheads),
                    ("headdim", headdim), ("dstate", dstate),
                    ("ngroups", ngroups)):
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}.")
    checkpoint = jnp.zeros((batch, nheads, headdim, dstate),
                           _state_dtype("checkpoint_dtype", checkpoint_dtype))
    return cls._with_empty_buffer(checkpoint, ngroups, buffer_len,
                                  buffer_dtype)

  @classmethod
  def from_ssm_state(cls, ssm_state: jax.Array, ngroups: int,
                     buffer_len: int, checkpoint_dtype=None,
                     buffer_dtype=jnp.bfloat16) -> "ReplayState":
    """Wraps a full SSM state (e.g. after prefill) with an empty buffer.

    Args:
      ssm_state: [batch, nheads, headdim, dstate] full state.
      ngroups: number of B/C groups of the layer.
      buffer_len: L, the number of decode steps between checkpoint writes.
      checkpoint_dtype: storage dtype of the checkpoint (default: that of
        ssm_state).
      buffer_dtype: storage dtype of the x and B buffers.
    """
    # Without an explicit checkpoint_dtype the state's own dtype is kept, so
    # it must be a storage dtype (an f64 state needs checkpoint_dtype).
    V.check_floating("ssm_state", ssm_state, V.FLOAT_DTYPES
                     if checkpoint_dtype is not None else V.STATE_DTYPES)
    V.check_ndim("ssm_state", ssm_state, 4,
                 "[batch, nheads, headdim, dstate]")
    dtype = ssm_state.dtype if checkpoint_dtype is None else checkpoint_dtype
    checkpoint = jnp.asarray(ssm_state).astype(
        _state_dtype("checkpoint_dtype", dtype))
    return cls._with_empty_buffer(checkpoint, ngroups, buffer_len,
                                  buffer_dtype)

  @classmethod
  def _with_empty_buffer(cls, checkpoint, ngroups, buffer_len, buffer_dtype):
    if not isinstance(buffer_len, int) or buffer_len < 1:
      raise ValueError(f"buffer_len must be an int >= 1, got {buffer_len!r}.")
    if not isinstance(ngroups, int):
      raise ValueError(f"ngroups must be an int, got {ngroups!r}.")
    batch, nheads, headdim, dstate = checkpoint.shape
    V.check_groups(nheads, ngroups, where="ngroups")
    bdt = _state_dtype("buffer_dtype", buffer_dtype)
    return cls(
        checkpoint=checkpoint,
        x_buf=jnp.zeros((batch, buffer_len, nheads, headdim), bdt),
        b_buf=jnp.zeros((batch, buffer_len, ngroups, dstate), bdt),
        dt_buf=jnp.zeros((batch, buffer_len, nheads), jnp.float32),
        count=jnp.zeros((batch,), jnp.int32),
    )

  # -------------------------------------------------------------- checks
  def validate(self, name: str = "rstate") -> "ReplayState":
    """Checks shapes and dtypes (and count values when not traced)."""
    V.check_floating(f"{name}.checkpoint", self.checkpoint, V.STATE_DTYPES)
    V.check_ndim(f"{name}.checkpoint", self.checkpoint, 4,
                 "[batch, nheads, headdim, dstate]")
    b, h, p, n = self.checkpoint.shape
    V.check_floating(f"{name}.x_buf", self.x_buf, V.STATE_DTYPES)
    V.check_ndim(f"{name}.x_buf", self.x_buf, 4,
                 "[batch, L, nheads, headdim]")
    L = self.x_buf.shape[1]
    if L < 1:
      raise ValueError(f"{name}.x_buf: buffer_len must be >= 1, got {L}.")
    V.check_shape(f"{name}.x_buf", self.x_buf, (b, L, h, p),
                  "[batch, L, nheads, headdim]")
    V.check_floating(f"{name}.b_buf", self.b_buf, V.STATE_DTYPES)
    V.check_ndim(f"{name}.b_buf", self.b_buf, 4, "[batch, L, ngroups, dstate]")
    g = self.b_buf.shape[2]
    V.check_shape(f"{name}.b_buf", self.b_buf, (b, L, g, n),
                  "[batch, L, ngroups, dstate]")
    V.check_groups(h, g, where=f"{name}.b_buf")
    V.check_floating(f"{name}.dt_buf", self.dt_buf, (jnp.float32,))
    V.check_shape(f"{name}.dt_buf", self.dt_buf, (b, L, h),
                  "[batch, L, nheads]")
    V.check_integer(f"{name}.count", self.count)
    V.check_shape(f"{name}.count", self.count, (b,), "[batch]")
    if jnp.dtype(self.count.dtype) != jnp.int32:
      raise TypeError(f"{name}.count must be int32, got {self.count.dtype}.")
    V.check_count_range(self.count, L, f"{name}.count")
    return self

  def replace(self, **kwargs) -> "ReplayState":
    return dataclasses.replace(self, **kwargs)


def _state_dtype(name, dtype):
  dt = jnp.dtype(dtype)
  if dt not in [jnp.dtype(d) for d in V.STATE_DTYPES]:
    names = ", ".join(jnp.dtype(d).name for d in V.STATE_DTYPES)
    raise TypeError(f"{name} must be one of ({names}), got {dt.name}.")
  return dt
