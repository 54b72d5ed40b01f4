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
  the workload to its full output length (greedy, no eos), plain, with a
  prefix cache and with speculative decoding (whose greedy tokens equal
  the plain run's), the latency percentiles are ordered, and the outputs
  are written."""
  from configs import serve_bench as serve_config  # pylint: disable=g-import-not-at-top
  from experiments import serve_bench  # pylint: disable=g-import-not-at-top
  config = serve_config.get_config("smoke")
  assert "python -m experiments.serve_bench" in serve_config.__doc__
  out = serve_bench.run(config, str(tmp_path))
  recs = out["records"]
  assert config.serve.shared_prefixes  # the smoke run tests the cache too
  window = config.serve.speculative_window
  assert window  # and speculative decoding
  assert [(r["mode"], r["prefix_cache"], r["speculative"]) for r in recs] == [
      (m, c, w) for c, w in ((False, None), (True, None), (False, window))
      for m in config.serve.ssm_modes]
  want = serve_bench.workload(config, config.model.vocab_size)
  shared = config.serve.shared_prefix_len
  hit_rates = {r["cache_hit_rate"] for r in recs if r["prefix_cache"]}
  assert len(hit_rates) == 1  # the same workload in both modes
  for r in recs:
    if r["prefix_cache"]:
      # Hits reuse whole blocks of a shared prefix: at most the first two
      # requests of each prefix miss (the second stores the prefix's
      # state where its prompt parts from the first's).
      block = config.serve.prefix_block
      hits = round(r["cache_hit_rate"] * len(want))
      assert len(want) - 2 * config.serve.shared_prefixes <= hits < len(want)
      assert r["cache_reused_tokens"] % block == 0
      assert r["cache_reused_tokens"] >= hits * (shared // block) * block
    else:
      assert r["cache_hit_rate"] is None
    assert r["requests"] == len(want)
    assert r["tokens"] == sum(w["max_new_tokens"] for w in want)
    assert r["tokens_per_s"] > 0 and r["state_bytes"] > 0
    # 12 requests at once into 4 slots: after the first fill, dispatches
    # run full with a queue behind them (the full-load window).
    assert 0 < r["full_load_s"] < r["duration_s"], r
    assert r["full_load_tokens_per_s"] > 0
    assert 0 <= r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    assert 0 <= r["tpot_p50_ms"] <= r["tpot_p99_ms"]
    assert r["steps"] == r["dispatches"] * config.serve.steps_per_dispatch
    if r["speculative"]:
      assert r["match_plain"] == 1.0  # greedy: the plain run's tokens
      assert 0 < r["verify_rounds"] <= r["tokens"] - len(want)
      assert 0 <= r["accepted_drafts"] <= r["drafts"]
      assert 1.0 <= r["mean_accepted_length"] <= window
    else:
      assert r["match_plain"] is None and r["acceptance_rate"] is None
  _assert_config_json(out["workdir"], config)
  lines = common.read_metrics(os.path.join(out["workdir"], "metrics.jsonl"))
  assert lines[0]["kind"] == "environment" and len(lines) == 1 + len(recs)
  _assert_png(os.path.join(out["workdir"], "latency.png"))


def test_serve_bench_smoke_set_acceptance(tmp_path):
  """Speculative serving at a set acceptance rate: sampling at a high
  temperature with the flat oracle proposer, whose drafts are accepted
  with probability accept_prob each."""
  from configs import serve_bench as serve_config  # pylint: disable=g-import-not-at-top
  from experiments import serve_bench  # pylint: disable=g-import-not-at-top
  config = serve_config.get_config("smoke")
  s = config.serve
  s.proposer, s.temperature, s.accept_prob = "flat_sampling", 1000.0, 0.7
  s.shared_prefixes, s.ssm_modes = 0, ("replay",)
  recs = serve_bench.run(config, str(tmp_path))["records"]
  assert [r["speculative"] for r in recs] == [None, s.speculative_window]
  want = serve_bench.workload(config, config.model.vocab_size)
  spec = recs[1]
  assert spec["tokens"] == sum(w["max_new_tokens"] for w in want)
  assert spec["match_plain"] is None  # sampled: nothing to compare
  # Drafts after a window's first rejection count as proposed, not
  # accepted: the rate is the mean of a, a^2, ... over the window's drafts
  # (0.595 for a = 0.7, T = 3); about 80 drafts, so within a few binomial
  # standard deviations.
  a, t = s.accept_prob, s.speculative_window
  assert spec["drafts"] > 50
  rate = sum(a ** k for k in range(1, t)) / (t - 1)
  assert abs(spec["acceptance_rate"] - rate) < 0.2
  expected = sum(a ** k for k in range(t))  # tokens per verify round
  assert abs(spec["mean_accepted_length"] - expected) < 0.4
  s.proposer = "draft"
  with pytest.raises(ValueError, match="serve.proposer"):
    serve_bench.speculation(config, config.model.vocab_size)
  s.proposer, s.temperature = "flat_sampling", 0.0
  with pytest.raises(ValueError, match="serve.temperature"):
    serve_bench.speculation(config, config.model.vocab_size)
