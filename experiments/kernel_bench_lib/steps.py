"""The decode steps the kernel benchmark times, and its kernel variants
("pallas:<name>" runs a tuned config)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import replayssm_jax
from replayssm_jax import precision

BASELINE_OP = "selective_state_update"
REPLAY_OP = "replay_state_update"


def _plain_dict(d) -> dict:
  return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def _tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------ steps
# Tuned variants of the Pallas kernels, timed as implementation
# "pallas:<name>": name -> keyword arguments of pallas_kernels.SSUConfig
# (baseline) / ReplayConfig (replay), and "pallas_mosaic_gpu:<name>":
# MosaicSSUConfig (baseline). Filled from config.ssu_variants,
# config.replay_variants and config.mosaic_variants.
_VARIANTS: dict[str, dict[str, dict]] = {}
MOSAIC = "pallas_mosaic_gpu"


def _split_policy(impl: str):
  """"<impl>@<policy preset>" -> ("<impl>", PrecisionPolicy); else (impl,
  None). A replay implementation with a policy runs states stored as the
  policy says (master, read copy, buffers, stochastic rounding)."""
  impl, _, name = impl.partition("@")
  return impl, (precision.PrecisionPolicy.preset(name) if name else None)


def _state_dtypes(impl: str, checkpoint_dtype, buffer_dtype):
  """(policy, checkpoint dtype, buffer dtype, read-copy dtype) of the states
  `impl` runs: a policy's own dtypes, else the given ones (no copy)."""
  _, policy = _split_policy(impl)
  if policy is None:
    return None, checkpoint_dtype, buffer_dtype, None
  return (policy, jnp.dtype(policy.checkpoint_dtype),
          jnp.dtype(policy.buffer_dtype), policy.read_dtype)


def _impl_and_config(op: str, impl: str):
  """"name" -> (name, None); "pallas:<variant>" -> ("pallas", its config)."""
  impl, _ = _split_policy(impl)
  name, _, variant = impl.partition(":")
  if not variant:
    return name, None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  if name == MOSAIC:
    return name, pallas_kernels.MosaicSSUConfig(**_VARIANTS[MOSAIC][variant])
  cls = (pallas_kernels.SSUConfig if op == BASELINE_OP
         else pallas_kernels.ReplayConfig)
  return name, cls(**_VARIANTS[op][variant])


def _step(op: str, state, inp, params, impl):
  """One decode step of `op` ("pallas:<variant>" runs that config)."""
  name, config = _impl_and_config(op, impl)
  kw = {}
  if op == REPLAY_OP:
    kw["policy"] = _split_policy(impl)[1]
  fn = (replayssm_jax.selective_state_update if op == BASELINE_OP
        else replayssm_jax.replay_state_update)
  return fn(state, inp["x"], inp["dt"], params["A"], inp["B"], inp["C"],
            D=params["D"], z=inp["z"], dt_bias=params["dt_bias"],
            dt_softplus=True, implementation=name, config=config, **kw)


def _baseline_step(state, inp, params, impl):
  return _step(BASELINE_OP, state, inp, params, impl)


def _replay_step(rstate, inp, params, impl):
  return _step(REPLAY_OP, rstate, inp, params, impl)
