"""The Gated DeltaNet mixer ('G' in the layer pattern): Qwen3.5 / Qwen3-Next's
linear-attention layer.

  [qkv | z | b | a] = in_proj(h)   qkv [.., 2 HK K + HV V] (q, k, v channels),
                                   z [.., HV V], b, a [.., HV]
  q, k, v = split(silu(causal_conv(qkv)))      (depthwise, no bias)
  g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)   (float32)
  o = delta rule (q, k L2-normalised, q scaled by K ** -0.5;
      `replayssm_jax.gdn`)                                 [.., HV, V]
  y = out_proj(weight * rmsnorm(o) * silu(z))   (per value head, float32)

The delta-rule ops come from `replayssm_jax.gdn`: `gdn_chunked_prefill`
(prefill; padded positions leave the state unchanged), `gdn_step` (baseline
decode: the full [batch, HV, K, V] state), `gdn_replay_step` (replay decode:
checkpoint + buffers), and the speculative window ops `gdn_replay_verify` /
`gdn_baseline_verify` (committed by `models.verify_commit`).

in_proj is one matmul: transformers' in_proj_qkv / in_proj_z / in_proj_b /
in_proj_a (Qwen3.5) or, rows regrouped, in_proj_qkvz / in_proj_ba
(Qwen3-Next) are fused into it when loaded (`hf_qwen.pack_tensors`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import gdn
from replayssm_jax import slots
from replayssm_jax.conv import (causal_conv1d, causal_conv1d_update,
                                conv_state_after)
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.layers import Linear, _normal
from replayssm_jax.models.states import (GDNState, StoredSSMState,
                                         baseline_after_prefill,
                                         check_stored_implementation,
                                         full_ssm_state, step_stored,
                                         tokens_after)
from replayssm_jax.ssd import scan_precision

F32 = jnp.float32


class DeltaRuleMixer(nnx.Module):
  """What the delta-rule mixers (`GDNMixer`, `kda_block.KDAMixer`) share:
  the conv output's split into q, k, v, the gated per-head RMSNorm with
  out_proj, and the prefill around the chunked rule. A subclass defines
  `_project` (h -> pre-conv qkv, output gate, g, beta), `_scan` (the
  chunked rule), `_replay_from` (its replay state's constructor, as
  `gdn.gdn_replay_state_from`) with `_replay_kw` (its extra arguments)
  and `GATE` (the output gate's activation), `STATE_NAME` (for errors)."""

  GATE = staticmethod(jax.nn.silu)
  STATE_NAME = "the delta-rule state"

  def _split(self, x):
    """Conv output [.., conv_dim] -> q, k [.., HK, K], v [.., HV, V]."""
    c = self.cfg
    lead = x.shape[:-1]
    kd = c.gdn_key_dim
    return (x[..., :kd].reshape(lead + (c.gdn_num_k_heads, c.gdn_k_dim)),
            x[..., kd:2 * kd].reshape(lead + (c.gdn_num_k_heads, c.gdn_k_dim)),
            x[..., 2 * kd:].reshape(lead + (c.gdn_num_v_heads, c.gdn_v_dim)))

  def _out(self, o, gate):
    """Gated RMSNorm over each value head (normalise, weight, times
    GATE(gate); float32), then out_proj: o, gate [.., HV, V] -> [.., d]."""
    of = o.astype(F32)
    of = of * jax.lax.rsqrt(jnp.mean(of * of, -1, keepdims=True) + self.eps)
    y = (self.norm_weight[...].astype(F32) * of
         * self.GATE(gate.astype(F32))).astype(self.cfg.jnp_dtype)
    return self.out_proj(y.reshape(y.shape[:-2] + (-1,)))

  def prefill(self, h, lengths, state: GDNState | None, layer: int = 0,
              resume: bool = False):
    """The right-padded prompt h [b, T, d] (positions >= lengths are
    padding: they leave the state unchanged) -> (y [b, T, d], state); the
    replay state stored per state.precision (`layer`: the recurrent-block
    index keying stochastic rounding).

    resume False: every row starts empty (`state` only fixes the layout).
    resume True: each row continues `state` (its conv window precedes the
    chunk, its delta-rule state, materialized, is the chunked prefill's
    initial state; the rounding step counts on from the state's own), as
    `Mamba2Mixer.prefill`."""
    c = self.cfg
    bsz, t, _ = h.shape
    qkv, gate, g, beta = self._project(h)
    hist = state.conv if resume else None  # the window before the chunk
    x, _ = causal_conv1d(qkv, self.conv_weight[...], None,
                         initial_state=hist, activation="silu")
    q, k, v = self._split(x)
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [b, T]
    s0 = (full_ssm_state(state.ssm, where=self.STATE_NAME)
          if resume else None)
    o, final = self._scan(q, k, v, g, beta, s0, valid)
    out = self._out(o, gate)
    if state is None:
      return out, None
    # Conv state: the k-1 inputs before each row's end.
    if hist is None:  # an empty row: zeros before t=0
      hist = jnp.zeros((bsz, c.conv_kernel - 1, qkv.shape[-1]),
                       state.conv.dtype)
    conv = conv_state_after(qkv, lengths, hist, state.conv.dtype)
    policy = state.precision
    if not state.is_replay:
      ssm = baseline_after_prefill(
          final, state.ssm, policy, tokens_after(state.ssm, lengths, resume),
          layer)
      return out, state.replace(conv=conv, ssm=ssm)
    r = state.ssm
    if policy is None:
      ssm = self._replay_from(final, r.buffer_len,
                              checkpoint_dtype=r.checkpoint.dtype,
                              buffer_dtype=r.d_buf.dtype,
                              **self._replay_kw(r))
    else:  # master (and read copy) stored per the policy
      sr = policy.stochastic_rounding
      ssm = self._replay_from(
          final, r.buffer_len, policy=policy,
          row_id=r.row_id if sr else None,
          step=tokens_after(r, lengths, resume) if sr else None,
          layer=layer, **self._replay_kw(r))
    return out, state.replace(conv=conv, ssm=ssm)

  def _baseline_step(self, op, state: GDNState, args, layer, rows,
                     implementation):
    """The baseline op `op` (`gdn.gdn_step`, `kda.kda_step`) of one token
    on state.ssm with args (q, k, v, g, beta) -> (o, ssm): a plain array
    through the op's dispatcher (rows: its slots); a StoredSSMState
    (reference only) loaded, stepped in float32 and stored back per
    state.precision with `layer` (`states.step_stored`), its `rows`
    gathered and scattered back."""
    kw = {} if rows is None else dict(rows=rows)
    if not isinstance(state.ssm, StoredSSMState):
      return op(state.ssm, *args, implementation=implementation, **kw)
    check_stored_implementation(implementation, state.precision)

    def step(ssm):
      return step_stored(ssm, state.precision, layer,
                         lambda s: op(s, *args, implementation="reference"))
    return step(state.ssm) if rows is None else slots.on_rows(
        step, state.ssm, rows)


class GDNMixer(DeltaRuleMixer):
  """Gated DeltaNet: projections -> conv + SiLU -> delta rule -> gated
  per-head RMSNorm -> out_proj."""

  STATE_NAME = "the Gated DeltaNet state"
  _replay_from = staticmethod(gdn.gdn_replay_state_from)

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.cfg = cfg
    d, hv = cfg.d_model, cfg.gdn_num_v_heads
    self.eps = float(cfg.norm_eps)
    self.in_proj = Linear(d, cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * hv,
                          cfg, rngs=rngs)  # [qkv | z | b | a]
    k = cfg.conv_kernel
    self.conv_weight = nnx.Param(_normal(rngs, (cfg.gdn_conv_dim, k),
                                         k ** -0.5, cfg.jnp_param_dtype))
    # A_log and dt_bias in float32 whatever param_dtype (the gates are
    # computed in float32, as transformers does).
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(
        rngs.params(), (hv,), F32, 1.0, 16.0)))
    self.dt_bias = nnx.Param(_normal(rngs, (hv,), 0.5, F32))
    self.norm_weight = nnx.Param(jnp.ones((cfg.gdn_v_dim,),
                                          cfg.jnp_param_dtype))  # [V]
    self.out_proj = Linear(cfg.gdn_value_dim, d, cfg, rngs=rngs)

  # ------------------------------------------------------------ pieces
  def _project(self, h):
    """h [.., d] -> (pre-conv qkv [.., conv_dim], z [.., HV, V], g, beta
    [.., HV] float32)."""
    c = self.cfg
    lead = h.shape[:-1]
    x = self.in_proj(h)
    cd, vd, hv = c.gdn_conv_dim, c.gdn_value_dim, c.gdn_num_v_heads
    z = x[..., cd:cd + vd].reshape(lead + (hv, c.gdn_v_dim))
    b, a = x[..., cd + vd:cd + vd + hv], x[..., cd + vd + hv:]
    g, beta = gdn.gdn_gates(a, b, self.A_log[...], self.dt_bias[...])
    return x[..., :cd], z, g, beta

  def _scan(self, q, k, v, g, beta, s0, valid):
    return gdn.gdn_chunked_prefill(
        q, k, v, g, beta, chunk_size=self.cfg.gdn_chunk_size,
        initial_state=s0, valid=valid,
        precision=scan_precision(self.cfg.scan_precision),
        solve=self.cfg.gdn_solve)

  def _replay_kw(self, r):
    del r
    return dict(num_k_heads=self.cfg.gdn_num_k_heads)

  def step(self, h, state: GDNState, implementation: str | None = None,
           layer: int = 0, rows=None):
    """One token per row: h [b, d] -> (y [b, d], state); `implementation`
    goes to the delta-rule op's dispatcher; replay states step under
    state.precision with `layer` (keys stochastic rounding). rows: [b]
    effective slots (`replayssm_jax.slots`) of a state with any number of
    rows: the delta-rule op steps them in place, the (small) conv windows
    are gathered and scattered back."""
    with jax.named_scope("in_proj"):  # scopes name the ops in profiles
      qkv, z, g, beta = self._project(h)
    with jax.named_scope("conv"):
      window = state.conv if rows is None else slots.gather(state.conv, rows)
      x, conv = causal_conv1d_update(qkv, window, self.conv_weight[...],
                                     None, activation="silu")
      if rows is not None:
        conv = slots.scatter(state.conv, conv, rows)
    q, k, v = self._split(x)
    with jax.named_scope("ssm"):
      if state.is_replay:
        o, ssm = gdn.gdn_replay_step(state.ssm, q, k, v, g, beta,
                                     policy=state.precision, layer=layer,
                                     rows=rows,
                                     implementation=implementation)
      else:
        o, ssm = self._baseline_step(gdn.gdn_step, state, (q, k, v, g, beta),
                                     layer, rows, implementation)
    with jax.named_scope("out_proj"):  # the gated norm and the projection
      y = self._out(o, z)
    return y, state.replace(conv=conv, ssm=ssm)

  def verify(self, h, state: GDNState, implementation: str | None = None,
             layer: int = 0):
    """A window of T tokens per row from the committed state.

    Returns (y [b, T, d], (ssm, window_conv_inputs, snapshots)) as
    `Mamba2Mixer.verify`: ssm the replay state with the window pending
    (`gdn_replay_verify`) or, baseline, the committed state unchanged;
    window_conv_inputs [b, T, conv_dim] the window's pre-conv inputs in the
    conv-state dtype; snapshots [b, T, HV, K, V] (baseline,
    `gdn_baseline_verify`) or None. `implementation` goes to the window
    op's dispatcher; a replay window runs under state.precision with
    `layer`.
    """
    qkv, z, g, beta = self._project(h)
    x, _ = causal_conv1d(qkv, self.conv_weight[...], None,
                         initial_state=state.conv.astype(qkv.dtype),
                         activation="silu")
    q, k, v = self._split(x)
    if state.is_replay:
      o, ssm = gdn.gdn_replay_verify(state.ssm, q, k, v, g, beta,
                                     policy=state.precision, layer=layer,
                                     implementation=implementation)
      snapshots = None
    else:
      o, snapshots = gdn.gdn_baseline_verify(state.ssm, q, k, v, g, beta,
                                             implementation=implementation)
      ssm = state.ssm
    return self._out(o, z), (ssm, qkv.astype(state.conv.dtype), snapshots)
