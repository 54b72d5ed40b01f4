"""Where an engine's admissions spend their host time, with and without a
prefix cache (GPU; runs anywhere).

serve_bench's shared-prefix workload one request at a time: prompts of
--prompt_len tokens whose first --prefix_len are one of 4 prefixes,
--new_tokens tokens each, each request submitted before two dispatches
(so that admissions meet a decode call in flight, as at a light load),
on an `Engine` of --capacity slots, replay (L 16) or baseline states.
A first pass of --requests requests compiles what the workload needs
(no `precompile`: only its shapes); the second is timed: the engine's
admission ms per request, and the host functions under `Engine._admit`
by their own time (cProfile: a jitted call's dispatch counts in the
function that makes it; the admission paths' jitted functions are
wrapped in Python functions of their names, so that each call's host
time, waits included, is a row of its own). hybrid_1b's shapes, random
bf16 weights.

  PYTHONPATH=. python benchmarks/scripts/admission_profile.py \\
      --out $OUT/admission_profile.json
  PYTHONPATH=. python benchmarks/scripts/admission_profile.py --small \\
      --out /tmp/ap.json   # CPU: a tiny model
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)

from configs import _decode_bench, hybrid_1b  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import common  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments.decode_bench import build_model  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax import models, serving  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax.serving import pool as pool_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from replayssm_jax.serving import prefix_cache  # pylint: disable=g-import-not-at-top,wrong-import-position

# The jitted functions of the admission paths, by module.
ADMISSION_JITS = {pool_lib: ("_insert_many_jit",),
                  prefix_cache: ("_prefill_jit", "_extend_jit",
                                 "_finish_many_jit", "_take_jit")}


def wrap_jits():
  """Each function of ADMISSION_JITS replaced, in its module, by a Python
  function of the same name that calls it (the modules look them up at
  call time): cProfile then times each on its own."""
  for module, names in ADMISSION_JITS.items():
    for name in names:
      scope = {"jitted": getattr(module, name)}
      exec(f"def {name}(*args, **kwargs):\n"  # pylint: disable=exec-used
           f"  return jitted(*args, **kwargs)\n", scope)
      setattr(module, name, scope[name])


def own_times(profile: cProfile.Profile, top: int) -> list[dict]:
  """The `top` functions by own time (ms) with their calls."""
  st = pstats.Stats(profile)
  rows = [dict(function=f"{os.path.basename(f)}:{line}({name})",
               calls=nc, own_ms=1e3 * tt, cumulative_ms=1e3 * ct)
          for (f, line, name), (_, nc, tt, ct, _) in st.stats.items()]
  return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", default="admission_profile.json")
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--prefix_len", type=int, default=448)
  ap.add_argument("--new_tokens", type=int, default=16)
  ap.add_argument("--capacity", type=int, default=64)
  ap.add_argument("--requests", type=int, default=32)
  ap.add_argument("--modes", default="replay")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  if a.small:
    a.prompt_len, a.prefix_len, a.capacity, a.requests = 48, 32, 4, 6
    cfg = models.ModelConfig(**_decode_bench.TINY_MODEL)
  else:
    cfg = models.ModelConfig(**hybrid_1b.MODEL)
  max_len = 2 * a.prompt_len
  res = dict(env=common.log_environment(),
             command=" ".join([sys.executable] + sys.argv),
             args=vars(a), records=[])
  model = build_model(cfg, seed=0)
  wrap_jits()
  rng = np.random.default_rng(0)
  prefixes = rng.integers(0, cfg.vocab_size, (4, a.prefix_len),
                          dtype=np.int32)
  tail = a.prompt_len - a.prefix_len
  for mode in a.modes.split(","):
    for cached in (False, True):
      eng = serving.Engine(
          model, a.capacity, max_len, steps_per_dispatch=8,
          buffer_len=16, ssm_mode=mode, prefix_cache=(
              serving.PrefixCache(16, max_entries=64) if cached else None))

      def one_pass(first_id, profile=None):
        for i in range(first_id, first_id + a.requests):
          prompt = np.concatenate([
              prefixes[i % 4],
              rng.integers(0, cfg.vocab_size, tail, dtype=np.int32)])
          eng.submit(serving.Request(id=i, prompt=prompt,
                                     max_new_tokens=a.new_tokens))
          if profile is not None:
            profile.enable()
          eng.dispatch()
          if profile is not None:
            profile.disable()
          eng.dispatch()
        eng.run()

      one_pass(0)  # compiles
      eng.stats = serving.EngineStats()
      prof = cProfile.Profile()
      one_pass(a.requests, prof)
      st = eng.stats
      rec = dict(mode=mode, prefix_cache=cached,
                 admit_ms_per_request=1e3 * st.admit_s / st.admissions,
                 admissions=st.admissions,
                 cache=eng.prefix_cache.stats() if cached else None,
                 profiled_dispatches=a.requests,
                 own_time=own_times(prof, a.top))
      res["records"].append(rec)
      print(f"{mode} cache={cached}: admission "
            f"{rec['admit_ms_per_request']:.2f} ms per request", flush=True)
      for r in rec["own_time"][:12]:
        print(f"  {r['own_ms']:8.2f} ms own {r['cumulative_ms']:8.2f} cum "
              f"{r['calls']:5d} calls  {r['function']}", flush=True)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
