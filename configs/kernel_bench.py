r"""Decode-step kernel benchmark: baseline vs ReplaySSM, every implementation.

Full run (GPU; Nemotron-H 8B Mamba layer, TP=1), from the repository root:
  python -m experiments.kernel_bench --config=configs/kernel_bench.py \
      --workdir=runs/kernel_bench --results_dir=benchmarks
Smoke run (CPU, tests/test_experiments.py; timing bounded by
`time_budget_s` per timed loop):
  python -m experiments.kernel_bench --config=configs/kernel_bench.py:smoke \
      --workdir=runs/kernel_bench_smoke
Studies (`--config=configs/kernel_bench.py:<arg>`, Pallas kernels only, L 16):
  sweep          the defaults against the rows flush grid, batch 256 / 64
  batch1         the fused launch's flush grids at batch 1
  rows_fused     the one launch on the output grid at batch 256
  mosaic_flush   the Mosaic GPU flush against the Triton flush, batch 128 / 256
  fills          the replay step by buffer fill (extra fills, synced cycle)
  launch         fused against separate launches, batch 16 / 64
  policies       replay per precision policy against the f16 baseline
  output_launch  the 8-bit read copies' output route, the default repeated
  mosaic         the Mosaic GPU baseline kernel and its variants
Useful overrides: `--config.implementations='("pallas",)'`,
`--config.exclude_replay_implementations='()'` (also time the XLA
reference replay step), `--config.checkpoint_dtypes='("float32",)'`,
`--config.batches='(64,256)'`, `--config.name=h200_f32` (file names under
--results_dir).
"""

import ml_collections

from configs import _args


def _kernel_study(config, name: str, batches: tuple[int, ...]) -> None:
  """The setup the studies share: L 16, the Pallas kernels only."""
  config.name = name
  config.batches = batches
  config.buffer_lens = (16,)
  config.exclude_implementations = ("reference", "pallas_mosaic_gpu")


def _variants(**kw) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(kw)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration; `arg="smoke"` is a tiny CPU run."""
  _args.check_arg(arg, "sweep", "launch", "policies", "mosaic",
                  "output_launch", "batch1", "rows_fused",
                  "mosaic_flush", "fills")
  config = ml_collections.ConfigDict()
  config.name = "kernel_bench"  # stem of the files copied to --results_dir
  config.seed = 0
  config.nheads = 128
  config.headdim = 64
  config.dstate = 128
  config.ngroups = 8
  config.batches = (1, 16, 64, 128, 256)
  config.checkpoint_dtypes = ("float32", "float16")
  config.buffer_lens = (4, 8, 16, 32)
  config.buffer_dtype = "bfloat16"
  config.act_dtype = "bfloat16"  # x, dt, B, C, y
  config.has_z = False  # vLLM's Mamba-2 mixer gates in the RMSNorm
  config.has_D = True
  config.has_dt_bias = True
  config.implementations = ()
  config.exclude_implementations = ("pallas_mosaic_gpu",)
  config.exclude_replay_implementations = ("reference",)
  config.experimental_implementations = ("pallas_mosaic_gpu",)
  config.rotate_bytes = 256 * 2**20  # state sets rotated per call >= this
  config.min_sets = 2  # K >= 2: consecutive steps never reuse one set
  config.max_sets = 256
  config.min_steps = 32  # decode steps per timed call (at least)
  config.min_call_ms = 25.0
  config.warmup = 2  # untimed calls after compilation
  config.iters = 20  # timed calls; median / p10 / p90 reported
  config.time_budget_s = 0.0  # wall time per timed loop (0: unbounded)
  config.copy_bytes = 2 * 2**30  # device copy-bandwidth buffer
  config.copy_iters = 20
  config.check = True  # each implementation vs the reference first
  config.ssu_variants = _variants()
  config.replay_variants = _variants()
  config.mosaic_variants = _variants()
  config.policies = ()
  config.extra_fills = ()
  config.synced_cycle = False
  if arg == "sweep":
    _kernel_study(config, "kernel_sweep", (256, 64))
    config.replay_variants = _variants(rows=dict(flush_grid="rows"),
                                       same=dict())
  if arg == "batch1":
    _kernel_study(config, "kernel_batch1", (1,))
    config.replay_variants = _variants(
        same=dict(fused_launch=True),
        rows=dict(fused_launch=True, flush_grid="rows"),
        persistent=dict(fused_launch=True, flush_grid="persistent"))
  if arg == "rows_fused":
    _kernel_study(config, "kernel_rows_fused", (256,))
    rows = dict(fused_launch=True, flush_grid="rows")
    config.replay_variants = _variants(
        rows=rows, rows_bf3=dict(rows, flush_fold="dot_bf16x3"),
        rows_bf3c128=dict(rows, flush_fold="dot_bf16x3", max_registers=128),
        rows_w2=dict(rows, num_warps=2), w8=dict(num_warps=8), same=dict())
  if arg == "mosaic_flush":
    _kernel_study(config, "kernel_mosaic_flush", (128, 256))
    config.replay_variants = _variants(
        triton=dict(flush_route="triton"),
        mosaic=dict(flush_route="mosaic_gpu"),
        mosaic_rows=dict(flush_route="mosaic_gpu", flush_grid="rows"))
    config.experimental_implementations = tuple(
        f"pallas:{k}" for k in config.replay_variants)
  if arg == "fills":
    _kernel_study(config, "kernel_fills", (256,))
    config.nheads = 64
    config.checkpoint_dtypes = ("float32",)
    config.extra_fills = (3, 11, 14)
    config.synced_cycle = True
  if arg == "launch":
    _kernel_study(config, "kernel_launch", (16, 64))
    config.replay_variants = _variants(fused=dict(fused_launch=True),
                                       separate=dict(fused_launch=False))
  if arg == "policies":
    _kernel_study(config, "kernel_policies", (256,))
    config.checkpoint_dtypes = ("float16",)
    config.policies = ("f32", "f32+bf16", "f32+f16", "f32+fp8", "f32+int8",
                       "f16+fp8", "f32+fp8+sr")
    config.replay_variants = _variants(triton=dict(output_route="triton"))
  if arg == "output_launch":
    _kernel_study(config, "kernel_output_launch", (256,))
    config.checkpoint_dtypes = ("float16",)
    config.policies = ("f32+fp8", "f16+fp8")
    config.replay_variants = _variants(same=dict())  # the run's own noise
  if arg == "mosaic":
    _kernel_study(config, "kernel_mosaic", (256, 64))
    config.exclude_implementations = ()
    config.implementations = ("pallas", "pallas_mosaic_gpu", "reference")
    config.mosaic_variants = _variants(
        hpp1=dict(heads_per_program=1), hpp16=dict(heads_per_program=16),
        steps3=dict(max_concurrent_steps=3),
        steps4=dict(max_concurrent_steps=4),
        steps4_hpp16=dict(heads_per_program=16, max_concurrent_steps=4),
        pallas_call=dict(entry="pallas_call"))
  if arg == "smoke":
    config.name = "kernel_bench_smoke"
    config.nheads = 4
    config.headdim = 8
    config.dstate = 16
    config.ngroups = 2
    config.batches = (1, 2)
    config.checkpoint_dtypes = ("float32",)
    config.buffer_lens = (2, 4)
    config.exclude_implementations = ("reference", "pallas_mosaic_gpu")
    config.rotate_bytes = 2**10
    config.min_sets = 1  # one state set: minimal compile time on CPU
    config.min_steps = 2
    config.min_call_ms = 2.0  # long enough for t(2n) - t(n) to resolve
    config.warmup = 1
    config.iters = 3
    config.time_budget_s = 3.0
    config.copy_bytes = 4 * 2**20
    config.copy_iters = 3
  return config
