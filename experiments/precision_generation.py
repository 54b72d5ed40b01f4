"""Long-generation agreement under decode-state precision policies (part of
experiments/precision_accuracy.py's study).

For one trained model: prompts are the first `generation.prompt_len`
tokens of validation windows; `generate` runs `generation.new_tokens`
tokens per prompt with the f32 baseline state (the reference) and with
each policy x L replay state (and each every-step low-precision
baseline), greedy and sampled (temperature `generation.temperature`, the
same PRNG key for every run, so two runs draw the same random numbers and
part only where their distributions do). Per run and mode:

  agreement          share of generated tokens equal to the reference's
                     at the same position;
  first_divergence   per row, the index of the first token that differs
                     (new_tokens when none does): median, min and the
                     share of rows that never diverge.

Greedy agreement measures how often rounding flips an argmax and sends the
continuation elsewhere; sampled agreement, how often it moves a draw.
"""

from __future__ import annotations

import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.models import generate


def prompts(task, config):
  """[n, prompt_len] int32 prompts: validation windows' first tokens."""
  g = config.generation
  rows, out, i = g.num_prompts, [], 0
  while sum(len(b) for b in out) < rows:
    out.append(task.batch(i, rows, "val")["inputs"][:, :g.prompt_len])
    i += 1
  return np.concatenate(out)[:rows].astype(np.int32)


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


def _generate(model, p, config, mode, ssm_mode, buffer_len, policy):
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
  """Agreement records of one model. runs: (kind, label, policy or None,
  ssm_mode, L) per decode configuration besides the reference."""
  p = prompts(task, config)
  records = []
  for mode in config.generation.modes:
    ref = _generate(model, p, config, mode, "baseline", 1, None)
    for kind, label, policy, ssm_mode, L in runs:
      t0 = time.perf_counter()
      out = _generate(model, p, config, mode, ssm_mode, L, policy)
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
