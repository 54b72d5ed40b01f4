"""The Kimi Delta Attention mixer ('K' in the layer pattern): Kimi Linear's
linear-attention layer, built as `gdn_block.GDNMixer` with a per-channel
gate.

  [qkv | f_lo | g_lo | b] = in_proj(h)  qkv [.., 2 HK K + HV V] (q, k, v
                                        channels), f_lo [.., K], g_lo
                                        [.., V], b [.., HV]
  q, k, v = split(silu(causal_conv(qkv)))      (depthwise, no bias)
  g = -exp(A_log) * softplus(f_b_proj(f_lo) + dt_bias)   [.., HV, K] f32
  beta = sigmoid(b)
  o = KDA delta rule (q, k L2-normalised, q scaled by K ** -0.5;
      `replayssm_jax.kda`)                                 [.., HV, V]
  y = out_proj(weight * rmsnorm(o) * sigmoid(g_b_proj(g_lo)))  (per value
      head, float32)

in_proj fuses transformers' q_proj, k_proj, v_proj, f_a_proj, g_a_proj and
b_proj (`hf_kimi.pack_tensors`). The decode state is a `states.GDNState`
whose ssm is a [batch, HV, K, V] array (baseline) or a
`kda.KDAReplayState` (replay: pre-decayed keys under the gate bound
`kda.safe_gate_lower_bound(buffer_len)`; Kimi Linear's gate is unbounded
below, and a token below the bound flushes its row early, exactly).
Speculative verify windows run from either state: a baseline one keeps a
state snapshot per window position (`kda.kda_baseline_verify`), a replay
one writes the window behind its history (`kda.kda_replay_verify`) and
hands a `kda.KDAWindow` to commit (a counter move, or a refold where an
accepted token's gate left the bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import kda
from replayssm_jax.conv import causal_conv1d, causal_conv1d_update
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.gdn_block import DeltaRuleMixer
from replayssm_jax.models.layers import Linear, _normal
from replayssm_jax.models.states import GDNState

F32 = jnp.float32


class KDAMixer(DeltaRuleMixer):
  """Kimi Delta Attention: projections -> conv + SiLU -> KDA rule -> gated
  (sigmoid) per-head RMSNorm -> out_proj."""

  GATE = staticmethod(jax.nn.sigmoid)
  STATE_NAME = "the KDA state"
  _replay_from = staticmethod(kda.kda_replay_state_from)

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.cfg = cfg
    d, hv, K, Vd = (cfg.d_model, cfg.gdn_num_v_heads, cfg.gdn_k_dim,
                    cfg.gdn_v_dim)
    self.eps = float(cfg.norm_eps)
    self.in_proj = Linear(d, cfg.gdn_conv_dim + K + Vd + hv, cfg,
                          rngs=rngs)  # [qkv | f_lo | g_lo | b]
    self.f_b_proj = Linear(K, hv * K, cfg, rngs=rngs)
    self.g_b_proj = Linear(Vd, hv * Vd, cfg, rngs=rngs)
    k = cfg.conv_kernel
    self.conv_weight = nnx.Param(_normal(rngs, (cfg.gdn_conv_dim, k),
                                         k ** -0.5, cfg.jnp_param_dtype))
    # A_log and dt_bias in float32 whatever param_dtype (the gate is
    # computed in float32, as transformers does).
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(
        rngs.params(), (hv,), F32, 1.0, 16.0)))
    self.dt_bias = nnx.Param(_normal(rngs, (hv, K), 0.5, F32))
    self.norm_weight = nnx.Param(jnp.ones((Vd,), cfg.jnp_param_dtype))
    self.out_proj = Linear(cfg.gdn_value_dim, d, cfg, rngs=rngs)

  def _project(self, h):
    """h [.., d] -> (pre-conv qkv [.., conv_dim], output gate [.., HV, V],
    g [.., HV, K], beta [.., HV] float32)."""
    c = self.cfg
    lead = h.shape[:-1]
    x = self.in_proj(h)
    cd, K, Vd, hv = c.gdn_conv_dim, c.gdn_k_dim, c.gdn_v_dim, c.gdn_num_v_heads
    f = self.f_b_proj(x[..., cd:cd + K]).reshape(lead + (hv, K))
    gate = self.g_b_proj(x[..., cd + K:cd + K + Vd]).reshape(lead + (hv, Vd))
    g, beta = kda.kda_gates(f, x[..., cd + K + Vd:], self.A_log[...],
                            self.dt_bias[...])
    return x[..., :cd], gate, g, beta

  def _scan(self, q, k, v, g, beta, s0, valid):
    return kda.kda_chunked_prefill(q, k, v, g, beta,
                                   chunk_size=self.cfg.gdn_chunk_size,
                                   initial_state=s0, valid=valid,
                                   solve=self.cfg.gdn_solve)

  def _replay_kw(self, r):
    return dict(gate_lower_bound=r.gate_lower_bound)

  def step(self, h, state: GDNState, implementation: str | None = None,
           layer: int = 0):
    """One token per row: h [b, d] -> (y [b, d], state)."""
    qkv, gate, g, beta = self._project(h)
    x, conv = causal_conv1d_update(qkv, state.conv, self.conv_weight[...],
                                   None, activation="silu")
    q, k, v = self._split(x)
    if state.is_replay:
      o, ssm = kda.kda_replay_step(state.ssm, q, k, v, g, beta,
                                   policy=state.precision, layer=layer,
                                   implementation=implementation)
    else:
      o, ssm = self._baseline_step(kda.kda_step, state, (q, k, v, g, beta),
                                   layer, None, implementation)
    return self._out(o, gate), state.replace(conv=conv, ssm=ssm)

  def verify(self, h, state: GDNState, implementation: str | None = None,
             layer: int = 0):
    """A window of T tokens per row from the committed state ->
    (y [b, T, d], (ssm, window_conv_inputs, window data)) as
    `GDNMixer.verify`: replay, the state with the window written and its
    `kda.KDAWindow` (`kda.kda_replay_verify` under state.precision with
    `layer`); baseline, the committed state and one state snapshot per
    position (`kda.kda_baseline_verify`)."""
    qkv, gate, g, beta = self._project(h)
    x, _ = causal_conv1d(qkv, self.conv_weight[...], None,
                         initial_state=state.conv.astype(qkv.dtype),
                         activation="silu")
    q, k, v = self._split(x)
    if state.is_replay:
      o, ssm, data = kda.kda_replay_verify(state.ssm, q, k, v, g, beta,
                                           policy=state.precision,
                                           layer=layer,
                                           implementation=implementation)
    else:
      o, data = kda.kda_baseline_verify(state.ssm, q, k, v, g, beta,
                                        implementation=implementation)
      ssm = state.ssm
    return self._out(o, gate), (ssm, qkv.astype(state.conv.dtype), data)
