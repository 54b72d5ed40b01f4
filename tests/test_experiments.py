"""End-to-end runs of the experiment scripts' smoke configs (CPU)."""

import dataclasses
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")

from configs import kernel_bench as kernel_bench_config  # noqa: E402
from configs import replay_demo as replay_demo_config  # noqa: E402
from experiments import common  # noqa: E402
from experiments import kernel_bench  # noqa: E402
from experiments import replay_demo  # noqa: E402
import replayssm_jax  # noqa: E402
from replayssm_jax import testing  # noqa: E402
from replayssm_jax import traffic  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
  assert os.path.exists(path), path
  with open(path, "rb") as f:
    assert f.read(8) == PNG_MAGIC, path
  assert os.path.getsize(path) > 5_000, path


def _assert_config_json(workdir, config):
  with open(os.path.join(workdir, "config.json")) as f:
    saved = json.load(f)
  assert saved == common.to_jsonable(config.to_dict())


def test_config_args():
  for mod in (replay_demo_config, kernel_bench_config):
    assert mod.get_config().to_dict() == mod.get_config("").to_dict()
    assert mod.get_config("smoke").to_dict() != mod.get_config().to_dict()
    with pytest.raises(ValueError, match="smoke"):
      mod.get_config("bogus")
    assert "python -m experiments." in mod.__doc__


def test_replay_demo_smoke(tmp_path):
  config = replay_demo_config.get_config("smoke")
  workdir = str(tmp_path / "replay_demo")
  out = replay_demo.run(config, workdir)

  _assert_config_json(workdir, config)
  records = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  kinds = [r["kind"] for r in records]
  assert kinds[0] == "environment"

  decode = [r for r in records if r["kind"] == "decode"]
  n_base = len(config.baseline_state_dtypes)
  n_rep = len(config.buffer_lens) * len(config.buffer_dtypes)
  assert len(decode) == n_base + n_rep
  keys = {"mode", "L", "checkpoint_dtype", "buffer_dtype", "steps",
          "max_rel_output_dev", "final_state_rel_dev", "tolerance",
          "within_tolerance", "dev_per_step"}
  for r in decode:
    assert keys <= set(r), r.keys()
    assert len(r["dev_per_step"]) == config.steps
  replay = [r for r in decode if r["mode"] == "replay"]
  assert {(r["L"], r["buffer_dtype"]) for r in replay} == {
      (L, d) for L in config.buffer_lens for d in config.buffer_dtypes}
  for r in replay:
    # ReplaySSM reproduces the baseline decode within the storage tolerance.
    assert r["within_tolerance"], r
    assert r["max_rel_output_dev"] <= r["tolerance"], r
    assert r["final_state_rel_dev"] <= r["tolerance"], r
    if r["buffer_dtype"] == "float32":
      assert r["max_rel_output_dev"] < 1e-5, r
    if r["L"] == 1:  # L=1 is algebraically the baseline step
      assert r["max_rel_output_dev"] < 1e-6, r

  tr = [r for r in records if r["kind"] == "traffic"]
  assert len(tr) == (len(config.traffic.buffer_lens)
                     * len(config.traffic.checkpoint_dtypes))
  dims = traffic.LayerDims.nemotron_h_8b()
  for r in tr:
    assert r["baseline_bytes"] == traffic.baseline_step_bytes(
        dims, config.traffic.batch, r["checkpoint_dtype"])
    assert r["predicted_speedup"] == pytest.approx(1 / r["ratio"])
  opt = {r["checkpoint_dtype"]: r for r in records
         if r["kind"] == "traffic_optimum"}
  assert opt["float32"]["optimal_L"] == 21
  assert opt["float16"]["optimal_L"] == 15
  assert len(out["decode"]) == len(decode)

  for name in ("deviation.png", "traffic_speedup.png"):
    _assert_png(os.path.join(workdir, name))
  assert os.path.exists(os.path.join(workdir, "summary.md"))


def test_kernel_bench_smoke(tmp_path):
  config = kernel_bench_config.get_config("smoke")
  # The smoke config times the kernels (each checked against the reference
  # first), or the reference alone when no kernel is registered.
  others = tuple(
      i for i in replayssm_jax.implementations("replay_state_update")
      if i != "reference"
      and i in replayssm_jax.implementations("selective_state_update"))
  impls = others or ("reference",)
  workdir = str(tmp_path / "kernel_bench")
  results_dir = str(tmp_path / "benchmarks")
  results = kernel_bench.run(config, workdir, results_dir)

  _assert_config_json(workdir, config)
  for name in ("results.json", "results.md", "metrics.jsonl"):
    assert os.path.exists(os.path.join(workdir, name)), name
  _assert_png(os.path.join(workdir, "speedup.png"))
  for ext in ("json", "md", "png"):
    assert os.path.exists(os.path.join(results_dir, f"{config.name}.{ext}"))

  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved["summary"] == results["summary"]
  meta = saved["meta"]
  for key in ("device_kind", "jax", "jaxlib", "date", "command_line"):
    assert meta[key], key
  assert saved["stream_bandwidth"]["gbps"] > 0

  # Every implementation passed its checks against the reference.
  checks = [c for c in saved["checks"] if c["impl"] != "reference"]
  if impls != ("reference",):
    n_cfg = len(config.batches) * len(config.checkpoint_dtypes)
    assert len(checks) == len(impls) * n_cfg * (1 + len(config.buffer_lens))
  for c in checks:
    assert c["passed"] is True, c
    assert c["max_err_y"] <= c["tolerance"], c

  # Every phase of every configuration was timed, with the model's bytes.
  dims = traffic.LayerDims(config.nheads, config.headdim, config.dstate,
                           config.ngroups)
  timings = saved["timings"]
  assert {t["impl"] for t in timings} == set(impls)
  for impl in impls:
    for batch in config.batches:
      for sdt in config.checkpoint_dtypes:
        base = [t for t in timings if t["impl"] == impl
                and t["batch"] == batch and t["phase"] == "baseline"
                and t["checkpoint_dtype"] == sdt]
        assert len(base) == 1
        assert base[0]["model_bytes"] == traffic.baseline_step_bytes(
            dims, batch, sdt, config.act_dtype)
        for L in config.buffer_lens:
          phases = {t["phase"]: t for t in timings if t["impl"] == impl
                    and t["batch"] == batch and t["L"] == L
                    and t["checkpoint_dtype"] == sdt}
          assert set(phases) == {"non_flush", "flush", "natural",
                                 "amortized"}
          assert phases["flush"]["fill"] == L - 1
          assert phases["non_flush"]["fill"] == (L - 2) // 2
          assert phases["flush"]["model_bytes"] == traffic.replay_step_bytes(
              dims, batch, L, L - 1, sdt, config.buffer_dtype,
              config.act_dtype)
          # Whole L-step cycles per call in the natural phase.
          nat = phases["natural"]
          assert nat["steps_per_call"] % (L * nat["num_sets"]) == 0
          for t in phases.values():
            assert math.isfinite(t["median_us"]) and t["median_us"] > 0
            assert t["p10_us"] <= t["median_us"] <= t["p90_us"]
  assert len(saved["summary"]) == (len(impls) * len(config.batches)
                                   * len(config.checkpoint_dtypes)
                                   * len(config.buffer_lens))
  for row in saved["summary"]:
    assert row["speedup_amortized"] > 0
    assert row["predicted_speedup"] > 1

  records = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  kinds = {r["kind"] for r in records}
  assert {"environment", "stream_bandwidth", "timing", "summary"} <= kinds

  # A run cut off before its last summary: benchmarks/scripts/
  # kernel_bench_rebuild.py writes its results from metrics.jsonl, marked.
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..",
                                  "benchmarks", "scripts"))
  try:
    import kernel_bench_rebuild  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  cut = str(tmp_path / "cut")
  os.makedirs(cut)
  last = max(i for i, r in enumerate(records) if r["kind"] == "summary")
  with open(os.path.join(cut, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records[:last])
  shutil.copyfile(os.path.join(workdir, "config.json"),
                  os.path.join(cut, "config.json"))
  rebuilt = kernel_bench_rebuild.rebuild(cut, "a test")
  assert rebuilt["summary"] == saved["summary"][:-1]
  assert rebuilt["timings"] == [t for t in records[:last]
                                if t["kind"] == "timing"]
  with open(os.path.join(cut, "results.md")) as f:
    text = f.read()
  assert f"cut off after {len(saved['summary']) - 1} finished" in text
  assert "a test." in text
  _assert_png(os.path.join(cut, "speedup.png"))


def test_random_generators():
  """DeviceGen (accelerators) and HostGen (CPU) draw the same structures."""
  dims = traffic.LayerDims(nheads=4, headdim=8, dstate=16, ngroups=2)
  out = {}
  for gen in (kernel_bench.DeviceGen(0, dims), kernel_bench.HostGen(0, dims)):
    inp = gen.inputs(3, jnp.bfloat16, False)
    seq = gen.inputs(3, jnp.bfloat16, True, seqlen=5)
    assert inp["z"] is None and seq["z"].shape == (5, 3, 4, 8)
    assert seq["x"].shape == (5, 3, 4, 8) and seq["dt"].shape == (5, 3, 4)
    rs = gen.rstate([0, 1, 3], True, 4, jnp.float16, jnp.bfloat16)
    rs.validate()
    x = np.asarray(rs.x_buf, np.float32)
    assert np.all(x[0] > 5e3) and np.all(x[1, 1:] > 5e3)  # stale: junk
    assert np.all(np.abs(x[2, :3]) < 100) and np.any(x[2, :3] != 0)
    assert np.all(np.asarray(rs.dt_buf)[0] == 50.0)
    clean = gen.rstate([0, 1, 3], False, 4, jnp.float32, jnp.bfloat16)
    assert np.all(np.abs(np.asarray(clean.x_buf, np.float32)) < 100)
    state = gen.state(2, jnp.float32)
    assert float(jnp.std(state)) > 0.5  # fresh random, never zeros
    out[type(gen).__name__] = jax.tree.map(
        lambda a: (a.shape, a.dtype), (inp, seq, rs, clean, state))
  assert out["DeviceGen"] == out["HostGen"]


def test_kernel_bench_policies_smoke(tmp_path):
  """Replay under a precision policy ("<impl>@<preset>") is checked against
  the reference under the same policy, timed, and compared with the
  baseline of the row's dtype; its bytes count the read copy."""
  config = kernel_bench_config.get_config("smoke")
  config.batches = (2,)
  config.buffer_lens = (4,)
  config.policies = ("f32+int8",)
  config.extra_fills = (0, 9)  # 9 >= L - 1: not a non-flush fill, skipped
  config.synced_cycle = True
  results = kernel_bench.run(config, str(tmp_path / "kb"))
  # The diagnostic phases: the non-flush step at fill 0, and the synced
  # cycle (every row from count 0, whole L-step cycles per call).
  for impl in ("pallas", "pallas@f32+int8"):
    phases = {r["phase"]: r for r in results["timings"]
              if r["op"] == "replay" and r["impl"] == impl}
    assert set(phases) == {"non_flush", "flush", "natural", "amortized",
                           "non_flush_fill0", "synced"}, phases
    assert phases["non_flush_fill0"]["fill"] == 0
    synced = phases["synced"]
    assert synced["fill"] is None and synced["median_us"] > 0
    assert synced["steps_per_call"] % (4 * synced["num_sets"]) == 0
  rows = {r["impl"]: r for r in results["summary"]}
  assert set(rows) == {"pallas", "pallas@f32+int8"}, rows
  for impl, row in rows.items():
    assert row["checks_passed"] is True, row
    assert row["baseline_us"] == rows["pallas"]["baseline_us"]
  timing = {(r["impl"], r["phase"]): r["model_bytes"]
            for r in results["timings"] if r["op"] == "replay"}
  dims = traffic.LayerDims(config.nheads, config.headdim, config.dstate,
                           config.ngroups)
  assert timing[("pallas@f32+int8", "non_flush")] == traffic.replay_step_bytes(
      dims, 2, 4, 1, jnp.float32, jnp.bfloat16, jnp.dtype(config.act_dtype),
      read_dtype="int8", has_z=False, has_D=True, has_dt_bias=True)


def test_kernel_bench_mosaic_smoke(tmp_path):
  """The `mosaic` study's implementations and variants at smoke size: the
  Mosaic GPU baseline kernel (interpret mode here) and a variant of it are
  checked against the reference and timed beside the Triton kernel."""
  mosaic = kernel_bench_config.get_config("mosaic")
  config = kernel_bench_config.get_config("smoke")
  config.batches = (2,)
  config.buffer_lens = (4,)
  config.implementations = mosaic.implementations
  config.exclude_implementations = ("reference",)
  config.mosaic_variants = {"hpp1": mosaic.mosaic_variants.hpp1.to_dict()}
  config.replay_variants = mosaic.replay_variants.to_dict()
  config.experimental_implementations = mosaic.experimental_implementations
  # No policy here: "<impl>@<policy>" rows are in
  # test_kernel_bench_policies_smoke.
  config.policies = ()
  results = kernel_bench.run(config, str(tmp_path / "kb"))
  base = {r["impl"] for r in results["timings"] if r["op"] == "baseline"}
  assert base == {"pallas", "pallas_mosaic_gpu", "pallas_mosaic_gpu:hpp1"}
  checks = {(c["impl"], c["op"]): c for c in results["checks"]}
  assert {i for i, op in checks if op == "baseline"} == base
  assert all(c["passed"] is True for c in checks.values()), checks
  # The replay step (no Mosaic output route): the Triton kernels.
  replay = {"pallas"}
  assert {i for i, op in checks if op == "replay"} == replay
  assert {r["impl"] for r in results["summary"]} == replay


def test_kernel_bench_records_an_experimental_failure(tmp_path, monkeypatch):
  """A failing experimental implementation is recorded with its error and
  the run goes on; any other implementation's failure stops the run."""
  def broken(**_):
    raise ValueError("Mosaic GPU lowering failed (simulated)")

  jax.clear_caches()  # no step jitted by an earlier test with the real fn

  assert "pallas_mosaic_gpu" in replayssm_jax.implementations(
      "selective_state_update")  # (loads the kernel package)
  table = replayssm_jax.ops._REGISTRY["selective_state_update"]  # pylint: disable=protected-access
  monkeypatch.setitem(table, "pallas_mosaic_gpu", dataclasses.replace(
      table["pallas_mosaic_gpu"], fn=broken))
  config = kernel_bench_config.get_config("smoke")
  config.batches = (2,)
  config.buffer_lens = (4,)
  config.implementations = ("pallas", "pallas_mosaic_gpu")
  config.exclude_implementations = ()
  results = kernel_bench.run(config, str(tmp_path / "kb"))
  failed = [c for c in results["checks"] if c["impl"] == "pallas_mosaic_gpu"]
  assert failed and all(c["passed"] is None for c in failed)
  assert "simulated" in failed[0]["reason"]
  assert {r["impl"] for r in results["summary"]} == {"pallas"}
  config.experimental_implementations = ()
  jax.clear_caches()
  with pytest.raises(ValueError, match="simulated"):
    kernel_bench.run(config, str(tmp_path / "kb2"))


def test_device_check_matches_testing_helpers():
  """kernel_bench's on-device check agrees with testing's host helpers."""
  tol = testing.tolerance(jnp.float16)
  rng = np.random.default_rng(3)
  expected = rng.standard_normal((4, 5, 6)).astype(np.float32)
  noise = rng.standard_normal(expected.shape).astype(np.float32)
  for scale in (0.1 * tol.rtol, 10.0 * (tol.atol + tol.rtol)):
    actual = expected + scale * noise
    err, ok = kernel_bench._errors_ok(  # pylint: disable=protected-access
        jnp.asarray(actual), jnp.asarray(expected), tol)
    np.testing.assert_allclose(err, testing.max_rel_error(actual, expected),
                               rtol=1e-5)
    try:
      testing.assert_close(actual, expected, tol)
      host_ok = True
    except AssertionError:
      host_ok = False
    assert ok == host_ok
  assert not host_ok, "the large perturbation must fail"
  actual[0, 0, 0] = np.nan
  err, ok = kernel_bench._errors_ok(  # pylint: disable=protected-access
      jnp.asarray(actual), jnp.asarray(expected), tol)
  assert err == float("inf") and not ok


def test_timed_loop_keeps_steps_apart():
  """Every timed step ends in an optimization barrier, so XLA cannot fuse a
  state set's consecutive reference steps into one pass over the state."""
  dims = traffic.LayerDims(nheads=2, headdim=4, dstate=8, ngroups=1)
  gen = kernel_bench.HostGen(0, dims)
  loop = kernel_bench.make_loop(kernel_bench.BASELINE_OP, "reference", 1,
                                fixed_count=False, rounds_per_iter=3)
  states = (gen.state(2, jnp.float32),)
  inputs = (gen.inputs(2, jnp.float32, False),)
  params = testing.random_params(jax.random.PRNGKey(0), 2)
  hlo = loop.lower(states, inputs, params, jnp.int32(1)).as_text()
  assert hlo.count("optimization_barrier") >= 3


def test_timed_loop_stops_at_its_time_budget():
  """With a time budget, a loop whose steps never reach min_call_s (here
  an hour) stops calibrating, warming up and timing once the budget is
  spent, and says so; without one the smoke config would grow its calls
  up to 8 times by up to 64x."""
  import time  # pylint: disable=g-import-not-at-top
  dims = traffic.LayerDims(nheads=2, headdim=4, dstate=8, ngroups=1)
  gen = kernel_bench.HostGen(0, dims)
  loop = kernel_bench.make_loop(kernel_bench.BASELINE_OP, "reference", 1,
                                fixed_count=False)
  states = (gen.state(2, jnp.float32),)
  inputs = (gen.inputs(2, jnp.float32, False),)
  params = testing.random_params(jax.random.PRNGKey(0), 2)
  t0 = time.perf_counter()
  stats, _ = kernel_bench.time_loop(
      loop, states, inputs, params, (), num_sets=1, min_call_s=3600.0,
      warmup=5, iters=50, state_shape=(2, 2, 4, 8), time_budget_s=0.5)
  assert time.perf_counter() - t0 < 60
  # On a busy machine the first call alone may foresee the budget's end:
  # the calibration then stops at one round per call and every timed pair
  # may fit (iters=50: 100 calls); the budget is reported hit either way.
  assert stats["budget_hit"] and 2 <= stats["timed_calls"] <= 100
  assert kernel_bench_config.get_config("smoke").time_budget_s > 0
  assert kernel_bench_config.get_config().time_budget_s == 0


def test_count_state_copies():
  hlo = "\n".join([
      "%fused_computation (p: f32[2,3]) -> f32[2,3] {",
      "  %copy.1 = f32[2,3]{1,0} copy(%p)",
      "}",
      "ENTRY %main (a: f32[2,3]) -> f32[2,3] {",
      "  %copy.2 = f32[2,3]{1,0} copy(%a)",
      "  %copy.3 = f32[3,2]{1,0} copy(%a)",
      "  %cs = (f32[2,3]{1,0}, f32[2,3]{1,0}, u32[]) copy-start(%a)",
      "  %cd = f32[2,3]{1,0} copy-done(%cs)",
      "}",
  ])
  # copy.2 and copy-start count; the fused copy and other shapes do not.
  assert kernel_bench.count_state_copies(hlo, (2, 3)) == 2


def test_metrics_writer_and_tables(tmp_path):
  w = common.MetricsWriter(str(tmp_path))
  w.write(a=1, b=float("nan"))
  w.write({"c": [1, 2]}, d=None)
  assert common.read_metrics(w.path) == [{"a": 1, "b": "nan"},
                                         {"c": [1, 2], "d": None}]
  table = common.markdown_table([{"x": 1.23456, "y": None}], ["x", "y"],
                                {"x": ".2f"})
  assert table.splitlines()[-1] == "| 1.23 | - |"


@pytest.mark.parametrize("arg", ["sweep", "launch", "policies",
                                 "output_launch", "batch1", "rows_fused",
                                 "mosaic_flush"])
def test_kernel_variants_resolve_to_configs(arg):
  """'pallas:<name>' runs the kernel with the named tuning config; every
  variant of the sweep / launch configs is a valid config object."""
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  sweep = kernel_bench_config.get_config(arg)
  variants = {kernel_bench.BASELINE_OP: sweep.ssu_variants.to_dict(),
              kernel_bench.REPLAY_OP: sweep.replay_variants.to_dict()}
  assert variants[kernel_bench.REPLAY_OP], "the sweep has replay variants"
  saved = dict(kernel_bench._VARIANTS)  # pylint: disable=protected-access
  try:
    kernel_bench._VARIANTS.update(variants)  # pylint: disable=protected-access
    for op, cls in ((kernel_bench.BASELINE_OP, pallas_kernels.SSUConfig),
                    (kernel_bench.REPLAY_OP, pallas_kernels.ReplayConfig)):
      assert kernel_bench._impl_and_config(op, "pallas") == ("pallas", None)  # pylint: disable=protected-access
      for name, kw in variants[op].items():
        impl, config = kernel_bench._impl_and_config(op, f"pallas:{name}")  # pylint: disable=protected-access
        assert impl == "pallas" and config == cls(**kw)
  finally:
    kernel_bench._VARIANTS.clear()  # pylint: disable=protected-access
    kernel_bench._VARIANTS.update(saved)  # pylint: disable=protected-access


def test_specdec_bench_smoke(tmp_path):
  """The speculative-decoding benchmark's smoke run: every mode reproduces
  the plain greedy tokens, the oracle proposer's acceptance is the same for
  baseline and replay, and the outputs are written."""
  from configs import specdec_bench as specdec_config  # pylint: disable=g-import-not-at-top
  from experiments import specdec_bench  # pylint: disable=g-import-not-at-top
  config = specdec_config.get_config("smoke")
  assert "python -m experiments.specdec_bench" in specdec_config.__doc__
  out = specdec_bench.run(config, str(tmp_path))
  recs = out["records"]
  b = config.bench
  assert b.plain_baseline
  assert len(recs) == len(b.batches) * (
      2 + len(b.windows) * len(b.compactions) * len(b.ssm_modes))
  assert set(b.compactions) == {0, 1}
  for r in recs:
    assert r["match_fraction"] == 1.0, r  # f32: exactly the plain tokens
    assert r["e2e_tokens_per_s"] > 0
    if r["decode_s"] and r["mode"].startswith("plain"):
      assert r["steady_tokens_per_s"] == r["tokens_per_s"]
    elif r["decode_s"] and not r["compaction"]:
      # The slowest row sets the run's length.
      n = r["new_tokens"]
      assert r["steady_tokens_per_s"] >= r["tokens_per_s"] * (n - 1) / n, r
    elif r["decode_s"]:  # a compacting loop has no steady figure
      assert "steady_tokens_per_s" not in r
  for batch in b.batches:
    for w in b.windows:
      for c in b.compactions:
        acc = {r["mode"]: r["mean_accepted_length"] for r in recs
               if r["batch"] == batch and r["window"] == w
               and r["compaction"] == c}
        assert acc["baseline"] == acc["replay"]  # same proposer and drafts
        assert 1.0 <= acc["replay"] <= w
  _assert_config_json(out["workdir"], config)
  lines = common.read_metrics(os.path.join(out["workdir"], "metrics.jsonl"))
  assert lines[0]["kind"] == "environment" and len(lines) == 1 + len(recs)
  _assert_png(os.path.join(out["workdir"], "throughput.png"))


def test_specdec_bench_with_a_precision_policy(tmp_path):
  """bench.precision: plain and replay speculative decoding run states of
  that policy (here an f32 master with an int8 read copy) and say so; the
  baseline state's plain decoding keeps f32 (precision None)."""
  from configs import specdec_bench as specdec_config  # pylint: disable=g-import-not-at-top
  from experiments import specdec_bench  # pylint: disable=g-import-not-at-top
  config = specdec_config.get_config("smoke")
  config.bench.ssm_modes = ("replay",)
  config.bench.compactions = (0,)
  config.bench.precision = "f32+int8"
  recs = specdec_bench.run(config, str(tmp_path))["records"]
  assert [r["mode"] for r in recs] == ["plain", "plain_baseline", "replay"]
  assert [r["precision"] for r in recs] == ["f32+int8", None, "f32+int8"]
  for r in recs:
    assert r["e2e_tokens_per_s"] > 0 and 0.0 <= r["match_fraction"] <= 1.0
  config.bench.precision = "f8"
  with pytest.raises(ValueError, match="name must be one of"):
    specdec_bench.run(config, str(tmp_path / "bad"))


def test_oracle_proposer_acceptance_rate():
  """accept_prob 1 drafts the reference exactly; 0 never does."""
  from experiments.specdec_bench import OracleProposer  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import ProposalContext  # pylint: disable=g-import-not-at-top
  ref = jax.random.randint(jax.random.PRNGKey(0), (64, 20), 0, 50, jnp.int32)
  ctx = ProposalContext(history=None, length=None, last=None,
                        num_generated=jnp.full((64,), 3, jnp.int32),
                        active=None, iteration=None)
  for p, check in ((1.0, np.equal), (0.0, np.not_equal)):
    proposer = OracleProposer(ref, p, 50)
    pstate = proposer.init(None, None)  # the reference, row by row
    prop, _ = proposer.propose(pstate, ctx, 5, jax.random.PRNGKey(1), None)
    assert check(np.asarray(prop.drafts), np.asarray(ref[:, 3:7])).all()
    np.testing.assert_array_equal(prop.num_drafts, 4)
  with pytest.raises(ValueError, match="accept_prob"):
    OracleProposer(ref, 1.5, 50)


def test_flat_oracle_proposer_acceptance_rate():
  """Speculative sampling of a nearly flat target accepts each of the flat
  oracle's drafts with probability accept_prob."""
  from experiments.specdec_bench import FlatOracleProposer  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import ProposalContext  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models.generate import sampling_settings  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models.speculative import accept  # pylint: disable=g-import-not-at-top
  b, t, vocab, temperature = 4096, 4, 64, 1000.0
  ctx = ProposalContext(history=None, length=None, last=None,
                        num_generated=jnp.zeros((b,), jnp.int32),
                        active=None, iteration=None)
  logits = jax.random.normal(jax.random.PRNGKey(0), (b, t, vocab)) * 3.0
  sampling = sampling_settings(temperature, None, None, None,
                               jax.random.PRNGKey(1))
  for a in (0.0, 0.5, 0.9):
    prop, _ = FlatOracleProposer(a, vocab).propose(
        (), ctx, t, jax.random.PRNGKey(2), sampling)
    np.testing.assert_allclose(np.sum(prop.q, -1), 1.0, rtol=1e-5)
    acc, _ = accept(logits, prop.drafts, prop.num_drafts, prop.q, sampling,
                    jax.random.PRNGKey(3))
    # First draft accepted w.p. a(1 + O(logit / T)); binomial sd <= 0.008.
    first = float(np.mean(np.asarray(acc) >= 1))
    assert abs(first - a) < 0.03 + 1.5 / vocab, (a, first)
  with pytest.raises(ValueError, match="accept_prob"):
    FlatOracleProposer(-0.1, vocab)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPTS = sorted(
    f[:-3] for f in os.listdir(os.path.join(_ROOT, "experiments"))
    if f.endswith(".py") and f not in ("__init__.py", "common.py"))


def _own_flags(script: str) -> set[str]:
  """--config, --workdir and the `extra_flags` names of the script's
  `common.run_app` call."""
  import ast  # pylint: disable=g-import-not-at-top
  with open(os.path.join(_ROOT, "experiments", f"{script}.py")) as f:
    tree = ast.parse(f.read())
  names = {"config", "workdir"}
  calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
           and getattr(n.func, "attr", None) == "run_app"]
  assert len(calls) == 1, script
  for kw in calls[0].keywords:
    if kw.arg == "extra_flags":
      names |= {k.value for k in kw.value.keys}
  return names


def test_every_script_has_help():
  """`python -m experiments.<name> --help` exits 0 and lists the script's
  own flags (all scripts side by side, one interpreter each)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  assert {"replay_demo", "kernel_bench", "train"} <= set(_SCRIPTS)
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
  procs = {s: subprocess.Popen(
      [sys.executable, "-m", f"experiments.{s}", "--help"], cwd=_ROOT,
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for s in _SCRIPTS}
  for script, proc in procs.items():
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, (script, out[-3000:])
    own = out.split(f"experiments/{script}.py:", 1)
    assert len(own) == 2, (script, out[-3000:])  # the script's flag section
    for flag in _own_flags(script):
      assert f"--{flag}:" in own[1], (script, flag, out[-3000:])


def test_every_config_names_its_run_command():
  for f in sorted(os.listdir(os.path.join(_ROOT, "configs"))):
    if f.endswith(".py") and not f.startswith("_"):
      with open(os.path.join(_ROOT, "configs", f)) as fh:
        text = fh.read()
      assert "python -m experiments." in text, f
