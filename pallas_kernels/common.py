"""Pieces shared by the Pallas decode kernels: tuning configs and math.

(dt processing is `replayssm_jax.reference.process_dt`, shared as is.)
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

from replayssm_jax import precision as P


def on_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def compute_capability():
  """(major, minor) of the GPU, or None off-GPU or when unknown."""
  if not on_gpu():
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    major, minor = (int(v) for v in str(cc).split(".")[:2])
  except ValueError:
    return None  # unknown: let the Triton compiler decide
  return major, minor

F32 = jnp.float32


def pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n (a block size that
  tiles n)."""
  p = 1
  while p * 2 <= cap and n % (p * 2) == 0:
    p *= 2
  return p


def _check_pow2(name, v):
  if not isinstance(v, int) or v < 1 or v & (v - 1):
    raise ValueError(f"{name} must be a power of two >= 1, got {v!r}.")


# How a fold sums its tokens' rank-1 terms (ReplayConfig.flush_fold,
# VerifyConfig.fold).
FOLD_MODES = ("rank1", "dot_tf32x3", "dot_f32", "dot_bf16x3", "dot_bf16x2")


def _check_choice(name, v, choices, optional=False):
  if not (optional and v is None) and v not in choices:
    raise ValueError(f"{name} must be one of {choices}"
                     f"{' or None' if optional else ''}, got {v!r}.")


def _check_count(name, v):
  """None or a positive int."""
  if v is not None and (not isinstance(v, int) or v < 1):
    raise ValueError(f"{name} must be None or an int >= 1, got {v!r}.")


# A per-kernel register cap (PTX `.maxnreg`): Pallas' Triton CompilerParams
# has no field for it, but Triton reads a `ttg.maxnreg` attribute on the
# module it compiles. `capped_name` tags a pallas_call's name with the cap,
# and a wrapper of Pallas' Triton module lowering sets the attribute on the
# modules so named. (A private jax hook, like
# benchmarks/scripts/triton_offline.py's: if jax moves it, a cap is refused
# by name instead of silently dropped.)
_CAP_SUFFIX = re.compile(r"__maxnreg(\d+)$")
_cap_hook_error = None


def _install_cap_hook():
  """Wraps Pallas' Triton lowering once (at import, so that tools wrapping
  it later, such as triton_offline.py's capture, see the attribute)."""
  global _cap_hook_error
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    original = lowering.lower_jaxpr_to_triton_module
  except Exception as e:  # pylint: disable=broad-except  # pragma: no cover
    # Never fail the package import over this hook: without it the
    # default launches are uncapped and a requested cap is refused.
    _cap_hook_error = repr(e)
    return
  if getattr(original, "replayssm_register_cap", False):
    return

  def lower(*args, **kwargs):
    result = original(*args, **kwargs)
    op = result.module.operation
    if "sym_name" in op.attributes:
      cap = _CAP_SUFFIX.search(ir.StringAttr(op.attributes["sym_name"]).value)
      if cap:
        with result.module.context:
          op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(
              ir.IntegerType.get_signless(32), int(cap.group(1)))
    return result

  lower.replayssm_register_cap = True
  lowering.lower_jaxpr_to_triton_module = lower


_install_cap_hook()


def register_caps_supported() -> bool:
  """Whether this jax lets `capped_name` cap a kernel's registers."""
  return _cap_hook_error is None


def capped_name(name: str, max_registers: int | None) -> str:
  """A pallas_call name that makes Triton cap the kernel at max_registers
  registers per thread (None: no cap, the name unchanged). ptxas then
  rematerializes or spills instead of exceeding it: H200 flush route,
  benchmarks/README.md (session 15)."""
  if max_registers is None:
    return name
  if _cap_hook_error is not None:  # pragma: no cover
    raise NotImplementedError(
        f"a register cap ({max_registers}) needs the Pallas Triton lowering "
        f"hook, which this jax version does not have ({_cap_hook_error}); "
        "leave the max_registers fields None.")
  return f"{name}__maxnreg{max_registers}"


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


@dataclasses.dataclass(frozen=True)
class SSUConfig(_LaunchConfig):
  """Tuning of the baseline kernel.

  Attributes:
    block_p: headdim rows per program (the state tile is [block_p, dstate]);
      None = all of headdim.
    num_warps, num_stages: Triton launch parameters.
  """
  block_p: int | None = 16  # H200 sweep: 16/32/64 within 4% at batch 256


@dataclasses.dataclass(frozen=True)
class ReplayConfig(_LaunchConfig):
  """Tuning of the replay kernel.

  Attributes:
    block_p: headdim rows per program (checkpoint tile [block_p, dstate]);
      None = a batch-size heuristic (replay.default_block_p). Smaller
      tiles mean fewer registers per thread and more programs.
    heads_per_program: heads of one B/C group handled by one program; the
      program computes the B-buffer dot products B_j . C once and reuses them
      for all its heads (so the B buffer is read once per group, not once per
      head, when heads_per_program == nheads // ngroups). None = 1, the
      fastest on the H200 sweep (more programs beat the saved B reads).
    num_warps: Triton warps per program of the output route (and of the
      fused kernel); None = `replay.default_num_warps`: 2 when the route
      reads a 16- or 8-bit tile, 4 for f32 and the fused launch. H200
      (benchmarks/kernel_output_launch_h200_session11.md and
      kernel_output_launch_h200.md (session 14), batch 256, L 16): the
      non-flush step of f32 / f16 master + fp8 copy 133 / 131 -> 115 / 113
      µs with 2 warps (8 warps: 189 / 191, session 11); the f16
      checkpoint's 165 -> 162 (session 11) and 164.6 -> 160.6 µs (session
      14, where a repeat of the 4-warp default gave 164.5).
    num_stages: Triton pipelining stages.
    precompute_bc: form bc_j = B_j . C for all buffer slots in a small XLA
      op before the kernel (reads the B buffer once per row) instead of in
      every program.
    output_weights: each row's window weights are formed before the
      output route (per head the slots' k_j = s_j B_j . C, the current
      token's included, the decay and the current token's dt'), so an
      output program only reads its tile out and weighs its x window.
      True or "xla": by XLA (`replay.output_weights`: elementwise products
      summed, so reduction fusions); "pallas": by one small kernel on a
      (group, row) grid (`replay.output_weights_kernel`; L, heads per
      group and dstate powers of two); False: in the route; None:
      `replay.default_output_weights` (on the Triton output route:
      "pallas" with the route at 64 registers for an 8-bit read copy at
      batch x heads >= 256 x 128, which the split route takes by default,
      else False). H200, f16 master + fp8 copy, batch 256, L 16 (session
      35, benchmarks/output_split_h200_session35*.json): the route kernel
      111.4 µs against 113.0, XLA's weights ~15 µs more per step; with
      max_registers=64 the route kernel 102-104 and the weights kernel
      7.3. Nsight
      Compute (session 34, f16 master + fp8 copy at batch 256): the
      per-program B.C products, window weights and their reductions come
      before the readout in the route's SASS and hold ~36% of its
      instructions (1253 per warp) in a launch that issues on 74% of its
      cycles. Not with precompute_bc, fused_launch or the Mosaic or split
      output routes (the split route's window kernel forms them itself).
    output_all_rows: the output kernel computes y for flush rows too (the
      output-only formula holds for every row), so its checkpoint read does
      not wait on the row's counter; flush rows then read their checkpoint
      twice (once per kernel), +1/L of a checkpoint per step.
    flush_block_p: block_p of the flush-route kernel (None: block_p). Its
      fold holds a second f32 tile, so it may want smaller tiles than the
      output route (ncu on the H200: 128 registers/thread, 25% occupancy at
      block_p 64).
    flush_unroll: unroll the L-1 rank-1 updates of the fold (False keeps a
      loop: fewer registers, no hoisted loads).
    flush_fold: "rank1" (exact f32 rank-1 updates), "dot_tf32x3" (one
      tensor-core dot with 3xTF32 inputs, ~f32 accurate; exact f32 in
      interpret mode), "dot_f32" (one dot with IEEE f32 inputs), or
      "dot_bf16x3" / "dot_bf16x2" (bf16 B only: bf16 dots of B with the
      weighted x split into 3 / 2 bf16 pieces, ~24 / ~16 mantissa bits,
      `replay.fold_product`); the dot modes need buffer_len and the flush
      block_p >= 16. None (`replay._fold_dot`): where a dot applies,
      for bf16 B "dot_bf16x2" on a 16-bit checkpoint and "dot_bf16x3" on
      an f32 one (3xTF32 in the fused launch), "dot_tf32x3" otherwise;
      elsewhere "rank1". H200,
      flush_sweep_h200 runs 8-13: on the all-rows flush step rank1 was
      11-101% slower than the 3xTF32 dot, the IEEE dot 17x slower on an
      f32 checkpoint at 2 warps, bf16x3 25-35% faster than 3xTF32, bf16x2
      a further 3-4% on f16.
    flush_grid: "rows" launches the flush kernel on the output route's
      grid (programs of non-flush rows exit at once, but each costs a
      launch slot: ~18-23 µs per step at batch 256 on the H200);
      "persistent" launches `flush_programs` programs that share out the
      (flush row, head, headdim block) items of the flush rows only. None:
      "rows" in the one launch (fused_launch) on an f32 checkpoint (where
      it folded faster at batch 1, `replay.default_flush_grid`), else
      "persistent".
    flush_heads_per_program: heads of one group per program of the rows
      flush grid (None: heads_per_program); only with flush_grid="rows".
      Fewer programs exit at once on a non-flush step, each flush program
      folds its heads one after another.
    flush_programs: program count of the persistent flush grid (None: as
      many per SM as the register cap leaves room for, at most 4 (3 at
      168 registers x 4 warps); 8 in interpret mode).
    fused_launch: one launch for both routes: the persistent flush programs
      first, then one program per output-route item, so the flush rows'
      latency-bound folds overlap the output route's streaming and a step
      costs one launch instead of two (batch 1). The kernel's register
      budget is the larger of the two routes'. With flush_grid="rows" the
      launch is the output route's grid alone: a flush row's program folds
      its own heads' tiles (flush_block_p and flush_heads_per_program must
      then be block_p and heads_per_program), so a step launches no flush
      programs at all. Plain states only (no precision policy), not with
      output_all_rows or precompute_bc. None: fused (unless flush_grid is
      "rows") where it applies and the batch is small
      (`replay.default_fused_launch`: on the H200 it wins at batch 1 and
      loses from batch 16 up, where the shared register budget cuts the
      output route's occupancy; benchmarks/README.md).
    flush_prefetch: the persistent flush programs issue the next item's
      global loads (checkpoint tile, buffered x and B, dt window) before
      folding the current one, so their latency overlaps the fold (manual
      software pipelining; one more set of tiles in registers). Persistent
      flush grid only. H200 (benchmarks/README.md, session 6): -3% to +4%
      on the amortized step, -7% on a 16-bit dual-precision flush.
    output_prefetch: the output route loads the checkpoint (or read copy)
      tiles of all its heads_per_program heads before computing any, so
      a program has that many tiles in flight (for 8-bit copies, whose
      tiles are half the bytes). Separate launches only. H200 (session
      6): 15-23% slower with heads_per_program=2; session 25 (one head,
      the tile loaded before the B buffer, whose B . C products it waits
      on otherwise; kernel_bench_h200_hybrid_layer_fills_session25b.md):
      16-19% slower on the f32 non-flush step at every fill; session 18
      (benchmarks/kernel_output_launch_h200_session18_hp.md, batch 256, L
      16): with 2 / 4 heads per program at 2 or 4 warps the non-flush
      step 29-79% slower (f16 checkpoint, fp8 read copies).
    output_unmasked_buffers: the Triton output route loads all L slots of
      the x / B / dt buffers unmasked and zeroes the slots past the row's
      counter afterwards, so these loads issue with the state tile's
      instead of waiting for the counter (a dependent load) to form
      their masks; it reads ~L/2 more slots per step on average. H200
      (session 15, benchmarks/kernel_output_launch_h200_ub.md, batch 256,
      L 16): the non-flush step 9-14% slower (f16 checkpoint, f32 / f16
      master + fp8 copy).
    output_eager: every row's output-route program computes, flush rows'
      too, so its loads (state tile, buffers) do not wait on the row's
      counter (a dependent load) to pick the route; a flush row's y is
      dropped (the flush route stores it). With output_unmasked_buffers
      no load of the route waits on the counter. For latency-bound steps
      (batch 1); at large batch a step where every row flushes does the
      output route's work on top of the flush. H200 (session 16,
      benchmarks/kernel_batch1_h200_session16.md, batch 1, L 16, fused
      launch): slower, the f16 non-flush step 3.65 µs against 3.46 (3.92
      with unmasked buffers).
    output_route: None (the default: `replay.default_output_route`,
      "split" for an 8-bit read copy at batch x heads >= 256 x 128 with
      no Triton output-route field set, else "triton"), "triton" (the
      Triton output-route kernel), "split": the state read out (y0 = S C,
      checkpoint or read copy, scaled) by its own Triton kernel
      (`replay._readout_kernel`), then the window terms, appends and
      counters by a (group, row) kernel (`replay._window_kernel`); H200,
      f16 master + fp8 copy, batch 256, L 16 (session 36,
      benchmarks/output_split_h200_session36_e.json): readout 73.8 µs +
      window 22.4 against the route's 102.1 + weights kernel 7.4,
      non-flush step 97.4-98.7 against 111.3-111.7, 2.29-2.32x the f16
      baseline amortized against 2.09-2.10x; or
      "mosaic_gpu": the output route's state read (y0 = S C, checkpoint or
      read copy) by the Mosaic GPU readout kernel
      (`pallas_kernels.mosaic_gpu.readout`, TMA-pipelined), the window
      weights, buffer term and appends by XLA; the flush route stays in
      Triton. Separate launches only (fused_launch None or False, no
      output_all_rows / precompute_bc / output_prefetch). H200 (session 7,
      benchmarks/kernel_mosaic_h200.md): slower than "triton" on every
      state tried (non-flush step at batch 256: f32 324 vs 284 µs, f16 203
      vs 164, f32 master + fp8 copy 145 vs 132).
    flush_route: None (the default: `replay.default_flush_route`, the
      persistent Mosaic flush below for plain f32 checkpoints at batch >=
      128 on Hopper GPUs, else "triton"), "triton" (the flush kernels
      above) or "mosaic_gpu": the
      flush rows' fold by the Mosaic GPU kernel
      (`pallas_kernels.mosaic_gpu.flush`: TMA-pipelined tiles, the
      checkpoint updated in place through `pl.run_state`), launched
      before the Triton output route, which completes its y in place. One
      CTA per (row, flush_heads_per_program heads) streams its heads with
      flush_num_stages (default 2) tiles in flight; CTAs of non-flush rows
      exit after reading the counter. H200, batch 256, L 16: on that grid
      many CTAs cost the non-flush step and few starve the staggered-row
      step (session 20, f32 587 vs 322 µs at one CTA per row); the
      persistent grid with the in-slot store (sessions 21-22,
      benchmarks/kernel_mosaic_flush_h200_run{11,12}.md) flushes f32 in
      625-637 µs against Triton's 716-723 at no cost to the other steps.
      flush_fold picks its fold: "rank1" (f32 rank-1 updates), or
      "dot_bf16x3" / "dot_bf16x2" (one WGMMA product per bf16 piece of the
      weighted x against the bf16 B buffer; buffer_len a multiple of 16);
      None: `mosaic_gpu.default_fold_pieces`. flush_heads_per_program
      must divide nheads.
      Separate launches, the Triton output route and plain states only
      (no precision policy); the Triton flush fields must be left unset.
      Needs headdim a multiple of 64 and 128-byte checkpoint rows on the
      GPU.
      flush_grid (Mosaic): None or "rows" launch one CTA per (row,
      flush_heads_per_program heads); "persistent" launches flush_programs
      CTAs (None: 2 per SM), dealt the flush rows' chunks of
      flush_heads_per_program heads round-robin (`mosaic_gpu.cta_tiles`;
      batch a multiple of 32).
    flush_store_from_input: with flush_route="mosaic_gpu", the new tile
      overwrites its input tile in shared memory and is stored from there
      (`mosaic_gpu.flush(store_from_input=True)`): half the shared memory
      per CTA, so two CTAs share an SM.
    readout_chunk: the Triton output route loads and reads out its state
      tile in [block_p, readout_chunk] column blocks (see
      `VerifyConfig.readout_chunk`); None: the whole dstate at once. H200
      (session 9, benchmarks/kernel_policies_h200_session9.md): the
      non-flush step is 9-34% slower at 32 and 50-74% at 16 (f32, f16,
      f32 + bf16 / fp8 copies): this single readout is memory-bound, not
      shuffle-bound.
    readout_fma: with readout_chunk, the column blocks' products are
      accumulated by PTX multiply-adds (`common.fma`, as
      `VerifyConfig.readout_fma`; plain ops in interpret mode) before the
      one reduction. H200 (session 35, f16 master + fp8 copy, batch 256,
      L 16): slower, non-flush 143.0 µs at 32 columns against 115.0
      (benchmarks/kernel_policies_h200_session35_fma.md).
    readout: how the Triton output route reads its tile out against C:
      "reduce" (elementwise products and a dstate reduction in f32) or
      "dot" (`readout_dot`: one tensor-core product of the tile in f16
      against C scaled by a power of two in f16, f32 accumulation; the
      same products up to 2^-38 max|C| |S|, another summation order).
      "dot" needs an f16, fp8 e4m3 or int8 tile (checkpoint or read copy),
      C in bf16 / f16, block_p and dstate >= 16, and not readout_chunk /
      fused_launch / the Mosaic output route. H200 (session 35, batch 256,
      L 16, benchmarks/kernel_policies_h200_session35_dot.md): slower, the
      non-flush step 149.8 µs against 113.7 on an fp8 copy, 189.5 against
      161.4 on an f16 checkpoint (the tile goes through shared memory to
      the tensor cores).
    flush_num_warps: Triton warps per program of the separate flush-route
      kernel; None = `replay.default_flush_launch`: 4 (2 for a
      stochastically rounded master without a read copy). H200, batch 256, L
      16: uncapped, 2 warps beat 4 on plain states (session 11,
      benchmarks/flush_sweep_h200.json run 7: f16 822 -> 661 µs and f32
      1122 -> 966 per all-rows flush step, with the 3xTF32 fold of the
      time), but 4 warps with their registers capped at 128
      (flush_max_registers) beat 2 (session 15, run 15); states with a
      read copy were slower at 2 (session 12,
      benchmarks/kernel_policies_h200_session12.md: f32 master + fp8 copy
      1368 -> 1981, f16 + fp8 967 -> 1382, f32 + bf16 1354 -> 1400).
      The fused kernel uses num_warps.
    flush_num_stages: Triton pipelining stages of the separate flush-route
      kernel (None: num_stages).
    max_registers: cap on the registers per thread of the output-route
      kernel, or of the fused kernel with fused_launch (as
      flush_max_registers); None: no cap. H200
      (session 15, benchmarks/kernel_output_launch_h200.md, batch 256, L
      16, 2 warps): caps of 104 / 96 / 80 / 64 were no faster than none
      on the f16 checkpoint (non-flush 160-169 µs against 161) and 3-21%
      slower on the fp8 read copies.
    flush_max_registers: cap on the registers per thread of the separate
      flush-route kernel (PTX .maxnreg, `capped_name`; 256: no cap); None
      = `replay.default_flush_launch`: at 4 warps 128 on a plain state
      and an f32 master with an 8-bit copy, 120 on a 16-bit master with
      an 8-bit copy, 168 with other read copies,
      no cap with stochastic rounding.
  """
  _default_num_warps = True
  num_warps: int | None = None
  heads_per_program: int | None = None
  precompute_bc: bool = False
  output_weights: bool | str | None = None
  output_all_rows: bool = False
  flush_block_p: int | None = None
  flush_unroll: bool = False
  flush_fold: str | None = None
  flush_grid: str | None = None
  flush_heads_per_program: int | None = None
  flush_programs: int | None = None
  fused_launch: bool | None = None
  flush_prefetch: bool = False
  output_prefetch: bool = False
  output_unmasked_buffers: bool = False
  output_eager: bool = False
  flush_num_warps: int | None = None
  flush_num_stages: int | None = None
  flush_max_registers: int | None = None
  max_registers: int | None = None
  output_route: str | None = None
  flush_route: str | None = None
  flush_store_from_input: bool = False
  readout_chunk: int | None = None
  readout_fma: bool = False
  readout: str = "reduce"

  def __post_init__(self):
    super().__post_init__()
    _check_choice("readout", self.readout, ("reduce", "dot"))
    if self.readout_fma and self.readout_chunk is None:
      raise ValueError("readout_fma=True accumulates the readout's column "
                       "blocks; set readout_chunk (e.g. 32).")
    if self.readout == "dot" and self.readout_chunk is not None:
      raise ValueError("readout='dot' reads the whole tile in one product; "
                       f"leave readout_chunk None, got {self.readout_chunk}.")
    _check_choice("flush_grid", self.flush_grid, ("rows", "persistent"),
                  optional=True)
    _check_choice("output_route", self.output_route,
                  ("triton", "mosaic_gpu", "split"), optional=True)
    _check_choice("flush_route", self.flush_route, ("triton", "mosaic_gpu"),
                  optional=True)
    if self.flush_store_from_input and self.flush_route != "mosaic_gpu":
      raise ValueError("flush_store_from_input=True needs flush_route="
                       f"'mosaic_gpu', got {self.flush_route!r}.")
    if self.flush_route == "mosaic_gpu":
      if self.output_route not in (None, "triton"):
        raise ValueError("flush_route='mosaic_gpu' needs output_route="
                         "'triton' (it completes the flush's y in place).")
      clash = [name for name in ("output_all_rows", "fused_launch",
                                 "flush_prefetch",
                                 "flush_block_p", "flush_unroll",
                                 "flush_num_warps", "flush_max_registers")
               if getattr(self, name)]
      if clash:
        raise ValueError(
            f"flush_route='mosaic_gpu' replaces the Triton flush route, "
            f"which {', '.join(clash)} configure(s); leave them unset.")
      if self.flush_fold not in (None, "rank1", "dot_bf16x2", "dot_bf16x3"):
        raise ValueError(
            f"flush_route='mosaic_gpu' folds by 'rank1', 'dot_bf16x2' or "
            f"'dot_bf16x3' (or None: its default), got flush_fold="
            f"{self.flush_fold!r}.")
    if self.flush_programs and self.flush_route == "mosaic_gpu" and (
        self.flush_grid != "persistent"):
      raise ValueError(
          "flush_programs with flush_route='mosaic_gpu' needs flush_grid="
          f"'persistent', got flush_grid={self.flush_grid!r}.")
    if self.readout_chunk is not None:
      _check_pow2("readout_chunk", self.readout_chunk)
    if self.output_weights not in (None, False, True, "xla", "pallas"):
      raise ValueError("output_weights must be None (the default), False, "
                       "True (= 'xla'), 'xla' or 'pallas', got "
                       f"{self.output_weights!r}.")
    if self.output_weights and self.precompute_bc:
      raise ValueError("output_weights=True forms the B.C products with the "
                       "weights; leave precompute_bc False.")
    clash = [name for name in ("output_all_rows", "precompute_bc",
                               "output_weights",
                               "output_prefetch", "fused_launch",
                               "readout_chunk", "output_unmasked_buffers",
                               "output_eager")
             if getattr(self, name)]
    if self.readout != "reduce":
      clash.append("readout")
    if self.output_route not in (None, "triton") and clash:
      raise ValueError(
          f"output_route={self.output_route!r} replaces the Triton output "
          f"route, which {', '.join(clash)} configure(s); leave them "
          "unset.")
    _check_count("flush_programs", self.flush_programs)
    if self.flush_block_p is not None:
      _check_pow2("flush_block_p", self.flush_block_p)
    _check_choice("flush_fold", self.flush_fold, FOLD_MODES, optional=True)
    _check_count("heads_per_program", self.heads_per_program)
    if self.flush_num_warps is not None:
      _check_pow2("flush_num_warps", self.flush_num_warps)
    _check_count("flush_num_stages", self.flush_num_stages)
    _check_registers("flush_max_registers", self.flush_max_registers)
    _check_registers("max_registers", self.max_registers)
    _check_count("flush_heads_per_program", self.flush_heads_per_program)
    if (self.flush_heads_per_program and self.flush_grid != "rows"
        and self.flush_route != "mosaic_gpu"):
      raise ValueError(
          "flush_heads_per_program needs flush_grid='rows' or flush_route="
          "'mosaic_gpu' (the persistent grid shares out (row, head, block) "
          "items), got "
          f"flush_grid={self.flush_grid!r}.")
    if self.flush_prefetch and self.flush_grid == "rows":
      raise ValueError(
          "flush_prefetch=True needs flush_grid='persistent' or None (the "
          "rows grid runs one item per program: nothing to prefetch), got "
          f"flush_grid={self.flush_grid!r}.")


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """Tuning of the conv decode-step kernel (`pallas_kernels.conv`).

  Attributes:
    block_rows: rows per program (at most; the largest power of two <= it
      that divides the batch).
    block_channels: channels per program (at most; the largest power of
      two <= it that divides every output piece, >= 16).
    num_warps: Triton launch parameter.

  Defaults not swept. H200, hybrid_1b's decode step at batch 256 (6144
  bf16 channels as 4096 + 1024 + 1024, kernel 4;
  benchmarks/decode_step_profile_h200_session27*.json): 7.4 µs per layer,
  where XLA spent 16 µs (the ring select over the whole state, two slice
  fusions each recomputing its part of the conv, the counter update) and
  the xBC slice of the in_proj output 2 µs more.
  """
  block_rows: int = 16
  block_channels: int = 256
  num_warps: int = 4

  def __post_init__(self):
    _check_pow2("block_rows", self.block_rows)
    _check_pow2("block_channels", self.block_channels)
    _check_pow2("num_warps", self.num_warps)
    if self.block_channels < 16:
      raise ValueError(f"block_channels must be >= 16, got "
                       f"{self.block_channels}.")


@dataclasses.dataclass(frozen=True)
class NormConfig:
  """Tuning of the norm kernels (`pallas_kernels.norm`: the gated RMSNorm
  and the residual add + RMSNorm).

  Attributes:
    block_rows: rows per program (at most; the largest power of two <= it
      that divides the rows).
    num_warps: Triton launch parameter.

  Defaults not swept. H200, hybrid_1b's decode step at batch 256 (4096
  channels in 8 groups of 512): 3.5-4.3 µs per layer against 7.3-8.4 µs
  for XLA's two fusions (benchmarks/decode_step_profile_h200_session27*).
  """
  block_rows: int = 4
  num_warps: int = 4

  def __post_init__(self):
    _check_pow2("block_rows", self.block_rows)
    _check_pow2("num_warps", self.num_warps)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Tuning of the decode attention kernel (`pallas_kernels.attention`).

  Attributes:
    block_s: cache entries per loop iteration (a power of two >= 16: the
      scores are a tensor-core dot).
    split_s: cache entries per program (a multiple of block_s); None = the
      whole cache, so one program per (row, KV head) and no combine. With a
      split, programs of (row, KV head, split) write partial softmax sums
      that XLA combines (flash-decoding), and a split past the row's length
      exits at once.
    num_warps, num_stages: Triton launch parameters (num_stages > 1
      pipelines the block loop's loads).

  Defaults: H200, batch 256, 384-entry bf16 caches with ragged lengths in
  [192, 384] (benchmarks/attend_micro_h200_session25.json): 74.3 µs at
  hybrid_1b's 16 / 4 heads of 128 (XLA's whole-cache attention 81.0), one
  stage 78.5, three 87.2, 8 warps 94.3, 32- / 128-entry blocks 100.2 /
  88.3, splits of 64 / 128 entries 82.1 / 81.3; at the 8B's 32 / 8 heads
  121.1 µs (XLA 150.6, one stage 131.2, split 128 143.5).
  """
  block_s: int = 64
  split_s: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    _check_pow2("block_s", self.block_s)
    if self.block_s < 16:
      raise ValueError(f"block_s must be >= 16 (a dot operand), got "
                       f"{self.block_s}.")
    if self.split_s is not None and (
        not isinstance(self.split_s, int) or self.split_s < self.block_s
        or self.split_s % self.block_s):
      raise ValueError(f"split_s must be None or a multiple of block_s "
                       f"({self.block_s}), got {self.split_s!r}.")
    _check_pow2("num_warps", self.num_warps)
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}.")


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


def load_tile_blocks(ref, tile, chunk, when=None, rows=None):
  """ref[tile] ([block_p, N]) as a list of [block_p, chunk] column blocks
  (chunk None: one block), each loaded on its own (evict-first: a state
  tile is read once). A narrower block spans fewer lanes of a warp along
  N, so a reduction over N after `readouts` sums the blocks takes fewer
  cross-lane shuffle rounds. when: None, or a scalar bool: the blocks are
  loaded only where it holds (masked loads, no traffic otherwise), zeros
  elsewhere; rows: block_p then."""
  nstate = ref.shape[-1]
  chunk = min(chunk or nstate, nstate)
  mask = other = None
  if when is not None:
    mask = jnp.broadcast_to(when, (rows, chunk))
    # (an int 0 does not cast to fp8 in the Triton lowering; 0.0 does)
    other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
  return [plgpu.load(ref.at[(*tile, pl.ds(k * chunk, chunk))],
                     mask=mask, other=other, eviction_policy="evict_first")
          for k in range(nstate // chunk)]


def fma(a, b, c, asm: bool):
  """a * b + c in f32 (broadcast to one shape). asm: one PTX fma.rn.f32 per
  element (`plgpu.elementwise_inline_asm`), for a Triton that emits the
  multiply and the add as two instructions (XLA's bundled one on the H200
  leaves most such pairs unfused: Nsight Compute, sessions 17 and 30);
  otherwise (and in interpret mode, which cannot run PTX) the plain
  product and sum, rounded twice."""
  a, b, c = jnp.broadcast_arrays(a.astype(F32), b.astype(F32),
                                 c.astype(F32))
  if not asm:
    return a * b + c
  (out,) = plgpu.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f",
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
  return out


def readouts(blocks, vectors, fma_asm=False):
  """sum_n S[:, n] v[n] ([block_p] f32) of the tile S given as column
  blocks (`load_tile_blocks`), for each v in vectors: callables taking the
  block's column slice and returning v there ([chunk], any float dtype).
  The products are summed over the blocks elementwise (by `fma` with
  fma_asm), then reduced once per vector."""
  chunk = blocks[0].shape[-1]
  out = []
  for v in vectors:
    acc = None
    for k, blk in enumerate(blocks):
      vk = v(pl.ds(k * chunk, chunk)).astype(F32)[None, :]
      acc = (blk.astype(F32) * vk if acc is None
             else fma(blk, vk, acc, fma_asm))
    out.append(jnp.sum(acc, axis=1))
  return out


# The read tiles a "dot" readout converts to f16 exactly (e4m3 and int8
# values are f16 values), and the C dtypes whose values a power-of-two
# scale takes into f16's range with every mantissa bit kept.
_DOT_TILES = tuple(map(jnp.dtype, (jnp.float16, jnp.float8_e4m3fn, jnp.int8)))
_DOT_C = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16)))


def dot_readout_problem(tile_dtype, c_dtype) -> str | None:
  """Why `readout_dot` cannot read a tile of tile_dtype against C of
  c_dtype, or None."""
  t, c = jnp.dtype(tile_dtype), jnp.dtype(c_dtype)
  if t not in _DOT_TILES:
    return (f"the read tile must be one of {[d.name for d in _DOT_TILES]} "
            f"(converted to float16 exactly), got {t}")
  if c not in _DOT_C:
    return f"C must be one of {[d.name for d in _DOT_C]}, got {c}"
  return None


def readout_dot(tile, c):
  """sum_n S[:, n] c[n] ([block_p] f32) by one tensor-core product: the
  tile [block_p, N] in f16 (`dot_readout_problem`: exact) against c times
  a power of two in f16, broadcast to Triton's smallest dot tile [16, N],
  f32 accumulation; column 0 of the [block_p, 16] product times the
  inverse power. The power puts max|c| in [2^14, 2^15) (within [2^-126,
  2^126]), so a bf16 / f16 c converts with its mantissa kept but for
  entries under 2^-24 of max|c| in magnitude, whose products are off by
  at most 2^-38 max|c| |S|: the products are the f32 ones of `readouts`
  up to that, the summation order differs."""
  cf = c.astype(F32)
  amax = jnp.max(jnp.abs(cf))
  e = (lax.bitcast_convert_type(amax, jnp.int32) >> 23) & 0xFF
  k = jnp.clip(268 - e, 1, 253)  # biased exponent of the power
  scale = lax.bitcast_convert_type(k << 23, F32)
  inv = lax.bitcast_convert_type((254 - k) << 23, F32)
  cw = jnp.broadcast_to((cf * scale).astype(jnp.float16)[None, :],
                        (16, c.shape[0]))
  y = lax.dot_general(tile.astype(jnp.float16), cw, (((1,), (1,)), ((), ())),
                      preferred_element_type=F32)
  # Column 0 (all 16 are equal: the others are masked, exact zeros added).
  y = jnp.sum(jnp.where(jnp.arange(16)[None, :] == 0, y, 0.0), axis=1)
  return y * inv


def suffix_sums(d, j):
  """sum_{i>j} d_i ([L, ...] f32) along axis 0 of a window d [L, ...] (j:
  arange(L)), as an [L, L] masked sum: a cumsum scan
  (`reference.window_weights`' form) compiles to fewer instructions but
  made the replay routes 3-6% slower on the H200 (flush_sweep_h200.json
  run 13)."""
  after = j[:, None] < j[None, :]  # [j, i]: i > j
  for _ in range(d.ndim - 1):
    after = after[..., None]
  return jnp.sum(jnp.where(after, d[None], 0.0), axis=1)


def finish_output(y, x, D, z):
  """y + D x, then * silu(z); all f32. x, z: [P]; D scalar or None."""
  if D is not None:
    y = y + D.astype(F32) * x
  if z is not None:
    zf = z.astype(F32)
    y = y * (zf * jax.nn.sigmoid(zf))
  return y


def resolve_block_p(block_p, headdim: int) -> int:
  bp = headdim if block_p is None else min(block_p, headdim)
  if headdim % bp:
    raise NotImplementedError(
        f"block_p ({bp}) must divide headdim ({headdim}).")
  return bp


# ------------------------------------------------- stores of a read copy
# `precision.quantize` / `round_to` restated in ops that the Pallas Triton
# backend lowers (it has no round primitive, and its max reduction ignores
# NaN). Equal to them bit for bit (tests/test_pallas_kernels.py).


def round_half_even(v):
  """jnp.round (ties to even) of f32 values with |v| < 2^22, from floor."""
  f = jnp.floor(v)
  d = v - f  # exact
  odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0.0
  up = (d > 0.5) | ((d == 0.5) & odd)
  return f + jnp.where(up, 1.0, 0.0)


def quantize_rows(xf, dtype, bits=None):
  """`precision.quantize` of an f32 tile [rows, n] (one scale per row).

  Returns:
    (q [rows, n] in dtype (float8_e4m3fn or int8), scale [rows] f32).
  """
  dt = jnp.dtype(dtype)
  qmax = np.float32(P.QMAX[dt.name])
  # A row with a NaN or inf has amax inf (the reference's amax is not
  # finite). One reduction per row (a second one counting the non-finite
  # elements took ~70 of the f16 + fp8 flush's 576 µs, session 32), an
  # integer max of the magnitudes' bits (their order is the floats'; a NaN's
  # bits exceed inf's, which Triton's float max would drop): a mask and an
  # integer max per element.
  mag = lax.bitcast_convert_type(xf, jnp.int32) & np.int32(0x7FFFFFFF)
  amax_bits = jnp.max(mag, axis=-1)
  amax = jnp.where(amax_bits >= np.int32(0x7F800000), jnp.inf,
                   lax.bitcast_convert_type(amax_bits, F32))
  finite = jnp.isfinite(amax)
  enc = qmax / jnp.where(amax > 0, amax, 1.0)
  usable = finite & (amax > 0) & jnp.isfinite(enc)
  enc = jnp.where(usable, enc, 1.0)
  v = jnp.where(usable[:, None], xf * enc[:, None], 0.0)
  # |v| <= qmax (1 + 2^-23) (|x| <= amax, two roundings), so the reference's
  # clip of v to qmax changes nothing that rounding to nearest leaves: the
  # int8 result is clipped after rounding, and an fp8 value that close to
  # 448 rounds to 448. Stochastic fp8 rounding needs the clip.
  if dt.name == "int8":
    if bits is None:
      r = round_half_even(v)
    else:
      u = (bits >> np.uint32(8)).astype(F32) * np.float32(2.0**-24)
      r = jnp.floor(v + u)
    q = jnp.minimum(jnp.maximum(r, -qmax), qmax).astype(jnp.int8)
  elif bits is None:
    q = v.astype(dt)
  else:
    q = P.round_to(jnp.minimum(jnp.maximum(v, -qmax), qmax), dt, bits)
  scale = jnp.where(finite, 1.0 / enc, jnp.nan).astype(F32)
  return q, scale
