"""Qwen3.5 / Qwen3-Next's gated full attention ('*' blocks with
`ModelConfig.attn_qk_norm` / `attn_output_gate`).

  [q; gate] = q_proj(h)   per head: attn_head_dim query channels, then
                          attn_head_dim gate channels (transformers' layout)
  q = q_norm(q), k = k_norm(k_proj(h))   (RMSNorm over each head's
                                         attn_head_dim channels)
  q, k = RoPE on the first rotary_dim dims of each head (partial rotary)
  o = softmax(q k^T / sqrt(attn_head_dim)) v     (causal, grouped KV heads)
  y = o_proj(o * sigmoid(gate))

The KV cache, prefill, decode step and verify window are
`attention_block.Attention`'s; the gate travels from `_project` to `_output`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.attention_block import Attention, _partial_rope
from replayssm_jax.models.layers import Linear, RMSNorm

F32 = jnp.float32


class GatedAttention(Attention):
  """`Attention` with q/k head norms and a sigmoid output gate."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    super().__init__(cfg, rngs=rngs)
    hd = cfg.attn_head_dim
    if cfg.attn_output_gate:  # [query; gate] per head
      self.q_proj = Linear(cfg.d_model, 2 * cfg.num_heads * hd, cfg,
                           rngs=rngs)
    if cfg.attn_qk_norm:
      self.q_norm = RMSNorm(hd, cfg)
      self.k_norm = RMSNorm(hd, cfg)

  def _project(self, h, positions):
    """h [.., T, d] -> (q [.., T, Hq, D], k, v [.., Hk, T, D], gate
    [.., T, Hq * D] or None)."""
    c = self.cfg
    lead = h.shape[:-1]
    hd = c.attn_head_dim
    q = self.q_proj(h)
    gate = None
    if c.attn_output_gate:
      qg = q.reshape(lead + (c.num_heads, 2 * hd))
      q, gate = qg[..., :hd], qg[..., hd:].reshape(lead + (-1,))
    q = q.reshape(lead + (c.num_heads, hd))
    k = self.k_proj(h).reshape(lead + (c.num_kv_heads, hd))
    v = self.v_proj(h).reshape(lead + (c.num_kv_heads, hd))
    if c.attn_qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    if c.rope_theta is not None:
      q = _partial_rope(q, positions, c.rope_theta, c.rotary_dim)
      k = _partial_rope(k, positions, c.rope_theta, c.rotary_dim)
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), gate

  def _output(self, o, ctx):
    """o [.., num_heads * attn_head_dim] times sigmoid(gate) (ctx), then
    o_proj."""
    if ctx is not None:
      o = (o.astype(F32) * jax.nn.sigmoid(ctx.reshape(o.shape).astype(F32))
           ).astype(self.cfg.jnp_dtype)
    return self.o_proj(o)
