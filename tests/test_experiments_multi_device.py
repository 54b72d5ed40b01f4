"""The multi-device benchmark's smoke run on 8 forced host devices (in a
subprocess: the device count must be set before jax starts), beside
tests/test_experiments.py."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")

from configs import multi_device_bench as config_mod  # noqa: E402
from experiments import common  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multi_device_bench_smoke(tmp_path):
  config = config_mod.get_config("smoke")
  assert "python -m experiments.multi_device_bench" in config_mod.__doc__
  workdir = str(tmp_path / "run")
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.multi_device_bench",
       "--config=configs/multi_device_bench.py:smoke",
       f"--workdir={workdir}"], cwd=_ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:]
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f) == common.to_jsonable(config.to_dict())
  recs = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert recs[0]["kind"] == "environment"
  b = config.bench
  decode = [r for r in recs if r["kind"] == "decode"]
  assert {(r["data"], r["model"], r["batch"], r["ssm_mode"])
          for r in decode} == {(d, m, n, s) for d, m in b.meshes
                               for n in b.global_batches
                               for s in b.ssm_modes}
  for r in decode:
    assert r["tokens_per_s"] > 0
    # The state as placed by the rules, and the model's figure for it.
    assert (r["state_bytes_per_device"]
            == r["predicted_state_bytes_per_device"]), r
    # Every predicted residual-stream psum is in the compiled loop.
    assert (r["hlo_residual_allreduce_bytes"]
            == r["predicted_psum_bytes"]), r
    assert r["hlo_all_reduce_bytes"] >= r["predicted_psum_bytes"]
    if r["model"] == 1:
      assert r["predicted_psum_bytes"] == 0
  spec = [r for r in recs if r["kind"] == "specdec"]
  assert {(r["data"], r["model"], r["ssm_mode"]) for r in spec} == {
      (d, m, s) for d, m in b.meshes for s in b.ssm_modes}
  assert all(r["e2e_tokens_per_s"] > 0 and r["mean_accepted_length"] >= 1
             for r in spec)
  with open(os.path.join(workdir, "summary.md")) as f:
    assert "multi_device_bench" in f.read()
  with open(os.path.join(workdir, "tokens_per_s.png"), "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_meshes_that_do_not_fit_are_skipped(tmp_path):
  from experiments import multi_device_bench  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  config = config_mod.get_config("smoke")
  n = jax.device_count()
  config.bench.meshes = ((n + 1, 1),)
  out = multi_device_bench.run(config, str(tmp_path))
  assert out["records"] == []
  assert [(r["data"], r["model"]) for r in out["skipped"]] == [(n + 1, 1)]
  config.bench.meshes = ((0, 1),)
  with pytest.raises(ValueError, match="meshes"):
    multi_device_bench.run(config, str(tmp_path / "bad"))
