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
class VerifyConfig(_LaunchConfig):
  """Tuning of the speculative verify kernels (one head per program).

  Attributes:
    block_p: headdim rows per program; None = `verify.default_block_p`
      (at most 32).
    num_warps, num_stages: Triton launch parameters.
    fold: how the early flush folds the history: one of FOLD_MODES (as
      ReplayConfig.flush_fold, and the same default).
    copy_readout: how the window kernel reads a state with a read copy
      (rows that folded read the master, the others the copy): "masked"
      (a masked load of each, summed: one source's bytes, both sources'
      loads, converts and adds) or "branch" (a `lax.cond` per program on
      the row's fold: one source's loads and readouts). The replay
      speculative loop with an f32 master + fp8 copy ran slower than with
      plain f32 states on the H200 (session 28: 57.4k against 66.2k
      tokens/s at batch 256, "masked"). H200, hybrid_1b's layer, f32
      master + fp8 copy (session 29, benchmarks/verify_sweep_h200.json
      sweep 15): window kernel 0.272 ms masked, 0.288 branch (0.264 on a
      plain f32 state).
    fold_grid: "persistent" (`fold_programs` programs share out the
      folding rows' items) or "rows" (the window kernel's grid, programs of
      rows that do not fold exit at once).
    fold_programs: program count of the persistent fold grid (None: as
      ReplayConfig.flush_programs, from fold_num_warps and
      fold_max_registers: 4 per SM uncapped; 8 in interpret mode).
    fold_num_warps: Triton warps per program of the early-flush fold
      kernel; None = 2. H200, hybrid_1b's layer at batch 256, T 4
      (benchmarks/verify_sweep_h200.json sweeps 4, 6, 7 and 9, variants
      "w2" / "xla_w2", which ran both verify kernels at 2 warps): the fold
      kernel took 0.062 ms at 2 warps against 0.079-0.080 at 4, where the
      window kernel was slower at 2 (0.301 vs 0.261 ms in sweep 9), so the
      window kernel keeps num_warps.
    fold_max_registers: cap on the registers per thread of the early-flush
      fold kernel (as ReplayConfig.flush_max_registers); None: no cap.
      H200 (session 15, benchmarks/verify_sweep_h200.json sweep 14): 4
      warps capped at 128 took 0.0541 ms per verify against 0.0560 at
      the default 2 uncapped warps (0.5% of the verify iteration).
    precompute: what XLA computes for the window kernel before it runs.
      "none": nothing; every program forms its head's decay weights and
      the B.C products of the history and window against each position's
      C (the group's B buffer is read and reduced once per head and
      headdim block). "bc": the B.C products, per row and group
      (`speculative.verify_bc` as einsums; "bc_reduce", the default until
      session 31: the same as elementwise products summed over dstate, so
      that XLA emits reduction fusions instead of a GEMM fusion, which took
      30 of the ~45 µs of XLA ops per verify in sweeps 6-10; H200 sweep 11,
      session 10: 0.380 vs 0.405 ms per verify on the device, the window
      kernel unchanged at 0.262).
      "terms": everything but the checkpoint (`speculative.verify_terms`:
      decay [b, T, h] and the history and window contributions [b, T, h,
      p]), so the kernel reads the checkpoint tile out against the T
      positions' C and appends the window. H200, hybrid_1b's layer at
      batch 256, T 4, L 16 (benchmarks/verify_sweep_h200.json, sweeps
      3-5): window kernel
      "bc" 0.380 ms at block_p 32 (0.431 at 64), "none" 0.47-0.49;
      "terms" 0.32 at block_p 32, but its XLA ops add ~0.2 ms (verify
      0.58-0.61 vs 0.49-0.52 ms for "bc" on the device; sweeps 5-7).
      Session 30 (sweeps 18-19): "terms" 0.228 against 0.264 for the
      default, so the T readouts, not the history and window terms, are
      most of the kernel; a "weights" form (XLA forming the terms'
      weights, the kernel weighing the inputs) took 0.267 and was removed.
      "terms_reduce" (the default since session 31): "terms" with XLA's
      weighted sums over the slots as elementwise products summed
      (reduction fusions) instead of einsums. H200, session 31
      (benchmarks/verify_sweep_h200.json sweep 20): verify device time
      0.348 ms against 0.358 for "bc_reduce" (window kernel 0.224 against
      0.262; XLA ops ~0.07 against ~0.04) and 0.478 for "terms"; replay
      spec decoding at batch 512 +4% (specdec_bench_h200.json run 35).
      C converted to f32 by XLA before the kernel (fewer SASS instructions
      offline, 1424 against 1520) made the window kernel slower, 0.303 ms
      with either precompute (78-100 registers against 64; 0.276-0.329
      capped at 64 or 80), so C stays in its dtype.
    readout: how the window kernel reads the checkpoint tile out against
      the T positions' C: "reduce" (T dstate reductions) or one tile x C^T
      dot over the positions padded to 16, "dot_tf32x3" (3xTF32, about f32
      accuracy) or "dot_f32" (IEEE f32); the dots need block_p, dstate >=
      16. "xla": XLA reads the checkpoint out (`speculative.verify_readout`,
      one f32 [h/g * p, n] x [n, T] product per row and group) and the
      kernel does not read the checkpoint. H200 (sweeps 6-7, session 9),
      against "reduce" over the whole dstate (window kernel 0.35 ms, 0.49
      per verify): the dots are slower (0.70 ms for 3xTF32, 1.49 for f32,
      0.56 at block_p 64); "xla" takes the kernel to 0.16 ms, but XLA's
      product adds 0.19 (0.51 per verify). Session 33 (sweep 22, against
      0.224 ms for "reduce" at the terms_reduce default): bf16 dots of the
      f32 tile split in two / three bf16 pieces against C in bf16
      (`replay.split_dot`; fewer SASS instructions per state element
      offline at block_p 64) took 0.284 ms at block_p 32, 0.250 / 0.307 at
      64, 0.438 at 64 with 8 warps (85-130 registers against 64); removed.
    readout_chunk: with "reduce" (ignored otherwise), the checkpoint tile
      is loaded and multiplied in [block_p, readout_chunk] column blocks
      that are summed elementwise before one reduction per position; a
      narrower block spans fewer lanes of a warp along dstate, so each
      reduction takes fewer cross-lane shuffles (a [block_p, 128] f32 tile
      spans all 32 lanes: 5 shuffle rounds per row; 32 columns span 8
      lanes: 3 rounds). None: the whole dstate at once. H200 (sweeps
      8-10): window kernel 0.26 ms at 32 (the default; 0.40 per verify),
      0.28 at 16 and 64, 0.35-0.38 with the whole dstate.
    readout_fma: with "reduce" (ignored otherwise), the products of the
      column blocks are accumulated by explicit PTX multiply-adds
      (`common.fma`; plain ops in interpret mode): XLA's Triton on the H200
      emits most multiply + add pairs of the kernel as two instructions
      (Nsight Compute, session 30: 68.6M unfused against 14.7M fused f32
      pairs per launch). H200, session 33 (benchmarks/verify_sweep_h200.json
      sweep 22, one machine): window kernel 0.218 ms (min-max 0.217-0.220)
      against 0.224 (0.223-0.225) without, verify 0.343 against 0.349 ms on
      the device; the default since. At 16-column blocks 0.235.
    max_registers: cap on the registers per thread of the window kernel
      (as `ReplayConfig.max_registers`); None: no cap. H200, hybrid_1b's
      layer at batch 256, T 4, L 16 (session 29,
      benchmarks/verify_sweep_h200.json sweep 17): 0.265 ms at 64, 0.301
      at 80, 0.313 at 96, against 0.264 uncapped.

  One warp per program (half the default's instructions per tile) took
  0.35-0.42 ms (session 30, sweep 19: 255 registers, or spills when
  capped), so num_warps stays 4.

  The window kernel forms the T positions' outputs one position at a time
  (a readout and two term reductions each). With the positions as a tile
  axis instead (one reduction each over [T, block_p, chunk], [L, T,
  block_p] and [T, T, block_p] products; session 29, sweep 16, since
  removed) it took 0.307 ms against 0.262 (0.267-0.511 at other blocks
  and warps).
  """
  fold: str | None = None
  copy_readout: str = "masked"
  fold_grid: str = "persistent"
  fold_programs: int | None = None
  fold_num_warps: int | None = None
  fold_max_registers: int | None = None
  precompute: str = "terms_reduce"
  readout: str = "reduce"
  readout_chunk: int | None = 32
  readout_fma: bool = True
  max_registers: int | None = None

  def __post_init__(self):
    super().__post_init__()
    _check_registers("max_registers", self.max_registers)
    _check_choice("precompute", self.precompute,
                  ("none", "bc", "bc_reduce", "terms", "terms_reduce"))
    _check_choice("readout", self.readout,
                  ("reduce", "dot_tf32x3", "dot_f32", "xla"))
    _check_choice("fold", self.fold, FOLD_MODES, optional=True)
    _check_choice("copy_readout", self.copy_readout, ("masked", "branch"))
    _check_choice("fold_grid", self.fold_grid, ("rows", "persistent"))
    _check_count("fold_programs", self.fold_programs)
    if self.fold_num_warps is not None:
      _check_pow2("fold_num_warps", self.fold_num_warps)
    _check_registers("fold_max_registers", self.fold_max_registers)
    if self.readout_chunk is not None:
      _check_pow2("readout_chunk", self.readout_chunk)
