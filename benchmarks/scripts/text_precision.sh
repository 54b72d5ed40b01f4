#!/usr/bin/env bash
# The real-text precision study's GPU steps, behind run_h200.sh's parts
# text_corpus, text_train and text_study (run it through run_h200.sh, which
# sets PYTHONPATH, OUT and the part limit T):
#
#   text_corpus                 runs/corpus from the carried archive
#   text_train NAME [flags]     configs/train_text.py:NAME, resumable
#   text_study NAME [STAGES]    configs/precision_text.py:NAME, the presets
#                               split over processes, then one merged report
#                               (STAGES: scores, generation, state_error;
#                               default the config's: all three, NAME@f32
#                               scores and generation)
#
# NAME: <family>_<size>, family mamba2 | gdn, size s20m | s60m | s120m |
# s300m (text_study also takes "fixture", the CPU fixtures of the tests,
# and <family>_<size>@f32, the trained model computing in float32: the
# 16-bit-master presets' scores at L 16 and greedy generations).
# Everything under runs/ stays on the machine for as long as it is held (a
# later call of the same session sees it); what comes back is under $OUT.
#
# The corpus travels as runs/carry/corpus.tar.xz (carry ["runs/carry",
# "wheels"]), made on the CPU machine:
#   python -m experiments.build_corpus --config=configs/corpus.py \
#       --workdir=runs/corpus
#   mkdir -p runs/carry && tar -C runs/corpus -cJf runs/carry/corpus.tar.xz \
#       train.bin validation.bin test.bin manifest.json tokenizer.json
# (about 13 MB; configs/train_text.py pins the corpus hash, and every load
# checks each split's sha256 against the manifest).
#
# Planning. Measured on one H100 (benchmarks/text_precision/<model>_h100):
# mamba2_s20m trains at 437k bytes/s (its 65.5M bytes in 150 s of steps),
# gdn_s20m at 217k (302 s), mamba2_s60m at 259k (49.2M bytes in 190 s;
# 246 s with compilation and evals), gdn_s60m at 130k (379 s; 459 s in
# all), mamba2_s120m at 159k (24.6M bytes in 155 s; 210 s in all: half
# what parameters x bytes scaled from s60m predicted, its GEMMs being
# larger), mamba2_s300m at 88k (12.3M bytes in 140 s; 226 s in all). A
# Gated DeltaNet model takes about twice its Mamba-2 twin's time at
# every size (gdn_s120m 297 s of steps, 401 s in all; gdn_s300m 275 s,
# 404 s in all).
# mamba2_s120m's study over thirteen processes took 95-148 s a slice
# for the scores, 182-216 s for the generations and state error, and
# 79-111 s for the float32-activation control; mamba2_s300m's ~40 s a
# scored run (a slice's three L and its baseline: give the scores part
# 300 s; 215 s left 8 of 39 replay runs and the baselines unscored: a
# slice now scores L 16 and the baselines before L 8 and 32),
# 277-316 s for the generations and state error, and ~190 s for the
# float32-activation control (two calls: its slices resume). A study of an s20m
# model over three processes took 330 s (Mamba-2) and over 440 s (Gated
# DeltaNet: its stochastically rounded presets score in 20-30 s a run against
# 7-9 s) per slice: a score 7-30 s, a 2048-token generation 8-10 s, mostly
# compilation. mamba2_s60m's scores over twelve processes took 150 s; its
# generations 6-23 s a run, after the f32 reference (62 s when each of twelve
# slices generated it at once; one of them now generates it for all, and the
# state-error stage's recording of its stream is shared likewise: 55 s a slice
# at gdn_s60m, before it was). gdn_s60m's whole study over twelve processes
# (scores, generations and state error of every preset) took 379-438 s a slice,
# and 501 s for the first, which held two of the 13 presets (f32 and f16+fp8+sr:
# a slice gets every STUDY_PROCS-th preset; STUDY_PROCS=13 gives each slice
# one), near the 505 s a slice gets in a 545 s part; its float32-activation
# control took 159 s. gdn_s120m over thirteen processes: 125 s of scores
# after its training, then 409-449 s a slice for the rest of the scores,
# the generations and the state error (the f16+fp8+sr slice, the slowest,
# stopped by a 530 s part in its last state error), and 101-138 s for the
# float32-activation control (f16+fp8+sr cut at 185 s in its last
# generation): its three calls, the first held 530 s before it ran, used
# the session's 30 minutes. gdn_s300m: training 404 s, then its scored
# runs took 17-77 s each over thirteen processes (about 300 s for a
# slice's three L and its baselines); its generations and state error,
# about twice gdn_s120m's, need more than the rest of a session.
# Everything under runs/, the trained models too, is lost when the machine
# goes back (30 minutes of device time a session, a call at most 10
# minutes, idle machines go back within a minute): a model's training and
# study share one machine's calls, back to back. The s20m pair in three calls
# (carry ["runs/carry", "wheels"]; a chain's total at most 540 s,
# leaving the call's limit room; an s20m run's last eval, checkpoint and
# decode cross-check take well under the default 120 s STOP_MARGIN):
#   STOP_MARGIN=40 run_h200_chain.sh 540 text_train,mamba2_s20m:240 \
#       text_train,gdn_s20m:300
#   STOP_MARGIN=40 run_h200_chain.sh 540 text_train,gdn_s20m:180 \
#       text_study,mamba2_s20m:360
#   run_h200_chain.sh 540 text_train,gdn_s20m:60 text_study,gdn_s20m:480
# Once a model's folder is committed (benchmarks/text_precision/<model>_h100/
# with study/ and study_f32/), `python benchmarks/scripts/
# text_precision_across.py` redraws the cross-model table and figure; its
# table goes into benchmarks/README.md (a test compares them).
# A paused training continues where it stopped and a finished one returns
# at once; a study slice stopped by its limit continues in the next call
# (--config.resume), and each study part's report merges every part of
# that model so far. Larger models take a session each (one model, its
# training split over calls, then its study); where that does not fit, a
# several-GPU kind splits each batch over its GPUs (train.py,
# data-parallel) and runs six study slices per GPU; or a smaller
# --config.train.num_steps, said beside the results.
set -euo pipefail
OUT=${OUT:-runs}
T=${T:-560}

text_corpus() {
  if [ ! -f runs/corpus/manifest.json ]; then
    mkdir -p runs/corpus
    python -c "import tarfile; tarfile.open('runs/carry/corpus.tar.xz').extractall('runs/corpus')"
  fi
  python -c "from replayssm_jax import text_corpus as t; t.load_corpus('runs/corpus'); print('corpus', t.corpus_hash('runs/corpus'))"
}

case "$1" in
  text_corpus)
    text_corpus ;;
  text_train)
    name=${2:?text_train needs <family>_<size>, e.g. mamba2_s20m}
    text_corpus
    # The run stops STOP_MARGIN s (default 120: the last eval, the
    # checkpoint and optimizer-state save, and, when it finishes, the
    # decode-mode cross-check) before the part's limit, with its optimizer
    # state saved; the same part in the next call continues it, and once
    # finished returns at once. The log says "paused" or "finished".
    stop=$(( T - ${STOP_MARGIN:-120} ))
    timeout -k 10 "$T" python -m experiments.train \
      --config=configs/train_text.py:"$name" --workdir="runs/train_text/$name" \
      --config.train.stop_after_s="$stop" "${@:3}"
    mkdir -p "$OUT/text_train_$name"
    for f in config.json metrics.jsonl summary.md training.png tokenizer.json; do
      cp "runs/train_text/$name/$f" "$OUT/text_train_$name/" 2>/dev/null || true
    done
    grep -q '"kind": "final"' "runs/train_text/$name/metrics.jsonl" \
      && echo "text_train $name: finished" || echo "text_train $name: paused" ;;
  text_study)
    name=${2:?text_study needs <family>_<size>, e.g. mamba2_s20m}
    # Stages as one comma-separated word or as words (run_h200_chain.sh
    # turns a part's commas into spaces).
    stages=$(IFS=,; echo "${*:3}")
    stages=${stages:-$(python -c "
import sys
from configs import precision_text
print(','.join(precision_text.get_config(sys.argv[1]).stages))" "$name")}
    # ("fixture": the committed CPU fixtures on their own corpus excerpt.)
    [ "$name" = fixture ] || text_corpus
    # STUDY_PROCS processes (default six per GPU: compiles dominate a
    # small model's study, and they run on the host's 16 cores) each take
    # a slice of the presets, with their every-step baselines, into
    # $STUDY_DIR/NAME/<stages>/part<i>of<procs> (STUDY_DIR default
    # runs/precision_text), the references (the scores' f32 decode, the
    # f32 generations, the state-error recording and floor) computed by
    # one of them and shared through $STUDY_DIR/NAME/shared (a later call
    # loads them); then every part of every call so far is merged
    # into $OUT/text_NAME. A slice stopped by the limit continues where it
    # stopped when the same part runs again (--config.resume).
    ngpu=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
    ngpu=$(( ngpu > 0 ? ngpu : 1 ))
    procs=${STUDY_PROCS:-$(( 6 * ngpu ))}
    study=${STUDY_DIR:-runs/precision_text}/$name
    base="$study/${stages//,/_}"
    mkdir -p "$base"
    mapfile -t slices < <(python -c "
import sys
from configs import precision_text
names = tuple(precision_text.get_config(sys.argv[2]).policies)
n = int(sys.argv[1])
for i in range(min(n, len(names))):
  print(repr(names[i::n]))" "$procs" "$name")
    # The slices get a TERM 40 s before the part's limit and a KILL 10 s
    # later (a process inside a compile can outlast the TERM), leaving the
    # merge 30 s.
    pids=()
    for i in "${!slices[@]}"; do
      CUDA_VISIBLE_DEVICES=$(( i % ngpu )) XLA_PYTHON_CLIENT_PREALLOCATE=false \
        timeout -k 10 $(( T - 40 )) python -m experiments.precision_accuracy \
        --config=configs/precision_text.py:"$name" \
        --workdir="$base/part${i}of$procs" --config.resume=True \
        --config.shared_dir="$study/shared" \
        --config.stages="('${stages//,/\',\'}',)" \
        --config.policies="${slices[$i]}" \
        --config.baseline_policies="${slices[$i]}" \
        >> "$base/part${i}of$procs.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do
      wait "$p" || echo "text_study $name: a slice exited $? (see $base/part*.log)"
    done
    tail -n 3 "$base"/part*of"$procs".log
    mkdir -p "$OUT/text_${name}_logs"
    cp "$base"/part*of"$procs".log "$OUT/text_${name}_logs/"
    parts=$(find "$study" -name metrics.jsonl -path '*part*' \
      -printf "'%h',\n" | sort | tr -d '\n')
    if [ -z "$parts" ]; then  # (an empty list would run the whole study)
      echo "text_study $name: no slice wrote records (logs: $base)" >&2
      exit 1
    fi
    python -m experiments.precision_accuracy \
      --config=configs/precision_text.py:"$name" --workdir="$OUT/text_$name" \
      --config.merge_workdirs="($parts)" ;;
  *) echo "text_precision.sh: unknown part: $1" >&2; exit 2 ;;
esac
