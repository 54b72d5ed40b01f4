"""Experiment scripts (absl apps configured by `configs/*.py`).

Run them from the repository root, e.g.
  python -m experiments.replay_demo --workdir=runs/replay_demo
Each script writes config.json, metrics.jsonl and plots into --workdir.
"""
