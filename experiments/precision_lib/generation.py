"""Long generations of each decode configuration against the f32
baseline's.

Per model: prompts are the first `generation.prompt_len` tokens of
validation windows; `generate` runs `generation.new_tokens` tokens per
prompt with the f32 baseline state (the reference) and with each decode
configuration (`runs.sub_runs(config, config.generation)`), greedy
and sampled (temperature `generation.temperature`, the same PRNG key in
every run, so two runs draw the same random numbers and part only where
their distributions do). Greedy agreement measures how often rounding
flips an argmax and sends the continuation elsewhere; sampled agreement,
how often it moves a draw.
"""

from __future__ import annotations

import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments.precision_lib import runs as R
from experiments.precision_lib import shared
from replayssm_jax import tasks
from replayssm_jax.models import generate


def prompts(task, config, rows: int | None = None):
  """[rows, prompt_len] int32 prompts (rows default generation.num_prompts):
  validation windows' first tokens."""
  g = config.generation
  n = rows or g.num_prompts
  return task.batch(0, n, "val")["inputs"][:, :g.prompt_len]


def divergence(tokens, ref, margins=None) -> dict:
  """Agreement and first-divergence statistics of [n, T] tokens vs ref;
  with the reference's [n, T] top-2 logit margins (`reference_margins`),
  also the margin at each diverged row's first divergence (median / max:
  a greedy run that leaves the reference where its two best tokens nearly
  tie was decided by rounding anywhere in the model)."""
  tokens, ref = np.asarray(tokens), np.asarray(ref)
  same = tokens == ref
  n, t = same.shape
  first = np.where(same.all(1), t, np.argmin(same, axis=1))
  out = dict(agreement=float(same.mean()),
             first_divergence_median=float(np.median(first)),
             first_divergence_min=int(first.min()),
             never_diverged=float(np.mean(first == t)), rows=int(n),
             new_tokens=int(t))
  if margins is not None:
    rows = np.flatnonzero(first < t)
    at = np.asarray(margins)[rows, first[rows]]
    out.update(divergence_margin_median=(float(np.median(at)) if rows.size
                                         else None),
               divergence_margin_max=float(at.max()) if rows.size else None)
  return out


def reference_margins(model, p, ref) -> np.ndarray:
  """[n, T] the reference's top-1 minus top-2 logit at each generated
  position: the f32 baseline decode teacher-forced along prompt +
  reference tokens (the prompt prefilled, then one step a token, as the
  reference generation ran: memory linear in the length, where a forward
  pass over the whole sequence holds attention scores quadratic in it)."""
  p, ref = np.asarray(p), np.asarray(ref)
  seq = np.concatenate([p, ref], axis=1)[:, :-1]
  logits = np.asarray(tasks.decode_logits(
      model, seq, "baseline", 1, prefill_len=p.shape[1]))[:, p.shape[1] - 1:]
  top2 = np.partition(logits, -2, axis=-1)[..., -2:]
  return top2[..., 1] - top2[..., 0]


def generate_run(model, p, config, mode, run: R.Run | None,
                 new_tokens: int | None = None):
  """[n, new_tokens] tokens of one run (None: the f32 baseline)."""
  g = config.generation
  lengths = jnp.full((p.shape[0],), p.shape[1], jnp.int32)
  kw = {}
  if run is not None:
    kw["precision"] = run.policy
    if run.policy.stochastic_rounding:
      kw["row_ids"] = np.arange(p.shape[0], dtype=np.int32)
  if mode == "sampled":
    kw.update(temperature=float(g.temperature),
              rng=jax.random.PRNGKey(config.seed + 7))
  tokens, _ = generate(
      model, jnp.asarray(p), lengths, int(new_tokens or g.new_tokens),
      ssm_mode="baseline" if run is None else run.ssm_mode,
      buffer_len=1 if run is None else run.buffer_len, **kw)
  return np.asarray(tokens)


def reference_run(name, model, p, config, mode, new_tokens=None,
                  with_margins=False) -> dict[str, np.ndarray]:
  """The f32 baseline's generation of prompts p ("tokens"; with_margins:
  "margins" too, `reference_margins`), computed once for every process
  of a split study that shares `config.shared_dir` (shared.py)."""
  n = int(new_tokens or config.generation.new_tokens)

  def compute():
    t0 = time.perf_counter()
    out = dict(tokens=generate_run(model, p, config, mode, None, n))
    if with_margins:
      out["margins"] = reference_margins(model, p, out["tokens"])
    logging.info("%s %s reference generation: %d x %d tokens in %.1fs",
                 name, mode, *out["tokens"].shape, time.perf_counter() - t0)
    return out

  def key():
    return shared.key(name, f"{mode}_reference", prompts=np.asarray(p),
                      new_tokens=n, with_margins=with_margins,
                      seed=config.seed,
                      temperature=float(config.generation.temperature),
                      model_config=repr(model.config),
                      params=shared.fingerprint(model))

  return shared.computed_once(config.get("shared_dir", ""), key, compute)


def agreement(name, model, task, config, writer) -> list[dict]:
  """Long-generation records of one model (agreement: share of tokens
  equal to the reference's at the same position; first divergence per
  row: the index of its first differing token, new_tokens if none)."""
  p = prompts(task, config)
  runs = R.sub_runs(config, config.generation)
  records = []
  for mode in config.generation.modes:
    idents = [dict(kind="generation", model=name, mode=mode,
                   run_kind=run.kind, label=run.label, L=run.buffer_len)
              for run in runs]
    records += filter(None, map(writer.done, idents))  # a resumed study's
    todo = [(r, i) for r, i in zip(runs, idents) if not writer.done(i)]
    if not todo:
      continue
    reference = reference_run(name, model, p, config, mode,
                              with_margins=mode == "greedy")
    ref, margins = reference["tokens"], reference.get("margins")
    ref_margin = ({} if margins is None else
                  dict(ref_margin_median=float(np.median(margins))))
    for run, ident in todo:
      t0 = time.perf_counter()
      out = generate_run(model, p, config, mode, run)
      rec = writer.write(dict(
          ident, policy=run.policy_name, prompt_len=p.shape[1],
          temperature=(float(config.generation.temperature)
                       if mode == "sampled" else 0.0),
          eval_s=time.perf_counter() - t0, **ref_margin,
          **divergence(out, ref, margins)))
      records.append(rec)
      R.release_compiled()
      logging.info("%s %s %-8s %-12s L=%-4s agreement %.4f, first "
                   "divergence median %.0f", name, mode, run.kind,
                   run.label, run.L or "-", rec["agreement"],
                   rec["first_divergence_median"])
  return records
