r"""Benchmark of the decode-step kernels: baseline vs ReplaySSM.

For every registered implementation of `selective_state_update` (baseline)
and `replay_state_update` (ReplaySSM), every batch size, checkpoint dtype and
buffer length L in the config, this script

1. checks the implementation against the reference on that configuration
   (outputs, and new state / materialized state after a full L-step cycle
   from ragged counters) within the per-dtype tolerance of
   `replayssm_jax.testing`, and records pass/fail and the max errors;
2. times it:
   * the baseline step;
   * the replay non-flush step with every row at the mean non-flush fill
     (L-2)//2, and the flush step with every row at count L-1 (the count is
     reset to that value before every step with `rstate.replace(count=...)`,
     which passes a fixed [batch] int32 buffer and costs no kernel);
   * the amortized replay step ((L-1) * non_flush + flush) / L, derived
     (exact for a kernel whose cost is linear in the fill, since (L-2)/2 is
     the mean non-flush fill for even L);
   * the natural cycle: consecutive steps with the counters advancing and the
     rows staggered (count = row % L), so about 1/L of the rows flush at
     every step; each timed call covers a whole number of L-step cycles;
   * optionally (`extra_fills`, `synced_cycle`) the non-flush step at other
     fills, and the synced cycle: the counters advancing from 0 in every
     row, so all rows flush in the same step (a decode loop over prompts of
     one length, as experiments/decode_bench.py runs);
3. relates every time to the traffic model (`replayssm_jax.traffic`): the
   achieved bandwidth model_bytes / time, and its fraction of the device's
   measured stream bandwidth (8 chained `x + 1` passes over `copy_bytes`
   in one jit, counting read + write).

Timing methodology. Every timed call is ONE jitted function running many
consecutive decode steps (`lax.fori_loop` over a traced number of
iterations, each unrolling >= `min_steps` steps over K state sets, step i
touching set i % K; an XLA while-loop iteration costs a host read of its
predicate on GPU, so iterations must be long).
The K sets total >= `rotate_bytes` (256 MiB, > the 60 MB L2 of an
H100/H200), so every step streams its state from HBM. The state sets are
donated (`donate_argnums`), so the updates alias in place: a copy of the
state would double the traffic; the compiled HLO is scanned for state-sized
copies and their count is reported (`hlo_state_copies`, should be 0 for a
kernel). Outputs y of every step stay live (carried), so no step can be
dead-code eliminated. Each call runs >= `min_steps` steps, and more until a
call's steps last >= `min_call_ms` (t(2n) - t(n), without the call's
fixed cost). Inputs are fresh random (never zeros), one set
per state set. After compilation, calibration and `warmup` calls, `iters`
pairs of calls are timed with `jax.block_until_ready`, each pair one call
of n loop iterations and one of 2n, interleaved; a step's time is the
pair's difference over the extra steps, so the fixed cost of a call (host
dispatch of an executable whose arguments are K state sets: ~ms for
hundreds of small sets at batch 1) cancels; it is reported as
`call_overhead_us`. Per-step median / p10 / p90 over the pairs, in µs.

Outputs in --workdir: config.json, metrics.jsonl (one line per check, timing
and summary row), results.json (every figure plus device, versions, date and
command line), results.md (tables), speedup.png (replay amortized step over
the same implementation's baseline step vs batch, one line per L). With
--results_dir the last three are also copied there as <config.name>.*.

Usage: see configs/kernel_bench.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import time
import traceback

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import replayssm_jax
from replayssm_jax import precision
from replayssm_jax import testing
from replayssm_jax import traffic

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "kernel_bench.py")

BASELINE_OP = "selective_state_update"
REPLAY_OP = "replay_state_update"


def import_kernels() -> str:
  """Imports `pallas_kernels` (which registers "pallas") if it exists."""
  try:
    # pylint: disable-next=g-import-not-at-top,unused-import
    import pallas_kernels  # noqa: F401
  except ImportError as e:
    logging.warning("pallas_kernels not imported (%s); timing the registered "
                    "implementations only.", e)
    return f"not imported: {e}"
  return "imported"


# ------------------------------------------------------------ random data
# Fresh random inputs and states (never zeros), with the distributions of
# `replayssm_jax.testing`: DeviceGen draws them with jitted jax.random on the
# device (fast for GiB-sized state sets); HostGen with numpy, used on the CPU
# backend, where the host *is* the device and numpy needs none of the
# per-shape XLA compilations that dominate small CPU runs.
def _raw_inputs(key, batch, dims, dtype, has_z, seqlen=None):
  return testing.random_step_inputs(
      key, batch, dims.nheads, dims.headdim, dims.dstate, dims.ngroups,
      dtype, dt_softplus=True, with_z=has_z, seqlen=seqlen)


def _raw_state(key, batch, dims, dtype):
  return jax.random.normal(
      key, (batch, dims.nheads, dims.headdim, dims.dstate),
      jnp.float32).astype(dtype)


def _raw_rstate(key, counts, junk, batch, dims, buffer_len, checkpoint_dtype,
                buffer_dtype):
  """A random ReplayState with the given counters ([batch] int32).

  Where `junk` (a traced bool) is true, buffer slots past each row's count
  hold large values, so that a kernel reading stale slots fails its check
  (as in `testing.random_replay_state`).
  """
  H, P, N, G, L = (dims.nheads, dims.headdim, dims.dstate, dims.ngroups,
                   buffer_len)
  kc, kx, kb, kd = jax.random.split(key, 4)
  checkpoint = jax.random.normal(kc, (batch, H, P, N), jnp.float32)
  x_buf = jax.random.normal(kx, (batch, L, H, P), jnp.float32)
  b_buf = jax.random.normal(kb, (batch, L, G, N), jnp.float32)
  dt_buf = jax.random.uniform(kd, (batch, L, H), jnp.float32, 0.01, 0.5)
  return _assemble_rstate(counts, junk, checkpoint.astype(checkpoint_dtype),
                          x_buf, b_buf, dt_buf, buffer_dtype)


def _assemble_rstate(counts, junk, checkpoint, x_buf, b_buf, dt_buf,
                     buffer_dtype, xp=jnp):
  L = x_buf.shape[1]
  stale = (xp.arange(L)[None, :] >= counts[:, None]) & junk  # [b, L]
  x_buf = xp.where(stale[..., None, None], 1e4, x_buf)
  b_buf = xp.where(stale[..., None, None], -1e4, b_buf)
  dt_buf = xp.where(stale[..., None], 50.0, dt_buf)
  return replayssm_jax.ReplayState(
      checkpoint=checkpoint, x_buf=x_buf.astype(buffer_dtype),
      b_buf=b_buf.astype(buffer_dtype), dt_buf=dt_buf.astype(xp.float32),
      count=counts.astype(xp.int32))


_gen_inputs = jax.jit(_raw_inputs, static_argnums=(1, 2, 3, 4, 5))
_gen_state = jax.jit(_raw_state, static_argnums=(1, 2, 3))
_gen_rstate = jax.jit(_raw_rstate, static_argnums=(3, 4, 5, 6, 7))


class DeviceGen:
  """Random data drawn on the device (jitted jax.random, "rbg" keys)."""

  def __init__(self, seed: int, dims: traffic.LayerDims):
    self.dims = dims
    self.key = jax.random.key(seed, impl="rbg")
    self.counter = 0

  def _key(self):
    self.counter += 1
    return jax.random.fold_in(self.key, self.counter)

  def inputs(self, batch, dtype, has_z, seqlen=None):
    """Leaves [batch, ...], or [seqlen, batch, ...] with seqlen."""
    inp = _gen_inputs(self._key(), batch, self.dims, dtype, has_z, seqlen)
    if seqlen is None:
      return inp
    return jax.tree.map(lambda v: jnp.swapaxes(v, 0, 1), inp)

  def state(self, batch, dtype):
    return _gen_state(self._key(), batch, self.dims, dtype)

  def rstate(self, counts, junk, buffer_len, checkpoint_dtype,
             buffer_dtype):
    counts = jnp.asarray(np.asarray(counts, np.int32))
    return _gen_rstate(self._key(), counts, junk, counts.shape[0],
                       self.dims, buffer_len, checkpoint_dtype, buffer_dtype)


class HostGen:
  """numpy twin of DeviceGen (same distributions)."""

  def __init__(self, seed: int, dims: traffic.LayerDims):
    self.dims = dims
    self.rng = np.random.default_rng(seed)

  @staticmethod
  def _put(a, dtype):
    # ml_dtypes casts on the host, so the transfer needs no compiled convert.
    return jnp.asarray(np.asarray(a, np.float32).astype(dtype))

  def inputs(self, batch, dtype, has_z, seqlen=None):
    d, r = self.dims, self.rng
    lead = (batch,) if seqlen is None else (seqlen, batch)
    H, P, N, G = d.nheads, d.headdim, d.dstate, d.ngroups
    out = dict(x=r.standard_normal(lead + (H, P)),
               dt=r.standard_normal(lead + (H,)) * 0.5 - 0.5,
               B=r.standard_normal(lead + (G, N)),
               C=r.standard_normal(lead + (G, N)) / np.sqrt(N),
               z=r.standard_normal(lead + (H, P)) if has_z else None)
    return {k: None if v is None else self._put(v, dtype)
            for k, v in out.items()}

  def state(self, batch, dtype):
    d = self.dims
    shape = (batch, d.nheads, d.headdim, d.dstate)
    return self._put(self.rng.standard_normal(shape, np.float32), dtype)

  def rstate(self, counts, junk, buffer_len, checkpoint_dtype,
             buffer_dtype):
    d, r, L = self.dims, self.rng, buffer_len
    counts = np.asarray(counts, np.int32)
    b = counts.shape[0]
    rs = _assemble_rstate(
        counts, junk, self.state(b, checkpoint_dtype),
        r.standard_normal((b, L, d.nheads, d.headdim), np.float32),
        r.standard_normal((b, L, d.ngroups, d.dstate), np.float32),
        r.uniform(0.01, 0.5, (b, L, d.nheads)), buffer_dtype, xp=np)
    return jax.tree.map(jnp.asarray, rs)


def _plain_dict(d) -> dict:
  return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def _tree_bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# ------------------------------------------------------------------ steps
# Tuned variants of the Pallas kernels, timed as implementation
# "pallas:<name>": name -> keyword arguments of pallas_kernels.SSUConfig
# (baseline) / ReplayConfig (replay), and "pallas_mosaic_gpu:<name>":
# MosaicSSUConfig (baseline). Filled from config.ssu_variants,
# config.replay_variants and config.mosaic_variants.
_VARIANTS: dict[str, dict[str, dict]] = {}
MOSAIC = "pallas_mosaic_gpu"


def _split_policy(impl: str):
  """"<impl>@<policy preset>" -> ("<impl>", PrecisionPolicy); else (impl,
  None). A replay implementation with a policy runs states stored as the
  policy says (master, read copy, buffers, stochastic rounding)."""
  impl, _, name = impl.partition("@")
  return impl, (precision.PrecisionPolicy.preset(name) if name else None)


def _state_dtypes(impl: str, checkpoint_dtype, buffer_dtype):
  """(policy, checkpoint dtype, buffer dtype, read-copy dtype) of the states
  `impl` runs: a policy's own dtypes, else the given ones (no copy)."""
  _, policy = _split_policy(impl)
  if policy is None:
    return None, checkpoint_dtype, buffer_dtype, None
  return (policy, jnp.dtype(policy.checkpoint_dtype),
          jnp.dtype(policy.buffer_dtype), policy.read_dtype)


def _impl_and_config(op: str, impl: str):
  """"name" -> (name, None); "pallas:<variant>" -> ("pallas", its config)."""
  impl, _ = _split_policy(impl)
  name, _, variant = impl.partition(":")
  if not variant:
    return name, None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  if name == MOSAIC:
    return name, pallas_kernels.MosaicSSUConfig(**_VARIANTS[MOSAIC][variant])
  cls = (pallas_kernels.SSUConfig if op == BASELINE_OP
         else pallas_kernels.ReplayConfig)
  return name, cls(**_VARIANTS[op][variant])


def _step(op: str, state, inp, params, impl):
  """One decode step of `op` ("pallas:<variant>" runs that config)."""
  name, config = _impl_and_config(op, impl)
  kw = {}
  if op == REPLAY_OP:
    kw["policy"] = _split_policy(impl)[1]
  fn = (replayssm_jax.selective_state_update if op == BASELINE_OP
        else replayssm_jax.replay_state_update)
  return fn(state, inp["x"], inp["dt"], params["A"], inp["B"], inp["C"],
            D=params["D"], z=inp["z"], dt_bias=params["dt_bias"],
            dt_softplus=True, implementation=name, config=config, **kw)


def _baseline_step(state, inp, params, impl):
  return _step(BASELINE_OP, state, inp, params, impl)


def _replay_step(rstate, inp, params, impl):
  return _step(REPLAY_OP, rstate, inp, params, impl)


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
        # steps into one pass over the state (the H200 grid of 2026-11-29
        # timed the reference baseline at 15-60 TB/s that way). Kernels
        # (custom calls) are unaffected.
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
              cache=None):
  """Compiles, calibrates, warms up and times `loop`.

  The number of loop iterations per call starts at 1 and grows until the
  steps of one call, t(2n) - t(n) (the smaller of two such differences),
  last >= min_call_s (not the whole call: at batch 1 the call's fixed
  cost alone, ~2-7 ms of host dispatch for 60-128 donated state sets,
  outlasted min_call_s, so the timed difference covered ~0.4 ms of steps
  and drowned in the dispatch jitter; session 15's f16 batch-1 baseline
  had a p10 of 0.04 µs per ~3 µs step). Then
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

  states, _ = call(states, rounds)  # first run: allocation, autotuning
  for _ in range(8):  # calibrate the rounds per call on the steps' part
    states, part = steps_part(states, rounds)
    if part >= min_call_s:
      break
    grow = max(2.0, min(64.0, 1.2 * min_call_s / max(part, 1e-6)))
    rounds = math.ceil(rounds * grow)
  for _ in range(warmup):
    states, _ = call(states, rounds)
  short, diffs = [], []
  for _ in range(iters):
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
               steps_per_call=steps_per_call, timed_calls=2 * iters)
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


# ----------------------------------------------------------------- checks
@jax.jit
def _close_stats(actual, expected, atol, rtol):
  """On-device twin of testing.max_rel_error / assert_close.

  Returns (max |a - e| / max |e| (inf if a is not finite), whether every
  |a - e| <= atol max|e| + rtol |e|). The check runs where the arrays are:
  at batch 256 the states are GiB-sized, and copying them to the host (and
  numpy over them) cost seconds per check.
  """
  a = actual.astype(jnp.float32)
  e = expected.astype(jnp.float32)
  finite = jnp.all(jnp.isfinite(a))
  scale = jnp.maximum(jnp.max(jnp.abs(e)), 1e-30)
  err = jnp.abs(a - e)
  ok = finite & jnp.all(err <= atol * scale + rtol * jnp.abs(e))
  return jnp.where(finite, jnp.max(err) / scale, jnp.inf), ok


def _errors_ok(actual, expected, tol):
  if actual.shape != expected.shape:
    return float("inf"), False
  err, ok = _close_stats(actual, expected, tol.atol, tol.rtol)
  return float(err), bool(ok)


@functools.partial(jax.jit, static_argnums=3)
def _baseline_check_run(state, inp, params, impl):
  """One baseline step of impl and of the reference on the same inputs."""
  return (_baseline_step(state, inp, params, impl),
          _baseline_step(state, inp, params, "reference"))


def check_baseline(impl, gen, *, batch, state_dtype, act_dtype, has_z,
                   params):
  """impl vs reference on one random baseline step (one compilation)."""
  state = gen.state(batch, state_dtype)
  inp = gen.inputs(batch, act_dtype, has_z)
  (y, s), (y_ref, s_ref) = _baseline_check_run(state, inp, params, impl)
  tol = testing.tolerance(state_dtype, act_dtype)
  ey, oky = _errors_ok(y, y_ref, tol)
  es, oks = _errors_ok(s, s_ref, tol)
  return dict(passed=bool(oky and oks), max_err_y=ey, max_err_state=es,
              tolerance=tol.atol)


@functools.partial(jax.jit, static_argnums=3)
def _replay_check_run(rs0, xs, params, impl):
  """L consecutive replay steps of impl (lax.scan) -> outputs, final state."""
  def step(rs, inp):
    y, rs = _replay_step(rs, inp, params, impl)
    return rs, y

  rs, ys = jax.lax.scan(step, rs0, xs)
  return dict(ys=ys, state=replayssm_jax.materialize(rs, params["A"]),
              checkpoint=rs.checkpoint, count=rs.count)


def check_replay(impl, gen, *, batch, buffer_len, checkpoint_dtype,
                 buffer_dtype, act_dtype, has_z, params, cache=None):
  """impl vs reference over one full L-step cycle from ragged counters.

  Row r starts at count (L-1-r) mod L (row 0 flushes first) with junk in
  its stale buffer slots, so within the L steps every row visits every
  fill, flush included. Compares y at every step, the counters exactly, the
  checkpoint and the materialized state at the end. `cache` (a dict) keeps
  the random inputs and the reference's results per shape, so every
  implementation checked at one shape runs on the same fresh inputs and
  the (slow to compile) reference runs once.
  """
  L = buffer_len
  policy, checkpoint_dtype, buffer_dtype, read_dtype = _state_dtypes(
      impl, checkpoint_dtype, buffer_dtype)
  ref_impl = "reference" + (f"@{policy.name}" if policy else "")
  key = (batch, L, checkpoint_dtype.name, ref_impl)
  cache = {} if cache is None else cache
  if key not in cache:
    counts = (L - 1 - np.arange(batch)) % L
    rs0 = gen.rstate(counts, True, L, checkpoint_dtype, buffer_dtype)
    if policy is not None:
      rs0 = rs0.with_policy(policy)
    xs = gen.inputs(batch, act_dtype, has_z, seqlen=L)  # [L, batch, ...]
    ref = _replay_check_run(rs0, xs, params, ref_impl)  # kept on device
    cache.clear()  # one shape at a time: the states may be large
    cache[key] = (rs0, xs, ref)
  rs0, xs, ref = cache[key]
  out = _replay_check_run(rs0, xs, params, impl)
  read = (read_dtype,) if read_dtype else ()
  tol = testing.tolerance(checkpoint_dtype, buffer_dtype, act_dtype, *read)
  ey, oky = _errors_ok(out["ys"], ref["ys"], tol)
  es, oks = _errors_ok(out["state"], ref["state"], tol)
  ec, okc = _errors_ok(out["checkpoint"], ref["checkpoint"], tol)
  counts_ok = bool(jnp.array_equal(out["count"], ref["count"]))
  return dict(passed=bool(oky and oks and okc and counts_ok), max_err_y=ey,
              max_err_state=es, max_err_checkpoint=ec, counts_equal=counts_ok,
              tolerance=tol.atol)


# --------------------------------------------------------------- benchmark
class Bench:
  """Runs the whole benchmark for one config; collects every record."""

  def __init__(self, config, workdir: str):
    self.c = config
    self.workdir = workdir
    self.dims = traffic.LayerDims(config.nheads, config.headdim,
                                  config.dstate, config.ngroups)
    self.act = jnp.dtype(config.act_dtype)
    self.buf = jnp.dtype(config.buffer_dtype)
    self.params = jax.jit(testing.random_params, static_argnums=1)(
        jax.random.key(config.seed, impl="rbg"), config.nheads)
    if not config.has_D:
      self.params["D"] = None
    if not config.has_dt_bias:
      self.params["dt_bias"] = None
    self.writer = common.MetricsWriter(workdir)
    self.checks, self.timings, self.summary = [], [], []
    self.copy_bw = None
    self._check_cache = {}  # check_replay's inputs + reference results
    # See "random data" above for why the CPU backend draws with numpy.
    _VARIANTS.clear()
    _VARIANTS[BASELINE_OP] = _plain_dict(config.get("ssu_variants", {}))
    _VARIANTS[REPLAY_OP] = _plain_dict(config.get("replay_variants", {}))
    _VARIANTS[MOSAIC] = _plain_dict(config.get("mosaic_variants", {}))
    gen_cls = HostGen if jax.default_backend() == "cpu" else DeviceGen
    self.gen = gen_cls(config.seed + 1, self.dims)

  def implementations(self, op: str) -> tuple[str, ...]:
    """config.implementations (default: all registered) of `op`, minus
    config.exclude_implementations (and, for the replay op,
    config.exclude_replay_implementations) unless that would leave none."""
    registered = replayssm_jax.implementations(op)
    wanted = tuple(self.c.implementations) or registered
    known = (set(replayssm_jax.implementations(BASELINE_OP))
             | set(replayssm_jax.implementations(REPLAY_OP)))
    unknown = [w for w in wanted if w not in known]
    if unknown:
      raise ValueError(
          f"config.implementations names {unknown}, not registered; "
          f"registered: {BASELINE_OP} "
          f"{replayssm_jax.implementations(BASELINE_OP)}, {REPLAY_OP} "
          f"{replayssm_jax.implementations(REPLAY_OP)}.")
    chosen = tuple(w for w in wanted if w in registered)
    excluded = tuple(self.c.exclude_implementations)
    if op == REPLAY_OP:
      excluded += tuple(self.c.exclude_replay_implementations)
    kept = tuple(w for w in chosen if w not in excluded)
    if not kept:
      logging.info("%s: excluding %s would leave no implementation; "
                   "timing %s", op, excluded, chosen)
      kept = chosen
    if "pallas" in registered:
      kept += tuple(f"pallas:{v}" for v in _VARIANTS.get(op, {}))
    if MOSAIC in kept:
      kept += tuple(f"{MOSAIC}:{v}" for v in _VARIANTS.get(MOSAIC, {}))
    if op == REPLAY_OP:  # the same implementations under each policy
      kept += tuple(f"{k}@{p}" for p in self.c.get("policies", ())
                    for k in kept if "@" not in k)
    return kept

  def _model_kw(self):
    return dict(has_z=self.c.has_z, has_D=self.c.has_D,
                has_dt_bias=self.c.has_dt_bias)

  def _num_sets(self, set_bytes: int) -> int:
    k = max(self.c.min_sets, math.ceil(self.c.rotate_bytes / set_bytes))
    if k > self.c.max_sets:
      logging.warning("capping rotating state sets at %d (would need %d)",
                      self.c.max_sets, k)
      k = self.c.max_sets
    return k

  def _inputs(self, batch: int, K: int):
    return tuple(self.gen.inputs(batch, self.act, self.c.has_z)
                 for _ in range(K))

  def _record_timing(self, rec: dict) -> dict:
    if rec.get("median_us"):
      gbps = rec["model_bytes"] / (rec["median_us"] * 1e-6) / 1e9
      rec["achieved_gbps"] = gbps
      rec["frac_stream_bw"] = (gbps / self.copy_bw["gbps"]
                               if self.copy_bw else None)
    self.timings.append(self.writer.write(dict(kind="timing", **rec)))
    return rec

  def _checked(self, tag, check_fn, **kw) -> bool:
    """Runs check_fn (vs the reference) unless disabled; False when the
    implementation cannot take the configuration."""
    if not self.c.check or tag["impl"] == "reference":
      return True
    try:
      chk = check_fn(tag["impl"], self.gen, act_dtype=self.act,
                     has_z=self.c.has_z, params=self.params, **kw)
    except Exception as e:  # pylint: disable=broad-except
      self._unsupported_or_raise(tag, e)
      return False
    self._record_check(tag, chk)
    return True

  # ------------------------------------------------------------- baseline
  def run_baseline(self, impl, batch, sdt):
    dims, c = self.dims, self.c
    tag = dict(impl=impl, op="baseline", batch=batch,
               checkpoint_dtype=sdt.name, L=None)
    if not self._checked(tag, check_baseline, batch=batch, state_dtype=sdt):
      return None
    state_shape = (batch, dims.nheads, dims.headdim, dims.dstate)
    set_bytes = math.prod(state_shape) * sdt.itemsize
    K = self._num_sets(set_bytes)
    rpi = math.ceil(c.min_steps / K)
    states = tuple(self.gen.state(batch, sdt) for _ in range(K))
    inputs = self._inputs(batch, K)
    loop = make_loop(BASELINE_OP, impl, K, fixed_count=False,
                     rounds_per_iter=rpi)
    try:
      stats, _ = time_loop(loop, states, inputs, self.params, (),
                           num_sets=K, rounds_per_iter=rpi,
                           min_call_s=c.min_call_ms * 1e-3, warmup=c.warmup,
                           iters=c.iters, state_shape=state_shape)
    except Exception as e:  # pylint: disable=broad-except
      self._unsupported_or_raise(tag, e)
      return None
    model = traffic.baseline_step_bytes(dims, batch, sdt, self.act,
                                        **self._model_kw())
    rec = self._record_timing(dict(tag, phase="baseline", fill=None,
                                   num_sets=K, set_bytes=set_bytes,
                                   model_bytes=model, **stats))
    logging.info("  %-9s baseline b=%-3d %-8s: %9.2f µs/step "
                 "[p10 %.2f, p90 %.2f] %7.1f GB/s (%d sets, %d steps/call)",
                 impl, batch, sdt.name, rec["median_us"], rec["p10_us"],
                 rec["p90_us"], rec["achieved_gbps"], K,
                 rec["steps_per_call"])
    return rec

  # --------------------------------------------------------------- replay
  def run_replay(self, impl, batch, sdt, L):
    """Times `impl` at (batch, L); sdt: the checkpoint dtype, or with a
    policy ("<impl>@<preset>") the dtype of the baseline it is compared
    with (the policy sets its own dtypes)."""
    dims, c = self.dims, self.c
    policy, ck, buf, read = _state_dtypes(impl, sdt, self.buf)
    tag = dict(impl=impl, op="replay", batch=batch,
               checkpoint_dtype=sdt.name, L=L,
               policy=policy.name if policy else None)
    if not self._checked(tag, check_replay, cache=self._check_cache,
                         batch=batch, buffer_len=L,
                         checkpoint_dtype=sdt, buffer_dtype=self.buf):
      return None

    state_shape = (batch, dims.nheads, dims.headdim, dims.dstate)

    def gen(counts):
      rs = self.gen.rstate(counts, False, L, ck, buf)
      return rs if policy is None else rs.with_policy(policy)
    natural_counts = (np.arange(batch) % L).astype(np.int32)
    probe = gen(natural_counts)
    set_bytes = _tree_bytes(probe)
    del probe
    K = self._num_sets(set_bytes)
    inputs = self._inputs(batch, K)
    kw = self._model_kw()
    amortized_bytes = traffic.replay_amortized_bytes(
        dims, batch, L, ck, buf, self.act, read_dtype=read, **kw)
    out = {}
    nf_fill = max((L - 2) // 2, 0)
    fixed_rpi = math.ceil(c.min_steps / K)
    # Natural cycle: each loop iteration advances every set by whole cycles.
    nat_rpi = L * math.ceil(fixed_rpi / L)
    # (phase, counts, advancing): the fixed-count phases reset the counters
    # before every step; the advancing ones run whole L-step cycles.
    phases = [("non_flush", np.full((batch,), nf_fill, np.int32), False),
              ("flush", np.full((batch,), L - 1, np.int32), False),
              ("natural", natural_counts, True)]
    phases += [(f"non_flush_fill{f}", np.full((batch,), f, np.int32), False)
               for f in c.get("extra_fills", ()) if 0 <= f < L - 1]
    if c.get("synced_cycle", False):  # every row at the same count
      phases.append(("synced", np.zeros((batch,), np.int32), True))
    fixed_loop = make_loop(REPLAY_OP, impl, K, fixed_count=True,
                           rounds_per_iter=fixed_rpi)
    fixed_cache = {}  # non_flush and flush share one executable
    for phase, counts, advancing in phases:
      if phase == "non_flush" and L < 2:
        continue
      fill = None if advancing else int(counts[0])
      states = tuple(gen(counts) for _ in range(K))
      if advancing:
        loop = make_loop(REPLAY_OP, impl, K, fixed_count=False,
                         rounds_per_iter=nat_rpi)
        extra, rpi, cache = (), nat_rpi, {}
        model = amortized_bytes
      else:
        loop, extra, rpi, cache = (
            fixed_loop, (jnp.asarray(counts),), fixed_rpi, fixed_cache)
        model = traffic.replay_step_bytes(dims, batch, L, fill, ck, buf,
                                          self.act, read_dtype=read, **kw)
      try:
        stats, states = time_loop(
            loop, states, inputs, self.params, extra, num_sets=K,
            rounds_per_iter=rpi, min_call_s=c.min_call_ms * 1e-3,
            warmup=c.warmup, iters=c.iters,
            state_shape=state_shape, cache=cache)
      except Exception as e:  # pylint: disable=broad-except
        self._unsupported_or_raise(dict(tag, phase=phase), e)
        return None
      del states
      out[phase] = self._record_timing(dict(
          tag, phase=phase, fill=fill, num_sets=K, set_bytes=set_bytes,
          model_bytes=model, **stats))

    # Amortized step, derived from the fixed-count phases.
    t_nf = out["non_flush"]["median_us"] if "non_flush" in out else 0.0
    amort = dict(
        median_us=((L - 1) * t_nf + out["flush"]["median_us"]) / L,
        p10_us=((L - 1) * out.get("non_flush", out["flush"])["p10_us"]
                + out["flush"]["p10_us"]) / L,
        p90_us=((L - 1) * out.get("non_flush", out["flush"])["p90_us"]
                + out["flush"]["p90_us"]) / L)
    out["amortized"] = self._record_timing(dict(
        tag, phase="amortized", fill=None, num_sets=K, set_bytes=set_bytes,
        model_bytes=amortized_bytes,
        derived="((L-1)*non_flush + flush)/L", **amort))
    logging.info("  %-9s replay   b=%-3d %-8s L=%-2d: non-flush %8.2f, "
                 "flush %8.2f, amortized %8.2f, natural %8.2f µs/step "
                 "(%d sets)", impl, batch, sdt.name, L, t_nf,
                 out["flush"]["median_us"], out["amortized"]["median_us"],
                 out["natural"]["median_us"], K)
    return out

  # -------------------------------------------------------------- records
  def _record_check(self, tag, chk):
    rec = self.writer.write(dict(kind="check", **tag, **chk))
    self.checks.append(rec)
    logging.info("  check %-9s %-8s b=%-3d %-8s L=%s: %s (max err y %.2e, "
                 "state %.2e, tol %.0e)", tag["impl"], tag["op"],
                 tag["batch"], tag["checkpoint_dtype"], tag["L"],
                 "PASS" if chk["passed"] else "** FAIL **", chk["max_err_y"],
                 chk["max_err_state"], chk["tolerance"])
    if not chk["passed"]:
      logging.error("implementation %s failed its check on %s", tag["impl"],
                    tag)

  def _unsupported_or_raise(self, tag, err):
    """Records a NotImplementedError (the kernel says why it cannot run),
    or any error of an experimental implementation (a kernel's first GPU
    run: the others are still timed); re-raises anything else."""
    impl = tag["impl"].partition("@")[0]  # "name" or "name:variant"
    experimental = tuple(self.c.get("experimental_implementations", ()))
    if not (isinstance(err, NotImplementedError) or impl in experimental
            or impl.partition(":")[0] in experimental):
      raise err
    self._unsupported(tag, err)

  def _unsupported(self, tag, err):
    reason = str(err)
    if not isinstance(err, NotImplementedError) or not reason:
      # A lowering's bare AssertionError says nothing: keep where it came
      # from (the last 6000 characters of the traceback).
      reason = "".join(traceback.format_exception(err))[-6000:]
    rec = self.writer.write(dict(kind="unsupported", **tag, reason=reason))
    self.checks.append(dict(rec, passed=None))
    logging.warning("  %s cannot run %s: %s", tag["impl"], tag, err)

  def _summarize(self, impl, batch, sdt, L, base, rep, best_base):
    kw = self._model_kw()
    policy, ck, buf, read = _state_dtypes(impl, sdt, self.buf)
    if policy is None:
      pred = traffic.replay_breakdown(self.dims, batch, L, sdt, self.buf,
                                      self.act, **kw).speedup
    else:  # vs the baseline at sdt
      pred = (traffic.baseline_step_bytes(self.dims, batch, sdt, self.act,
                                          **kw)
              / traffic.replay_amortized_bytes(self.dims, batch, L, ck, buf,
                                               self.act, read_dtype=read,
                                               **kw))
    chk = [c for c in self.checks if c["impl"] == impl
           and c["batch"] == batch and c["checkpoint_dtype"] == sdt.name
           and c["L"] in (L, None) and c.get("passed") is not None]
    row = dict(
        impl=impl, batch=batch, checkpoint_dtype=sdt.name, L=L,
        baseline_us=base["median_us"] if base else None,
        non_flush_us=rep.get("non_flush", {}).get("median_us"),
        flush_us=rep["flush"]["median_us"],
        amortized_us=rep["amortized"]["median_us"],
        natural_us=rep["natural"]["median_us"],
        speedup_amortized=(base["median_us"] / rep["amortized"]["median_us"]
                           if base else None),
        speedup_natural=(base["median_us"] / rep["natural"]["median_us"]
                         if base else None),
        speedup_vs_best_baseline=(best_base / rep["amortized"]["median_us"]
                                  if best_base else None),
        predicted_speedup=pred,
        baseline_frac_bw=base.get("frac_stream_bw") if base else None,
        natural_frac_bw=rep["natural"].get("frac_stream_bw"),
        checks_passed=(all(c["passed"] for c in chk) if chk else None),
    )
    self.summary.append(self.writer.write(dict(kind="summary", **row)))

  # ------------------------------------------------------------------ run
  def run(self):
    c = self.c
    self.copy_bw = measure_copy_bandwidth(c.copy_bytes, c.copy_iters)
    self.writer.write(dict(kind="stream_bandwidth", **self.copy_bw))
    base_impls = self.implementations(BASELINE_OP)
    rep_impls = self.implementations(REPLAY_OP)
    logging.info("implementations: baseline %s, replay %s", base_impls,
                 rep_impls)
    configs = [(jnp.dtype(d), b) for d in c.checkpoint_dtypes
               for b in c.batches]
    for i, (sdt, batch) in enumerate(configs):
      logging.info("[%d/%d] batch %d, %s checkpoint", i + 1, len(configs),
                   batch, sdt.name)
      bases = {impl: self.run_baseline(impl, batch, sdt)
               for impl in base_impls}
      times = [b["median_us"] for b in bases.values() if b]
      best_base = min(times) if times else None
      for L in c.buffer_lens:
        for impl in rep_impls:
          rep = self.run_replay(impl, batch, sdt, L)
          if rep:  # a kernel variant compares with its plain baseline
            plain = _split_policy(impl)[0]
            base = bases.get(plain) or bases.get(plain.partition(":")[0])
            self._summarize(impl, batch, sdt, L, base, rep, best_base)


# ---------------------------------------------------------------- reports
def _human_bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"


def _markdown(results: dict) -> str:
  meta = results["meta"]
  bw = results["stream_bandwidth"]
  cfg = results["config"]
  lines = [
      "# Decode-step kernel benchmark: baseline vs ReplaySSM",
      "",
      f"- device: {meta['device_kind']} ({meta['backend']}), jax "
      f"{meta['jax']}, jaxlib {meta['jaxlib']}, {meta['date']}",
      f"- command: `{meta['command_line']}`",
      f"- layer: nheads {cfg['nheads']}, headdim {cfg['headdim']}, dstate "
      f"{cfg['dstate']}, ngroups {cfg['ngroups']}; activations "
      f"{cfg['act_dtype']}, buffers {cfg['buffer_dtype']}, z "
      f"{cfg['has_z']}",
      f"- stream bandwidth (jitted x+1, read+write): {bw['gbps']:.1f} GB/s "
      f"median",
      f"- method: one jitted call runs >= {cfg['min_steps']} consecutive "
      f"steps over rotating donated state sets totalling >= "
      f"{_human_bytes(cfg['rotate_bytes'])}; median of {cfg['iters']} "
      f"calls after {cfg['warmup']} warm-up calls. amortized = ((L-1) * "
      "non_flush(fill (L-2)//2) + flush) / L; natural = counters advancing, "
      "rows staggered (count = row % L). speed-ups are over the same "
      "implementation's baseline step; `vs best` over the fastest baseline "
      "implementation; `pred` is the traffic model's baseline/amortized "
      "bytes; `%bw` = model bytes / time / stream bandwidth.",
      "",
      "## Summary (µs per decode step, medians)",
      "",
  ]
  cols = ["impl", "checkpoint_dtype", "batch", "L", "baseline_us",
          "non_flush_us", "flush_us", "amortized_us", "natural_us",
          "speedup_amortized", "speedup_natural", "speedup_vs_best_baseline",
          "predicted_speedup", "baseline_frac_bw", "natural_frac_bw",
          "checks_passed"]
  heads = {"checkpoint_dtype": "ckpt", "baseline_us": "base",
           "non_flush_us": "non-flush", "flush_us": "flush",
           "amortized_us": "amortized", "natural_us": "natural",
           "speedup_amortized": "x amort", "speedup_natural": "x natural",
           "speedup_vs_best_baseline": "x vs best", "predicted_speedup":
           "x pred", "baseline_frac_bw": "base %bw",
           "natural_frac_bw": "natural %bw", "checks_passed": "check"}
  fmts = {k: ".2f" for k in cols if k.endswith("_us")}
  fmts.update({k: ".2f" for k in cols if k.startswith(("speedup",
                                                       "predicted"))})
  fmts.update(baseline_frac_bw=".0%", natural_frac_bw=".0%")
  lines.append(common.markdown_table(results["summary"], cols, fmts, heads))
  lines += ["", "## Checks against the reference", ""]
  lines.append(common.markdown_table(
      results["checks"], ["impl", "op", "checkpoint_dtype", "batch", "L",
                          "passed", "max_err_y", "max_err_state",
                          "tolerance", "reason"],
      {"max_err_y": ".2e", "max_err_state": ".2e", "tolerance": ".0e"}))
  lines += ["", "## Every timing", ""]
  lines.append(common.markdown_table(
      results["timings"], ["impl", "op", "phase", "checkpoint_dtype",
                           "batch", "L", "fill", "median_us", "p10_us",
                           "p90_us", "achieved_gbps", "frac_stream_bw",
                           "num_sets", "steps_per_call", "hlo_state_copies"],
      {"median_us": ".2f", "p10_us": ".2f", "p90_us": ".2f",
       "achieved_gbps": ".0f", "frac_stream_bw": ".0%"}))
  return "\n".join(lines) + "\n"


def _plot(results: dict, path: str):
  rows = results["summary"]
  impls = sorted({r["impl"] for r in rows})
  dtypes = list(dict.fromkeys(r["checkpoint_dtype"] for r in rows))
  if not rows:
    dtypes, impls = ["none"], ["none"]
  fig, axes = common.new_figure(len(impls), len(dtypes),
                                figsize=(6 * len(dtypes), 4 * len(impls)))
  for i, impl in enumerate(impls):
    for j, sdt in enumerate(dtypes):
      ax = axes[i][j]
      sel = [r for r in rows if r["impl"] == impl
             and r["checkpoint_dtype"] == sdt
             and r["speedup_amortized"] is not None]
      for L in sorted({r["L"] for r in sel}):
        pts = sorted((r["batch"], r["speedup_amortized"],
                      r["predicted_speedup"]) for r in sel if r["L"] == L)
        xs = [p[0] for p in pts]
        line, = ax.plot(xs, [p[1] for p in pts], "o-", label=f"L={L}")
        ax.plot(xs, [p[2] for p in pts], ":", color=line.get_color(),
                alpha=0.6)
      ax.axhline(1.0, color="k", lw=0.8, ls="--")
      ax.set_xscale("log", base=2)
      batches = sorted({r["batch"] for r in sel})
      if batches:
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
      ax.set_xlabel("batch")
      ax.set_ylabel("replay amortized speed-up over baseline")
      ax.set_title(f"{impl}, {sdt} checkpoint "
                   f"({results['meta']['device_kind']})", fontsize=10)
      ax.grid(True, which="both", alpha=0.3)
      if sel:
        ax.legend(fontsize=8, title="dotted: model", title_fontsize=7)
  common.save_plot(fig, path)


def run(config, workdir: str, results_dir: str | None = None) -> dict:
  """Runs the benchmark into `workdir` (and copies results to results_dir)."""
  t0 = time.perf_counter()
  workdir = common.prepare_workdir(workdir, config)
  env = common.log_environment()
  env["pallas_kernels"] = import_kernels()
  env["implementations"] = {
      op: list(replayssm_jax.implementations(op))
      for op in (BASELINE_OP, REPLAY_OP)}
  bench = Bench(config, workdir)
  bench.writer.write(dict(kind="environment", **env))
  bench.run()
  results = common.to_jsonable(dict(
      meta=env, config=config, stream_bandwidth=bench.copy_bw,
      checks=bench.checks, timings=bench.timings, summary=bench.summary,
      wall_s=time.perf_counter() - t0))
  paths = dict(json=os.path.join(workdir, "results.json"),
               md=os.path.join(workdir, "results.md"),
               png=os.path.join(workdir, "speedup.png"))
  with open(paths["json"], "w") as f:
    json.dump(results, f, indent=1)
  text = _markdown(results)
  with open(paths["md"], "w") as f:
    f.write(text)
  _plot(results, paths["png"])
  if results_dir:
    os.makedirs(results_dir, exist_ok=True)
    for ext, src in paths.items():
      dst = os.path.join(results_dir, f"{config.name}.{ext}")
      shutil.copyfile(src, dst)
      logging.info("copied %s -> %s", src, dst)
  common.log_block(common.markdown_table(
      results["summary"], ["impl", "checkpoint_dtype", "batch", "L",
                           "baseline_us", "amortized_us", "natural_us",
                           "speedup_amortized", "speedup_natural",
                           "predicted_speedup", "checks_passed"],
      {"baseline_us": ".2f", "amortized_us": ".2f", "natural_us": ".2f",
       "speedup_amortized": ".2f", "speedup_natural": ".2f",
       "predicted_speedup": ".2f"}))
  failed = [c for c in bench.checks if c.get("passed") is False]
  if failed:
    logging.error("%d check(s) FAILED; see results.md", len(failed))
  logging.info("kernel_bench finished in %.1fs; results in %s",
               results["wall_s"], workdir)
  return results


if __name__ == "__main__":
  common.run_app(
      lambda config, workdir, results_dir: run(config, workdir,
                                               results_dir or None),
      default_config=_DEFAULT_CONFIG, default_workdir="runs/kernel_bench",
      extra_flags={"results_dir": (
          "", "Optional directory (e.g. benchmarks/) that also receives "
          "<config.name>.json/.md/.png.")})
