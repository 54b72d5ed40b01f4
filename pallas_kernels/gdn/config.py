"""Tuning of the GDN kernels and the checks that refuse what they cannot
run (by name, so the dispatcher falls back to the reference or says why).

The defaults are untuned: the GDN kernels have been run in interpret mode
only (no GPU measurement backs a value yet).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _check_pow2
from replayssm_jax import precision as P

# The longest window the verify kernel takes (it unrolls the forward
# substitution in registers).
MAX_VERIFY_WINDOW = 8


@dataclasses.dataclass(frozen=True)
class GDNConfig:
  """Launch fields of the GDN kernels (`pallas_kernels.gdn`).

  Attributes:
    block_v: value columns per program (the state tile is [key_dim,
      block_v]); None: `default_block_v`. A replay state with a read copy
      or stochastic rounding needs whole rows (block_v = value_dim: the
      copy's scales and the random bits' element indices span a row).
    num_warps: Triton warps per program; None: `default_num_warps`.
    num_stages: Triton pipelining stages.
  """
  block_v: int | None = None
  num_warps: int | None = None
  num_stages: int = 1

  def __post_init__(self):
    for name in ("block_v", "num_warps"):
      if getattr(self, name) is not None:
        _check_pow2(name, getattr(self, name))
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages must be an int >= 1, got "
                       f"{self.num_stages!r}.")


@dataclasses.dataclass(frozen=True)
class GDNPlan:
  """A GDNConfig resolved for one call."""
  block_v: int
  num_warps: int
  num_stages: int


def default_block_v(key_dim: int, value_dim: int) -> int:
  """Tiles of about 2048 elements ([key_dim, block_v]), as the Mamba-2
  baseline kernel's [16, 128] tiles (untuned for GDN)."""
  return max(1, min(value_dim, 2048 // key_dim))


def default_num_warps(key_dim: int, block_v: int) -> int:
  """4 warps up to 4096 tile elements, 8 above (untuned)."""
  return 4 if key_dim * block_v <= 4096 else 8


def pow2_problem(**sizes) -> str | None:
  """Why a shape is refused (Triton blocks are powers of two), or None."""
  for name, v in sizes.items():
    if v < 1 or v & (v - 1):
      return (f"{name} = {v} is not a power of two (Triton block shapes "
              f"must be); use implementation='reference'.")
  return None


def plan(config: GDNConfig | None, key_dim: int, value_dim: int,
         whole_rows: bool = False) -> GDNPlan:
  """The plan of config for a [.., key_dim, value_dim] state; whole_rows:
  the call needs block_v = value_dim (refused by name otherwise)."""
  config = config or GDNConfig()
  if config.block_v is None:
    bv = value_dim if whole_rows else default_block_v(key_dim, value_dim)
  else:
    bv = min(config.block_v, value_dim)
  if value_dim % bv:
    raise NotImplementedError(
        f"GDNConfig.block_v ({bv}) must divide value_dim ({value_dim}).")
  if whole_rows and bv != value_dim:
    raise NotImplementedError(
        f"GDNConfig.block_v={config.block_v} does not apply: a replay "
        f"state with a read copy or stochastic rounding stores whole "
        f"checkpoint rows (block_v = value_dim = {value_dim}); leave "
        f"block_v None.")
  warps = config.num_warps or default_num_warps(key_dim, bv)
  return GDNPlan(block_v=bv, num_warps=warps, num_stages=config.num_stages)


def step_problem(state, **_) -> str | None:
  """`Implementation.supports` of the baseline step kernel."""
  return pow2_problem(key_dim=state.shape[2], value_dim=state.shape[3])


def replay_problem(rstate, policy=None, **_) -> str | None:
  """`Implementation.supports` of the replay step kernel."""
  return (tu.precision_problem(rstate, policy)
          or pow2_problem(key_dim=rstate.checkpoint.shape[2],
                          value_dim=rstate.checkpoint.shape[3],
                          buffer_len=rstate.d_buf.shape[1]))


def verify_problem(rstate, q, policy=None, **_) -> str | None:
  """`Implementation.supports` of the verify kernels (q: [batch, T, ...])."""
  T = q.shape[1]
  if T > MAX_VERIFY_WINDOW:
    return (f"the window length T = {T} exceeds {MAX_VERIFY_WINDOW} (the "
            f"verify kernel unrolls the forward substitution in "
            f"registers); use implementation='reference'.")
  return replay_problem(rstate, policy)
