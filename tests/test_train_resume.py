"""experiments/train.py's resume: a call stopped by train.stop_after_s
continues where it stopped and ends with the parameters of an uninterrupted
run; a finished run returns at once; another config is refused. Then the
corpus excerpt (`text_corpus.write_excerpt`, `lineage`), a trained text
model scored on it (`load_trained(task_overrides=...)`), and data-parallel
training on two forced host devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("ml_collections")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from configs import corpus as corpus_config  # noqa: E402
from configs import train_text  # noqa: E402
from experiments import build_corpus  # noqa: E402
from experiments import common  # noqa: E402
from experiments import train  # noqa: E402
from experiments.train_lib import resume as train_resume  # noqa: E402
from replayssm_jax import tasks  # noqa: E402
from replayssm_jax import text_corpus as TC  # noqa: E402
from tests.test_text_corpus import _sources  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("corpus")
  lib, man = _sources(tmp)
  config = corpus_config.get_config("smoke")
  config.corpus.roots = dict(python_stdlib=lib, manpages=man)
  out = str(tmp / "corpus")
  build_corpus.run(config, out)
  return out


def _config(corpus, **train_fields):
  config = train_text.get_config("smoke")
  config.task.corpus_dir = corpus
  config.train.update(dict(dict(num_steps=24, log_every=4, eval_every=12,
                                checkpoint_every=8, resume=True),
                           **train_fields))
  return config


def _logits(workdir, batch):
  model, _, _ = train.load_trained(workdir)
  return np.asarray(tasks.forward_logits(model, batch))


def test_stopped_run_resumes_to_the_same_parameters(corpus, tmp_path):
  whole = train.run(_config(corpus), str(tmp_path / "whole"))
  assert whole["finished"]
  part = str(tmp_path / "part")
  # A stop after 0 s: the call ends after its first step, saving it.
  out = train.run(_config(corpus, stop_after_s=1e-9), part)
  assert not out["finished"] and out["step"] == 1
  assert train.checkpoint_steps(part) == [1]
  assert train_resume.saved_steps(part) == [1]
  records = common.read_metrics(os.path.join(part, "metrics.jsonl"))
  assert records[-1]["kind"] == "paused" and records[-1]["step"] == 1
  with open(os.path.join(part, "summary.md")) as f:
    assert "(paused)" in f.read()
  out = train.run(_config(corpus), part)  # continues from step 1
  assert out["finished"] and out["final"]["resumed_from"] == 1
  batch = whole["task"].eval_batches(1, 4)[0]["inputs"]
  np.testing.assert_array_equal(_logits(part, batch),
                                _logits(str(tmp_path / "whole"), batch))
  # Only the newest optimizer state is kept.
  assert train_resume.saved_steps(part) == [16]
  records = common.read_metrics(os.path.join(part, "metrics.jsonl"))
  steps = [r["step"] for r in records if r["kind"] == "train"]
  assert steps == sorted(set(steps)) and steps[-1] == 24
  assert [r["kind"] for r in records].count("final") == 1
  final = records[-1]
  assert final["recipe"]["config_arg"] == "smoke"
  assert final["recipe"]["config_file"] == "configs/train_text.py"
  assert final["recipe"]["corpus_sha256"] == TC.corpus_hash(corpus)
  assert final["recipe"]["token_budget"] == 24 * 8 * 32
  with open(os.path.join(part, "tokenizer.json")) as f:  # beside the model
    assert TC.ByteTokenizer.from_dict(json.load(f)) == TC.ByteTokenizer()
  with open(os.path.join(part, "summary.md")) as f:
    summary = f.read()
  assert "## Rebuild" in summary and TC.corpus_hash(corpus) in summary
  assert "--config=configs/train_text.py:smoke" in summary
  # A finished run returns at once; a changed config is refused.
  again = train.run(_config(corpus), part)
  assert again["finished"] and again["resumed_from"] == 24
  with pytest.raises(ValueError, match="another config"):
    train.run(_config(corpus, learning_rate=1e-3), part)


def test_killed_run_resumes_from_its_last_checkpoint(corpus, tmp_path):
  """A call killed between checkpoints (its later records and parameters
  left behind) continues from the newest step with an optimizer state."""
  part = str(tmp_path / "part")
  train.run(_config(corpus, checkpoint_every=4, stop_after_s=1e-9), part)
  out = train.run(_config(corpus, checkpoint_every=4), part)
  assert out["finished"]
  # Pretend the call died after step 20's records: drop the final
  # checkpoint and records, keep the optimizer state of step 20.
  path = os.path.join(part, "metrics.jsonl")
  records = [r for r in common.read_metrics(path)
             if r["kind"] not in ("final", "decode_eval")]
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(os.path.join(part, train.CHECKPOINT_DIR, "24"))
  assert train_resume.saved_steps(part) == [20]
  out = train.run(_config(corpus, checkpoint_every=4), part)
  assert out["final"]["resumed_from"] == 20
  steps = [r["step"] for r in common.read_metrics(path)
           if r["kind"] == "train"]
  assert steps == sorted(set(steps)) and steps[-1] == 24


def test_excerpt_and_scoring_a_model_on_it(corpus, tmp_path):
  excerpt = str(tmp_path / "excerpt")
  manifest = TC.write_excerpt(corpus, excerpt, dict(
      train=3000, validation=2000, test=2000))
  data, whole = TC.load_corpus(excerpt), TC.load_corpus(corpus)
  for split in TC.SPLITS:
    n = len(data[split])
    assert 0 < n <= max(3000, 2000)
    np.testing.assert_array_equal(data[split], whole[split][:n])
    # Whole documents: the next byte of the source is a separator.
    if n < len(whole[split]) and n < manifest["excerpt_of"]["max_bytes"][
        split]:
      assert whole[split][n] == TC.DOC_SEP
  assert TC.lineage(excerpt) == (manifest["corpus_sha256"],
                                 TC.corpus_hash(corpus))
  assert TC.lineage(corpus) == (TC.corpus_hash(corpus),)
  config = _config(corpus, num_steps=4, warmup_steps=1, checkpoint_every=0,
                   resume=False)
  config.train.update(eval_every=4, decode_eval_batches=0)
  run = str(tmp_path / "run")
  train.run(config, run)
  model, task, cfg = train.load_trained(
      run, task_overrides=dict(corpus_dir=excerpt, corpus_sha256=""))
  assert task.corpus_dir == excerpt and cfg.task.corpus_dir == corpus
  assert task.batch(0, 2, "val")["inputs"].shape == (2, 32)


def test_data_parallel_on_two_devices(corpus, tmp_path):
  """On two forced host devices the step runs data-parallel (batch split,
  parameters replicated) and trains as the single-device run does."""
  code = f"""
import sys; sys.path.insert(0, {ROOT!r})
import jax, json
from configs import train_text
from experiments import train
config = train_text.get_config("smoke")
config.task.corpus_dir = {corpus!r}
config.train.update(num_steps=6, log_every=2, eval_every=6,
                    decode_eval_batches=0)
config.train.data_parallel = sys.argv[1] == "1"
out = train.run(config, sys.argv[2])
print("LOSSES", json.dumps([h["loss"] for h in out["history"]]),
      jax.local_device_count())
"""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  losses = {}
  for dp in ("1", "0"):
    r = subprocess.run([sys.executable, "-c", code, dp,
                        str(tmp_path / f"dp{dp}")], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("LOSSES")][0]
    losses[dp] = json.loads(line.split(" ", 1)[1].rsplit(" ", 1)[0])
    assert line.endswith(" 2")
  np.testing.assert_allclose(losses["1"], losses["0"], rtol=1e-4)
