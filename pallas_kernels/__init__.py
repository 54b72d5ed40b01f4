"""Pallas GPU kernels for the Mamba-2 decode step (baseline and ReplaySSM).

Importing this package registers implementation "pallas" for
`replayssm_jax.selective_state_update`, `replayssm_jax.replay_state_update`
and `replayssm_jax.replay_verify`
(the dispatcher imports it lazily on first use). The kernels use the Pallas
Triton backend on GPU and Pallas interpret mode elsewhere, so the same kernel
code runs in CPU tests. A Mosaic GPU variant would register beside it under
its own name (e.g. "pallas_mosaic_gpu") with the same signature.
"""

from __future__ import annotations

import jax

from pallas_kernels import common
from pallas_kernels import replay as replay_kernel
from pallas_kernels import ssu as ssu_kernel
from pallas_kernels import verify as verify_kernel
from pallas_kernels.common import ReplayConfig, SSUConfig, VerifyConfig
from replayssm_jax import ops as _ops


def on_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def _pow2(v: int) -> bool:
  return v >= 1 and not v & (v - 1)


def _shape_problem(headdim: int, dstate: int, buffer_len: int = 1):
  """Triton block shapes must be powers of two."""
  for name, v in (("headdim", headdim), ("dstate", dstate),
                  ("buffer_len", buffer_len)):
    if not _pow2(v):
      return (f"{name} = {v} is not a power of two (Triton block shapes "
              f"must be); use implementation='reference'.")
  return None


def _ssu_supports(ssm_state, **_):
  return _shape_problem(ssm_state.shape[2], ssm_state.shape[3])


def _precision_problem(rstate, policy=None):
  """The kernels store neither read copies nor stochastic-rounding state."""
  if (getattr(rstate, "read_copy", None) is not None
      or getattr(rstate, "step", None) is not None
      or getattr(policy, "stochastic_rounding", False)):
    return ("the state has a read copy or stochastic-rounding counters (a "
            "PrecisionPolicy with read_dtype or stochastic_rounding), which "
            "the Pallas kernels do not support yet; use "
            "implementation='reference'.")
  return None


def _replay_supports(rstate, policy=None, **_):
  return (_precision_problem(rstate, policy)
          or _shape_problem(rstate.headdim, rstate.dstate,
                            rstate.buffer_len))


def _verify_supports(rstate, x, **_):
  problem = _shape_problem(rstate.headdim, rstate.dstate, rstate.buffer_len)
  if problem is None and not _pow2(x.shape[1]):
    problem = (f"the window length T = {x.shape[1]} is not a power of two "
               f"(Triton block shapes must be); use "
               f"implementation='reference'.")
  return problem


def _ssu(*, config=None, **args):
  return ssu_kernel.selective_state_update(
      **args, config=config or SSUConfig(), interpret=not on_gpu())


def _replay(*, config=None, **args):
  return replay_kernel.replay_state_update(
      **args, config=config or ReplayConfig(), interpret=not on_gpu())


def _verify(*, config=None, **args):
  return verify_kernel.replay_verify(
      **args, config=config or VerifyConfig(), interpret=not on_gpu())


_ops.register_implementation(
    "replay_verify",
    _ops.Implementation("pallas", _verify, supports=_verify_supports,
                        preferred=on_gpu, priority=10))
_ops.register_implementation(
    "selective_state_update",
    _ops.Implementation("pallas", _ssu, supports=_ssu_supports,
                        preferred=on_gpu, priority=10))
_ops.register_implementation(
    "replay_state_update",
    _ops.Implementation("pallas", _replay, supports=_replay_supports,
                        preferred=on_gpu, priority=10))

__all__ = ["ReplayConfig", "SSUConfig", "VerifyConfig", "common", "on_gpu"]
