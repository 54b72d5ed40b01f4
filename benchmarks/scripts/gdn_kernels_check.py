"""The Gated DeltaNet Pallas kernels against their references on the device
at hand, at Qwen3.5-like shapes (16 key heads, 32 value heads of 128 x
128, L 16, window 4), with time per call.

  python benchmarks/scripts/gdn_kernels_check.py --out=gdn_kernels.json \
      [--batch=64] [--small]

For each op (gdn_step, gdn_replay_step with ragged counters so some rows
flush, gdn_replay_verify): the "pallas" implementation and the reference on
the same fresh random inputs (stale ring slots poisoned with NaN), max
|error| / max |reference| of the outputs and of the returned state (the
full state, or the materialized replay state), and the median time of
CALLS jitted calls after a warm-up, in µs. Records are written after each
op. `--small` shrinks the shapes to run on a CPU (interpret mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
CALLS = 20


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="gdn_kernels.json")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  sys.path.insert(0, ROOT)
  from replayssm_jax import gdn  # pylint: disable=g-import-not-at-top
  from replayssm_jax.gdn import testing as GT  # pylint: disable=g-import-not-at-top
  from replayssm_jax.testing import max_rel_error  # pylint: disable=g-import-not-at-top
  b, hk, hv, k, v, L, T = ((2, 1, 2, 16, 16, 4, 2) if a.small else
                           (a.batch, 16, 32, 128, 128, 16, 4))
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d"),
             shapes=dict(batch=b, num_k_heads=hk, num_v_heads=hv, key_dim=k,
                         value_dim=v, buffer_len=L, window=T), records=[])
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  one = GT.random_inputs(keys[0], b, hk, hv, k, v)
  win = GT.random_inputs(keys[1], b, hk, hv, k, v, T=T)
  counts = np.arange(b) % L  # every fill, the last one flushing
  rstate, full = GT.random_gdn_replay_state(keys[2], b, hk, hv, k, v, L,
                                            counts)
  rstate = GT.fill_stale_slots(rstate)
  counts_w = np.arange(b) % (L - T)  # room for the window
  wstate, _ = GT.random_gdn_replay_state(keys[3], b, hk, hv, k, v, L,
                                         counts_w)
  wstate = GT.fill_stale_slots(wstate)

  def as_state(x):
    return gdn.gdn_materialize(x) if isinstance(x, gdn.GDNReplayState) else x

  cases = (
      ("gdn_step", gdn.gdn_step, full, one),
      ("gdn_replay_step", gdn.gdn_replay_step, rstate, one),
      ("gdn_replay_verify", gdn.gdn_replay_verify, wstate, win),
  )
  for name, fn, st, inp in cases:
    try:
      rec = _check(name, fn, st, inp, as_state, max_rel_error)
    except Exception as e:  # pylint: disable=broad-except
      # Recorded, so one op's failure does not hide the others' results.
      rec = dict(op=name, error=f"{type(e).__name__}: {e}"[:2000])
    print(rec, flush=True)
    res["records"].append(rec)
    with open(a.out, "w") as fh:
      json.dump(res, fh, indent=1)


def _check(name, fn, st, inp, as_state, max_rel_error) -> dict:
  """Errors and times of one op's "pallas" implementation vs the
  reference."""
  outs, times = {}, {}
  for impl in ("reference", "pallas"):
    f = jax.jit(lambda st, inp, impl=impl: fn(st, **inp,
                                              implementation=impl))
    o, new = f(st, inp)
    outs[impl] = (o, as_state(new))
    jax.block_until_ready(f(st, inp))
    calls = []
    for _ in range(CALLS):
      t0 = time.perf_counter()
      jax.block_until_ready(f(st, inp))
      calls.append((time.perf_counter() - t0) * 1e6)
    times[impl] = float(np.median(calls))
  return dict(op=name,
              output_rel_error=max_rel_error(outs["pallas"][0],
                                             outs["reference"][0]),
              state_rel_error=max_rel_error(outs["pallas"][1],
                                            outs["reference"][1]),
              pallas_us=times["pallas"], reference_us=times["reference"])


if __name__ == "__main__":
  main()
