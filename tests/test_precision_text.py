"""The real-text precision study on the committed fixture models
(configs/precision_text.py:fixture; tests/fixtures/text_models: a Mamba-2
and a Gated DeltaNet hybrid of about 190K parameters trained on the
real-text corpus, scored on its committed excerpt, tests/fixtures/
text_corpus): the outputs exist and are sane. Then the merge of study
workdirs, the configs and the fixtures' rebuild records."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")
pytest.importorskip("orbax.checkpoint")

from configs import precision_text  # noqa: E402
from configs import train_text  # noqa: E402
from experiments import common  # noqa: E402
from experiments import precision_accuracy  # noqa: E402
from experiments.precision_lib import runs as R  # noqa: E402
from replayssm_jax import tasks  # noqa: E402
from replayssm_jax import text_corpus as TC  # noqa: E402
from replayssm_jax.models import ModelConfig  # noqa: E402
from replayssm_jax.precision import PrecisionPolicy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIXTURES = os.path.join(ROOT, precision_text.FIXTURES)
NAMES = ("fixture", "gdn_fixture")
# f32 replay vs the f32 baseline decode: the same math, summed in another
# order (checkpoint + buffer vs the running state).
F32_REL_PPL = 1e-5


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  """The fixture study, run as the command line runs it (a fresh process:
  GDN on the CPU backend wants its process pinned before jax starts, see
  experiments.common.avoid_cpu_lapack_stall)."""
  workdir = str(tmp_path_factory.mktemp("precision_text") / "study")
  r = subprocess.run(
      [sys.executable, "-m", "experiments.precision_accuracy",
       "--config=configs/precision_text.py:fixture", f"--workdir={workdir}"],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-4000:]
  return workdir, common.read_metrics(os.path.join(workdir,
                                                   "metrics.jsonl"))


def test_fixture_study_outputs(study):
  workdir, records = study
  config = precision_text.get_config("fixture")
  for f in ("config.json", "metrics.jsonl", "summary.md"):
    assert os.path.getsize(os.path.join(workdir, f)) > 0, f
  for f in ("accuracy_delta.png", "perplexity.png", "distance.png",
            "generation.png", "state_error.png"):
    with open(os.path.join(workdir, f), "rb") as fh:
      assert fh.read(8) == PNG_MAGIC, f
  assert records[0]["kind"] == "environment"
  assert records[-1]["kind"] == "final"
  models = {r["model"]: r for r in records if r["kind"] == "model"}
  assert set(models) == set(NAMES)
  assert models["fixture"]["pattern"] == "M-M-M*-"
  assert models["gdn_fixture"]["pattern"] == "G-G-G*-"
  assert {m["dtype"] for m in models.values()} == {"float32"}
  for name in NAMES:
    mine = [r for r in records if r.get("model") == name]
    assert models[name]["recipe"]["corpus_sha256"] == (
        train_text.CORPUS_SHA256)
    ref = next(r for r in mine if r["kind"] == "reference")
    # Trained: far below the uniform byte's perplexity of 256.
    assert ref["perplexity"] < 12.0, ref
    assert ref["decode_steps"] == 127
    replay = {(r["policy"], r["L"]): r for r in mine if r["kind"] == "replay"}
    assert set(replay) == {(p, 8) for p in config.policies}
    f32 = replay[("f32", 8)]
    assert abs(f32["rel_perplexity"]) < F32_REL_PPL, f32
    assert f32["within_ppl"] and f32["agreement"] == 1.0
    dual = replay[("f32+bf16", 8)]
    assert dual["within_ppl"] == (abs(dual["rel_perplexity"])
                                  <= config.ppl_tolerance)
    assert dual["max_rel_logit_diff"] > 0  # the bf16 copy is read
    base = {r["label"]: r for r in mine if r["kind"] == "baseline"}
    assert set(base) == {"bf16+rn", "int8+sr"}
    for r in list(replay.values()) + list(base.values()):
      assert np.isfinite(r["perplexity"]) and r["nonfinite_logits"] == 0
      assert 0.0 <= r["agreement"] <= 1.0
    gen = [r for r in mine if r["kind"] == "generation"]
    assert {(r["mode"], r["label"], r["L"]) for r in gen} == {
        ("greedy", "f32", 8)}
    # f32 replay generates the f32 baseline's tokens.
    assert gen[0]["never_diverged"] == 1.0
    for r in gen:
      assert 0.0 <= r["agreement"] <= 1.0 and r["new_tokens"] == 48
      assert (r["first_divergence_min"] <= r["first_divergence_median"]
              <= r["new_tokens"])
    stream = next(r for r in mine if r["kind"] == "state_error_stream")
    # The recording loop runs the model's decode step.
    assert stream["capture_max_logit_diff"] < 1e-4, stream
    se = {(r["run_kind"], r["label"]): r for r in mine
          if r["kind"] == "state_error"}
    assert set(se) == {("baseline", "f32+rn"), ("replay", "f32+bf16"),
                       ("baseline", "bf16+rn"), ("baseline", "int8+sr")}
    floor = se[("baseline", "f32+rn")]
    assert floor["steps"] == 95 and floor["points"][-1] == 95
    assert floor["peak_state_max_rel"] < 1e-5, floor
    for r in se.values():
      assert all(np.isfinite(r["state_max_rel"]))
    # A bf16 state stored every step errs more than the f32 one; the f32
    # master of f32+bf16 stays near the floor while its outputs, read from
    # the bf16 copy between flushes, err more than the floor's.
    bf16 = se[("baseline", "bf16+rn")]
    copy = se[("replay", "f32+bf16")]
    assert floor["peak_state_max_rel"] < bf16["peak_state_max_rel"] < 1e-1
    assert copy["peak_state_max_rel"] < bf16["peak_state_max_rel"]
    assert floor["max_out_rel"] < copy["max_out_rel"] < 1e-1
    # An int8 state stored every step errs more than a bf16 one.
    assert (bf16["peak_state_max_rel"]
            < se[("baseline", "int8+sr")]["peak_state_max_rel"] < 1.0)
  with open(os.path.join(workdir, "summary.md")) as f:
    summary = f.read()
  for heading in ("## Targets", "## Long generation",
                  "## State error against float64", "## All runs"):
    assert heading in summary, heading
  assert "| policy | L=8 | baseline (every step) |" in summary
  assert "not supported" not in summary


def test_merge_reports_the_same_records(study, tmp_path):
  workdir, records = study
  config = precision_text.get_config("fixture")
  config.merge_workdirs = (workdir,)
  out = precision_accuracy.run(config, str(tmp_path / "merged"))
  kinds = [r["kind"] for r in records if r["kind"] not in (
      "environment", "final", "model")]
  assert [r["kind"] for r in out["records"]] == kinds
  with open(os.path.join(workdir, "summary.md")) as f:
    want = f.read()
  with open(os.path.join(out["workdir"], "summary.md")) as f:
    assert f.read() == want


def test_merge_of_slices(study, tmp_path):
  """The study's records split as two preset slices write them (each with
  the references and its own model records) merge into the same
  records."""
  workdir, records = study
  body = [r for r in records if r["kind"] not in ("environment", "final",
                                                  "model")]
  models = [r for r in records if r["kind"] == "model"]
  slices = []
  for i in range(2):
    mine = [r for j, r in enumerate(body)
            if r["kind"] == "reference" or j % 2 == i]
    wd = tmp_path / f"part{i}"
    wd.mkdir()
    with open(wd / "metrics.jsonl", "w") as f:
      for r in models + mine:
        f.write(json.dumps(r) + "\n")
    slices.append(str(wd))
  config = precision_text.get_config("fixture")
  config.merge_workdirs = tuple(slices)
  out = precision_accuracy.run(config, str(tmp_path / "merged"))
  assert sorted(json.dumps(r, sort_keys=True) for r in out["records"]) == (
      sorted(json.dumps(r, sort_keys=True) for r in body))
  assert out["models"] == models


def _untimed(r):
  return {k: v for k, v in r.items() if not k.endswith("_s")}


def test_resume_runs_only_what_is_missing(study, tmp_path):
  """A study stopped short (its metrics.jsonl missing a score, a generation
  and a state-error record) and run again with resume: the records it had
  are kept as they were, the missing ones come back equal to the
  uninterrupted run's, and a resume under another config is refused."""
  workdir, records = study
  body = [r for r in records if r["kind"] not in ("environment", "final")]
  drop = {max(i for i, r in enumerate(body) if r["kind"] == kind)
          for kind in ("replay", "generation", "state_error")}
  cut = tmp_path / "cut"
  cut.mkdir()
  shutil.copy(os.path.join(workdir, "config.json"), cut / "config.json")
  with open(cut / "metrics.jsonl", "w") as f:
    for i, r in enumerate(body):
      if i not in drop:
        f.write(json.dumps(r) + "\n")
  r = subprocess.run(
      [sys.executable, "-m", "experiments.precision_accuracy",
       "--config=configs/precision_text.py:fixture", f"--workdir={cut}",
       "--config.resume=True"],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=False,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"))
  assert r.returncode == 0, r.stderr[-4000:]
  # One model: the generation stage's greedy reference, and the state-error
  # stage's stream (its own prompts and length).
  assert r.stderr.count("greedy reference generation: 2 x 48") == 1
  assert r.stderr.count("reference generation") == 2
  got = [x for x in common.read_metrics(str(cut / "metrics.jsonl"))
         if x["kind"] not in ("environment", "final")]
  kept = [x for i, x in enumerate(body)
          if i not in drop and x["kind"] != "model"]
  assert [x for x in got if x in kept] == kept  # as they were, timings too
  key = lambda x: json.dumps(_untimed(x), sort_keys=True)  # noqa: E731
  assert sorted(map(key, got)) == sorted(map(key, body))
  config = precision_text.get_config("fixture")
  config.resume = True
  config.eval_batches = 2
  with pytest.raises(ValueError, match="eval_batches"):
    precision_accuracy._previous_records(config, str(cut))  # pylint: disable=protected-access


def test_fixture_files_and_rebuild_record():
  """The committed fixtures: small, trained on the pinned corpus, scored
  on an excerpt of it; their metrics.jsonl records how to rebuild them."""
  total = 0
  for dirpath, _, files in os.walk(FIXTURES):
    total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
  corpus = os.path.join(ROOT, precision_text.FIXTURE_CORPUS)
  for f in os.listdir(corpus):
    total += os.path.getsize(os.path.join(corpus, f))
  assert total < 2_200_000, total
  assert TC.lineage(corpus)[1] == train_text.CORPUS_SHA256
  TC.load_corpus(corpus)  # sizes and hashes as its manifest says
  counts = train_text.param_counts()
  for name in NAMES:
    d = os.path.join(FIXTURES, name)
    with open(os.path.join(d, "task.json")) as f:
      assert json.load(f)["corpus_sha256"] == train_text.CORPUS_SHA256
    with open(os.path.join(d, "tokenizer.json")) as f:
      assert TC.ByteTokenizer.from_dict(json.load(f)) == TC.ByteTokenizer()
    final = common.read_metrics(os.path.join(d, "metrics.jsonl"))[-1]
    assert final["kind"] == "final"
    recipe = final["recipe"]
    assert (recipe["config_file"], recipe["config_arg"], recipe["seed"]) == (
        "configs/train_text.py", name, 0)
    assert recipe["num_params"] == counts[name] == final["num_params"]
    with open(os.path.join(d, "config.json")) as f:
      # The same model (fields the fixture's config.json predates take
      # their defaults).
      assert ModelConfig(**json.load(f)["model"]) == ModelConfig(
          **train_text.get_config(name).model.to_dict())


def test_model_overrides():
  """A study entry's model_overrides load the trained parameters into
  another compute dtype; fields that would change the parameters are
  refused by name."""
  path = os.path.join(FIXTURES, "fixture")
  entry = precision_accuracy.model_entry(precision_text.text_model(
      "fixture@bf16", 64, path, precision_text.FIXTURE_CORPUS,
      model_overrides={"dtype": "bfloat16"}))
  low, task, _ = precision_accuracy.load_model(entry, "", False)
  ref, _, _ = precision_accuracy.load_model(
      precision_accuracy.model_entry(precision_text.text_model(
          "fixture", 64, path, precision_text.FIXTURE_CORPUS)), "", False)
  assert (low.config.dtype, ref.config.dtype) == ("bfloat16", "float32")
  jax.tree.map(np.testing.assert_array_equal, nnx.state(low, nnx.Param),
               nnx.state(ref, nnx.Param))
  inputs = task.eval_batches(1, 2)[0]["inputs"]
  a = np.asarray(tasks.forward_logits(low, inputs), np.float32)
  b = np.asarray(tasks.forward_logits(ref, inputs), np.float32)
  assert not np.array_equal(a, b)  # bf16 activations round
  np.testing.assert_allclose(a, b, atol=0.25)
  bad = precision_accuracy.model_entry(precision_text.text_model(
      "fixture", 64, path, precision_text.FIXTURE_CORPUS,
      model_overrides={"d_model": 32}))
  with pytest.raises(ValueError, match="model_overrides.*d_model"):
    precision_accuracy.load_model(bad, "", False)


def test_text_configs():
  assert "python -m experiments.precision_accuracy" in precision_text.__doc__
  all_ = precision_text.get_config("all")
  assert len(all_.models) == 8 and all_.buffer_lens == (8, 16, 32)
  for m in all_.models:
    assert m["train_config_file"] == "train_text"
    assert m["eval_seq_len"] == 1024
    assert m["workdir"] == f"runs/train_text/{m['train_config']}"
  assert set(all_.policies) == set(PrecisionPolicy.preset_names())
  for bad in ("mamba2_s1b", "fixture@f32", "gdn_s20m@bf16"):
    with pytest.raises(ValueError, match="config arg"):
      precision_text.get_config(bad)
  f32 = precision_text.get_config("gdn_s60m@f32")
  (m,) = f32.models
  assert m["name"] == "gdn_s60m@f32" and m["train_config"] == "gdn_s60m"
  assert m["workdir"] == "runs/train_text/gdn_s60m"
  assert m["model_overrides"] == {"dtype": "float32"}
  assert f32.stages == ("scores", "generation") and f32.buffer_lens == (16,)
  assert f32.generation.modes == ("greedy",)
  assert f32.policies[0] == "f32" and all(
      PrecisionPolicy.preset(p).checkpoint_dtype in ("bfloat16", "float16")
      for p in f32.policies[1:])
  # A slice stopped by its limit has scored the L the other stages read
  # and the every-step baselines before the other L.
  order = [(r.kind, r.L) for r in R.score_runs(
      precision_text.get_config("mamba2_s300m"))]
  n = len(all_.policies)
  assert order[:n] == [("replay", 16)] * n
  assert {k for k, _ in order[n:-2 * n]} == {"baseline"}
  assert sorted(order[-2 * n:]) == [("replay", 8)] * n + [("replay", 32)] * n
  counts = train_text.param_counts()
  for name, n in counts.items():
    # The docstring's table holds the exact counts.
    assert f"{n:,}" in train_text.__doc__, name
  for family in train_text.FAMILIES:
    sizes = [counts[f"{family}_{s}"] for s in train_text.SIZES]
    assert sizes == sorted(sizes)
    assert 15e6 < sizes[0] < 25e6 and 250e6 < sizes[-1] < 320e6
    c = train_text.get_config(f"{family}_s300m")
    assert c.train.resume and c.task.corpus_sha256 == (
        train_text.CORPUS_SHA256)
    assert c.train.token_budget == (c.train.num_steps * c.train.batch_size
                                    * c.task.seq_len)


def test_text_study_script_on_the_fixtures(tmp_path):
  """benchmarks/scripts/text_precision.sh text_study (behind run_h200.sh
  text_study): the presets split over two processes, then merged."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", T="400",
             OUT=str(tmp_path / "out"), STUDY_DIR=str(tmp_path / "study"),
             STUDY_PROCS="2")
  r = subprocess.run(
      ["bash", "benchmarks/scripts/text_precision.sh", "text_study",
       "fixture", "scores"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=900, check=False)
  assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
  parts = sorted(os.listdir(tmp_path / "study" / "fixture" / "scores"))
  assert parts == ["part0of2", "part0of2.log", "part1of2", "part1of2.log"]
  records = common.read_metrics(str(tmp_path / "out" / "text_fixture" /
                                    "metrics.jsonl"))
  replay = {(r["model"], r["policy"]) for r in records
            if r["kind"] == "replay"}
  assert replay == {(m, p) for m in NAMES for p in ("f32", "f32+bf16")}
  refs = [r for r in records if r["kind"] == "reference"]
  assert len(refs) == 2  # one per model, though each slice ran one


def test_across_models_table_is_the_records(tmp_path):
  """benchmarks/scripts/text_precision_across.py on the committed studies:
  one row per model folder with a study, its worst replay perplexity
  change that of its records, the figure written, and benchmarks/README's
  copy of the table equal to the script's."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  studies = os.path.join(root, "benchmarks", "text_precision")
  subprocess.run(
      [sys.executable, os.path.join(root, "benchmarks", "scripts",
                                    "text_precision_across.py"),
       f"--studies={studies}", f"--out_dir={tmp_path}"],
      check=True, cwd=root, env=dict(os.environ, PYTHONPATH=root),
      capture_output=True, timeout=300)
  assert os.path.getsize(tmp_path / "across.png") > 10_000
  md = (tmp_path / "across.md").read_text()
  table = md[md.index("| model |"):].strip()
  rows = {line.split(" | ")[0].strip("| "): line
          for line in table.splitlines()[2:]}
  folders = [d for d in sorted(os.listdir(studies)) if os.path.exists(
      os.path.join(studies, d, "study", "metrics.jsonl"))]
  assert len(rows) == len(folders) >= 5
  for d in folders:
    recs = common.read_metrics(os.path.join(studies, d, "study",
                                            "metrics.jsonl"))
    name = next(r["model"] for r in recs if r["kind"] == "model")
    worst = max((r for r in recs if r["kind"] == "replay"),
                key=lambda r: abs(r["rel_perplexity"]))
    assert f"{100 * worst['rel_perplexity']:+.4f}% ({worst['policy']} " \
        f"L {worst['L']})" in rows[name], (name, rows[name])
  with open(os.path.join(root, "benchmarks", "README.md")) as f:
    assert table in f.read(), "benchmarks/README.md: rerun the script"
  with open(os.path.join(studies, "across.md")) as f:
    assert f.read() == md, "benchmarks/text_precision/across.md is stale"
