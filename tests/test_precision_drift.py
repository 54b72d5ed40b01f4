"""Smoke run of experiments/precision_drift (CPU, reduced config)."""

import os

import numpy as np
import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")

from configs import precision_drift as drift_config  # noqa: E402
from experiments import common  # noqa: E402
from experiments import precision_drift  # noqa: E402
from replayssm_jax import precision as P  # noqa: E402
from replayssm_jax import testing  # noqa: E402


def test_config_args():
  assert (drift_config.get_config().to_dict()
          == drift_config.get_config("").to_dict())
  assert drift_config.get_config().steps == 100_000
  with pytest.raises(ValueError, match="smoke"):
    drift_config.get_config("bogus")
  assert "python -m experiments.precision_drift" in drift_config.__doc__


def test_sr_rngs_config_pairs_every_stochastic_preset_with_both_hashes():
  config = drift_config.get_config("sr_rngs")
  pols = {n: P.PrecisionPolicy.preset(n) for n in config.policies}
  assert {p.sr_rng for p in pols.values()} == set(P.SR_RNGS)
  for name, pol in pols.items():
    assert pol.stochastic_rounding and pol.name == name
    assert f"{name.partition(':')[0]}:hash32" in pols
  assert config.baseline_roundings == ("sr", "sr:hash32")


@pytest.mark.parametrize("field,value,match", [
    ("baseline_roundings", ("rn", "sr:philox"), "baseline_roundings"),
    ("baseline_roundings", ("rn:hash32",), "baseline_roundings"),
    ("policies", ("f32", "f16:hash32"), "name must be one of"),
])
def test_bad_rounding_or_policy_names_fail_before_any_run(field, value,
                                                          match):
  config = drift_config.get_config("smoke")
  setattr(config, field, value)
  with pytest.raises(ValueError, match=match):
    precision_drift.run_all(config, writer=None)


def test_measure_points():
  pts = precision_drift.measure_points(100_000, 40)
  assert pts[0] == 1 and pts[-1] == 100_000
  assert np.all(np.diff(pts) > 0)


def test_precision_drift_smoke(tmp_path):
  config = drift_config.get_config("smoke")
  workdir = str(tmp_path / "drift")
  precision_drift.run(config, workdir)
  for f in ("config.json", "metrics.jsonl", "summary.md", "state_error.png",
            "output_error.png"):
    assert os.path.exists(os.path.join(workdir, f)), f
  records = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert records[0]["kind"] == "environment"
  runs = [r for r in records if r["kind"] != "environment"]
  replay = {(r["policy"], r["L"]): r for r in runs if r["kind"] == "replay"}
  assert set(replay) == {(p, L) for p in config.policies
                         for L in config.buffer_lens}
  base = {(r["storage_dtype"], r["rounding"]): r for r in runs
          if r["kind"] == "baseline"}
  assert set(base) == {(d, r) for d in config.baseline_dtypes
                       for r in config.baseline_roundings}
  npts = len(precision_drift.measure_points(config.steps, config.num_points))
  for r in runs:
    for key in ("state_max_rel", "state_fro_rel", "out_max_rel",
                "out_mean_rel"):
      v = np.asarray(r[key], np.float64)
      assert v.shape == (npts,) and np.all(np.isfinite(v)), (r["label"], key)
  # f32 storage vs the f64 reference: only f32 arithmetic error, well
  # inside the f32 comparison tolerance of the test-suite.
  f32_tol = testing.TOLERANCES["float32"].rtol
  for L in config.buffer_lens:
    assert replay[("f32", L)]["final_state_max_rel"] < f32_tol
    assert max(replay[("f32", L)]["out_max_rel"]) < f32_tol
    # An f32 master + int8 read copy: the master never sees the copy.
    assert replay[("f32+int8", L)]["final_state_max_rel"] < f32_tol
    # bf16 storage errs by at least a fraction of its roundoff 2^-9.
    assert replay[("bf16", L)]["final_state_max_rel"] > 2.0**-9 / 8
  # Rounding once per 16 steps instead of every step: the bf16 baseline's
  # state error exceeds replay's at L=16. Expected ratio ~sqrt(16) = 4 for
  # a random walk of rounding errors; observed ~2.8 at 400 steps; asserted
  # with margin (> 1.5x) on the mean over the second half of the run.
  half = npts // 2
  b16 = np.mean(base[("bfloat16", "rn")]["state_max_rel"][half:])
  r16 = np.mean(replay[("bf16", 16)]["state_max_rel"][half:])
  assert b16 > 1.5 * r16, (b16, r16)


def test_a_scale_scales_A_only():
  import jax  # pylint: disable=g-import-not-at-top
  config = drift_config.get_config("smoke")
  key = jax.random.PRNGKey(3)
  base = precision_drift.drift_params(key, config)
  config.a_scale = 0.01
  slow = precision_drift.drift_params(key, config)
  np.testing.assert_allclose(np.asarray(slow["A"]),
                             0.01 * np.asarray(base["A"]), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(slow["dt_bias"]),
                                np.asarray(base["dt_bias"]))
  lo, hi = map(float, precision_drift._decay_range(config).split("-"))
  assert 0.99 < lo <= hi < 1.0
  config.a_scale = 0.0
  with pytest.raises(ValueError, match="a_scale"):
    precision_drift.drift_params(key, config)
