"""The ReplaySSM decode state of one Kimi Delta Attention (KDA) layer, with
pre-decayed keys.

With a per-key-channel decay the state after c buffered tokens is

  S = diag(exp(H)) S_0 + sum_{j<c} diag(exp(H - G_j)) k_j d_j^T,

G_j the channel-wise log-decay from the checkpoint S_0 through token j and
H = G_{c-1}. Replaying it from raw keys needs the [L, K] suffix-decay
matrix exp(H - G_j) at every step. The ring instead holds each key
*pre-decayed* at append time, k~_j = exp(-G_j) * k_j, so that

  S^T x = S_0^T (exp(H) x) + sum_j (k~_j . exp(H) x) d_j

costs one exp per channel (of the running total H) per step.

Gate bound. exp(-G_j) grows with the accumulated decay: with every
channel's log-gate at or above a lower bound lb < 0 (g >= lb) the stored
keys are at most |k| exp((L - 1) |lb|) (a key is stored at most L - 2
tokens after the checkpoint, with G_j >= (j + 1) lb), and the decays
exp(H + g) a non-flush step multiplies by are at least exp(-(L - 1) |lb|).
Both stay in range when

  (L - 1) * |gate_lower_bound| <= MAX_LOG_DECAY[k ring dtype]

(80 for float32 / bfloat16 rings: exp(80) = 5.5e34 < 3.4e38, exp(-80) =
1.8e-35 above the smallest normal 1.2e-38; 10 for a float16 ring, whose
largest value is 65504 = exp(11.1)). The constructors refuse a
buffer_len / gate_lower_bound pair that violates it. A token whose gate
leaves the bound (any channel g < lb, possible for Kimi Linear's
unbounded gate) is still exact: its row takes the flush route (the state
is formed from the checkpoint and the bounded ring, then stepped by the
baseline rule) and its count restarts at 0, so the ring never holds a key
decayed past the bound. With every gate within the bound the checkpoint is
written exactly every L steps.

Shapes (L = buffer_len):
  checkpoint: [batch, HV, K, V]   checkpoint dtype (f32/bf16/f16)
  d_buf:      [batch, L, HV, V]   buffer dtype, corrected updates d_j
  k_buf:      [batch, L, HV, K]   buffer dtype, pre-decayed keys
                                  exp(-G_j) k_j (per value head: the
                                  decay is)
  g_sum:      [batch, HV, K]      float32, H: the log-decay from the
                                  checkpoint through the last buffered
                                  token (read as 0 at count 0)
  count:      [batch]             int32, in [0, L)
  read_copy, read_scale, row_id, step: a `precision.PrecisionPolicy`'s
                                  fields, as in `ReplayState`.
  gate_lower_bound                static float < 0 (-inf only for L = 1),
                                  required.

Slots at or past a row's count are stale (anything, inf and NaN included:
every op selects them away).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax import precision as P
from replayssm_jax.gdn import checks
from replayssm_jax.gdn import state as GS
from replayssm_jax.state import _state_dtype

MAX_LOG_DECAY = {"float32": 80.0, "bfloat16": 80.0, "float16": 10.0}

LAYOUTS = dict(checkpoint=checks.STATE_LAYOUT,
               d_buf="[batch, L, num_v_heads, value_dim]",
               k_buf="[batch, L, num_v_heads, key_dim]",
               g_sum="[batch, num_v_heads, key_dim]")


def safe_gate_lower_bound(buffer_len: int, buffer_dtype="bfloat16") -> float:
  """The loosest gate lower bound the pre-decayed ring allows at this
  buffer_len: -MAX_LOG_DECAY / (L - 1) (-inf at L = 1, where no key is
  ever stored)."""
  L = V.positive_int("buffer_len", buffer_len)
  lim = MAX_LOG_DECAY[jnp.dtype(buffer_dtype).name]
  return -math.inf if L == 1 else -lim / (L - 1)


def check_gate_bound(buffer_len: int, gate_lower_bound, buffer_dtype) -> float:
  """gate_lower_bound as a float, checked against buffer_len (see the
  module docstring); None gives `safe_gate_lower_bound`."""
  L = V.positive_int("buffer_len", buffer_len)
  name = jnp.dtype(buffer_dtype).name
  if gate_lower_bound is None:
    return safe_gate_lower_bound(L, name)
  lb = gate_lower_bound
  if (isinstance(lb, (bool, np.bool_)) or not isinstance(
      lb, (int, float, np.integer, np.floating)) or math.isnan(float(lb))
      or float(lb) >= 0):
    raise ValueError(f"gate_lower_bound must be None or a Python float < 0 "
                     f"(the smallest per-channel log-gate g), got {lb!r}.")
  lb = float(lb)
  lim = MAX_LOG_DECAY[name]
  if L > 1 and (L - 1) * abs(lb) > lim:
    raise ValueError(
        f"buffer_len ({L}) and gate_lower_bound ({lb}) give (buffer_len - "
        f"1) * |gate_lower_bound| = {(L - 1) * abs(lb):.4g} > {lim:g}: keys "
        f"pre-decayed by up to exp({(L - 1) * abs(lb):.4g}) would leave the "
        f"{name} range of the k ring. Use gate_lower_bound >= "
        f"{-lim / (L - 1):.4g} or buffer_len <= "
        f"{1 + int(lim // abs(lb))}.")
  return lb


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAReplayState(GS.DeltaRingState):
  """Checkpoint + rings of (d, pre-decayed k) + running log-decay + per-row
  counter (a pytree)."""

  checkpoint: jax.Array  # [batch, HV, K, V]
  d_buf: jax.Array  # [batch, L, HV, V]
  k_buf: jax.Array  # [batch, L, HV, K]
  g_sum: jax.Array  # [batch, HV, K] float32
  count: jax.Array  # [batch] int32
  read_copy: jax.Array | None = None
  read_scale: jax.Array | None = None
  row_id: jax.Array | None = None
  step: jax.Array | None = None
  gate_lower_bound: float | None = dataclasses.field(
      default=None, metadata=dict(static=True))

  def __post_init__(self):
    lb = self.gate_lower_bound
    if isinstance(lb, bool) or not isinstance(lb, float) or not lb < 0:
      raise ValueError(f"gate_lower_bound is required: a float < 0 with "
                       f"(buffer_len - 1) * |gate_lower_bound| <= "
                       f"MAX_LOG_DECAY (see safe_gate_lower_bound), got "
                       f"{lb!r}.")

  def validate(self, name: str = "rstate", rows=None) -> "KDAReplayState":
    """Checks shapes, dtypes, the gate bound (and count values when not
    traced: of the rows `rows` alone when given)."""
    b, L, hv = self._validate_rings(name, False, LAYOUTS, rows)
    V.check_floating(f"{name}.g_sum", self.g_sum, (jnp.float32,))
    V.check_shape(f"{name}.g_sum", self.g_sum,
                  (b, hv, self.checkpoint.shape[2]), LAYOUTS["g_sum"])
    check_gate_bound(L, self.gate_lower_bound, self.k_buf.dtype)
    return self


def _empty(checkpoint, buffer_len, buffer_dtype, gate_lower_bound):
  buffer_len = V.positive_int("buffer_len", buffer_len)
  b, hv, K, Vd = checkpoint.shape
  bdt = _state_dtype("buffer_dtype", buffer_dtype)
  lb = check_gate_bound(buffer_len, gate_lower_bound, bdt)
  return KDAReplayState(
      checkpoint=checkpoint,
      d_buf=jnp.zeros((b, buffer_len, hv, Vd), bdt),
      k_buf=jnp.zeros((b, buffer_len, hv, K), bdt),
      g_sum=jnp.zeros((b, hv, K), jnp.float32),
      count=jnp.zeros((b,), jnp.int32), gate_lower_bound=lb)


def init_kda_replay_state(batch: int, *, num_v_heads: int, key_dim: int,
                          value_dim: int, buffer_len: int,
                          gate_lower_bound=None, checkpoint_dtype=None,
                          buffer_dtype=None,
                          policy: P.PrecisionPolicy | None = None,
                          row_id=None, step=None) -> KDAReplayState:
  """An all-zero state (zero checkpoint, empty rings).

  Args:
    batch, num_v_heads, key_dim, value_dim: sizes.
    buffer_len: L, the decode steps between checkpoint writes.
    gate_lower_bound: lb < 0 with (L - 1) |lb| <= MAX_LOG_DECAY (80 for an
      f32 / bf16 ring); None: the loosest, `safe_gate_lower_bound(L)`.
    checkpoint_dtype: default float32 (or the policy's).
    buffer_dtype: of the d and k rings; default bfloat16 (or the policy's).
    policy, row_id, step: as `gdn.init_gdn_replay_state`.
  """
  empty = lambda ck, bf: _empty(ck, buffer_len, bf, gate_lower_bound)
  return GS.new_state(empty, (batch, num_v_heads, key_dim, value_dim),
                      policy, checkpoint_dtype, buffer_dtype, row_id, step)


def kda_replay_state_from(full_state, buffer_len: int, *,
                          gate_lower_bound=None, checkpoint_dtype=None,
                          buffer_dtype=None,
                          policy: P.PrecisionPolicy | None = None,
                          row_id=None, step=None,
                          layer: int = 0) -> KDAReplayState:
  """Wraps a full KDA state [batch, HV, K, V] (e.g. after
  `kda_chunked_prefill`) with empty rings; the other arguments as
  `init_kda_replay_state` and `gdn.gdn_replay_state_from`."""
  empty = lambda ck, bf: _empty(ck, buffer_len, bf, gate_lower_bound)
  return GS.state_from(empty, full_state, policy, checkpoint_dtype,
                       buffer_dtype, row_id, step, layer)
