r"""Speculative-decoding throughput: replay rollback vs snapshot baseline.

For each batch: random prompts, then
  * plain: `generate` (replay state, one token per step), and with
    `bench.plain_baseline` also "plain_baseline": `generate` with the
    baseline (full) SSM state;
  * for each window T, compaction (`bench.compactions`: how many times the
    loop may halve its batch as rows finish) and ssm_mode ("baseline": one
    full SSM state per window position, rollback selects one; "replay":
    verify from checkpoint + buffer, rollback moves the counter):
    `speculative_generate` with the same proposer;
all greedy, or all sampling at `bench.temperature` (see bench.proposer).
The proposer sets the acceptance rate, so every mode sees the same
(reported) acceptance length and the proposer itself costs nothing: the
figures isolate the target's verify/commit cost. `bench.proposer`:
  * "greedy_oracle": greedy decoding; drafts are the plain run's own
    continuation, each corrupted with probability 1 - accept_prob. Exact in
    f32 (the smoke test checks every mode reproduces the plain tokens), but
    with a random-weight bf16 target the spec runs drift from the plain
    tokens at near-ties and acceptance collapses;
  * "flat_sampling" (full runs): every mode samples at a high temperature
    and `FlatOracleProposer` declares a draft distribution that speculative
    sampling accepts with probability accept_prob per draft, whatever the
    numerics (see the class).
Each run is timed end to end (best of `repeats` after a
compile + warm-up run). tokens_per_s counts decode only, batch *
new_tokens / (total - prefill) with the prefill timed alone (None when the
prefill is over 95% of the run); e2e_tokens_per_s includes the prefill.
A batch of speculative runs lasts as long as its slowest row (rows accept
different numbers of drafts, so the slowest row needs more iterations
than the mean one), so steady_tokens_per_s also gives what every row
staying busy (continuous batching) would sustain: batch *
mean_accepted_length / (decode time per iteration); for plain decoding
it equals tokens_per_s, and a compacting run (compaction > 0, whose later
iterations run a smaller batch) has none.

Usage (see configs/specdec_bench.py):
  python -m experiments.specdec_bench --config=configs/specdec_bench.py \
      --workdir=runs/specdec_bench
  python -m experiments.specdec_bench --config=configs/specdec_bench.py:smoke \
      --workdir=runs/specdec_bench_smoke   # CPU, about a minute

Outputs in --workdir: config.json, metrics.jsonl (environment + one line
per run), summary.md, throughput.png.
"""

from __future__ import annotations

import itertools
import os

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.decode_bench import build_model
from replayssm_jax.models import ModelConfig, Proposal, Proposer
from replayssm_jax.models import (generate, kv_cache_len, prefill,
                                  speculative_generate)
from replayssm_jax.precision import PrecisionPolicy

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "specdec_bench.py")


@jax.tree_util.register_pytree_node_class
class OracleProposer(Proposer):
  """Drafts the reference continuation, each draft corrupted with
  probability 1 - accept_prob (a corrupted draft is never the reference
  token). With a target whose greedy output is the reference, a draft is
  accepted iff it and every earlier draft of the window are uncorrupted.

  Args:
    reference: [batch, N] int32 tokens the target generates greedily.
    accept_prob: probability that a draft is left intact.
    vocab_size: the target's vocabulary size.
  """

  def __init__(self, reference, accept_prob: float, vocab_size: int):
    if not 0.0 <= accept_prob <= 1.0:
      raise ValueError(f"accept_prob must lie in [0, 1], got "
                       f"{accept_prob!r}.")
    self.reference = reference
    self.accept_prob, self.vocab_size = float(accept_prob), int(vocab_size)

  def tree_flatten(self):
    return (self.reference,), (self.accept_prob, self.vocab_size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def init(self, prompt_tokens, prompt_lengths, **unused):
    # Per-row data lives in the proposer state, whose rows follow theirs
    # when the loop compacts its batch.
    return self.reference

  def propose(self, pstate, ctx, window, rng, sampling):
    del sampling
    reference = pstate
    n = reference.shape[1]
    t1 = window - 1
    # Reference position of the token after `last`: num_generated.
    idx = ctx.num_generated[:, None] + jnp.arange(t1)[None, :]
    drafts = jnp.take_along_axis(reference, jnp.clip(idx, 0, n - 1),
                                 axis=1)
    k1, k2 = jax.random.split(rng)
    bad = jax.random.uniform(k1, drafts.shape) >= self.accept_prob
    shift = jax.random.randint(k2, drafts.shape, 1, self.vocab_size)
    drafts = jnp.where(bad, (drafts + shift) % self.vocab_size, drafts)
    nd = jnp.clip(n - ctx.num_generated, 0, t1)
    return Proposal(drafts.astype(jnp.int32), nd.astype(jnp.int32),
                    None), pstate


@jax.tree_util.register_pytree_node_class
class FlatOracleProposer(Proposer):
  """Acceptance at a set rate for speculative *sampling* from a flat target.

  With a random-weight bf16 target, greedy drafts of a reference run stop
  matching once a parallel verify and single steps round a near-tie
  differently, and the greedy oracle's acceptance length falls towards one
  token per step. So the full benchmark samples at a high
  temperature, where the target's distribution p is nearly uniform (p(v) =
  (1 + O(logit / temperature)) / V), and this proposer draws uniform drafts
  d with a declared draft distribution q that puts mass 1 / (accept_prob V)
  on d: speculative sampling accepts a draft with probability min(1, p(d) /
  q(d)) = accept_prob (1 + O(logit / temperature)), independently per draft
  and whatever the numerics, and still emits exactly the target's
  distribution. Every mode runs the same acceptance rule and cost.

  Args:
    accept_prob: target acceptance probability of each draft, in [0, 1].
    vocab_size: the target's vocabulary size.
  """

  def __init__(self, accept_prob: float, vocab_size: int):
    if not 0.0 <= accept_prob <= 1.0:
      raise ValueError(f"accept_prob must lie in [0, 1], got "
                       f"{accept_prob!r}.")
    self.accept_prob, self.vocab_size = float(accept_prob), int(vocab_size)

  def tree_flatten(self):
    return (), (self.accept_prob, self.vocab_size)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def init(self, prompt_tokens, prompt_lengths, **unused):
    return ()

  def propose(self, pstate, ctx, window, rng, sampling):
    del sampling
    b, t1, v = ctx.num_generated.shape[0], window - 1, self.vocab_size
    drafts = jax.random.randint(rng, (b, t1), 0, v, jnp.int32)
    c = 1.0 if self.accept_prob == 0 else min(1.0,
                                                1.0 / (self.accept_prob * v))
    q = jnp.where(jax.nn.one_hot(drafts, v, dtype=jnp.bool_), c,
                  (1.0 - c) / (v - 1)).astype(jnp.float32)
    return Proposal(drafts, jnp.full((b,), t1, jnp.int32), q), pstate


def bench_batch(model, config, batch: int, writer) -> list[dict]:
  b, cfg = config.bench, model.config
  impl = b.implementation or None
  key = jax.random.PRNGKey(config.seed + batch)
  prompts = jax.random.randint(key, (batch, b.prompt_len), 0, cfg.vocab_size,
                               jnp.int32)
  lengths = jnp.full((batch,), b.prompt_len, jnp.int32)
  state_kw = dict(checkpoint_dtype=b.checkpoint_dtype)
  # Replay states (plain decoding and replay spec decoding) may carry a
  # precision policy; the snapshot baseline keeps checkpoint_dtype.
  replay_kw = dict(state_kw)
  if b.precision:
    policy = PrecisionPolicy.preset(b.precision)
    replay_kw = dict(precision=policy,
                     checkpoint_dtype=policy.checkpoint_dtype)
  n_new = b.new_tokens
  if b.proposer not in ("greedy_oracle", "flat_sampling"):
    raise ValueError(f"bench.proposer must be 'greedy_oracle' or "
                     f"'flat_sampling', got {b.proposer!r}.")
  # Greedy everywhere, or sampling at a high temperature everywhere.
  sampling = (dict(temperature=float(b.temperature),
                   rng=jax.random.PRNGKey(2))
              if b.proposer == "flat_sampling" else {})

  def run_prefill():
    st = model.init_state(batch,
                          kv_cache_len(b.prompt_len + n_new + max(b.windows)),
                          ssm_mode="replay", buffer_len=b.buffer_len,
                          **replay_kw)
    return prefill(model, prompts, lengths, st)[0]

  _, t_prefill, _ = common.best_of(lambda: run_prefill, b.repeats)
  (ref, _), t_plain, times = common.best_of(
      lambda: lambda: generate(model, prompts, lengths, n_new,
                               ssm_mode="replay", buffer_len=b.buffer_len,
                               implementation=impl, **sampling, **replay_kw),
      b.repeats)
  ref = jnp.asarray(ref)
  base = dict(kind="specdec", batch=batch, prompt_len=b.prompt_len,
              new_tokens=n_new, prefill_s=t_prefill)

  def record(**fields):
    # The preset of the states the run used: replay states only.
    precision = (b.precision or None) if fields["mode"] in (
        "plain", "replay") else None
    # Decode-only time; None when the run is too short to tell it from the
    # prefill's (CPU smoke runs).
    decode_s = fields["total_s"] - t_prefill
    decode_s = decode_s if decode_s > 0.05 * fields["total_s"] else None
    rec = dict(base, precision=precision, **fields, decode_s=decode_s,
               tokens_per_s=batch * n_new / decode_s if decode_s else None,
               e2e_tokens_per_s=batch * n_new / fields["total_s"])
    # Steady: as if every row stayed busy to the end (continuous batching
    # refills finished rows): tokens per row-iteration x full-batch
    # iterations per second. Not for a compacting loop, whose later
    # iterations run a smaller batch.
    if decode_s and not fields.get("compaction"):
      rec["steady_tokens_per_s"] = (
          batch * fields["mean_accepted_length"] * fields["iterations"]
          / decode_s if fields.get("iterations") else rec["tokens_per_s"])
    logging.info("batch %d %-8s T=%s: %s decode tokens/s, %.1f end to end "
                 "(accepted length %.2f, match %s)", batch, rec["mode"],
                 rec["window"], rec["tokens_per_s"], rec["e2e_tokens_per_s"],
                 rec["mean_accepted_length"], rec["match_fraction"])
    return writer.write(rec)

  recs = [record(mode="plain", window=None, total_s=t_plain, times_s=times,
                 mean_accepted_length=1.0,
                 match_fraction=None if sampling else 1.0)]
  if b.plain_baseline:
    (out, _), t, times = common.best_of(
        lambda: lambda: generate(model, prompts, lengths, n_new,
                                 ssm_mode="baseline", implementation=impl,
                                 **sampling, **state_kw), b.repeats)
    recs.append(record(
        mode="plain_baseline", window=None, total_s=t, times_s=times,
        mean_accepted_length=1.0, match_fraction=None if sampling else float(
            np.mean(np.asarray(out) == np.asarray(ref)))))
  if b.proposer == "greedy_oracle":
    proposer = OracleProposer(ref, b.accept_prob, cfg.vocab_size)
  else:
    proposer = FlatOracleProposer(b.accept_prob, cfg.vocab_size)
  for window, compaction, mode in itertools.product(
      b.windows, b.compactions, b.ssm_modes):
    try:
      (out, _, stats), t, times = common.best_of(
          lambda: lambda: speculative_generate(  # pylint: disable=cell-var-from-loop
              model, proposer, prompts, lengths, n_new, window,
              ssm_mode=mode, buffer_len=b.buffer_len,
              implementation=impl, compaction=compaction,
              **(sampling or dict(rng=jax.random.PRNGKey(1))),
              **(replay_kw if mode == "replay" else state_kw)),
          b.repeats)
    except Exception as e:  # pylint: disable=broad-except
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      # The baseline keeps T full SSM states per Mamba layer: at large
      # batch x window it may not fit; that is a result, not a crash.
      logging.warning("batch %d %s T=%d does not fit in device memory",
                      batch, mode, window)
      recs.append(writer.write(dict(base, mode=mode, window=window,
                                    compaction=compaction,
                                    out_of_memory=True)))
      continue
    # Greedy speculative decoding must reproduce the plain greedy run (up
    # to low-precision rounding differences between a parallel verify and
    # single steps, which is why this is reported, not asserted).
    # (Sampling: the tokens are random draws, nothing to compare.)
    match = (float(np.mean(np.asarray(out) == np.asarray(ref)))
             if not sampling else None)
    recs.append(record(
        mode=mode, window=window, compaction=compaction, total_s=t,
        times_s=times,
        mean_accepted_length=float(stats.mean_accepted_length),
        expected_accepted_length=float(sum(
            b.accept_prob ** k for k in range(window))),
        iterations=int(stats.iterations), match_fraction=match))
  return recs


def _summarize(records: list[dict]) -> list[dict]:
  rows = []
  records = [r for r in records if not r.get("out_of_memory")]
  for r in records:
    same = [q for q in records if q["batch"] == r["batch"]]
    plain = next(q for q in same if q["mode"] == "plain")
    base = next((q for q in same if q["mode"] == "baseline"
                 and q["window"] == r["window"]
                 and q.get("compaction") == r.get("compaction")), None)
    def ratio(a, b):
      return a / b if a and b else None

    rows.append(dict(
        r, vs_plain=ratio(r["tokens_per_s"], plain["tokens_per_s"]),
        steady_vs_plain=ratio(r.get("steady_tokens_per_s"),
                              plain.get("steady_tokens_per_s")),
        replay_vs_baseline=(ratio(r["tokens_per_s"], base["tokens_per_s"])
                            if base and r["mode"] == "replay" else None)))
  return rows


def _plot(rows: list[dict], path: str):
  windows = sorted({r["window"] for r in rows if r["window"]})
  fig, axes = common.new_figure(1, len(windows),
                                figsize=(4.5 * len(windows), 4.0))
  for ax, w in zip(axes[0], windows):
    for mode, style in (("plain", "k--"), ("plain_baseline", "k:"),
                        ("baseline", "o-"), ("replay", "s-")):
      for c in sorted({r.get("compaction") or 0 for r in rows
                       if r["mode"] == mode}):
        pts = sorted((r["batch"], r["e2e_tokens_per_s"]) for r in rows
                     if r["mode"] == mode and r["window"] in (w, None)
                     and mode.startswith("plain") == (r["window"] is None)
                     and (r.get("compaction") or 0) == c)
        if pts:
          ax.plot(*zip(*pts), style if c == 0 else style.replace("-", ":"),
                  label=mode if not c else f"{mode}, compaction {c}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("generated tokens/s (end to end)")
    ax.set_title(f"window {w}")
    ax.legend()
  common.save_plot(fig, path)


def run(config, workdir: str) -> dict:
  """Runs the benchmark into `workdir`; returns the records."""
  workdir, env, writer = common.start_run(workdir, config)
  cfg = ModelConfig(**config.model.to_dict())
  model = build_model(cfg, config.seed)
  records = []
  for i, batch in enumerate(config.bench.batches):
    logging.info("[%d/%d] batch %d", i + 1, len(config.bench.batches), batch)
    records += bench_batch(model, config, batch, writer)
  rows = _summarize(records)
  text = (f"# specdec_bench\n\nmodel: {cfg.pattern} d_model {cfg.d_model}, "
          f"{cfg.dtype}; proposer {config.bench.proposer}, accept_prob "
          f"{config.bench.accept_prob}; backend {env['backend']} "
          f"({env['device_kind']})\n\n" + common.markdown_table(
              rows, ["batch", "mode", "window", "compaction", "tokens_per_s",
                     "e2e_tokens_per_s", "mean_accepted_length", "vs_plain",
                     "replay_vs_baseline", "steady_tokens_per_s",
                     "steady_vs_plain", "match_fraction"],
              formats=dict(tokens_per_s=".1f", e2e_tokens_per_s=".1f",
                           mean_accepted_length=".2f",
                           vs_plain=".2f", replay_vs_baseline=".2f",
                           steady_tokens_per_s=".1f", steady_vs_plain=".2f",
                           match_fraction=".3f")) + "\n")
  oom = [f"batch {r['batch']} {r['mode']} T={r['window']}" for r in records
         if r.get("out_of_memory")]
  if oom:
    text += "\nDid not fit in device memory: " + ", ".join(oom) + ".\n"
  common.log_block(common.write_summary(workdir, text))
  _plot(rows, os.path.join(workdir, "throughput.png"))
  return dict(workdir=workdir, records=records, rows=rows)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/specdec_bench")
