"""Decode-state pytrees of the hybrid LM (frozen registered dataclasses).

The modules hold parameters only; these states are passed in and returned.

  MambaState      conv: [batch, conv_kernel - 1, conv_dim] rolling conv input
                  ssm:  ReplayState (ssm_mode="replay") or
                        [batch, H, P, N] array (ssm_mode="baseline")
  AttentionState  k, v: [batch, max_len, num_kv_heads, attn_head_dim]
                  length: [batch] int32, valid cache entries per row
  MLP blocks      None (stateless)
  ModelState      layers: tuple in layer order; positions: [batch] int32,
                  tokens processed per row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from replayssm_jax.state import ReplayState

SSM_MODES = ("replay", "baseline")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaState:
  """Conv window + SSM state of one Mamba-2 layer."""
  conv: jax.Array  # [batch, conv_kernel - 1, conv_dim]
  ssm: Any  # ReplayState | jax.Array [batch, H, P, N]

  def replace(self, **kwargs) -> "MambaState":
    return dataclasses.replace(self, **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionState:
  """KV cache of one attention layer with per-row lengths."""
  k: jax.Array  # [batch, max_len, num_kv_heads, attn_head_dim]
  v: jax.Array  # [batch, max_len, num_kv_heads, attn_head_dim]
  length: jax.Array  # [batch] int32

  @property
  def max_len(self) -> int:
    return self.k.shape[1]

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
                     checkpoint_dtype, buffer_dtype, conv_dtype) -> MambaState:
  conv = jnp.zeros((batch, cfg.conv_kernel - 1, cfg.conv_dim), conv_dtype)
  if ssm_mode == "replay":
    ssm = ReplayState.create(batch, cfg.ssm_heads, cfg.head_dim, cfg.d_state,
                             cfg.n_groups, buffer_len,
                             checkpoint_dtype=checkpoint_dtype,
                             buffer_dtype=buffer_dtype)
  else:
    ssm = jnp.zeros((batch, cfg.ssm_heads, cfg.head_dim, cfg.d_state),
                    checkpoint_dtype)
  return MambaState(conv=conv, ssm=ssm)


def init_attention_state(cfg, batch: int, max_len: int,
                         kv_dtype) -> AttentionState:
  shape = (batch, max_len, cfg.num_kv_heads, cfg.attn_head_dim)
  return AttentionState(k=jnp.zeros(shape, kv_dtype),
                        v=jnp.zeros(shape, kv_dtype),
                        length=jnp.zeros((batch,), jnp.int32))
