"""The op dispatcher: the implementation table and the choice of entry.

Every dispatched op has an entry "reference" (its pure-JAX reference, which
takes every input) and the entries of the kernel packages in `PLUGINS`.
The ops are those of the table below plus those that the modules of
`OP_MODULES` add with `register_op` (the Gated DeltaNet and Kimi Delta
Attention ops). A
kernel package exports a plain table `IMPLEMENTATIONS` of
(op name, `registry.Implementation`) pairs; the dispatcher imports the
package and reads that table on first use, so the package never imports
the dispatcher (it may import the modules below it: precision, reference,
verify_reference, state, _validation). `dispatch` runs an op:

  implementation=None         the highest-priority preferred implementation
                              that supports the inputs (the reference
                              always does);
  implementation="<name>"     that implementation, with no fallback: if it
                              cannot take the inputs it raises
                              NotImplementedError saying why.

Under `jax.set_mesh` with a ("data", "model") mesh the chosen
implementation runs per shard (`per_shard.call`: a `jax.shard_map` with
the op's specs).

The helpers at the end build the arguments the replay ops (decode step and
verify) pass to their implementations.
"""

from __future__ import annotations

import functools
import importlib
import inspect

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import attention
from replayssm_jax import conv
from replayssm_jax import norm
from replayssm_jax import per_shard
from replayssm_jax import precision as P
from replayssm_jax import reference
from replayssm_jax import slots
from replayssm_jax import verify_reference
from replayssm_jax.registry import Implementation
from replayssm_jax.state import ReplayState

# Op name -> implementation name -> entry (tests patch entries in place).
_REGISTRY: dict[str, dict[str, Implementation]] = {
    op: {"reference": Implementation("reference", fn, priority=-1)}
    for op, fn in (
        ("selective_state_update", reference.selective_state_update),
        ("replay_state_update", reference.replay_state_update),
        ("replay_verify", verify_reference.replay_verify_reference),
        ("baseline_verify", verify_reference.baseline_verify_reference),
        ("decode_attention", attention.decode_attention_reference),
        ("causal_conv1d_step", conv.causal_conv1d_step_reference),
        ("causal_conv1d_window", conv.causal_conv1d_window_reference),
        ("gated_rms_norm", norm.gated_rms_norm_reference),
        ("add_rms_norm", norm.add_rms_norm_reference))}

# Kernel packages whose `IMPLEMENTATIONS` table the dispatcher loads.
PLUGINS = ("pallas_kernels",)
_plugins_loaded = False
_plugin_errors: dict[str, str] = {}


# Modules that register further ops with `register_op` when imported (their
# ops import this module, so they cannot be listed in the table above);
# imported before the kernel packages' tables are read.
OP_MODULES = ("replayssm_jax.gdn.ops", "replayssm_jax.kda.ops")


def register_op(op: str, reference_fn) -> None:
  """Adds op `op` with its pure-JAX reference as entry "reference" (kept if
  the op exists already)."""
  _REGISTRY.setdefault(op, {}).setdefault(
      "reference", Implementation("reference", reference_fn, priority=-1))


def register_implementation(op: str, impl: Implementation) -> None:
  """Adds (or replaces) the entry `impl.name` of `op`."""
  if op not in _REGISTRY:
    raise ValueError(f"op must be one of {sorted(_REGISTRY)}, got {op!r}.")
  _REGISTRY[op][impl.name] = impl


def implementations(op: str) -> tuple[str, ...]:
  """Registered implementation names of `op`, fastest first."""
  _load_plugins()
  impls = sorted(_REGISTRY[op].values(), key=lambda i: -i.priority)
  return tuple(i.name for i in impls)


def _load_plugins() -> None:
  """Imports the kernel packages once and registers their tables."""
  global _plugins_loaded
  if _plugins_loaded:
    return
  _plugins_loaded = True
  for module in OP_MODULES:
    importlib.import_module(module)
  for module in PLUGINS:
    try:
      table = importlib.import_module(module).IMPLEMENTATIONS
    except (ImportError, AttributeError) as e:  # e.g. jax without Pallas.
      _plugin_errors[module] = f"{type(e).__name__}: {e}"
      logging.warning("replayssm_jax: kernels in %s unavailable: %s", module,
                      e)
      continue
    for op, impl in table:
      register_implementation(op, impl)


def dispatch(op: str, implementation: str | None, config, args: dict):
  """Runs `op` (validated args) with the chosen implementation, per shard
  under `jax.set_mesh` (`per_shard.call`)."""
  _, fn = _choose(op, implementation, config, args)
  return per_shard.call(op, fn, args)


def dispatch_rows(op: str, implementation: str | None, config, args: dict,
                  rows, state_args: tuple[str, ...],
                  returns_state: bool = True):
  """`dispatch` of a row-indexed op (`replayssm_jax.slots`): the args named
  in `state_args` hold a pool's capacity rows, the other batch-leading args
  k token rows, `rows` [k] their slots (already `slots.effective`). An
  implementation that takes the slots itself (`Implementation.rows`) gets
  them as `rows=`; any other runs on the gathered rows. returns_state: the
  op returns (out, new state of its one state arg), scattered back."""
  if rows is None:
    return dispatch(op, implementation, config, args)
  if per_shard.active_mesh() is not None:
    raise NotImplementedError(
        f"{op}: rows (a slot per row) under a device mesh; gather the rows "
        f"first, or run without the mesh.")
  impl, fn = _choose(op, implementation, config, args)
  if impl.rows:
    res = fn(**args, rows=rows)
    if returns_state:
      return slots.nan_pad(res[0], rows), res[1]
    return jax.tree.map(lambda o: slots.nan_pad(o, rows), res)
  state = tuple(args[n] for n in state_args)
  if returns_state:
    (state,) = state
  def run(st):
    return fn(**{**args, **dict(zip(state_args,
                                    (st,) if returns_state else st))})
  return slots.on_rows(run, state, rows, returns_state=returns_state)


def _choose(op: str, implementation: str | None, config, args: dict):
  """(entry, callable with config bound) of `op` for these args."""
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
      return impl, impl.fn
    if "config" not in inspect.signature(impl.fn).parameters:
      raise ValueError(f"{op}: implementation {implementation!r} takes no "
                       f"config, got {config!r}.")
    return impl, functools.partial(impl.fn, config=config)
  if config is not None:
    raise ValueError("config can only be given with a named implementation.")
  for name in implementations(op):
    impl = table[name]
    if impl.preferred() and impl.supports(**args) is None:
      return impl, impl.fn
  raise AssertionError("unreachable: the reference supports every input")


# ------------------------------------------------- replay ops' arguments
def invalid_rows(rstate: ReplayState, rows=None):
  """[batch] bool: rows whose counter is outside [0, L) (the traced-value
  policy's marker: such rows output NaN); with `rows` ([k] effective
  slots of a step through slots) [k]: those of the stepped slots (a
  padding row: False)."""
  bad = (rstate.count < 0) | (rstate.count >= rstate.buffer_len)
  return bad if rows is None else slots.gather(bad, rows) & (rows >= 0)


def policy_args(rstate: ReplayState, policy, layer) -> dict:
  """The policy and layer arguments of a replay op's implementation
  (validated): none for a plain state without counters, so implementations
  that take no policy still run it."""
  policy = resolve_policy(rstate, policy)
  check_layer(layer)
  if policy.plain and rstate.step is None:
    return {}
  return dict(policy=policy, layer=layer)


def resolve_policy(rstate: ReplayState,
                   policy: P.PrecisionPolicy | None) -> P.PrecisionPolicy:
  """The policy of a step: `policy` checked against the state, or (None)
  the round-to-nearest policy implied by the state's dtypes."""
  return P.resolve_policy(
      policy, jnp.dtype(rstate.checkpoint.dtype).name,
      jnp.dtype(rstate.x_buf.dtype).name,
      None if rstate.read_copy is None
      else jnp.dtype(rstate.read_copy.dtype).name,
      rstate.step is not None,
      "ReplayState.create/from_ssm_state(..., policy=policy)")


def check_layer(layer):
  """`layer` (keys stochastic rounding): an int >= 0 or an integer scalar
  array (e.g. traced under a scan over layers)."""
  if isinstance(layer, (bool, np.bool_)):
    raise TypeError(f"layer must be an int >= 0, got {layer!r}.")
  if isinstance(layer, (int, np.integer)):
    if layer < 0:
      raise ValueError(f"layer must be an int >= 0, got {layer}.")
    return
  if (not hasattr(layer, "dtype") or jnp.ndim(layer) != 0
      or not jnp.issubdtype(layer.dtype, jnp.integer)):
    raise TypeError(f"layer must be an int >= 0 or an integer scalar "
                    f"array, got {layer!r}.")
