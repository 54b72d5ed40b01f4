#!/usr/bin/env bash
# One device call's worth of H200 benchmarks (each part should fit the 10-minute
# command limit; run from the repository root on the GPU machine with the
# `wheels/` folder carried: it holds the ml_collections wheel).
#
#   (wall times measured on 2026-11-29, sessions 3-4)
#   bash benchmarks/scripts/run_h200.sh sweep      # flush-route designs vs the default, b 256 + 64, L 16 (3.2 min with 7 variants in session 11, 3.8 min with 5 in session 12, 1.5 min with 3 in session 15; now the 2-warp flush and the default repeated)
#   bash benchmarks/scripts/run_h200.sh grid f16   # full kernel grid, one dtype (~4 min)
#   bash benchmarks/scripts/run_h200.sh grid f32
#   bash benchmarks/scripts/run_h200.sh grid both  # both dtypes, f16 first (8 min)
#   bash benchmarks/scripts/run_h200.sh grid both 16  # L 16 only (2.3 min; third argument: buffer lengths, e.g. 8,16)
#   bash benchmarks/scripts/run_h200.sh decode     # hybrid_1b decode, b {64,256,512} x L {8,16,32} + split at 256 (~5 min)
#   bash benchmarks/scripts/run_h200.sh decode_policies  # hybrid_1b decode at b 256, L 16, also with dual-precision replay states (f32 master + bf16 / fp8 read copy), split per part (2.4 min, session 11)
#   bash benchmarks/scripts/run_h200.sh decode_extra  # hybrid_1b batch 1 (kernels), XLA reference ops at b {1,64,256} L 16 (> 4 min: the reference part needs ~3 min more than the 115 s it got)
#   bash benchmarks/scripts/run_h200.sh specdec    # hybrid_1b spec decoding, b {256,512}, T 4 (2.5 min in session 10, 2.7 in session 12; 4.1 min in session 30 with compaction 0 and 2)
#   bash benchmarks/scripts/run_h200.sh specdec256  # b 256 only, plain and replay spec (session 30)
#   bash benchmarks/scripts/run_h200.sh specdec_compaction  # b {256,512}, plain and replay spec at compaction 2 and 3 (session 30)
#   bash benchmarks/scripts/run_h200.sh specdec256_graphs  # the same with XLA command buffers for conditionals and while loops (session 30: no gain)
#   bash benchmarks/scripts/run_h200.sh specdec_fp8  # the same with the plain and replay states under f32+fp8 (f32 master, fp8 read copy; the verify kernels' policy support, session 26, not yet run); the snapshot baseline stays f32
#   bash benchmarks/scripts/run_h200.sh specdec_accept  # b {256,512}, T 4, plain and replay spec only, proposer acceptance 0.8 and 0.9 (not yet run)
#   bash benchmarks/scripts/run_h200.sh specdec_L32  # the same with a 32-token replay buffer: a row folds its history every ~11 iterations instead of ~5 (the early-flush fold took 0.81 of the replay iteration's 8.16 ms at L 16, session 10; not yet run)
#   bash benchmarks/scripts/run_h200.sh specdec_small    # the same at b {1,64}, T {4,2,8} (issue 5's other batches and windows; > 3.2 min: session 11 ran it to its 190 s limit inside batch 64)
#   bash benchmarks/scripts/run_h200.sh specdec_windows  # b {256,512} at T {2,8} (> 3.2 min: session 11 ran it to its 190 s limit after batch 512's plain row)
#   bash benchmarks/scripts/run_h200.sh profile    # where a spec-decoding iteration's time goes, b 256, with the verify split and a per-kernel split of the plain step, verify + commit, window forward and (since session 8, untimed: + ~2 min) specdec_bench's own loops per iteration (2 min in session 7; its per-kernel split needs `profile_kernels`, which runs it with XLA's CUDA graphs off)
#   bash benchmarks/scripts/run_h200.sh profile_b1  # the same two profiles at batch 1, where replay spec decoding was 0.60-0.64x the baseline's (session 11); session 12 ran the first (2.4 min: device time per iteration within 4%), the per-kernel second is not yet run
#   bash benchmarks/scripts/run_h200.sh profile_b1_kernels  # profile_b1's per-kernel half alone (not yet run)
#   bash benchmarks/scripts/run_h200.sh profile_kernels_fp8  # profile_kernels with f32 + fp8 copy replay states, plain and replay loops only (not yet run)
#   bash benchmarks/scripts/run_h200.sh batch1     # batch 1, f32 / f16, L 16: the fused launch's default fold (3xTF32) vs the bf16-split fold (1.5 min in session 13)
#   bash benchmarks/scripts/run_h200.sh rows_fused # both routes in one launch on the output grid (fused_launch + flush_grid rows) beside the default, b 256, f32 / f16, L 16 (with batch1: 4 min in session 19)
#   bash benchmarks/scripts/run_h200.sh mosaic_flush  # the flush rows folded by the Mosaic GPU kernel (its variants) beside the Triton default, b 256, f32 / f16, L 16
#   bash benchmarks/scripts/run_h200.sh launch     # fused vs separate route launches, b 16 + 64, L 16 (1.2 min)
#   bash benchmarks/scripts/run_h200.sh mosaic     # the Mosaic GPU kernels: baseline (7 configs) vs Triton and XLA, replay with the Mosaic output route (plain, f32+fp8, f16+fp8), b 256 + 64, f32 / f16, each checked first; a Mosaic failure is recorded, not fatal (> 3 min: session 7 ran f32 in 185 s, f16 without policies in 90 s)
#   bash benchmarks/scripts/run_h200.sh verify [--variants a,b]  # spec verify kernel: VerifyConfig variants on hybrid_1b's layer, b 256, T 4, checked, split per kernel (14 variants: ~2 min in session 9; all 25 now, or pick with verify_sweep.py --variants)
#   bash benchmarks/scripts/run_h200.sh hlo_dump   # XLA's optimized HLO of the plain and replay spec loops at b 256, packed (session 30: ~70 s)
#   bash benchmarks/scripts/run_h200.sh verify_ab VARIANTS [MODES] [ab]  # window-kernel candidates swept, then spec decoding at b {256,512} with the fastest as the default (and with "ab" b 512 at the code's default; session 31: 5.2 min)
#   bash benchmarks/scripts/run_h200.sh verify_copy  # the verify kernels on f32 and on f32 + fp8 copy states: masked vs branching copy readout, capped fold (not yet run)
#   bash benchmarks/scripts/run_h200.sh ncu_verify # Nsight Compute on the verify window kernel (default and the pre-session-8 default)
#   bash benchmarks/scripts/run_h200.sh ncu_flush  # Nsight Compute on the flush route with every row folding (f16 checkpoint, b 256, L 16): stall reasons, instruction mix, source counters (1.5 min, session 11: it profiles one launch; with two, the second failed and the GPU stayed out of memory for the next part)
#   bash benchmarks/scripts/run_h200.sh ncu_flush_grids  # Nsight Compute of the f32 all-rows flush: persistent grid, rows grid, one launch on the output grid (3 min in session 19)
#   bash benchmarks/scripts/run_h200.sh ncu_flush_fp8 [config_json]  # Nsight Compute on the f16 master + fp8 copy flush route, every row folding (b 256, L 16; ~80 s in session 36)
#   bash benchmarks/scripts/run_h200.sh ncu_b1     # Nsight Compute at batch 1 (f16, no row folding): the baseline step and the fused replay step
#   bash benchmarks/scripts/run_h200.sh ncu_sass   # per-instruction SASS counters (ncu source page, CSV): the verify window kernel at b 512, the f16 + fp8 output route at b 256 (session 34)
#   bash benchmarks/scripts/run_h200.sh ncu_fp8    # Nsight Compute of the output route at batch 256 (no row folding): plain f16 checkpoint vs f16 master + fp8 copy (2.2 min in session 17)
#   bash benchmarks/scripts/run_h200.sh policies_sr  # the stochastic presets session 27 did not time (f16+fp8+sr:hash32, threefry f32+int8+sr and f16+fp8+sr)
#   bash benchmarks/scripts/run_h200.sh policies_fp8_L  # f16+fp8 and f32+fp8 at L 16 and 32 (not yet run)
#   bash benchmarks/scripts/run_h200.sh fp8_split [variants] [flush_variants]  # the f16 + fp8 step split by kernel (output_split.py: non-flush per variant, then the all-rows flush per variant), then the policies study on f16 + fp8 (session 35's calls took ~2 min)
#   bash benchmarks/scripts/run_h200.sh policies [overrides]  # replay per precision policy (session 15: defaults only, 2.4 min for all 8; now also the uncapped flush) vs the f16 baseline, b 256, L 16 (2.5 min for 4 policies x 3 in session 9; > 4.8 min for all 7 x 2 in session 12, cut at its 290 s limit; 2.8 min for 3 x 4)
#   bash benchmarks/scripts/run_h200.sh output_launch  # the output route's launch shape on the f16 checkpoint and the fp8 read copies, b 256, L 16 (5 variants: 1.8 min in session 11; session 15: 4 register caps 2 min, one variant 45 s)
#   bash benchmarks/scripts/run_h200.sh precision small  # train the <task>_small_ssm models if missing, then the accuracy study (sizes tiny|small|medium|large; tiny took > 4.5 min with the old MQAR task, the full 13-policy study needs several calls or fewer policies; f16+fp8 joined in session 23, not yet run)
#   bash benchmarks/scripts/run_h200.sh precision_mqar1024_rest  # retrains mqar_medium_ssm, then mqar_medium_ssm@1024's rows session 5 did not reach (f32, bf16+sr, f16+sr at every L; the 8 every-step baselines) (not yet run; session 5's whole medium study took > 9 min)
#   bash benchmarks/scripts/run_h200.sh precision_rest  # trains mqar_large_ssm + char_large_ssm, evaluates mqar_large_ssm@1024 and char_large_ssm (13 policies since session 23, 12 then; > 9.6 min: session 6 ran it to its 575 s limit, inside char_large_ssm)
#   bash benchmarks/scripts/run_h200.sh decode8b   # Nemotron-H-8B shapes (random bf16 weights), b {64,256}, L 16 (3 min)
#   bash benchmarks/scripts/run_h200.sh decode8b_split  # the same at b 256 only, with the per-part time split (not yet run)
#   bash benchmarks/scripts/run_h200.sh decode8b_policies  # the 8B shapes at b 256, L 16, also with dual-precision replay states (f32 master + bf16 / fp8 read copy) (3.7 min in session 13)
#   bash benchmarks/scripts/run_h200.sh fills      # the replay step by buffer fill at hybrid_1b's layer (f32, b 256, L 16) with the output route's buffer-read variants (configs/kernel_bench.py:fills; not yet run; the default alone took 54 s in session 24)
#   bash benchmarks/scripts/run_h200.sh conv_ring8b  # the 8B shapes' decode step at b 256, L 16, shifting vs ring conv state on one machine (replay, then baseline; session 24's run of the shift row took ~110 s)
#   bash benchmarks/scripts/run_h200.sh decode8b_512  # the 8B shapes at b 512, L 16 (not yet run; 2 x ~59 GB states built one at a time)
#   bash benchmarks/scripts/run_h200.sh policies_sr  # the stochastic presets with the cheap hash32 bits (f16+sr, f32+int8+sr, f16+fp8+sr, each ":hash32"; session 26, not yet run), then the threefry ones sessions 24-25 did not reach (f32+int8+sr, f16+fp8+sr), f16 baseline, b 256, L 16 (session 25: f16+sr alone took most of 110 s)
#   bash benchmarks/scripts/run_h200.sh attention  # the decode attention forms (XLA whole cache vs the Pallas kernel's variants) at hybrid_1b's and the 8B's attention shapes, b 256, and hybrid_1b's verify window of 4 (session 25 ran all but the window, ~1 min)
#   bash benchmarks/scripts/run_h200.sh attention_window  # its verify window of 4 alone
#   bash benchmarks/scripts/run_h200.sh decode_profile  # hybrid_1b's decode step at b 256 by named scope, replay and baseline (decode_step_profile.py, XLA's CUDA graphs off)
#   bash benchmarks/scripts/run_h200.sh decode256_flags  # hybrid_1b decode at b 256, L 16 under XLA flag sets that may fold the step's small elementwise kernels (norms, converts, the relu2 square) into its GEMMs: none, then --xla_gpu_triton_gemm_any=true (issue 4's shared part; session 26, not yet run; a flag this XLA does not know fails its run only)
#   bash benchmarks/scripts/run_h200.sh decode_b256  # hybrid_1b decode at b 256, L 16 only, no split (70 s in session 27)
#   bash benchmarks/scripts/run_h200.sh decode256  # hybrid_1b decode at b {256,512}, L 16, split at 256 (2.5 min in session 25)
#   bash benchmarks/scripts/run_h200.sh gpu_tests  # the conv-step, gated-norm and attention kernels and the model's decode step / verify through every kernel vs the reference, on the GPU (pytest: 105 tests, over 70 s; session 27 reached 93 in 70 s, give it 120)
#   bash benchmarks/scripts/run_h200.sh check      # kernel_bench smoke: every kernel vs the reference on the GPU
#   bash benchmarks/scripts/run_h200.sh drift      # precision_drift: 13 policies (f16+fp8 since session 23, not yet run) x L {4,16,64} + 8 baselines, 100k steps
#
# Several parts in one call within a total budget: run_h200_chain.sh.
#
# To run exactly a commit (no uncommitted edits travel), export it into an
# ignored folder and carry that:
#   echo /.clean/ >> .git/info/exclude; rm -rf .clean; mkdir .clean
#   git archive HEAD | tar -x -C .clean; cp -r wheels .clean/
#   (device) carry [".clean"]; command: cd .clean && bash benchmarks/scripts/run_h200.sh <part>
# At most 8 files come back from $OUT: tar a part's workdir when it has more.
#
# Results land under $OUT/<part> (config.json, metrics.jsonl, tables, PNGs).
set -euo pipefail
compgen -G 'wheels/*.whl' >/dev/null || {
  echo "run_h200.sh: no wheels/*.whl (pip download --no-deps -d wheels ml_collections here, carry wheels)" >&2
  exit 2; }
pip install --no-deps --no-index -q --target /tmp/mlc wheels/*.whl 2>/dev/null
export PYTHONPATH=.:/tmp/mlc
OUT=${OUT:-runs}
# Per-part limit (s); lower it to run several parts in one 10-minute call.
T=${PART_TIMEOUT:-560}
mkdir -p "$OUT"
# specdec_bench on hybrid_1b into $OUT/<workdir name>, with extra overrides.
specdec_bench() {
  timeout "$T" python -m experiments.specdec_bench \
    --config=configs/specdec_bench.py --workdir="$OUT/$1" "${@:2}"
}
# Nsight Compute: clocks as they run and the sections every ncu part reads
# (a part adds its own).
NCU=(ncu --clock-control none --section SpeedOfLight --section Occupancy
     --section LaunchStats --section WarpStateStats --section SchedulerStats
     --section InstructionStats --section MemoryWorkloadAnalysis)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/gpu_${1}.csv"
case "$1" in
  sweep)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:sweep --workdir="$OUT/sweep" --config.iters=10 ;;
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
      --config.iters=10 --config.name="kernel_bench_h200_$dtype" ;;
  decode)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode" --config.bench.batches='(64,256,512)' \
      --config.bench.repeats=2 ;;
  decode_policies)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_policies" --config.bench.batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.split_batches='(256,)' \
      --config.bench.replay_policies="('f32+bf16','f32+fp8')" \
      --config.bench.repeats=2 ;;
  decode_extra)
    # Batch 1 with the kernels (every L), then the XLA reference ops at
    # batch {1, 64, 256}, L 16 (the Pallas figures at 64/256: `decode`).
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_b1" --config.bench.batches='(1,)' \
      --config.bench.repeats=2
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_ref" --config.bench.batches='(1,64,256)' \
      --config.bench.buffer_lens='(16,)' --config.bench.implementation=reference \
      --config.bench.split_batches='()' \
      --config.bench.repeats=2 ;;
  specdec)
    specdec_bench specdec --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' ;;
  specdec_fp8)
    specdec_bench specdec_fp8 --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.precision=f32+fp8 ;;
  specdec256)
    # Batch 256 only, plain decoding and replay spec decoding.
    specdec_bench specdec256 --config.bench.batches='(256,)' \
      --config.bench.windows='(4,)' --config.bench.ssm_modes="('replay',)" ;;
  specdec256_graphs)
    # The same with XLA's command buffers also taking conditionals and
    # while loops (CUDA graph conditional nodes: the decode loops' while
    # would run as one graph, without a host sync per iteration).
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE \
      specdec_bench specdec256_graphs --config.bench.batches='(256,)' \
      --config.bench.windows='(4,)' --config.bench.ssm_modes="('replay',)" ;;
  specdec_compaction)
    # Plain decoding and replay spec decoding compacting 2 or 3 times
    # (b 512 -> 256 -> 128 [-> 64]), b {256,512} (session 30).
    specdec_bench specdec_compaction --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.ssm_modes="('replay',)" \
      --config.bench.compactions='(2,3)' ;;
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
  specdec_small)
    specdec_bench specdec_small --config.bench.batches='(1,64)' \
      --config.bench.windows='(4,2,8)' ;;
  specdec_windows)
    specdec_bench specdec_windows --config.bench.batches='(256,512)' \
      --config.bench.windows='(2,8)' ;;
  batch1)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:batch1 --workdir="$OUT/batch1" \
      --config.iters=10 ;;
  rows_fused)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:rows_fused --workdir="$OUT/rows_fused" \
      --config.iters=10 ;;
  mosaic_flush)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:mosaic_flush \
      --workdir="$OUT/mosaic_flush" --config.iters=10 ;;
  launch)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:launch --workdir="$OUT/launch" \
      --config.iters=10 ;;
  output_launch)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:output_launch \
      --workdir="$OUT/output_launch" --config.iters=10 ;;
  mosaic)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:mosaic --workdir="$OUT/mosaic" \
      --config.iters=10 ;;
  fills)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:fills --workdir="$OUT/fills" ;;
  conv_ring8b)
    timeout "$T" python benchmarks/scripts/conv_ring_check.py \
      --config configs/nemotron_h_8b.py --batch 256 --new_tokens 128 \
      --repeats 2 --prompt_len 256 --prefill_rows 64 \
      --out "$OUT/conv_ring_8b.json" ;;
  decode8b_512)
    timeout "$T" python -m experiments.decode_bench --config=configs/nemotron_h_8b.py \
      --workdir="$OUT/decode8b_512" --config.bench.batches='(512,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.prompt_len=256 \
      --config.bench.new_tokens=128 --config.bench.repeats=2 \
      --config.bench.prefill_rows=64 --config.bench.split_batches='()' ;;
  policies_sr)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:policies --workdir="$OUT/policies_sr" \
      --config.policies="('f16+fp8+sr:hash32','f32+int8+sr','f16+fp8+sr')" \
      --config.iters=10 ;;
  policies_fp8_L)
    # The fp8 read copies at L 16 and 32: a flush every 32 steps halves its
    # amortized share (issue 6's 2.2x; its kernel benchmark is named at L 16).
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:policies --workdir="$OUT/policies_fp8_L" \
      --config.policies="('f16+fp8','f32+fp8')" --config.buffer_lens='(16,32)' \
      --config.replay_variants='{}' --config.iters=10 ;;
  fp8_split)
    # The f16 + fp8 step split by kernel (output_split.py: the non-flush
    # step per variant, argument 2, default "default"; then the all-rows
    # flush step per variant, argument 3, default "default"), then the
    # policies study on f16 + fp8 (session 35's calls, ~2 min).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/output_split.py --policy f16+fp8 \
      --variants "${2:-default}" --out "$OUT/output_split.json"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/output_split.py --policy f16+fp8 --fill 15 \
      --variants "${3:-default}" --out "$OUT/output_split_flush.json"
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:policies --workdir="$OUT/policies" \
      --config.iters=10 --config.policies="('f16+fp8',)" ;;
  policies)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:policies --workdir="$OUT/policies" \
      --config.iters=10 "${@:2}" ;;
  precision)
    size=${2:?precision needs a size: tiny, small, medium or large}
    timeout "$T" python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py:"$size" \
      --workdir="$OUT/precision_$size" --config.train_missing=True ;;
  precision_rest)
    timeout "$T" python -c "import sys; from absl import logging
logging.set_verbosity(logging.INFO)
from configs import precision_accuracy as C
from experiments import precision_accuracy as P
c = C.get_config('large')
c.models = [m for m in c.models if m['name'] != 'mqar_large_ssm']
c.train_missing = True
P.run(c, sys.argv[1])" "$OUT/precision_rest" ;;
  precision_mqar1024_rest)
    timeout "$T" python -c "import sys; from absl import logging
logging.set_verbosity(logging.INFO)
from configs import precision_accuracy as C
from experiments import precision_accuracy as P
c = C.get_config('medium')
c.models = [m for m in c.models if m['name'] == 'mqar_medium_ssm@1024']
c.policies = ('f32', 'bf16+sr', 'f16+sr')
c.baseline_policies = C.POLICIES
c.train_missing = True
P.run(c, sys.argv[1])" "$OUT/precision_mqar1024_rest" ;;
  decode8b)
    timeout "$T" python -m experiments.decode_bench --config=configs/nemotron_h_8b.py \
      --workdir="$OUT/decode8b" --config.bench.batches='(64,256)' \
      --config.bench.buffer_lens='(16,)' --config.bench.prompt_len=256 \
      --config.bench.new_tokens=128 --config.bench.repeats=2 \
      --config.bench.prefill_rows=64 ;;
  decode8b_split)
    timeout "$T" python -m experiments.decode_bench --config=configs/nemotron_h_8b.py \
      --workdir="$OUT/decode8b_split" --config.bench.batches='(256,)' \
      --config.bench.split_batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.prompt_len=256 \
      --config.bench.new_tokens=128 --config.bench.repeats=2 \
      --config.bench.prefill_rows=64 ;;
  decode8b_policies)
    timeout "$T" python -m experiments.decode_bench --config=configs/nemotron_h_8b.py \
      --workdir="$OUT/decode8b_policies" --config.bench.batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.prompt_len=256 \
      --config.bench.new_tokens=128 --config.bench.repeats=2 \
      --config.bench.prefill_rows=64 --config.bench.split_batches='()' \
      --config.bench.replay_policies="('f32+bf16','f32+fp8')" ;;
  attention)
    timeout "$T" python benchmarks/scripts/attend_micro.py \
      --out "$OUT/attend_micro.json"
    timeout "$T" python benchmarks/scripts/attend_micro.py --q_heads 32 \
      --kv_heads 8 --variants default,s1,split128,split64 \
      --out "$OUT/attend_micro_8b.json" ;&  # then the window of 4
  attention_window)
    timeout "$T" python benchmarks/scripts/attend_micro.py --window 4 \
      --variants default,s1,split128 --out "$OUT/attend_micro_window4.json" ;;
  decode_profile)
    # hybrid_1b's decode step by named scope (replay and baseline, b 256)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/decode_step_profile.py --top 400 \
      --hlo_dir "$OUT/decode_step_hlo" --out "$OUT/decode_step_profile.json" ;;
  decode256_flags)
    # The first (no flags) with the per-part split at batch 256.
    split='(256,)'
    for flags in "" "--xla_gpu_triton_gemm_any=true"; do
      name=$(printf '%s' "${flags:-none}" | tr -c 'a-z0-9' '_' | cut -c1-40)
      XLA_FLAGS="$flags" timeout "$T" python -m experiments.decode_bench \
        --config=configs/hybrid_1b.py --workdir="$OUT/decode256_flags_$name" \
        --config.bench.batches='(256,)' --config.bench.buffer_lens='(16,)' \
        --config.bench.split_batches="$split" \
        --config.bench.repeats=2 || echo "decode256_flags: '$flags' failed"
      split='()'
    done ;;
  decode_b256)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode_b256" --config.bench.batches='(256,)' \
      --config.bench.buffer_lens='(16,)' --config.bench.split_batches='()' \
      --config.bench.repeats=2 ;;
  decode256)
    timeout "$T" python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir="$OUT/decode256" --config.bench.batches='(256,512)' \
      --config.bench.buffer_lens='(16,)' --config.bench.repeats=2 ;;
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
  check)
    timeout "$T" python -m experiments.kernel_bench \
      --config=configs/kernel_bench.py:smoke --workdir="$OUT/check" ;;
  drift)
    timeout "$T" python -m experiments.precision_drift \
      --config=configs/precision_drift.py --workdir="$OUT/drift" ;;
  profile)
    timeout "$T" python benchmarks/scripts/specdec_profile.py --batch 256 \
      --out "$OUT/specdec_profile.json" ;;
  profile_kernels_fp8)
    # profile_kernels with f32 master + fp8 copy replay states (the replay
    # spec loop was slower with them than with f32 ones, session 28).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch 256 \
      --precision f32+fp8 --loops plain,replay \
      --out "$OUT/specdec_profile_kernels_fp8.json" ;;
  profile_kernels)
    # The same with XLA's CUDA graphs off, so the trace splits every loop
    # by kernel (the `*_ops` entries; its step times pay the launches).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch 256 \
      --out "$OUT/specdec_profile_kernels.json" ;;
  profile_b1)
    # Batch 1, where replay spec decoding ran at 0.60-0.64x the baseline
    # spec decoding (session 11): wall and device time per piece with
    # CUDA graphs, then the per-kernel split without them.
    timeout "$T" python benchmarks/scripts/specdec_profile.py --batch 1 \
      --out "$OUT/specdec_profile_b1.json"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch 1 \
      --out "$OUT/specdec_profile_kernels_b1.json" ;;
  profile_b1_kernels)
    # profile_b1's per-kernel half alone (session 12 ran the first half:
    # device time per iteration replay 1.007 vs baseline 0.966 ms, while
    # the benchmark's wall totals differ by ~20 ms over 49 iterations).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/specdec_profile.py --batch 1 \
      --out "$OUT/specdec_profile_kernels_b1.json" ;;
  verify)
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/verify_sweep.py --out "$OUT/verify_sweep.json" "${@:2}" ;;
  verify_ab)
    # Window-kernel candidates checked and timed (argument 2: verify_sweep
    # variants), then spec decoding at b {256,512}, compaction 0 and 3,
    # with the fastest passing candidate as the dispatcher's VerifyConfig
    # (with_config.py); argument 3: the ssm modes (default replay only; the
    # snapshot baseline does not run the verify kernels). Argument 4 "ab":
    # then b 512 again at the code's own default (an A/B on one machine).
    # Session 31: ~5 min with 9 variants and "ab", replay only.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 170 \
      python benchmarks/scripts/verify_sweep.py --out "$OUT/verify_sweep.json" \
      --variants "${2:-default,bc_reduce}"
    best=$(python benchmarks/scripts/verify_pick.py "$OUT/verify_sweep.json")
    echo "verify_ab: candidate $best"
    timeout 300 python benchmarks/scripts/with_config.py VerifyConfig "$best" \
      experiments.specdec_bench --config=configs/specdec_bench.py \
      --workdir="$OUT/specdec_candidate" --config.bench.batches='(256,512)' \
      --config.bench.windows='(4,)' --config.bench.ssm_modes="${3:-('replay',)}" \
      --config.bench.compactions='(0,3)' || echo "verify_ab: candidate run exited $?"
    if [ "${4:-}" = ab ]; then
      T=150 specdec_bench specdec_default --config.bench.batches='(512,)' \
        --config.bench.windows='(4,)' --config.bench.ssm_modes="('replay',)" \
        --config.bench.compactions='(0,3)'
    fi ;;
  verify_copy)
    # The verify kernels on an f32 state and on f32 master + fp8 copy states
    # (the replay spec loop was slower with the copy, session 28): the
    # window kernel's masked and branching copy readouts, the fold capped.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/verify_sweep.py --variants default \
      --out "$OUT/verify_sweep_f32.json"
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/verify_sweep.py --policy f32+fp8 \
      --variants default,copy_branch,fold_w4c128 \
      --out "$OUT/verify_sweep_f32_fp8.json" ;;
  verify_caps)
    # The window kernel's registers capped (session 29).
    XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$T" \
      python benchmarks/scripts/verify_sweep.py \
      --variants default,cap64,cap80,cap96 \
      --out "$OUT/verify_sweep_caps.json" ;;
  ncu_verify)
    # The window kernel of each variant (argument 2, comma-separated).
    timeout "$T" "${NCU[@]}" -k regex:replayssm_verify_window -c 1 \
      --section ComputeWorkloadAnalysis --section SourceCounters \
      python benchmarks/scripts/verify_sweep.py --check_only \
      --variants "${2:-default}" --out "$OUT/verify_check.json" \
      > "$OUT/ncu_verify.txt" 2>&1 ;;
  hlo_dump)
    # XLA's optimized HLO of the plain and replay spec loops (fusion names
    # of a profile_kernels trace), packed.
    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(generate|spec).*" \
      timeout "$T" python benchmarks/scripts/dump_loop_hlo.py
    tar czf "$OUT/hlo_dump.tgz" -C /tmp/hlo . ;;
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
  ncu_b1)
    # Batch 1, f16, no row folding: the baseline step beside the fused
    # replay step (two launches of it), each kernel's own time, stalls and
    # instruction counts (issue 3's f16 batch-1 gap, session 16).
    timeout "$T" "${NCU[@]}" -c 3 \
      -k regex:"replayssm_selective_state_update|replayssm_replay_fused" \
      python benchmarks/scripts/ncu_profile.py --counts nonflush --batch 1 \
      > "$OUT/ncu_b1.txt" 2>&1 ;;
  ncu_flush_grids)
    # f32 checkpoint, batch 256, every row folding: the persistent flush
    # (~690 µs) beside the rows grid (~630 µs, one item per program) and
    # the one launch on the output grid (session 19): what the persistent
    # loop's items wait on.
    for cfg in default rows1 fusedrows; do
      case "$cfg" in
        default) json='{}' ;;
        rows1) json='{"flush_grid": "rows", "flush_heads_per_program": 1}' ;;
        fusedrows) json='{"fused_launch": true, "flush_grid": "rows", "flush_fold": "dot_bf16x3", "max_registers": 128}' ;;
      esac
      timeout "$T" "${NCU[@]}" -k regex:"replayssm_replay_(flush|fused)" -c 1 \
        --section SourceCounters \
        python benchmarks/scripts/ncu_profile.py --counts flush --dtype float32 \
        --config "$json" > "$OUT/ncu_flush_f32_$cfg.txt" 2>&1
    done ;;
  ncu_fp8)
    # Batch 256, no row folding: the output route on the plain f16
    # checkpoint (~90% of the copy bandwidth) beside the f16 master + fp8
    # copy (~70%; reading it out in f16 did not help, session 17): stalls,
    # occupancy, memory throughput of one launch each.
    for pol in none f16+fp8; do
      args=(--counts nonflush)
      [ "$pol" = none ] || args+=(--policy "$pol")
      timeout "$T" "${NCU[@]}" -k regex:replayssm_replay_output_route -c 1 \
        --section SourceCounters \
        python benchmarks/scripts/ncu_profile.py "${args[@]}" \
        > "$OUT/ncu_output_route_${pol/+/_}.txt" 2>&1
    done ;;
  ncu_sass)
    # Per-instruction SASS counters (executed instructions, stall samples)
    # of one launch each: the verify window kernel at b 512 (argument 2:
    # variants, default "default") and the output route on the f16 master +
    # fp8 copy at b 256 (no row folding), as CSVs of ncu's source page.
    ncu --version > "$OUT/ncu_version.txt" 2>&1 || true
    timeout "$T" ncu --clock-control none --set full -k regex:replayssm_verify_window \
      -c 1 -f -o /tmp/ncu_window python benchmarks/scripts/verify_sweep.py \
      --check_only --batch 512 --variants "${2:-default}" \
      --out "$OUT/verify_check.json" > "$OUT/ncu_sass_window.log" 2>&1 || true
    timeout "$T" ncu --clock-control none --set full \
      -k regex:replayssm_replay_output_route -c 1 -f -o /tmp/ncu_fp8 \
      python benchmarks/scripts/ncu_profile.py --counts nonflush \
      --policy f16+fp8 > "$OUT/ncu_sass_fp8.log" 2>&1 || true
    for r in window fp8; do
      [ -f /tmp/ncu_$r.ncu-rep ] || continue
      ncu -i /tmp/ncu_$r.ncu-rep --page source --csv --print-source sass \
        > "$OUT/ncu_sass_$r.csv" 2>> "$OUT/ncu_sass_$r.log" || true
      ncu -i /tmp/ncu_$r.ncu-rep --page details \
        > "$OUT/ncu_details_$r.txt" 2>> "$OUT/ncu_sass_$r.log" || true
    done ;;
  *) echo "unknown part: $1" >&2; exit 2 ;;
esac
