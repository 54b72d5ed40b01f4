"""Jitted multi-step runners shared by the reference and kernel tests.

Each runner builds a case's fresh random inputs (from `replayssm_jax.testing`)
and runs the whole token loop inside one `jax.lax.scan`, so a case costs one
compilation and one dispatch instead of one per step. Compiled functions are
module-level, so cases of equal shapes reuse them.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax import testing
from tests import cases as C

# XLA:CPU options for the test jits: compile time dominates this suite (tiny
# shapes, many cases), and LLVM's optimization passes roughly double it while
# buying nothing at these sizes. They do not change floating-point semantics
# (no fast-math).
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def bits(a):
  """The raw bits of a float array (to test bit-identity, -0 != +0)."""
  a = jnp.asarray(a)
  ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
        8: jnp.uint64}[a.dtype.itemsize]
  return jax.lax.bitcast_convert_type(a, ut)


def rows_changed(old, new):
  """[batch] bool: some bit of row r differs between old and new."""
  diff = bits(old) != bits(new)
  return jnp.any(diff.reshape(diff.shape[0], -1), axis=1)


def make_params(key, nheads: int, *, with_D: bool, with_dt_bias: bool,
                dt_softplus: bool) -> dict[str, Any]:
  """A, D, dt_bias. Without softplus the bias is made small and positive so
  that dt' = dt + dt_bias stays a positive step (a decay, as in a model)."""
  params = testing.random_params(key, nheads, with_D=with_D,
                                 with_dt_bias=with_dt_bias)
  if with_dt_bias and not dt_softplus:
    params["dt_bias"] = jnp.abs(params["dt_bias"]) * 0.1
  return params


def time_major(steps: dict[str, Any]) -> dict[str, Any]:
  """[batch, T, ...] -> [T, batch, ...] (None entries kept)."""
  return {k: None if v is None else jnp.swapaxes(v, 0, 1)
          for k, v in steps.items()}


class DecodeInputs(NamedTuple):
  """Everything a ReplayCase feeds the ops (fresh random values)."""
  params: dict[str, Any]  # A, D, dt_bias
  rstate: rs.ReplayState  # ragged starting state
  full_state: jax.Array  # baseline-equivalent full state (f32)
  steps: dict[str, Any]  # x, dt, B, C, z as [T, batch, ...]


def decode_inputs(case: C.ReplayCase) -> DecodeInputs:
  """A case's inputs. Generated eagerly on purpose: each eager op compiles
  once per shape and is then reused by every case of the same shapes, which
  is cheaper than compiling one input function per case."""
  d = case.dims
  kp, kr, ks = jax.random.split(jax.random.PRNGKey(case.seed), 3)
  params = make_params(kp, d.nheads, with_D=case.with_D,
                       with_dt_bias=case.with_dt_bias,
                       dt_softplus=case.dt_softplus)
  rstate, full = testing.random_replay_state(
      kr, d.batch, d.nheads, d.headdim, d.dstate, d.ngroups, case.buffer_len,
      case.counts, params["A"], checkpoint_dtype=case.checkpoint_dtype,
      buffer_dtype=case.buffer_dtype)
  steps = testing.random_step_inputs(
      ks, d.batch, d.nheads, d.headdim, d.dstate, d.ngroups,
      dtype=case.input_dtype, dt_softplus=case.dt_softplus,
      with_z=case.with_z, seqlen=case.nsteps)
  return DecodeInputs(params, rstate, full, time_major(steps))


def step_kwargs(tok, params, dt_softplus):
  """Keyword arguments of one decode step from a token and the params."""
  return dict(x=tok["x"], dt=tok["dt"], A=params["A"], B=tok["B"],
              C=tok["C"], D=params["D"], z=tok["z"],
              dt_bias=params["dt_bias"], dt_softplus=dt_softplus)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "implementation"),
                   compiler_options=FAST_COMPILE)
def _decode_scan(rstate, full_state, steps, params, *, dt_softplus,
                 implementation):
  def body(carry, tok):
    rst, base = carry
    kw = step_kwargs(tok, params, dt_softplus)
    y_base, base = rs.selective_state_update(base, **kw,
                                             implementation="reference")
    y_rep, new = rs.replay_state_update(rst, **kw,
                                        implementation=implementation)
    out = dict(y_base=y_base, y_replay=y_rep, state_base=base,
               state_replay=rs.materialize(new, params["A"]),
               wrote=rows_changed(rst.checkpoint, new.checkpoint),
               count=new.count)
    return (new, base), out

  (final, _), out = jax.lax.scan(body, (rstate, full_state), steps)
  return final, out


def run_decode(case: C.ReplayCase, implementation: str = "reference",
               inputs: DecodeInputs | None = None):
  """Runs case.nsteps decode steps with the baseline and with ReplaySSM.

  The baseline keeps an f32 full state (the exact recurrence); the replay
  state uses the case's storage dtypes.

  Returns:
    (inputs, final ReplayState, dict of numpy arrays with a leading step
    axis: y_base, y_replay [T, b, h, p]; state_base, state_replay (the
    materialized replay state) [T, b, h, p, n]; wrote [T, b] (checkpoint
    bits changed by the step); count [T, b] (count after the step)).
  """
  if inputs is None:
    inputs = decode_inputs(case)
  final, out = _decode_scan(inputs.rstate, inputs.full_state, inputs.steps,
                            inputs.params, dt_softplus=case.dt_softplus,
                            implementation=implementation)
  return inputs, final, jax.tree.map(np.asarray, out)


@functools.partial(jax.jit, static_argnames=("dt_softplus",),
                   compiler_options=FAST_COMPILE)
def baseline_scan(state, steps, params, *, dt_softplus):
  """Token-by-token baseline over time-major steps.

  Returns:
    (final state in state.dtype, y [T, b, h, p]).
  """
  def body(st, tok):
    y, st = rs.selective_state_update(
        st, **step_kwargs(tok, params, dt_softplus),
        implementation="reference")
    return st, y

  return jax.lax.scan(body, state, steps)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "implementation"),
                   compiler_options=FAST_COMPILE)
def replay_scan(rstate, steps, params, *, dt_softplus,
                implementation="reference"):
  """Token-by-token ReplaySSM decode over time-major steps.

  Returns:
    (final ReplayState, y [T, b, h, p]).
  """
  def body(rst, tok):
    y, rst = rs.replay_state_update(
        rst, **step_kwargs(tok, params, dt_softplus),
        implementation=implementation)
    return rst, y

  return jax.lax.scan(body, rstate, steps)


# ----------------------------------------------------------------- prefill
DRAW_LEN = 64  # random sequences are drawn this long, then cut
ssd_scan = jax.jit(rs.ssd_chunked_scan,
                   static_argnames=("chunk_size", "dt_softplus"),
                   compiler_options=FAST_COMPILE)


def with_policy_fields(rstate, policy, row_id, step):
  """rstate with the fields of `policy` (None: none): a read copy (and
  scales) stored from its master, and with stochastic rounding the given
  row ids and steps."""
  fields = {}
  if policy is not None and policy.read_dtype is not None:
    fields["read_copy"], fields["read_scale"] = rs.precision.store(
        rstate.checkpoint.astype(jnp.float32), policy.read_dtype)
  if policy is not None and policy.stochastic_rounding:
    fields["row_id"] = jnp.asarray(row_id, jnp.int32)
    fields["step"] = jnp.asarray(step, jnp.int32)
  return rstate.replace(**fields)


def random_state(key, dims: C.Dims, dtype=jnp.float32):
  """A random full SSM state [batch, nheads, headdim, dstate]."""
  return jax.random.normal(
      key, (dims.batch, dims.nheads, dims.headdim, dims.dstate),
      jnp.float32).astype(dtype)


def ssd_inputs(case: C.SsdCase, seqlen: int | None = None):
  """(params, sequence inputs [batch, seqlen, ...], initial state or None)."""
  d = case.dims
  kp, ks, ki = jax.random.split(jax.random.PRNGKey(case.seed), 3)
  params = make_params(kp, d.nheads, with_D=case.with_D,
                       with_dt_bias=case.with_dt_bias,
                       dt_softplus=case.dt_softplus)
  t = case.seqlen if seqlen is None else seqlen
  # Drawn at one fixed length and cut, so that the eager random ops compile
  # once per geometry rather than once per seqlen.
  seq = testing.random_step_inputs(
      ks, d.batch, d.nheads, d.headdim, d.dstate, d.ngroups,
      dt_softplus=case.dt_softplus, with_z=case.with_z,
      seqlen=max(t, DRAW_LEN))
  seq = {k: None if v is None else v[:, :t] for k, v in seq.items()}
  init = random_state(ki, d) if case.initial_state else None
  return params, seq, init


def run_ssd(seq, params, chunk_size: int, dt_softplus: bool,
            initial_state=None):
  """ssd_chunked_scan on [batch, seqlen, ...] inputs (jitted)."""
  return ssd_scan(seq["x"], seq["dt"], params["A"], seq["B"], seq["C"],
                  chunk_size=chunk_size, D=params["D"], z=seq["z"],
                  dt_bias=params["dt_bias"], dt_softplus=dt_softplus,
                  initial_state=initial_state)


# -------------------------------------------------------------------- conv
conv_prefill = jax.jit(rs.causal_conv1d, static_argnames=("activation",),
                       compiler_options=FAST_COMPILE)


@functools.partial(jax.jit, static_argnames=("activation",),
                   compiler_options=FAST_COMPILE)
def conv_steps(x, conv_state, weight, bias, *, activation):
  """causal_conv1d_update token by token over x [batch, seqlen, dim].

  Returns:
    (y [batch, seqlen, dim], final conv state).
  """
  def body(st, xt):
    y, st = rs.causal_conv1d_update(xt, st, weight, bias,
                                    activation=activation)
    return st, y

  st, ys = jax.lax.scan(body, conv_state, jnp.swapaxes(x, 0, 1))
  return jnp.swapaxes(ys, 0, 1), st


@functools.partial(jax.jit, static_argnames=("activation",),
                   compiler_options=FAST_COMPILE)
def conv_steps_ring(x, conv_state, start, weight, bias, *, activation):
  """causal_conv1d_update_ring token by token over x [batch, seqlen, dim].

  Returns:
    (y [batch, seqlen, dim], final ring conv state, final start).
  """
  def body(carry, xt):
    y, st, sp = rs.causal_conv1d_update_ring(xt, *carry, weight, bias,
                                             activation=activation)
    return (st, sp), y

  (st, sp), ys = jax.lax.scan(body, (conv_state, start),
                              jnp.swapaxes(x, 0, 1))
  return jnp.swapaxes(ys, 0, 1), st, sp


def conv_inputs(case: C.ConvCase, seqlen: int | None = None):
  """(x [batch, seqlen, dim], weight [dim, k], bias or None, initial conv
  state [batch, k-1, dim] or None), random."""
  kx, kw, kb, ki = jax.random.split(jax.random.PRNGKey(case.seed), 4)
  t = case.seqlen if seqlen is None else seqlen
  k = case.kernel_size
  # Drawn at fixed sizes and cut (see ssd_inputs).
  kmax = max(k, 8)
  x = jax.random.normal(kx, (case.batch, max(t, DRAW_LEN), case.dim))
  x = x[:, :t].astype(case.dtype)
  weight = jax.random.normal(kw, (case.dim, kmax))[:, :k] / np.sqrt(k)
  bias = jax.random.normal(kb, (case.dim,)) if case.with_bias else None
  init = (jax.random.normal(ki, (case.batch, kmax, case.dim))[:, :k - 1]
          .astype(case.dtype) if case.initial_state else None)
  return x, weight, bias, init
