"""Public, validated ops that run through the implementation dispatcher.

`selective_state_update` (baseline), `replay_state_update` (ReplaySSM),
`decode_attention` (one query or a verify window per row against its KV
cache), the conv steps and the norms check their arguments once at trace
time (shape/dtype errors name the argument), then run an implementation
(`replayssm_jax.dispatch`):

  implementation=None         the fastest registered implementation that
                              supports the device and shapes (the reference
                              always does);
  implementation="reference"  the pure-JAX reference (`reference.py`,
                              `attention.py`, `conv.py`, `norm.py`);
  any other registered name   that implementation, with no fallback: if it
                              cannot take the inputs it raises
                              NotImplementedError saying why.

Re-exported here: the dispatcher's `Implementation`,
`register_implementation`, `implementations` and `dispatch`, and the verify
ops of `replayssm_jax.speculative` (`replay_verify`, `replay_commit`,
`baseline_verify`, `baseline_commit`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax import attention
from replayssm_jax import conv
from replayssm_jax import norm
from replayssm_jax import precision as P
from replayssm_jax import reference
from replayssm_jax import slots
from replayssm_jax import dispatch as _dispatch
# The dispatcher's API, re-exported.
from replayssm_jax.dispatch import (check_layer, dispatch, implementations,
                                    invalid_rows, policy_args,
                                    register_implementation)
from replayssm_jax.registry import Implementation
# The speculative verify ops, dispatched like the ops below.
from replayssm_jax.speculative import (baseline_commit, baseline_verify,
                                      replay_commit, replay_verify)
from replayssm_jax.state import ReplayState

_REGISTRY = _dispatch._REGISTRY  # the table itself (tests patch entries)

__all__ = [
    "Implementation", "add_rms_norm", "baseline_commit", "baseline_verify",
    "causal_conv1d_step", "causal_conv1d_window", "decode_attention",
    "dispatch", "gated_rms_norm", "implementations", "materialize",
    "register_implementation", "replay_commit", "replay_state_update",
    "replay_verify", "selective_state_update",
    "selective_state_update_stored",
]


def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None,
                           dt_bias=None, dt_softplus=False, *, rows=None,
                           implementation: str | None = None, config=None):
  """Baseline Mamba-2 decode step.

  Args:
    ssm_state: [batch, nheads, headdim, dstate] f32/bf16/f16 state.
    x: [batch, nheads, headdim] post-conv input.
    dt: [batch, nheads] raw time step.
    A: [nheads] per-head decay rate (A = -exp(A_log)).
    B, C: [batch, ngroups, dstate]; nheads % ngroups == 0.
    D: optional [nheads] skip.
    z: optional [batch, nheads, headdim] gate: y *= silu(z).
    dt_bias: optional [nheads], added to dt before the softplus.
    dt_softplus: apply softplus to dt + dt_bias.
    rows: optional [batch] int32, a state row (slot) per token row: then
      ssm_state may have any number of rows (a serving pool's), token row i
      reads and writes state row rows[i] and the other state rows stay as
      they are (`replayssm_jax.slots`: padding rows, repeated slots).
    implementation: see module docstring.
    config: tuning config of the named implementation.

  Returns:
    (y [batch, nheads, headdim] in x.dtype, new ssm_state in its dtype).
  """
  V.check_floating("ssm_state", ssm_state, V.STATE_DTYPES)
  V.check_ndim("ssm_state", ssm_state, 4, "[batch, nheads, headdim, dstate]")
  b, h, p, n = ssm_state.shape
  b, rows = slots.token_rows(b, x, rows)
  V.check_step_inputs(b, h, p, n, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                      dt_bias=dt_bias)
  args = dict(ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=bool(dt_softplus))
  return _dispatch.dispatch_rows("selective_state_update", implementation,
                                 config, args, rows, ("ssm_state",))


def decode_attention(q, k_cache, v_cache, lengths, scale=None, *,
                     rows=None, implementation: str | None = None,
                     config=None):
  """Queries of each row against the row's KV cache (a decode step, or a
  speculative window whose keys are already in the cache).

  Args:
    q: [batch, q_heads, head_dim] (one query per row) or [batch, T, q_heads,
      head_dim] (a window of T queries per row).
    k_cache, v_cache: [batch, kv_heads, max_len, head_dim] head-major caches;
      q_heads % kv_heads == 0 (query head h reads KV head
      h // (q_heads // kv_heads)).
    lengths: [batch] integers in [0, max_len]: row r's (first) query attends
      to its cache entries 0 .. lengths[r] - 1, window query t to the first
      min(lengths[r] + t, max_len) (causal within the window). A query that
      sees no entry returns zeros. Checked when concrete; under jit a row
      whose length lies outside [0, max_len] returns NaN. A kernel reads
      only the entries it needs.
    scale: the score scale, a Python float; None = head_dim ** -0.5.
    rows: optional [batch] int32, a cache row (slot) per query row: the
      caches may then have any number of rows (a serving pool's);
      padding rows and repeated slots as in `replayssm_jax.slots`.
    implementation, config: see the module docstring.

  Returns:
    q's shape in q.dtype (float32 scores, softmax and sums).
  """
  attention.validate_decode_attention(q, k_cache, v_cache, lengths, scale,
                                      rows)
  if rows is not None:
    rows = slots.effective(rows, k_cache.shape[0])
  args = dict(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths,
              scale=scale)
  out = _dispatch.dispatch_rows("decode_attention", implementation, config,
                                args, rows, ("k_cache", "v_cache"),
                                returns_state=False)
  ln = jnp.asarray(lengths)
  bad = (ln < 0) | (ln > k_cache.shape[2])
  V.raise_if_invalid(bad, "decode_attention (lengths)")
  bad = bad.reshape((-1,) + (1,) * (out.ndim - 1))
  return jnp.where(bad, jnp.nan, out).astype(out.dtype)


def causal_conv1d_step(x, conv_state, start, weight, bias=None, *,
                       activation: str | None = "silu", split=None,
                       x_offset: int = 0, implementation: str | None = None,
                       config=None):
  """One decode step of the causal depthwise conv on a ring-buffer conv
  state, its output cut into channel pieces (Mamba-2's x, B, C).

  Args:
    x: [batch, width] holding the new token's pre-conv input in columns
      x_offset .. x_offset + dim - 1 (e.g. Mamba-2's in_proj output, whose
      xBC columns a kernel reads in place: no slice copy).
    conv_state: [batch, kernel_size - 1, dim] ring of the previous inputs
      (kernel_size >= 2), row r's oldest in slot start[r] (see
      `conv.causal_conv1d_update_ring`).
    start: [batch] int slot of each row's oldest input.
    weight: [dim, kernel_size]; bias: optional [dim]; activation: "silu"
      or None.
    split: channel counts of the output pieces (summing to dim), or None
      for one piece. A kernel writes each piece as its own array, so a
      consumer of one piece (a kernel's operand) needs no slice copy.
    x_offset: the first column of the conv's input in x (a Python int).
    implementation, config: see the module docstring.

  Returns:
    (tuple of pieces [batch, n] in x.dtype, new conv state (the new input
     written over the oldest; updated in place where XLA can), new start
     [batch] int32).
  """
  args = _ring_conv_args(x, "[batch, width]", conv_state, start, weight,
                         bias, activation, split, x_offset)
  if weight.shape[1] < 2:
    raise ValueError(f"weight must have kernel_size >= 2 (a ring of "
                     f"kernel_size - 1 >= 1 inputs), got {weight.shape[1]}; "
                     f"use conv.causal_conv1d_update_ring.")
  return dispatch("causal_conv1d_step", implementation, config, args)


def _ring_conv_args(x, x_layout, conv_state, start, weight, bias,
                    activation, split, x_offset) -> dict:
  """The checked arguments of a conv op on a ring conv state (x: one
  token [batch, width] or a window [batch, T, width])."""
  V.check_ndim("x", x, len(x_layout.split(",")), x_layout)
  V.check_ndim("conv_state", conv_state, 3, "[batch, kernel_size - 1, dim]")
  dim = conv_state.shape[-1]
  V.check_column_offset("x_offset", x_offset, dim, x.shape[-1],
                        "the conv's input inside x")
  conv.check_step_args(jax.ShapeDtypeStruct((x.shape[0], dim), x.dtype),
                       conv_state, weight, bias, activation)
  conv.check_start(start, x.shape[0])
  conv.check_split(split, dim)
  return dict(x=x, conv_state=conv_state, start=start, weight=weight,
              bias=bias, activation=activation, split=split,
              x_offset=x_offset)


def causal_conv1d_window(x, conv_state, start, weight, bias=None, *,
                         activation: str | None = "silu", split=None,
                         x_offset: int = 0, implementation: str | None = None,
                         config=None):
  """The causal depthwise conv over a speculative window of T inputs per
  row, from a ring-buffer conv state that it does not change, its output
  cut into channel pieces (Mamba-2's x, B, C).

  Args:
    x: [batch, T, width] holding the window's pre-conv inputs in columns
      x_offset .. x_offset + dim - 1 (read in place by a kernel).
    conv_state, start, weight, bias, activation, split, implementation,
      config: as in `causal_conv1d_step`.
    x_offset: the first column of the conv's input in x (a Python int).

  Returns:
    tuple of pieces [batch, T, n] in x.dtype.
  """
  args = _ring_conv_args(x, "[batch, T, width]", conv_state, start, weight,
                         bias, activation, split, x_offset)
  return dispatch("causal_conv1d_window", implementation, config, args)


def gated_rms_norm(y, z, weight, *, group_size: int, eps: float,
                   z_offset: int = 0, out_dtype=None,
                   implementation: str | None = None, config=None):
  """Mamba-2's gated grouped RMSNorm: weight * h / rms(h) per group of
  `group_size` channels, h = y * silu(z), float32 math.

  Args:
    y: [..., dim].
    z: [..., width] holding the gate in columns z_offset .. z_offset + dim
      - 1 (e.g. the in_proj output, which a kernel reads in place).
    weight: [dim].
    group_size: channels per group (divides dim).
    eps: a positive Python float.
    z_offset: the gate's first column in z.
    out_dtype: the result's dtype (y's if None).
    implementation, config: see the module docstring.

  Returns:
    [..., dim] in out_dtype.
  """
  norm.validate_gated_rms_norm(y, z, weight, group_size, eps, z_offset)
  args = dict(y=y, z=z, weight=weight, group_size=group_size, eps=eps,
              z_offset=z_offset, out_dtype=out_dtype)
  return dispatch("gated_rms_norm", implementation, config, args)


def add_rms_norm(x, y, weight, *, eps: float, out_dtype=None,
                 implementation: str | None = None, config=None):
  """The residual add and RMSNorm between two pre-norm blocks.

  Args:
    x: [..., d] the residual stream; y: [..., d] a block's output.
    weight: [d] the next norm's weight.
    eps: a positive Python float.
    out_dtype: the normed output's dtype (x's if None).
    implementation, config: see the module docstring.

  Returns:
    (s = x + y [..., d] float32, weight * s / rms(s) [..., d] in
     out_dtype).
  """
  norm.validate_add_rms_norm(x, y, weight, eps)
  args = dict(x=x, y=y, weight=weight, eps=eps, out_dtype=out_dtype)
  return dispatch("add_rms_norm", implementation, config, args)


def replay_state_update(rstate: ReplayState, x, dt, A, B, C, D=None, z=None,
                        dt_bias=None, dt_softplus=False, *,
                        policy: P.PrecisionPolicy | None = None,
                        layer=0, rows=None,
                        implementation: str | None = None, config=None):
  """ReplaySSM decode step: same arguments as `selective_state_update` with a
  `ReplayState` instead of the full state.

  Rows with count < L-1 compute y from checkpoint + buffer and append the
  token (checkpoint untouched); rows with count == L-1 fold the L tokens into
  a new checkpoint (flush) and reset their count. Each row therefore writes
  its checkpoint exactly once every L steps; L = 1 is the baseline step.

  Args:
    policy: optional `precision.PrecisionPolicy` the state was built with
      (`ReplayState.create/from_ssm_state(policy=...)`); it must match the
      state's dtypes and fields. None: the policy implied by the state with
      round-to-nearest stores. With a read copy, non-flush rows read only the
      (dequantized) copy and flush rows write master + copy; with
      stochastic_rounding, flush stores round stochastically keyed by
      (policy.seed, layer, row_id, step, element index).
    layer: layer index (int >= 0, or an int32 scalar, e.g. under a scan over
      layers) keying stochastic rounding; ignored otherwise.
    rows: optional [batch] int32, a state row (slot) per token row (see
      `selective_state_update`).
    Others: see `selective_state_update`. A state with a read copy or
      stochastic rounding runs on implementations that support it (the
      reference and the Pallas kernels; see
      `pallas_kernels._precision_problem` for what they refuse).

  Returns:
    (y [batch, nheads, headdim] in x.dtype, new ReplayState).
  """
  if not isinstance(rstate, ReplayState):
    raise TypeError(f"rstate must be a ReplayState, got "
                    f"{type(rstate).__name__}.")
  rstate.validate("rstate", rows)
  batch, rows = slots.token_rows(rstate.batch, x, rows)
  V.check_step_inputs(batch, rstate.nheads, rstate.headdim,
                      rstate.dstate, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                      dt_bias=dt_bias, ngroups=rstate.ngroups)
  args = dict(rstate=rstate, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=bool(dt_softplus),
              **policy_args(rstate, policy, layer))
  y, new = _dispatch.dispatch_rows("replay_state_update", implementation,
                                   config, args, rows, ("rstate",))
  V.raise_if_invalid(invalid_rows(new, rows), "replay_state_update")
  return y, new


def selective_state_update_stored(ssm_state, x, dt, A, B, C, D=None, z=None,
                                  dt_bias=None, dt_softplus=False, *,
                                  state_scale=None,
                                  stochastic_rounding: bool = False,
                                  seed: int = 0, layer=0, row_id=None,
                                  step=None, sr_rng: str = "threefry"):
  """Baseline decode step with the state stored (rounded) every step.

  The contrast of the precision study (reference implementation only).

  Args:
    ssm_state: [batch, nheads, headdim, dstate] stored state: float32,
      bfloat16, float16, float8_e4m3fn or int8.
    state_scale: [batch, nheads, headdim] float32 scales, required for (and
      only for) float8_e4m3fn / int8 states (see `precision.quantize`).
    stochastic_rounding: round the store stochastically (needs row_id and
      step, [batch] int32; the caller advances step).
    seed, layer: key the stochastic rounding.
    sr_rng: its per-element hash (`precision.SR_RNGS`).
    Others: as in `selective_state_update`.

  Returns:
    (y [batch, nheads, headdim] in x.dtype, new state in ssm_state.dtype,
    new scale [batch, nheads, headdim] float32 or None).
  """
  V.check_array("ssm_state", ssm_state)
  sdt = jnp.dtype(ssm_state.dtype).name
  allowed = P.CHECKPOINT_DTYPES + P.QUANTIZED_DTYPES
  if sdt not in allowed:
    raise TypeError(f"ssm_state must have a dtype in ({', '.join(allowed)}),"
                    f" got {sdt}.")
  V.check_ndim("ssm_state", ssm_state, 4, "[batch, nheads, headdim, dstate]")
  b, h, p, n = ssm_state.shape
  V.check_step_inputs(b, h, p, n, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                      dt_bias=dt_bias)
  if sdt in P.QUANTIZED_DTYPES:
    if state_scale is None:
      raise ValueError(f"state_scale ([batch, nheads, headdim] float32) is "
                       f"required with a {sdt} ssm_state.")
    V.check_floating("state_scale", state_scale, (jnp.float32,))
    V.check_shape("state_scale", state_scale, (b, h, p),
                  "[batch, nheads, headdim]")
  elif state_scale is not None:
    raise ValueError(f"state_scale must be None with a {sdt} ssm_state "
                     f"(only float8_e4m3fn/int8 states are scaled).")
  if stochastic_rounding:
    for name, v in (("row_id", row_id), ("step", step)):
      if v is None:
        raise ValueError(f"{name} ([batch] int32) is required with "
                         f"stochastic_rounding=True.")
      V.check_integer(name, v)
      V.check_shape(name, v, (b,), "[batch]")
    P.PrecisionPolicy(seed=seed, sr_rng=sr_rng)  # validates both
  check_layer(layer)
  return reference.selective_state_update_stored(
      ssm_state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus),
      state_scale=state_scale, stochastic_rounding=bool(stochastic_rounding),
      seed=seed, layer=layer, row_id=row_id, step=step, sr_rng=sr_rng)


def materialize(rstate: ReplayState, A, dtype=None):
  """Full current state [batch, nheads, headdim, dstate] of a ReplayState.

  The checkpoint advanced over the `count` buffered tokens, computed in f32
  and returned in `dtype` (default float32).
  """
  if not isinstance(rstate, ReplayState):
    raise TypeError(f"rstate must be a ReplayState, got "
                    f"{type(rstate).__name__}.")
  rstate.validate("rstate")
  V.check_params(rstate.nheads, A=A)
  if dtype is not None:
    V.check_dtype_arg("dtype", dtype)
  return reference.materialize(rstate, A, reference.F32 if dtype is None
                               else dtype)
