"""Qwen3.5 / Qwen3-Next's gated full attention ('*' blocks with
`ModelConfig.attn_qk_norm` / `attn_output_gate`).

  q = q_norm(q_proj(h)), k = k_norm(k_proj(h))   (RMSNorm over each head's
                                                 attn_head_dim channels)
  q, k = RoPE on the first rotary_dim dims of each head (partial rotary)
  o = softmax(q k^T / sqrt(attn_head_dim)) v     (causal, grouped KV heads)
  y = o_proj(o * sigmoid(gate_proj(h)))

transformers' q_proj yields [query; gate] per head (2 * attn_head_dim rows
per head); the loader splits it into q_proj and gate_proj
(`hf_qwen.pack_tensors`). The KV cache, prefill, decode step and verify
window are `layers.Attention`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.layers import (Attention, Linear, RMSNorm,
                                         _partial_rope)

F32 = jnp.float32


class GatedAttention(Attention):
  """`Attention` with q/k head norms and a sigmoid output gate."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    super().__init__(cfg, rngs=rngs)
    hd = cfg.attn_head_dim
    if cfg.attn_output_gate:
      self.gate_proj = Linear(cfg.d_model, cfg.num_heads * hd, cfg,
                              rngs=rngs)
    if cfg.attn_qk_norm:
      self.q_norm = RMSNorm(hd, cfg)
      self.k_norm = RMSNorm(hd, cfg)

  def _qkv(self, h, positions):
    c = self.cfg
    lead = h.shape[:-1]
    q = self.q_proj(h).reshape(lead + (c.num_heads, c.attn_head_dim))
    k = self.k_proj(h).reshape(lead + (c.num_kv_heads, c.attn_head_dim))
    v = self.v_proj(h).reshape(lead + (c.num_kv_heads, c.attn_head_dim))
    if c.attn_qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if c.rope_theta is not None:
      q = _partial_rope(q, positions, c.rope_theta, c.rotary_dim)
      k = _partial_rope(k, positions, c.rope_theta, c.rotary_dim)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

  def _output(self, o, h):
    """o [.., num_heads * attn_head_dim] of the normed input h [.., d]."""
    if self.cfg.attn_output_gate:
      o = (o.astype(F32) * jax.nn.sigmoid(self.gate_proj(h).astype(F32))
           ).astype(self.cfg.jnp_dtype)
    return self.o_proj(o)
