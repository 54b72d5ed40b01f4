#!/usr/bin/env bash
# Several run_h200.sh parts in one device call, inside a total budget (s):
# each part runs with PART_TIMEOUT = min(its own limit, what is left), and a
# part with under 45 s left is skipped (noted in the log). Arguments are
# `part[:limit]`, a part's own arguments joined by commas, e.g.
#   bash benchmarks/scripts/run_h200_chain.sh 560 decode256_flags:150 \
#       decode_profile:120 grid,f32,16:200
# (decode256_flags runs two benchmarks, each under the limit). At the end
# everything under $OUT is packed into $OUT/runs.tgz (a device call brings
# back at most 8 files).
set -uo pipefail
total=${1:?usage: run_h200_chain.sh TOTAL_S part[:limit] ...}
shift
# The log also goes to $OUT/chain.log: a call stopped at its limit brings
# back what is under $OUT, not what a pipe after this script held.
OUT=${OUT:-runs}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/chain.log") 2>&1
start=$SECONDS
for spec in "$@"; do
  part=${spec%%:*}
  limit=${spec#"$part"}
  limit=${limit#:}
  left=$(( total - (SECONDS - start) ))
  limit=${limit:-$left}
  if [ "$left" -lt 45 ]; then
    echo "chain: ${part//,/ } skipped ($left s left)"
    continue
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "chain: ${part//,/ } (limit $limit s) at $((SECONDS - start)) s"
  # shellcheck disable=SC2086  # the part's words
  PART_TIMEOUT=$limit bash benchmarks/scripts/run_h200.sh ${part//,/ } \
    || echo "chain: ${part//,/ } exited $?"
done
echo "chain: done at $((SECONDS - start)) s"
# (tar exits 1 when chain.log grows while it reads it: still packed.)
tar --warning=no-file-changed -czf /tmp/runs.tgz -C "$OUT" .
[ -s /tmp/runs.tgz ] && find "$OUT" -mindepth 1 -delete \
  && mv /tmp/runs.tgz "$OUT/runs.tgz"
