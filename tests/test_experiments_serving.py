"""The serving benchmark's smoke run (experiments/serve_bench.py), beside
tests/test_experiments.py."""

import os

import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")

from experiments import common  # noqa: E402
from tests.test_experiments import _assert_config_json, _assert_png  # noqa: E402


def test_serve_bench_smoke(tmp_path):
  """The serving benchmark's smoke run: both modes serve every request of
  the workload to its full output length (greedy, no eos), the latency
  percentiles are ordered, and the outputs are written."""
  from configs import serve_bench as serve_config  # pylint: disable=g-import-not-at-top
  from experiments import serve_bench  # pylint: disable=g-import-not-at-top
  config = serve_config.get_config("smoke")
  assert "python -m experiments.serve_bench" in serve_config.__doc__
  out = serve_bench.run(config, str(tmp_path))
  recs = out["records"]
  assert config.serve.shared_prefixes  # the smoke run tests the cache too
  assert [(r["mode"], r["prefix_cache"]) for r in recs] == [
      (m, c) for m in config.serve.ssm_modes for c in (False, True)]
  want = serve_bench.workload(config, config.model.vocab_size)
  shared = config.serve.shared_prefix_len
  hit_rates = {r["cache_hit_rate"] for r in recs if r["prefix_cache"]}
  assert len(hit_rates) == 1  # the same workload in both modes
  for r in recs:
    if r["prefix_cache"]:
      # Hits reuse whole blocks of a shared prefix (which of them hit
      # depends on the prompts' lengths: a miss caches its last aligned
      # boundary only).
      block = config.serve.prefix_block
      hits = round(r["cache_hit_rate"] * len(want))
      assert 0 < hits < len(want)
      assert r["cache_reused_tokens"] % block == 0
      assert r["cache_reused_tokens"] >= hits * (shared // block) * block
    else:
      assert r["cache_hit_rate"] is None
    assert r["requests"] == len(want)
    assert r["tokens"] == sum(w["max_new_tokens"] for w in want)
    assert r["tokens_per_s"] > 0 and r["state_bytes"] > 0
    assert 0 <= r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert 0 <= r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["steps"] == r["dispatches"] * config.serve.steps_per_dispatch
  _assert_config_json(out["workdir"], config)
  lines = common.read_metrics(os.path.join(out["workdir"], "metrics.jsonl"))
  assert lines[0]["kind"] == "environment" and len(lines) == 1 + len(recs)
  _assert_png(os.path.join(out["workdir"], "latency.png"))
