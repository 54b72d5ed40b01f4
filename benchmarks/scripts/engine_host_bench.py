"""The serving engine's host time, on a model whose device work is small.

hybrid_1b's block pattern (25 blocks: Mamba-2, attention, MLP) at a tiny
width (d_model 128, f32), so that on any machine the engine's Python and
dispatch costs dominate what is measured: `--requests` requests of 8-31
prompt tokens and 16-47 new tokens through `--capacity` slots, 8 steps
per dispatch, batched admissions of up to 8 prompts, after
`Engine.precompile`. Prints one JSON line: wall seconds of `Engine.run`,
its statistics, wall ms per dispatch and per admission, the host
time of one hash of the model's nnx GraphDef (what jax computed on every
jitted call taking it as a static argument, before `serving.model_parts`
kept the hash), of one flattening of the model's parameters as an nnx
State and as `model_parts` passes them (every jitted serving call
flattens them), and the GraphDef comparisons made during the timed runs
(count and ms: each run is a new engine of the same model, whose jitted
calls find the first engine's compiled functions; a comparison of two
whole GraphDefs when their static graphs are not the same object).

  PYTHONPATH=. python benchmarks/scripts/engine_host_bench.py --repeats 3

Compare two commits by pointing PYTHONPATH at each tree in turn (the
script uses only `serving.Engine`, `Request` and `EngineStats`), or the
engine with and without overlap (`--overlap 0` / `--overlap 1`). With
`--shared_prefix N` every prompt starts with one of 4 shared prefixes of N
tokens and admissions go through a prefix cache of 16-token blocks (its
statistics printed too).
"""

import argparse
import dataclasses
import json
import statistics
import time

import jax
import numpy as np
from flax import nnx

from configs import hybrid_1b
from experiments.decode_bench import build_model
from replayssm_jax import models, serving


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--capacity", type=int, default=64)
  ap.add_argument("--requests", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--overlap", type=int, choices=(0, 1), default=None,
                  help="Engine(overlap=...); unset: the engine's default "
                  "(a tree whose engine has no such argument)")
  ap.add_argument("--shared_prefix", type=int, default=0,
                  help="tokens of a prefix shared by a quarter of the "
                  "prompts each, admitted through a prefix cache")
  a = ap.parse_args()
  cfg = models.ModelConfig(**dict(
      hybrid_1b.MODEL, d_model=128, ssm_heads=4, head_dim=32, d_state=16,
      n_groups=1, num_heads=2, num_kv_heads=1, attn_head_dim=64,
      intermediate_size=256, vocab_size=256, dtype="float32",
      param_dtype="float32"))
  model = build_model(cfg, 0)
  graph_type = type(nnx.graphdef(model))
  real_eq, eqs = graph_type.__eq__, []

  def counted_eq(g, other):
    t0 = time.perf_counter()
    out = real_eq(g, other)
    eqs.append(time.perf_counter() - t0)
    return out

  graph_type.__eq__ = counted_eq
  walls, stats, cache, timed_eqs = [], None, None, []
  prefixes = np.random.default_rng(99).integers(
      0, 256, (4, a.shared_prefix)).astype(np.int32)
  for rep in range(a.repeats + 1):  # the first run warms up
    kw = {} if a.overlap is None else dict(overlap=bool(a.overlap))
    if a.shared_prefix:
      kw["prefix_cache"] = serving.PrefixCache(16, max_entries=64)
    eng = serving.Engine(model, a.capacity, 128 + a.shared_prefix,
                         steps_per_dispatch=8, prefill_batch=8,
                         buffer_len=16, **kw)
    eng.precompile(31 + a.shared_prefix)
    rng = np.random.default_rng(rep)
    for i in range(a.requests):
      tail = rng.integers(0, 256, rng.integers(8, 32)).astype(np.int32)
      eng.submit(serving.Request(
          id=i, prompt=np.concatenate([prefixes[i % 4], tail]),
          max_new_tokens=int(rng.integers(16, 48))))
    eqs.clear()
    t0 = time.perf_counter()
    eng.run()
    if rep:
      walls.append(time.perf_counter() - t0)
      timed_eqs += eqs
      stats = dataclasses.asdict(eng.stats)
      if a.shared_prefix:
        cache = eng.prefix_cache.stats()
  graph_type.__eq__ = real_eq
  wall = statistics.median(walls)
  graphdef = nnx.graphdef(model)
  t0 = time.perf_counter()
  for _ in range(200):
    hash(graphdef)
  graph_hash_ms = (time.perf_counter() - t0) / 200 * 1e3

  def flatten_us(tree):
    t0 = time.perf_counter()
    for _ in range(1000):
      jax.tree_util.tree_flatten(tree)
    return (time.perf_counter() - t0) * 1e3

  # What every jitted serving call flattens: the model's parameters as
  # nnx.split gives them, and as serving.model_parts passes them.
  state_flatten_us = flatten_us(nnx.split(model)[1])
  parts_flatten_us = flatten_us(serving.model_parts(model)[1])
  print(json.dumps(dict(
      capacity=a.capacity, requests=a.requests, overlap=a.overlap,
      shared_prefix=a.shared_prefix, prefix_cache=cache,
      graph_hash_ms=graph_hash_ms, state_flatten_us=state_flatten_us,
      parts_flatten_us=parts_flatten_us,
      graph_eq_per_run=len(timed_eqs) / len(walls),
      graph_eq_ms_per_run=1e3 * sum(timed_eqs) / len(walls),
      wall_s=wall, walls_s=walls,
      ms_per_dispatch=1e3 * wall / stats["dispatches"],
      admit_ms_per_request=1e3 * stats["admit_s"] / stats["admissions"],
      stats=stats)))


if __name__ == "__main__":
  main()
