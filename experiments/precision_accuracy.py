r"""Decode accuracy, perplexity, long generations and state error of trained
models under decode-state precision policies.

For each trained model (experiments/train.py checkpoints; the smoke config
trains a tiny one first) the study runs its stages (config.stages):

  scores       the validation batches in decode mode: prefill of the first
               token, then teacher-forced `decode_step`s over the rest
               (`tasks.decode_logits`), so every recurrent layer runs
               seq_len - 1 decode steps and a replay row flushes
               floor((seq_len - 1) / L) times. Decodes
                 reference  ssm_mode="baseline", float32 state (no policy);
                 replay     ssm_mode="replay" with `init_state(precision=
                            policy)` for each policy x buffer length L;
                 baseline   the full state stored every step in a policy's
                            storage dtype and rounding, for contrast
               (`precision_lib.runs`). Reported per decode: accuracy,
               loss / perplexity, the accuracy delta vs the reference in
               percentage points (within config.within_points?) and the
               perplexity's relative change (within config.ppl_tolerance?),
               the greedy-prediction agreement with the reference and
               max |logit - reference logit| / max |reference logit|;
  generation   long generations against the f32 baseline's, greedy and
               sampled: token agreement, first divergence
               (`precision_lib.generation`);
  state_error  the recorded recurrent layers' states along a long decode
               against a float64 recurrence over the same inputs
               (`precision_lib.state_error`).

With config.merge_workdirs set, nothing is evaluated: the records of those
workdirs (stages run apart, e.g. one device call each) are read and the
combined report written.

Usage (see configs/precision_accuracy.py and configs/precision_text.py):
  python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py --workdir=runs/precision_accuracy

Outputs in --workdir: config.json, metrics.jsonl (kind = environment |
model | reference | replay | baseline | generation | state_error_stream |
state_error | final), summary.md (`precision_lib.report`),
accuracy_delta.png, perplexity.png, distance.png, generation.png,
state_error.png; trained smoke models under train/<name>/.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import common
from experiments import train as train_lib
from experiments.precision_lib import generation
from experiments.precision_lib import report
from experiments.precision_lib import runs as R
from experiments.precision_lib import shared
from experiments.precision_lib import state_error
from replayssm_jax import tasks
from replayssm_jax import text_corpus

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "precision_accuracy.py")
TRAIN_CONFIG_FILES = ("train", "train_text")
STAGES = ("scores", "generation", "state_error")


# ------------------------------------------------------------------ models
@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """One config.models entry (see configs/precision_accuracy.py)."""
  name: str
  train_config: str
  train_config_file: str = "train"
  workdir: str = ""
  eval_seq_len: int = 0
  train_overrides: dict = dataclasses.field(default_factory=dict)
  corpus_dir: str = ""
  model_overrides: dict = dataclasses.field(default_factory=dict)


def model_entry(raw) -> ModelEntry:
  """A config.models entry (a dict) as a checked ModelEntry."""
  d = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
  fields = [f.name for f in dataclasses.fields(ModelEntry)]
  unknown = sorted(set(d) - set(fields))
  if unknown or "name" not in d or "train_config" not in d:
    raise ValueError(f"config.models entries need 'name' and "
                     f"'train_config' (optional: train_config_file, "
                     f"workdir, eval_seq_len, train_overrides, corpus_dir, "
                     f"model_overrides); got fields {sorted(d)}.")
  d["train_overrides"] = dict(d.get("train_overrides") or {})
  d["model_overrides"] = dict(d.get("model_overrides") or {})
  return ModelEntry(**d)


def _train_config(entry):
  if entry.train_config_file not in TRAIN_CONFIG_FILES:
    raise ValueError(f"models[{entry.name!r}].train_config_file must be "
                     f"one of {TRAIN_CONFIG_FILES}, got "
                     f"{entry.train_config_file!r}.")
  module = importlib.import_module(f"configs.{entry.train_config_file}")
  config = module.get_config(entry.train_config)
  if entry.train_overrides:
    config.update_from_flattened_dict(dict(entry.train_overrides))
  return config


def _corpus_override(entry, path: str) -> dict | None:
  """Task overrides scoring a text model on `entry.corpus_dir` (e.g. a
  committed excerpt of the corpus it was trained on); the corpus must be
  the training corpus or an excerpt of it (`text_corpus.lineage`)."""
  if not entry.corpus_dir:
    return None
  with open(os.path.join(path, "task.json")) as f:
    trained_on = json.load(f).get("corpus_sha256", "")
  if trained_on not in text_corpus.lineage(entry.corpus_dir):
    raise ValueError(f"models[{entry.name!r}].corpus_dir "
                     f"{entry.corpus_dir!r} is neither the corpus the "
                     f"model was trained on ({trained_on}) nor an excerpt "
                     f"of it.")
  return dict(corpus_dir=os.path.abspath(entry.corpus_dir), corpus_sha256="")


def load_model(entry, workdir: str, train_missing: bool):
  """(model, task, training workdir) of one config.models entry; trains it
  first if its workdir has no checkpoint and train_missing is set."""
  path = entry.workdir or os.path.join(workdir, "train", entry.name)
  path = os.path.abspath(path)
  if not train_lib.checkpoint_steps(path):
    if not train_missing:
      raise FileNotFoundError(
          f"model {entry.name!r}: no checkpoint under {path}. Train it "
          f"first: python -m experiments.train --config=configs/"
          f"{entry.train_config_file}.py:{entry.train_config} "
          f"--workdir={path} (or set "
          f"--config.train_missing=True).")
    logging.info("model %s: no checkpoint in %s, training %s", entry.name,
                 path, entry.train_config)
    train_lib.run(_train_config(entry), path)
  model, task, _ = train_lib.load_trained(
      path, task_overrides=_corpus_override(entry, path),
      model_overrides=entry.model_overrides)
  if entry.eval_seq_len:
    if entry.eval_seq_len < 2:
      raise ValueError(f"models[{entry.name!r}].eval_seq_len must be 0 or "
                       f">= 2, got {entry.eval_seq_len}.")
    task = dataclasses.replace(task, seq_len=int(entry.eval_seq_len))
  return model, task, path


def _block_kinds(entry, workdir: str) -> tuple[str, ...]:
  """The block kinds of an entry's model, from its training workdir's
  model_config.json or its train config (no jax computation)."""
  path = os.path.join(entry.workdir or os.path.join(workdir, "train",
                                                    entry.name),
                      "model_config.json")
  if os.path.exists(path):
    with open(path) as f:
      return train_lib.ModelConfig(**json.load(f)).block_kinds
  return train_lib.model_config(_train_config(entry)).block_kinds


def _training_record(path: str) -> dict:
  """The final record of a training workdir's metrics.jsonl ({} if none)."""
  mpath = os.path.join(path, "metrics.jsonl")
  if not os.path.exists(mpath):
    return {}
  finals = [r for r in common.read_metrics(mpath) if r["kind"] == "final"]
  return finals[-1] if finals else {}


# -------------------------------------------------------------- evaluation
@jax.jit
def _compare(logits, ref, targets, mask):
  """Sums of one batch: masked_sums + agreement with the reference's greedy
  predictions at the scored positions + the KL divergence KL(ref || run)
  and total-variation distance of the next-token distributions (summed
  and max) + max |logit diffs|."""
  out = tasks.masked_sums(logits, targets, mask)
  scored = mask > 0
  agree = jnp.argmax(logits, -1) == jnp.argmax(ref, -1)
  out["agree"] = jnp.sum((agree & scored).astype(jnp.float32))
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  logr = jax.nn.log_softmax(ref.astype(jnp.float32), -1)
  kl = jnp.sum(jnp.exp(logr) * (logr - logp), -1)
  tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - jnp.exp(logr)), -1)
  out["kl"] = jnp.sum(jnp.where(scored, kl, 0.0))
  out["tv"] = jnp.sum(jnp.where(scored, tv, 0.0))
  out["max_tv"] = jnp.max(jnp.where(scored, tv, 0.0))
  finite = jnp.isfinite(logits)
  out["nonfinite"] = jnp.sum((~finite).astype(jnp.float32))
  out["max_abs_diff"] = jnp.max(jnp.where(finite, jnp.abs(logits - ref),
                                          jnp.inf))
  out["max_abs_ref"] = jnp.max(jnp.abs(ref))
  return out


def decode_eval(model, batches, refs, ssm_mode, buffer_len, policy=None):
  """Metrics of one decode configuration over the batches (refs: the
  reference logits per batch, or None when this IS the reference)."""
  total, all_logits = {}, []
  for i, batch in enumerate(batches):
    kw = {}
    if policy is not None:
      kw["precision"] = policy
      if policy.stochastic_rounding:
        n = batch["inputs"].shape[0]
        kw["row_ids"] = np.arange(i * n, (i + 1) * n, dtype=np.int32)
    logits = tasks.decode_logits(model, batch["inputs"], ssm_mode,
                                 buffer_len, **kw)
    ref = logits if refs is None else refs[i]
    s = {k: float(v) for k, v in _compare(
        logits, ref, jnp.asarray(batch["targets"]),
        jnp.asarray(batch["mask"])).items()}
    for k, v in s.items():
      if k.startswith("max_"):
        total[k] = max(total.get(k, 0.0), v)
      else:
        total[k] = total.get(k, 0.0) + v
    if refs is None:
      all_logits.append(logits)
  m = tasks.finalize(total)
  m.update(agreement=total["agree"] / total["count"],
           mean_kl=total["kl"] / total["count"],
           mean_tv=total["tv"] / total["count"], max_tv=total["max_tv"],
           nonfinite_logits=int(total["nonfinite"]),
           max_rel_logit_diff=total["max_abs_diff"] / max(
               total["max_abs_ref"], 1e-30))
  return m, all_logits


def reference_scores(name, model, batches, config):
  """(metrics, logits per batch) of the reference decode (`decode_eval`
  without a reference), computed once for every slice of a split study
  that shares `config.shared_dir` (shared.py)."""

  def compute():
    m, logits = decode_eval(model, batches, None, "baseline", 1)
    out = {f"logits_{i}": x for i, x in enumerate(logits)}
    out.update({f"metric_{k}": np.asarray(v) for k, v in m.items()})
    return out

  def key():
    arrays = {f"batch{i}_{k}": np.asarray(v) for i, b in enumerate(batches)
              for k, v in b.items()}
    return shared.key(name, "score_reference", model_config=repr(
        model.config), params=shared.fingerprint(model), **arrays)

  out = shared.computed_once(config.get("shared_dir", ""), key, compute)
  metrics = {k[len("metric_"):]: np.asarray(v).item()
             for k, v in out.items() if k.startswith("metric_")}
  return metrics, [jnp.asarray(out[f"logits_{i}"])
                   for i in range(len(batches))]


def score_model(entry, model, task, config, writer) -> list[dict]:
  """The reference, replay and every-step baseline decodes of one model
  on its validation batches."""
  steps = task.seq_len - 1  # prefill 1 token, then decode steps
  base = dict(model=entry.name, task=task.name, seq_len=task.seq_len,
              decode_steps=steps)
  runs = R.score_runs(config)
  idents = [dict(base, kind=run.kind, label=run.label, L=run.L)
            for run in runs]
  ref_ident = dict(base, kind="reference", label="f32 baseline", L=None)
  if all(map(writer.done, idents + [ref_ident])):  # a resumed study's
    return [writer.done(r) for r in [ref_ident] + idents]

  batches = task.eval_batches(config.eval_batches, config.eval_batch_size)
  t0 = time.perf_counter()
  ref, refs = reference_scores(entry.name, model, batches, config)
  rec = writer.write(dict(ref_ident, policy=None, storage_dtype="float32",
                          rounding="rn", eval_s=time.perf_counter() - t0,
                          **ref))
  records = [rec]
  logging.info("%s reference (f32 baseline): accuracy %.4f, loss %.4f, "
               "perplexity %.4f", entry.name, ref["accuracy"], ref["loss"],
               ref["perplexity"])

  for run, ident in zip(runs, idents):
    if writer.done(ident):
      records.append(writer.done(ident))
      continue
    t0 = time.perf_counter()
    m, _ = decode_eval(model, batches, refs, run.ssm_mode, run.buffer_len,
                       run.policy)
    rec = dict(ident, policy=run.policy_name)
    if run.kind == "replay":
      rec.update(checkpoint_dtype=run.policy.checkpoint_dtype,
                 read_dtype=run.policy.read_dtype,
                 buffer_dtype=run.policy.buffer_dtype,
                 rounding=run.policy.rounding, flushes_per_row=steps // run.L)
    else:
      rec.update(storage_dtype=run.storage_dtype, rounding=run.rounding)
    delta = 100.0 * (m["accuracy"] - ref["accuracy"])
    rel = m["perplexity"] / ref["perplexity"] - 1.0
    rec.update(m, delta_accuracy_points=delta,
               delta_loss=m["loss"] - ref["loss"], rel_perplexity=rel,
               within=bool(abs(delta) <= config.within_points),
               within_ppl=bool(abs(rel) <= config.ppl_tolerance),
               eval_s=time.perf_counter() - t0)
    records.append(writer.write(rec))
    R.release_compiled()
    logging.info("%s %-8s %-12s L=%-4s accuracy %.4f (%+.2f points), "
                 "perplexity %+.3f%%, agreement %.4f, max rel logit diff "
                 "%.2e", entry.name, rec["kind"], rec["label"],
                 rec["L"] or "-", m["accuracy"], delta, 100 * rel,
                 m["agreement"], m["max_rel_logit_diff"])
  return records


def evaluate_model(entry, model, task, config, writer) -> list[dict]:
  """The study's stages (config.stages) on one model."""
  stages = tuple(config.get("stages", STAGES))
  records = []
  if "scores" in stages:
    records += score_model(entry, model, task, config, writer)
  if "generation" in stages and config.generation.new_tokens:
    records += generation.agreement(entry.name, model, task, config, writer)
  se = config.get("state_error")
  if "state_error" in stages and se is not None and se.steps:
    records += state_error.measure(entry.name, model, task, config, writer)
  return records


# ------------------------------------------------------------------- run
def _check_config(config):
  if not config.models and not config.get("merge_workdirs"):
    raise ValueError("config.models must list at least one model.")
  for raw in config.models:
    model_entry(raw)
  for L in config.buffer_lens:
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
      raise ValueError(f"config.buffer_lens must hold ints >= 1, got {L!r}.")
  for name in R.table_policies(config):
    R.make_policy(name, config)  # raises naming the preset / field
  unknown = sorted(set(config.get("stages", STAGES)) - set(STAGES))
  if unknown:
    raise ValueError(f"config.stages: unknown {unknown}; choose from "
                     f"{STAGES}.")


def _merged(config) -> tuple[list[dict], list[dict]]:
  """(model infos, records) of the workdirs in config.merge_workdirs; a
  record that several hold (the reference decode of each preset slice)
  is kept once."""
  models, records, seen = {}, [], set()
  for wd in config.merge_workdirs:
    for r in common.read_metrics(os.path.join(wd, "metrics.jsonl")):
      if r["kind"] == "model":
        models.setdefault(r["model"], r)
        continue
      key = R.identity(r)
      if r["kind"] not in ("environment", "final") and key not in seen:
        seen.add(key)
        records.append(r)
  return list(models.values()), records


def _previous_records(config, workdir: str) -> list[dict]:
  """With config.resume, the run records an earlier run of the same config
  left in `workdir` (none if it holds no metrics.jsonl)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not config.get("resume") or not os.path.exists(path):
    return []
  with open(os.path.join(workdir, "config.json")) as f:
    old = json.load(f)
  new = json.loads(json.dumps(common.to_jsonable(config)))
  differ = sorted(k for k in set(old) | set(new) if k != "resume"
                  and old.get(k) != new.get(k))
  if differ:
    raise ValueError(
        f"config.resume: {workdir} holds a run of another config (fields "
        f"{differ} differ); resume with the same config or use another "
        f"--workdir.")
  return [r for r in common.read_metrics(path)
          if r["kind"] not in ("environment", "model", "final")]


def run(config, workdir: str) -> dict:
  """Runs the study into `workdir`; returns the records."""
  t_start = time.perf_counter()
  _check_config(config)
  for entry in map(model_entry, config.models):  # before jax starts
    common.avoid_cpu_lapack_stall(_block_kinds(entry, workdir))
  previous = _previous_records(config, workdir)
  workdir, _, writer = common.start_run(workdir, config)
  writer = R.ResumableWriter(writer, previous)
  if config.get("merge_workdirs"):
    models, records = _merged(config)
    for r in models + records:
      writer.write(r)
  else:
    records, models = [], []
    for entry in map(model_entry, config.models):
      model, task, path = load_model(entry, workdir, config.train_missing)
      trained = _training_record(path)
      n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(
          nnx.split(model)[1])))
      info = writer.write(kind="model", model=entry.name, task=task.name,
                          seq_len=task.seq_len, train_workdir=path,
                          pattern=model.config.pattern,
                          d_model=model.config.d_model, num_params=n_params,
                          dtype=model.config.dtype,
                          recipe=trained.get("recipe"),
                          task_spec=task.to_dict())
      models.append(dict(info))
      logging.info("model %s: %s, pattern %s, %s parameters, eval seq_len "
                   "%d", entry.name, task.name, model.config.pattern,
                   f"{n_params:,}", task.seq_len)
      records += evaluate_model(entry, model, task, config, writer)
  text = report.write_summary(config, workdir, models, records)
  report.plot_scores(config, workdir, models, records)
  report.plot_generation(workdir, models, records)
  report.plot_state_error(workdir, models, records)
  common.log_block(text)
  wall = time.perf_counter() - t_start
  writer.write(kind="final", wall_s=wall)
  logging.info("precision_accuracy finished in %.1fs; outputs in %s", wall,
               workdir)
  return dict(workdir=workdir, records=records, models=models, wall_s=wall)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/precision_accuracy")
