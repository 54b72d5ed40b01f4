"""Which of the serving paths' jitted calls wait for the device (GPU).

A jitted call returns as soon as its work is queued, unless its program
needs a value of the device on the host: XLA runs a `while` loop whose
trip count it does not know (and a `conditional`) outside a command
buffer by copying the predicate to the host each iteration, so the call
returns only once the device has reached that loop, behind everything
queued before it. For each path below: the host time of the call made
right after --busy_ms of device work was queued (a path that waits
returns after about that long, one that does not in its own launch time),
beside the same call on an idle device, and the while loops (with and
without a known trip count) and conditionals of the optimized programs it
compiled (XLA's HLO dumps, by module name).

Paths (hybrid_1b's shapes, random bf16 weights, a pool of 8 slots x
--max_len, replay or baseline):
  insert_<n>        serving.insert of a fresh prompt of n tokens
  hit_<n>           serving.insert_cached of a prompt of --prompt_len
                    tokens with all but its last n cached
  hits_8x<n>        serving.insert_cached_many of 8 such prompts
  step_1            serving.step_n of one step over the pool
  moe_step_1        the same on a two-block model (Mamba-2, MoE of 128
                    experts, top 6) over a pool of --moe_slots slots (its
                    experts' capacity dispatch runs rounds until every
                    expert's tokens are served)

  PYTHONPATH=. python benchmarks/scripts/dispatch_sync.py \\
      --out $OUT/dispatch_sync.json
  PYTHONPATH=. python benchmarks/scripts/dispatch_sync.py --small \\
      --out /tmp/ds.json   # CPU: a tiny model, seconds
"""

from __future__ import annotations

import argparse
import atexit
import functools
import glob
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

DUMP = tempfile.mkdtemp(prefix="dispatch_sync_hlo_")
atexit.register(functools.partial(shutil.rmtree, DUMP, ignore_errors=True))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_pass_re=^$")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)

from configs import _decode_bench, hybrid_1b  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.decode_bench import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax import models, serving  # pylint: disable=g-import-not-at-top,wrong-import-position


def hlo_loops(module: str, seen: set) -> dict:
  """While loops (with / without a known trip count) and conditionals of
  the optimized programs dumped for jitted functions named `module` since
  the last call (files in `seen` skipped, then added)."""
  out = dict(programs=0, whiles_known=0, whiles_unknown=0, conditionals=0)
  for path in sorted(glob.glob(os.path.join(
      DUMP, f"*jit_{module}.*after_optimizations.txt"))):
    if path in seen:
      continue
    seen.add(path)
    out["programs"] += 1
    with open(path) as f:
      for line in f:
        if re.search(r"\swhile\(", line):
          key = ("whiles_known" if "known_trip_count" in line
                 else "whiles_unknown")
          out[key] += 1
        elif re.search(r"\sconditional\(", line):
          out["conditionals"] += 1
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="dispatch_sync.json")
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--rests", default="32,128",
                  help="uncached tails of the hits (comma or '+')")
  ap.add_argument("--max_len", type=int, default=1024)
  ap.add_argument("--modes", default="replay,baseline")
  ap.add_argument("--busy_ms", type=float, default=20.0)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--moe_slots", type=int, default=256)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  if a.small:
    a.prompt_len, a.max_len, a.rests, a.repeats = 64, 128, "8", 3
    a.moe_slots = 64  # 24 slots per expert: more than one round may run
    cfg = models.ModelConfig(**_decode_bench.TINY_MODEL)
  else:
    cfg = models.ModelConfig(**hybrid_1b.MODEL)
  rests = [int(r) for r in a.rests.replace("+", ",").split(",")]
  block = 16 if not a.small else 8
  model = build_model(cfg, seed=0)
  parts = serving.model_parts(model)
  rng = np.random.default_rng(1)
  tokens = lambda n: rng.integers(0, cfg.vocab_size, n, dtype=np.int32)

  # Device work of about --busy_ms: a chain of products, its count fixed
  # (a known trip count: queued without a wait).
  n_busy, d = 1, 256 if a.small else 4096
  w = jax.random.normal(jax.random.PRNGKey(0), (d, d), jnp.float32)
  w = w / np.sqrt(d)
  busy_fn = jax.jit(lambda x, n: jax.lax.fori_loop(
      0, n, lambda i, y: jnp.tanh(y @ x), x), static_argnums=1)
  for _ in range(12):
    jax.block_until_ready(busy_fn(w, n_busy))
    t0 = time.perf_counter()
    jax.block_until_ready(busy_fn(w, n_busy))
    ms = (time.perf_counter() - t0) * 1e3
    if ms >= a.busy_ms or n_busy >= 1 << 16:
      break
    n_busy = max(n_busy + 1, int(n_busy * a.busy_ms / max(ms, 1e-3)))
  busy = lambda: busy_fn(w, n_busy)
  seen = set()
  res = dict(env=common.log_environment(),
             command=" ".join([sys.executable] + sys.argv),
             args=vars(a), busy_ms=ms, busy_products=n_busy, records=[])

  moe_model = build_model(models.ModelConfig(
      vocab_size=cfg.vocab_size, d_model=cfg.d_model, pattern="ME",
      ssm_heads=cfg.ssm_heads, head_dim=cfg.head_dim, d_state=cfg.d_state,
      n_groups=cfg.n_groups, n_routed_experts=128 if not a.small else 64,
      num_experts_per_tok=6, moe_intermediate_size=256 if not a.small else 16,
      dtype=cfg.dtype), seed=0)
  moe_parts = serving.model_parts(moe_model)

  for mode in a.modes.replace("+", ",").split(","):
    pool = serving.init_pool(model, 8, a.max_len, ssm_mode=mode,
                             buffer_len=16)
    moe_pool = serving.init_pool(moe_model, a.moe_slots, 64, ssm_mode=mode,
                                 buffer_len=16)
    # Every slot active on a random token: the router sees real rows.
    moe_pool = moe_pool.replace(
        active=jnp.ones_like(moe_pool.active),
        tokens=jnp.asarray(tokens(a.moe_slots)))
    prefix = tokens(a.prompt_len)
    cache = serving.PrefixCache(block, 4)

    def insert(n):
      nonlocal pool
      pool, tok = serving.insert(model, pool, 0, tokens(n), parts=parts)
      return tok

    def hit(n):
      nonlocal pool
      pool, tok = serving.insert_cached(
          model, pool, cache, 0, np.concatenate(
              [prefix[:a.prompt_len - n], tokens(n)]), parts=parts)
      return tok

    def hits(n):
      nonlocal pool
      pool, tok = serving.insert_cached_many(
          model, pool, cache, list(range(8)), [np.concatenate(
              [prefix[:a.prompt_len - n], tokens(n)]) for _ in range(8)],
          parts=parts)
      return tok

    def step():
      nonlocal pool
      pool, tok = serving.step_n(model, pool, 1, parts=parts)
      return tok

    paths = [(f"insert_{n}", lambda n=n: insert(n), "_insert_jit")
             for n in sorted({min(rests), a.prompt_len})]
    for n in rests:
      paths += [(f"hit_{n}", lambda n=n: hit(n), "_finish_jit"),
                (f"hits_8x{n}", lambda n=n: hits(n), "_finish_many_jit")]
    def moe_step():
      nonlocal moe_pool
      moe_pool, tok = serving.step_n(moe_model, moe_pool, 1,
                                     parts=moe_parts)
      return tok

    paths += [("step_1", step, "_step_n_jit"),
              ("moe_step_1", moe_step, "_step_n_jit")]
    # The cached prefixes: one prompt stores the row each hit starts from.
    for n in rests:
      hit(n)
    for name, call, module in paths:
      for _ in range(2):  # compiles, then a warm call
        jax.block_until_ready(call())
      idle, behind = [], []
      for _ in range(a.repeats):
        jax.block_until_ready(pool)
        t0 = time.perf_counter()
        out = call()
        idle.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(out)
        b = busy()
        t0 = time.perf_counter()
        out = call()
        behind.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready((out, b))
      rec = dict(mode=mode, path=name, idle_host_ms=statistics.median(idle),
                 behind_busy_host_ms=statistics.median(behind),
                 hlo=hlo_loops(module, seen))
      res["records"].append(rec)
      print(f"{mode} {name}: host {rec['idle_host_ms']:.2f} ms idle, "
            f"{rec['behind_busy_host_ms']:.2f} ms behind {ms:.1f} ms of "
            f"device work; {module}: {rec['hlo']}", flush=True)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
