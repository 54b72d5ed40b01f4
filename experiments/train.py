r"""Trains a small hybrid LM on a synthetic task (MQAR or char-level LM).

Usage (see configs/train.py for the named sizes):
  python -m experiments.train --config=configs/train.py:mqar_small \
      --workdir=runs/train/mqar_small

Training: optax AdamW (weight decay on matrices only) with linear warmup +
cosine decay and global-norm gradient clipping; one jit-compiled train step
over the model's split parameters (`nnx.split` -> graphdef static, params
and optimizer state donated); batches from `replayssm_jax.tasks` (a pure
function of seed and step). Periodic evaluation on fixed validation batches
(MQAR: query accuracy; char: per-character cross-entropy / perplexity);
after training a decode-mode cross-check (prefill + teacher-forced
`decode_step`, baseline and replay state).

Outputs in --workdir:
  config.json         the full ml_collections config;
  model_config.json   the `ModelConfig` fields; task.json the task spec;
  tokenizer.json      text tasks: the corpus's tokenizer;
  metrics.jsonl       kind=environment | train (loss, lr, grad_norm,
                      step_time_s, tokens_per_s) | eval (full-forward
                      metrics) | decode_eval | final (with `recipe`: config
                      file and arg, seed, corpus sha256, token budget) |
                      paused;
  training.png        train/eval loss and the task's eval metric vs step;
  summary.md          the final metrics and how to rebuild the run;
  checkpoints/<step>/ the parameters, saved with orbax
                      (`orbax.checkpoint.StandardCheckpointer`, a flat dict
                      "blocks.0.mixer.A_log" -> array); the last step is
                      always saved;
  train_state/        with train.resume: the newest optimizer state
                      (`experiments.train_lib.resume`).

Long runs under a per-command time limit: train.resume=True and
train.stop_after_s=<seconds> make each call stop at a step boundary after
that long, saving parameters and optimizer state; the same command then
continues from there (the data order is a pure function of the step), and
once finished returns at once. With several local devices each step runs
data-parallel (train.data_parallel, default on).

Reload for evaluation (no ml_collections config file needed):
  model, task, config = experiments.train.load_trained(workdir)

orbax-checkpoint is a dependency of flax itself, so it is present wherever
the `models` extra is installed (CPU CI and the GPU machine alike).
"""

from __future__ import annotations

import json
import os
import shutil
import time

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from experiments import common
from experiments.train_lib import resume as train_resume
from replayssm_jax import tasks
from replayssm_jax.models import HybridLM, ModelConfig

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "train.py")
CHECKPOINT_DIR = "checkpoints"
# optax.tree.norm (optax >= 0.2.5) replaces the deprecated global_norm.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or (
    optax.global_norm)


# ------------------------------------------------------------------ setup
def model_config(config) -> ModelConfig:
  """The `ModelConfig` of a train config (config.model as plain values)."""
  fields = config.model.to_dict() if hasattr(config.model, "to_dict") else (
      dict(config.model))
  return ModelConfig(**fields)


def build(config) -> tuple[tasks.Task, ModelConfig]:
  """(task, ModelConfig) of a train config; checks they fit together."""
  task = tasks.make_task(config.task)
  cfg = model_config(config)
  if cfg.vocab_size < task.vocab_size:
    raise ValueError(f"model vocab_size ({cfg.vocab_size}) must be >= the "
                     f"task's vocab_size ({task.vocab_size}).")
  return task, cfg


def make_optimizer(tc, params) -> tuple[optax.GradientTransformation,
                                        optax.Schedule]:
  """AdamW + warmup/cosine schedule + global-norm clipping.

  Weight decay applies to parameters with ndim >= 2 (projection and
  embedding matrices), not to norms, A_log, D, dt_bias or conv biases.
  """
  if tc.num_steps < 1:
    raise ValueError(f"train.num_steps must be >= 1, got {tc.num_steps}.")
  if not 0 <= tc.warmup_steps < tc.num_steps:
    raise ValueError(f"train.warmup_steps must lie in [0, num_steps), got "
                     f"{tc.warmup_steps} (num_steps {tc.num_steps}).")
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate,
      warmup_steps=max(tc.warmup_steps, 1), decay_steps=tc.num_steps,
      end_value=tc.learning_rate * tc.end_lr_fraction)
  decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
  parts = []
  if tc.grad_clip:
    parts.append(optax.clip_by_global_norm(tc.grad_clip))
  parts.append(optax.adamw(schedule, b1=tc.b1, b2=tc.b2,
                           weight_decay=tc.weight_decay, mask=decay_mask,
                           mu_dtype=jnp.float32))
  return optax.chain(*parts), schedule


def make_train_step(graphdef, tx):
  """jit-compiled (params, opt_state, batch) -> (params, opt_state,
  metrics); params and opt_state are donated."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"])
    return tasks.masked_loss(logits, batch["targets"], batch["mask"])

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(loss=loss, grad_norm=_tree_norm(grads))

  return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------ checkpoints
def _flat_params(params) -> dict:
  return {".".join(map(str, path)): var.get_value()
          for path, var in nnx.to_flat_state(params)}


def save_checkpoint(workdir: str, step: int, params) -> str:
  """Saves params (an nnx.State) as `<workdir>/checkpoints/<step>` with
  orbax; returns the path."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR, str(step))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, _flat_params(params), force=True)
  logging.info("checkpoint: %s", path)
  return path


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps with a complete checkpoint in `workdir`, ascending."""
  root = os.path.join(workdir, CHECKPOINT_DIR)
  if not os.path.isdir(root):
    return []
  return sorted(int(n) for n in os.listdir(root)
                if n.isdigit() and os.path.isdir(os.path.join(root, n)))


def restore_model(cfg: ModelConfig, path: str) -> HybridLM:
  """A HybridLM of `cfg` with the parameters saved at `path`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = list(nnx.to_flat_state(state))
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {".".join(map(str, p)): jax.ShapeDtypeStruct(
      v.get_value().shape, v.get_value().dtype, sharding=sharding)
            for p, v in flat}
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(os.path.abspath(path), target)
  missing = sorted(set(target) - set(restored))
  if missing:
    raise ValueError(f"checkpoint {path} lacks parameters {missing[:5]}.")
  new = [(p, v.replace(jnp.asarray(restored[".".join(map(str, p))])))
         for p, v in flat]
  return nnx.merge(graphdef, nnx.from_flat_state(new))


# ModelConfig fields a trained model may be loaded with other values of:
# they change how its parameters compute, not which parameters it has.
LOAD_MODEL_OVERRIDES = ("dtype", "scan_precision", "gdn_solve")


def load_trained(workdir: str, step: int | None = None,
                 task_overrides: dict | None = None,
                 model_overrides: dict | None = None
                 ) -> tuple[HybridLM, tasks.Task, ml_collections.ConfigDict]:
  """(model, task, config) of a training run's workdir.

  Args:
    workdir: the --workdir of an `experiments.train` run.
    step: the checkpoint step to load (default: the latest).
    task_overrides: task fields to replace before the task is built (e.g.
      a text model's corpus_dir, to score it on another copy or an excerpt
      of its corpus); the returned config keeps the run's own.
    model_overrides: ModelConfig fields among LOAD_MODEL_OVERRIDES to
      replace (e.g. {"dtype": "float32"}: a bf16-trained model computing
      in f32); the returned config keeps the run's own.

  Returns:
    The HybridLM with the trained parameters, the task (`tasks.make_task`
    of task.json) and the run's config (a ConfigDict from config.json).
  """
  workdir = os.path.abspath(workdir)
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no config.json in {workdir}: not the workdir "
                            f"of an experiments.train run.")
  with open(path) as f:
    raw = json.load(f)
  config = ml_collections.ConfigDict(raw)
  if task_overrides:
    raw["task"] = dict(raw["task"], **task_overrides)
  unknown = sorted(set(model_overrides or ()) - set(LOAD_MODEL_OVERRIDES))
  if unknown:
    raise ValueError(f"model_overrides may set {LOAD_MODEL_OVERRIDES} (the "
                     f"fields that keep the trained parameters), got "
                     f"{unknown}.")
  if model_overrides:
    raw["model"] = dict(raw["model"], **model_overrides)
  task, cfg = build(ml_collections.ConfigDict(raw))
  steps = checkpoint_steps(workdir)
  if not steps:
    raise FileNotFoundError(f"no checkpoint under "
                            f"{os.path.join(workdir, CHECKPOINT_DIR)}.")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"no checkpoint for step {step}; saved steps: {steps}.")
  model = restore_model(cfg, os.path.join(workdir, CHECKPOINT_DIR, str(step)))
  return model, task, config


# ---------------------------------------------------------------- report
def _plot(workdir: str, task: tasks.Task, history: list[dict],
          evals: list[dict]) -> str:
  fig, axes = common.new_figure(1, 2, figsize=(11, 4.2))
  ax = axes[0][0]
  ax.plot([h["step"] for h in history], [h["loss"] for h in history],
          label="train (interval mean)")
  ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-",
          label="eval")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats)")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  ax = axes[0][1]
  metric = "accuracy" if task.headline_metric == "accuracy" else (
      "bits_per_token")
  ax.plot([e["step"] for e in evals], [e[metric] for e in evals], "o-")
  ax.set_xlabel("step")
  ax.set_ylabel(f"eval {metric}" + (" (queries)" if task.name == "mqar"
                                    else " (bits per char)"))
  ax.grid(True, alpha=0.3)
  fig.suptitle(f"{task.name}: {os.path.basename(workdir)}")
  return common.save_plot(fig, os.path.join(workdir, "training.png"))


def _recipe_lines(r: dict) -> list[str]:
  """The summary's "Rebuild" section: the commands and the hashes that
  make the same parameters again."""
  lines = ["## Rebuild", ""]
  if r["corpus_sha256"]:
    lines += [f"Corpus sha256 `{r['corpus_sha256']}` "
              "(`python -m experiments.build_corpus "
              "--config=configs/corpus.py --workdir=runs/corpus`; "
              "manifest.json holds the hash).", ""]
  if r["config_file"]:
    lines += ["```",
              f"python -m experiments.train --config={r['config_file']}:"
              f"{r['config_arg']} --workdir=<workdir>",
              "```", ""]
  lines += [f"Seed {r['seed']}; {r['num_steps']} steps x batch "
            f"{r['batch_size']} x {r['seq_len']} tokens = "
            f"{r['token_budget']:,} training tokens; {r['num_params']:,} "
            "parameters.", ""]
  return lines


def _summary(workdir, config, cfg, n_params, final) -> str:
  rows = [dict(mode=r["mode"], **{k: r[k] for k in (
      "loss", "accuracy", "perplexity", "bits_per_token", "num_targets")})
          for r in final["evals"]]
  table = common.markdown_table(
      rows, ["mode", "loss", "accuracy", "perplexity", "bits_per_token",
             "num_targets"],
      {"loss": ".4f", "accuracy": ".4f", "perplexity": ".3f",
       "bits_per_token": ".4f"})
  text = "\n".join([
      f"# Training run `{config.name}`",
      "",
      f"Task: `{json.dumps(common.to_jsonable(config.task))}`",
      "",
      f"Model: d_model {cfg.d_model}, pattern `{cfg.pattern}`, "
      f"{n_params:,} parameters, {cfg.param_dtype} params, {cfg.dtype} "
      f"activations.",
      "",
      f"{config.train.num_steps} steps x batch {config.train.batch_size} in "
      f"{final['train_s']:.1f} s ({final['step_time_s'] * 1e3:.1f} ms per "
      f"step after compilation).",
      "",
      table,
      "",
  ] + _recipe_lines(final["recipe"]))
  return common.write_summary(workdir, text)


# ------------------------------------------------------------------- run
def _placement(tc, batch_size: int):
  """(put_state, put_batch, devices): with train.data_parallel (default on)
  and several local devices, parameters and optimizer state replicated
  and each batch split over a one-axis "data" mesh (jit then runs the
  step data-parallel: XLA inserts the gradient all-reduce); else
  identities."""
  n = jax.local_device_count()
  if n == 1 or not tc.get("data_parallel", True):
    return (lambda t: t), (lambda b: b), 1
  if batch_size % n:
    raise ValueError(f"train.batch_size ({batch_size}) must be a multiple "
                     f"of the {n} local devices (or set "
                     f"train.data_parallel=False).")
  # Auto axes: XLA's sharding propagation places every intermediate (the
  # embedding gather, the activations) after the batch split.
  mesh = jax.make_mesh((n,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  split = jax.sharding.NamedSharding(mesh,
                                     jax.sharding.PartitionSpec("data"))
  return ((lambda t: jax.device_put(t, rep)),
          (lambda b: jax.device_put(b, split)), n)


def recipe(config, task: tasks.Task, n_params: int) -> dict:
  """How to rebuild the run: config file and arg, seed, the corpus hash
  (text tasks), the token budget and the parameter count."""
  tc = config.train
  return dict(config_file=config.get("config_file", ""),
              config_arg=config.get("name", ""), seed=int(config.seed),
              corpus_sha256=task.to_dict().get("corpus_sha256", ""),
              num_steps=int(tc.num_steps), batch_size=int(tc.batch_size),
              seq_len=int(task.seq_len),
              token_budget=int(tc.num_steps * tc.batch_size * task.seq_len),
              num_params=int(n_params))


def run(config, workdir: str) -> dict:
  """Trains per `config` into `workdir`; returns a summary dict (workdir,
  history, evals, final, checkpoint, finished).

  With train.resume, a workdir holding an earlier call of the same config
  continues from its newest saved step (`experiments.train_lib.resume`); with
  train.stop_after_s > 0, the call stops after that many seconds at a step
  boundary, saving the parameters and optimizer state (finished False), so
  that a call repeated until finished trains within a per-call time limit.
  """
  t_start = time.perf_counter()
  task, cfg = build(config)
  common.avoid_cpu_lapack_stall(cfg.block_kinds)  # before jax starts
  tc = config.train
  for name in ("batch_size", "log_every", "eval_every", "eval_batches",
               "eval_batch_size"):
    if tc[name] < 1:
      raise ValueError(f"train.{name} must be >= 1, got {tc[name]}.")
  stop_after = float(tc.get("stop_after_s", 0) or 0)
  resume = bool(tc.get("resume", False))
  workdir = os.path.abspath(workdir)
  start = train_resume.resume_step(workdir, config, checkpoint_steps(workdir))
  if start == tc.num_steps:
    logging.info("%s: already trained to step %d", workdir, start)
    return dict(workdir=workdir, finished=True, resumed_from=start,
                checkpoint=os.path.join(workdir, CHECKPOINT_DIR, str(start)))
  kept = train_resume.trim_metrics(workdir, start) if start else []
  workdir = common.prepare_workdir(workdir, config)
  env = common.log_environment()
  writer = common.MetricsWriter(workdir, truncate=not start)
  writer.write(kind="environment", resumed_from=start, **env)
  ckpt_root = os.path.join(workdir, CHECKPOINT_DIR)
  if not start:
    for root in (ckpt_root, os.path.join(workdir,
                                         train_resume.TRAIN_STATE_DIR)):
      if os.path.isdir(root):  # a previous run's: would mix with ours
        logging.info("removing old checkpoints in %s", root)
        shutil.rmtree(root)
  for name, obj in (("model_config.json", cfg), ("task.json",
                                                 task.to_dict())):
    with open(os.path.join(workdir, name), "w") as f:
      json.dump(common.to_jsonable(obj), f, indent=2, sort_keys=True)
  tokenizer = os.path.join(getattr(task, "corpus_dir", ""), "tokenizer.json")
  if getattr(task, "corpus_dir", "") and os.path.exists(tokenizer):
    shutil.copy(tokenizer, workdir)  # the text model's tokenizer beside it

  put_state, put_batch, n_dev = _placement(tc, tc.batch_size)
  if start:
    model = restore_model(cfg, os.path.join(ckpt_root, str(start)))
  else:
    model = HybridLM(cfg, rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model)
  del model
  n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
  logging.info("task %s, model d_model %d pattern %s: %s parameters "
               "(%d device(s))", task.name, cfg.d_model, cfg.pattern,
               f"{n_params:,}", n_dev)
  tx, schedule = make_optimizer(tc, params)
  opt_state = tx.init(params)
  totals = dict(train_s=0.0, steps_timed=0, compile_s=None)
  if start:
    opt_state, meta = train_resume.restore(workdir, start, opt_state)
    totals.update({k: meta[k] for k in totals if k in meta})
    logging.info("resumed from step %d (%s)", start, workdir)
  params, opt_state = put_state(params), put_state(opt_state)
  train_step = make_train_step(graphdef, tx)
  eval_batches = task.eval_batches(tc.eval_batches, tc.eval_batch_size)
  tokens_per_step = tc.batch_size * task.seq_len

  def evaluate(step):
    t0 = time.perf_counter()
    m = task.evaluate(nnx.merge(graphdef, params), eval_batches)
    rec = writer.write(kind="eval", step=step, eval_s=time.perf_counter() - t0,
                       **m)
    logging.info("eval step %d: loss %.4f, accuracy %.4f, ppl %.3f", step,
                 m["loss"], m["accuracy"], m["perplexity"])
    return rec

  def save(step):
    path = save_checkpoint(workdir, step, params)
    if resume:
      train_resume.save(workdir, step, opt_state, totals)
    return path

  history = [r for r in kept if r.get("kind") == "train"]
  evals = [r for r in kept if r.get("kind") == "eval"] or [evaluate(0)]
  interval_losses, t_interval = [], None
  # Step timing excludes compilation (the call's first step), evals and
  # checkpoints: n_since steps ran since t_interval; int_* accumulate the
  # log interval; totals sum over every call of a resumed run.
  n_since = int_steps = 0
  int_time = 0.0
  first = (start or 0) + 1
  stopped = None
  for step in range(first, tc.num_steps + 1):
    batch = put_batch(task.batch(step - 1, tc.batch_size, "train"))
    if step == first:
      t0 = time.perf_counter()
      params, opt_state, m = train_step(params, opt_state, batch)
      jax.block_until_ready(m)
      compile_s = time.perf_counter() - t0
      if totals["compile_s"] is None:
        totals["compile_s"] = compile_s
      logging.info("first step (compilation included): %.2fs", compile_s)
      t_interval = time.perf_counter()
    else:
      params, opt_state, m = train_step(params, opt_state, batch)
      n_since += 1
    interval_losses.append(m["loss"])
    stop = (stop_after > 0 and step < tc.num_steps
            and time.perf_counter() - t_start > stop_after)
    if step % tc.log_every == 0 or step == tc.num_steps or stop:
      losses = np.asarray(jax.device_get(interval_losses), np.float64)
      now = time.perf_counter()
      int_time += now - t_interval
      int_steps += n_since
      t_interval, n_since = now, 0
      dt = int_time / int_steps if int_steps else float("nan")
      totals["train_s"] += int_time
      totals["steps_timed"] += int_steps
      rec = writer.write(kind="train", step=step, loss=float(losses.mean()),
                         last_loss=float(losses[-1]),
                         lr=float(schedule(step - 1)),
                         grad_norm=float(m["grad_norm"]), step_time_s=dt,
                         tokens_per_s=tokens_per_step / dt)
      history.append(rec)
      if not np.isfinite(rec["loss"]):
        raise FloatingPointError(f"training loss is {rec['loss']} at step "
                                 f"{step}; lower train.learning_rate.")
      logging.info("step %d/%d: loss %.4f, lr %.2e, grad norm %.3f, "
                   "%.1f ms/step, %.0f tokens/s", step, tc.num_steps,
                   rec["loss"], rec["lr"], rec["grad_norm"], dt * 1e3,
                   rec["tokens_per_s"])
      interval_losses, int_time, int_steps = [], 0.0, 0
    if stop:
      save(step)
      stopped = step
      break
    do_eval = step % tc.eval_every == 0 or step == tc.num_steps
    do_ckpt = bool(tc.checkpoint_every) and step % tc.checkpoint_every == 0 \
        and step != tc.num_steps
    if do_eval or do_ckpt:
      if n_since:  # close the running timing before the pause
        jax.block_until_ready(params)
        int_time += time.perf_counter() - t_interval
        int_steps += n_since
      if do_eval:
        evals.append(evaluate(step))
      if do_ckpt:
        save(step)
      t_interval, n_since = time.perf_counter(), 0
  if stopped is not None:
    wall = time.perf_counter() - t_start
    writer.write(kind="paused", step=stopped, num_steps=tc.num_steps,
                 wall_s=wall, resume=resume)
    _plot(workdir, task, history, evals)
    common.write_summary(workdir, (
        f"# Training run `{config.name}` (paused)\n\nStopped at step "
        f"{stopped} of {tc.num_steps} after {wall:.0f} s "
        f"(train.stop_after_s {stop_after:g}); the same command continues "
        f"it.\n"))
    logging.info("stopped at step %d of %d after %.0f s (stop_after_s); "
                 "run again to continue", stopped, tc.num_steps, wall)
    return dict(workdir=workdir, history=history, evals=evals,
                finished=False, step=stopped,
                checkpoint=os.path.join(ckpt_root, str(stopped)))
  ckpt = save_checkpoint(workdir, tc.num_steps, params)

  # Decode-mode cross-check of the trained model (f32 states).
  model = nnx.merge(graphdef, params)
  final_evals = [dict(mode="forward", **{k: v for k, v in evals[-1].items()
                                         if k not in ("kind", "step",
                                                      "eval_s")})]
  if tc.decode_eval_batches:
    dec_batches = eval_batches[:tc.decode_eval_batches]
    # The forward pass on the decode batches alone: the decode modes'
    # like-for-like comparison (the forward row above averages all the
    # eval batches).
    final_evals.append(dict(mode="forward, decode batches",
                            **task.evaluate(model, dec_batches)))
    for mode in ("baseline", "replay"):
      t0 = time.perf_counter()
      m = task.decode_evaluate(model, dec_batches, mode,
                               tc.decode_buffer_len)
      rec = writer.write(kind="decode_eval", step=tc.num_steps, mode=mode,
                         buffer_len=tc.decode_buffer_len,
                         num_batches=len(dec_batches),
                         eval_s=time.perf_counter() - t0, **m)
      logging.info("decode eval (%s): loss %.4f, accuracy %.4f", mode,
                   m["loss"], m["accuracy"])
      final_evals.append(dict(mode=f"decode {mode}", **m))
  step_time = totals["train_s"] / max(totals["steps_timed"], 1)
  final = dict(kind="final", step=tc.num_steps, num_params=n_params,
               compile_s=totals["compile_s"], train_s=totals["train_s"],
               step_time_s=step_time, resumed_from=start,
               initial_eval_loss=evals[0]["loss"],
               final_eval_loss=evals[-1]["loss"],
               final_eval_accuracy=evals[-1]["accuracy"],
               evals=final_evals, checkpoint=ckpt,
               recipe=recipe(config, task, n_params),
               wall_s=time.perf_counter() - t_start)
  writer.write(final)
  _plot(workdir, task, history, evals)
  common.log_block(_summary(workdir, config, cfg, n_params, final))
  logging.info("train finished in %.1fs; outputs in %s", final["wall_s"],
               workdir)
  return dict(workdir=workdir, history=history, evals=evals, final=final,
              checkpoint=ckpt, model=model, task=task, finished=True)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/train")
