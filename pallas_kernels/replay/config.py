"""The replay step's tuning config and its plan: every field resolved from
the state's shapes and dtypes and the device, each default on its own.

A default depends on the state, the device and, where a route needs it, on
the resolved value of the route fields before it (output_route, then
flush_route, then fused_launch, then flush_grid); never on whether another
field was set. A field that does not apply to the routes so resolved is
refused by name. Every heuristic below names the result file that
measured it; the variants that are not fields: benchmarks/VARIANTS.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import (FOLD_MODES, _check_choice,
                                        _check_count, _check_pow2,
                                        _check_registers)
from pallas_kernels.replay import fold
from pallas_kernels.replay.mosaic_flush import default_fold_pieces
from pallas_kernels.replay.program import CopySpec, copy_spec
from pallas_kernels.replay.split import READOUT_WARPS, split_problem
from pallas_kernels.ssu.mosaic import counts_fit_tma, shape_problem

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """Tuning of the replay step's kernels (`pallas_kernels.replay`).

  Every field None is filled by `plan_replay_step` from the state's shapes
  and dtypes and the device, each on its own: setting a field never
  changes another field's default, and a field that does not apply to the
  routes the others resolve to is refused by name.

  Attributes:
    block_p: headdim rows per output-route program (state tile [block_p,
      dstate]); None: `default_block_p`.
    num_warps: Triton warps per program of the output route (of the
      readout kernel on the split route, of the one kernel with
      fused_launch); None: `default_num_warps`.
    num_stages: Triton pipelining stages of the Triton kernels; None: 1
      (the split route's readout: Triton's default).
    heads_per_program: heads of one B/C group per output-route program
      (their B.C products are formed once); None: 1. The split route reads
      one head per program.
    output_route: "triton" (one kernel: readout, window terms, appends) or
      "split" (the readout y0 = S C by one kernel, then the window terms,
      appends and counters by a (group, row) kernel); None:
      `default_output_route`.
    flush_route: "triton" (the Triton flush kernels) or "mosaic_gpu" (the
      Mosaic GPU fold, `mosaic_flush.flush`, before the Triton output route;
      plain states, separate launches); None: `default_flush_route`.
    fused_launch: both routes in one Triton launch (plain states, Triton
      routes); None: `default_fused_launch`.
    flush_grid: "persistent" (a fixed number of programs share out the
      flush rows' (row, head, headdim block) items) or "rows" (the output
      route's grid; programs of non-flush rows exit at once); None:
      `default_flush_grid`.
    flush_fold: how the flush sums its tokens' rank-1 terms, one of
      FOLD_MODES: "rank1" (f32 rank-1 updates), "dot_tf32x3" (one 3xTF32
      tensor-core dot), "dot_bf16x3" / "dot_bf16x2" (bf16 dots of the
      weighted x in 3 / 2 bf16 pieces against a bf16 B, `fold_product`);
      the dot modes need buffer_len, block_p >= 16. None:
      `fold.default_fold_mode` (Mosaic: `mosaic_flush.default_fold_pieces`).
    flush_num_warps, flush_max_registers: warps and register cap (PTX
      .maxnreg, `triton_utils.capped_name`; 256: no cap) of the separate
      Triton flush kernel; None: `default_flush_launch`.
    max_registers: register cap of the output-route kernel (the split
      route's readout kernel, the fused kernel); None: no cap.
  """
  block_p: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  heads_per_program: int | None = None
  output_route: str | None = None
  flush_route: str | None = None
  fused_launch: bool | None = None
  flush_grid: str | None = None
  flush_fold: str | None = None
  flush_num_warps: int | None = None
  flush_max_registers: int | None = None
  max_registers: int | None = None

  def __post_init__(self):
    for name in ("block_p", "num_warps", "flush_num_warps"):
      if getattr(self, name) is not None:
        _check_pow2(name, getattr(self, name))
    _check_count("num_stages", self.num_stages)
    _check_count("heads_per_program", self.heads_per_program)
    _check_choice("output_route", self.output_route, ("triton", "split"),
                  optional=True)
    _check_choice("flush_route", self.flush_route, ("triton", "mosaic_gpu"),
                  optional=True)
    if self.fused_launch not in (None, False, True):
      raise ValueError(f"fused_launch must be None or a bool, got "
                       f"{self.fused_launch!r}.")
    _check_choice("flush_grid", self.flush_grid, ("rows", "persistent"),
                  optional=True)
    _check_choice("flush_fold", self.flush_fold, FOLD_MODES, optional=True)
    _check_registers("flush_max_registers", self.flush_max_registers)
    _check_registers("max_registers", self.max_registers)


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
  """A ReplayConfig with every field resolved for one state and device
  (fields that do not apply to the resolved routes are None), plus the
  values the kernels take that are not fields.

  Attributes (besides ReplayConfig's):
    copy_spec: the flush's read-copy / stochastic-rounding stores
      (`program.CopySpec`; None: a plain state).
    fold_dot: the Triton fold's form (`fold.fold_dot`; None: rank-1).
    flush_num_stages: pipelining stages of the separate Triton flush.
    flush_programs: programs of a persistent flush grid (Triton: as many
      per SM as the register cap leaves room for, `fold.flush_programs`;
      the fused launch 4 per SM; Mosaic: 2 CTAs per SM); None otherwise.
    flush_heads_per_program: heads per flush program (Triton rows grid:
      heads_per_program; Mosaic: 4 per CTA, or the largest power of two
      below dividing nheads).
    mosaic_fold_pieces: the Mosaic fold's bf16 pieces (0: rank-1).
    mosaic_store_from_input: the Mosaic flush stores each new tile from
      its input tile's shared memory (half the shared memory per CTA, so
      two CTAs share an SM).
    mosaic_stages: tiles in flight per Mosaic CTA.
  """
  block_p: int
  num_warps: int
  num_stages: int | None
  heads_per_program: int
  output_route: str
  flush_route: str
  fused_launch: bool
  flush_grid: str
  flush_fold: str
  flush_num_warps: int | None
  flush_max_registers: int | None
  max_registers: int | None
  copy_spec: CopySpec | None
  fold_dot: Any
  flush_num_stages: int | None
  flush_programs: int | None
  flush_heads_per_program: int
  mosaic_fold_pieces: int | None
  mosaic_store_from_input: bool
  mosaic_stages: int | None


# The smallest (row, head) count at which an 8-bit read copy's output route
# is split: the measured size.
_SPLIT_MIN_PAIRS = 256 * 128
# ReplayConfig.flush_fold -> mosaic_flush.flush(fold_pieces=...).
_MOSAIC_FOLDS = {"rank1": 0, "dot_bf16x2": 2, "dot_bf16x3": 3}
_MOSAIC_HEADS = 4  # heads per Mosaic flush CTA
_MOSAIC_CTAS_PER_SM = 2  # persistent Mosaic flush (store from input)
_MOSAIC_STAGES = 2


def default_block_p(batch: int, nheads: int, headdim: int) -> int:
  """Whole-headdim tiles once the grid has ~16 programs per SM, quarter
  tiles below (more programs hide latency at small batch; H200:
  benchmarks/kernel_tuning/first_kernel_designs_h200.json)."""
  return headdim if batch * nheads >= 16 * 132 else min(16, headdim)


def default_num_warps(read_dtype, fused: bool = False) -> int:
  """Warps per output-route program: 2 over a 16- or 8-bit tile
  (checkpoint or read copy), 4 over f32 and in the fused launch, whose
  register budget the flush shares (H200:
  benchmarks/kernel_tuning/output_route_buffer_work_h200.md)."""
  return 4 if fused or jnp.dtype(read_dtype).itemsize == 4 else 2


def default_output_route(rstate) -> str:
  """"split" for an 8-bit read copy (fp8 / int8) at >= 256 x 128 (row,
  head) pairs whose window blocks are powers of two, else "triton" (H200:
  benchmarks/precision_policies/read_copies_8bit_b256_L16_h200.md)."""
  copy8 = (rstate.read_copy is not None
           and jnp.dtype(rstate.read_copy.dtype).itemsize == 1)
  big = rstate.count.shape[0] * rstate.nheads >= _SPLIT_MIN_PAIRS
  return ("split" if copy8 and big and split_problem(rstate) is None
          else "triton")


def default_flush_route(rstate, plain: bool, output_route: str,
                        interpret: bool, compute_capability) -> str:
  """"mosaic_gpu" for a plain f32 checkpoint at batch >= 128 (counters in
  whole 128-byte granules) with a bf16 B buffer of a multiple of 16 tokens
  on a Hopper-or-later GPU, beside the Triton output route; else "triton"
  (H200: benchmarks/kernel_tuning/mosaic_flush_grid_f32_b256_h200.md; f16 stays on
  Triton)."""
  mosaic = (not interpret and plain and output_route == "triton"
            and jnp.dtype(rstate.checkpoint.dtype) == F32
            and rstate.checkpoint.shape[0] >= 128
            and rstate.x_buf.shape[1] % 16 == 0
            and rstate.b_buf.dtype == jnp.bfloat16
            and jnp.dtype(rstate.count.dtype) == jnp.int32
            and counts_fit_tma(rstate.count)
            and shape_problem(rstate.checkpoint) is None
            and compute_capability is not None
            and compute_capability >= (9, 0))
  return "mosaic_gpu" if mosaic else "triton"


def default_fused_launch(batch: int, nheads: int) -> bool:
  """Fuse below ~4 (row, head) pairs per SM, where a step is launch- and
  latency-bound (H200: wins at batch 1, loses from batch 16 up;
  benchmarks/kernel_tuning/batch1_fused_fold_h200.md)."""
  return batch * nheads < 4 * 132


def default_flush_grid(fused: bool, ck_dtype) -> str:
  """The Triton flush grid: "rows" in the one launch on an f32 checkpoint
  (a flush row's output-route program folds its own tiles), else
  "persistent" (H200: benchmarks/kernel_tuning/batch1_rows_flush_fused_h200.md)."""
  return ("rows" if fused and jnp.dtype(ck_dtype).itemsize == 4
          else "persistent")


def default_flush_launch(spec, master_dtype, num_warps: int | None = None,
                         max_registers: int | None = None):
  """(warps, register cap or None) of the separate Triton flush kernel
  (spec: the state's CopySpec, None for a plain state) for the fields
  flush_num_warps / flush_max_registers (None: the default). Warps: 4 (2
  for a stochastically rounded master without a read copy). Cap, at 4
  warps only, where the persistent loop would hold more registers than 4
  (or 3) programs per SM leave: 128 on a plain state and an f32 master
  with an 8-bit copy, 120 on a 16-bit master with one, 168 with other
  copies, none with stochastic rounding (H200:
  benchmarks/precision_policies/read_copy_flush_caps_b256_L16_h200.md,
  benchmarks/kernel_tuning/output_split/f16_fp8_b256_L16_split_default_flush_step.json). Without the
  lowering hook (`triton_utils.capped_name`) nothing is capped and a plain
  state takes 2 warps."""
  copy = spec is not None and spec.copy
  sr = spec is not None and (spec.sr_master or spec.sr_copy)
  can_cap = max_registers is not None or tu.register_caps_supported()
  warps = num_warps or (4 if copy or (spec is None and can_cap) else 2)
  if max_registers is None and can_cap and warps == 4 and not sr:
    size = jnp.dtype(master_dtype).itemsize
    max_registers = (128 if spec is None or (spec.scaled and size == 4)
                     else 120 if spec.scaled and size == 2 else 168)
  return warps, max_registers


def _refuse(fields, config, why):
  """Raises for the explicit fields of config among `fields` (if any)."""
  bad = [f for f in fields if getattr(config, f) is not None]
  if bad:
    raise NotImplementedError(
        f"ReplayConfig.{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} "
        f"not apply: {why}.")


def _refuse_for_rows(config: ReplayConfig) -> None:
  """A step through slots runs the Triton routes in two launches only."""
  for field, bad in (("output_route", ("split",)),
                     ("flush_route", ("mosaic_gpu",)),
                     ("fused_launch", (True,))):
    if getattr(config, field) in bad:
      raise NotImplementedError(
          f"ReplayConfig.{field}={getattr(config, field)!r} does not take a "
          f"slot per row (rows=); leave it None.")


def plan_replay_step(config: ReplayConfig, rstate, policy=None,
                     B_dtype=None, interpret: bool = False,
                     compute_capability=None,
                     core_count: int = 132, rows: int | None = None
                     ) -> ReplayPlan:
  """The ReplayPlan of config for rstate (and its precision policy) on a
  device of compute_capability ((major, minor) or None: off-GPU) with
  core_count SMs; B_dtype: the current token's B (None: the buffer's).

  rows: the number of token rows of a step through a slot per row
  (`replayssm_jax.slots`), None for one token row per state row. Such a
  step runs the Triton output route and the Triton flush route in two
  launches (the routes that take the slots)."""
  spec = copy_spec(rstate, policy, interpret)
  plain = spec is None
  batch, nheads, headdim, _ = rstate.checkpoint.shape
  if rows is not None:
    batch = rows
    _refuse_for_rows(config)
    config = dataclasses.replace(config, output_route="triton",
                                 flush_route="triton", fused_launch=False)
  per_group = nheads // rstate.ngroups
  L = rstate.buffer_len
  ck_dtype = rstate.checkpoint.dtype
  read = rstate.checkpoint if rstate.read_copy is None else rstate.read_copy
  b_dtypes = (rstate.b_buf.dtype, rstate.b_buf.dtype if B_dtype is None
              else B_dtype)

  output_route = config.output_route or default_output_route(rstate)
  flush_route = config.flush_route or default_flush_route(
      rstate, plain, output_route, interpret, compute_capability)
  mosaic = flush_route == "mosaic_gpu"
  unfusable = [why for why, bad in (
      ("a read copy or stochastic rounding (a precision policy)", not plain),
      (f"output_route={output_route!r}", output_route != "triton"),
      (f"flush_route={flush_route!r}", mosaic)) if bad]
  fused = config.fused_launch
  if fused is None:
    fused = not unfusable and default_fused_launch(batch, nheads)
  elif fused and unfusable:
    raise NotImplementedError(
        f"ReplayConfig.fused_launch=True does not support "
        f"{', '.join(unfusable)}; use fused_launch=False or None.")
  if mosaic:
    if not plain:
      raise NotImplementedError(
          "flush_route='mosaic_gpu' folds plain states only, not a read "
          "copy or stochastic rounding (a precision policy); use "
          "flush_route='triton'.")
    if output_route != "triton":
      raise NotImplementedError(
          "flush_route='mosaic_gpu' needs output_route='triton' (it "
          "completes the flush's y in place).")
    _refuse(("flush_num_warps", "flush_max_registers"), config,
            "the Mosaic GPU flush (flush_route='mosaic_gpu', the default "
            "for this state and device) has no Triton flush kernel; set "
            "flush_route='triton'")
  if fused:
    _refuse(("flush_num_warps", "flush_max_registers"), config,
            "the fused launch (fused_launch=True, the default at batch x "
            "nheads < 528) runs both routes in one kernel at num_warps and "
            "max_registers; set fused_launch=False")

  block_p = tu.resolve_block_p(
      config.block_p or default_block_p(batch, nheads, headdim), headdim)
  if output_route == "split":
    if config.heads_per_program not in (None, 1):
      raise NotImplementedError(
          f"ReplayConfig.heads_per_program={config.heads_per_program} does "
          f"not apply: output_route='split' (the default for an 8-bit read "
          f"copy at this batch) reads one head per program; set "
          f"output_route='triton'.")
    why = split_problem(rstate)
    if why:
      raise NotImplementedError(f"output_route='split' needs {why}.")
  hb = config.heads_per_program or 1
  if per_group % hb:
    raise NotImplementedError(
        f"heads_per_program ({hb}) must divide nheads // ngroups "
        f"({per_group}).")
  num_warps = config.num_warps or (
      READOUT_WARPS if output_route == "split"
      else default_num_warps(read.dtype, fused))
  num_stages = config.num_stages or (None if output_route == "split"
                                     else 1)

  flush_warps = flush_cap = nprog = fold_form = None
  pieces = mosaic_stages = None
  if mosaic:
    flush_grid = config.flush_grid or (
        "persistent" if counts_fit_tma(rstate.count) else "rows")
    flush_fold = config.flush_fold or next(
        k for k, v in _MOSAIC_FOLDS.items()
        if v == default_fold_pieces(ck_dtype, L))
    if flush_fold not in _MOSAIC_FOLDS:
      raise NotImplementedError(
          f"flush_route='mosaic_gpu' folds by {tuple(_MOSAIC_FOLDS)}, got "
          f"flush_fold={flush_fold!r}.")
    pieces = _MOSAIC_FOLDS[flush_fold]
    flush_hb = tu.pow2_divisor(nheads, _MOSAIC_HEADS)
    if flush_grid == "persistent":
      nprog = _MOSAIC_CTAS_PER_SM * core_count
    mosaic_stages = _MOSAIC_STAGES
  else:
    flush_grid = config.flush_grid or default_flush_grid(fused, ck_dtype)
    flush_fold = config.flush_fold or fold.default_fold_mode(
        L, block_p, b_dtypes, ck_dtype, fused)
    fold_form = fold.fold_dot(flush_fold, L, block_p, interpret,
                         field="flush_fold", tile="block_p",
                         b_dtypes=b_dtypes, ck_dtype=ck_dtype, fused=fused)
    flush_hb = hb
    if not fused:
      flush_warps, flush_cap = default_flush_launch(
          spec, ck_dtype, config.flush_num_warps, config.flush_max_registers)
    if flush_grid == "persistent":
      nprog = (fold.default_flush_programs(interpret, core_count)
               if fused else fold.flush_programs(
                   interpret, flush_warps, flush_cap, core_count))
  return ReplayPlan(
      block_p=block_p, num_warps=num_warps, num_stages=num_stages,
      heads_per_program=hb, output_route=output_route,
      flush_route=flush_route, fused_launch=fused, flush_grid=flush_grid,
      flush_fold=flush_fold, flush_num_warps=flush_warps,
      flush_max_registers=flush_cap, max_registers=config.max_registers,
      copy_spec=spec, fold_dot=fold_form,
      flush_num_stages=None if mosaic or fused else (config.num_stages or 1),
      flush_programs=nprog, flush_heads_per_program=flush_hb,
      mosaic_fold_pieces=pieces, mosaic_store_from_input=mosaic,
      mosaic_stages=mosaic_stages)
