"""Public, validated decode-step ops with an implementation dispatcher.

`selective_state_update` (baseline) and `replay_state_update` (ReplaySSM)
check their arguments once at trace time (shape/dtype errors name the
argument), then run an implementation:

  implementation=None         the fastest registered implementation that
                              supports the device and shapes (the reference
                              always does);
  implementation="reference"  the pure-JAX reference in `reference.py`;
  any other registered name   that implementation, with no fallback: if it
                              cannot take the inputs it raises
                              NotImplementedError saying why.

Kernels register themselves with `register_implementation`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable

from absl import logging

from replayssm_jax import _validation as V
from replayssm_jax import reference
from replayssm_jax import speculative
from replayssm_jax.state import ReplayState


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One way to run an op.

  Attributes:
    name: the name users pass as `implementation=`.
    fn: callable with the reference op's signature plus `config=` keyword.
    supports: callable(**op_kwargs) -> None | str; a string says why the
      implementation cannot take these inputs on this device.
    preferred: callable() -> bool; whether implementation=None may pick it
      (e.g. a Pallas kernel only on GPU: elsewhere it runs in the slow
      interpret mode, which only an explicit request gets).
    priority: higher runs first when implementation=None.
  """
  name: str
  fn: Callable
  supports: Callable[..., str | None] = lambda **_: None
  preferred: Callable[[], bool] = lambda: True
  priority: int = 0


_REGISTRY: dict[str, dict[str, Implementation]] = {
    "selective_state_update": {
        "reference": Implementation(
            "reference", reference.selective_state_update, priority=-1)},
    "replay_state_update": {
        "reference": Implementation(
            "reference", reference.replay_state_update, priority=-1)},
    "replay_verify": {
        "reference": Implementation(
            "reference", speculative.replay_verify_reference, priority=-1)},
}


def register_implementation(op: str, impl: Implementation) -> None:
  if op not in _REGISTRY:
    raise ValueError(f"op must be one of {sorted(_REGISTRY)}, got {op!r}.")
  _REGISTRY[op][impl.name] = impl


def implementations(op: str) -> tuple[str, ...]:
  """Registered implementation names of `op`, fastest first."""
  _load_plugins()
  impls = sorted(_REGISTRY[op].values(), key=lambda i: -i.priority)
  return tuple(i.name for i in impls)


_PLUGINS = ("pallas_kernels",)
_plugins_loaded = False
_plugin_errors: dict[str, str] = {}


def _load_plugins() -> None:
  """Imports the kernel packages once; they register themselves."""
  global _plugins_loaded
  if _plugins_loaded:
    return
  _plugins_loaded = True
  for module in _PLUGINS:
    try:
      importlib.import_module(module)
    except ImportError as e:  # e.g. a jax build without Pallas.
      _plugin_errors[module] = f"{type(e).__name__}: {e}"
      logging.warning("replayssm_jax: kernels in %s unavailable: %s", module,
                      e)


def dispatch(op: str, implementation: str | None, config, args: dict):
  """Runs `op` (validated args) with the chosen implementation."""
  _load_plugins()
  table = _REGISTRY[op]
  if implementation is not None:
    if implementation not in table:
      unavailable = "".join(f" (kernel package {m} failed to import: {e})"
                            for m, e in _plugin_errors.items())
      raise ValueError(f"implementation must be None or one of "
                       f"{implementations(op)}, got {implementation!r}."
                       f"{unavailable}")
    impl = table[implementation]
    why = impl.supports(**args)
    if why is not None:
      raise NotImplementedError(
          f"{op}: implementation {implementation!r} cannot run these inputs: "
          f"{why}")
    if config is None:
      return impl.fn(**args)
    if "config" not in inspect.signature(impl.fn).parameters:
      raise ValueError(f"{op}: implementation {implementation!r} takes no "
                       f"config, got {config!r}.")
    return impl.fn(**args, config=config)
  if config is not None:
    raise ValueError("config can only be given with a named implementation.")
  for name in implementations(op):
    impl = table[name]
    if impl.preferred() and impl.supports(**args) is None:
      return impl.fn(**args)
  raise AssertionError("unreachable: the reference supports every input")


def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None,
                           dt_bias=None, dt_softplus=False, *,
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
    implementation: see module docstring.
    config: tuning config of the named implementation.

  Returns:
    (y [batch, nheads, headdim] in x.dtype, new ssm_state in its dtype).
  """
  V.check_floating("ssm_state", ssm_state, V.STATE_DTYPES)
  V.check_ndim("ssm_state", ssm_state, 4, "[batch, nheads, headdim, dstate]")
  b, h, p, n = ssm_state.shape
  V.check_step_inputs(b, h, p, n, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                      dt_bias=dt_bias)
  args = dict(ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=bool(dt_softplus))
  return dispatch("selective_state_update", implementation, config, args)


def replay_state_update(rstate: ReplayState, x, dt, A, B, C, D=None, z=None,
                        dt_bias=None, dt_softplus=False, *,
                        implementation: str | None = None, config=None):
  """ReplaySSM decode step: same arguments as `selective_state_update` with a
  `ReplayState` instead of the full state.

  Rows with count < L-1 compute y from checkpoint + buffer and append the
  token (checkpoint untouched); rows with count == L-1 fold the L tokens into
  a new checkpoint (flush) and reset their count. Each row therefore writes
  its checkpoint exactly once every L steps; L = 1 is the baseline step.

  Returns:
    (y [batch, nheads, headdim] in x.dtype, new ReplayState).
  """
  if not isinstance(rstate, ReplayState):
    raise TypeError(f"rstate must be a ReplayState, got "
                    f"{type(rstate).__name__}.")
  rstate.validate("rstate")
  V.check_step_inputs(rstate.batch, rstate.nheads, rstate.headdim,
                      rstate.dstate, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
                      dt_bias=dt_bias, ngroups=rstate.ngroups)
  args = dict(rstate=rstate, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=bool(dt_softplus))
  return dispatch("replay_state_update", implementation, config, args)


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
