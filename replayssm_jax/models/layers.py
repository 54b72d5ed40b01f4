"""Flax NNX blocks of the hybrid LM: parameters only, state passed in/out.

Every mixer has two entry points:
  prefill(h [b, T, d], lengths [b], state) -> (y [b, T, d], new_state)
      the whole right-padded prompt (positions t >= lengths[r] are padding:
      they never touch the state); `state` None: no decode state is built.
      With resume=True the prompt continues each row of `state` (a chunked
      prefill: `models.chunked_prefill`).
  step(h [b, d], state) -> (y [b, d], new_state)
      one decode token per row.
  verify(h [b, T, d], state) -> (y [b, T, d], pending)
      a speculative window of T tokens per row, in one parallel pass from
      the committed state (see replayssm_jax.models.speculative).
`models.blocks.Block` (pre-norm residual) wraps a mixer. Linear kernels are
stored [in, out]; matmuls run in `config.dtype`, norms/softmax in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import ops
from replayssm_jax import slots
from replayssm_jax.conv import (causal_conv1d, causal_conv1d_update,
                                conv_state_after)
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.states import (GDNState, MambaState,
                                         StoredSSMState,
                                         baseline_after_prefill,
                                         check_stored_implementation,
                                         full_ssm_state, tokens_after)
from replayssm_jax.norm import rms_norm
from replayssm_jax.reference import process_dt
from replayssm_jax.speculative import baseline_verify, replay_verify
from replayssm_jax.ssd import scan_precision, ssd_chunked_scan
from replayssm_jax.state import ReplayState

F32 = jnp.float32


def _normal(rngs, shape, std, dtype):
  return (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ kernel (no bias: none of the supported checkpoints has one)."""

  def __init__(self, d_in: int, d_out: int, cfg: ModelConfig, *, rngs):
    self.dtype = cfg.jnp_dtype
    self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), d_in ** -0.5,
                                    cfg.jnp_param_dtype))  # [in, out]

  def __call__(self, x):
    return jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


class Embedding(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs):
    self.dtype = cfg.jnp_dtype
    self.multiplier = float(cfg.embedding_multiplier)
    self.weight = nnx.Param(_normal(rngs, (cfg.vocab_size, cfg.d_model), 1.0,
                                    cfg.jnp_param_dtype))  # [vocab, d]

  def __call__(self, tokens):
    x = jnp.take(self.weight[...], tokens, axis=0).astype(self.dtype)
    if self.multiplier != 1.0:  # config.embedding_multiplier
      x = x * jnp.asarray(self.multiplier, self.dtype)
    return x

  def attend(self, h):
    """Tied LM head: h [..., d] -> logits [..., vocab] float32."""
    return jnp.dot(h.astype(self.dtype),
                   self.weight[...].astype(self.dtype).T).astype(F32)


class RMSNorm(nnx.Module):
  """weight * x / rms(x), computed in float32, returned in config.dtype."""

  def __init__(self, dim: int, cfg: ModelConfig):
    self.eps = float(cfg.norm_eps)
    self.dtype = cfg.jnp_dtype
    self.weight = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype))

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps, self.dtype)


class GatedRMSNorm(nnx.Module):
  """norm(y * silu(z)) over groups of `group_size` channels (Mamba-2)."""

  def __init__(self, dim: int, group_size: int, cfg: ModelConfig):
    self.eps = float(cfg.norm_eps)
    self.dtype = cfg.jnp_dtype
    self.group_size = group_size
    self.weight = nnx.Param(jnp.ones((dim,), cfg.jnp_param_dtype))

  def __call__(self, y, z, z_offset: int = 0,
               implementation: str | None = "reference"):
    """y [..., dim], the gate in z's columns z_offset ..; through
    `ops.gated_rms_norm` (the decode step passes its `implementation`)."""
    return ops.gated_rms_norm(y, z, self.weight[...],
                              group_size=self.group_size, eps=self.eps,
                              z_offset=z_offset, out_dtype=self.dtype,
                              implementation=implementation)


def check_speculative_precision(state: MambaState | GDNState,
                                what: str) -> None:
  """The speculative verify/commit path takes every precision policy of a
  replay state; a baseline state only without a policy or with a plain one
  (its snapshots are not stored per policy)."""
  policy = state.precision
  if policy is not None and not policy.plain and not state.is_replay:
    raise ValueError(
        f"{what}: precision {policy.name!r} (an 8-bit store or stochastic "
        f"rounding) of a baseline state is not supported by the speculative "
        f"verify/commit path (replay states take every policy); use "
        f"ssm_mode='replay', init_state(precision=None) or a plain policy "
        f"(read_dtype=None, stochastic_rounding=False, e.g. "
        f"PrecisionPolicy.preset('bf16')).")


# --------------------------------------------------------------- Mamba-2
def _join_blocks(v, t: int, bounds):
  """v [..., t w] as t blocks: per bounds (a, b) (b None: the end), the
  columns a:b of every block joined (a reshape local to each block)."""
  blk = v.reshape(v.shape[:-1] + (t, v.shape[-1] // t))
  return tuple(blk[..., a:b].reshape(v.shape[:-1] + (-1,))
               for a, b in zip(bounds[:-1], bounds[1:]))


class Mamba2Mixer(nnx.Module):
  """HF Mamba2 / Nemotron-H mixer: in_proj -> [z, xBC, dt] -> conv+silu ->
  SSM (replayssm_jax ops) -> gated grouped RMSNorm -> out_proj."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.cfg = cfg
    h, k = cfg.ssm_heads, cfg.conv_kernel
    pdt = cfg.jnp_param_dtype
    self.in_proj = Linear(cfg.d_model, cfg.in_proj_dim, cfg, rngs=rngs)
    self.conv_weight = nnx.Param(_normal(rngs, (cfg.conv_dim, k), k ** -0.5,
                                         pdt))  # [conv_dim, k]
    self.conv_bias = nnx.Param(_normal(rngs, (cfg.conv_dim,), 0.1, pdt))
    # A_log, D, dt_bias in float32 whatever param_dtype (as Hugging Face's
    # Mamba2 keeps them): the SSM ops take them in float32, and a decode
    # loop would otherwise convert them every step, three tiny kernels per
    # layer that XLA does not hoist out of the loop.
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(
        rngs.params(), (h,), F32, 1.0, 16.0)))  # [H]
    self.D = nnx.Param(1.0 + _normal(rngs, (h,), 0.1, F32))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (h,), F32,
                                    math.log(1e-3), math.log(0.1)))
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
    self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.n_groups, cfg)
    self.out_proj = Linear(cfg.d_inner, cfg.d_model, cfg, rngs=rngs)

  def _split(self, zxbcdt):
    """in_proj output -> z [..., d_inner], the conv input xbc [...,
    conv_dim] (in the conv's channel layout) and dt [..., H]."""
    c = self.cfg
    t = c.mamba_shards
    if t == 1:
      z = zxbcdt[..., :c.d_inner]
      xbc = zxbcdt[..., c.d_inner:c.d_inner + c.conv_dim]
      dt = zxbcdt[..., c.d_inner + c.conv_dim:]
      return z, xbc, dt
    # Shard-major blocks [z_i | x_i B_i C_i | dt_i] (config.mamba_shards).
    zl, cl = c.d_inner // t, c.conv_dim // t
    return _join_blocks(zxbcdt, t, (0, zl, zl + cl, None))

  def _split_xbc(self, xbc):
    """[..., conv_dim] -> x [..., H, P], B, C [..., G', N] (G' =
    config.bc_groups)."""
    t = self.cfg.mamba_shards
    d, gn, _ = (v // t for v in self._xbc_split())
    return self._to_heads(*_join_blocks(xbc, t, (0, d, d + gn, None)))

  def _xbc_split(self) -> tuple[int, int, int]:
    """Channel counts of the conv output's x, B and C pieces."""
    gn = self.cfg.bc_groups * self.cfg.d_state
    return (self.cfg.d_inner, gn, gn)

  def _to_heads(self, x, b, cc):
    """x, B, C pieces [..., n] -> x [..., H, P], B, C [..., G', N]."""
    c = self.cfg
    lead = x.shape[:-1]
    return (x.reshape(lead + (c.ssm_heads, c.head_dim)),
            b.reshape(lead + (c.bc_groups, c.d_state)),
            cc.reshape(lead + (c.bc_groups, c.d_state)))

  def _conv(self, zxbcdt, xbc, state, start, implementation, window):
    """`ops.causal_conv1d_window` (window) / `_step` on the ring conv state
    -> ((x, B, C) as heads, () / (conv, start)). The op reads the xBC
    columns of the in_proj output in place, or (shard-major blocks) the
    joined xbc, each shard its own channels (`per_shard`)."""
    c = self.cfg
    op = ops.causal_conv1d_window if window else ops.causal_conv1d_step
    kw = dict(activation="silu", implementation=implementation)
    w, b = self.conv_weight[...], self.conv_bias[...]
    if c.mamba_shards == 1:
      out = op(zxbcdt, state.conv, start, w, b, split=self._xbc_split(),
               x_offset=c.d_inner, **kw)
    else:
      out = op(xbc, state.conv, start, w, b, **kw)
    pieces, rest = (out, ()) if window else (out[0], out[1:])
    if c.mamba_shards == 1:
      return self._to_heads(*pieces), rest
    return self._split_xbc(pieces[0]), rest

  def _gate(self, zxbcdt):
    """The gate (column 0 on): zxbcdt (read in place) or its joined z."""
    return zxbcdt if self.cfg.mamba_shards == 1 else self._split(zxbcdt)[0]

  def _ssm_params(self):
    A = -jnp.exp(self.A_log[...].astype(F32))  # [H]
    return A, self.D[...].astype(F32), self.dt_bias[...].astype(F32)

  def prefill(self, h, lengths, state: MambaState | None, layer: int = 0,
              resume: bool = False):
    """The prompt; the decode state per state.precision (`layer`: the Mamba
    index keying stochastic rounding).

    resume False: every row starts empty (`state` only fixes the layout).
    resume True: each row continues `state`: its conv window precedes the
    chunk, its SSM state (materialized) is the scan's initial state, and
    the stored state's rounding step counts on from the state's own.
    """
    c = self.cfg
    bsz, t, _ = h.shape
    z, xbc, dt = self._split(self.in_proj(h))
    conv_w, conv_b = self.conv_weight[...], self.conv_bias[...]
    hist = state.ordered_conv() if resume else None
    xbc_act, _ = causal_conv1d(xbc, conv_w, conv_b, initial_state=hist,
                               activation="silu")
    x, b, cc = self._split_xbc(xbc_act)  # [b, T, H, P], [b, T, G, N] x2
    A, D, dt_bias = self._ssm_params()
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [b, T]
    # Padded positions: dt' = 0 (no decay, no input) and x = B = C = 0,
    # selected (never multiplied by a 0/1 mask), so that a pad holding inf
    # or NaN reaches neither the state nor a valid position's output.
    dtp = jnp.where(valid[..., None], process_dt(dt, dt_bias, True), 0.0)
    x, b, cc = (jnp.where(valid[..., None, None], v, jnp.zeros((), v.dtype))
                for v in (x, b, cc))
    s0 = (full_ssm_state(state.ssm, A, "the Mamba state") if resume
          else None)
    y, final = ssd_chunked_scan(
        x, dtp, A, b, cc, c.chunk_size, D=D, dt_softplus=False,
        initial_state=s0, precision=scan_precision(c.scan_precision))
    # final: [b, H, P, N] f32
    y = self.norm(y.reshape(bsz, t, c.d_inner), z)
    out = self.out_proj(y)
    if state is None:
      return out, None
    # Conv state: the k-1 inputs before each row's end (the window before
    # the chunk, or zeros before t=0).
    if hist is None:
      hist = jnp.zeros((bsz, c.conv_kernel - 1, c.conv_dim), state.conv.dtype)
    conv = conv_state_after(xbc, lengths, hist, state.conv.dtype)
    policy = state.precision
    steps = tokens_after(state.ssm, lengths, resume)
    if isinstance(state.ssm, ReplayState):
      if policy is None:
        ssm = ReplayState.from_ssm_state(
            final, c.bc_groups, state.ssm.buffer_len,
            checkpoint_dtype=state.ssm.checkpoint.dtype,
            buffer_dtype=state.ssm.x_buf.dtype)
      else:  # master (and read copy) stored per the policy
        sr = policy.stochastic_rounding
        ssm = ReplayState.from_ssm_state(
            final, c.bc_groups, state.ssm.buffer_len, policy=policy,
            row_id=state.ssm.row_id if sr else None,
            step=steps if sr else None, layer=layer)
    else:
      ssm = baseline_after_prefill(final, state.ssm, policy, steps, layer)
    return out, state.with_ordered_conv(conv).replace(ssm=ssm)

  def step(self, h, state: MambaState, implementation: str | None = None,
           layer: int = 0, rows=None):
    """One token; replay states step under state.precision with `layer`
    (the Mamba index keying stochastic rounding). rows: [b] effective slots
    (`replayssm_jax.slots`) of a state with any number of rows: the SSM op
    steps them in place, the (small) conv windows are gathered and
    scattered back."""
    if rows is None:
      return self._step(h, state, implementation, layer, None)
    conv = slots.gather((state.conv, state.conv_start), rows)
    y, new = self._step(h, state.replace(conv=conv[0], conv_start=conv[1]),
                        implementation, layer, rows)
    conv = slots.scatter((state.conv, state.conv_start),
                         (new.conv, new.conv_start), rows)
    return y, new.replace(conv=conv[0], conv_start=conv[1])

  def _step(self, h, state: MambaState, implementation, layer, rows):
    """`step` with the token rows' conv windows in `state` (its SSM state
    the pool's, read through `rows`, when given)."""
    c = self.cfg
    bsz = h.shape[0]
    with jax.named_scope("in_proj"):
      zxbcdt = self.in_proj(h)
      _, xbc, dt = self._split(zxbcdt)  # z: read by the norm in place
    with jax.named_scope("conv"):
      conv_w, conv_b = self.conv_weight[...], self.conv_bias[...]
      if state.conv_start is None:
        xbc, conv = causal_conv1d_update(xbc, state.conv, conv_w, conv_b,
                                         activation="silu")
        state = state.replace(conv=conv)
        x, b, cc = self._split_xbc(xbc)  # [b, H, P], [b, G, N] x2
      else:  # one slot written in place (no shifted copy per step), the
        # input read inside the in_proj output and the output written as
        # x, B, C pieces (a kernel does both: no slice copies)
        (x, b, cc), (conv, start) = self._conv(
            zxbcdt, xbc, state, state.conv_start, implementation, False)
        state = state.replace(conv=conv, conv_start=start)
    A, D, dt_bias = self._ssm_params()
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True,
              implementation=implementation)
    with jax.named_scope("ssm"):
      y, ssm = self._ssm_step(state, x, dt, A, b, cc, kw, layer, rows)
    with jax.named_scope("gated_norm"):  # the gate read in place
      y = self.norm(y.reshape(bsz, c.d_inner), self._gate(zxbcdt), 0,
                    implementation)
    with jax.named_scope("out_proj"):
      out = self.out_proj(y)
    return out, state.replace(ssm=ssm)

  def _ssm_step(self, state: MambaState, x, dt, A, b, cc, kw, layer,
                rows=None):
    """The SSM op of one step on state.ssm (through the slots `rows` when
    given) -> (y [b, H, P], new ssm)."""
    policy, implementation = state.precision, kw["implementation"]
    if isinstance(state.ssm, ReplayState):
      y, ssm = ops.replay_state_update(state.ssm, x, dt, A, b, cc,
                                       policy=policy, layer=layer,
                                       rows=rows, **kw)
    elif isinstance(state.ssm, StoredSSMState) and rows is not None:
      # (The stored baseline's op is a reference without slots.)
      y, ssm = slots.on_rows(lambda st: self._ssm_step(
          state.replace(ssm=st), x, dt, A, b, cc, kw, layer), state.ssm, rows)
    elif isinstance(state.ssm, StoredSSMState):
      check_stored_implementation(implementation, policy)
      st = state.ssm
      step = None if st.step is None else st.step + 1
      y, stored, scale = ops.selective_state_update_stored(
          st.state, x, dt, A, b, cc, D=kw["D"], dt_bias=kw["dt_bias"],
          dt_softplus=True, state_scale=st.scale,
          stochastic_rounding=step is not None,
          seed=policy.seed, layer=layer, row_id=st.row_id, step=step,
          sr_rng=policy.sr_rng)
      ssm = st.replace(state=stored, scale=scale, step=step)
    else:
      y, ssm = ops.selective_state_update(state.ssm, x, dt, A, b, cc,
                                          rows=rows, **kw)
    return y, ssm

  def verify(self, h, state: MambaState, implementation: str | None = None,
             layer=0):
    """A window of T tokens per row from the committed state.

    in_proj and the causal conv (starting from the conv state:
    `ops.causal_conv1d_window`) run over the whole window; the SSM outputs
    come from `replay_verify` (replay state: one parallel pass from
    checkpoint + buffer, `implementation` goes to its dispatcher) or
    `baseline_verify` (full state: one snapshot per window position).

    Args:
      h: [b, T, d] normed window activations.
      state: the committed MambaState.
      implementation: implementation of the SSM op (replay_verify in
        replay mode, baseline_verify in baseline mode), the window conv and
        the gated norm.
      layer: this block's index among the Mamba blocks (keys stochastic
        rounding of an early flush).

    Returns:
      (y [b, T, d], (ssm, window_conv_inputs, snapshots)): ssm is the
      replay state with the window pending (count unchanged) or, baseline,
      the committed state unchanged; window_conv_inputs [b, T, conv_dim]
      the window's pre-conv inputs in the conv-state dtype (to roll the
      conv state forward over an accepted prefix); snapshots [b, T, H, P, N]
      (baseline) or None.
    """
    c = self.cfg
    check_speculative_precision(state, "verify")
    bsz, t, _ = h.shape
    zxbcdt = self.in_proj(h)
    _, xbc, dt = self._split(zxbcdt)
    # The window's conv from the (ring) conv state, read in place from the
    # in_proj output and written as x, B, C pieces (as the decode step's).
    start = (jnp.zeros((bsz,), jnp.int32) if state.conv_start is None
             else state.conv_start)
    (x, b, cc), _ = self._conv(zxbcdt, xbc, state, start, implementation,
                               True)
    A, D, dt_bias = self._ssm_params()
    if isinstance(state.ssm, ReplayState):
      y, ssm = replay_verify(state.ssm, x, dt, A, b, cc, D=D, dt_bias=dt_bias,
                             dt_softplus=True, policy=state.precision,
                             layer=layer, implementation=implementation)
      snapshots = None
    else:
      y, snapshots = baseline_verify(state.ssm, x, dt, A, b, cc, D=D,
                                     dt_bias=dt_bias, dt_softplus=True,
                                     implementation=implementation)
      ssm = state.ssm
    y = self.norm(y.reshape(bsz, t, c.d_inner), self._gate(zxbcdt), 0,
                  implementation)
    return self.out_proj(y), (ssm, xbc.astype(state.conv.dtype), snapshots)
