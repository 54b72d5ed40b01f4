"""Smoke run of experiments/precision_accuracy (CPU: trains a two-layer
pure Mamba-2 char model for 200 steps, then decodes under two policies x
two buffer lengths and the every-step baseline)."""

import os

import numpy as np
import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("matplotlib")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from configs import precision_accuracy as pa_config  # noqa: E402
from experiments import common  # noqa: E402
from experiments import precision_accuracy  # noqa: E402
from experiments.precision_lib import generation  # noqa: E402
from replayssm_jax import testing  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_config_args():
  full = pa_config.get_config()
  assert full.to_dict() == pa_config.get_config("").to_dict()
  assert [m["train_config"] for m in full.models] == [
      "mqar_small_ssm", "mqar_small_ssm", "char_small_ssm"]
  assert [m["eval_seq_len"] for m in full.models] == [0, 1024, 1024]
  assert [m["workdir"] for m in pa_config.get_config("large").models][0] == (
      "runs/train/mqar_large_ssm")
  assert pa_config.get_config("smoke").train_missing
  with pytest.raises(ValueError, match="smoke"):
    pa_config.get_config("bogus")
  assert "python -m experiments.precision_accuracy" in pa_config.__doc__
  # Every model the full config names is an SSM-only train variant.
  from configs import train as train_config  # pylint: disable=g-import-not-at-top
  for m in full.models:
    assert "*" not in train_config.get_config(
        m["train_config"]).model.pattern


def test_missing_model_and_bad_entries_raise(tmp_path):
  config = pa_config.get_config()
  config.models = [dict(name="absent", train_config="mqar_small_ssm",
                        workdir=str(tmp_path / "nowhere"))]
  with pytest.raises(FileNotFoundError,
                     match="configs/train.py:mqar_small_ssm"):
    precision_accuracy.run(config, str(tmp_path / "out"))
  config.models = [dict(name="x")]
  with pytest.raises(ValueError, match="train_config"):
    precision_accuracy.run(config, str(tmp_path / "out"))
  config.models = [dict(name="x", train_config="smoke_ssm")]
  config.policies = ("f32", "f64")
  with pytest.raises(ValueError, match="f64"):
    precision_accuracy.run(config, str(tmp_path / "out"))


def test_precision_accuracy_smoke(tmp_path):
  config = pa_config.get_config("smoke")
  workdir = str(tmp_path / "pa")
  out = precision_accuracy.run(config, workdir)
  for f in ("config.json", "metrics.jsonl", "summary.md"):
    assert os.path.exists(os.path.join(workdir, f)), f
  with open(os.path.join(workdir, "accuracy_delta.png"), "rb") as f:
    assert f.read(8) == PNG_MAGIC
  records = common.read_metrics(os.path.join(workdir, "metrics.jsonl"))
  assert records[0]["kind"] == "environment"
  assert records[-1]["kind"] == "final"
  ref = next(r for r in records if r["kind"] == "reference")
  replay = {(r["policy"], r["L"]): r for r in records
            if r["kind"] == "replay"}
  assert set(replay) == {(p, L) for p in config.policies
                         for L in config.buffer_lens}
  base = {r["label"]: r for r in records if r["kind"] == "baseline"}
  assert set(base) == {"int8+sr"}  # f32's every-step baseline = reference
  steps = config.models[0]["eval_seq_len"] - 1
  assert ref["decode_steps"] == steps and ref["num_targets"] > 0
  # The model learned something (chance: 1/77 characters).
  assert ref["accuracy"] > 0.2, ref
  for r in list(replay.values()) + list(base.values()):
    assert np.isfinite(r["loss"]) and r["nonfinite_logits"] == 0, r
    assert r["within"] == (abs(r["delta_accuracy_points"])
                           <= config.within_points)
    assert r["delta_accuracy_points"] == pytest.approx(
        100 * (r["accuracy"] - ref["accuracy"]))
  for L in config.buffer_lens:
    r = replay[("f32", L)]
    assert r["flushes_per_row"] == steps // L
    # f32 replay == the f32 baseline decode: the same greedy prediction at
    # every scored position, hence exactly the same accuracy; logits agree
    # to f32 association order.
    assert r["delta_accuracy_points"] == 0.0 and r["agreement"] == 1.0
    assert r["accuracy"] == ref["accuracy"]
    assert r["max_rel_logit_diff"] < testing.TOLERANCES["float32"].rtol
    # The int8 read copy is really read: its logits differ.
    int8 = replay[("f32+int8+sr", L)]
    assert int8["max_rel_logit_diff"] > 1e-4
    # Distances of the next-token distributions: bounded, the f32 replay's
    # at f32's rounding level, the int8 copy's larger.
    for x in (r, int8):
      assert 0.0 <= x["mean_tv"] <= x["max_tv"] <= 1.0, x
      assert x["mean_kl"] > -1e-6, x  # >= 0 but for rounding
    assert r["max_tv"] < testing.TOLERANCES["float32"].rtol
    assert int8["mean_tv"] > r["mean_tv"] and int8["mean_kl"] > r["mean_kl"]
  # Long generations (greedy and sampled) of every run against the f32
  # baseline's: in f32 the replay state generates the same tokens.
  g = config.generation
  gen = {(r["mode"], r["label"], r["L"]): r for r in records
         if r["kind"] == "generation"}
  runs = [(k[0], k[1]) for k in replay] + [("int8+sr", 1)]
  assert set(gen) == {(m, lbl, L) for m in g.modes for lbl, L in runs}
  for r in gen.values():
    assert r["rows"] == g.num_prompts and r["new_tokens"] == g.new_tokens
    assert 0.0 <= r["agreement"] <= 1.0
    assert (r["first_divergence_min"] <= r["first_divergence_median"]
            <= g.new_tokens)
  for L in config.buffer_lens:
    assert gen[("greedy", "f32", L)]["never_diverged"] == 1.0
    assert gen[("sampled", "f32", L)]["agreement"] == 1.0
  for (mode, _, _), r in gen.items():
    # The reference's top-2 margins (greedy runs): positive; where a run
    # left the reference, the margin there is recorded.
    assert ("ref_margin_median" in r) == (mode == "greedy")
    if mode == "greedy":
      assert r["ref_margin_median"] > 0
      diverged = r["never_diverged"] < 1.0
      assert (r["divergence_margin_median"] is not None) == diverged
      if diverged:
        assert 0 <= r["divergence_margin_median"] <= r[
            "divergence_margin_max"]
  with open(os.path.join(workdir, "summary.md")) as f:
    summary = f.read()
  assert "## Long generation" in summary
  assert "| policy | L=4 | L=8 | baseline (every step) |" in summary
  assert "| f32 | +0.00 (yes) | +0.00 (yes) | = reference |" in summary
  # The trained model is reused by a second run (no retraining).
  train_dir = out["models"][0]["train_workdir"]
  assert train_dir == os.path.join(workdir, "train", "char_smoke_ssm")
  mtime = os.path.getmtime(os.path.join(train_dir, "metrics.jsonl"))
  # ... here running f32's replay rows and int8+sr's every-step baseline
  # only (baseline_policies), the same figures as the first run.
  config.policies = ("f32",)
  config.buffer_lens = (4,)
  config.baseline_policies = ("f32+int8+sr",)
  again = precision_accuracy.run(config, workdir)
  assert os.path.getmtime(os.path.join(train_dir, "metrics.jsonl")) == mtime
  scored = [r for r in again["records"] if r["kind"] != "generation"]
  kinds = [(r["kind"], r["label"], r["L"]) for r in scored]
  assert kinds == [("reference", "f32 baseline", None),
                   ("replay", "f32", 4), ("baseline", "int8+sr", None)]
  r2, b2 = scored[1:]
  assert r2["accuracy"] == replay[("f32", 4)]["accuracy"]
  assert b2["accuracy"] == base["int8+sr"]["accuracy"]
  with open(os.path.join(workdir, "summary.md")) as f:
    assert "| f32+int8+sr | - | int8+sr: " in f.read()


def test_divergence_statistics():
  """First divergence per row and the reference's margin there, on
  hand-made tokens."""
  ref = np.arange(12).reshape(3, 4)
  out = ref.copy()
  out[0, 2] = -1  # row 0 leaves at 2, row 1 at 0, row 2 never
  out[1, 0] = -1
  margins = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
  d = generation.divergence(out, ref, margins)
  assert d["agreement"] == 10 / 12 and d["never_diverged"] == 1 / 3
  assert (d["first_divergence_min"], d["first_divergence_median"]) == (0, 2)
  np.testing.assert_allclose(
      [d["divergence_margin_median"], d["divergence_margin_max"]],
      [np.median([0.2, 0.4]), 0.4])
  same = generation.divergence(ref, ref, margins)
  assert same["divergence_margin_median"] is None
  assert "divergence_margin_median" not in generation.divergence(ref, ref)


def test_reference_margins_follow_the_reference_generation():
  """The margins come from the reference decode teacher-forced along its
  own greedy tokens: non-negative at every generated position (each token
  was the argmax there), and the full forward's top-2 gaps up to f32
  summation order."""
  from replayssm_jax import tasks  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import generate  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_model, random_tokens  # pylint: disable=g-import-not-at-top
  model = make_model(3)
  p = np.asarray(random_tokens(11, (2, 5)))
  ref, _ = generate(model, p, np.full((2,), 5, np.int32), 12,
                    ssm_mode="baseline", buffer_len=1)
  ref = np.asarray(ref)
  margins = generation.reference_margins(model, p, ref)
  assert margins.shape == ref.shape
  assert (margins >= 0).all()
  logits = np.asarray(tasks.forward_logits(
      model, np.concatenate([p, ref], 1)[:, :-1]))[:, 4:]
  top2 = np.sort(logits, -1)[..., -2:]
  # Each margin is a difference of two logits: the f32 table's bound on
  # a logit, relative to the largest, twice.
  atol = 2 * testing.TOLERANCES["float32"].atol * np.abs(logits).max()
  np.testing.assert_allclose(margins, top2[..., 1] - top2[..., 0], rtol=0,
                             atol=atol)


def test_targets_name_the_margins_at_divergences():
  """The targets table's greedy cell: the lowest 16-bit-master agreement,
  the f32 replay decode's beside it, and the largest reference margin
  where any of those runs (not the f32 decode's) left the reference."""
  from experiments.precision_lib import report  # pylint: disable=g-import-not-at-top

  def gen(policy, agreement, margin):
    return dict(kind="generation", model="m", mode="greedy",
                run_kind="replay", policy=policy, label=policy, L=16,
                new_tokens=2048, agreement=agreement,
                divergence_margin_max=margin, ref_margin_median=6.5)

  config = pa_config.get_config()
  records = [gen("f32", 0.97, 0.5), gen("bf16", 0.88, 0.03125),
             gen("f16", 1.0, None), gen("f16+fp8+sr", 0.89, 0.0625)]
  table = "\n".join(report._targets(config, [{"model": "m"}], records))  # pylint: disable=protected-access
  assert ("missed: min 0.8800 (bf16 L=16, 2048 tokens); f32 replay 0.9700; "
          "reference margin at a divergence <= 0.0625 (median over all "
          "tokens 6.5)") in table
  records = [gen("f32", 1.0, None), gen("bf16", 1.0, None)]
  table = "\n".join(report._targets(config, [{"model": "m"}], records))  # pylint: disable=protected-access
  assert "met: min 1.0000 (bf16 L=16, 2048 tokens); f32 replay 1.0000 |" in (
      table)


def test_studies_cover_every_preset():
  """The accuracy and drift studies run every PrecisionPolicy preset."""
  from configs import precision_drift  # pylint: disable=g-import-not-at-top
  from replayssm_jax import precision  # pylint: disable=g-import-not-at-top
  presets = set(precision._PRESETS)  # pylint: disable=protected-access
  assert set(pa_config.POLICIES) == presets
  assert set(pa_config.get_config().policies) == presets
  assert set(precision_drift.get_config().policies) == presets
