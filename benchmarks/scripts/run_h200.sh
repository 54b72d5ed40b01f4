#!/usr/bin/env bash
# The H200 parts behind benchmarks/README.md, one per study; each fits the
# 10-minute command limit of the GPU machine. Run from the repository root
# there with the `wheels/` folder carried (it holds the ml_collections wheel).
#
#   bash benchmarks/scripts/run_h200.sh grid both 16  # kernel step grid, f16 and f32, L 16 (third argument: buffer lengths)
#   bash benchmarks/scripts/run_h200.sh policies [--config.policies="('f16+fp8',)"]  # kernel step per precision policy vs the f16 baseline, b 256, L 16
#   bash benchmarks/scripts/run_h200.sh check      # kernel_bench smoke: every kernel vs the reference on the GPU
#   bash benchmarks/scripts/run_h200.sh decode     # hybrid_1b decode step, b {64,256,512} x L {8,16,32}, split at 256
#   bash benchmarks/scripts/run_h200.sh decode_b256  # hybrid_1b decode step at b 256, L 16 only
#   bash benchmarks/scripts/run_h200.sh decode_policies  # the same with dual-precision replay states (f32 master + bf16 / fp8 read copy)
#   bash benchmarks/scripts/run_h200.sh decode_profile  # hybrid_1b's decode step at b 256 by named scope (XLA's CUDA graphs off)
#   bash benchmarks/scripts/run_h200.sh prefill_profile  # one batched prefill (8 x 512 tokens, hybrid_1b) by block: the serving engine's admission
#   bash benchmarks/scripts/run_h200.sh pool_profile  # the serving pool's dispatch (256 slots of 1024 entries, replay) by scope, beside the static decode step at the same KV length
#   bash benchmarks/scripts/run_h200.sh qwen35_4b_profile  # the same on the Qwen3.5-4B text shape (GDN layers by scope), b 256
#   bash benchmarks/scripts/run_h200.sh qwen35_4b_specdec_profile [batch] [sections]  # a speculative-decoding iteration on the Qwen3.5-4B text shape split by kernel, replay states, b 256 (128 fits an H100; XLA's CUDA graphs off; the window forward, timed before, left out); sections: specdec_profile.py's --sections, "+"-joined in run_h200_chain.sh (default modes,accept,loops)
#   bash benchmarks/scripts/run_h200.sh specdec    # speculative decoding, hybrid_1b, b {256,512}, window 4
#   bash benchmarks/scripts/run_h200.sh specdec_fp8  # the same with f32 master + fp8 copy states (the snapshot baseline stays f32)
#   bash benchmarks/scripts/run_h200.sh specdec_accept  # plain and replay spec decoding at proposer acceptance 0.8 and 0.9
#   bash benchmarks/scripts/run_h200.sh specdec_compaction  # plain and replay spec decoding compacting the batch 2 or 3 times
#   bash benchmarks/scripts/run_h200.sh profile_kernels  # a spec-decoding iteration split by kernel, b 256 (XLA's CUDA graphs off)
#   bash benchmarks/scripts/run_h200.sh attention  # decode attention forms, hybrid_1b and 8B heads, then the verify window of 4
#   bash benchmarks/scripts/run_h200.sh gpu_tests  # conv, norm, attention kernels and the model's step / verify vs the reference on the GPU
#   bash benchmarks/scripts/run_h200.sh poisoned   # poisoned stale slots and verify causality, and their tests on the GPU
#   bash benchmarks/scripts/run_h200.sh drift      # precision_drift: every policy x L {4,16,64} + baselines, 100k steps
#   bash benchmarks/scripts/run_h200.sh precision SIZE  # precision_accuracy at one model size (tiny, small, medium, large)
#   bash benchmarks/scripts/run_h200.sh text_train NAME  # configs/train_text.py:NAME (mamba2|gdn _ s20m|s60m|s120m|s300m), stops before the limit, the next call resumes (carry runs/carry: the corpus archive)
#   bash benchmarks/scripts/run_h200.sh text_study NAME [STAGES]  # configs/precision_text.py:NAME: presets split over processes, merged into $OUT/text_NAME (benchmarks/scripts/text_precision.sh)
#   bash benchmarks/scripts/run_h200.sh ncu_flush  # Nsight Compute of the all-rows flush (f16 checkpoint, b 256, L 16)
#   bash benchmarks/scripts/run_h200.sh ncu_flush_fp8 [config_json]  # the same on the f16 master + fp8 copy
#   bash benchmarks/scripts/run_h200.sh mlp_gemm   # the Qwen3.5-4B dense MLP's GEMMs alone, gate / up as two weights or one packed weight, rows {256,1024}, with XLA's Triton GEMMs on and off (XLA's CUDA graphs off)
#   bash benchmarks/scripts/run_h200.sh moe_dispatch  # one Nemotron 3 Nano MoE layer per dispatch, balanced and imbalanced routing
#   bash benchmarks/scripts/run_h200.sh nano [parts] [batches]  # the Nemotron 3 Nano-shaped model: decode step, generate / speculative_generate (parts and batches joined by "," or "+"; run_h200_chain.sh needs "+", e.g. qwen35_4b,step+spec,256)
#   bash benchmarks/scripts/run_h200.sh qwen35_4b [parts] [batches]  # the same on the Qwen3.5-4B text shape (Gated DeltaNet); PRECISIONS=f32+fp8,f32+bf16 adds replay states under those presets to the step part, SPEC_PRECISION=f32+bf16 sets the spec part's replay states, SPEC_MODES=replay leaves out the snapshot baseline (which needs an H200's memory at batch 256); SPEC_COMPACTIONS=0,3 adds speculative runs whose batch halves up to 3 times as rows finish; SPEC_WINDOWS=2,3,4 times those windows (default 4: 3 drafts); the model's init takes ~6 s on a fresh machine (one compiled initializer per block kind; step at b 256 with two presets and spec at b 256 ran in 84 s on an H100)
#   bash benchmarks/scripts/run_h200.sh gdn_kernels  # the Gated DeltaNet kernels vs their references at Qwen3.5 shapes, then their tests on the GPU
#   bash benchmarks/scripts/run_h200.sh serve [hf_config]  # serve_bench: continuous batching, Poisson arrivals, baseline vs replay (hybrid_1b, or a transformers config's shape)
#   bash benchmarks/scripts/run_h200.sh serve_b256 [plain|speculative|plain+speculative] [hf_config]  # serve_bench saturated at 256 slots (512 requests at once); speculative: at acceptance 0.7
#   bash benchmarks/scripts/run_h200.sh serve_decode [on|off] [hf_config]  # serve_bench saturated at 256 slots on a decode-bound workload (prompts of 16-64, outputs of 256-768 tokens), the engine's overlap on or off
#   bash benchmarks/scripts/run_h200.sh serve_prefix [hf_config] [modes]  # serve_bench on a shared-prefix workload at a light load, without and with a prefix cache (modes: "+"-joined SSM modes, default baseline+replay; a cached engine's precompile takes ~4 min on an H100, so one mode per call; hf_config "-" for hybrid_1b)
#   bash benchmarks/scripts/run_h200.sh prefix_ttft [name] [flags]  # time to first token on an idle pool with a cached prefix of 25-94% of a 512-token prompt against insert without one, and the ideal (1 - f) of it, then 8 hits admitted one by one against one batched call (hybrid_1b); flags: prefix_ttft_bench.py's (--prompt_len, --max_len, --modes, --chunk_size, --fractions joined by "+"), output prefix_ttft_<name>.json
#   bash benchmarks/scripts/run_h200.sh admission_profile [on|off]  # an engine's admissions with and without a prefix cache under cProfile, each jitted call of the admission paths a row of its own (hybrid_1b, replay, 24 requests), XLA's command buffers on (default) or off; output admission_profile_cb_<on|off>.json
#   bash benchmarks/scripts/run_h200.sh dispatch_sync [name] [flags]  # which serving calls (insert, a prefix-cache hit, batched hits, a decode step, a MoE model's decode step) wait for device work queued before them, and their programs' while loops of unknown trip count (benchmarks/scripts/dispatch_sync.py; output dispatch_sync[_name].json)
#   bash benchmarks/scripts/run_h200.sh pool_occupancy [active rows] [hf_config]  # a pool of 256 slots partly occupied: the dense dispatch vs the active rows gathered or stepped in place through a slot per row (hybrid_1b, or a transformers config's shape, e.g. configs/qwen3_5_4b_text.json; rows "+"-joined in run_h200_chain.sh)
#   bash benchmarks/scripts/run_h200.sh slot_tests  # tests/test_slots.py on the GPU: the kernels through a slot per row against themselves on gathered rows
#   bash benchmarks/scripts/run_h200.sh gdn_bench    # the GDN step kernels timed: baseline (Pallas, XLA, flash-linear-attention) vs replay, b {256,64,1,512} x L {16,8,32}
#   bash benchmarks/scripts/run_h200.sh prefill_ttft_profile [name] [flags]  # one request's prefill (batch 1, 128 and 512 tokens, replay): device against wall time, by block (flags: decode_step_profile.py's, e.g. --segsum_difference or --segsum_masked, the forms of the Mamba-2 decay sums; output prefill_ttft_profile_<name>_<tokens>.json)
#   bash benchmarks/scripts/run_h200.sh prefill_scan_cost [flags]  # XLA's cost and the wall time of the Mamba-2 and GDN chunked prefill scans at hybrid_1b / Qwen3.5 layer shapes, 512 tokens; their products also at bf16 / TF32 dot algorithms, with the error against true f32
#   bash benchmarks/scripts/run_h200.sh gdn_baseline_tiles  # the GDN baseline step alone at b {64,256,512}, f32 / f16 state, over its launch shapes, beside flash-linear-attention's kernel
#   bash benchmarks/scripts/run_h200.sh gdn_batch1  # the GDN step kernels at b 1 and 8 per pipelining depth and launch shape, beside flash-linear-attention's kernel, two passes in one call (output gdn_batch1_{1,2}.json)
#   bash benchmarks/scripts/run_h200.sh gdn_ring_weights  # the GDN step kernels with and without the replay step's ring-weights launch (GDNConfig.ring_weights) and at 2 / 3 pipelining stages, beside flash-linear-attention's kernel, b {256,64}, L 16, f32 / f16 masters and the f16 + fp8 copy
#   bash benchmarks/scripts/run_h200.sh gdn_split  # the GDN replay step in one launch or two (GDNConfig.split_routes), with and without ring weights, beside the baselines and flash-linear-attention, b {256,64}, L 16, f32 / f16 masters and the f16 + fp8 copy
#   bash benchmarks/scripts/run_h200.sh gdn_heads  # the split replay step's output launch stepping through 2 or 4 value heads per program at 2 / 3 pipelining stages (GDNConfig.heads_per_program; the baseline step too), b {256,64}, L 16, f32 / f16 masters and the f16 + fp8 copy
#   bash benchmarks/scripts/run_h200.sh gdn_flush_fold  # the GDN replay step's flush fold by rank-1 updates or tensor-core products (GDNConfig.flush_fold), in one launch or two, b {256,64}, L 16, staggered and aligned (flush steps timed alone), f32 / f16 masters and the f16 + fp8 copy
#   bash benchmarks/scripts/run_h200.sh gdn_registers  # the GDN replay step's register budget: its launch capped at 128 registers (GDNConfig.max_registers), split routes with the flush launch at 8 warps (GDNConfig.flush_num_warps), against the defaults, b {256,64}, L 16, staggered and aligned, f32 / f16 masters, f16 / f32 masters with an fp8 copy and an f32 master with a bf16 copy
#   bash benchmarks/scripts/run_h200.sh gdn_ncu    # Nsight Compute of the GDN baseline step and the replay step in one launch and two, without ring weights (f32, b 256, L 16)
#   [BENCH=gdn_verify_bench.py] bash benchmarks/scripts/run_h200.sh gdn_trees DIR... [-- FLAGS]  # the GDN step (or verify) kernels of several exported trees side by side (each `git archive` of a commit in an ignored folder, carried): gdn_kernel_bench from each in turn, b {256,64}, L 16, staggered, f32 / f16 masters and the f16 + fp8 copy (FLAGS replace these), into $OUT/gdn_trees/<dir>.json
#   bash benchmarks/scripts/run_h200.sh gdn_verify   # the GDN speculative verify + commit per iteration (window 4, L 16): the Pallas kernels at their defaults (f16: 2 warps), without the coefficients' first launch and at four launch shapes (4 warps among them), the reference, the snapshot baseline, b {256,64}; f32, f16, f16 + fp8 copy, f32 + bf16 copy
#   bash benchmarks/scripts/run_h200.sh gdn_readout  # the GDN state readouts alone in the [K, V] and transposed [V, K] layouts against a plain read (b 256)
#   bash benchmarks/scripts/run_h200.sh multi_gpu [meshes]  # multi_device_bench on every GPU of a multi-GPU host (hybrid_1b, random weights, global b {256,512}, the ops per shard), e.g. meshes "((1,1),(1,4),(4,1))"
#
# Several parts in one call within a total budget: run_h200_chain.sh.
#
# To run exactly a commit (no uncommitted edits travel), export it into an
# ignored folder and carry that:
#   echo /.clean/ >> .git/info/exclude; rm -rf .clean; mkdir .clean
#   git archive HEAD | tar -x -C .clean; cp -r wheels .clean/
#   (device) carry [".clean"]; command: cd .clean && bash benchmarks/scripts/run_h200.sh <part>
#
# Results land under $OUT/<part> (config.json, metrics.jsonl, tables, PNGs).
set -euo pipefail
compgen -G 'wheels/*.whl' >/dev/null || {
  echo "run_h200.sh: no wheels/*.whl (pip download --no-deps -d wheels ml_collections here, carry wheels)" >&2
  exit 2; }
pip install --no-deps --no-index -q --target /tmp/mlc wheels/*.whl 2>/dev/null
export PYTHONPATH=.:/tmp/mlc
# jax's persistent compilation cache, so that a later call on the same warm
# machine loads what an earlier one compiled (the key is the program: two
# source trees do not share entries).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/replayssm_jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-1}
OUT=${OUT:-runs}
# Per-part limit (s); lower it to run several parts in one 10-minute call.
T=${PART_TIMEOUT:-560}
mkdir -p "$OUT"
# specdec_bench on hybrid_1b into $OUT/<workdir name>, with extra overrides.
specdec_bench() {
  timeout "$T" python -m experiments.specdec_bench \
    --config=configs/specdec_bench.py --workdir="$OUT/$1" "${@:2}"
}
# gdn_kernel_bench side by side per GDNConfig field set (argument 2, a JSON
# list) into $OUT/<argument 1>.json: b {256,64}, L 16, staggered counters,
# f32 / f16 masters and the f16 + fp8 copy, flash-linear-attention's kernel
# beside the baselines (its wheels in wheels/).
gdn_configs() {
  timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
    --batches=256,64 --buffer_lens=16 --checkpoints=f32,f16 \
    --policies=f16+fp8 --no_xla --layouts=staggered --configs="$2" \
    --budget_s=$(( T - 60 )) --out="$OUT/$1.json"
}
# Nsight Compute: clocks as they run and the sections every ncu part reads
# (a part adds its own).
NCU=(ncu --clock-control none --section SpeedOfLight --section Occupancy
     --section LaunchStats --section WarpStateStats --section SchedulerStats
     --section InstructionStats --section MemoryWorkloadAnalysis)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu_${1}.csv"
case "$1" in
  grid)
    dtype=${2:?grid needs f16, f32 or both}
    case "$dtype" in
      f16) d="'float16'," ;; f32) d="'float32'," ;; both) d="'float16','float32'" ;;
      *) echo "grid: unknown dtype $dtype" >&2; exit 2 ;;
    esac
    lens=${3:-4,8,16,32}  # buffer lengths
    timeout "$T" python -m experiments.kernel_bench --config=configs/kernel_bench.py \
      --workdir="$OUT/grid_$dtype" --config.checkpoint_dtypes="($d)" \
      --config.buffer_lens="($lens,)" \
      --config.iters=10 --config.name="grid_$dtype" ;;
  policies)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:policies --workdir="$OUT/policies" \
      --config.iters=10 "${@:2}" ;;
  check)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:smoke --workdir="$OUT/check" ;;
  decode)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode" --config.bench.batches='(64,256,512)' \
      --config.bench.repeats=2 ;;
  decode_b256)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_b256" --config.bench.batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.split_batches='()' \
      --config.bench.repeats=2 ;;
  decode_policies)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_policies" --config.bench.batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.split_batches='(256,)' \
      --config.bench.replay_policies="('f32+bf16','f32+fp8')" \
      --config.bench.repeats=2 ;;
  decode_profile)
    # hybrid_1b's decode step by named scope (replay and baseline, b 256)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/decode_step_profile.py --top 400 \
      --hlo_dir "$OUT/decode_step_hlo" --out "$OUT/decode_step_profile.json" ;;
  prefill_profile)
    # One batched prefill as the serving engine admits (hybrid_1b, 8
    # prompts of 512 tokens), by block.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/decode_step_profile.py --part prefill \
      --batch 8 --prompt_len 512 --top 200 \
      --out "$OUT/prefill_profile.json" ;;
  prefill_ttft_profile)
    # A request's prefill as time to first token sees it: batch 1, the
    # 128 tokens a hit of 384 cached leaves and the whole 512 (prefix_ttft's
    # cases), device time against wall time, by block. Argument 2: a name
    # for the output files; further ones: decode_step_profile.py's flags
    # (e.g. --segsum_difference).
    for t in 128 512; do
      XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout $(( T / 2 )) \
        python benchmarks/scripts/decode_step_profile.py --part prefill \
        --modes replay --batch 1 --prompt_len $t --max_len 1024 --top 100 \
        --out "$OUT/prefill_ttft_profile${2:+_$2}_$t.json" "${@:3}"
    done ;;
  prefill_scan_cost)
    # Further arguments replace the default study (its dot algorithms).
    if [ $# -gt 1 ]; then flags=("${@:2}"); else flags=(
      --precisions=BF16_BF16_F32_X3,BF16_BF16_F32_X6,TF32_TF32_F32_X3,TF32_TF32_F32,BF16_BF16_F32); fi
    timeout "$T" python -u benchmarks/scripts/prefill_scan_cost.py \
      "${flags[@]}" --out "$OUT/prefill_scan_cost.json" ;;
  pool_profile)
    # Why the pool's step is slower than decode_bench's static one: both
    # at 256 rows after 64-token prompts, KV caches of 1024 entries.
    for part in pool decode; do
      XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
        python benchmarks/scripts/decode_step_profile.py --part $part \
        --modes replay --prompt_len 64 --max_len 1024 --steps 8 --top 200 \
        --out "$OUT/${part}_profile_1024.json"
    done ;;
  qwen35_4b_profile)
    # The same on the Qwen3.5-4B text shape (random bf16 weights), b 256.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/decode_step_profile.py \
      --config configs/qwen3_5_4b_text.json --prompt_len 32 --top 200 \
      --out "$OUT/qwen35_4b_profile.json" ;;
  qwen35_4b_specdec_profile)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch "${2:-256}" \
      --config configs/qwen3_5_4b_text.json --modes replay \
      --loops plain,replay --sections "$(tr + , <<< "${3:-modes,accept,loops}")" \
      --out "$OUT/specdec_profile_qwen35_4b.json" ;;
  specdec)
    specdec_bench specdec --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' ;;
  specdec_fp8)
    specdec_bench specdec_fp8 --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.precision=f32+fp8 ;;
  specdec_accept)
    # Window 4 at higher acceptance (the proposer's per-draft probability;
    # 0.7, the benchmark's default, gives 2.55 accepted tokens per verify),
    # plain decoding and replay spec decoding only: where replay spec
    # decoding overtakes plain decoding in a static batch.
    for a in 0.8 0.9; do
      specdec_bench "specdec_accept$a" --config.bench.batches='(256,512)' \
        --config.bench.windows='(4,)' --config.bench.accept_prob=$a \
        --config.bench.ssm_modes="('replay',)" || echo "specdec_accept: $a failed"
    done ;;
  specdec_L32)
    specdec_bench specdec_L32 --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.buffer_len=32 \
      --config.bench.ssm_modes="('replay',)" ;;
  specdec_compaction)
    # Plain decoding and replay spec decoding compacting 2 or 3 times
    # (b 512 -> 256 -> 128 [-> 64]), b {256,512}.
    specdec_bench specdec_compaction --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.ssm_modes="('replay',)" \
      --config.bench.compactions='(2,3)' ;;
  profile_kernels)
    # The same with XLA's CUDA graphs off, so the trace splits every loop
    # by kernel (the `*_ops` entries; its step times pay the launches).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch 256 \
      --out "$OUT/specdec_profile_kernels.json" ;;
  attention)
    timeout "$T" python benchmarks/scripts/attend_micro.py \
      --out "$OUT/attend_micro.json"
    timeout "$T" python benchmarks/scripts/attend_micro.py --q_heads 32 \
      --kv_heads 8 --variants default,s1,split128,split64 \
      --out "$OUT/attend_micro_8b.json" ;&  # then the window of 4
  attention_window)
    timeout "$T" python benchmarks/scripts/attend_micro.py --window 4 \
      --variants default,s1,split128 --out "$OUT/attend_micro_window4.json" ;;
  mlp_gemm)
    for triton in true false; do
      XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_enable_triton_gemm=$triton" \
        timeout $(( T / 2 )) python -u benchmarks/scripts/mlp_gemm_micro.py \
        --out="$OUT/mlp_gemm_micro_triton_$triton.json" \
        || echo "mlp_gemm: triton gemm $triton failed"
    done ;;
  moe_dispatch)
    for std in 0 0.1; do
      timeout "$T" python -u benchmarks/scripts/moe_dispatch.py \
        --router_bias_std=$std --out="$OUT/moe_dispatch_bias$std.json"
    done ;;
  nano|qwen35_4b)
    # Argument 2: the parts (default step,spec); 3: the batches of both
    # ("+" joins them as "," does: run_h200_chain.sh splits on commas).
    b=${3:-256,64,1}; b=${b//+/,}; parts=${2:-step,spec}
    cfg=configs/nemotron3_nano_30b_a3b.json
    [ "$1" = qwen35_4b ] && cfg=configs/qwen3_5_4b_text.json
    timeout "$T" python -u benchmarks/scripts/random_weight_decode.py \
      --hf_config=$cfg --parts="${parts//+/,}" --batches="$b" \
      --spec_batches="$b" --prng_impl=rbg --budget_s=$(( T - 120 )) \
      --precisions="${PRECISIONS:-}" --spec_precision="${SPEC_PRECISION:-}" \
      --spec_modes="${SPEC_MODES:-replay,baseline}" \
      --spec_windows="${SPEC_WINDOWS:-4}" \
      --spec_compactions="${SPEC_COMPACTIONS:-0}" --out="$OUT/$1.json" ;;
  gdn_kernels)
    timeout "$T" python -u benchmarks/scripts/gdn_kernels_check.py \
      --out="$OUT/gdn_kernels.json"
    REPLAYSSM_TEST_CACHE=0 timeout "$T" python -m pytest -q \
      -p no:cacheprovider tests/test_gdn_kernel.py \
      tests/test_gdn_kernel_verify.py > "$OUT/gdn_kernel_tests.txt" 2>&1 \
      || echo "gdn_kernels: failures (see $OUT/gdn_kernel_tests.txt)" ;;
  gdn_bench)
    # flash-linear-attention comes from its wheels in wheels/ (fla_core,
    # einops; pip download them here).
    timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
      --batches=256,64,1,512 --buffer_lens=16,8,32 --budget_s=$(( T - 120 )) \
      --out="$OUT/gdn_kernel_bench.json" ;;
  gdn_defaults)
    # The step kernels at their launch defaults, batches 256, 64, 1, 512
    # (the budget cuts the tail), L 16, staggered counters, beside fla's
    # kernel: the table the targets are read from.
    timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
      --batches=256,64,1,512 --buffer_lens=16 --checkpoints=f32,f16 \
      --policies=f16+fp8,f32+bf16 --no_xla --layouts=staggered \
      --budget_s=$(( T - 40 )) --out="$OUT/gdn_defaults.json" ;;
  gdn_batch1)
    # At batch 1 the f32 baseline step took twice the f16 one (H100,
    # ddcc2d4: 20.0 against 9.1 µs; flash-linear-attention 4.6), its
    # 3 stages chosen at batch 64 and 256; two passes tell the launch shape
    # from a timing outlier.
    for pass in 1 2; do
      timeout $(( T / 2 )) python -u benchmarks/scripts/gdn_kernel_bench.py \
        --batches=1,8 --buffer_lens=16 --checkpoints=f32,f16 --policies= \
        --no_xla --layouts=staggered --configs='[{}, {"num_stages": 1}, {"num_stages": 2}, {"block_v": 32}, {"block_v": 8, "num_warps": 1}]' \
        --budget_s=$(( T / 2 - 30 )) --out="$OUT/gdn_batch1_$pass.json"
    done ;;
  gdn_baseline_tiles)
    # The baseline step alone at its launch shapes, beside fla's kernel
    # ([128, 8] tiles, 1 warp: the shape it launches).
    timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
      --batches=64,256,512 --buffer_lens= --checkpoints=f32,f16 --policies= \
      --no_xla --layouts=staggered --configs='[{}, {"block_v": 32}, {"block_v": 128}, {"block_v": 128, "num_warps": 8}, {"block_v": 8, "num_warps": 1}, {"block_v": 16, "num_warps": 1}, {"num_stages": 1}, {"heads_per_program": 2, "num_stages": 3}]' \
      --budget_s=$(( T - 60 )) --out="$OUT/gdn_baseline_tiles.json" ;;
  gdn_ring_weights)
    gdn_configs gdn_ring_weights '[{}, {"ring_weights": true}, {"num_stages": 2}, {"num_stages": 3}]' ;;
  gdn_split)
    gdn_configs gdn_split '[{}, {"split_routes": true}, {"split_routes": true, "ring_weights": false}, {"split_routes": true, "num_stages": 2}, {"split_routes": true, "block_v": 32}, {"split_routes": true, "block_v": 128, "num_warps": 8}]' ;;
  gdn_heads)
    gdn_configs gdn_heads '[{}, {"split_routes": true}, {"split_routes": true, "heads_per_program": 2, "num_stages": 2}, {"split_routes": true, "heads_per_program": 2, "num_stages": 3}, {"split_routes": true, "heads_per_program": 4, "num_stages": 3}]' ;;
  gdn_flush_fold)
    timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
      --batches=256,64 --buffer_lens=16 --checkpoints=f32,f16 \
      --policies=f16+fp8 --no_xla --no_fla --layouts=staggered,aligned \
      --configs='[{}, {"flush_fold": "dot"}, {"split_routes": true}, {"split_routes": true, "flush_fold": "dot"}]' \
      --budget_s=$(( T - 60 )) --out="$OUT/gdn_flush_fold.json" ;;
  gdn_registers)
    timeout "$T" python -u benchmarks/scripts/gdn_kernel_bench.py \
      --batches=256,64 --buffer_lens=16 --checkpoints=f32,f16 \
      --policies=f16+fp8,f32+fp8,f32+bf16 --no_xla --no_fla \
      --layouts=staggered,aligned \
      --configs='[{}, {"max_registers": 128}, {"split_routes": true}, {"split_routes": true, "flush_num_warps": 8}]' \
      --budget_s=$(( T - 60 )) --out="$OUT/gdn_registers.json" ;;
  gdn_ncu)
    # Not the ring-weights launch: Nsight Compute failed on it (and stopped
    # the run there), so the replay step runs without it, in one launch
    # and in two.
    timeout "$T" "${NCU[@]}" -k 'regex:replayssm_gdn_(step|replay)' \
      --section SourceCounters \
      python benchmarks/scripts/gdn_ncu_profile.py --configs \
      '[{"ring_weights": false}, {"ring_weights": false, "split_routes": true}]' \
      > "$OUT/gdn_ncu.txt" 2>&1 ;;
  gdn_trees)
    # Trees in turn, the time split evenly; fla's kernel (the verify's
    # reference and snapshot baseline) in the first only.
    # BENCH=gdn_verify_bench.py: that script instead (FLAGS needed), the
    # harness (it and gdn_kernel_bench.py) copied from this checkout into
    # each tree, so that only the kernels differ.
    shift; trees=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do trees+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift
    flags=("$@"); [ ${#flags[@]} -eq 0 ] && flags=(--batches=256,64
      --buffer_lens=16 --checkpoints=f32,f16 --policies=f16+fp8 --no_xla
      --layouts=staggered)
    bench=${BENCH:-gdn_kernel_bench.py}; once=()  # after the first tree
    mkdir -p "$OUT/gdn_trees"; each=$(( T / ${#trees[@]} ))
    for t in "${trees[@]}"; do
      name=$(basename "$t"); name=${name#.}
      [ "$bench" = gdn_kernel_bench.py ] || cp benchmarks/scripts/gdn_kernel_bench.py \
        "benchmarks/scripts/$bench" "$t/benchmarks/scripts/"
      (cd "$t" && timeout "$each" python -u "benchmarks/scripts/$bench" \
        "${flags[@]}" "${once[@]}" --budget_s=$(( each - 25 )) \
        --out="$OUT/gdn_trees/$name.json") \
        > "$OUT/gdn_trees/$name.log" 2>&1 || echo "gdn_trees: $t failed"
      once=(--no_fla)
      [ "$bench" = gdn_kernel_bench.py ] || once=(--no_xla --no_snapshot)
    done ;;
  gdn_verify)
    timeout "$T" python -u benchmarks/scripts/gdn_verify_bench.py \
      --precisions=f32,f16,f16+fp8,f32+bf16 --configs='[{}, {"ring_weights": false}, {"block_v": 32}, {"num_warps": 4}, {"block_v": 8, "num_warps": 1}, {"block_v": 64, "num_warps": 8}]' \
      --budget_s=$(( T - 120 )) --out="$OUT/gdn_verify_bench.json" ;;
  gdn_readout)
    timeout "$T" python -u benchmarks/scripts/gdn_readout_layout.py \
      --batches=256 --out="$OUT/gdn_readout_layout.json" ;;
  multi_gpu)
    # NVLink multicast stays off (the device notes: a program using it can
    # take the host's shared GPUs out of service).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
      NVSHMEM_DISABLE_NVLS=1
    timeout "$T" python -m experiments.multi_device_bench \
      --config=configs/multi_device_bench.py --workdir="$OUT/multi_gpu" \
      --config.bench.global_batches="(256,512)" \
      ${2:+--config.bench.meshes=$2} ;;
  serve)
    timeout "$T" python -m experiments.serve_bench \
      --config=configs/serve_bench.py --workdir="$OUT/serve" \
      ${2:+--config.hf_config=$2} ;;
  serve_b256)
    # Saturated: 512 requests at once into 256 slots, outputs of 128-512
    # tokens; argument 2: the variants, "+"-separated (default plain;
    # speculative: the flat oracle at acceptance 0.7), each about 5 min.
    v=${2:-plain}
    timeout "$T" python -m experiments.serve_bench \
      --config=configs/serve_bench.py --workdir="$OUT/serve_b256_${v//+/_}" \
      --config.serve.variants="('${v//+/\',\'}',)" \
      --config.serve.capacity=256 --config.serve.arrival_rate=0 \
      --config.serve.num_requests=512 --config.serve.output_len_min=128 \
      --config.serve.output_len_max=512 \
      --config.serve.proposer=flat_sampling --config.serve.temperature=1000 \
      --config.serve.accept_prob=0.7 ${3:+--config.hf_config=$3} ;;
  serve_decode)
    # Saturated and decode-bound: 512 requests at once into 256 slots,
    # prompts of 16-64 tokens, outputs of 256-768, greedy; argument 2: the
    # engine's overlap of host and device, on (default) or off.
    o=${2:-on}
    timeout "$T" python -m experiments.serve_bench \
      --config=configs/serve_bench.py --workdir="$OUT/serve_decode_$o" \
      --config.serve.variants="('plain',)" --config.serve.capacity=256 \
      --config.serve.arrival_rate=0 --config.serve.num_requests=512 \
      --config.serve.prompt_len_min=16 --config.serve.prompt_len_max=64 \
      --config.serve.output_len_min=256 --config.serve.output_len_max=768 \
      --config.serve.overlap=$([ "$o" = off ] && echo False || echo True) \
      ${3:+--config.hf_config=$3} ;;
  serve_prefix)
    # Prefill-bound requests at a light load (no queueing): prompts of
    # 464-512 tokens, 448 of them one of 4 shared prefixes, 16-32 new
    # tokens; each mode without and with a prefix cache of 16-token blocks.
    timeout "$T" python -m experiments.serve_bench \
      --config=configs/serve_bench.py --workdir="$OUT/serve_prefix${3:+_$3}" \
      --config.serve.num_requests=192 --config.serve.arrival_rate=16 \
      --config.serve.prompt_len_min=464 --config.serve.prompt_len_max=512 \
      --config.serve.output_len_min=16 --config.serve.output_len_max=32 \
      --config.serve.shared_prefixes=4 --config.serve.shared_prefix_len=448 \
      --config.serve.speculative_window=0 \
      --config.serve.ssm_modes="('$(echo "${3:-baseline+replay}" | sed "s/+/','/g")',)" \
      $([ "${2:--}" != - ] && echo "--config.hf_config=$2") ;;
  prefix_ttft)
    # Argument 2: a name for the output file; further ones: the script's
    # flags (fractions joined by "+").
    timeout "$T" python -u benchmarks/scripts/prefix_ttft_bench.py \
      --out="$OUT/prefix_ttft${2:+_$2}.json" "${@:3}" ;;
  dispatch_sync)
    timeout "$T" python -u benchmarks/scripts/dispatch_sync.py \
      --out="$OUT/dispatch_sync${2:+_$2}.json" "${@:3}" ;;
  admission_profile)
    cb=${2:-on}
    XLA_FLAGS="${XLA_FLAGS:-}$([ "$cb" = off ] && echo ' --xla_gpu_enable_command_buffer=')" \
      timeout "$T" python -u benchmarks/scripts/admission_profile.py \
      --modes=replay --requests=24 --out="$OUT/admission_profile_cb_$cb.json" ;;
  pool_occupancy)
    timeout "$T" python -u benchmarks/scripts/pool_occupancy_bench.py \
      --occupancies="$(echo "${2:-64,256}" | tr + ,)" \
      ${3:+--hf_config=$3} --out="$OUT/pool_occupancy${3:+_$(basename "$3" .json)}.json" ;;
  slot_tests)
    # The ops and the model's decode step through a slot per row, the
    # kernels compiled for the GPU (tests/test_slots.py).
    JAX_DEFAULT_MATMUL_PRECISION=highest REPLAYSSM_TEST_CACHE=0 \
      timeout "$T" python -m pytest -q -p no:cacheprovider tests/test_slots.py \
      > "$OUT/slot_tests.txt" 2>&1 \
      || echo "slot_tests: failures (see $OUT/slot_tests.txt)" ;;
  gpu_tests)
    # Kernel-vs-reference tests that run the real kernels on the GPU (the
    # conv step, the gated norm, the decode attention, and the model's
    # decode step and verify through every kernel), pytest's output kept.
    # The tests' f32 tolerances assume IEEE f32 matmuls (the model's
    # Linear layers use XLA's default precision, TF32 on the GPU).
    # Argument 2 "window": only the conv window kernel's tests and the
    # model-level test.
    k="kernel_matches or with_the_kernel or kernel_and_reference"
    [ "${2:-}" = window ] && k="window_kernel_matches or with_the_kernel"
    JAX_DEFAULT_MATMUL_PRECISION=highest REPLAYSSM_TEST_CACHE=0 \
      timeout "$T" python -m pytest -q -p no:cacheprovider \
      tests/test_conv.py tests/test_norm.py tests/test_attention.py \
      -k "$k" \
      > "$OUT/gpu_tests.txt" 2>&1 \
      || echo "gpu_tests: failures (see $OUT/gpu_tests.txt)" ;;
  drift)
    timeout "$T" python -m experiments.precision_drift \
      --config=configs/precision_drift.py --workdir="$OUT/drift" ;;
  precision)
    size=${2:?precision needs a size: tiny, small, medium or large}
    timeout "$T" python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py:"$size" \
      --workdir="$OUT/precision_$size" --config.train_missing=True ;;
  ncu_flush)
    timeout "$T" "${NCU[@]}" -k regex:replayssm_replay_flush -c 1 \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      python benchmarks/scripts/ncu_profile.py --counts flush \
      > "$OUT/ncu_flush.txt" 2>&1 ;;
  ncu_flush_fp8)
    # The f16 master + fp8 copy flush route with every row folding (b 256,
    # L 16; ReplayConfig fields as JSON in argument 2, default {}).
    timeout "$T" "${NCU[@]}" -k regex:replayssm_replay_flush -c 1 \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      python benchmarks/scripts/ncu_profile.py --counts flush \
      --policy f16+fp8 --config "${2:-{\}}" > "$OUT/ncu_flush_fp8.txt" 2>&1 ;;
  poisoned)
    # Stale buffer slots poisoned, every route checked against the
    # reference and for causality (benchmarks/correctness/poisoned_slots_h200.json).
    timeout "$T" python benchmarks/scripts/poisoned_inputs_gpu.py \
      --out="$OUT/poisoned_inputs.json"
    timeout "$T" python -m pytest -q -p no:cacheprovider \
      tests/test_poisoned_inputs.py tests/test_traced_policy.py \
      > "$OUT/poisoned_tests.txt" 2>&1 || echo "poisoned: test failures" ;;
  text_corpus|text_train|text_study)
    # The real-text precision study (benchmarks/scripts/text_precision.sh
    # says what each does and how the corpus travels).
    T="$T" OUT="$OUT" bash benchmarks/scripts/text_precision.sh "$@" ;;
  *) echo "unknown part: $1" >&2; exit 2 ;;
esac
