"""Decode-state pytrees of the hybrid LM (frozen registered dataclasses).

The modules hold parameters only; these states are passed in and returned.

  MambaState      conv: [batch, conv_kernel - 1, conv_dim] the last conv
                        inputs as a ring buffer (oldest in slot conv_start;
                        a decode step writes one slot)
                  conv_start: [batch] int32; `ordered_conv()` gives the
                        inputs oldest first
                  ssm:  ReplayState (ssm_mode="replay") or
                        [batch, H, P, N] array (ssm_mode="baseline") or
                        StoredSSMState (baseline stored in 8 bits or
                        with stochastic rounding, see below)
                  precision: the PrecisionPolicy the state was built with
                        (static; None: no policy)
  GDNState        conv: [batch, conv_kernel - 1, gdn_conv_dim] the last conv
                        inputs, oldest first
                  ssm:  GDNReplayState (ssm_mode="replay",
                        replayssm_jax.gdn) or [batch, HV, K, V] array
                        (ssm_mode="baseline") or StoredSSMState (as for
                        Mamba-2); Kimi Delta Attention
                        layers: KDAReplayState (replayssm_jax.kda) or the
                        array
  AttentionState  k, v: [batch, num_kv_heads, max_len, attn_head_dim]
                  length: [batch] int32, valid cache entries per row
  MLP blocks      None (stateless)
  ModelState      layers: tuple in layer order; positions: [batch] int32,
                  tokens processed per row.

Precision policies (`init_state(precision=policy)`, a
`replayssm_jax.precision.PrecisionPolicy`):
  replay    ReplayState built with the policy (master checkpoint, optional
            read copy, row_id/step counters with stochastic rounding).
  baseline  the full state stored every step in the policy's narrowest state
            dtype, `baseline_storage_dtype(policy)` (read_dtype if any, else
            checkpoint_dtype) with the policy's rounding: the "round every
            step" contrast. A float dtype rounded to nearest is a plain
            array (as `init_state(checkpoint_dtype=...)` without a policy);
            8-bit or stochastically rounded storage is a StoredSSMState.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from replayssm_jax import gdn
from replayssm_jax import kda
from replayssm_jax import precision as P
from replayssm_jax.conv import conv_ring_ordered
from replayssm_jax.reference import materialize
from replayssm_jax.state import ReplayState

SSM_MODES = ("replay", "baseline")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StoredSSMState:
  """A baseline recurrent state stored in a low precision, rounded every
  step (Mamba-2 [batch, H, P, N], Gated DeltaNet / KDA [batch, HV, K, V]).

  Decoded by `ops.selective_state_update_stored` (Mamba-2) or
  `step_stored` (delta rule), reference only: load to f32, advance one
  token, store back (round to nearest or stochastically). Stochastic
  rounding of a store is keyed by (policy seed, recurrent layer index,
  row_id, step after the store, element), with the store site
  `precision.SITE_BASELINE`; the prefill store is keyed by step = prompt
  length.
  """
  state: jax.Array  # [batch, H, P, N] / [batch, HV, K, V] storage dtype
  scale: jax.Array | None = None  # [batch, H, P] / [batch, HV, K] float32
  # (fp8 / int8 only)
  row_id: jax.Array | None = None  # [batch] int32 (stochastic rounding)
  step: jax.Array | None = None  # [batch] int32 tokens in the stored state

  @property
  def dtype(self):
    return self.state.dtype

  def replace(self, **kwargs) -> "StoredSSMState":
    return dataclasses.replace(self, **kwargs)


def baseline_storage_dtype(policy: P.PrecisionPolicy) -> str:
  """The dtype a baseline state is stored in under `policy`: the read copy's
  (the narrowest stored copy of the replay state) or else the master's."""
  return policy.read_dtype or policy.checkpoint_dtype


def store_baseline(state, policy: P.PrecisionPolicy, dtype, row_id, step,
                   layer):
  """f32 `state` [b, H, P, N] stored per `policy` in `dtype`: a plain array
  (float, round to nearest) or a StoredSSMState."""
  sr = policy.stochastic_rounding and jnp.dtype(dtype) != jnp.float32
  if jnp.dtype(dtype).name not in P.QUANTIZED_DTYPES and not sr:
    return state.astype(dtype)
  bits = None
  if sr:
    bits = P.random_bits(policy.seed, layer, row_id, step, state.shape[1:],
                         P.SITE_BASELINE, policy.sr_rng)
  stored, scale = P.store(state.astype(jnp.float32), dtype, bits)
  return StoredSSMState(state=stored, scale=scale,
                        row_id=row_id if sr else None,
                        step=step if sr else None)


def init_stored(shape, precision: P.PrecisionPolicy, row_ids):
  """An empty baseline state of `shape` stored per `precision` (a plain
  array in a float dtype rounded to nearest, else a StoredSSMState; with
  stochastic rounding, row_ids [batch] int32 and step 0)."""
  rn = precision.replace(stochastic_rounding=False) if (
      precision.stochastic_rounding) else precision
  # zeros store exactly: no random bits needed
  ssm = store_baseline(jnp.zeros(shape, jnp.float32), rn,
                       baseline_storage_dtype(precision), None, None, 0)
  if precision.stochastic_rounding:
    if not isinstance(ssm, StoredSSMState):
      ssm = StoredSSMState(state=ssm)
    ssm = ssm.replace(row_id=row_ids,
                      step=jnp.zeros((shape[0],), jnp.int32))
  return ssm


def step_stored(ssm: StoredSSMState, policy: P.PrecisionPolicy, layer,
                advance):
  """One decode step of a stored baseline state: loaded to f32, advanced
  by `advance` (f32 state -> (output, f32 state)), stored back per
  `policy` (stochastic rounding keyed by the step after the store) ->
  (output, StoredSSMState)."""
  step = None if ssm.step is None else ssm.step + 1
  out, new = advance(P.load(ssm.state, ssm.scale))
  return out, store_baseline(new, policy, ssm.dtype, ssm.row_id, step,
                             layer)


def baseline_after_prefill(final, ssm, policy: P.PrecisionPolicy | None,
                           steps, layer):
  """A prefill's final f32 state [b, ...] stored as the baseline `ssm`
  is: a plain array cast to its dtype, a StoredSSMState stored per
  `policy` (stochastic rounding keyed by `steps`, [b] tokens in the state,
  and its row ids)."""
  if isinstance(ssm, StoredSSMState):
    return store_baseline(final, policy, ssm.dtype, ssm.row_id,
                          steps if ssm.step is not None else None, layer)
  return final.astype(ssm.dtype)


def check_stored_implementation(implementation, policy) -> None:
  """A stored baseline state steps through the reference alone."""
  if implementation not in (None, "reference"):
    raise NotImplementedError(
        f"implementation {implementation!r} cannot run a baseline state "
        f"stored per precision {policy.name!r} (8-bit or stochastic "
        f"rounding): that step has a reference implementation only; pass "
        f"implementation=None or 'reference'.")


def full_ssm_state(ssm, A=None, where: str = "state"):
  """The current full SSM state of a recurrent layer's `ssm` leaf in
  float32, the state a continued prefill starts from: a replay state
  materialized (its checkpoint advanced over the buffered tokens; A: the
  Mamba layer's [H] decay rates, unused by Gated DeltaNet / KDA), a stored
  baseline state loaded (dequantized), a plain array converted. A replay
  state with a speculative window pending (from `verify`) is refused: its
  window is neither committed nor dropped."""
  if getattr(ssm, "pending_window", None) is not None:
    raise ValueError(
        f"{where} holds a speculative window pending (from verify); "
        f"commit it (models.commit) before continuing a prefill from it.")
  if isinstance(ssm, ReplayState):
    return materialize(ssm, A)
  if isinstance(ssm, gdn.GDNReplayState):
    return gdn.gdn_materialize(ssm)
  if isinstance(ssm, kda.KDAReplayState):
    return kda.kda_materialize(ssm)
  if isinstance(ssm, StoredSSMState):
    return P.load(ssm.state, ssm.scale)
  return ssm.astype(jnp.float32)


def tokens_after(ssm, lengths, resume: bool):
  """[batch] int32 tokens in a recurrent layer's state after a prefill of
  `lengths` tokens, the step keying the stochastic rounding of the state it
  stores: lengths from an empty row, or the state's own step counter (when
  it has one) plus lengths when the prefill continues `ssm`."""
  lengths = lengths.astype(jnp.int32)
  step = getattr(ssm, "step", None) if resume else None
  return lengths if step is None else step + lengths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaState:
  """Conv window + SSM state of one Mamba-2 layer (+ its static policy).

  `conv` is a ring buffer of the last conv_kernel - 1 inputs: row r's
  oldest sits in slot conv_start[r] (`conv.causal_conv1d_update_ring`), so
  a decode step writes one slot instead of shifting the window. Prefill
  and speculative commits lay it out oldest first (conv_start 0). With
  conv_start None the window is always oldest first and each step shifts
  it (`conv.causal_conv1d_update`).
  """
  conv: jax.Array  # [batch, conv_kernel - 1, conv_dim]
  ssm: Any  # ReplayState | jax.Array [batch, H, P, N] | StoredSSMState
  precision: P.PrecisionPolicy | None = dataclasses.field(
      default=None, metadata=dict(static=True))
  conv_start: jax.Array | None = None  # [batch] int32 (None: oldest first)

  def ordered_conv(self) -> jax.Array:
    """The conv inputs oldest first: [batch, conv_kernel - 1, conv_dim]."""
    if self.conv_start is None:
      return self.conv
    return conv_ring_ordered(self.conv, self.conv_start)

  def with_ordered_conv(self, conv) -> "MambaState":
    """This state with `conv` (oldest first) as its conv window."""
    start = (None if self.conv_start is None
             else jnp.zeros_like(self.conv_start))
    return self.replace(conv=conv, conv_start=start)

  @property
  def is_replay(self) -> bool:
    return isinstance(self.ssm, ReplayState)

  def replace(self, **kwargs) -> "MambaState":
    return dataclasses.replace(self, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GDNState:
  """Conv window + delta-rule state of one Gated DeltaNet layer.

  `conv` holds the last conv_kernel - 1 pre-conv inputs (q, k, v channels)
  oldest first; a decode step shifts it. `ssm` is the full recurrent state
  [batch, HV, K, V] (baseline, transformers' layout: o = S^T q) or a
  `replayssm_jax.gdn.GDNReplayState` (checkpoint + buffers of corrected
  updates, keys and log-decays, flushed every buffer_len steps), built and
  stepped under `precision` (static; None: no policy). A baseline state
  under a policy is stored every step as `baseline_storage_dtype` says
  (a plain array, or a StoredSSMState for 8-bit or stochastically rounded
  storage), as a Mamba-2 one.
  """
  conv: jax.Array  # [batch, conv_kernel - 1, gdn_conv_dim]
  ssm: Any  # GDNReplayState | [batch, HV, K, V] array | StoredSSMState
  precision: P.PrecisionPolicy | None = dataclasses.field(
      default=None, metadata=dict(static=True))

  def ordered_conv(self) -> jax.Array:
    """The conv inputs oldest first (as `MambaState.ordered_conv`)."""
    return self.conv

  def with_ordered_conv(self, conv) -> "GDNState":
    return self.replace(conv=conv)

  @property
  def is_replay(self) -> bool:
    return isinstance(self.ssm, (gdn.GDNReplayState, kda.KDAReplayState))

  def replace(self, **kwargs) -> "GDNState":
    return dataclasses.replace(self, **kwargs)


def init_gdn_state(cfg, batch: int, ssm_mode: str, buffer_len: int,
                   checkpoint_dtype, buffer_dtype, conv_dtype,
                   precision: P.PrecisionPolicy | None = None,
                   row_ids=None, kind: str = "gdn") -> GDNState:
  """An empty GDNState (zero state, empty buffer) of a Gated DeltaNet
  layer, or with kind "kda" of a Kimi Delta Attention layer (per-channel
  gates: `kda.init_kda_replay_state`); with `precision` laid out per the
  policy (row_ids: [batch] int32, stochastic rounding)."""
  conv = jnp.zeros((batch, cfg.conv_kernel - 1, cfg.gdn_conv_dim), conv_dtype)
  sizes = dict(num_v_heads=cfg.gdn_num_v_heads, key_dim=cfg.gdn_k_dim,
               value_dim=cfg.gdn_v_dim, buffer_len=buffer_len)
  if kind == "kda":
    init_replay = kda.init_kda_replay_state
  else:
    init_replay = gdn.init_gdn_replay_state
    sizes["num_k_heads"] = cfg.gdn_num_k_heads
  if row_ids is not None:  # a buffer of this layer's own (donated)
    row_ids = jnp.array(row_ids, jnp.int32, copy=True)
  shape = (batch, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim)
  if ssm_mode == "replay" and precision is None:
    ssm = init_replay(batch, checkpoint_dtype=checkpoint_dtype,
                      buffer_dtype=buffer_dtype, **sizes)
  elif ssm_mode == "replay":
    ssm = init_replay(batch, policy=precision, row_id=row_ids, **sizes)
  elif precision is None:
    ssm = jnp.zeros(shape, checkpoint_dtype)
  else:
    ssm = init_stored(shape, precision, row_ids)
  return GDNState(conv=conv, ssm=ssm, precision=precision)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionState:
  """KV cache of one attention layer with per-row lengths."""
  k: jax.Array  # [batch, num_kv_heads, max_len, attn_head_dim]
  v: jax.Array  # [batch, num_kv_heads, max_len, attn_head_dim]
  length: jax.Array  # [batch] int32

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def replace(self, **kwargs) -> "AttentionState":
    return dataclasses.replace(self, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelState:
  """Per-layer states in layer order + per-row positions."""
  layers: tuple  # MambaState | AttentionState | None per block
  positions: jax.Array  # [batch] int32

  @property
  def batch(self) -> int:
    return self.positions.shape[0]

  @property
  def ssm_mode(self) -> str | None:
    for s in self.layers:
      if isinstance(s, MambaState):
        return "replay" if isinstance(s.ssm, ReplayState) else "baseline"
      if isinstance(s, GDNState):
        return "replay" if s.is_replay else "baseline"
    return None

  @property
  def precision(self) -> P.PrecisionPolicy | None:
    """The PrecisionPolicy of the Mamba / Gated DeltaNet layers (None: none
    given)."""
    for s in self.layers:
      if isinstance(s, (MambaState, GDNState)):
        return s.precision
    return None

  @property
  def max_len(self) -> int | None:
    for s in self.layers:
      if isinstance(s, AttentionState):
        return s.max_len
    return None

  def replace(self, **kwargs) -> "ModelState":
    return dataclasses.replace(self, **kwargs)


def init_mamba_state(cfg, batch: int, ssm_mode: str, buffer_len: int,
                     checkpoint_dtype, buffer_dtype, conv_dtype,
                     precision: P.PrecisionPolicy | None = None,
                     row_ids=None) -> MambaState:
  """An empty MambaState; with `precision`, laid out per the policy (see
  the module docstring); row_ids: [batch] int32 (stochastic rounding)."""
  conv = jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), conv_dtype)
  shape = (batch, cfg.ssm_heads, cfg.head_dim, cfg.d_state)
  if row_ids is not None:  # a buffer of this layer's own (states are donated)
    row_ids = jnp.array(row_ids, jnp.int32, copy=True)
  if ssm_mode == "replay":
    if precision is None:
      ssm = ReplayState.create(batch, cfg.ssm_heads, cfg.head_dim,
                               cfg.d_state, cfg.bc_groups, buffer_len,
                               checkpoint_dtype=checkpoint_dtype,
                               buffer_dtype=buffer_dtype)
    else:
      ssm = ReplayState.create(batch, cfg.ssm_heads, cfg.head_dim,
                               cfg.d_state, cfg.bc_groups, buffer_len,
                               policy=precision, row_id=row_ids)
  elif precision is None:
    ssm = jnp.zeros(shape, checkpoint_dtype)
  else:
    ssm = init_stored(shape, precision, row_ids)
  return MambaState(conv=conv, ssm=ssm, precision=precision,
                    conv_start=jnp.zeros((batch,), jnp.int32))


KV_BLOCK = 64  # pallas_kernels.AttentionConfig.block_s's default


def kv_cache_len(entries: int) -> int:
  """KV-cache length for `entries` positions, rounded up to a multiple of
  KV_BLOCK. The decode attention kernel walks the cache in blocks that
  divide its length (and falls back to XLA's attention below 16-entry
  blocks); it reads only the entries each row sees, so the padding costs
  memory only. The decode loops allocate their caches with it, so that a
  length such as prompt + new tokens + window still runs the kernel."""
  return -(-entries // KV_BLOCK) * KV_BLOCK


def init_attention_state(cfg, batch: int, max_len: int,
                         kv_dtype) -> AttentionState:
  shape = (batch, cfg.num_kv_heads, max_len, cfg.attn_head_dim)
  return AttentionState(k=jnp.zeros(shape, kv_dtype),
                        v=jnp.zeros(shape, kv_dtype),
                        length=jnp.zeros((batch,), jnp.int32))
