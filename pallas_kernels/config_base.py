"""Field checks shared by the kernel configs, and the launch fields of
the Triton kernel configs."""

from __future__ import annotations

import dataclasses


def _check_pow2(name, v):
  if not isinstance(v, int) or v < 1 or v & (v - 1):
    raise ValueError(f"{name} must be a power of two >= 1, got {v!r}.")


# How a fold sums its tokens' rank-1 terms (ReplayConfig.flush_fold,
# VerifyConfig.fold).
FOLD_MODES = ("rank1", "dot_tf32x3", "dot_bf16x3", "dot_bf16x2")


def _check_choice(name, v, choices, optional=False):
  if not (optional and v is None) and v not in choices:
    raise ValueError(f"{name} must be one of {choices}"
                     f"{' or None' if optional else ''}, got {v!r}.")


def _check_count(name, v):
  """None or a positive int."""
  if v is not None and (not isinstance(v, int) or v < 1):
    raise ValueError(f"{name} must be None or an int >= 1, got {v!r}.")


def _check_registers(name, v):
  """None or a multiple of 8 in [24, 256] (PTX .maxnreg)."""
  if v is not None and (not isinstance(v, int) or v % 8 or not 24 <= v
                        <= 256):
    raise ValueError(f"{name} must be None or a multiple of 8 in [24, 256] "
                     f"(registers per thread), got {v!r}.")


@dataclasses.dataclass(frozen=True)
class _LaunchConfig:
  """Fields and checks shared by the kernel configs."""
  block_p: int | None = None
  num_warps: int = 4
  num_stages: int = 1
  # Whether num_warps=None means a per-call default (ReplayConfig).
  _default_num_warps = False

  def __post_init__(self):
    if self.block_p is not None:
      _check_pow2("block_p", self.block_p)
    if self.num_warps is not None or not self._default_num_warps:
      _check_pow2("num_warps", self.num_warps)
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}.")
