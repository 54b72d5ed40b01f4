"""The verify kernels' tuning config and its planning: `plan_verify` fills
each field left None on its own from the state's shapes and dtypes and the
device."""

from __future__ import annotations

import dataclasses

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _check_choice, _check_count, _check_pow2
from pallas_kernels.replay.config import default_block_p as _step_block_p
from pallas_kernels.replay.fold import flush_programs, fold_dot


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
      pieces against a bf16 B buffer; `replay.fold.fold_product`). None: as the
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


def default_block_p(batch: int, nheads: int, headdim: int) -> int:
  """The replay step's heuristic (`replay.config.default_block_p`) capped at 32:
  the window kernel holds T readouts per row of its tile
  (benchmarks/kernel_tuning/verify_window_kernel_h200.json)."""
  return min(32, _step_block_p(batch, nheads, headdim))


DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 1
# The fold kernel is a short persistent loop of dots: 2 warps per program
# (benchmarks/kernel_tuning/verify_window_kernel_h200.json).
DEFAULT_FOLD_NUM_WARPS = 2
# Checkpoint column blocks of the readouts (benchmarks/kernel_tuning/verify_window_kernel_h200.json).
DEFAULT_READOUT_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
  """A `VerifyConfig` with every field resolved for one state (and
  what follows from it), as the kernels launch."""
  block_p: int
  num_warps: int
  num_stages: int
  fold: str  # "rank1" or a dot mode of `VerifyConfig.fold`
  fold_num_warps: int
  readout_chunk: int  # at most dstate
  fold_programs: int  # programs of the persistent fold grid
  fma: bool  # the readouts' multiply-adds as PTX fma (not in interpret mode)


def _fold_mode(form) -> str:
  """The `VerifyConfig.fold` name of a `replay.fold.fold_dot` form."""
  if form is None:
    return "rank1"
  return f"dot_{form}" if isinstance(form, str) else "dot_tf32x3"


def plan_verify(config: VerifyConfig, rstate,
                interpret: bool) -> VerifyPlan:
  """Each field of `config` left None filled on its own from the state's
  shapes and dtypes and the device (`interpret`: Pallas interpret mode on
  the host); explicit fields are kept, and a combination the kernels cannot
  run raises, naming the fields. Only the fold's default reads another
  field: the resolved block_p, since a dot fold needs 16-row tiles."""
  batch, nheads, headdim, dstate = rstate.checkpoint.shape
  block_p = tu.resolve_block_p(
      config.block_p or default_block_p(batch, nheads, headdim), headdim)
  fold = _fold_mode(fold_dot(config.fold, rstate.buffer_len, block_p,
                              interpret, field="config.fold",
                              tile="block_p",
                              b_dtypes=(rstate.b_buf.dtype,),
                              ck_dtype=rstate.checkpoint.dtype))
  fold_warps = config.fold_num_warps or DEFAULT_FOLD_NUM_WARPS
  return VerifyPlan(
      block_p=block_p, num_warps=config.num_warps or DEFAULT_NUM_WARPS,
      num_stages=config.num_stages or DEFAULT_NUM_STAGES, fold=fold,
      fold_num_warps=fold_warps,
      readout_chunk=min(config.readout_chunk or DEFAULT_READOUT_CHUNK,
                        dstate),
      fold_programs=flush_programs(interpret, fold_warps, None),
      fma=not interpret)
