"""The micro-benchmarks' timing of a jitted loop (gdn_readout_layout.py,
mlp_gemm_micro.py): the difference of two loop lengths, so that the
dispatch, the first step's cold caches and the final sync cancel."""

import time

import jax
import numpy as np


def doubling_time(make_loop, *, min_ms=20.0, repeats=7, n_min=4,
                  n_max=4096):
  """(seconds per step, n): the median over `repeats` of (t(2n) - t(n)) /
  n, make_loop(n) a callable of no arguments that runs n steps (compiled on
  its first call), n the power of two in [n_min, n_max] from which t(n) >=
  min_ms by one step's time (two compilations besides that step's)."""

  def run(f):
    jax.block_until_ready(f())  # compile and warm up
    t = time.perf_counter()
    jax.block_until_ready(f())
    return time.perf_counter() - t

  one = run(make_loop(1))
  n = int(min(n_max, max(n_min, 2 ** np.ceil(np.log2(min_ms * 1e-3 / one)))))
  f1, f2 = make_loop(n), make_loop(2 * n)
  return float(np.median([(run(f2) - run(f1)) / n
                          for _ in range(repeats)])), n
