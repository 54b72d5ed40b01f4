"""The kernel benchmark's timing: many decode steps in one jitted call,
calibrated, timed as differences of calls of n and 2n loop iterations."""

from __future__ import annotations

import math
import re
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments.kernel_bench_lib.steps import (BASELINE_OP, _baseline_step,
                                                _replay_step)


def make_loop(op: str, impl: str, num_sets: int, fixed_count: bool,
              rounds_per_iter: int = 1):
  """Jitted fn(states, inputs, params, rounds[, count]) -> (states, ys).

  Runs rounds * rounds_per_iter * num_sets consecutive decode steps; step i
  updates state set i % num_sets with inputs[i % num_sets]. `rounds` is a
  traced int32 (one executable for any number of steps): the trip count of
  a while loop whose body unrolls rounds_per_iter rounds. On GPU every
  iteration of an XLA while loop costs a device->host read of its predicate
  (~10 µs), so the body must hold many steps (>= min_steps) for that cost to
  vanish in the per-step time. `states` (a tuple of state sets) is
  donated, so XLA updates every set in place. With fixed_count (replay
  only) every step first resets the set's counter to `count` (a [batch]
  int32 buffer: `replace` passes it through, no kernel runs).
  """
  K = num_sets

  def loop(states, inputs, params, rounds, count=None):
    def body(_, carry):
      states, ys = list(carry[0]), list(carry[1])
      for k in list(range(K)) * rounds_per_iter:
        if op == BASELINE_OP:
          y, st = _baseline_step(states[k], inputs[k], params, impl)
        else:
          rs = states[k].replace(count=count) if fixed_count else states[k]
          y, st = _replay_step(rs, inputs[k], params, impl)
        # One step's results materialize before the next step reads them:
        # without the barrier XLA fuses a set's consecutive XLA-reference
        # steps into one pass over the state (and times it above the
        # device's bandwidth). Kernels (custom calls) are unaffected.
        ys[k], states[k] = jax.lax.optimization_barrier((y, st))
      return tuple(states), tuple(ys)

    # Carrying every set's last y keeps each step's output live.
    ys0 = tuple(jnp.zeros_like(inputs[k]["x"]) for k in range(K))
    return jax.lax.fori_loop(0, rounds, body, (tuple(states), ys0))

  return jax.jit(loop, donate_argnums=(0,))


_COPY_RE = re.compile(r"\b(copy|copy-start)\(")


def count_state_copies(hlo_text: str, shape: tuple[int, ...]) -> int:
  """Top-level (unfused) copy instructions whose result has `shape`.

  A state-sized copy outside a fusion means XLA could not update a state in
  place (it would add a full read + write of the state per step).
  """
  dims = "[" + ",".join(str(d) for d in shape) + "]"
  count, in_fusion = 0, False
  for line in hlo_text.splitlines():
    if line and not line[0].isspace() and line.rstrip().endswith("{"):
      name = line.split()[0].lstrip("%")
      if name == "ENTRY":
        name = line.split()[1].lstrip("%")
      in_fusion = "fused" in name or "fusion" in name
      continue
    if in_fusion or not _COPY_RE.search(line):
      continue
    lhs = line.split("=", 2)[1] if "=" in line else ""
    if dims in lhs.split("copy")[0]:
      count += 1
  return count


def time_loop(loop, states, inputs, params, extra, *, num_sets,
              min_call_s, warmup, iters, state_shape, rounds_per_iter=1,
              cache=None, time_budget_s=0.0, label=""):
  """Compiles, calibrates, warms up and times `loop`.

  The number of loop iterations per call starts at 1 and grows until the
  steps of one call, t(2n) - t(n) (the smaller of two such differences),
  last >= min_call_s (not the whole call: at batch 1 the call's fixed
  cost alone, ~2-7 ms of host dispatch for 60-128 donated state sets,
  can outlast min_call_s, and a difference covering ~0.4 ms of steps
  drowns in the dispatch jitter). Then
  `iters` interleaved pairs of calls with n and 2n iterations are timed:
  per-step time = (t(2n) - t(n)) / (steps of n iterations), which cancels
  the fixed cost of a call (host dispatch and argument handling, which
  grows with the number of donated buffers).

  Args:
    loop: from `make_loop`.
    states, inputs, params: its arguments (`states` is donated).
    extra: trailing arguments (the fixed count).
    num_sets: K, the number of state sets in `states`.
    min_call_s: minimal wall time of the steps of one timed call.
    warmup: untimed calls after compilation and calibration.
    iters: timed calls.
    state_shape: [batch, nheads, headdim, dstate], for the HLO copy scan.
    rounds_per_iter: rounds unrolled in one loop iteration (make_loop's).
    cache: dict keeping the executable (and its copy count) across calls
      with the same loop and argument shapes.
    time_budget_s: > 0: the wall time after compilation at which the
      calibration stops growing the calls, the warm-up is skipped and the
      timed pairs end (after the first); the stats' `budget_hit` says the
      budget cut a phase short (or the calibration foresaw it). For
      smoke runs on busy machines, where noise can hide the steps' time.
    label: what is timed, for the progress log lines.

  Returns:
    (stats dict, states after the last call).
  """
  cache = {} if cache is None else cache
  compile_s, rounds = 0.0, 1
  if "compiled" not in cache:
    t0 = time.perf_counter()
    cache["compiled"] = loop.lower(states, inputs, params, jnp.int32(rounds),
                                   *extra).compile()
    compile_s = time.perf_counter() - t0
    try:
      cache["copies"] = count_state_copies(cache["compiled"].as_text(),
                                           state_shape)
    except Exception:  # pylint: disable=broad-except
      cache["copies"] = None
  compiled, copies = cache["compiled"], cache["copies"]

  def call(states, n):
    t = time.perf_counter()
    states, ys = compiled(states, inputs, params, jnp.int32(n), *extra)
    jax.block_until_ready((states, ys))
    return states, time.perf_counter() - t

  def steps_part(states, n):
    """The smaller of two t(2n) - t(n): a one-off stall in one call (seen
    on the H200 at batch 1: one configuration stopped at 112 steps per
    call and timed a p10-p90 of 2.8-5.2 µs per step) cannot end the
    calibration early."""
    diffs = []
    for _ in range(2):
      states, t1 = call(states, n)
      states, t2 = call(states, 2 * n)
      diffs.append(t2 - t1)
    return states, min(diffs)

  start = time.perf_counter()
  budget = time_budget_s if time_budget_s and time_budget_s > 0 else None

  cut = False  # the budget cut a phase short (or was foreseen to)

  def over_budget(extra_s=0.0):
    nonlocal cut
    over = budget is not None and (
        time.perf_counter() - start + extra_s > budget)
    cut = cut or over
    return over

  states, first = call(states, rounds)  # first run: allocation, autotuning
  for _ in range(8):  # calibrate the rounds per call on the steps' part
    states, part = steps_part(states, rounds)
    logging.info("  timing %s: %d round(s) per call, steps' part %.2f ms",
                 label, rounds, part * 1e3)
    if part >= min_call_s:
      break
    grow = max(2.0, min(64.0, 1.2 * min_call_s / max(part, 1e-6)))
    # One calibration probe runs calls of n and 2n twice: ~6 calls.
    if over_budget(6 * grow * max(first, part)):
      logging.info("  timing %s: time budget (%.1f s) reached at %d "
                   "round(s) per call", label, budget, rounds)
      break
    rounds = math.ceil(rounds * grow)
  for _ in range(warmup):
    if over_budget():
      break
    states, _ = call(states, rounds)
  short, diffs = [], []
  for i in range(iters):
    if i and over_budget():
      break
    states, t1 = call(states, rounds)
    states, t2 = call(states, 2 * rounds)
    short.append(t1)
    diffs.append(t2 - t1)
  steps_per_call = num_sets * rounds * rounds_per_iter
  per_step = np.asarray(diffs) / steps_per_call * 1e6  # µs
  median = float(np.median(per_step))
  resolved = median > 0
  if not resolved:  # calls too short for the difference to beat the noise
    logging.warning("per-step time not resolved by the difference of "
                    "calls; reporting the whole short call per step (an "
                    "upper bound)")
    per_step = np.asarray(short) / steps_per_call * 1e6
    median = float(np.median(per_step))
  stats = dict(median_us=median, resolved=resolved,
               p10_us=float(np.percentile(per_step, 10)),
               p90_us=float(np.percentile(per_step, 90)),
               min_us=float(np.min(per_step)),
               call_overhead_us=(float(np.median(short) * 1e6
                                       - median * steps_per_call)
                                 if resolved else None),
               compile_s=compile_s, hlo_state_copies=copies,
               steps_per_call=steps_per_call, timed_calls=2 * len(diffs),
               budget_hit=over_budget() or cut)
  return stats, states


COPY_PASSES = 8


def measure_copy_bandwidth(nbytes: int, iters: int) -> dict:
  """Median stream bandwidth of `x + 1` (read + write bytes).

  One jitted call chains COPY_PASSES passes over the buffer (an
  optimization barrier between passes stops XLA from fusing them), so the
  host's per-call overhead does not deflate the figure.
  """
  n = max(1, nbytes // 4)
  if jax.default_backend() == "cpu":  # see HostGen
    x = jnp.asarray(np.random.default_rng(1).random(n, np.float32))
  else:
    x = jax.random.uniform(jax.random.key(1, impl="rbg"), (n,), jnp.float32)
  def passes(v):
    for _ in range(COPY_PASSES):
      v = jax.lax.optimization_barrier(v + jnp.float32(1))
    return v

  f = jax.jit(passes)
  jax.block_until_ready(f(x))
  times = []
  for _ in range(max(iters, 1)):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t)
  med = float(np.median(times))
  moved = 2 * n * 4 * COPY_PASSES
  rec = dict(bytes_moved=moved, median_us=med * 1e6,
             gbps=moved / med / 1e9,
             best_gbps=moved / float(np.min(times)) / 1e9)
  logging.info("stream bandwidth (%d x (x+1) over %.0f MiB): %.1f GB/s "
               "median, "
               "%.1f GB/s best", COPY_PASSES, n * 4 / 2**20, rec["gbps"],
               rec["best_gbps"])
  return rec
