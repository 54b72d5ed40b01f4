r"""ReplaySSM demo: replay decode matches the baseline; what it saves in HBM.

1. Decodes `config.steps` random Mamba-2 tokens with the baseline step and
   with the ReplaySSM step for each buffer length L and buffer dtype (each
   run is one `jax.lax.scan` under `jax.jit`) and reports the maximal
   relative output deviation from a float32 reference-baseline decode, and
   the deviation of the final (materialized) state. Low-precision *baseline*
   states are decoded too, for context.
2. Tabulates the traffic model (`replayssm_jax.traffic`) at a production
   shape: bytes per step, baseline vs replay, predicted speed-up and the
   optimal L.

Usage (see configs/replay_demo.py):
  python -m experiments.replay_demo --config=configs/replay_demo.py \
      --workdir=runs/replay_demo

Outputs in --workdir: config.json, metrics.jsonl (one line per decode run and
per traffic row), summary.md, deviation.png, traffic_speedup.png.
"""

from __future__ import annotations

import functools
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import replayssm_jax
from replayssm_jax import reference
from replayssm_jax import testing
from replayssm_jax import traffic

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "replay_demo.py")


# ------------------------------------------------------------------ decoding
def _op_kwargs(params, inp):
  return dict(D=params["D"], z=inp["z"], dt_bias=params["dt_bias"],
              dt_softplus=True)


@functools.partial(jax.jit, static_argnames=("implementation",))
def decode_baseline(state0, xs, params, implementation=None):
  """Baseline decode over xs ([steps, batch, ...] leaves).

  Returns:
    (final state [b, h, p, n], ys [steps, b, h, p]).
  """
  def step(state, inp):
    y, state = replayssm_jax.selective_state_update(
        state, inp["x"], inp["dt"], params["A"], inp["B"], inp["C"],
        implementation=implementation, **_op_kwargs(params, inp))
    return state, y
  return jax.lax.scan(step, state0, xs)


@functools.partial(jax.jit, static_argnames=("implementation",))
def decode_replay(rstate0, xs, params, implementation=None):
  """ReplaySSM decode over xs. Returns (final ReplayState, ys)."""
  def step(rstate, inp):
    y, rstate = replayssm_jax.replay_state_update(
        rstate, inp["x"], inp["dt"], params["A"], inp["B"], inp["C"],
        implementation=implementation, **_op_kwargs(params, inp))
    return rstate, y
  return jax.lax.scan(step, rstate0, xs)


_materialize = jax.jit(replayssm_jax.materialize)


@jax.jit
def per_step_rel_dev(ys, ys_ref):
  """max_{b,h,p} |y - y_ref| / max_{b,h,p} |y_ref| for each step -> [T]."""
  ys, ys_ref = ys.astype(jnp.float32), ys_ref.astype(jnp.float32)
  num = jnp.max(jnp.abs(ys - ys_ref), axis=(1, 2, 3))
  den = jnp.maximum(jnp.max(jnp.abs(ys_ref), axis=(1, 2, 3)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(ys), axis=(1, 2, 3)), num / den,
                   jnp.inf)


def _within(actual, expected, tol) -> bool:
  try:
    testing.assert_close(actual, expected, tol)
    return True
  except AssertionError:
    return False


def _step_inputs(key, config):
  """Random inputs for config.steps tokens, leaves [steps, batch, ...]."""
  gen = jax.jit(testing.random_step_inputs, static_argnums=(1, 2, 3, 4, 5, 6),
                static_argnames=("dt_softplus", "with_z", "seqlen"))
  inp = gen(key, config.batch, config.nheads, config.headdim, config.dstate,
            config.ngroups, jnp.dtype(config.act_dtype), dt_softplus=True,
            with_z=config.has_z, seqlen=config.steps)
  return {k: None if v is None else jnp.swapaxes(v, 0, 1)
          for k, v in inp.items()}


@jax.jit
def _history_state(checkpoint, x_buf, b_buf, dt_buf, counts, A):
  """The checkpoint advanced over each row's first counts[r] buffered tokens
  one token at a time with the *baseline* reference step (independent of
  `materialize`), in float32."""
  zero_c = jnp.zeros(b_buf.shape[:1] + b_buf.shape[2:], jnp.float32)

  def step(state, j):
    _, nxt = reference.selective_state_update(
        state, x_buf[:, j].astype(jnp.float32), dt_buf[:, j], A,
        b_buf[:, j].astype(jnp.float32), zero_c)
    live = (j < counts)[:, None, None, None]
    return jnp.where(live, nxt, state), None

  state, _ = jax.lax.scan(step, checkpoint.astype(jnp.float32),
                          jnp.arange(x_buf.shape[1]))
  return state


def ragged_replay_state(rng: np.random.Generator, config, buffer_len, counts,
                        A, checkpoint_dtype, buffer_dtype):
  """(ReplayState with counts[r] random buffered tokens in row r, full f32
  state of the baseline over the same history).

  The same distributions as `testing.random_replay_state` (junk in stale
  slots), drawn with numpy so that each L costs no PRNG compilation.
  """
  b, h, p, n, g = (config.batch, config.nheads, config.headdim,
                   config.dstate, config.ngroups)
  L = buffer_len
  f32 = np.float32
  checkpoint = rng.standard_normal((b, h, p, n), f32)
  x_buf = rng.standard_normal((b, L, h, p), f32)
  b_buf = rng.standard_normal((b, L, g, n), f32)
  dt_buf = rng.uniform(0.01, 0.5, (b, L, h)).astype(f32)
  stale = np.arange(L)[None, :] >= counts[:, None]  # [b, L]
  x_buf[stale] = 1e4
  b_buf[stale] = -1e4
  dt_buf[stale] = 50.0
  rstate = replayssm_jax.ReplayState(
      checkpoint=jnp.asarray(checkpoint, checkpoint_dtype),
      x_buf=jnp.asarray(x_buf, buffer_dtype),
      b_buf=jnp.asarray(b_buf, buffer_dtype),
      dt_buf=jnp.asarray(dt_buf), count=jnp.asarray(counts, jnp.int32))
  # Round through the storage dtypes so that both decodes see the same
  # numbers (cast back to f32 keeps one compilation for every dtype).
  f = lambda a: a.astype(jnp.float32)  # noqa: E731
  full = _history_state(f(rstate.checkpoint), f(rstate.x_buf),
                        f(rstate.b_buf), rstate.dt_buf, rstate.count, A)
  return rstate, full


def _timed(fn, *args, **kwargs):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args, **kwargs))
  return out, time.perf_counter() - t0


def run_decode(config, writer: common.MetricsWriter) -> list[dict]:
  """Baseline and replay decodes; one metrics line per (mode, L, dtype)."""
  impl = config.implementation or None
  b, h, p, n, g = (config.batch, config.nheads, config.headdim,
                   config.dstate, config.ngroups)
  T = config.steps
  # "rbg" keys compile much faster than threefry on CPU; the numbers only
  # need to be random, not reproducible across PRNG implementations.
  key = jax.random.key(config.seed, impl="rbg")
  k_par, k_in = jax.random.split(key)
  params = jax.jit(testing.random_params, static_argnums=1)(k_par, h)
  xs = _step_inputs(k_in, config)
  rng = np.random.default_rng(config.seed)
  records = []

  # Truth for the baseline rows: reference decode with a float32 state.
  s0 = jnp.asarray(rng.standard_normal((b, h, p, n), np.float32))
  (final_ref, ys_ref), dt_s = _timed(decode_baseline, s0, xs, params,
                                     implementation="reference")
  logging.info("reference baseline (float32 state): %d steps in %.2fs", T,
               dt_s)
  for sdt in config.baseline_state_dtypes:
    sdt = jnp.dtype(sdt)
    (final, ys), wall = _timed(decode_baseline, s0.astype(sdt), xs, params,
                               implementation=impl)
    dev = np.asarray(per_step_rel_dev(ys, ys_ref))
    tol = testing.tolerance(sdt, config.act_dtype)
    rec = dict(kind="decode", mode="baseline", L=None,
               state_dtype=sdt.name, checkpoint_dtype=None,
               buffer_dtype=None, steps=T,
               max_rel_output_dev=float(np.max(dev)),
               mean_rel_output_dev=float(np.mean(dev)),
               final_state_rel_dev=testing.max_rel_error(final, final_ref),
               tolerance=tol.atol,
               within_tolerance=_within(ys, ys_ref, tol),
               wall_s=wall, dev_per_step=dev.tolist())
    records.append(writer.write(rec))
    logging.info("baseline state %-8s: max output dev %.2e, final state dev "
                 "%.2e (%.2fs)", sdt.name, rec["max_rel_output_dev"],
                 rec["final_state_rel_dev"], wall)

  ckpt_dt = jnp.dtype(config.checkpoint_dtype)
  for L in config.buffer_lens:
    # Same history for every buffer dtype (up to its rounding).
    seed_L = (config.seed, L)
    counts = (np.arange(b) % L if config.stagger
              else np.zeros(b)).astype(np.int32)
    for bdt in config.buffer_dtypes:
      bdt = jnp.dtype(bdt)
      if config.stagger:
        rstate0, full0 = ragged_replay_state(
            np.random.default_rng(seed_L), config, L, counts, params["A"],
            ckpt_dt, bdt)
      else:
        rstate0 = replayssm_jax.ReplayState.from_ssm_state(
            s0, g, L, checkpoint_dtype=ckpt_dt, buffer_dtype=bdt)
        full0 = s0.astype(ckpt_dt).astype(jnp.float32)
      # Truth: the float32 reference baseline from the same full state.
      final_b, ys_b = decode_baseline(full0, xs, params,
                                      implementation="reference")
      (final_rs, ys), wall = _timed(decode_replay, rstate0, xs, params,
                                    implementation=impl)
      state = _materialize(final_rs, params["A"])
      dev = np.asarray(per_step_rel_dev(ys, ys_b))
      tol = testing.tolerance(ckpt_dt, bdt, config.act_dtype)
      rec = dict(kind="decode", mode="replay", L=L, state_dtype=None,
                 checkpoint_dtype=ckpt_dt.name, buffer_dtype=bdt.name,
                 steps=T,
                 max_rel_output_dev=float(np.max(dev)),
                 mean_rel_output_dev=float(np.mean(dev)),
                 final_state_rel_dev=testing.max_rel_error(state, final_b),
                 tolerance=tol.atol,
                 within_tolerance=(_within(ys, ys_b, tol)
                                   and _within(state, final_b, tol)),
                 wall_s=wall, dev_per_step=dev.tolist())
      records.append(writer.write(rec))
      logging.info("replay L=%-2d buffer %-8s: max output dev %.2e, final "
                   "state dev %.2e (%.2fs)%s", L, bdt.name,
                   rec["max_rel_output_dev"], rec["final_state_rel_dev"],
                   wall, "" if rec["within_tolerance"] else
                   "  ** OUTSIDE TOLERANCE **")
  return records


# ------------------------------------------------------------------ traffic
def run_traffic(config, writer: common.MetricsWriter):
  """Traffic-model tables at config.traffic; returns (rows, optima)."""
  tc = config.traffic
  dims = traffic.LayerDims(tc.nheads, tc.headdim, tc.dstate, tc.ngroups)
  rows, optima = [], []
  for cdt in tc.checkpoint_dtypes:
    kw = dict(buffer_dtype=tc.buffer_dtype, act_dtype=tc.act_dtype)
    for row in traffic.traffic_table(dims, tc.batch, tc.buffer_lens, cdt,
                                     **kw):
      rows.append(writer.write(dict(kind="traffic", **row)))
    L_opt = traffic.optimal_buffer_len(dims, cdt, max_len=tc.max_len, **kw)
    best = traffic.replay_breakdown(dims, tc.batch, L_opt, cdt, **kw)
    curve = [traffic.replay_breakdown(dims, tc.batch, L, cdt, **kw).speedup
             for L in range(1, tc.max_len + 1)]
    optima.append(writer.write(dict(
        kind="traffic_optimum", checkpoint_dtype=jnp.dtype(cdt).name,
        batch=tc.batch, optimal_L=L_opt,
        approx_optimal_L=traffic.approx_optimal_buffer_len(
            dims, cdt, tc.buffer_dtype),
        ratio=best.ratio, predicted_speedup=best.speedup,
        speedup_curve=curve)))
  return dims, rows, optima


# ------------------------------------------------------------------ reports
def _report(config, workdir, decode, dims, rows, optima) -> str:
  dec_cols = ["mode", "L", "state_dtype", "checkpoint_dtype",
              "buffer_dtype", "max_rel_output_dev", "final_state_rel_dev",
              "tolerance", "within_tolerance"]
  fmts = {"max_rel_output_dev": ".2e", "final_state_rel_dev": ".2e",
          "tolerance": ".0e"}
  t1 = common.markdown_table(decode, dec_cols, fmts)
  tr_cols = ["checkpoint_dtype", "L", "baseline_bytes",
             "replay_non_flush_bytes", "replay_flush_bytes",
             "replay_amortized_bytes", "ratio", "predicted_speedup"]
  mib = lambda v: None if v is None else v / 2**20  # noqa: E731
  tr_rows = [dict(r, **{k: mib(r[k]) for k in tr_cols if k.endswith("bytes")})
             for r in rows]
  fmts2 = {k: ".2f" for k in tr_cols if k.endswith("bytes")}
  fmts2.update(ratio=".3f", predicted_speedup=".2f")
  t2 = common.markdown_table(
      tr_rows, tr_cols, fmts2,
      headers={k: k.replace("_bytes", " MiB") for k in tr_cols})
  t3 = common.markdown_table(
      optima, ["checkpoint_dtype", "optimal_L", "approx_optimal_L", "ratio",
               "predicted_speedup"],
      {"approx_optimal_L": ".1f", "ratio": ".3f", "predicted_speedup": ".2f"})
  text = "\n".join([
      "# ReplaySSM demo",
      "",
      f"Decode: batch {config.batch}, nheads {config.nheads}, headdim "
      f"{config.headdim}, dstate {config.dstate}, ngroups {config.ngroups}, "
      f"{config.steps} steps, activations {config.act_dtype}, "
      f"implementation {config.implementation or 'default'}; deviations are "
      "relative to max |y| of a float32 reference-baseline decode.",
      "",
      t1,
      "",
      f"Traffic model per step (`replayssm_jax.traffic`): {dims}, batch "
      f"{config.traffic.batch}, buffers {config.traffic.buffer_dtype}, "
      f"activations {config.traffic.act_dtype}.",
      "",
      t2,
      "",
      t3,
      "",
  ])
  return common.write_summary(workdir, text)


def _plots(config, workdir, decode, optima):
  bdts = list(config.buffer_dtypes)
  fig, axes = common.new_figure(1, len(bdts), figsize=(6 * len(bdts), 4.2))
  steps = np.arange(1, config.steps + 1)
  for ax, bdt in zip(axes[0], bdts):
    for rec in decode:
      if rec["mode"] == "replay" and rec["buffer_dtype"] == jnp.dtype(
          bdt).name:
        exact = not np.any(rec["dev_per_step"])
        ax.plot(steps, np.maximum(rec["dev_per_step"], 1e-12),
                label=f"replay L={rec['L']}" + (" (exact: 0)" if exact
                                                else ""))
      elif rec["mode"] == "baseline" and rec["state_dtype"] != "float32":
        ax.plot(steps, np.maximum(rec["dev_per_step"], 1e-12), "k--",
                alpha=0.5, label=f"baseline, {rec['state_dtype']} state")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("max |y - y_ref| / max |y_ref|")
    ax.set_title(f"{jnp.dtype(config.checkpoint_dtype).name} checkpoint, "
                 f"{jnp.dtype(bdt).name} buffers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
  common.save_plot(fig, os.path.join(workdir, "deviation.png"))

  tc = config.traffic
  fig, axes = common.new_figure(1, 1)
  ax = axes[0][0]
  for opt in optima:
    curve = opt["speedup_curve"]
    Ls = np.arange(1, len(curve) + 1)
    line, = ax.plot(Ls, curve, label=f"{opt['checkpoint_dtype']} checkpoint")
    ax.plot([opt["optimal_L"]], [opt["predicted_speedup"]], "o",
            color=line.get_color())
    ax.annotate(f"L*={opt['optimal_L']}", (opt["optimal_L"],
                                            opt["predicted_speedup"]),
                textcoords="offset points", xytext=(4, 6), fontsize=8)
  ax.axhline(1.0, color="k", lw=0.8, ls=":")
  ax.set_xscale("log", base=2)
  ticks = [L for L in (1, 2, 4, 8, 16, 32, 64, 128) if L <= tc.max_len]
  ax.set_xticks(ticks, [str(L) for L in ticks])
  ax.minorticks_off()
  ax.set_xlabel("buffer length L")
  ax.set_ylabel("predicted speed-up (baseline / replay bytes)")
  ax.set_title(f"H={tc.nheads} P={tc.headdim} N={tc.dstate} G={tc.ngroups}, "
               f"batch {tc.batch}, {tc.buffer_dtype} buffers")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  common.save_plot(fig, os.path.join(workdir, "traffic_speedup.png"))


def run(config, workdir: str) -> dict:
  """Runs the demo into `workdir`; returns the decode and traffic records."""
  t0 = time.perf_counter()
  workdir, env, writer = common.start_run(workdir, config)
  decode = run_decode(config, writer)
  dims, rows, optima = run_traffic(config, writer)
  text = _report(config, workdir, decode, dims, rows, optima)
  _plots(config, workdir, decode, optima)
  common.log_block(text)
  wall = time.perf_counter() - t0
  logging.info("replay_demo finished in %.1fs; outputs in %s", wall, workdir)
  return dict(workdir=workdir, decode=decode, traffic=rows, optima=optima,
              wall_s=wall)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/replay_demo")
