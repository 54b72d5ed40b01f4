"""The ReplaySSM decode state of one Gated DeltaNet layer.

A `GDNReplayState` replaces the full GDN state `[batch, HV, K, V]` by a
*checkpoint* (the state as of the last flush) plus rings of what the tokens
decoded since contributed: the *corrected* update d_t = beta_t (v_t -
alpha_t S_{t-1}^T k_t), the normalised key k_t and the log-decay g_t, and a
per-row counter. Given them the state is a decayed rank-1 sum,

  S = exp(G) S_0 + sum_j exp(G - G_j) k_j d_j^T,  G_j = g_0 + ... + g_j,

which `gdn_materialize` forms when needed; the decode step never does on
non-flush rows.

Shapes (L = buffer_len, HK key heads serving HV value heads):
  checkpoint: [batch, HV, K, V]   checkpoint dtype (f32/bf16/f16)
  d_buf:      [batch, L, HV, V]   buffer dtype, corrected updates d_t
  k_buf:      [batch, L, HK, K]   buffer dtype, normalised keys k_t
  g_buf:      [batch, L, HV]      float32, log-decays g_t
  count:      [batch]             int32, in [0, L)

Optional fields of a `precision.PrecisionPolicy`, as in `ReplayState`:
  read_copy:  [batch, HV, K, V]   read dtype: the copy non-flush steps read
  read_scale: [batch, HV, K]      float32 scales of an 8-bit read copy
  row_id, step: [batch] int32     key stochastic rounding

Row r holds `count[r]` buffered tokens in slots [0, count[r]); slots past
it are stale (they may hold anything, inf and NaN included: every
implementation selects them away). `pending_window` (static metadata) is
None for a committed state and T for the state `gdn_replay_verify` returns.

The shape and dtype checks run in `validate` (called by every op and
constructor), not in `__post_init__`: jax rebuilds a pytree with
placeholder or batched leaves (vmap, scan outputs), on which they would
fail; `__post_init__` checks the static `pending_window` only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax import precision as P
from replayssm_jax.gdn import checks
from replayssm_jax.dispatch import check_layer
from replayssm_jax.state import ReplayState
from replayssm_jax.state import _resolve_dtypes, _state_dtype

LAYOUTS = dict(checkpoint=checks.STATE_LAYOUT,
               d_buf="[batch, L, num_v_heads, value_dim]",
               k_buf="[batch, L, num_k_heads, key_dim]",
               g_buf="[batch, L, num_v_heads]")


class DeltaRingState:
  """What a delta-rule replay state (`GDNReplayState`, the KDA state) shares:
  a checkpoint [batch, HV, K, V], rings d_buf [batch, L, HV, V] and k_buf
  [batch, L, heads, K] of one buffer dtype, a per-row count in [0, L) and
  the precision fields of `ReplayState`. Subclasses are frozen dataclasses
  with those fields."""

  @property
  def batch(self) -> int:
    return self.checkpoint.shape[0]

  @property
  def num_v_heads(self) -> int:
    return self.checkpoint.shape[1]

  @property
  def key_dim(self) -> int:
    return self.checkpoint.shape[2]

  @property
  def value_dim(self) -> int:
    return self.checkpoint.shape[3]

  @property
  def buffer_len(self) -> int:
    return self.d_buf.shape[1]

  @property
  def read_dtype(self):
    """The read copy's dtype, or None."""
    return None if self.read_copy is None else jnp.dtype(self.read_copy.dtype)

  def replace(self, **kwargs):
    return dataclasses.replace(self, **kwargs)

  def with_policy(self, policy, *, row_id=None, step=None):
    """This state with the fields a `PrecisionPolicy` needs (read copy
    rounded to nearest from the stored checkpoint; with stochastic
    rounding the row_id / step counters), as `ReplayState.with_policy`."""
    if policy is None:
      raise ValueError("policy must be a PrecisionPolicy, got None.")
    return _with_policy_fields(self, policy, None, row_id, step, 0)

  def _validate_rings(self, name: str, grouped: bool, layouts: dict,
                      rows=None) -> tuple[int, int, int]:
    """The shared checks (grouped: the k ring has its own key heads,
    serving the value heads in groups; else one per value head) ->
    (batch, L, HV)."""
    V.check_floating(f"{name}.checkpoint", self.checkpoint, V.STATE_DTYPES)
    V.check_ndim(f"{name}.checkpoint", self.checkpoint, 4,
                 layouts["checkpoint"])
    b, hv, K, Vd = self.checkpoint.shape
    for field in ("d_buf", "k_buf"):
      V.check_floating(f"{name}.{field}", getattr(self, field),
                       V.STATE_DTYPES)
      V.check_ndim(f"{name}.{field}", getattr(self, field), 4,
                   layouts[field])
    L = self.d_buf.shape[1]
    if L < 1:
      raise ValueError(f"{name}.d_buf: buffer_len must be >= 1, got {L}.")
    V.check_shape(f"{name}.d_buf", self.d_buf, (b, L, hv, Vd),
                  layouts["d_buf"])
    hk = self.k_buf.shape[2] if grouped else hv
    V.check_shape(f"{name}.k_buf", self.k_buf, (b, L, hk, K),
                  layouts["k_buf"])
    if self.k_buf.dtype != self.d_buf.dtype:
      raise TypeError(f"{name}.k_buf ({self.k_buf.dtype}) and {name}.d_buf "
                      f"({self.d_buf.dtype}) must share the buffer dtype.")
    if grouped:
      checks.check_heads(hv, hk, f"{name}.k_buf")
    V.check_integer(f"{name}.count", self.count)
    V.check_shape(f"{name}.count", self.count, (b,), "[batch]")
    if jnp.dtype(self.count.dtype) != jnp.int32:
      raise TypeError(f"{name}.count must be int32, got {self.count.dtype}.")
    V.check_count_range(self.count, L, f"{name}.count", rows)
    # The precision fields have ReplayState's layout (checkpoint-shaped read
    # copy, one scale per checkpoint row): its checks apply as they are.
    ReplayState._validate_policy_fields(self, name)  # pylint: disable=protected-access
    return b, L, hv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNReplayState(DeltaRingState):
  """Checkpoint + rings of (d, k, g) + per-row counter (a pytree)."""

  checkpoint: jax.Array  # [batch, HV, K, V]
  d_buf: jax.Array  # [batch, L, HV, V]
  k_buf: jax.Array  # [batch, L, HK, K]
  g_buf: jax.Array  # [batch, L, HV] float32
  count: jax.Array  # [batch] int32
  read_copy: jax.Array | None = None  # [batch, HV, K, V]
  read_scale: jax.Array | None = None  # [batch, HV, K] float32
  row_id: jax.Array | None = None  # [batch] int32
  step: jax.Array | None = None  # [batch] int32
  pending_window: int | None = dataclasses.field(
      default=None, metadata=dict(static=True))

  def __post_init__(self):
    w = self.pending_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int)
                          or w < 1):
      raise ValueError(f"pending_window must be None or an int >= 1, got "
                       f"{w!r}.")

  @property
  def num_k_heads(self) -> int:
    return self.k_buf.shape[2]

  def validate(self, name: str = "rstate", rows=None) -> "GDNReplayState":
    """Checks shapes and dtypes (and count values when not traced: of the
    rows `rows` alone when given, `ReplayState.validate`)."""
    b, L, hv = self._validate_rings(name, True, LAYOUTS, rows)
    V.check_floating(f"{name}.g_buf", self.g_buf, (jnp.float32,))
    V.check_shape(f"{name}.g_buf", self.g_buf, (b, L, hv), LAYOUTS["g_buf"])
    w = self.pending_window
    if w is not None and not 1 <= w < L:
      raise ValueError(f"{name}.pending_window must be None or an int in "
                       f"[1, buffer_len = {L}), got {w!r}.")
    return self


def _with_policy_fields(rstate, policy, source, row_id, step, layer):
  """Read copy / SR counters of `policy` (and `source` stored as the
  master), exactly as for a ReplayState (same fields, same store sites)."""
  return ReplayState._with_policy_fields(  # pylint: disable=protected-access
      rstate, policy, source, row_id, step, layer)


def new_state(empty, dims, policy, checkpoint_dtype, buffer_dtype, row_id,
              step):
  """A zero state of dims (batch, HV, K, V); `empty(checkpoint, buffer
  dtype)` adds the empty rings (GDN's and KDA's constructors)."""
  dims = [V.positive_int(n, x) for n, x in zip(
      ("batch", "num_v_heads", "key_dim", "value_dim"), dims)]
  ck, bf = _resolve_dtypes(policy, checkpoint_dtype, buffer_dtype,
                           jnp.float32)
  checkpoint = jnp.zeros(dims, _state_dtype("checkpoint_dtype", ck))
  out = empty(checkpoint, bf)
  return _with_policy_fields(out, policy, None, row_id, step, 0).validate()


def state_from(empty, full_state, policy, checkpoint_dtype, buffer_dtype,
               row_id, step, layer):
  """`full_state` as the checkpoint of `empty`'s rings (as `new_state`),
  stored through `policy` when one is given."""
  explicit = checkpoint_dtype is not None or policy is not None
  checks.check_state("full_state", full_state, V.FLOAT_DTYPES
                     if explicit else V.STATE_DTYPES)
  ck, bf = _resolve_dtypes(policy, checkpoint_dtype, buffer_dtype,
                           full_state.dtype)
  ckdt = _state_dtype("checkpoint_dtype", ck)
  source = jnp.asarray(full_state)
  if policy is None:
    if row_id is not None or step is not None:
      raise ValueError("row_id and step are only used with a "
                       "PrecisionPolicy that has stochastic_rounding=True.")
    # A copy even in the same dtype: the caller's array stays theirs.
    return empty(jnp.array(source, ckdt, copy=True), bf).validate()
  out = empty(jnp.zeros(source.shape, ckdt), bf)
  return _with_policy_fields(out, policy, source, row_id, step,
                             layer).validate()


def _empty(checkpoint, num_k_heads, buffer_len, buffer_dtype):
  buffer_len = V.positive_int("buffer_len", buffer_len)
  hk = V.positive_int("num_k_heads", num_k_heads)
  b, hv, K, Vd = checkpoint.shape
  checks.check_heads(hv, hk, "num_k_heads")
  bdt = _state_dtype("buffer_dtype", buffer_dtype)
  return GDNReplayState(
      checkpoint=checkpoint,
      d_buf=jnp.zeros((b, buffer_len, hv, Vd), bdt),
      k_buf=jnp.zeros((b, buffer_len, hk, K), bdt),
      g_buf=jnp.zeros((b, buffer_len, hv), jnp.float32),
      count=jnp.zeros((b,), jnp.int32))


def init_gdn_replay_state(batch: int, *, num_v_heads: int, num_k_heads: int,
                          key_dim: int, value_dim: int, buffer_len: int,
                          checkpoint_dtype=None, buffer_dtype=None,
                          policy: P.PrecisionPolicy | None = None,
                          row_id=None, step=None) -> GDNReplayState:
  """An all-zero state (zero checkpoint, empty rings).

  Args:
    batch, num_v_heads, num_k_heads, key_dim, value_dim: sizes.
    buffer_len: L, the decode steps between checkpoint writes.
    checkpoint_dtype: default float32 (or the policy's).
    buffer_dtype: of the d and k rings; default bfloat16 (or the policy's).
    policy: optional `PrecisionPolicy` (adds a zero read copy / the
      stochastic-rounding counters).
    row_id, step: see `gdn_replay_state_from`.
  """
  empty = lambda ck, bf: _empty(ck, num_k_heads, buffer_len, bf)
  return new_state(empty, (batch, num_v_heads, key_dim, value_dim), policy,
                   checkpoint_dtype, buffer_dtype, row_id, step)


def gdn_replay_state_from(full_state, buffer_len: int, *, num_k_heads: int,
                          checkpoint_dtype=None, buffer_dtype=None,
                          policy: P.PrecisionPolicy | None = None,
                          row_id=None, step=None,
                          layer: int = 0) -> GDNReplayState:
  """Wraps a full GDN state (e.g. after `gdn_chunked_prefill`) with empty
  rings.

  Args:
    full_state: [batch, num_v_heads, key_dim, value_dim].
    buffer_len: L.
    num_k_heads: key heads of the layer (the k ring's heads).
    checkpoint_dtype: default the policy's, else full_state's (which must
      then be f32/bf16/f16).
    buffer_dtype: default the policy's, else bfloat16.
    policy: optional `PrecisionPolicy`: the master (and read copy) are
      stored from the f32 values of full_state, stochastically with
      stochastic rounding (keyed by layer, row_id, step).
    row_id, step: [batch] int32 (stochastic rounding only; defaults
      arange(batch) and zeros).
    layer: layer index keying the stochastic rounding of the stores.
  """
  empty = lambda ck, bf: _empty(ck, num_k_heads, buffer_len, bf)
  return state_from(empty, full_state, policy, checkpoint_dtype,
                    buffer_dtype, row_id, step, layer)


def resolve_policy(rstate: GDNReplayState, policy) -> P.PrecisionPolicy:
  """The policy of a step: `policy` checked against the state, or (None)
  the round-to-nearest policy of the state's dtypes (as
  `dispatch.resolve_policy` for a ReplayState)."""
  return P.resolve_policy(
      policy, jnp.dtype(rstate.checkpoint.dtype).name,
      jnp.dtype(rstate.d_buf.dtype).name,
      None if rstate.read_copy is None else rstate.read_dtype.name,
      rstate.step is not None,
      "its constructor's policy argument (init_gdn_replay_state / "
      "init_kda_replay_state(..., policy=policy))")


def policy_args(rstate: GDNReplayState, policy, layer) -> dict:
  """The policy / layer arguments of a GDN replay op's implementation
  (none for a plain state, as `dispatch.policy_args`)."""
  policy = resolve_policy(rstate, policy)
  check_layer(layer)
  if policy.plain and rstate.step is None:
    return {}
  return dict(policy=policy, layer=layer)
