"""A partly occupied slot pool decoded two ways, checked and timed (GPU).

`serving.step_n` decodes the whole pool as one dense batch of `capacity`
rows, free slots included, so a dispatch costs the same at any occupancy.
The alternative gathers the active rows into a batch of their own once per
dispatch (the active set only changes between dispatches: admissions and
evictions happen there), decodes that batch and scatters it back:

  dense     `serving.step_n(model, pool, n)` over all `capacity` rows
  gathered  gather the active rows (`serving.rows.gather_rows`),
            `step_n` on that batch, scatter the rows back (donated):
            what `Engine(compact_below=...)` runs
  steps     the gathered form's `step_n` alone: what a kernel that reads
            and writes the pool through a slot index per row would cost
            at best (the same rows, no copies)

per occupancy (active rows out of `--capacity`), at hybrid_1b's shapes
(random bf16 weights), replay (L 16) and baseline states. The pool's rows
hold a real prefill of random prompts (never zeros). Before timing, the
gathered form's tokens and active rows' states are checked against the
dense form's on the same pool (tokens equal; states within the bf16
matmul rounding of batch-size-dependent kernels: max |difference| over
max |value|, recorded). µs per decode step are medians over `--repeats`
dispatches of `--steps` steps after a warm-up.

  PYTHONPATH=. python benchmarks/scripts/pool_occupancy_bench.py \
      --out $OUT/pool_occupancy.json
  PYTHONPATH=. python benchmarks/scripts/pool_occupancy_bench.py --small \
      --out /tmp/po.json   # CPU: a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)

from configs import _decode_bench, hybrid_1b  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.decode_bench import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax import models, serving  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax.serving import rows as R  # pylint: disable=g-import-not-at-top,wrong-import-position


def filled_pool(model, capacity, max_len, prompt_len, mode, seed):
  """A pool whose every row holds a prefill of a random prompt."""
  cfg = model.config
  key = jax.random.PRNGKey(seed)
  prompts = jax.random.randint(key, (capacity, prompt_len), 0,
                               cfg.vocab_size, jnp.int32)
  state = model.init_state(capacity, max_len, ssm_mode=mode, buffer_len=16)
  logits, state = models.prefill(model, prompts,
                                 jnp.full((capacity,), prompt_len), state)
  tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return serving.Pool(state=state, active=jnp.ones((capacity,), bool),
                      tokens=tokens, max_len=max_len)


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


def time_us(fn, pool, repeats, steps):
  """Median µs per step of `repeats` dispatches (after one warm-up);
  `fn(pool) -> pool` donates its argument."""
  pool = fn(pool)
  jax.block_until_ready(pool)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    pool = fn(pool)
    jax.block_until_ready(pool)
    times.append((time.perf_counter() - t0) / steps * 1e6)
  return statistics.median(times), times


def state_error(a, b):
  """max |a - b| / max |b| over the float leaves (NaN-free rows)."""
  num = den = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if jnp.issubdtype(x.dtype, jnp.floating):
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      num = max(num, float(np.max(np.abs(x - y))))
      den = max(den, float(np.max(np.abs(y))))
  return num / max(den, 1e-30)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="pool_occupancy.json")
  ap.add_argument("--capacity", type=int, default=256)
  ap.add_argument("--occupancies", default="64,128,192,256",
                  help="active rows, comma-separated")
  ap.add_argument("--max_len", type=int, default=1024)
  ap.add_argument("--prompt_len", type=int, default=64)
  ap.add_argument("--steps", type=int, default=8, help="steps per dispatch")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--modes", default="replay,baseline")
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  if a.small:
    a.capacity, a.occupancies, a.max_len = 8, "2,4,8", 64
    a.prompt_len, a.repeats = 8, 2
    cfg = models.ModelConfig(**_decode_bench.TINY_MODEL)
  else:
    cfg = models.ModelConfig(**hybrid_1b.MODEL)
  res = dict(env=common.log_environment(),
             command=" ".join([sys.executable] + sys.argv),
             capacity=a.capacity, steps_per_dispatch=a.steps,
             max_len=a.max_len, records=[])

  def save():
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)

  model = build_model(cfg, seed=0)
  parts = serving.model_parts(model)  # split once, as the engine does
  steps = a.steps
  for mode in a.modes.split(","):
    base = filled_pool(model, a.capacity, a.max_len, a.prompt_len, mode, 1)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(base.state))
    for n in (int(x) for x in a.occupancies.split(",")):
      t0 = time.time()
      idx = jnp.arange(0, a.capacity, a.capacity // n)[:n].astype(jnp.int32)
      active = jnp.zeros((a.capacity,), bool).at[idx].set(True)

      def dense(pool):
        return serving.step_n(model, pool, steps, parts=parts)[0]

      def gathered(pool, idx=idx):
        sub, _ = serving.step_n(model, R.gather_rows(pool, idx), steps,
                                parts=parts)
        return R.scatter_rows(pool, sub, idx)

      def steps_only(sub):
        return serving.step_n(model, sub, steps, parts=parts)[0]

      # Check: the same dispatch both ways from the same pool.
      pool = base.replace(active=active)
      ref, ref_toks = serving.step_n(model, copy(pool), steps)
      sub, toks = serving.step_n(model, R.gather_rows(copy(pool), idx),
                                 steps)
      out = R.scatter_rows(copy(pool), sub, idx)
      rows = lambda p: jax.tree.map(lambda x: x[idx], p.state)  # pylint: disable=cell-var-from-loop
      tokens_equal = float(np.mean(np.asarray(ref_toks)[np.asarray(idx)]
                                   == np.asarray(toks)))
      err = state_error(rows(out), rows(ref))
      del ref, sub, out
      rec = dict(mode=mode, active=n, state_bytes=int(state_bytes),
                 tokens_equal=tokens_equal, state_rel_err=err)
      for name, fn, p in (
          ("dense", dense, copy(pool)),
          ("gathered", gathered, copy(pool)),
          ("steps", steps_only, R.gather_rows(copy(pool), idx))):
        us, times = time_us(fn, p, a.repeats, steps)
        rec[f"{name}_us_per_step"] = us
        rec[f"{name}_times_us"] = times
      rec["gathered_vs_dense"] = rec["dense_us_per_step"] / rec[
          "gathered_us_per_step"]
      rec["steps_vs_dense"] = rec["dense_us_per_step"] / rec[
          "steps_us_per_step"]
      rec["wall_s"] = time.time() - t0
      print({k: v for k, v in rec.items() if not k.endswith("times_us")},
            flush=True)
      res["records"].append(rec)
      save()
  save()


if __name__ == "__main__":
  main()
