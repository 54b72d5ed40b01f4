"""Pallas GPU kernels for the Mamba-2 decode step (baseline and ReplaySSM).

`IMPLEMENTATIONS` lists implementation "pallas" of
`replayssm_jax.selective_state_update`, `replayssm_jax.replay_state_update`,
`replayssm_jax.replay_verify`, `replayssm_jax.baseline_verify`,
`replayssm_jax.ops.decode_attention`, `replayssm_jax.ops.causal_conv1d_step`,
`replayssm_jax.ops.causal_conv1d_window`, `replayssm_jax.ops.gated_rms_norm`,
`replayssm_jax.ops.add_rms_norm` and the Gated DeltaNet ops `gdn_step`,
`gdn_replay_step`, `gdn_replay_verify` (`pallas_kernels.gdn`); the dispatcher
(`replayssm_jax.dispatch`) imports this package on first use and registers
that table (this package does not import the dispatcher). The kernels use
the Pallas Triton backend on GPU and Pallas interpret mode elsewhere, so the same kernel
code runs in CPU tests. The Mosaic GPU baseline kernel
(`pallas_kernels.ssu.mosaic`, Hopper and later) registers beside it as
implementation "pallas_mosaic_gpu" of `selective_state_update`;
`implementation=None` does not pick it (within 0-4% of the Triton kernel
on the H200, without an in-place state update: `ssu/mosaic.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import attention as attention_kernel
from pallas_kernels import conv as conv_kernel
from pallas_kernels import gdn as gdn_kernel
from pallas_kernels import norm as norm_kernel
from pallas_kernels import replay as replay_kernel
from pallas_kernels import ssu as ssu_kernel
from pallas_kernels import triton_utils
from pallas_kernels import verify as verify_kernel
from pallas_kernels.attention import AttentionConfig
from pallas_kernels.conv import ConvConfig
from pallas_kernels.gdn import GDNConfig
from pallas_kernels.norm import NormConfig
from pallas_kernels.replay import ReplayConfig
from pallas_kernels.ssu import MosaicSSUConfig, SSUConfig
from pallas_kernels.ssu import mosaic as mosaic_kernel
from pallas_kernels.triton_utils import on_gpu
from pallas_kernels.verify import VerifyConfig
from replayssm_jax import precision as P
from replayssm_jax.registry import Implementation


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


def _replay_supports(rstate, policy=None, **_):
  return (triton_utils.precision_problem(rstate, policy)
          or _shape_problem(rstate.headdim, rstate.dstate,
                            rstate.buffer_len))


def _verify_supports(rstate, x, policy=None, **_):
  problem = (triton_utils.precision_problem(rstate, policy)
             or _shape_problem(rstate.headdim, rstate.dstate,
                               rstate.buffer_len))
  if problem is None and not _pow2(x.shape[1]):
    problem = (f"the window length T = {x.shape[1]} is not a power of two "
               f"(Triton block shapes must be); use "
               f"implementation='reference'.")
  return problem


def _snapshot_verify(*, config=None, **args):
  return ssu_kernel.baseline_verify(
      **args, config=config or SSUConfig(), interpret=not on_gpu())


def _ssu(*, config=None, **args):
  return ssu_kernel.selective_state_update(
      **args, config=config or SSUConfig(), interpret=not on_gpu())


def _mosaic_supports(ssm_state, **_):
  cc = triton_utils.compute_capability()
  if cc is not None and cc < (9, 0):
    return (f"the Mosaic GPU kernel needs compute capability >= 9.0 (TMA, "
            f"Hopper; this GPU: {cc[0]}.{cc[1]}); use implementation="
            f"'pallas'.")
  return mosaic_kernel.shape_problem(ssm_state, on_gpu=on_gpu())


def _mosaic_ssu(*, config=None, **args):
  return mosaic_kernel.selective_state_update(
      **args, config=config or MosaicSSUConfig(), interpret=not on_gpu())


def _replay(*, config=None, **args):
  return replay_kernel.replay_state_update(
      **args, config=config or ReplayConfig(), interpret=not on_gpu())


def _attention_supports(q, k_cache, **_):
  return attention_kernel.shape_problem(q.shape[-1], k_cache.shape[2],
                                        AttentionConfig())


def _attention(*, config=None, **args):
  return attention_kernel.decode_attention(
      **args, config=config or AttentionConfig(), interpret=not on_gpu())


def _conv_supports(conv_state, weight, split=None, **_):
  sizes = (conv_state.shape[-1],) if split is None else tuple(split)
  return conv_kernel.shape_problem(sizes, weight.shape[1], ConvConfig())


def _conv(*, config=None, **args):
  return conv_kernel.causal_conv1d_step(
      **args, config=config or ConvConfig(), interpret=not on_gpu())


def _conv_window(*, config=None, **args):
  return conv_kernel.causal_conv1d_window(
      **args, config=config or ConvConfig(), interpret=not on_gpu())


def _norm_supports(group_size, **_):
  return norm_kernel.shape_problem("group_size", group_size)


def _norm(*, config=None, **args):
  return norm_kernel.gated_rms_norm(
      **args, config=config or NormConfig(), interpret=not on_gpu())


def _add_norm_supports(x, **_):
  return norm_kernel.shape_problem("d", x.shape[-1],
                                   "one Triton block per row")


def _add_norm(*, config=None, **args):
  return norm_kernel.add_rms_norm(
      **args, config=config or NormConfig(), interpret=not on_gpu())


def _verify(*, config=None, **args):
  return verify_kernel.replay_verify(
      **args, config=config or VerifyConfig(), interpret=not on_gpu())


def _x32(fn):
  """fn traced with 64-bit types off (`JAX_ENABLE_X64=1` would make the
  kernels' Python-int indices int64 beside int32 program ids, which Pallas
  refuses); the kernels take and return 32-bit and narrower types only."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.enable_x64(False):
      return fn(*args, **kwargs)
  return wrapped


def _gdn_step(*, config=None, **args):
  return gdn_kernel.gdn_step(**args, config=config, interpret=not on_gpu())


def _gdn_replay(*, config=None, **args):
  return gdn_kernel.gdn_replay_step(**args, config=config,
                                    interpret=not on_gpu())


def _gdn_verify(*, config=None, **args):
  return gdn_kernel.gdn_replay_verify(**args, config=config,
                                      interpret=not on_gpu())


# The table the dispatcher registers: (op, Implementation) pairs. The
# Pallas kernels are the dispatcher's default on a GPU (priority 10); the
# Mosaic GPU baseline kernel runs only on request.
# `ROWS`: the ops whose kernels take a slot per row (`replayssm_jax.slots`).
ROWS = ("selective_state_update", "replay_state_update", "decode_attention",
        "gdn_step", "gdn_replay_step")
IMPLEMENTATIONS = tuple(
    (op, Implementation("pallas", _x32(fn), supports=supports,
                        preferred=on_gpu, priority=10, rows=op in ROWS))
    for op, fn, supports in (
        ("replay_verify", _verify, _verify_supports),
        ("baseline_verify", _snapshot_verify, _ssu_supports),
        ("selective_state_update", _ssu, _ssu_supports),
        ("replay_state_update", _replay, _replay_supports),
        ("decode_attention", _attention, _attention_supports),
        ("gated_rms_norm", _norm, _norm_supports),
        ("add_rms_norm", _add_norm, _add_norm_supports),
        ("causal_conv1d_step", _conv, _conv_supports),
        ("causal_conv1d_window", _conv_window, _conv_supports),
        ("gdn_step", _gdn_step, gdn_kernel.step_problem),
        ("gdn_replay_step", _gdn_replay, gdn_kernel.replay_problem),
        ("gdn_replay_verify", _gdn_verify, gdn_kernel.verify_problem))) + (
    ("selective_state_update",
     Implementation("pallas_mosaic_gpu", _x32(_mosaic_ssu),
                    supports=_mosaic_supports, preferred=lambda: False,
                    priority=5)),)

__all__ = ["IMPLEMENTATIONS", "AttentionConfig", "ConvConfig", "GDNConfig",
           "MosaicSSUConfig", "NormConfig", "ReplayConfig", "SSUConfig",
           "VerifyConfig", "on_gpu", "triton_utils"]
