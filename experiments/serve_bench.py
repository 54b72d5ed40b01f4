r"""Serving benchmark: continuous batching (`replayssm_jax.serving.Engine`)
under Poisson arrivals, baseline vs replay decode states, plain vs
speculative decoding.

A workload of `serve.num_requests` requests (prompt and output lengths
uniform in the configured ranges, random prompt tokens, arrival times of a
Poisson process at `serve.arrival_rate` requests/s; the same workload for
every mode) is played against one engine per SSM mode: the driver submits
each request once the wall clock passes its arrival time and dispatches
the engine (admissions, then `steps_per_dispatch` decode steps) until all
finished. A throwaway engine's `precompile` and the same workload played
once at full speed through it (outputs cut to two dispatches) compile
every prefill and decode shape first, so the timed run compiles nothing.
With `serve.shared_prefixes` > 0 the prompts start with one of a few
shared prefixes, and each mode runs twice: without and with a
`serving.PrefixCache` (its hit rate and the
prompt tokens it saved recorded). With `serve.speculative_window` > 0 each
mode also runs with speculative decoding inside the engine
(`serving.Speculation`: `steps_per_dispatch` rounds per dispatch, each a
window of drafts per slot, one verify of the pool, acceptance and commit
per slot). `serve.proposer` picks the drafts:
  * "ngram": `NgramProposer` (prompt lookup in each slot's own history);
    its acceptance is whatever the model's text repeats (low for random
    weights and random prompts);
  * "flat_sampling": experiments/specdec_bench.py's `FlatOracleProposer`,
    for sampling at a high `serve.temperature` (the target nearly uniform):
    each draft is accepted with probability `serve.accept_prob` whatever
    the numerics, so the run measures the engine at a set acceptance.
The speculative record adds the acceptance rate, the mean accepted length
(tokens per slot and verify round) and, for greedy workloads, the
fraction of requests whose tokens equal the plain run's.

Per mode (one metrics.jsonl line each): output tokens/s (generated tokens
over the time from the first arrival to the last token), time to first
token (arrival -> first streamed token), the engine's admission time per
request (its prefill, through the prefix cache if any, and first token)
and time per output token (a request's (last - first token time) /
(tokens - 1)) at p50 / p99, the engine's host time per decode step (its
wall time less its waits for the device's tokens) against its wall time
per step, the dispatches compacted to the running slots' rows, and the
decode state's bytes; and the full-load tokens/s: tokens streamed over the
wall time of the dispatches whose admissions filled every free slot from
the queue, all but an empty pool's first fill (the engine at capacity,
none of a burst's ramp or tail). summary.md holds the table, latency.png
the TTFT / TPOT distributions.

Usage (see configs/serve_bench.py):
  python -m experiments.serve_bench --config=configs/serve_bench.py \
      --workdir=runs/serve_bench
  python -m experiments.serve_bench --config=configs/serve_bench.py:smoke \
      --workdir=runs/serve_bench_smoke   # CPU, about a minute
"""

from __future__ import annotations

import json
import os
import time

from absl import logging
import jax
import numpy as np

from experiments import common
from experiments.decode_bench import build_model
from experiments.specdec_bench import FlatOracleProposer
from replayssm_jax import serving
from replayssm_jax.models import ModelConfig, NgramProposer, hf
from replayssm_jax.precision import PrecisionPolicy

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "serve_bench.py")


def model_config(config) -> ModelConfig:
  """The benchmark's ModelConfig: `hf_config`'s shape in bf16, or
  `model`."""
  if config.hf_config:
    with open(config.hf_config) as f:
      cfg, _ = hf.config_from_hf(json.load(f))
    return cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  return ModelConfig(**config.model.to_dict())


def workload(config, vocab_size: int) -> list[dict]:
  """The requests: id, prompt tokens, max_new_tokens, arrival time (s)."""
  s = config.serve
  rng = np.random.default_rng(config.seed)
  n = s.num_requests
  gaps = (rng.exponential(1.0 / s.arrival_rate, n) if s.arrival_rate > 0
          else np.zeros(n))
  arrivals = np.cumsum(gaps) - gaps[0]
  prefixes = [rng.integers(0, vocab_size, s.shared_prefix_len,
                           dtype=np.int32) for _ in range(s.shared_prefixes)]
  out = []
  for i in range(n):
    t = int(rng.integers(s.prompt_len_min, s.prompt_len_max + 1))
    m = int(rng.integers(s.output_len_min, s.output_len_max + 1))
    prompt = rng.integers(0, vocab_size, t, dtype=np.int32)
    if prefixes:  # the shared prefix, then a tail of >= 1 token
      prompt = np.concatenate([prefixes[i % len(prefixes)],
                               prompt[:max(1, t - s.shared_prefix_len)]])
    if len(prompt) + m > s.max_len:
      raise ValueError(f"serve.max_len ({s.max_len}) is shorter than a "
                       f"prompt + output ({len(prompt)} + {m}).")
    out.append(dict(id=i, prompt=prompt, max_new_tokens=m,
                    arrival=float(arrivals[i])))
  return out


def speculation(config, vocab_size: int) -> serving.Speculation:
  """The speculative runs' `serving.Speculation` (serve.proposer,
  serve.speculative_window)."""
  s = config.serve
  if s.proposer == "ngram":
    proposer = NgramProposer(n=s.ngram_n)
  elif s.proposer == "flat_sampling":
    if not s.temperature > 0:
      raise ValueError(f"serve.proposer 'flat_sampling' needs sampling: "
                       f"serve.temperature must be > 0 (a high one, e.g. "
                       f"1000), got {s.temperature!r}.")
    proposer = FlatOracleProposer(s.accept_prob, vocab_size)
  else:
    raise ValueError(f"serve.proposer must be 'ngram' or 'flat_sampling', "
                     f"got {s.proposer!r}.")
  return serving.Speculation(proposer, window=s.speculative_window)


def _engine(model, config, mode: str, cached: bool,
            spec: bool) -> serving.Engine:
  s = config.serve
  kw = {}
  if mode == "replay" and s.precision:
    policy = PrecisionPolicy.preset(s.precision)
    kw = dict(precision=policy, checkpoint_dtype=policy.checkpoint_dtype)
  if spec:
    kw["speculative"] = speculation(config, model.config.vocab_size)
  return serving.Engine(model, s.capacity, s.max_len,
                        steps_per_dispatch=s.steps_per_dispatch,
                        prefill_batch=s.prefill_batch,
                        compact_below=s.compact_below,
                        overlap=s.overlap,
                        implementation=s.implementation or None,
                        prefix_cache=(serving.PrefixCache(
                            s.prefix_block, max_entries=64)
                                      if cached else None),
                        ssm_mode=mode, buffer_len=s.buffer_len, **kw)


def _request(r, config) -> serving.Request:
  return serving.Request(r["id"], r["prompt"], r["max_new_tokens"],
                         temperature=config.serve.temperature,
                         seed=config.seed + r["id"])


def warm_up(model, config, mode: str, cached: bool, spec: bool,
            requests: list[dict]):
  """Compiles what the timed run runs through a throwaway engine:
  `Engine.precompile` (every prefill and decode shape real-time arrivals
  may need), then the workload at once (no arrival times) with its
  outputs cut to two dispatches: every prompt's admission path (the
  prefix cache's remainders included) runs, and little decoding."""
  eng = _engine(model, config, mode, cached, spec)
  lengths = [len(r["prompt"]) for r in requests]
  eng.precompile(max(lengths), sampled=config.serve.temperature > 0,
                 min_prompt_len=min(lengths))
  cap = 2 * config.serve.steps_per_dispatch
  for r in requests:
    eng.submit(_request(dict(r, max_new_tokens=min(r["max_new_tokens"],
                                                   cap)), config))
  eng.run()


def play(model, config, mode: str, cached: bool, spec: bool,
         requests: list[dict]) -> tuple[dict, dict]:
  """Plays the workload against a fresh engine in real time -> (record,
  {request id: tokens})."""
  eng = _engine(model, config, mode, cached, spec)
  first, last, count = {}, {}, {}
  streamed = [0]  # tokens streamed so far

  def on_tokens(rid, toks):
    now = time.perf_counter()
    first.setdefault(rid, now)
    last[rid] = now
    count[rid] = count.get(rid, 0) + len(toks)
    streamed[0] += len(toks)

  t0 = time.perf_counter()
  pending = list(requests)  # in arrival order
  full = [0.0, 0]  # seconds and tokens of the dispatches at full load
  while pending or eng.busy:
    now = time.perf_counter() - t0
    while pending and pending[0]["arrival"] <= now:
      eng.submit(_request(pending.pop(0), config))
    if eng.busy:
      free = sum(r is None for r in eng.slots)
      # At full load: the queue refills every free slot, and this is not
      # the first fill of an empty pool (a burst's ramp).
      at_full = free < eng.pool.capacity and len(eng.queue) >= free
      before = streamed[0]
      eng.dispatch(on_tokens)
      if at_full:
        full[0] += time.perf_counter() - t0 - now
        full[1] += streamed[0] - before
    elif pending:  # idle until the next arrival
      time.sleep(max(0.0, pending[0]["arrival"] - now))
  end = max(last.values())
  ttft = np.array([first[r["id"]] - t0 - r["arrival"] for r in requests])
  tpot = np.array([(last[r["id"]] - first[r["id"]]) / (count[r["id"]] - 1)
                   for r in requests if count[r["id"]] > 1])
  tokens = streamed[0]
  st = eng.stats
  state_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree.leaves(eng.pool.state))
  cache = eng.prefix_cache.stats() if cached else {}
  window = config.serve.speculative_window if spec else None
  spec_fields = dict(
      proposer=config.serve.proposer if spec else None,
      acceptance_rate=st.acceptance_rate if spec else None,
      mean_accepted_length=st.mean_accepted_length if spec else None,
      verify_rounds=st.verify_rounds, drafts=st.drafts,
      accepted_drafts=st.accepted_drafts)
  return dict(
      kind="serve", mode=mode, prefix_cache=cached, speculative=window,
      **spec_fields,
      cache_hit_rate=cache.get("hit_rate"),
      cache_reused_tokens=cache.get("reused_tokens"),
      prompt_tokens=sum(len(r["prompt"]) for r in requests),
      requests=len(requests), tokens=tokens,
      duration_s=end - t0, tokens_per_s=tokens / (end - t0),
      full_load_s=full[0],
      full_load_tokens_per_s=full[1] / full[0] if full[0] else None,
      ttft_p50_ms=float(np.percentile(ttft, 50) * 1e3),
      ttft_p99_ms=float(np.percentile(ttft, 99) * 1e3),
      tpot_p50_ms=float(np.percentile(tpot, 50) * 1e3) if tpot.size else None,
      tpot_p99_ms=float(np.percentile(tpot, 99) * 1e3) if tpot.size else None,
      admit_ms_per_request=st.admit_s / max(st.admissions, 1) * 1e3,
      host_us_per_step=st.host_us_per_step,
      wall_us_per_step=st.wall_us_per_step, dispatches=st.dispatches,
      compacted_dispatches=st.compacted,
      steps=st.steps, admissions=st.admissions, state_bytes=int(state_bytes),
      ttft_ms=(ttft * 1e3).tolist(), tpot_ms=(tpot * 1e3).tolist()), dict(
          eng.results)


def _name(rec: dict) -> str:
  return rec["mode"] + (" + prefix cache" if rec["prefix_cache"] else "") + (
      f" + spec T={rec['speculative']}" if rec["speculative"] else "")


def _plot(records: list[dict], path: str):
  fig, axes = common.new_figure(1, 2, figsize=(10.0, 4.0))
  for rec in records:
    for ax, key in zip(axes[0], ("ttft_ms", "tpot_ms")):
      vals = np.sort(rec[key])
      if vals.size:
        ax.plot(vals, np.arange(1, vals.size + 1) / vals.size,
                label=_name(rec))
  for ax, title in zip(axes[0], ("time to first token (ms)",
                                 "time per output token (ms)")):
    ax.set_xlabel(title)
    ax.set_ylabel("fraction of requests")
    ax.legend()
  common.save_plot(fig, path)


def run(config, workdir: str) -> dict:
  """Runs the benchmark into `workdir`; returns the records."""
  workdir, env, writer = common.start_run(workdir, config)
  cfg = model_config(config)
  model = build_model(cfg, config.seed)
  requests = workload(config, cfg.vocab_size)
  records = []
  s = config.serve
  # Plain, with a prefix cache (shared-prefix workloads), with speculative
  # decoding; each for every mode in turn (a run cut short keeps whole
  # comparisons).
  unknown = set(s.variants) - {"plain", "prefix_cache", "speculative"}
  if unknown:
    raise ValueError(f"serve.variants: unknown {sorted(unknown)}; choose "
                     f"from 'plain', 'prefix_cache', 'speculative'.")
  runs = [(mode, cached, spec)
          for cached, spec in (
              [(False, False)] * ("plain" in s.variants)
              + [(True, False)] * bool("prefix_cache" in s.variants
                                       and s.shared_prefixes)
              + [(False, True)] * bool("speculative" in s.variants
                                       and s.speculative_window))
          for mode in s.ssm_modes]
  plain = {}  # mode -> the plain run's tokens
  for i, (mode, cached, spec) in enumerate(runs):
    name = _name(dict(mode=mode, prefix_cache=cached,
                      speculative=s.speculative_window if spec else None))
    logging.info("[%d/%d] %s: warm-up", i + 1, len(runs), name)
    warm_up(model, config, mode, cached, spec, requests)
    logging.info("[%d/%d] %s: %d requests", i + 1, len(runs), name,
                 len(requests))
    rec, results = play(model, config, mode, cached, spec, requests)
    if not cached and not spec:
      plain[mode] = results
    # Greedy speculative decoding must give the plain tokens (up to
    # near-ties a parallel verify rounds differently, so it is reported).
    rec["match_plain"] = (
        float(np.mean([results[k] == plain[mode][k] for k in results]))
        if spec and s.temperature == 0 and mode in plain else None)
    if spec:
      logging.info("%s: acceptance %.3f, %.2f tokens per verify round, "
                   "match %s", name, rec["acceptance_rate"],
                   rec["mean_accepted_length"], rec["match_plain"])
    writer.write(rec)
    records.append(rec)
  key = lambda r: (r["prefix_cache"], r["speculative"])
  base = {key(r): r for r in records if r["mode"] == "baseline"}
  plain_recs = {r["mode"]: r for r in records
                if not r["prefix_cache"] and not r["speculative"]}
  def ratio(r, other, field="tokens_per_s"):
    return (r[field] / other[field] if other is not None and r[field]
            and other[field] else None)

  rows = [dict(r, vs_baseline=ratio(r, base.get(key(r))),
               vs_plain=ratio(r, plain_recs.get(r["mode"])),
               full_load_vs_baseline=ratio(r, base.get(key(r)),
                                           "full_load_tokens_per_s"))
          for r in records]
  text = (f"# serve_bench\n\nmodel: {cfg.pattern[:40]} d_model "
          f"{cfg.d_model}, {cfg.dtype}; {s.num_requests} requests at "
          f"{s.arrival_rate} /s, capacity {s.capacity}, "
          f"{s.steps_per_dispatch} steps (speculative rounds) per "
          f"dispatch, prefills of up to {s.prefill_batch} prompts, "
          f"overlap {s.overlap}; "
          + (f"speculative: {s.proposer} proposer"
             + (f" at accept_prob {s.accept_prob}"
                if s.proposer == "flat_sampling" else "") + ", "
             if s.speculative_window else "")
          + f"temperature {s.temperature}; backend "
          f"{env['backend']} ({env['device_kind']})\n\n" +
          common.markdown_table(
              rows, ["mode", "prefix_cache", "cache_hit_rate", "speculative",
                     "acceptance_rate", "mean_accepted_length",
                     "match_plain", "tokens_per_s", "vs_baseline",
                     "vs_plain", "full_load_tokens_per_s",
                     "full_load_vs_baseline", "ttft_p50_ms",
                     "ttft_p99_ms", "admit_ms_per_request", "tpot_p50_ms",
                     "tpot_p99_ms",
                     "host_us_per_step", "wall_us_per_step", "state_bytes"],
              formats=dict(tokens_per_s=".1f", vs_baseline=".3f",
                           vs_plain=".3f", cache_hit_rate=".2f",
                           full_load_tokens_per_s=".1f",
                           full_load_vs_baseline=".3f",
                           acceptance_rate=".3f",
                           mean_accepted_length=".2f", match_plain=".2f",
                           ttft_p50_ms=".1f", ttft_p99_ms=".1f",
                           admit_ms_per_request=".2f",
                           tpot_p50_ms=".2f", tpot_p99_ms=".2f",
                           host_us_per_step=".0f", wall_us_per_step=".0f"))
          + "\n")
  common.log_block(common.write_summary(workdir, text))
  _plot(records, os.path.join(workdir, "latency.png"))
  return dict(workdir=workdir, records=records)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/serve_bench")
