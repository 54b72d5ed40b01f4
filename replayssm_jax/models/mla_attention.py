"""Multi-head latent attention (MLA) at the reference level: Kimi Linear's
full-attention layers ('*' blocks with `ModelConfig.mla_kv_lora_rank`).

  q = q_proj(h)                         [.., H, nope + rope]
  [c | k_rot] = kv_a_proj(h)            c [.., kv_lora_rank], k_rot [.., rope]
  [k_nope | v] = kv_b_proj(rmsnorm(c))  per head: nope, then v_head_dim
  k = [k_nope | k_rot]                  (k_rot shared by the heads)
  o = softmax(q k^T (nope + rope) ** -0.5) v   (causal; no RoPE: Kimi
                                                Linear's MLA is NoPE)
  y = o_proj(o)

The KV cache holds the decompressed keys and values ([batch, H, max_len,
attn_head_dim] with attn_head_dim = max(nope + rope, v_head_dim); the
shorter of q / k and v is zero-padded, which changes neither the scores nor
the outputs), so `attention_block.Attention`'s prefill, decode step and verify
window (and `ops.decode_attention`) run unchanged; the score scale is
`ModelConfig.attention_multiplier`. The latent norm's epsilon is 1e-6
(transformers' default, not the model's rms_norm_eps).
"""

from __future__ import annotations

import jax.numpy as jnp

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.attention_block import Attention
from replayssm_jax.models.layers import Linear, RMSNorm

LATENT_NORM_EPS = 1e-6


def _pad(x, width):
  """x [..., n] zero-padded to [..., width]."""
  extra = width - x.shape[-1]
  if extra == 0:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


class MLAttention(Attention):
  """`Attention` whose keys and values come from a low-rank latent."""

  def __init__(self, cfg: ModelConfig, *, rngs):  # pylint: disable=super-init-not-called
    self.cfg = cfg
    h, r = cfg.num_heads, cfg.mla_kv_lora_rank
    nope, rope, vd = (cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim,
                      cfg.mla_v_head_dim)
    self.q_proj = Linear(cfg.d_model, h * (nope + rope), cfg, rngs=rngs)
    self.kv_a_proj = Linear(cfg.d_model, r + rope, cfg, rngs=rngs)
    self.kv_a_norm = RMSNorm(r, cfg)
    self.kv_a_norm.eps = LATENT_NORM_EPS
    self.kv_b_proj = Linear(r, h * (nope + vd), cfg, rngs=rngs)
    self.o_proj = Linear(h * vd, cfg.d_model, cfg, rngs=rngs)

  def _project(self, h, positions):
    """h [.., T, d] -> (q [.., T, H, D], k, v [.., H, T, D], None), D =
    attn_head_dim (zero-padded)."""
    del positions  # no positional encoding
    c = self.cfg
    lead = h.shape[:-1]
    nh, r, D = c.num_heads, c.mla_kv_lora_rank, c.attn_head_dim
    nope, rope = c.mla_qk_nope_head_dim, c.mla_qk_rope_head_dim
    q = self.q_proj(h).reshape(lead + (nh, nope + rope))
    ckv = self.kv_a_proj(h)
    lat, k_rot = self.kv_a_norm(ckv[..., :r]), ckv[..., r:]
    kv = self.kv_b_proj(lat).reshape(lead + (nh, -1))
    k_rot = jnp.broadcast_to(k_rot[..., None, :].astype(kv.dtype),
                             lead + (nh, rope))
    k = jnp.concatenate([kv[..., :nope], k_rot], axis=-1)
    v = kv[..., nope:]
    q, k, v = (_pad(x, D) for x in (q, k, v))
    return q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), None

  def _output(self, o, ctx):
    """o [.., H * D] -> the first v_head_dim channels of each head ->
    o_proj."""
    del ctx
    c = self.cfg
    o = o.reshape(o.shape[:-1] + (c.num_heads, c.attn_head_dim))
    o = o[..., :c.mla_v_head_dim]
    return self.o_proj(o.reshape(o.shape[:-2] + (-1,)))
