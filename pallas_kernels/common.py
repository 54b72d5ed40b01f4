"""The kernels' tuning configs and the shared helpers, in one namespace.

The helpers live in `pallas_kernels.triton_utils`, the field checks in
`pallas_kernels.config_base` and each op's config beside its kernels
(`pallas_kernels.<op>`); this module re-exports them (for
`pallas_kernels.verify`) and holds the verify kernels' config.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.attention.kernel import AttentionConfig
from pallas_kernels.config_base import (FOLD_MODES, _check_choice,
                                        _check_count, _check_pow2,
                                        _check_registers, _LaunchConfig)
from pallas_kernels.conv.kernel import ConvConfig
from pallas_kernels.norm.kernel import NormConfig
from pallas_kernels.replay.config import ReplayConfig
from pallas_kernels.ssu.triton import SSUConfig
from pallas_kernels.triton_utils import (F32, capped_name,  # noqa: F401
                                         compute_capability, core_count,
                                         finish_output, fma,
                                         install_register_cap_hook,
                                         load_tile_blocks, on_gpu,
                                         pow2_divisor, quantize_rows,
                                         readouts, register_caps_supported,
                                         resolve_block_p, round_half_even,
                                         suffix_sums)

__all__ = [
    "AttentionConfig", "ConvConfig", "F32", "FOLD_MODES", "NormConfig",
    "ReplayConfig", "SSUConfig", "VerifyConfig", "capped_name",
    "compute_capability", "core_count", "finish_output", "fma",
    "install_register_cap_hook", "load_tile_blocks", "on_gpu",
    "pow2_divisor", "quantize_rows", "readouts", "register_caps_supported",
    "resolve_block_p", "round_half_even", "suffix_sums", "_LaunchConfig",
    "_check_choice", "_check_count", "_check_pow2", "_check_registers",
]


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
  """Tuning of the speculative verify kernels (`pallas_kernels.verify`).
  Every field None is filled on its own by `verify.plan_verify` from the
  state's shapes and dtypes and the device; a field set keeps its value.

  Attributes:
    block_p: headdim rows per program of both kernels (a power of two);
      None: `verify.default_block_p`.
    num_warps: Triton warps per program of the window kernel; None: 4.
    num_stages: Triton pipelining stages of both kernels; None: 1.
    fold: how the fold kernel sums the committed history into the
      checkpoint: "rank1" (exact f32 rank-1 updates), or one tensor-core
      dot (buffer_len and block_p >= 16), "dot_tf32x3" (3xTF32) or
      "dot_bf16x3" / "dot_bf16x2" (the weighted x split in three / two bf16
      pieces against a bf16 B buffer; `replay.fold_product`). None: as the
      replay step's flush: rank-1 below 16-row tiles, else the bf16 split
      where B is bf16 (three pieces on an f32 master, two on a 16-bit one),
      else 3xTF32.
    fold_num_warps: Triton warps per program of the fold kernel; None: 2.
    readout_chunk: the window kernel loads the checkpoint tile in
      [block_p, readout_chunk] column blocks, summed elementwise before one
      reduction per window position (a narrower block spans fewer lanes of
      a warp along dstate: fewer cross-lane shuffles per reduction); a
      power of two, dstate or more for the whole row; None: 32.
  """
  FOLDS = ("rank1", "dot_tf32x3", "dot_bf16x3", "dot_bf16x2")
  block_p: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  fold: str | None = None
  fold_num_warps: int | None = None
  readout_chunk: int | None = None

  def __post_init__(self):
    for name in ("block_p", "num_warps", "fold_num_warps", "readout_chunk"):
      if getattr(self, name) is not None:
        _check_pow2(name, getattr(self, name))
    _check_count("num_stages", self.num_stages)
    _check_choice("fold", self.fold, self.FOLDS, optional=True)


