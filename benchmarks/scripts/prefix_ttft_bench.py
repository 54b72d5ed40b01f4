"""Time to first token with a cached prefix, against the ideal (GPU).

A request whose prompt starts with a cached prefix prefills only the rest
(`serving.insert_cached`), so its time to first token should fall with the
cached fraction f of the prompt: ideally to (1 - f) of the uncached time.
On an idle pool (nothing else queued on the device), per SSM mode:

  insert     `serving.insert` of a prompt of --prompt_len tokens: the
             uncached time t0 (and a miss through an empty cache: the
             prefix's prefill, then the rest's)
  hit f      `serving.insert_cached` of a prompt whose first f * T tokens
             (whole blocks) are cached: t_f

and reports t_f, the ideal (1 - f) * t0, and the share of the ideal saving
reached, (t0 - t_f) / (f * t0); beside each hit, `serving.insert` of
the rest alone ((1 - f) T tokens: rest_ms, the hit path's floor). Then
--batch_hits prompts hitting the prefix of the largest fraction:
`serving.insert_cached` one after another (into one slot) against one
`serving.insert_cached_many` of them all into as many slots (the engine's
batched admission), to the last first token, each form on prompts of its
own (a tail seen before would make a hit store a deeper row). Each
time runs from the call to the first token on the host
(`block_until_ready`), median over --repeats prompts of fresh random tails
(never zeros), after a warm-up that compiles each path.
Before timing, each hit's first token is checked against `insert` of the
same prompt and its logits' difference recorded (max |difference| over
max |logit|: the prefill split at the block boundary sums in another
order). hybrid_1b's shapes, random bf16 weights.

  PYTHONPATH=. python benchmarks/scripts/prefix_ttft_bench.py \\
      --out $OUT/prefix_ttft.json
  PYTHONPATH=. python benchmarks/scripts/prefix_ttft_bench.py --small \\
      --out /tmp/pt.json   # CPU: a tiny model, seconds
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)

from configs import _decode_bench, hybrid_1b  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.decode_bench import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax import models, serving  # pylint: disable=g-import-not-at-top,wrong-import-position


def timed(fn, repeats):
  """fn(i) -> (first token, ...) for repeat i: one warm-up call, then the
  median ms of `repeats` calls to the first token on the host, those
  times, and the median ms until fn returned (the host's own work: its
  Python and the dispatches; where it is close to the first one, the
  device waited for the host)."""
  jax.block_until_ready(fn(-1)[0])
  times, host = [], []
  for i in range(repeats):
    t0 = time.perf_counter()
    out = fn(i)
    host.append((time.perf_counter() - t0) * 1e3)
    jax.block_until_ready(out[0])
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), times, statistics.median(host)


def top2_gap(logits: np.ndarray) -> float:
  """(largest - second largest logit) / max |logit|."""
  top = np.sort(logits.astype(np.float64))[-2:]
  return float((top[1] - top[0]) / np.abs(logits).max())


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="prefix_ttft.json")
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--block", type=int, default=16)
  ap.add_argument("--fractions", default="0.25,0.5,0.75,0.875,0.9375",
                  help="cached fractions of the prompt, separated by commas "
                  "or '+' (rounded down to whole blocks)")
  ap.add_argument("--chunk_size", type=int, default=0,
                  help="the Mamba-2 prefill's chunk length (0: the "
                  "model config's)")
  ap.add_argument("--max_len", type=int, default=1024)
  ap.add_argument("--capacity", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--modes", default="replay,baseline")
  ap.add_argument("--batch_hits", type=int, default=8,
                  help="prompts of the batched-admission timing (at most "
                  "--capacity; 0: none)")
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  if a.small:
    a.prompt_len, a.block, a.max_len, a.capacity, a.repeats = 64, 8, 128, 2, 3
    cfg = models.ModelConfig(**_decode_bench.TINY_MODEL)
  else:
    cfg = models.ModelConfig(**hybrid_1b.MODEL)
  if a.chunk_size:
    cfg = cfg.replace(chunk_size=a.chunk_size)
  t, block = a.prompt_len, a.block
  res = dict(env=common.log_environment(),
             command=" ".join([sys.executable] + sys.argv), prompt_len=t,
             block=block, chunk_size=cfg.chunk_size, max_len=a.max_len,
             repeats=a.repeats, records=[])

  def save():
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)

  model = build_model(cfg, seed=0)
  parts = serving.model_parts(model)
  rng = np.random.default_rng(1)
  tokens = lambda n: rng.integers(0, cfg.vocab_size, n, dtype=np.int32)
  for mode in a.modes.split(","):
    pool = serving.init_pool(model, a.capacity, a.max_len, ssm_mode=mode,
                             buffer_len=16)

    def insert(prompt):
      nonlocal pool
      pool, tok, lg = serving.insert(model, pool, 0, prompt, parts=parts,
                                     return_logits=True)
      return tok, lg

    def cached(cache, prompt):
      nonlocal pool
      pool, tok, lg = serving.insert_cached(model, pool, cache, 0, prompt,
                                            parts=parts, return_logits=True)
      return tok, lg

    t0, t0_all, t0_host = timed(lambda i: insert(tokens(t)), a.repeats)
    miss, _, _ = timed(lambda i: cached(serving.PrefixCache(block, 2),
                                     tokens(t)), a.repeats)
    rec = dict(mode=mode, insert_ms=t0, insert_times_ms=t0_all,
               insert_host_ms=t0_host, miss_ms=miss, hits=[])
    res["records"].append(rec)  # saved with each hit
    save()
    print(f"{mode}: insert {t0:.2f} ms (host {t0_host:.2f}), miss "
          f"{miss:.2f} ms", flush=True)
    done, prefix_of = set(), {}
    for f in (float(x) for x in a.fractions.replace("+", ",").split(",")):
      k = int(f * t) // block * block
      if not 0 < k < t or k in done:
        continue
      done.add(k)
      prefix = prefix_of[k] = tokens(k)
      cache = serving.PrefixCache(block, 2)
      cached(cache, np.concatenate([prefix, tokens(1)]))  # stores k tokens
      prompts = [np.concatenate([prefix, tokens(t - k)])
                 for _ in range(a.repeats + 2)]
      want_tok, want_lg = insert(prompts[0])
      got_tok, got_lg = cached(cache, prompts[0])
      ok = int(got_tok) == int(want_tok)
      err = float(np.max(np.abs(np.asarray(got_lg) - np.asarray(want_lg)))
                  / np.max(np.abs(np.asarray(want_lg))))
      # Warm-up and timed calls on tails of their own: the checked prompt's
      # keys are known now, so it would extend the cached prefix instead.
      tf, tf_all, tf_host = timed(lambda i: cached(cache, prompts[i + 2]),
                                  a.repeats)
      rest, _, rest_host = timed(lambda i: insert(tokens(t - k)), a.repeats)
      st = cache.stats()
      fr = k / t
      hit = dict(cached_tokens=k, fraction=fr, ms=tf, times_ms=tf_all,
                 host_ms=tf_host, rest_ms=rest, rest_host_ms=rest_host,
                 ideal_ms=(1 - fr) * t0,
                 share_of_ideal_saving=(t0 - tf) / (fr * t0),
                 first_token_equal=ok, logits_rel_err=err,
                 hits=st["hits"], misses=st["misses"],
                 entries=st["entries"])
      print(f"  cached {k}/{t}: {tf:.2f} ms (host {tf_host:.2f}; ideal "
            f"{(1 - fr) * t0:.2f}, the rest alone {rest:.2f}), "
            f"{hit['share_of_ideal_saving']:.2f} of the ideal saving; "
            f"first token equal {ok}, logits err {err:.1e}", flush=True)
      rec["hits"].append(hit)
      save()
    n = min(a.batch_hits, a.capacity)
    if done and n:
      k = max(done)

      def prefix_cache():
        cache = serving.PrefixCache(block, 2)
        cached(cache, np.concatenate([prefix_of[k], tokens(1)]))
        return cache

      def fresh():
        """repeats + 1 batches of n prompts with tails never seen: a tail
        an earlier call inserted would have its keys known, and a hit then
        stores a row deeper in that tail (one more prefill)."""
        return [[np.concatenate([prefix_of[k], tokens(t - k)])
                 for _ in range(n)] for _ in range(a.repeats + 1)]

      def one_by_one(cache, batches, i):
        out = [cached(cache, p)[0] for p in batches[i]]
        return out[-1], out

      def batched(cache, batches, i):
        nonlocal pool
        pool, toks = serving.insert_cached_many(
            model, pool, cache, list(range(n)), batches[i], parts=parts)
        return toks, None

      check = fresh()  # both ways, each on a cache of its own
      ref_cache = prefix_cache()
      ref = [cached(ref_cache, p) for p in check[0]]
      want = [int(tok) for tok, _ in ref]
      got = [int(x) for x in batched(prefix_cache(), check, 0)[0]]
      cache = prefix_cache()
      single, _, _ = timed(functools.partial(one_by_one, cache, fresh()),
                           a.repeats)
      many, _, many_host = timed(functools.partial(batched, cache, fresh()),
                                 a.repeats)
      rec["batch_hits"] = dict(prompts=n, cached_tokens=k,
                               one_at_a_time_ms=single, batched_ms=many,
                               batched_host_ms=many_host,
                               first_tokens_equal=want == got)
      if want != got:
        # Which prompts differ, and how close their one-at-a-time logits'
        # two largest are (over max |logit|): a gap within the logits'
        # difference between prefills split otherwise (the hits'
        # logits_rel_err) is a near-tie another batch shape may flip.
        rec["batch_hits"]["differing"] = [
            dict(prompt=i, one_at_a_time=w, batched=g,
                 top2_gap=top2_gap(np.asarray(ref[i][1])))
            for i, (w, g) in enumerate(zip(want, got)) if w != g]
      print(f"  {n} hits of {k}/{t}: one at a time {single:.2f} ms, "
            f"batched {many:.2f} ms; first tokens equal {want == got}",
            flush=True)
      save()
  save()


if __name__ == "__main__":
  main()
