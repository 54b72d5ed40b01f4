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

Optional fields of a `precision.PrecisionPolicy` (None otherwise, so that
states without them are a pytree of the five fields above):
  read_copy:  [batch, nheads, headdim, dstate]  read dtype (bf16/f16/fp8/int8):
              a low-precision copy of the checkpoint that non-flush steps
              read instead of the master checkpoint
  read_scale: [batch, nheads, headdim]          float32, per-row dequant
              scales of an 8-bit (fp8 e4m3 / int8) read copy
  row_id:     [batch]                           int32, a stable identity of
              the sequence in each row (keys stochastic rounding)
  step:       [batch]                           int32, tokens processed by
              the row (keys stochastic rounding; advanced by every step)

Row r holds `count[r]` buffered tokens in slots [0, count[r]); the contents of
slots >= count[r] are stale and never read (they may hold anything, inf and
NaN included: every implementation selects them away).

`pending_window` (static pytree metadata, not a leaf) is None for a
committed state and T for the state `replay_verify` returns, whose T window
tokens wait behind the committed history for `replay_commit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax import precision as P


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReplayState:
  """Checkpoint + input buffer + per-row counter (a registered pytree)."""

  checkpoint: jax.Array  # [batch, nheads, headdim, dstate]
  x_buf: jax.Array  # [batch, L, nheads, headdim]
  b_buf: jax.Array  # [batch, L, ngroups, dstate]
  dt_buf: jax.Array  # [batch, L, nheads] float32
  count: jax.Array  # [batch] int32
  read_copy: jax.Array | None = None  # [batch, nheads, headdim, dstate]
  read_scale: jax.Array | None = None  # [batch, nheads, headdim] float32
  row_id: jax.Array | None = None  # [batch] int32
  step: jax.Array | None = None  # [batch] int32
  pending_window: int | None = dataclasses.field(
      default=None, metadata=dict(static=True))

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
             ngroups: int, buffer_len: int, checkpoint_dtype=None,
             buffer_dtype=None, *, policy: P.PrecisionPolicy | None = None,
             row_id=None, step=None) -> "ReplayState":
    """An all-zero state (zero checkpoint, empty buffers).

    Args:
      batch, nheads, headdim, dstate, ngroups: layer and batch sizes.
      buffer_len: L, the number of decode steps between checkpoint writes.
      checkpoint_dtype: default float32 (or the policy's).
      buffer_dtype: default bfloat16 (or the policy's).
      policy: optional `PrecisionPolicy`; adds a (zero) read copy if it has a
        read_dtype and row_id/step counters if it rounds stochastically.
      row_id, step: see `from_ssm_state`.
    """
    batch, nheads, headdim, dstate, ngroups = (
        V.positive_int(name, v) for name, v in (
            ("batch", batch), ("nheads", nheads), ("headdim", headdim),
            ("dstate", dstate), ("ngroups", ngroups)))
    checkpoint_dtype, buffer_dtype = _resolve_dtypes(
        policy, checkpoint_dtype, buffer_dtype, jnp.float32)
    checkpoint = jnp.zeros((batch, nheads, headdim, dstate),
                           _state_dtype("checkpoint_dtype", checkpoint_dtype))
    out = cls._with_empty_buffer(checkpoint, ngroups, buffer_len,
                                 buffer_dtype)
    return out._with_policy_fields(policy, None, row_id, step, 0)

  @classmethod
  def from_ssm_state(cls, ssm_state: jax.Array, ngroups: int,
                     buffer_len: int, checkpoint_dtype=None,
                     buffer_dtype=None, *,
                     policy: P.PrecisionPolicy | None = None, row_id=None,
                     step=None, layer: int = 0) -> "ReplayState":
    """Wraps a full SSM state (e.g. after prefill) with an empty buffer.

    Args:
      ssm_state: [batch, nheads, headdim, dstate] full state.
      ngroups: number of B/C groups of the layer.
      buffer_len: L, the number of decode steps between checkpoint writes.
      checkpoint_dtype: storage dtype of the checkpoint (default: the
        policy's, else that of ssm_state).
      buffer_dtype: storage dtype of the x and B buffers (default: the
        policy's, else bfloat16).
      policy: optional `PrecisionPolicy`. With a read_dtype the read copy is
        stored from the (stored) master; with stochastic_rounding the master
        and copy are rounded stochastically (keyed by layer, row_id, step)
        and the state carries row_id/step.
      row_id: [batch] int32 stable row identities (only with stochastic
        rounding; default arange(batch) -- pass request ids to make a row's
        bits independent of where it sits in the batch).
      step: [batch] int32 tokens already processed per row (only with
        stochastic rounding; default zeros).
      layer: layer index keying the stochastic rounding of the stores.
    """
    # Without an explicit checkpoint_dtype the state's own dtype is kept, so
    # it must be a storage dtype (an f64 state needs checkpoint_dtype).
    explicit = checkpoint_dtype is not None or policy is not None
    V.check_floating("ssm_state", ssm_state, V.FLOAT_DTYPES
                     if explicit else V.STATE_DTYPES)
    V.check_ndim("ssm_state", ssm_state, 4,
                 "[batch, nheads, headdim, dstate]")
    checkpoint_dtype, buffer_dtype = _resolve_dtypes(
        policy, checkpoint_dtype, buffer_dtype, ssm_state.dtype)
    ckdt = _state_dtype("checkpoint_dtype", checkpoint_dtype)
    source = jnp.asarray(ssm_state)
    if policy is None:
      # A copy even in the same dtype: the caller's array stays theirs (a
      # donated decode step would otherwise delete it).
      return cls._with_empty_buffer(jnp.array(source, ckdt, copy=True),
                                    ngroups, buffer_len, buffer_dtype)
    # The checkpoint is rounded (maybe stochastically) below, by
    # _with_policy_fields, from the f32 source.
    out = cls._with_empty_buffer(jnp.zeros(source.shape, ckdt), ngroups,
                                 buffer_len, buffer_dtype)
    return out._with_policy_fields(policy, source, row_id, step, layer)

  @classmethod
  def _with_empty_buffer(cls, checkpoint, ngroups, buffer_len, buffer_dtype):
    buffer_len = V.positive_int("buffer_len", buffer_len)
    ngroups = V.positive_int("ngroups", ngroups)
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

  def with_policy(self, policy, *, row_id=None, step=None):
    """This state (checkpoint, buffers, counters kept) with the fields a
    `PrecisionPolicy` needs: the read copy of the checkpoint (rounded to
    nearest: the checkpoint is already stored) and, with stochastic
    rounding, the counters that key its later stores (row_id default
    arange(batch), step default 0)."""
    if policy is None:
      raise ValueError("policy must be a PrecisionPolicy, got None.")
    return self._with_policy_fields(policy, None, row_id, step, 0)

  def _with_policy_fields(self, policy, source, row_id, step, layer):
    """Adds read copy / SR counters (and stores `source` as the master)."""
    if policy is None:
      if row_id is not None or step is not None:
        raise ValueError("row_id and step are only used with a "
                         "PrecisionPolicy that has stochastic_rounding=True.")
      return self
    if not isinstance(policy, P.PrecisionPolicy):
      raise TypeError(f"policy must be a PrecisionPolicy or None, got "
                      f"{type(policy).__name__}.")
    b = self.batch
    if policy.stochastic_rounding:
      row_id = _counter("row_id", row_id, b, jnp.arange(b, dtype=jnp.int32))
      step = _counter("step", step, b, jnp.zeros((b,), jnp.int32))
    elif row_id is not None or step is not None:
      raise ValueError("row_id and step are only used with "
                       "stochastic_rounding=True (policy "
                       f"{policy.name!r} rounds to nearest).")
    shape = self.checkpoint.shape[1:]
    checkpoint = self.checkpoint
    if source is not None:
      bits = None
      if policy.stochastic_rounding and policy.checkpoint_dtype != "float32":
        bits = P.random_bits(policy.seed, layer, row_id, step, shape,
                             P.SITE_INIT_MASTER, policy.sr_rng)
      checkpoint = P.round_to(source.astype(jnp.float32),
                              policy.checkpoint_dtype, bits)
    read_copy = read_scale = None
    if policy.read_dtype is not None:
      bits = None
      if policy.stochastic_rounding and source is not None:
        bits = P.random_bits(policy.seed, layer, row_id, step, shape,
                             P.SITE_INIT_READ_COPY, policy.sr_rng)
      read_copy, read_scale = P.store(checkpoint.astype(jnp.float32),
                                      policy.read_dtype, bits)
    return self.replace(checkpoint=checkpoint, read_copy=read_copy,
                        read_scale=read_scale, row_id=row_id, step=step)

  # -------------------------------------------------------------- checks
  def validate(self, name: str = "rstate", rows=None) -> "ReplayState":
    """Checks shapes and dtypes (and count values when not traced: of the
    rows `rows` alone when given, a concrete [k] array of slots)."""
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
    V.check_count_range(self.count, L, f"{name}.count", rows)
    self._validate_policy_fields(name)
    w = self.pending_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int)
                          or not 1 <= w < L):
      raise ValueError(f"{name}.pending_window must be None or an int in "
                       f"[1, buffer_len = {L}), got {w!r}.")
    return self

  def _validate_policy_fields(self, name):
    b, h, p, n = self.checkpoint.shape
    if self.read_copy is not None:
      V.check_array(f"{name}.read_copy", self.read_copy)
      rd = jnp.dtype(self.read_copy.dtype).name
      if rd not in P.READ_DTYPES:
        raise TypeError(f"{name}.read_copy must have a dtype in "
                        f"({', '.join(P.READ_DTYPES)}), got {rd}.")
      if (jnp.dtype(rd).itemsize
          >= jnp.dtype(self.checkpoint.dtype).itemsize):
        raise TypeError(f"{name}.read_copy ({rd}) must be narrower than "
                        f"{name}.checkpoint ({self.checkpoint.dtype}).")
      V.check_shape(f"{name}.read_copy", self.read_copy, (b, h, p, n),
                    "[batch, nheads, headdim, dstate]")
      if rd in P.QUANTIZED_DTYPES:
        if self.read_scale is None:
          raise ValueError(f"{name}.read_scale is required with a {rd} "
                           f"read copy ([batch, nheads, headdim] float32).")
        V.check_floating(f"{name}.read_scale", self.read_scale,
                         (jnp.float32,))
        V.check_shape(f"{name}.read_scale", self.read_scale, (b, h, p),
                      "[batch, nheads, headdim]")
      elif self.read_scale is not None:
        raise ValueError(f"{name}.read_scale must be None with a {rd} read "
                         f"copy (only float8_e4m3fn/int8 copies are "
                         f"scaled).")
    elif self.read_scale is not None:
      raise ValueError(f"{name}.read_scale must be None without a "
                       f"read_copy.")
    if (self.row_id is None) != (self.step is None):
      raise ValueError(f"{name}.row_id and {name}.step must be given "
                       f"together (both [batch] int32) or both be None.")
    for field in ("row_id", "step"):
      v = getattr(self, field)
      if v is not None:
        V.check_integer(f"{name}.{field}", v)
        V.check_shape(f"{name}.{field}", v, (b,), "[batch]")
        if jnp.dtype(v.dtype) != jnp.int32:
          raise TypeError(f"{name}.{field} must be int32, got {v.dtype}.")

  @property
  def read_dtype(self):
    """The read copy's dtype, or None."""
    return None if self.read_copy is None else jnp.dtype(self.read_copy.dtype)

  def replace(self, **kwargs) -> "ReplayState":
    return dataclasses.replace(self, **kwargs)


def _resolve_dtypes(policy, checkpoint_dtype, buffer_dtype, default_ckpt):
  """(checkpoint, buffer) dtypes from explicit args, the policy, defaults."""
  if policy is None:
    return (default_ckpt if checkpoint_dtype is None else checkpoint_dtype,
            jnp.bfloat16 if buffer_dtype is None else buffer_dtype)
  if not isinstance(policy, P.PrecisionPolicy):
    raise TypeError(f"policy must be a PrecisionPolicy or None, got "
                    f"{type(policy).__name__}.")
  for name, given, own in (("checkpoint_dtype", checkpoint_dtype,
                            policy.checkpoint_dtype),
                           ("buffer_dtype", buffer_dtype,
                            policy.buffer_dtype)):
    if given is not None and jnp.dtype(given) != jnp.dtype(own):
      raise ValueError(f"{name} ({jnp.dtype(given).name}) contradicts the "
                       f"policy's {name} ({own}); give one or the other.")
  return policy.checkpoint_dtype, policy.buffer_dtype


def _counter(name, value, batch, default):
  if value is None:
    return default
  V.check_integer(name, value)
  V.check_shape(name, value, (batch,), "[batch]")
  return jnp.asarray(value, jnp.int32)


def _state_dtype(name, dtype):
  dt = jnp.dtype(dtype)
  if dt not in [jnp.dtype(d) for d in V.STATE_DTYPES]:
    names = ", ".join(jnp.dtype(d).name for d in V.STATE_DTYPES)
    raise TypeError(f"{name} must be one of ({names}), got {dt.name}.")
  return dt
