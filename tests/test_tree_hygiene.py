"""The tree describes itself: no work-log labels, small files, small configs.

Every tracked text file and every tracked file name is searched, case
insensitively, for labels that name a past work step rather than anything
in the code (a session or an issue with its number, a measurement tagged
with a run number).
"""

import dataclasses
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A work-step label: session, issue or run followed by a number, used as a
# name.
LABEL = re.compile(
    r"(?<![a-z])(session|issue)s?[ _#-]{0,2}[0-9]"
    # A run's number as a name ends the phrase or is followed by a
    # preposition or conjunction; a count is followed by what it counts.
    r"|(?<![a-z])runs?[ _#-]{0,2}[0-9]+\b"
    r"(?!\s*(?!(of|and|or|in|at|on|with|to|from|vs|against)\b)[a-z])",
    re.IGNORECASE)
NAME_LABEL = re.compile(r"(session|issue|_run|^run)[_-]?[0-9]", re.IGNORECASE)
MAX_LINES = 600
SOURCE_DIRS = ("replayssm_jax", "pallas_kernels", "experiments", "configs",
               "tests", "benchmarks", "notebooks")


def _tracked():
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  return [p for p in out.decode().split("\0") if p]


def _text(path):
  if path.endswith(".bin"):
    return None  # token-id streams (a corpus's splits): data, not our text
  with open(os.path.join(ROOT, path), "rb") as f:
    data = f.read()
  if b"\0" in data[:4096]:
    return None  # binary (png, gz)
  return data.decode("utf-8", "replace")


def test_no_work_log_labels_in_files_or_names():
  hits = []
  for path in _tracked():
    if NAME_LABEL.search(os.path.basename(path)):
      hits.append(f"{path}: file name")
    if not os.path.exists(os.path.join(ROOT, path)):
      continue
    text = _text(path)
    for i, line in enumerate((text or "").splitlines(), 1):
      if LABEL.search(line):
        hits.append(f"{path}:{i}: {line.strip()[:100]}")
  assert not hits, ("work-log labels (describe what the thing is instead):\n"
                    + "\n".join(hits[:50])
                    + (f"\n... and {len(hits) - 50} more" if len(hits) > 50
                       else ""))


def test_label_pattern():
  # Assembled from parts so that this file itself names no work step.
  s, i, r = "session", "issue", "run"
  for bad in (f"{s} 12", f"{s.title()}12", f"{i} #45", f"{i} 45",
              f"kernel_bench_h200_{r}11.md", f"{r} 11 of the sweep"):
    assert LABEL.search(bad), bad
  for ok in (f"{r} 10 steps", f"{r}s 3 times", f"{r}s 16 greedy steps", "the run's median", "rerun",
             "session state", "issues", "run_app"):
    assert not LABEL.search(ok), ok


def test_no_source_file_over_max_lines():
  long = []
  for path in _tracked():
    if path.endswith(".py") and path.split("/")[0] in SOURCE_DIRS:
      text = _text(path) or ""
      n = text.count("\n")
      if n > MAX_LINES:
        long.append(f"{path}: {n} lines")
  assert not long, f"files over {MAX_LINES} lines: {long}"


def test_kernel_configs_are_small():
  from pallas_kernels import ReplayConfig, VerifyConfig
  assert len(dataclasses.fields(ReplayConfig)) <= 12
  assert len(dataclasses.fields(VerifyConfig)) <= 7
