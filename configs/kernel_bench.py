r"""Decode-step kernel benchmark: baseline vs ReplaySSM, every implementation.

Full run (GPU; Nemotron-H 8B Mamba layer, TP=1), from the repository root:

  python -m experiments.kernel_bench --config=configs/kernel_bench.py \
      --workdir=runs/kernel_bench --results_dir=benchmarks

Smoke run (CPU, about 30 s on 2 cores; used by tests/test_experiments.py):

  python -m experiments.kernel_bench --config=configs/kernel_bench.py:smoke \
      --workdir=runs/kernel_bench_smoke

Fused vs separate route launches around the default's batch threshold:

  python -m experiments.kernel_bench --config=configs/kernel_bench.py:launch \
      --workdir=runs/kernel_launch

The Mosaic GPU kernels beside the Triton ones (baseline step and XLA's;
replay with the Mosaic output route, also on fp8 read copies):

  python -m experiments.kernel_bench --config=configs/kernel_bench.py:mosaic \
      --workdir=runs/kernel_mosaic

Precision policies (issue 6; replay per policy preset vs the f16 baseline,
batch 256, L 16):

  python -m experiments.kernel_bench --config=configs/kernel_bench.py:policies \
      --workdir=runs/kernel_policies

The flush rows folded by the Mosaic GPU kernel beside the Triton flush
(batch 256, L 16):

  python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:mosaic_flush \
      --workdir=runs/kernel_mosaic_flush

The replay step by buffer fill at hybrid_1b's layer, with the output
route's buffer-read variants (`:fills`, see get_config).

The output route's launch shape on the 8-bit read copies and the f16
checkpoint (`:output_launch`, same setup as `:policies`). The flush fold
forms in the fused launch at batch 1 (`:batch1`).

Useful overrides: `--config.implementations='("pallas",)'` (one
implementation only), `--config.exclude_replay_implementations='()'` (also
time the XLA reference replay step: slow, and slow to compile at batch 1),
`--config.checkpoint_dtypes='("float32",)'` (split a long run in two),
`--config.batches='(64,256)'`, `--config.name=h200_f32` (file names under
--results_dir).

Needs ml_collections (a pure-Python wheel) and matplotlib besides the
library.
"""

import ml_collections

from configs import _args


def _kernel_study(config, name: str, batches: tuple[int, ...]) -> None:
  """The setup the sweep / launch / policies studies share: L 16, the
  Pallas kernels only (no XLA reference timings), these batches."""
  config.name = name
  config.batches = batches
  config.buffer_lens = (16,)
  config.exclude_implementations = ("reference", "pallas_mosaic_gpu")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration; `arg="smoke"` is a tiny CPU run."""
  _args.check_arg(arg, "sweep", "launch", "policies", "mosaic",
                  "output_launch", "batch1", "rows_fused",
                  "mosaic_flush", "fills")
  config = ml_collections.ConfigDict()
  config.name = "kernel_bench"  # stem of the files copied to --results_dir
  config.seed = 0

  # Layer shape: Nemotron-H 8B Mamba-2 layer at TP=1.
  config.nheads = 128
  config.headdim = 64
  config.dstate = 128
  config.ngroups = 8
  config.batches = (1, 16, 64, 128, 256)
  config.checkpoint_dtypes = ("float32", "float16")  # "bfloat16" optional
  config.buffer_lens = (4, 8, 16, 32)
  config.buffer_dtype = "bfloat16"
  config.act_dtype = "bfloat16"  # x, dt, B, C, y
  config.has_z = False  # vLLM's Mamba-2 mixer gates in the RMSNorm
  config.has_D = True
  config.has_dt_bias = True

  # () = every registered implementation ("pallas" registers itself when
  # `import pallas_kernels` succeeds).
  config.implementations = ()
  # Names left out of the timing, for both ops / for the replay op only,
  # unless nothing else would remain. The reference replay step is plain XLA
  # that rebuilds and rewrites the full state every step (it is the
  # correctness oracle, not a kernel); the reference *baseline* is XLA's
  # fused version of the baseline step, kept as a yardstick for the Pallas
  # baseline ("x vs best" in the results).
  # The Mosaic GPU baseline kernel is timed by the `mosaic` study only
  # (0-4% from the Triton kernel at batch >= 64, benchmarks/
  # kernel_mosaic_h200.md; no in-place state update).
  config.exclude_implementations = ("pallas_mosaic_gpu",)
  config.exclude_replay_implementations = ("reference",)
  # Implementations (or "name:variant"s) whose failure in their check
  # against the reference or their timing (lowering, compilation, a run
  # error) is recorded as "unsupported" with the error, while the run goes
  # on with the others.
  config.experimental_implementations = ("pallas_mosaic_gpu",)

  # Timing methodology (see experiments/kernel_bench.py).
  config.rotate_bytes = 256 * 2**20  # state sets rotated per call >= this
  config.min_sets = 2  # K >= 2: consecutive steps never reuse one set
  config.max_sets = 256  # cap on the number of rotating state sets
  config.min_steps = 32  # decode steps per timed call (at least)
  # More steps per call until its steps, t(2n) - t(n), last this. At 5 ms
  # (sessions 1-15) batch 256 ran the 32-step minimum, and pairs spread
  # +-5% around the median (session 16: the f16 non-flush step 154.6 and
  # 170.6 µs in two grids of the same code 20 minutes apart).
  config.min_call_ms = 25.0
  config.warmup = 2  # untimed calls after compilation
  config.iters = 20  # timed calls; median / p10 / p90 reported
  config.copy_bytes = 2 * 2**30  # device copy-bandwidth buffer
  config.copy_iters = 20
  config.check = True  # each implementation vs the reference first

  # Tuned kernel variants, timed as implementation "pallas:<name>" beside
  # the default "pallas" (name -> pallas_kernels.SSUConfig / ReplayConfig
  # keyword arguments).
  config.ssu_variants = ml_collections.ConfigDict()
  config.replay_variants = ml_collections.ConfigDict()
  # "pallas_mosaic_gpu:<name>" -> pallas_kernels.MosaicSSUConfig kwargs.
  config.mosaic_variants = ml_collections.ConfigDict()
  # Precision-policy presets (replayssm_jax.precision.PrecisionPolicy): each
  # replay implementation is also timed as "<impl>@<preset>" on states
  # stored as the preset says, against the baseline of the row's
  # checkpoint dtype.
  config.policies = ()
  # Diagnostics, timed beside the phases above (Every timing table only):
  # the non-flush step at these fills too (the amortized step assumes a
  # cost linear in the fill), and the synced cycle: the counters advancing
  # with every row at the same count, so all rows flush in the same step
  # (a decode loop over equal-length prompts).
  config.extra_fills = ()
  config.synced_cycle = False

  if arg == "sweep":
    # Flush-route designs side by side (benchmarks/README.md): batch 256
    # and 64, both checkpoint dtypes. The default is the persistent flush
    # grid (4 programs per SM) with the 3xTF32 dot fold, 2 warps.
    _kernel_study(config, "kernel_sweep", (256, 64))
    # Measured before (benchmarks/flush_sweep_h200.json): session 2
    # rows_dot=dict(flush_grid="rows", flush_fold="dot_tf32x3"),
    # dotf32=dict(flush_fold="dot_f32"), flush32=dict(flush_block_p=32),
    # programs132=dict(flush_programs=132); session 4
    # programs2048=dict(flush_programs=2048), fused=dict(fused_launch=True),
    # fused2048=dict(fused_launch=True, flush_programs=2048); session 6 the
    # flush loop's latency hiding (flush_prefetch=True, alone and with
    # flush_block_p=32 or flush_num_warps=8; flush_num_stages=3;
    # flush_num_warps=8) and two heads per output program: none a clear
    # win. Session 11 (run 7, at 4 warps): the fold forms (IEEE f32 dot,
    # rank-1 updates, half tiles, both), one wave of 264 programs (Nsight
    # Compute, benchmarks/ncu_h200_flush_b256_f16_L16.txt: 192
    # registers/thread, 2 programs per SM, so 528 programs are 2 waves) and
    # 2 warps, the only clear win at every batch and dtype (now the
    # default). Session 12 (run 8): the rank-1 fold with scalar weights
    # (replay.rank1_fold: no vector reduction per token), looped or
    # unrolled, at 2 or 4 warps, on whole or half tiles: 11-101% slower
    # on the all-rows flush than the 2-warp dot; the half tiles with the
    # IEEE dot on 2 warps: f16 3% faster on the flush, f32 17x slower.
    # Set up after session 12 but never run: half tiles with the 3xTF32
    # dot at 2 warps, 1 warp, 8 programs per SM.
    # Session 13 (run 9): the fold as bf16 dots of x with the weighted B
    # split into bf16 pieces (replay.fold_product; ncu had 63% of the
    # 4-warp flush's shared-memory wavefronts as bank-conflict excess, and
    # 3xTF32 stages 32-bit operand tiles): 3 pieces 25-35% faster on the
    # flush step than 3xTF32 (the new default for bf16 x), 2 pieces about
    # the same as 3, 4 warps and half tiles slower. Run 10: the 3xTF32
    # fold for reference, 1 warp, 2 and 8 programs per SM: none faster.
    # Run 11: the fold adding each dot into the tile as it comes
    # (replay.fold_product) took the f16 all-rows flush at batch 256 from
    # 489 (run 9) to 472 µs, f32 754 µs as before; [32, 128] and [16, 128]
    # tiles at 4 warps (with 6 programs per SM, with flush_prefetch) were
    # 4-130% slower: per-item work, not occupancy, sets the flush time.
    # Run 12: the fold split on the x side (half the elements to split, B
    # staged once) took the f16 all-rows flush at batch 256 to 453 µs, f32
    # to 742 (Nsight Compute: 21% fewer instructions, no spills, DRAM
    # 54%); 4 warps at 2 or 3 programs per SM the same or slower, the
    # prefetching loop at 4 warps x 2 programs / 8 warps x 1 program per
    # SM 19-98% slower. Run 13 (two sweeps alternating with two of the
    # run-12 code): the window weights by a cumsum scan, 3-6% slower on
    # both routes (dropped); two bf16 pieces 3-4% faster on the f16 flush
    # (now the default for 16-bit checkpoints, replay._fold_dot), f32 the
    # same; Triton's pipelining of the fold's small loads one item ahead
    # (flush_num_stages=2) 1-6% slower. Run 14 (these variants): 4 warps
    # at 3 programs per SM 1-2% faster on the flush, within noise
    # amortized; the flush kernel on the output route's grid at 4 warps
    # (ptxas offline: 128 / 124 registers per thread for f16 / f32 there,
    # against 167 / 166 in the persistent loop, which keeps ~40 registers
    # of hoisted shared-memory offsets) 8-11% faster on the all-rows flush
    # but 13-22 µs slower on the non-flush step at batch 256 (its 32768
    # early-exit programs), 5% slower amortized.
    # Run 15 (these variants): the persistent loop at 4 warps with its
    # registers capped (ReplayConfig.flush_max_registers, PTX .maxnreg;
    # ptxas offline: 128 with no spills on f16, 12 B on f32, +2% / +6%
    # instructions; 96 with 140 / 256 B spilled), so 4 or 5 programs fit
    # per SM, and 8 warps capped at 80 (3 per SM).
    # Measured: w4p396=dict(flush_num_warps=4, flush_programs=396) (the
    # uncapped 4 warps at 3 programs per SM), w4c128 (4 warps capped at
    # 128, now the default: flush 3-11% faster than the 2-warp default
    # of the time), w4c96p660 (capped at 96, 5 programs per SM: spills,
    # 8-30% slower), w8c80p396 (8 warps at 80: spills, 3-4x slower).
    # Run 16: the old 2-warp default beside the new one, repeated (a
    # same-run noise figure): flush f16 404 / 403 against 444 µs (batch
    # 256), 103 / 103 against 118 (64); f32 715 / 712 against 734, 183 /
    # 179 against 186; amortized within the non-flush step's noise.
    # Run 17 (commit 5188138): the fold in dstate column blocks, the next
    # block's loads one block ahead (a flush_col_chunks option, removed
    # after the run; ptxas offline at the 128 cap: f16 no spills, f32 20
    # B with 4 blocks, +12-25% instructions): 2 blocks 4-8% slower on the
    # batch-256 flush (f32 776 against 716 µs, f16 421 against 404), 4
    # blocks 11-79% slower, 4 blocks at 96 registers x 5 programs per SM
    # 24-36% slower. Measured: w2=dict(flush_num_warps=2) (the old
    # default), w4c128=dict(flush_num_warps=4, flush_max_registers=128)
    # (the default, repeated).
    # Run 18: the rows flush grid (no persistent loop, no per-item row
    # search; 8-11% faster on the all-rows flush in run 14) with 1-16
    # heads per flush program, so a non-flush step launches 32768 / h
    # early-exit programs instead of 32768 (4 warps, capped at 128).
    # Measured (README "Session 16"): h 1 the fastest f32 all-rows flush
    # (655 against 712 µs) but +23 µs on the non-flush step; h 2-16 cut
    # the exits' cost and lose the flush's gain; none faster amortized or
    # in the natural cycle.
    # Run 19: the persistent flush skipping its per-item row search when
    # every row flushes (replay.persistent_items: item w's row is then
    # w // items-per-row), beside the rows grid at one head per program
    # (rows1), the fastest all-rows flush of run 18. Measured: the skip
    # (a lax.cond in the item loop; reverted) made the f32 flush slower
    # (738.8 against 712-714 µs at batch 256, 188.6 against 181 at 64),
    # f16 the same (398.5 against 402-409); rows1 again 645.4 (f32) but
    # +18 µs on the non-flush step.
    # Run 20 (session 18): the flush launch picked per step on the device
    # (ReplayConfig.flush_switch, a lax.switch on the number of flush
    # rows; since removed): no launch on a step without flush rows, the
    # rows grid at 1 / 2 heads per program when every row flushes, the
    # persistent grid otherwise (the natural cycle). Measured: 3.3-3.7x
    # slower (f32 amortized 1055 against 308 µs): XLA copied the state
    # around the conditional (90 copies per timed loop), and at batch 1,
    # without copies, each conditional cost ~11 µs (consistent with a
    # device-to-host read of its branch index).
    # Run 21 (session 19): the rows grid's fold in the one launch
    # (`:rows_fused`, kernel_rows_fused_h200_session19.md) took the f32
    # all-rows flush step to 631 µs (bf16 x3, 4 warps, capped at 128)
    # against the persistent grid's 711-715: the persistent loop is ~9%
    # slower per item than one item per program at the same residency (4
    # programs per SM). Between the two: more persistent programs than fit
    # at once (8 / 16 / 32 / 64 per SM, so 31 / 16 / 8 / 4 items each),
    # each further wave still one launch slot on a non-flush step.
    # Measured (README "Session 19"): flush 708-723 µs at every program
    # count (f16 406-412), so waves are not it; Nsight Compute
    # (ncu_h200_flush_f32_*_session19.txt): the same occupancy (4 programs
    # of 4 warps per SM, 127 registers, 43 KB of shared memory) and
    # instructions, DRAM 66.5% (persistent) against 73.4% (rows): the
    # loop's items run one after another, each waiting on its own loads.
    # Run 22: the next item's loads issued before this one folds
    # (flush_prefetch) on half tiles (block_p 32, so two half tiles hold
    # the registers of one whole one) at the 128 cap, at a 168 cap (3 per
    # SM), on whole tiles at 168, and at 8 warps capped at 96. Measured:
    # f32 flush 862 / 784 / 978 / 1002 against 714 µs, f16 477-645
    # against 402: slower in every form.
    # Measured: pf32=dict(flush_prefetch=True, flush_block_p=32),
    # pf32c168 (the same with flush_max_registers=168), pf64c168 (whole
    # tiles at 168), pf32w8c96 (8 warps capped at 96).
    # Run 23: the next item's tile touched into L2 instead (a flush_touch
    # option, removed after the run: one load per 128-byte line of the
    # next item's tile at the loop's head, two registers per thread, its
    # values guarding a store that changed nothing; ptxas offline, f32 at
    # the 128 cap: 1024 SASS instructions against 960, no spills).
    # Measured: f32 flush 967 against 717-718 µs at batch 256, 239 against
    # 182 at 64; f16 502 against 401-402, 125 against 103.
    # Now: the rows grid at one head per program (the fastest all-rows
    # flush) beside the default and its repeat (same-run noise).
    config.replay_variants = ml_collections.ConfigDict(dict(
        rows1=dict(flush_grid="rows", flush_heads_per_program=1),
        same=dict()))

  if arg == "batch1":
    # Batch 1 (one launch for both routes, replay.default_fused_launch):
    # the default fold there (3xTF32) beside the bf16-split fold, the
    # default of the separate flush launch. Session 13 (two runs,
    # benchmarks/kernel_batch1_h200.md): bf16x3 slowed the f16 non-flush
    # step in both (3.16 vs 2.89 µs, 3.61 vs 1.46), f32 within 3%.
    # Measured: bf16x3=dict(flush_fold="dot_bf16x3").
    # Session 16 (the rounds calibrated on the steps' part, so batch 1's
    # dispatch cost no longer drowns the steps): f16 replay 3.65 µs
    # amortized (non-flush 3.40) against the baseline's 2.96 (0.81x). The
    # output route waits on the row's counter (a dependent load) before it
    # issues its state and buffer loads; the baseline issues its loads at
    # once. Variants: every row's output program computes (output_eager),
    # with the buffers loaded unmasked (no load waits on the counter),
    # fewer persistent flush programs in the fused launch (each still
    # costs a launch slot on a non-flush step), two launches, the default
    # repeated (same-run noise).
    _kernel_study(config, "kernel_batch1", (1,))
    # Run 1 (commit b79c494, kernel_batch1_h200_session16.md): the
    # default 3.46 / 3.47 µs non-flush (f16), eager 3.65, unmasked 3.93,
    # both 3.92, 132 flush programs 3.45 (flush 14.9 against 7.6), two
    # launches 5.67; f32 the same picture. Run 2: the fused launch's
    # waves: ~3 programs per SM uncapped, so 528 flush + 512 output
    # programs take several waves; capped at 128 registers (4 per SM),
    # fewer and larger output programs (block_p 32 / 64), 2 or 8 warps.
    # Measured: none faster than the default on the f16 non-flush step
    # (block_p 32 / 64 3.93 / 4.33 µs, capped 3.59, 2 warps 3.46, 8 warps
    # 4.31, against 3.46-3.56).
    # Run 3 (session 17, kernel_batch1_h200_session17.md): y from the
    # folded tile (ReplayConfig.output_fold, since removed) was slower
    # everywhere (f16 non-flush 5.81 µs with 3xTF32, 4.07 with the bf16
    # split, against 3.42); the bf16-split fold (dot_bf16x2) took the f16
    # flush from 7.56 to 5.36 µs at the same non-flush step (3.39), the
    # f32 flush 9.30 -> 7.49 but its non-flush 4.15 -> 4.37: two pieces
    # became the fused launch's default on 16-bit checkpoints. Run 4: f16
    # amortized 3.48 µs against the baseline's 3.12 (0.90x; repeat 3.51,
    # 3xTF32 3.76); the window's B.C products by a tensor-core dot
    # (output_bc='dot', since removed: its shared-memory staging) 4.73
    # non-flush against 3.35.
    # Run 5: the fold as rank-1 updates (no dot staging: the batch-1 flush
    # is latency-bound), rolled or unrolled; 8-row output tiles (1024
    # output programs; the flush then folds rank-1 unless its block_p
    # stays 16). Measured: rank-1 folds 10.0-10.8 µs f16 flush against
    # 5.5, 8-row tiles 4.3-4.6 µs non-flush against 3.37.
    # Run 6: larger flush items (flush_block_p 32 / 64: 256 / 128 items
    # for the 528 flush programs), the output route's tiles unchanged.
    # Measured: f16 flush 5.23 / 5.34 against 5.40-5.52 µs, non-flush 4.06
    # / 3.66 against 3.33-3.45 (the one kernel's registers are the larger
    # route's).
    # Run 7 (session 18, kernel_batch1_h200_session18.md): the readout
    # and B-window products by explicit PTX multiply-adds over dstate
    # column blocks of 64 / 32 (ReplayConfig.output_fma, since removed;
    # ptxas offline, f16, one launch: 992 / 1072 SASS instructions against
    # 1072). Measured: f16 non-flush 3.53 / 3.48 µs against 3.41 / 3.47
    # (the default twice), f32 4.17 / 4.00 against 4.17 / 4.10: no faster
    # beyond the default's own spread.
    # Run 8 (session 18): two launches with the flush launch skipped on
    # steps without flush rows (ReplayConfig.flush_switch, since removed),
    # so a non-flush step is the output route's launch alone. Measured:
    # non-flush 14.4 / 15.0 µs (f32 / f16) against 4.07 / 3.38 (as if
    # each XLA conditional waited on a device-to-host read).
    # Run 9 (session 18): the output items before the flush programs in
    # the one launch (ReplayConfig.fused_order="output_first", since
    # removed), with the default 528 flush programs and with 132.
    # Measured: f16 non-flush 3.62 / 3.30 µs against 3.40 / 3.49 (default,
    # repeat), flush 4.97 / 10.21 against 5.50: no amortized gain.
    # Run 10 (session 19): one launch on the output route's grid alone
    # (fused_launch=True, flush_grid="rows"): a flush row's program folds
    # its own tile, so no step launches the 528 persistent flush programs
    # (with 132 of them, run 9, the non-flush step was the fastest yet).
    # Measured (kernel_batch1_h200_session19.md): f32 flush 7.57 against
    # 9.20 / 9.29 µs at the same non-flush step, 0.94x against 0.91x
    # amortized (the new default on f32: ReplayConfig.flush_grid=None);
    # f16 flush 4.83 against 5.44 but non-flush 3.62 against 3.32 / 3.39.
    # Run 11: the same again with the new default, and the persistent one
    # launch beside it (`persistent`: the f32 default before; on f16 the
    # default), so each dtype has both forms twice. Measured: f32 rows
    # form 0.94-0.96x amortized (flush 7.58-7.65 µs) against the
    # persistent one launch's 0.92x (9.19); f16 persistent 0.80-0.85x,
    # rows 0.80x.
    config.replay_variants = ml_collections.ConfigDict(dict(
        same=dict(fused_launch=True),
        rows=dict(fused_launch=True, flush_grid="rows"),
        persistent=dict(fused_launch=True, flush_grid="persistent"),
    ))

  if arg == "rows_fused":
    # Session 19: both routes in one launch on the output route's grid
    # (fused_launch=True, flush_grid="rows") at batch 256. The separate
    # rows flush grid at one head per program is the fastest all-rows f32
    # flush measured (645-655 against 712 µs, runs 18-19) but its 32768
    # early-exit programs cost the non-flush step 18-23 µs; here the
    # output route's own programs fold, so a non-flush step launches
    # nothing besides them (and saves the persistent flush launch), at the
    # register budget of the larger route. Variants: the fused fold
    # defaults (f32 3xTF32, f16 bf16 x2) at 4 warps; the f32 fold as bf16
    # x3 (the separate flush's default), also capped at 128 registers (4
    # programs per SM, the separate flush's cap); at 2 warps (the 16-bit
    # output route's default); and the output route alone at 8 warps.
    # Measured (kernel_rows_fused_h200_session19.md): every form slower
    # (non-flush f32 357-509 against 282-285 µs, f16 244-252 against 162:
    # the fold's 127 registers and 43 KB of shared memory per program hold
    # the output route's occupancy down), though its all-rows f32 flush
    # with bf16 x3 (631 µs against 711-715) is the fastest measured; 8
    # warps: non-flush f32 300.7, f16 193.7.
    _kernel_study(config, "kernel_rows_fused", (256,))
    rows = dict(fused_launch=True, flush_grid="rows")
    config.replay_variants = ml_collections.ConfigDict(dict(
        rows=rows,
        rows_bf3=dict(rows, flush_fold="dot_bf16x3"),
        rows_bf3c128=dict(rows, flush_fold="dot_bf16x3", max_registers=128),
        rows_w2=dict(rows, num_warps=2),
        w8=dict(num_warps=8),
        same=dict()))

  if arg == "mosaic_flush":
    # Session 20: the flush rows folded by the Mosaic GPU kernel
    # (ReplayConfig(flush_route="mosaic_gpu"), `mosaic_gpu.flush`): TMA
    # moves each head's checkpoint tile in and out with flush_num_stages
    # tiles in flight per CTA, the latency hiding the Triton flush's loop
    # lacks (Nsight Compute, session 19: its items wait on their own
    # loads), and the Mosaic baseline step reached 98-103% of the stream
    # bandwidth (kernel_mosaic_h200.md). Run 1 (fold by f32 rank-1
    # updates, 4096-8192 CTAs): the flush 1037-1085 µs f32 / 564-958 f16
    # against Triton's 715 / 401, the non-flush step +2-22 µs (CTAs that
    # exit still cost launch slots), y wrong on the GPU. Run 2: the fold as
    # WGMMA products (bf16 pieces of the weighted x against the B buffer):
    # all-rows flush f32 667-707 µs, f16 344-355 (h128: one CTA per row,
    # 3 stages no better), amortized f32 307.4-318.6 against Triton's
    # 310.9, f16 174.2-178.8 against 177.4; but the staggered ("natural")
    # step 336-591 µs f32 against 323.5 (few CTAs busy, or many exiting),
    # and y still wrong inside the check's lax.scan (right in one jitted
    # step: benchmarks/scripts/mosaic_flush_check.py). Run 3: the Mosaic
    # flush first, its y a fresh output the output route completes in
    # place: every check passed, but the output route read the old
    # checkpoint after the in-place flush, so XLA copied the checkpoint
    # every step (non-flush 1080-1091 µs f32, 563-567 f16). Run 4: the
    # output route reads the flushed checkpoint; heads per CTA 8 / 16 / 32
    # / 128 (all-rows flush f32 663-707 µs, f16 343-354; the staggered step
    # 343-587 f32). Session 21: the new tile stored from its input slot
    # (flush_store_from_input: half the shared memory, two CTAs per SM):
    # run 5, all-rows flush f32 604 µs at 8 heads per CTA (non-flush +8),
    # 646 at 128. Run 7: the persistent grid (flush_grid="persistent"),
    # each CTA a contiguous share of the flush tiles: f32 flush 648 µs
    # (in-slot store, 264 CTAs), 656 (132 CTAs), 739 (396), amortized 304.2
    # against Triton's 306.2. Run 8: chunks of heads dealt round-robin,
    # each tile's row found by popcounts in the index maps: f32 flush
    # 625-652 µs (chunks of 4-16 heads) against 605 for the 8-heads grid,
    # f16 396-409 against 328. Run 9: each chunk's row found once into an
    # SMEM table: f32 flush 636-642 µs, amortized 301.8 (chunks of 4), 305.0
    # (8), 304.8 (2) against Triton's 307.6; f16 370-416. Run 10: chunks of
    # 4 twice beside the default, batch 128 and 256, f32
    # (--config.batches='(128,256)' --config.checkpoint_dtypes='("float32",)').
    # (The result files of runs 5-10 were lost with session 21; its figures
    # survive in these comments and its commit messages only.) Session 22:
    # the persistent Mosaic flush with chunks of 4 is the default for f32
    # checkpoints at batch >= 128 (`replay.default_flush_route`); run 11
    # times the Triton flush beside it, and the Mosaic one on f16 (f32
    # batch 256: flush 625 / 630 against Triton's 716 µs, amortized 306.4 /
    # 309.8 against 311.8; f16 on Mosaic 182.3 against 177.2-177.5).
    # Run 12 (f32, batch 256: --config.batches='(256,)'
    # --config.checkpoint_dtypes='("float32",)'): the persistent grid's
    # CTA count (256: 32 chunks each, no tail) and pipeline depth (3-4
    # stages, one CTA per SM), chunks of 8.
    _kernel_study(config, "kernel_mosaic_flush", (128, 256))
    mp = dict(flush_route="mosaic_gpu", flush_grid="persistent",
              flush_store_from_input=True, flush_heads_per_program=4)
    config.replay_variants = ml_collections.ConfigDict(dict(
        triton=dict(flush_route="triton"),
        mflush_p_in_c4=mp,
        ctas256=dict(mp, flush_programs=256),
        stages3_ctas132=dict(mp, flush_programs=132, flush_num_stages=3),
        stages4_ctas132=dict(mp, flush_programs=132, flush_num_stages=4),
        c8_ctas256=dict(mp, flush_heads_per_program=8, flush_programs=256)))
    config.experimental_implementations = tuple(
        f"pallas:{k}" for k in config.replay_variants)

  if arg == "fills":
    # The replay step by buffer fill at hybrid_1b's Mamba layer (64 heads),
    # f32, batch 256, L 16. Session 24 (kernel_bench_h200_hybrid_layer_
    # fills.md): non-flush 135.3 / 134.7 / 138.2 / 151.0 / 155.9 µs at fill
    # 0 / 3 / 7 / 11 / 14 (the buffer bytes grow ~6% from fill 3 to 14,
    # the time 16%); synced cycle 155.6 against amortized 149.6. Beside
    # the default: the variants that change the output route's buffer
    # reads, every slot loaded unmasked, and B . C of every slot formed
    # once per row by XLA.
    _kernel_study(config, "kernel_fills", (256,))
    config.nheads = 64
    config.checkpoint_dtypes = ("float32",)
    config.extra_fills = (3, 11, 14)
    config.synced_cycle = True
    # Session 25 (kernel_bench_h200_hybrid_layer_fills_session25.md):
    # fills 3 / 7 / 11 / 14 at 130.5 / 135.5 / 147.1 / 152.8 µs; every slot
    # loaded unmasked (output_unmasked_buffers) flat at ~155 (154.2 at fill
    # 7), B . C by XLA (precompute_bc) 152.9-172.6: both slower at every
    # fill. Second run (_session25b.md; the default at 135.9 / 138.8 /
    # 150.4 / 155.5): every row computing so no load waits on the counter
    # (output_eager) the same at every fill but its flush 470 against 322
    # µs; the checkpoint tile loaded before the B buffer (a one-head
    # output_prefetch loading the tiles first, alone and with output_eager;
    # reverted) 16-19% slower at every fill. Kept beside the default: every
    # slot loaded (flat in the fill), the contrast of the masked loads.
    config.replay_variants = ml_collections.ConfigDict(dict(
        unmasked=dict(output_unmasked_buffers=True)))

  if arg == "launch":
    # Where the fused launch (ReplayConfig.fused_launch) stops paying:
    # forced one launch vs two beside the default's choice
    # (pallas_kernels.replay.default_fused_launch), L 16.
    _kernel_study(config, "kernel_launch", (16, 64))
    config.replay_variants = ml_collections.ConfigDict(dict(
        fused=dict(fused_launch=True), separate=dict(fused_launch=False)))

  if arg == "policies":
    # Issue 6: amortized replay step per precision policy at batch 256, L 16,
    # against the f16 baseline kernel.
    _kernel_study(config, "kernel_policies", (256,))
    config.checkpoint_dtypes = ("float16",)
    config.policies = ("f32", "f32+bf16", "f32+f16", "f32+fp8", "f32+int8",
                       "f16+fp8", "f32+fp8+sr")
    # Variants measured (benchmarks/README.md): session 6, the prefetching
    # flush loop (flush_prefetch=True; -3% to +4% amortized), 8 warps and
    # two heads per program (heads_per_program=2, output_prefetch=True):
    # none a clear win (session 12, at the 2-warp flush: the prefetching
    # loop's flush 35-404% slower, kernel_policies_h200_session12.json).
    # Session 9 (f32, f32+bf16, f32+fp8, f16+fp8): the
    # output route reading its tile out in dstate column blocks
    # (readout_chunk 32 / 16), 9-74% slower on the non-flush step of every
    # state, where it sped up the verify window kernel's four readouts by
    # 30%.
    # Session 12 (kernel_policies_h200_session12.md): the flushes of
    # states with a read copy were 3-45% slower at 2 warps than at 4 (now
    # their default, replay.default_flush_num_warps); the scalar-weight
    # rank-1 fold slower than the 4-warp dot at 2 and 4 warps. The study
    # keeps the 2-warp flush beside the default. Session 13: the bf16-split
    # fold (replay.fold_product, now the default) took the flush of every
    # read-copy state down 11-27% (f16 + fp8 copy 970 -> 708 µs), at 2
    # warps less.
    # Session 15 (flush_sweep_h200.json run 15 beside it): the read-copy
    # flushes' register caps. ptxas offline at 4 warps: uncapped f32 +
    # fp8 216 registers, f16 + fp8 255, f32 + bf16 160 (2, 2 and 3
    # programs per SM); capped at 168: 154 (no spills), 168 (72 B
    # spilled), 160; at 128: 36 / 368 / 104 B spilled. Run 15: a cap of
    # 128 took the f32 + fp8 flush 1140 -> 1022 µs and the f16 + fp8
    # flush 677 -> 965.
    # Run B (kernel_policies_h200_session15.md): 168 at 3 programs per SM
    # took the f16 + fp8 flush to 575 µs and f32 + bf16 to 942 (now their
    # default), 128 the f32 + fp8 flush to 1017 (its default; 168: 1065).
    # Run C had every policy at its defaults only. Then beside them: the
    # same flush uncapped (256 registers: no cap; slower in sessions 33-34).
    # Session 34: the output route with XLA's window weights
    # (ReplayConfig.output_weights; ptxas offline at 2 warps: f16 + fp8
    # route 808 SASS instructions and 80 registers against 1208 and 96,
    # f16 856 / 128 against 1224 / 119). Session 35 (six runs,
    # kernel_policies_h200_session35*.md, benchmarks/README.md "Session
    # 35"), f16 + fp8 non-flush against 113.6-115.5 µs: XLA's weights
    # 128.3, the tensor-core readout (readout="dot") 149.8, two heads per
    # program 144.6, the readout by PTX multiply-adds 143.0; flushes on 32
    # / 16-row tiles 665 / 970 against 530; the weights kernel with the
    # route at 64 registers 111.3-112.0 (2.06x against 2.02x amortized),
    # the default for 8-bit read copies since
    # (replay.default_output_weights); the route forming its own weights
    # (the default before, xw_off=dict(output_weights=False)) beside it.
    # Session 36: the flush route at 8 warps and 128 registers (2 programs
    # per SM; ptxas offline on f16 + fp8: no spills, 1152 SASS
    # instructions against 1440 at 4 warps and 168) took the f16 + fp8
    # flush step from 532 to 775 µs; with y read out before the stores, a
    # cap of 120 at 4 warps (4 programs per SM) took it to 504 (128: 546,
    # 168: 561), the default since; 96 (5 per SM) 669. The split output
    # route (a readout kernel, then a (group, row) window kernel): f16 +
    # fp8 non-flush 97.4-98.7 against 111.3-111.7 µs, 2.29-2.32x against
    # 2.09-2.10x amortized (kernel_policies_h200_session36_{split,final}
    # .md), the default for 8-bit copies since
    # (replay.default_output_route).
    # Beside it now: the Triton route (the default before).
    config.replay_variants = ml_collections.ConfigDict(dict(
        triton=dict(output_route="triton")))

  if arg == "output_launch":
    # The output route's launch shape on the f16 checkpoint and the fp8
    # read copies. Session 11 (kernel_output_launch_h200_session11.md,
    # flush route pinned at 4 warps): 2 warps took the fp8 copies'
    # non-flush step from 133 / 131 to 115 / 113 µs (their default since);
    # 8 warps, block_p 32 and two heads per program were slower, 3 stages
    # the same; on the f16 checkpoint 2 warps were 1.8% faster than 4 (162
    # vs 165 µs), within run-to-run noise. This study (session 14,
    # kernel_output_launch_h200.md): 2 and 4 warps, so each state has one
    # variant that repeats its default (a same-run noise figure). The f16
    # checkpoint at 2 warps: 160.6 µs against 164.6 / 164.5 at 4 (2 warps
    # became its default, replay.default_num_warps); ptxas offline puts
    # it at 126 registers x 2 warps (8 programs per SM, as 64 x 4) and
    # 2482 warp-instructions per program against 3424.
    _kernel_study(config, "kernel_output_launch", (256,))
    config.checkpoint_dtypes = ("float16",)
    config.policies = ("f32+fp8", "f16+fp8")
    # Session 15: register caps on the output route (ReplayConfig.
    # max_registers, PTX .maxnreg; ptxas offline at 2 warps: the f16
    # checkpoint's route holds 126 registers (8 programs per SM), 104
    # without spills (9), 96 with 20 B spilled (10); the fp8 copy's 96
    # (10 per SM), 80 with 8 B spilled (12), 64 with 48 B (16). H200
    # (kernel_output_launch_h200.md): no cap faster than none beyond
    # noise (f16 non-flush 160.0-169.1 against 161.1 µs; fp8 copies
    # 118.6-138.9 against 114.2-114.9), so the route stays uncapped.
    # Measured: oc104 / oc96 / oc80 / oc64 = dict(max_registers=...).
    # Next: the B-buffer work per program, large beside an 8-bit tile (the
    # B.C products over the buffer: [L, dstate] per program, each group's
    # read by its 16 heads' programs): precomputed once per row by XLA
    # (precompute_bc), shared by two heads per program, or both.
    # H200 (kernel_output_launch_h200.md, second run): all slower on every
    # state (non-flush: f16 184.8 / 198.5 / 195.6 against 160.5 µs; fp8
    # copies 120.0-150.7 against 113.2-113.7). Third run
    # (kernel_output_launch_h200_ub.md): the buffer windows loaded
    # unmasked (ub=dict(output_unmasked_buffers=True)), so they do not
    # wait on the counter load: 9-14% slower on every state (non-flush f16
    # 178.1 against 164.0 µs, fp8 copies 121.1 / 123.1 against 111.2 /
    # 113.2): the ~L/2 more slots read cost more than the latency saved.
    # Session 17 (kernel_output_launch_h200_session17.md): the window's
    # B.C products by one tensor-core dot of the stored bf16 B window and
    # C (output_bc='dot', since removed) in place of L x dstate f32
    # multiply-adds and a cross-lane reduction per program: non-flush f16
    # 201.9 against 160.8 µs, fp8 copies 141.7 / 142.9 against 114.1 /
    # 114.9 (the dot's operands go through shared memory).
    # Second run (kernel_output_launch_h200_session17_ro16.md): the 8-bit
    # copies read out in f16 (readout_math='f16', since removed: F2FP +
    # HFMA2, ~1 instruction per element against ~3 with the conversion to
    # f32, C scaled by a power of two; ptxas offline 1104 SASS
    # instructions against 1208): non-flush 124.9 / 126.4 against 115.2 /
    # 114.9 µs (f32 / f16 master). Nsight Compute then
    # (ncu_h200_output_route_b256_*_session17.txt): the fp8 route issues
    # on 76% of its cycles, and 38% of its instructions are FP32
    # multiplies and adds that XLA's Triton did not fuse.
    # Session 18 (kernel_output_launch_h200_session18.md): explicit PTX
    # multiply-adds over dstate column blocks of 64 / 32
    # (ReplayConfig.output_fma, since removed; ptxas offline 1128 SASS
    # instructions against 1208 on the fp8 copy): non-flush f16 176.5 /
    # 256.7 against 162.6 µs, fp8 copies 125.6-125.8 / 164.6-165.4
    # against 114.9-115.0 (ptxas offline, f16: 164 registers per thread
    # against 126).
    # Second run (session 18): the B-window products shared by 2 / 4 heads
    # per program (each head program of a group recomputes them; with an
    # fp8 tile, whose route is issue-bound, that is ~1/4 of its
    # instructions), the heads' tiles loaded together (output_prefetch),
    # at 2 or 4 warps. Session 6 (4 warps, an older route) measured
    # prefetching with 2 heads 15-23% slower; session 15 2 heads per
    # program without it 6-33% slower. Measured
    # (kernel_output_launch_h200_session18_hp.md): non-flush f16 229.0 /
    # 209.7 / 290.8 µs (hp2pf, hp2pf4 = 4 warps, hp4pf4) against 162.7, fp8
    # copies 149.2-199.0 against 116.0-116.2: the route stays at one head
    # per program.
    # Measured: hp2pf=dict(heads_per_program=2, output_prefetch=True),
    # hp2pf4 / hp4pf4 = dict(heads_per_program=2 / 4, output_prefetch=True,
    # num_warps=4).
    config.replay_variants = ml_collections.ConfigDict(dict(
        same=dict()))  # the default repeated: the same run's noise

  if arg == "mosaic":
    # The Mosaic GPU kernels' first GPU run (each variant is checked against
    # the reference first; a failure is recorded, not fatal), batch 256 +
    # 64, f32 / f16 checkpoints: the baseline step, Triton vs Mosaic GPU,
    # with XLA's fused step as the yardstick; and the replay step with the
    # Mosaic readout as its output route (`mosaic_out`), also on the fp8
    # read copies whose Triton output route reaches 62% of the bandwidth.
    _kernel_study(config, "kernel_mosaic", (256, 64))
    config.exclude_implementations = ()
    config.implementations = ("pallas", "pallas_mosaic_gpu", "reference")
    config.replay_variants = ml_collections.ConfigDict(dict(
        mosaic_out=dict(output_route="mosaic_gpu")))
    config.experimental_implementations = ("pallas_mosaic_gpu",
                                           "pallas:mosaic_out")
    config.policies = ("f32+fp8", "f16+fp8")
    config.mosaic_variants = ml_collections.ConfigDict(dict(
        hpp1=dict(heads_per_program=1),
        hpp16=dict(heads_per_program=16),
        steps3=dict(max_concurrent_steps=3),
        steps4=dict(max_concurrent_steps=4),
        steps4_hpp16=dict(heads_per_program=16, max_concurrent_steps=4),
        # Failed its lowering on the H200 with jax 0.11.2 in session 7.
        pallas_call=dict(entry="pallas_call")))

  if arg == "smoke":
    config.name = "kernel_bench_smoke"
    config.nheads = 4
    config.headdim = 8
    config.dstate = 16
    config.ngroups = 2
    config.batches = (1, 2)
    config.checkpoint_dtypes = ("float32",)
    config.buffer_lens = (2, 4)
    # Time the kernels (checked against the reference); the reference only
    # when no kernel is registered.
    config.exclude_implementations = ("reference", "pallas_mosaic_gpu")
    config.rotate_bytes = 2**10
    config.min_sets = 1  # one state set: minimal compile time on CPU
    config.min_steps = 2
    config.min_call_ms = 2.0  # long enough for t(2n) - t(n) to resolve
    config.warmup = 1
    config.iters = 3
    config.copy_bytes = 4 * 2**20
    config.copy_iters = 3
  return config
