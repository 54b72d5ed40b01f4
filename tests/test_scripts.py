"""The GPU diagnostic scripts of benchmarks/scripts/ run end to end at tiny
size on the CPU (interpret mode), so a device call is not the first run."""

import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, path=ROOT, check=True):
  env = dict(os.environ, PYTHONPATH=path)
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "scripts", script),
       *args], check=check, cwd=ROOT, env=env, timeout=600,
      capture_output=True, text=True)


def test_output_split_tiny(tmp_path):
  """The non-flush step's op split: each variant checked against the
  reference on an f16 master + fp8 copy state, then traced."""
  out = tmp_path / "output_split.json"
  _run("output_split.py", "--tiny", "--buffer_len", "4", "--fill", "1",
       "--variants", "default,dot,xw_dot,split_h2,reference", "--out",
       str(out))
  res = json.loads(out.read_text())
  assert res["shape"]["policy"] == "f16+fp8"
  assert list(res["variants"]) == ["default", "dot", "xw_dot", "split_h2",
                                   "reference"]
  for name, r in res["variants"].items():
    assert r["check"] == "PASS", (name, r.get("error"))
    assert r["device_us_per_step"] > 0 and r["top"]
  # A variant's kernel launch reaches the module (and is reset after it).
  assert res["variants"]["split_h2"]["window_launch"]["heads"] == 2
  assert res["variants"]["reference"]["window_launch"]["heads"] is None


def test_readout_probe_tiny(tmp_path):
  """The bare readouts (Triton, Mosaic GPU in interpret mode) checked
  against an f32 einsum, then traced."""
  out = tmp_path / "readout_probe.json"
  _run("readout_probe.py", "--tiny", "--dtypes", "float8_e4m3fn",
       "--mosaic", "2x2", "--out", str(out))
  runs = json.loads(out.read_text())["runs"]
  assert set(runs) == {f"float8_e4m3fn:{v}"
                       for v in ("triton_w2", "triton_w4", "mosaic_2x2")}
  for name, r in runs.items():
    assert "error" not in r, (name, r.get("error"))
    assert r["max_rel_err"] < 1e-5 and r["us_per_call"] > 0, name


def test_verify_sweep_tiny(tmp_path):
  """With an f32 master + fp8 copy state (--policy), the window kernel's
  masked and branching copy readouts checked against the reference."""
  out = tmp_path / "verify_sweep.json"
  _run("verify_sweep.py", "--tiny", "--policy", "f32+fp8", "--variants",
       "default,copy_branch,bc_reduce,reference", "--out", str(out))
  res = json.loads(out.read_text())
  assert res["shape"]["policy"] == "f32+fp8"
  assert set(res["variants"]) == {"default", "copy_branch", "bc_reduce",
                                  "reference"}
  assert res["variants"]["reference"]["implementation"] == "reference"
  for name, r in res["variants"].items():
    assert r["check"] == "PASS", (name, r.get("error"))
    assert r["device_ms_per_iter"] > 0 and r["top"]
  # verify_pick: the fields of the fastest passing kernel variant (the
  # reference op is no candidate).
  kernels = {n: r for n, r in res["variants"].items() if n != "reference"}
  fastest = min(kernels, key=lambda n: kernels[n]["device_ms_per_iter"])
  picked = _run("verify_pick.py", str(out)).stdout
  assert json.loads(picked) == kernels[fastest]["config"]


def test_with_config(tmp_path):
  """with_config.py runs a module with the dispatcher's VerifyConfig
  defaults replaced (its arguments passed on), and refuses a bad field or
  class before running anything."""
  (tmp_path / "report_config.py").write_text(
      "import sys\nimport pallas_kernels as pk\n"
      "c = pk.VerifyConfig()\n"
      "open(sys.argv[1], 'w').write(f'{c.readout_chunk} {c.precompute}')\n")
  path = os.pathsep.join([ROOT, str(tmp_path)])
  out = tmp_path / "seen.txt"
  _run("with_config.py", "VerifyConfig", '{"readout_chunk": 64}',
       "report_config", str(out), path=path)
  assert out.read_text() == "64 terms_reduce"
  bad = _run("with_config.py", "VerifyConfig", '{"readout_chunk": 24}',
             "report_config", str(out), path=path, check=False)
  assert bad.returncode != 0 and "readout_chunk must be a power" in bad.stderr
  bad = _run("with_config.py", "NoConfig", "{}", "report_config", str(out),
             path=path, check=False)
  assert bad.returncode != 0 and "no config class 'NoConfig'" in bad.stderr


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
      config=pk.VerifyConfig(max_registers=96))
  assert set(verify) == {"replayssm_verify_fold",
                         "replayssm_verify_window__maxnreg96"}
  for text in verify.values():
    assert "tt.func public @replayssm_verify" in text


def test_readout_micro_interpret(tmp_path):
  _run("readout_micro.py", "--interpret", "--batch", "2", "--out",
       str(tmp_path))
  res = json.loads((tmp_path / "readout_micro.json").read_text())
  forms = {r["form"] for r in res["rows"]}
  assert {"xla", "xla_sum_u32", "elementwise", "dot_fp8", "dot_f16"} <= forms
  for r in res["rows"]:
    assert "error" not in r, r
    if r["form"] != "xla_sum_u32":  # (a plain read: no result to check)
      # Every readout form against the f32 einsum: the fp8 pieces of C
      # carry its bf16 values whole, so only f32 summation order differs.
      assert r["max_rel_err"] < 1e-5, r


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
