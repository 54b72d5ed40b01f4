r"""Task accuracy under decode-state precision policies.

For each trained model (experiments/train.py checkpoints; the smoke config
trains a tiny one first) the validation batches are scored in decode mode:
prefill of the first token, then teacher-forced `decode_step`s over the
rest of the sequence (`tasks.decode_logits`), so every Mamba layer runs
seq_len - 1 decode steps and a replay row flushes floor((seq_len - 1) / L)
times. Decodes:

  reference  ssm_mode="baseline", float32 state (no policy);
  replay     ssm_mode="replay" with `init_state(precision=policy)` for each
             policy x buffer length L (buffers config.buffer_dtype, SR seed
             config.sr_seed, SR row ids = the global row index);
  baseline   ssm_mode="baseline" with the same policy: the full state
             stored every step in the policy's storage dtype (read_dtype,
             else checkpoint_dtype) and rounding, for contrast (one run per
             distinct dtype x rounding).

Reported per decode: accuracy (MQAR: at the queries; char / text:
next-token accuracy), loss / perplexity and the perplexity's relative
change, the accuracy delta vs the reference in percentage points and
whether it lies within config.within_points, the greedy-prediction
agreement with the reference at the scored positions, and max |logit -
reference logit| / max |reference logit|. Then, per decode, long
generations against the f32 baseline's (greedy and sampled token agreement,
first divergence).

Usage (see configs/precision_accuracy.py):
  python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py --workdir=runs/precision_accuracy

Outputs in --workdir: config.json, metrics.jsonl (kind = environment |
model | reference | replay | baseline | generation), summary.md (per model
a policy x L table of accuracy deltas, then all runs and the long
generations), accuracy_delta.png; trained smoke models under
train/<name>/.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments import train as train_lib
from replayssm_jax import tasks
from replayssm_jax.models import generate
from replayssm_jax.models import states as S
from replayssm_jax.precision import PrecisionPolicy

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "precision_accuracy.py")
TRAIN_CONFIG_FILES = ("train", "train_text")
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
          "float8_e4m3fn": "fp8", "int8": "int8"}


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


def model_entry(raw) -> ModelEntry:
  """A config.models entry (a dict) as a checked ModelEntry."""
  d = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
  fields = [f.name for f in dataclasses.fields(ModelEntry)]
  unknown = sorted(set(d) - set(fields))
  if unknown or "name" not in d or "train_config" not in d:
    raise ValueError(f"config.models entries need 'name' and "
                     f"'train_config' (optional: train_config_file, "
                     f"workdir, eval_seq_len, train_overrides); got fields "
                     f"{sorted(d)}.")
  d["train_overrides"] = dict(d.get("train_overrides") or {})
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
  model, task, _ = train_lib.load_trained(path)
  if entry.eval_seq_len:
    if entry.eval_seq_len < 2:
      raise ValueError(f"models[{entry.name!r}].eval_seq_len must be 0 or "
                       f">= 2, got {entry.eval_seq_len}.")
    task = dataclasses.replace(task, seq_len=int(entry.eval_seq_len))
  return model, task, path


def make_policy(name: str, config) -> PrecisionPolicy:
  return PrecisionPolicy.preset(name).replace(
      buffer_dtype=config.buffer_dtype, seed=config.sr_seed)


def baseline_key(policy: PrecisionPolicy) -> tuple[str, str]:
  """(storage dtype, rounding) of the every-step baseline of `policy`;
  rounding "rn", "sr", or "sr:<sr_rng>" for a non-default hash."""
  dtype = S.baseline_storage_dtype(policy)
  return dtype, "rn" if dtype == "float32" else policy.rounding


# -------------------------------------------------------------- evaluation
@jax.jit
def _compare(logits, ref, targets, mask):
  """Sums of one batch: masked_sums + agreement with the reference's greedy
  predictions at the scored positions + max |logit diffs|."""
  out = tasks.masked_sums(logits, targets, mask)
  agree = jnp.argmax(logits, -1) == jnp.argmax(ref, -1)
  out["agree"] = jnp.sum(agree.astype(jnp.float32) * mask)
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
           nonfinite_logits=int(total["nonfinite"]),
           max_rel_logit_diff=total["max_abs_diff"] / max(
               total["max_abs_ref"], 1e-30))
  return m, all_logits


def evaluate_model(entry, model, task, config, writer) -> list[dict]:
  """The reference, replay and baseline decodes of one model."""
  batches = task.eval_batches(config.eval_batches, config.eval_batch_size)
  steps = task.seq_len - 1  # prefill 1 token, then decode steps
  base = dict(model=entry.name, task=task.name, seq_len=task.seq_len,
              decode_steps=steps)
  records = []

  t0 = time.perf_counter()
  ref, refs = decode_eval(model, batches, None, "baseline", 1)
  rec = writer.write(dict(base, kind="reference", label="f32 baseline",
                          policy=None, L=None, storage_dtype="float32",
                          rounding="rn", eval_s=time.perf_counter() - t0,
                          **ref))
  records.append(rec)
  logging.info("%s reference (f32 baseline): accuracy %.4f, loss %.4f",
               entry.name, ref["accuracy"], ref["loss"])

  def finish(rec, m, t0):
    delta = 100.0 * (m["accuracy"] - ref["accuracy"])
    rec.update(m, delta_accuracy_points=delta,
               delta_loss=m["loss"] - ref["loss"],
               rel_perplexity=m["perplexity"] / ref["perplexity"] - 1.0,
               within=bool(abs(delta) <= config.within_points),
               eval_s=time.perf_counter() - t0)
    records.append(writer.write(rec))
    logging.info("%s %-8s %-12s L=%-4s accuracy %.4f (%+.2f points), "
                 "agreement %.4f, max rel logit diff %.2e", entry.name,
                 rec["kind"], rec["label"], rec["L"] or "-", m["accuracy"],
                 delta, m["agreement"], m["max_rel_logit_diff"])

  for name in config.policies:
    policy = make_policy(name, config)
    for L in config.buffer_lens:
      t0 = time.perf_counter()
      m, _ = decode_eval(model, batches, refs, "replay", L, policy)
      finish(dict(base, kind="replay", label=name, policy=name, L=L,
                  checkpoint_dtype=policy.checkpoint_dtype,
                  read_dtype=policy.read_dtype,
                  buffer_dtype=policy.buffer_dtype,
                  rounding=policy.rounding,
                  flushes_per_row=steps // L), m, t0)

  if config.baseline_contrast:
    done = {("float32", "rn")}  # the reference itself
    for name in _baseline_policies(config):
      policy = make_policy(name, config)
      key = baseline_key(policy)
      if key in done:
        continue
      done.add(key)
      t0 = time.perf_counter()
      m, _ = decode_eval(model, batches, refs, "baseline", 1, policy)
      finish(dict(base, kind="baseline",
                  label=f"{_SHORT[key[0]]}+{key[1]}", policy=name, L=None,
                  storage_dtype=key[0], rounding=key[1]), m, t0)
  if config.generation.new_tokens:
    runs = [(r["kind"], r["label"], make_policy(r["policy"], config),
             "replay" if r["kind"] == "replay" else "baseline", r["L"] or 1)
            for r in records if r["kind"] in ("replay", "baseline")]
    records += generation_agreement(
        entry.name, model, task, config, runs, writer)
  return records


def _baseline_policies(config) -> tuple:
  """The presets whose every-step baselines run."""
  names = config.get("baseline_policies")
  return tuple(config.policies if names is None else names)


def _table_policies(config) -> tuple:
  """The report's rows: the replay presets, then any baseline-only ones."""
  extra = [n for n in _baseline_policies(config) if n not in config.policies]
  return tuple(config.policies) + tuple(dict.fromkeys(extra))


# --------------------------------------------------------- long generation
# Per model: prompts are the first `generation.prompt_len` tokens of
# validation windows; `generate` runs `generation.new_tokens` tokens per
# prompt with the f32 baseline state (the reference) and with each decode
# configuration, greedy and sampled (temperature `generation.temperature`,
# the same PRNG key in every run, so two runs draw the same random numbers
# and part only where their distributions do). Greedy agreement measures
# how often rounding flips an argmax and sends the continuation elsewhere;
# sampled agreement, how often it moves a draw.


def prompts(task, config):
  """[n, prompt_len] int32 prompts: validation windows' first tokens."""
  g = config.generation
  return task.batch(0, g.num_prompts, "val")["inputs"][:, :g.prompt_len]


def divergence(tokens, ref) -> dict:
  """Agreement and first-divergence statistics of [n, T] tokens vs ref."""
  tokens, ref = np.asarray(tokens), np.asarray(ref)
  same = tokens == ref
  n, t = same.shape
  first = np.where(same.all(1), t, np.argmin(same, axis=1))
  return dict(agreement=float(same.mean()),
              first_divergence_median=float(np.median(first)),
              first_divergence_min=int(first.min()),
              never_diverged=float(np.mean(first == t)), rows=int(n),
              new_tokens=int(t))


def _generate_run(model, p, config, mode, ssm_mode, buffer_len, policy):
  g = config.generation
  lengths = jnp.full((p.shape[0],), p.shape[1], jnp.int32)
  kw = {}
  if policy is not None:
    kw["precision"] = policy
    if policy.stochastic_rounding:
      kw["row_ids"] = np.arange(p.shape[0], dtype=np.int32)
  if mode == "sampled":
    kw.update(temperature=float(g.temperature),
              rng=jax.random.PRNGKey(config.seed + 7))
  tokens, _ = generate(model, jnp.asarray(p), lengths, int(g.new_tokens),
                       ssm_mode=ssm_mode, buffer_len=buffer_len, **kw)
  return np.asarray(tokens)


def generation_agreement(name, model, task, config, runs, writer):
  """Long-generation records of one model (agreement: share of tokens
  equal to the reference's at the same position; first divergence per
  row: the index of its first differing token, new_tokens if none). runs: (kind, label, policy or None,
  ssm_mode, L) per decode configuration besides the reference."""
  p = prompts(task, config)
  records = []
  for mode in config.generation.modes:
    ref = _generate_run(model, p, config, mode, "baseline", 1, None)
    for kind, label, policy, ssm_mode, L in runs:
      t0 = time.perf_counter()
      out = _generate_run(model, p, config, mode, ssm_mode, L, policy)
      rec = writer.write(dict(
          kind="generation", model=name, mode=mode, run_kind=kind,
          label=label, L=L, prompt_len=p.shape[1],
          temperature=(float(config.generation.temperature)
                       if mode == "sampled" else 0.0),
          eval_s=time.perf_counter() - t0, **divergence(out, ref)))
      records.append(rec)
      logging.info("%s %s %-8s %-12s L=%-4s agreement %.4f, first "
                   "divergence median %.0f", name, mode, kind, label,
                   L or "-", rec["agreement"],
                   rec["first_divergence_median"])
  return records


# ---------------------------------------------------------------- reports
def _cell(r):
  return f"{r['delta_accuracy_points']:+.2f} ({'yes' if r['within'] else 'no'})"


def _report(config, workdir, models, records) -> str:
  lines = [
      "# Decode accuracy under precision policies",
      "",
      "Decode mode: prefill 1 token, then teacher-forced decode steps over "
      "each sequence. Reference: the f32 baseline decode. Cells: accuracy "
      "delta vs the reference in percentage points, and whether it lies "
      f"within {config.within_points:g} point(s). Replay buffers "
      f"{config.buffer_dtype}; SR seed {config.sr_seed}. 'baseline' = the "
      "full state stored every step in the policy's storage dtype "
      "(read_dtype, else checkpoint_dtype) with its rounding.",
      "",
  ]
  Ls = list(config.buffer_lens)
  for info in models:
    name = info["model"]
    mine = [r for r in records if r["model"] == name]
    ref = next(r for r in mine if r["kind"] == "reference")
    baselines = {(r["storage_dtype"], r["rounding"]): r for r in mine
                 if r["kind"] == "baseline"}
    rows = []
    for pname in _table_policies(config):
      row = {"policy": pname}
      for r in mine:
        if r["kind"] == "replay" and r["policy"] == pname:
          row[f"L={r['L']}"] = _cell(r)
      key = baseline_key(make_policy(pname, config))
      b = baselines.get(key)
      row["baseline (every step)"] = (
          f"{b['label']}: {_cell(b)}" if b is not None else
          "= reference" if key == ("float32", "rn") else "-")
      rows.append(row)
    cols = ["policy"] + [f"L={L}" for L in Ls]
    if config.baseline_contrast:
      cols.append("baseline (every step)")
    lines += [
        f"## {name} ({ref['task']}, seq_len {ref['seq_len']}, "
        f"{ref['decode_steps']} decode steps, {ref['num_targets']} scored "
        f"targets)",
        "",
        f"Reference accuracy {ref['accuracy']:.4f}, loss {ref['loss']:.4f} "
        f"(perplexity {ref['perplexity']:.3f}); trained in "
        f"`{info['train_workdir']}`. Flushes per row: "
        + ", ".join(f"L={L}: {ref['decode_steps'] // L}" for L in Ls) + ".",
        "",
        common.markdown_table(rows, cols),
        "",
    ]
  cols = ["model", "kind", "label", "L", "flushes_per_row", "accuracy",
          "delta_accuracy_points", "within", "agreement", "loss",
          "delta_loss", "perplexity", "rel_perplexity", "max_rel_logit_diff"]
  fmts = {"accuracy": ".4f", "delta_accuracy_points": "+.2f",
          "agreement": ".4f", "loss": ".4f", "delta_loss": "+.4f",
          "perplexity": ".3f", "rel_perplexity": "+.2e",
          "max_rel_logit_diff": ".2e"}
  lines += ["## All runs", "",
            "agreement: share of scored positions where the greedy "
            "prediction equals the reference's; max_rel_logit_diff: max "
            "|logit - reference logit| / max |reference logit| over all "
            "positions.", "",
            common.markdown_table([r for r in records
                                   if r["kind"] in ("replay", "baseline")],
                                  cols, fmts),
            ""]
  gen = [r for r in records if r["kind"] == "generation"]
  if gen:
    g = config.generation
    lines += [
        "## Long generation", "",
        f"{g.num_prompts} prompts of {g.prompt_len} tokens, "
        f"{g.new_tokens} new tokens each, against the f32 baseline's; "
        f"sampled at temperature {g.temperature:g} with the same PRNG key "
        "in every run. agreement: share of tokens equal to the "
        "reference's; first divergence: index of a row's first differing "
        "token (median / min over rows).", "",
        common.markdown_table(gen, [
            "model", "mode", "run_kind", "label", "L", "agreement",
            "first_divergence_median", "first_divergence_min",
            "never_diverged"], dict(agreement=".4f", never_diverged=".2f",
                                    first_divergence_median=".0f")), ""]
  return common.write_summary(workdir, "\n".join(lines))


def _plot(config, workdir, models, records) -> str:
  n = len(models)
  fig, axes = common.new_figure(2, n, figsize=(6.5 * n, 8.0))
  Ls = list(config.buffer_lens)
  for j, info in enumerate(models):
    mine = [r for r in records if r["model"] == info["model"]]
    bl = {(r["storage_dtype"], r["rounding"]): r for r in mine
          if r["kind"] == "baseline"}
    for i, (metric, ylabel) in enumerate((
        ("delta_accuracy_points", "accuracy - f32 reference (points)"),
        ("disagreement_pct", "greedy predictions != f32 reference (%)"))):
      ax = axes[i][j]
      for k, pname in enumerate(_table_policies(config)):
        color = f"C{k % 10}"
        rs = sorted((r for r in mine if r["kind"] == "replay"
                     and r["policy"] == pname), key=lambda r: r["L"])

        def val(r):
          if metric == "disagreement_pct":
            return 100.0 * (1.0 - r["agreement"])
          return r[metric]

        ax.plot([r["L"] for r in rs], [val(r) for r in rs], "o-",
                color=color, label=pname)
        key = baseline_key(make_policy(pname, config))
        b = bl.get(key)
        if b is None and key == ("float32", "rn"):  # the reference itself
          b = dict(delta_accuracy_points=0.0, agreement=1.0)
        if b is not None and config.baseline_contrast:
          ax.plot([1], [val(b)], "s", mfc="none", color=color)
      if metric == "delta_accuracy_points":
        ax.axhspan(-config.within_points, config.within_points,
                   color="0.9", zorder=0)
      ax.set_xscale("log", base=2)
      ax.set_xticks([1] + Ls)
      ax.set_xticklabels(["1 (baseline)"] + [str(L) for L in Ls])
      ax.set_xlabel("buffer length L (hollow squares: baseline stored "
                    "every step)")
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
      if i == 0:
        ax.set_title(f"{info['model']} (seq_len {info['seq_len']})")
        ax.legend(fontsize=7, ncol=2)
  return common.save_plot(fig, os.path.join(workdir, "accuracy_delta.png"))


# ------------------------------------------------------------------- run
def _check_config(config):
  if not config.models:
    raise ValueError("config.models must list at least one model.")
  for raw in config.models:
    model_entry(raw)
  for L in config.buffer_lens:
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
      raise ValueError(f"config.buffer_lens must hold ints >= 1, got {L!r}.")
  for name in _table_policies(config):
    make_policy(name, config)  # raises naming the preset / field


def run(config, workdir: str) -> dict:
  """Runs the accuracy study into `workdir`; returns the records."""
  t_start = time.perf_counter()
  _check_config(config)
  workdir, _, writer = common.start_run(workdir, config)
  records, models = [], []
  for entry in map(model_entry, config.models):
    model, task, path = load_model(entry, workdir, config.train_missing)
    info = writer.write(kind="model", model=entry.name, task=task.name,
                        seq_len=task.seq_len, train_workdir=path,
                        pattern=model.config.pattern,
                        d_model=model.config.d_model,
                        task_spec=task.to_dict())
    info = dict(info)
    models.append(info)
    logging.info("model %s: %s, pattern %s, eval seq_len %d", entry.name,
                 task.name, model.config.pattern, task.seq_len)
    records += evaluate_model(entry, model, task, config, writer)
  text = _report(config, workdir, models, records)
  _plot(config, workdir, models, records)
  common.log_block(text)
  wall = time.perf_counter() - t_start
  writer.write(kind="final", wall_s=wall)
  logging.info("precision_accuracy finished in %.1fs; outputs in %s", wall,
               workdir)
  return dict(workdir=workdir, records=records, models=models, wall_s=wall)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/precision_accuracy")
