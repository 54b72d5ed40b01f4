"""A partly occupied slot pool decoded several ways, checked and timed (GPU).

Each form is one compiled call of `--steps` decode steps with on-device
stopping, the engine's dispatch (`serving.controls.decode`):

  dense     every one of the `capacity` rows, free slots included, so a
            dispatch costs the same at any occupancy
  gathered  the active rows gathered into a batch of their number,
            decoded, and scattered back within the call
            (`Engine(compact_below=...)`)
  in_place  the active rows stepped in the pool through a slot per row
            (`Engine(compact_in_place=True)`: the Mamba-2 and attention
            kernels read and write the pool's rows; no copies of their
            state)
  steps     `serving.step_n` on a batch that already holds the active rows
            alone: what a dispatch over those rows costs without any
            pool around them (the floor)

per occupancy (active rows out of `--capacity`), at hybrid_1b's shapes
or a transformers config's (`--hf_config`, e.g. the Gated DeltaNet model
configs/qwen3_5_4b_text.json; random bf16 weights), replay (L 16) and
baseline states. The pool's rows
hold a real prefill of random prompts (never zeros). Before timing, the
gathered and in-place forms' tokens and active rows' states are checked
against the dense form's on the same pool (tokens equal; states within
the bf16 matmul rounding of batch-size-dependent kernels: max |difference|
over max |value|, recorded). µs per decode step are medians over
`--repeats` dispatches of `--steps` steps after a warm-up.

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
from replayssm_jax.models import hf  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax.serving import controls  # pylint: disable=g-import-not-at-top,wrong-import-position
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


def time_us(fn, pool, ctl, repeats, steps):
  """Median µs per step of `repeats` dispatches (after one warm-up);
  `fn(pool, ctl) -> (pool, tokens, ctl)` donates its arguments."""
  pool, _, ctl = fn(pool, ctl)
  jax.block_until_ready(pool)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    pool, _, ctl = fn(pool, ctl)
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
  ap.add_argument("--hf_config", default="",
                  help="a transformers config.json (relative to the "
                  "repository root) in place of hybrid_1b")
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  if a.hf_config:
    with open(os.path.join(ROOT, a.hf_config)) as f:
      cfg = hf.config_from_hf(json.load(f))[0].replace(
          dtype="bfloat16", param_dtype="bfloat16")
  else:
    cfg = models.ModelConfig(**hybrid_1b.MODEL)
  if a.small:
    a.capacity, a.occupancies, a.max_len = 8, "2,8", 64
    a.prompt_len, a.repeats = 8, 2
    cfg = models.ModelConfig(**_decode_bench.TINY_MODEL)
  res = dict(env=common.log_environment(),
             command=" ".join([sys.executable] + sys.argv),
             config=a.hf_config or "configs/hybrid_1b.py",
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

      ctl0 = controls.init_controls(a.capacity)
      ctl0 = ctl0.replace(left=jnp.full((a.capacity,), 1 << 30, jnp.int32))
      graphdef, params = parts

      def dispatch(pool, ctl, rows=None, in_place=False):
        return controls.decode(graphdef, params, pool, ctl, steps, False,
                               None, None, None, rows, in_place)

      def forms():
        """name -> fn(pool, ctl) -> (pool, tokens [k, steps], ctl)."""
        return dict(
            dense=dispatch,
            gathered=lambda p, c: dispatch(p, c, idx),
            in_place=lambda p, c: dispatch(p, c, idx, True))

      # Check: the same dispatch every way from the same pool.
      pool = base.replace(active=active)
      ref, ref_toks, _ = dispatch(copy(pool), copy(ctl0))
      rows = lambda p: jax.tree.map(lambda x: x[idx], p.state)  # pylint: disable=cell-var-from-loop
      rec = dict(mode=mode, active=n, state_bytes=int(state_bytes))
      for name, fn in forms().items():
        if name == "dense":
          continue
        out, toks, _ = fn(copy(pool), copy(ctl0))
        rec[f"{name}_tokens_equal"] = float(np.mean(
            np.asarray(ref_toks)[np.asarray(idx)] == np.asarray(toks)))
        rec[f"{name}_state_rel_err"] = state_error(rows(out), rows(ref))
        del out
      del ref

      def steps_only(sub, ctl):
        return serving.step_n(model, sub, steps, parts=parts)[0], None, ctl

      for name, fn, p in [(k, f, copy(pool)) for k, f in forms().items()] + [
          ("steps", steps_only, R.gather_rows(copy(pool), idx))]:
        us, times = time_us(fn, p, copy(ctl0), a.repeats, steps)
        rec[f"{name}_us_per_step"] = us
        rec[f"{name}_times_us"] = times
      for name in ("gathered", "in_place", "steps"):
        rec[f"{name}_vs_dense"] = rec["dense_us_per_step"] / rec[
            f"{name}_us_per_step"]
      rec["wall_s"] = time.time() - t0
      print({k: v for k, v in rec.items() if not k.endswith("times_us")},
            flush=True)
      res["records"].append(rec)
      save()
  save()


if __name__ == "__main__":
  main()
