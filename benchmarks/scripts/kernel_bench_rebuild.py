"""Writes results.{json,md} and speedup.png of a kernel_bench run that was
cut off (by a part's timeout, say) from the records it had streamed to its
workdir's metrics.jsonl, and marks the files as partial:

  python benchmarks/scripts/kernel_bench_rebuild.py WORKDIR [--note "..."]

Configurations the run had not finished (no summary record) are left out of
the summary; their checks and timings stay in the tables.
"""

import argparse
import json
import os

from experiments import common
from experiments import kernel_bench


def rebuild(workdir: str, note: str = "") -> dict:
  records = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  by_kind = {}
  for r in records:
    by_kind.setdefault(r.get("kind"), []).append(r)
  meta = by_kind["environment"][0]
  done = by_kind.get("summary", [])
  partial = (f"- PARTIAL: the run was cut off after {len(done)} finished "
             f"configurations; rebuilt from metrics.jsonl by "
             f"benchmarks/scripts/kernel_bench_rebuild.py"
             f"{'; ' + note if note else ''}.")
  results = dict(meta=meta, config=config,
                 stream_bandwidth=by_kind["stream_bandwidth"][0],
                 checks=by_kind.get("check", []),
                 timings=by_kind.get("timing", []), summary=done,
                 partial=partial[2:])
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    lines = kernel_bench._markdown(results).split("\n")  # pylint: disable=protected-access
    at = next(i for i, ln in enumerate(lines) if ln.startswith("- command:"))
    f.write("\n".join(lines[:at + 1] + [partial] + lines[at + 1:]))
  kernel_bench._plot(results, os.path.join(workdir, "speedup.png"))  # pylint: disable=protected-access
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("workdir")
  parser.add_argument("--note", default="")
  args = parser.parse_args()
  rebuild(args.workdir, args.note)
