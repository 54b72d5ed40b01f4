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
With `time_budget_s` (the smoke config's), each timed loop stops growing
its calls, warming up and timing once that much wall time has passed
(`budget_hit` in its record), and the calibration logs its progress.

Outputs in --workdir: config.json, metrics.jsonl (one line per check, timing
and summary row), results.json (every figure plus device, versions, date and
command line), results.md (tables), speedup.png (replay amortized step over
the same implementation's baseline step vs batch, one line per L). With
--results_dir the last three are also copied there as <config.name>.*.

Usage: see configs/kernel_bench.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import traceback

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.kernel_bench_lib.checks import (_errors_ok, check_baseline,
                                                 check_replay)
from experiments.kernel_bench_lib.data import DeviceGen, HostGen
from experiments.kernel_bench_lib.report import _markdown, _plot
from experiments.kernel_bench_lib.steps import (_VARIANTS, BASELINE_OP,
                                                MOSAIC, REPLAY_OP,
                                                _impl_and_config,
                                                _plain_dict, _split_policy,
                                                _state_dtypes, _tree_bytes)
from experiments.kernel_bench_lib.timing import (count_state_copies,
                                                 make_loop,
                                                 measure_copy_bandwidth,
                                                 time_loop)
import replayssm_jax
from replayssm_jax import testing
from replayssm_jax import traffic

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "kernel_bench.py")

__all__ = ["BASELINE_OP", "Bench", "DeviceGen", "HostGen", "REPLAY_OP",
           "count_state_copies", "import_kernels", "make_loop",
           "measure_copy_bandwidth", "run", "time_loop", "_errors_ok",
           "_impl_and_config", "_markdown", "_plot", "_VARIANTS"]


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
                           iters=c.iters, state_shape=state_shape,
                           time_budget_s=c.get("time_budget_s", 0.0),
                           label=f"{impl} baseline b={batch}")
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
            state_shape=state_shape, cache=cache,
            time_budget_s=c.get("time_budget_s", 0.0),
            label=f"{impl} {phase} b={batch} L={L}")
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
