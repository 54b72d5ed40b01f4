"""Experiment scripts (absl apps configured by `configs/*.py`).

Run them from the repository root, e.g.
  python -m experiments.replay_demo --workdir=runs/replay_demo
`python -m experiments.<name> --help` lists a script's flags. Each script
writes config.json, metrics.jsonl and plots into --workdir. This package
and configs/ are not installed with replayssm_jax: run them from the
repository root.
"""
