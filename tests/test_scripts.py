"""The GPU diagnostic scripts of benchmarks/scripts/ run end to end at tiny
size on the CPU (interpret mode), so a device call is not the first run."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.testing import tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, path=ROOT, check=True):
  env = dict(os.environ, PYTHONPATH=path)
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "scripts", script),
       *args], check=check, cwd=ROOT, env=env, timeout=600,
      capture_output=True, text=True)


def test_specdec_profile_tiny(tmp_path):
  out = tmp_path / "specdec_profile.json"
  # One of the three loops: they share loop_splits' code (the others
  # cost ~40 s more of CI). The replay states with an fp8 read copy.
  _run("specdec_profile.py", "--tiny", "--batch", "2", "--steps", "2",
       "--loops", "replay", "--precision", "f32+fp8", "--out", str(out))
  res = json.loads(out.read_text())
  assert res["precision"] == "f32+fp8"
  assert res["window_forward_ms"] > 0
  for mode in ("replay", "baseline"):
    r = res["modes"][mode]
    for key in ("plain_step_ops", "verify_commit_ops"):
      split = r[key]
      assert split["top"] and split["device_ms"] > 0
      assert abs(sum(split["by_category"].values())
                 - split["device_ms"]) < 1e-6 * max(1.0, split["device_ms"])
  assert set(res["loops"]) == {"replay"}
  loop = res["loops"]["replay"]
  assert loop["iterations"] >= 1 and loop["loop_top"]
  # Only the loop body's ops (not the call's one-off prefill ops).
  assert all(o["events_per_call"] >= loop["iterations"] / 2
             for o in loop["loop_top"])
  assert loop["prefill_ms"] > 0
  assert np.isfinite(loop["idle_ms"])  # its sign means nothing on a CPU


def _tiny_qwen_config(path):
  """A 4-layer Qwen3.5-like transformers config.json at toy widths."""
  hf = json.loads((Path(ROOT) / "configs" / "qwen3_5_4b_text.json")
                  .read_text())
  hf.update(hidden_size=64, intermediate_size=64, head_dim=16,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
            linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            num_hidden_layers=4, layer_types=hf["layer_types"][:4])
  path.write_text(json.dumps(hf))


def test_specdec_profile_gdn_model(tmp_path):
  # A model without Mamba layers (Gated DeltaNet, from a transformers
  # config): the pieces and the replay loop are split, the Mamba-only
  # SSM-verify timing is left out; only the sections asked for run.
  _tiny_qwen_config(tmp_path / "qwen.json")
  out = tmp_path / "specdec_profile.json"
  _run("specdec_profile.py", "--config", str(tmp_path / "qwen.json"),
       "--batch", "2", "--steps", "2", "--modes", "replay", "--loops",
       "replay", "--sections", "modes,loops", "--out", str(out))
  res = json.loads(out.read_text())
  assert "window_forward_ms" not in res and not any(
      k.startswith("accept") for k in res)
  assert res["config"].endswith("qwen.json") and set(res["modes"]) == {
      "replay"}
  r = res["modes"]["replay"]
  assert r["ssm_verify_ms"] is None and "ssm_verify_loop_big_copies" not in r
  assert r["verify_commit_ms"] > 0 and r["verify_commit_ops"]["top"]
  assert res["loops"]["replay"]["iterations"] >= 1


def test_triton_offline_modules():
  """triton_offline.py's CPU half: the replay step's two kernels lowered
  for CUDA, captured as Triton modules (the flush fold as tensor-core
  dots). Compiling them needs the pip triton package, which CI lacks."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks", "scripts"))
  try:
    import triton_offline  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  def modules(**fields):
    return triton_offline.triton_modules(
        batch=2, nheads=4, headdim=16, dstate=16, ngroups=2, buffer_len=16,
        checkpoint_dtype=jnp.float16,
        config=pk.ReplayConfig(fused_launch=False, **fields))

  # The default flush (4 warps) is capped at 128 registers per thread
  # (replay.default_flush_launch): the cap reaches the flush module, and
  # only it, as Triton's ttg.maxnreg attribute.
  mods = modules()
  flush = "replayssm_replay_flush_route__maxnreg128"
  assert set(mods) == {"replayssm_replay_output_route", flush}
  for text in mods.values():
    assert "tt.func public @replayssm_replay" in text
  assert re.search(r"ttg\.maxnreg = 128 : i32", mods[flush])
  assert "maxnreg" not in mods["replayssm_replay_output_route"]
  # Two bf16 pieces on a 16-bit checkpoint: two dots of bf16 operands.
  dots = re.findall(r"tt\.dot .*: tensor<\d+x\d+xbf16>", mods[flush])
  assert len(dots) == 2, dots
  # 2 warps are not capped by default.
  uncapped = modules(flush_num_warps=2)
  assert "maxnreg" not in uncapped["replayssm_replay_flush_route"]
  # --op verify: the speculative verify's fold and window kernels.
  verify = triton_offline.verify_modules(
      batch=2, nheads=4, headdim=16, dstate=16, ngroups=2, buffer_len=8,
      checkpoint_dtype=jnp.float32, window=4,
      config=pk.VerifyConfig(num_warps=8))
  assert set(verify) == {"replayssm_verify_fold", "replayssm_verify_window"}
  for text in verify.values():
    assert "tt.func public @replayssm_verify" in text
  # --op gdn_step / gdn_verify: the Gated DeltaNet replay step's launch
  # (no ring-weights launch at 2 rows) and the verify's three.
  gdn = lambda **kw: set(triton_offline.gdn_modules(
      batch=2, buffer_len=16, checkpoint_dtype=jnp.float32, **kw))
  assert gdn(window=None) == {"replayssm_gdn_replay_step"}
  assert gdn() == {"replayssm_gdn_verify_weights", "replayssm_gdn_verify_fold",
                   "replayssm_gdn_verify_window"}


def test_spec_hlo_census_smoke(tmp_path):
  # One loop of three (they share the census code; each costs a compile).
  _run("spec_hlo_census.py", "--config=configs/specdec_bench.py:smoke",
       "--loops", "spec_replay", "--out", str(tmp_path))
  res = json.loads((tmp_path / "census.json").read_text())
  assert set(res["loops"]) == {"spec_replay"}
  for name, loop in res["loops"].items():
    assert "error" not in loop, (name, loop)
    assert loop["launch_ops"] == sum(loop["by_opcode"].values()) > 0
    assert loop["by_opcode"].get("fusion", 0) > 0


def test_decode_step_profile_and_attend_micro_tiny(tmp_path):
  """The decode step split by named scope (the scopes of models/layers.py
  reach the profile), and the attention forms agree with the f32 form."""
  out = tmp_path / "dsp.json"
  _run("decode_step_profile.py", "--config", "configs/tiny.py", "--batch",
       "2", "--prompt_len", "8", "--steps", "2", "--iters", "1", "--out",
       str(out))
  res = json.loads(out.read_text())
  for mode in ("baseline", "replay"):
    r = res["modes"][mode]
    assert r["ms_per_step"] > 0
    assert {"mamba/ssm", "mamba/conv", "attention/attend"} <= set(
        r["by_scope"]), sorted(r["by_scope"])
    assert abs(sum(r["by_scope"].values()) - r["ms_per_step"]) < 1e-6 * max(
        1.0, r["ms_per_step"])
  # A transformers config.json, whose Gated DeltaNet layers reach the
  # profile by scope.
  _tiny_qwen_config(tmp_path / "qwen.json")
  _run("decode_step_profile.py", "--config", str(tmp_path / "qwen.json"),
       "--batch", "2", "--prompt_len", "8", "--steps", "2", "--iters", "1",
       "--modes", "replay", "--out", str(out))
  scopes = json.loads(out.read_text())["modes"]["replay"]["by_scope"]
  assert {"gdn/ssm", "gdn/conv", "gdn/in_proj", "gdn/out_proj"} <= set(
      scopes), sorted(scopes)
  # A batched prefill, by block.
  _run("decode_step_profile.py", "--config", "configs/tiny.py", "--batch",
       "2", "--prompt_len", "16", "--iters", "1", "--modes", "replay",
       "--part", "prefill", "--out", str(out))
  r = json.loads(out.read_text())["modes"]["replay"]
  assert r["ms_per_step"] > 0 and {"mamba (rest)", "attention (rest)"} <= set(
      r["by_scope"]), sorted(r["by_scope"])
  # The serving pool's dispatch, by the same scopes, at a set KV length.
  _run("decode_step_profile.py", "--config", "configs/tiny.py", "--batch",
       "2", "--prompt_len", "8", "--steps", "2", "--iters", "1", "--modes",
       "replay", "--part", "pool", "--max_len", "64", "--out", str(out))
  res = json.loads(out.read_text())
  r = res["modes"]["replay"]
  assert res["max_len"] == 64 and r["ms_per_step"] > 0
  assert {"mamba/ssm", "attention/attend"} <= set(r["by_scope"]), sorted(
      r["by_scope"])
  out = tmp_path / "am.json"
  _run("attend_micro.py", "--batch", "2", "--max_len", "16", "--sets", "1",
       "--iters", "1", "--variants", "default,split64", "--out", str(out))
  forms = json.loads(out.read_text())["forms"]
  assert sorted(forms) == sorted(
      f"{f}/{r}" for f in ("xla_f32", "reference", "pallas:default",
                           "pallas:split64") for r in ("ragged", "full"))
  for name, f in forms.items():
    # bf16 output rounding (2^-8 relative).
    assert f["max_err_rel_to_max"] < 8e-3, (name, f)
  _run("attend_micro.py", "--batch", "2", "--max_len", "16", "--sets", "1",
       "--iters", "1", "--window", "4", "--variants", "default", "--out",
       str(out))
  res = json.loads(out.read_text())
  assert res["shapes"]["window"] == 4 and len(res["forms"]) == 6
  for name, f in res["forms"].items():
    assert f["max_err_rel_to_max"] < 8e-3, (name, f)


def test_conv_ring_check_tiny(tmp_path):
  """The script times both conv forms, and they decode the same greedy
  tokens (the copy census is a GPU figure: at this size every array is
  under its 1 MiB threshold)."""
  out = tmp_path / "conv_ring.json"
  _run("conv_ring_check.py", "--config", "configs/tiny.py", "--batch", "4",
       "--new_tokens", "2", "--repeats", "1", "--prompt_len", "8",
       "--modes", "replay", "--out", str(out))
  rows = json.loads(out.read_text())["rows"]
  assert [r["form"] for r in rows] == ["shift", "ring"]
  for r in rows:
    assert r["ms_per_step"] > 0 and r["last_tokens_equal_shift"] is True, r


def test_compare_trees_kernels_small():
  # The kernel half of the side-by-side timing, at a tiny size on this
  # tree: every figure is present and positive.
  out = _run("compare_trees.py", "--mode=kernels", "--small").stdout
  line = [x for x in out.splitlines() if x.startswith("TIMES ")]
  times = json.loads(line[0][len("TIMES "):])
  names = {f"baseline_{d}_us" for d in ("f32", "f16")} | {
      f"replay_{d}_{fill}_us" for d in ("f32", "f16", "f16+fp8")
      for fill in ("staggered", "aligned")}
  assert set(times) == names
  assert all(v > 0 for v in times.values())


@pytest.mark.parametrize("hf_config", ["nemotron3_nano_30b_a3b.json",
                                       "qwen3_5_4b_text.json"])
def test_random_weight_decode_small(tmp_path, hf_config):
  # The published config loads; the decode-step loop and the generate /
  # speculative_generate runs go on a shrunk model in both SSM modes (the
  # GDN model's step also with an f32 master + fp8 read copy state, its
  # speculative runs' replay states with a bf16 copy, their batch compacted
  # as rows finish, at window 3).
  out = tmp_path / "decode.json"
  copy = (["--precisions=f32+fp8", "--spec_precision=f32+bf16",
           "--spec_compactions=1", "--spec_windows=3"]
          if hf_config.startswith("qwen") else [])
  _run("random_weight_decode.py", "--small", "--batches=2",
       "--spec_batches=2", f"--hf_config=configs/{hf_config}", f"--out={out}",
       *copy)
  res = json.loads(out.read_text())
  steps = [("step", 2, "baseline"), ("step", 2, "replay")] + (
      [("step", 2, "replay")] if copy else [])
  assert [(r["part"], r["batch"], r["mode"]) for r in res["records"]] == (
      steps + [("spec", 2, "plain"), ("spec", 2, "plain_baseline"),
               ("spec", 2, "replay"), ("spec", 2, "baseline")])
  step = [r for r in res["records"] if r["part"] == "step"]
  assert all(r["step_us"] > 0 and r["state_bytes"] > 0 for r in step)
  if copy:  # the read copy adds its bytes to the f32 master's
    assert step[2]["precision"] == "f32+fp8"
    assert step[2]["state_bytes"] > step[1]["state_bytes"]
  assert all(r["e2e_tokens_per_s"] > 0 and r["mean_accepted_length"] >= 1
             for r in res["records"] if r["part"] == "spec")
  if copy:
    assert res["spec_settings"]["precision"] == "f32+bf16"
    assert [r["precision"] for r in res["records"] if r["part"] == "spec"] == [
        "f32+bf16", None, "f32+bf16", None]
    assert [r["compaction"] for r in res["records"][-2:]] == [1, 1]
    assert [r["window"] for r in res["records"][-2:]] == [3, 3]


def test_pool_occupancy_bench_small(tmp_path):
  # The gathered and in-place dispatches' tokens and active rows equal the
  # dense dispatch's (f32 tiny model) before any is timed.
  out = tmp_path / "pool.json"
  _run("pool_occupancy_bench.py", "--small", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [(r["mode"], r["active"]) for r in recs] == [
      (m, n) for m in ("replay", "baseline") for n in (2, 8)]
  for r in recs:
    for form in ("gathered", "in_place"):
      assert r[f"{form}_tokens_equal"] == 1.0, r
      assert r[f"{form}_state_rel_err"] < tolerance(jnp.float32).rtol, r
    assert min(r[f"{form}_us_per_step"] for form in (
        "dense", "gathered", "in_place", "steps")) > 0


def test_pool_occupancy_bench_gdn_model(tmp_path):
  # A Gated DeltaNet model (the Qwen3.5 parity fixture's config): the
  # in-place dispatch steps its GDN layers through their slots.
  out = tmp_path / "pool_gdn.json"
  _run("pool_occupancy_bench.py",
       "--hf_config=tests/fixtures/hf/qwen3_5/config.json", "--capacity=8",
       "--occupancies=2", "--max_len=64", "--prompt_len=8", "--repeats=1",
       "--modes=replay", f"--out={out}")
  (rec,) = json.loads(out.read_text())["records"]
  assert rec["in_place_tokens_equal"] == 1.0, rec
  assert rec["in_place_state_rel_err"] < tolerance(jnp.float32).rtol, rec


def test_prefix_ttft_bench_small(tmp_path):
  # Every hit's first token is insert's, its logits within f32 rounding,
  # and each cached fraction timed once.
  out = tmp_path / "prefix.json"
  _run("prefix_ttft_bench.py", "--small", f"--out={out}")
  res = json.loads(out.read_text())
  recs = res["records"]
  assert [r["mode"] for r in recs] == ["replay", "baseline"]
  for r in recs:
    assert [h["cached_tokens"] for h in r["hits"]] == [16, 32, 48, 56]
    assert min(r["insert_ms"], r["miss_ms"]) > 0
    for h in r["hits"]:
      # the filling miss; the check's, the warm-up's and the timed hits
      assert h["first_token_equal"] and (h["hits"], h["misses"]) == (
          res["repeats"] + 2, 1), h
      assert h["entries"] == 1, h  # the prefix only: no hit extended it
      assert h["logits_rel_err"] < tolerance(jnp.float32).rtol, h
      assert min(h["ms"], h["rest_ms"]) > 0 and h["ideal_ms"] < r["insert_ms"]
    b = r["batch_hits"]  # 2 slots in the small run
    assert b["first_tokens_equal"] and (b["prompts"], b["cached_tokens"]) == (
        2, 56), b
    assert min(b["one_at_a_time_ms"], b["batched_ms"]) > 0


def test_admission_profile_small(tmp_path):
  # Both engines (without and with a cache) are profiled; with the cache
  # every request after the first of each prefix hits.
  out = tmp_path / "admission.json"
  _run("admission_profile.py", "--small", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [(r["mode"], r["prefix_cache"]) for r in recs] == [
      ("replay", False), ("replay", True)]
  for r in recs:
    assert r["admissions"] == 6 and r["admit_ms_per_request"] > 0, r
    assert r["own_time"] and all(t["own_ms"] >= 0 for t in r["own_time"])
  assert recs[1]["cache"]["hits"] >= 6, recs[1]["cache"]


def test_moe_dispatch_small(tmp_path):
  # Every dispatch agrees with the dense reference; an imbalanced router
  # (bias std 0.5) gives a largest group beyond the capacity, which the
  # capacity dispatch covers in more rounds.
  out = tmp_path / "moe.json"
  _run("moe_dispatch.py", "--small", "--tokens=1,64",
       "--router_bias_std=0.5", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [(r["tokens"], r["dispatch"]) for r in recs] == [
      (n, d) for n in (1, 64) for d in ("gather", "capacity", "sorted")]
  tol = tolerance(jnp.bfloat16).rtol  # bf16 weights and hidden states
  assert all(r["rel_error"] < tol and r["us_per_layer"] > 0 for r in recs)
  assert recs[-1]["largest_group"] > recs[-1]["capacity"]


def test_gdn_kernels_check_small(tmp_path):
  # The GDN kernels' device check runs every op in interpret mode and
  # finds them equal to the references.
  out = tmp_path / "gdn.json"
  _run("gdn_kernels_check.py", "--small", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [r["op"] for r in recs] == ["gdn_step", "gdn_replay_step",
                                     "gdn_replay_verify"]
  tol = tolerance(jnp.float32).rtol
  for r in recs:
    assert "error" not in r, r
    assert r["output_rel_error"] < tol and r["state_rel_error"] < tol, r


def test_gdn_kernel_bench_small(tmp_path):
  # Each variant is checked against the reference before it is timed; a
  # config a read copy cannot take is recorded as an error by name, and
  # the run goes on; a replay-only field (ring_weights) times the replay
  # step only, beside the defaults.
  out = tmp_path / "gdn_bench.json"
  _run("gdn_kernel_bench.py", "--small", "--batches=2", "--no_fla",
       "--checkpoints=f32", "--policies=f16+fp8", "--layouts=staggered",
       '--configs=[{}, {"block_v": 8}, {"ring_weights": true}]',
       f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  timed = [r for r in recs if "us_per_step" in r]
  assert {(r["variant"], r["precision"], bool(r.get("config")))
          for r in timed} == {
              ("baseline_pallas", "f32", False), ("baseline_pallas", "f32", True),
              ("baseline_xla", "f32", False), ("replay_pallas", "f32", False),
              ("replay_pallas", "f16+fp8", False),
              ("replay_pallas", "f32", True),
              ("replay_pallas", "f16+fp8", True)}
  tol = tolerance(jnp.bfloat16).rtol  # bf16 inputs and rings
  assert all(r["us_per_step"] > 0 and r["output_rel_error"] < tol
             and r["state_rel_error"] < tol for r in timed), timed
  errors = [r for r in recs if "error" in r]
  assert len(errors) == 1 and "block_v" in errors[0]["error"]
  assert sorted((r["variant"], r["precision"]) for r in timed
                if r.get("config") == {"ring_weights": True}) == [
                    ("replay_pallas", "f16+fp8"), ("replay_pallas", "f32")]
  assert (tmp_path / "gdn_bench.md").read_text().count("| replay_pallas") == 5


def test_gdn_verify_bench_small(tmp_path):
  # Verify + commit iterations of every variant, each checked against the
  # reference first (the read copy's window launch in value tiles too); a
  # launch field the verify refuses is recorded by name.
  out = tmp_path / "verify.json"
  _run("gdn_verify_bench.py", "--small", "--precisions=f32,f16+fp8",
       '--configs=[{}, {"block_v": 8}, {"split_routes": true}]',
       f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  timed = [r for r in recs if "us_per_iteration" in r]
  assert sorted((r["variant"], r["precision"], bool(r.get("config")))
                for r in timed) == [
                    ("snapshot", "f32", False),
                    ("verify_pallas", "f16+fp8", False),
                    ("verify_pallas", "f16+fp8", True),
                    ("verify_pallas", "f32", False),
                    ("verify_pallas", "f32", True),
                    ("verify_xla", "f32", False)]
  tol = tolerance(jnp.bfloat16).rtol  # bf16 window inputs, rings, outputs
  assert all(r["us_per_iteration"] > 0 and r["output_rel_error"] < tol
             and r["state_rel_error"] < tol for r in timed), timed
  errors = [r for r in recs if "error" in r]
  assert len(errors) == 2 and all("split_routes" in r["error"]
                                  for r in errors)


def test_mlp_gemm_micro_small(tmp_path):
  # Both forms of the SwiGLU MLP (gate / up as two weights, or packed)
  # compute the same function of the same weights, within bf16 rounding.
  out = tmp_path / "mlp.json"
  _run("mlp_gemm_micro.py", "--small", "--rows=4", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [r["form"] for r in recs] == ["separate", "packed"]
  tol = tolerance(jnp.bfloat16).rtol
  # (The times are differences of loop times: on a busy CPU one may come
  # out negative, so only their presence is checked.)
  assert all(0 < r["rel_error"] < tol and np.isfinite(r["us_per_mlp"])
             for r in recs), recs


def test_gdn_readout_layout_small(tmp_path):
  # Both layouts' Pallas readouts (interpret mode) and XLA's equal the f32
  # einsum of the [K, V] state: the transposed copy is the same state.
  out = tmp_path / "readout.json"
  _run("gdn_readout_layout.py", "--small", "--dtypes=float32",
       "--configs=64:4,32:2", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert sorted({r["form"] for r in recs}) == [
      "pallas_kv", "pallas_vk", "plain_read", "xla_kv", "xla_vk"]
  checked = [r for r in recs if r["form"] != "plain_read"]
  assert len(checked) == 6
  tol = tolerance(jnp.float32).rtol
  assert all("error" not in r and r["rel_error"] < tol for r in checked), recs


def test_prefill_scan_cost_small(tmp_path):
  # Both scans' cost analysis and timing at a short sequence.
  out = tmp_path / "cost.json"
  _run("prefill_scan_cost.py", "--seq_len=32", "--repeats=1",
       "--precisions=BF16_BF16_F32_X3", f"--out={out}")
  res = json.loads(out.read_text())
  for op in ("ssd_chunked_scan", "gdn_chunked_prefill"):
    assert res[op]["gflop"] > 0 and res[op]["ms"] > 0, res
  # Three bf16 passes: about f32's error (bounded here at bf16's).
  for op in ("ssd_chunked_scan", "gdn_chunked_prefill"):
    x3 = res[op]["precisions"]["BF16_BF16_F32_X3"]
    assert x3["ms"] > 0 and x3["y_rel_err"] < 2 ** -8, x3


def test_prefill_scan_cost_backward_and_solves(tmp_path):
  # The gradients a training step takes, the GDN chunks solved both ways:
  # the inverse's within bf16's rounding of the substitution's (the inputs
  # and so their gradients are bf16).
  out = tmp_path / "cost.json"
  _run("prefill_scan_cost.py", "--seq_len=16", "--repeats=1", "--batch=2",
       "--backward", "--gdn_solves=inverse", f"--out={out}")
  res = json.loads(out.read_text())
  assert "--backward" in res["command"]
  inv = res["gdn_chunked_prefill"]["variants"]["solve=inverse"]
  assert inv["ms"] > 0 and inv["y_rel_err"] < 2 ** -8, inv
  assert inv["state_rel_err"] < 2 ** -8, inv


def test_dispatch_sync_small(tmp_path):
  # Every path is timed and its programs' loops read from XLA's dumps:
  # neither the decode step nor a hit's continued prefill
  # (the cached attention's loop over key blocks) has a loop of unknown
  # trip count.
  out = tmp_path / "dispatch_sync.json"
  _run("dispatch_sync.py", "--small", "--modes=replay", f"--out={out}")
  recs = json.loads(out.read_text())["records"]
  assert [r["path"] for r in recs] == [
      "insert_8", "insert_64", "hit_8", "hits_8x8", "step_1", "moe_step_1"]
  for r in recs:
    assert r["idle_host_ms"] > 0 and r["behind_busy_host_ms"] > 0, r
  hlo = {r["path"]: r["hlo"] for r in recs}
  assert all(h["programs"] >= 1 for h in hlo.values()), hlo
  for path in ("step_1", "hit_8", "hits_8x8"):
    assert hlo[path]["whiles_unknown"] == 0, hlo
