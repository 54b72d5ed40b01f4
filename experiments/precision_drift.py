r"""Error growth of low-precision decode states over long decodes.

For each precision policy (`replayssm_jax.precision.PrecisionPolicy`) x
buffer length L, decodes `config.steps` random Mamba-2 tokens with the
ReplaySSM reference step and, alongside in the same loop, a float64 (or
float32) reference recurrence from the same initial state. For contrast,
baselines that store the full state in a low-precision dtype every step
(round to nearest or stochastic rounding) run against the same reference.

Measured at log-spaced steps (the loop runs in jitted `lax.fori_loop`
chunks between measurement points, so 100k steps are feasible on a GPU):
  * state error: max |S - S_ref| / max |S_ref| and ||S - S_ref||_F /
    ||S_ref||_F of the materialized state (the master checkpoint advanced
    over the buffer);
  * output error: per step max |y - y_ref| / max |y_ref|; the maximum and
    the mean over each chunk.
Inputs are drawn inside the loop from fold_in(key, step), so every run sees
the same token stream without storing it.

Usage (see configs/precision_drift.py):
  python -m experiments.precision_drift --config=configs/precision_drift.py \
      --workdir=runs/precision_drift

Outputs in --workdir: config.json, metrics.jsonl (one line per run),
summary.md, state_error.png, output_error.png.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import reference
from replayssm_jax import testing

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "precision_drift.py")


# ---------------------------------------------------------------- helpers
def layer_dims(config):
  """(batch, nheads, headdim, dstate, ngroups) after head scaling."""
  h = max(1, config.nheads // config.head_scale)
  g = max(1, config.ngroups // config.head_scale)
  if h % g:
    raise ValueError(f"scaled nheads ({h}) must be divisible by scaled "
                     f"ngroups ({g}); change config.head_scale.")
  return config.batch, h, config.headdim, config.dstate, g


def drift_params(key, config):
  """The layer's A, D, dt_bias (`testing.random_params`) with A scaled by
  `config.a_scale`: 1 gives A in [-4, -0.5] (per-step decays 0.43-0.93 at
  the typical dt ~0.2: the state forgets a rounding within a few steps);
  0.01 gives long-memory heads (decays 0.9917-0.9992, hundreds of steps)."""
  params = testing.random_params(key, layer_dims(config)[1],
                                 with_D=config.with_D)
  if not config.a_scale > 0:
    raise ValueError(f"config.a_scale must be > 0, got {config.a_scale!r}.")
  params["A"] = params["A"] * config.a_scale
  return params


def _keys(config):
  """(params, initial state, inputs) keys of a run."""
  return jax.random.split(jax.random.PRNGKey(config.seed), 3)


def measure_points(steps: int, num: int) -> np.ndarray:
  """Log-spaced step counts in [1, steps], always ending at steps."""
  pts = np.unique(np.round(np.logspace(0, np.log10(steps), num)).astype(int))
  return np.unique(np.concatenate([pts[pts >= 1], [steps]]))


@contextlib.contextmanager
def precision_context(ref_dtype: str):
  """float64 enabled for the run when the reference is float64."""
  if jnp.dtype(ref_dtype) != jnp.float64:
    yield
    return
  enable = getattr(jax, "enable_x64", None)
  if enable is None:
    from jax.experimental import enable_x64 as enable  # pylint: disable=g-import-not-at-top
  with enable(True):
    yield


def _tokens(key, t, dims, inputs=None):
  """Step t's inputs: drawn from fold_in(key, t), or (inputs: a dict of
  [steps, batch, ...] arrays recorded from a model, e.g. by
  experiments/precision_lib/state_error.py) their row t."""
  if inputs is not None:
    return {k: v[t] for k, v in inputs.items()}
  b, h, p, n, g = dims
  return testing.random_step_inputs(jax.random.fold_in(key, t), b, h, p, n,
                                    g, with_z=False)


def _ref_step(S, tok, params):
  """The exact recurrence in S.dtype (f64 or f32): S = e^{dA} S + d x B^T."""
  dt = S.dtype
  h = S.shape[1]
  d = tok["dt"].astype(dt) + params["dt_bias"].astype(dt)
  d = jnp.where(d <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(d, 20.0))), d)
  decay = jnp.exp(d * params["A"].astype(dt))
  bh = jnp.repeat(tok["B"].astype(dt), h // tok["B"].shape[1], axis=1)
  ch = jnp.repeat(tok["C"].astype(dt), h // tok["C"].shape[1], axis=1)
  dx = d[..., None] * tok["x"].astype(dt)
  S = S * decay[..., None, None] + dx[..., None] * bh[:, :, None, :]
  y = jnp.einsum("bhpn,bhn->bhp", S, ch,
                 precision=jax.lax.Precision.HIGHEST)
  if params.get("D") is not None:
    y = y + params["D"].astype(dt)[:, None] * tok["x"].astype(dt)
  return S, y


def rel_errors(a, ref):
  """(max-norm, Frobenius) relative errors, computed in ref's dtype."""
  diff = a.astype(ref.dtype) - ref
  mx = jnp.max(jnp.abs(diff)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
  fro = jnp.sqrt(jnp.sum(diff * diff)) / jnp.maximum(
      jnp.sqrt(jnp.sum(ref * ref)), 1e-30)
  return mx, fro


def _out_err(y, y_ref):
  num = jnp.max(jnp.abs(y.astype(y_ref.dtype) - y_ref))
  err = num / jnp.maximum(jnp.max(jnp.abs(y_ref)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(y)), err, jnp.inf)


# ---------------------------------------------------------------- runners
@functools.partial(jax.jit, static_argnames=("dims", "policy", "layer"))
def advance_replay(carry, t0, n, key, params, *, dims, policy, layer,
                   inputs=None):
  """n replay steps from step t0; returns (carry, stats of the chunk).
  inputs: recorded step inputs (see `_tokens`), else random ones."""
  def body(t, c):
    S, rst, mx, sm = c
    tok = _tokens(key, t, dims, inputs)
    S, y_ref = _ref_step(S, tok, params)
    y, rst = rs.replay_state_update(
        rst, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
        params.get("D"), None, params["dt_bias"], True, policy=policy,
        layer=layer, implementation="reference")
    e = _out_err(y, y_ref)
    return S, rst, jnp.maximum(mx, e), sm + e

  S, rst = carry
  zero = jnp.zeros((), S.dtype)
  S, rst, mx, sm = jax.lax.fori_loop(t0, t0 + n, body, (S, rst, zero, zero))
  st_max, st_fro = rel_errors(reference.materialize(rst, params["A"]), S)
  return (S, rst), dict(out_max=mx, out_mean=sm / n, state_max=st_max,
                        state_fro=st_fro)


@functools.partial(jax.jit, static_argnames=("dims", "sr", "seed", "layer",
                                             "sr_rng"))
def advance_baseline(carry, t0, n, key, params, *, dims, sr, seed, layer,
                     sr_rng, inputs=None):
  """n steps of the stored-state baseline (rounded every step); inputs as
  in `advance_replay`."""
  b = dims[0]
  row_id = jnp.arange(b, dtype=jnp.int32)

  def body(t, c):
    S, stored, scale, mx, sm = c
    tok = _tokens(key, t, dims, inputs)
    S, y_ref = _ref_step(S, tok, params)
    y, stored, scale = reference.selective_state_update_stored(
        stored, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
        params.get("D"), None, params["dt_bias"], True, state_scale=scale,
        stochastic_rounding=sr, seed=seed, layer=layer, row_id=row_id,
        step=jnp.full((b,), t, jnp.int32), sr_rng=sr_rng)
    e = _out_err(y, y_ref)
    return S, stored, scale, jnp.maximum(mx, e), sm + e

  S, stored, scale = carry
  zero = jnp.zeros((), S.dtype)
  S, stored, scale, mx, sm = jax.lax.fori_loop(
      t0, t0 + n, body, (S, stored, scale, zero, zero))
  st_max, st_fro = rel_errors(P.load(stored, scale), S)
  return (S, stored, scale), dict(out_max=mx, out_mean=sm / n,
                                  state_max=st_max, state_fro=st_fro)


def drive(advance, carry, points, **kw):
  """Runs chunk by chunk to each measurement point; per-point stats."""
  rows, t = [], 0
  for pt in points:
    carry, stats = advance(carry, jnp.int32(t), jnp.int32(pt - t), **kw)
    rows.append({k: float(v) for k, v in stats.items()})
    t = int(pt)
  return carry, {k: [r[k] for r in rows] for k in rows[0]}


def run_all(config, writer) -> list[dict]:
  """Every policy x L run and every baseline; one metrics line each."""
  for rnd in config.baseline_roundings:
    kind, colon, sr_rng = rnd.partition(":")
    if kind not in ("rn", "sr") or colon and (
        kind != "sr" or sr_rng not in P.SR_RNGS):
      raise ValueError(f"config.baseline_roundings entries must be 'rn', "
                       f"'sr' or 'sr:<sr_rng>' (sr_rng one of "
                       f"{P.SR_RNGS}), got {rnd!r}.")
  policies = [P.PrecisionPolicy.preset(name) for name in config.policies]
  dims = layer_dims(config)
  b, h, p, n, g = dims
  ref_dt = jnp.dtype(config.reference_dtype)
  points = measure_points(config.steps, config.num_points)
  k_par, k_s0, k_in = _keys(config)
  params = drift_params(k_par, config)
  s0 = jax.random.normal(k_s0, (b, h, p, n), jnp.float32)
  records = []

  def finish(rec, stats, wall):
    rec.update(steps=config.steps, points=points.tolist(), wall_s=wall,
               final_state_max_rel=stats["state_max"][-1],
               final_state_fro_rel=stats["state_fro"][-1],
               max_out_rel=float(np.max(stats["out_max"])),
               **{f"{k}_rel": v for k, v in stats.items()})
    records.append(writer.write(rec))
    logging.info("%-8s %-12s L=%-3s: final state err %.2e (max-norm), "
                 "max output err %.2e (%.1fs)", rec["kind"], rec["label"],
                 rec["L"] or "-", rec["final_state_max_rel"],
                 rec["max_out_rel"], wall)

  for name, policy in zip(config.policies, policies):
    policy = policy.replace(buffer_dtype=config.buffer_dtype,
                            seed=config.sr_seed)
    for L in config.buffer_lens:
      t0 = time.perf_counter()
      rst = rs.ReplayState.from_ssm_state(s0, g, L, policy=policy)
      # Staggered flushes: row r starts at count r % L with empty slots
      # (zero dt: no decay, no input), which leaves its state unchanged.
      rst = rst.replace(count=jnp.asarray(np.arange(b) % L, jnp.int32),
                        dt_buf=jnp.zeros_like(rst.dt_buf))
      carry = (s0.astype(ref_dt), rst)
      _, stats = drive(advance_replay, carry, points, key=k_in,
                        params=params, dims=dims, policy=policy,
                        layer=config.layer)
      finish(dict(kind="replay", label=name, policy=name, L=L,
                  checkpoint_dtype=policy.checkpoint_dtype,
                  read_dtype=policy.read_dtype,
                  rounding=policy.rounding),
             stats, time.perf_counter() - t0)

  for dtype in config.baseline_dtypes:
    for rnd in config.baseline_roundings:
      kind, _, sr_rng = rnd.partition(":")  # "rn", "sr" or "sr:<sr_rng>"
      t0 = time.perf_counter()
      stored, scale = P.store(s0, dtype)
      carry = (s0.astype(ref_dt), stored, scale)
      _, stats = drive(advance_baseline, carry, points, key=k_in,
                        params=params, dims=dims, sr=(kind == "sr"),
                        seed=config.sr_seed, layer=config.layer,
                        sr_rng=sr_rng or "threefry")
      short = P.PrecisionPolicy(read_dtype=dtype).name.split("+")[1] if (
          dtype != "float32") else "f32"
      finish(dict(kind="baseline", label=f"{short}+{rnd}", policy=None,
                  L=None, storage_dtype=jnp.dtype(dtype).name,
                  rounding=rnd), stats, time.perf_counter() - t0)
  return records


# ---------------------------------------------------------------- reports
def _report(config, workdir, records) -> str:
  cols = ["kind", "label", "L", "final_state_max_rel",
          "final_state_fro_rel", "max_out_rel"]
  fmts = {c: ".2e" for c in cols[3:]}
  table = common.markdown_table(records, cols, fmts)
  # Pivot: final state error, policy x L, with the every-step baselines.
  Ls = list(config.buffer_lens)
  piv = []
  for name in config.policies:
    row = {"policy": name}
    for r in records:
      if r["kind"] == "replay" and r["policy"] == name:
        row[f"L={r['L']}"] = r["final_state_max_rel"]
    piv.append(row)
  pivot = common.markdown_table(piv, ["policy"] + [f"L={L}" for L in Ls],
                                {f"L={L}": ".2e" for L in Ls})
  b, h, p, n, g = layer_dims(config)
  text = "\n".join([
      "# Precision drift",
      "",
      f"{config.steps} decode steps, batch {b}, nheads {h}, headdim {p}, "
      f"dstate {n}, ngroups {g} (Nemotron-H 8B dims / {config.head_scale} "
      f"in heads), A scaled by {config.a_scale:g} (per-step decay "
      f"{_decay_range(config)}), buffers {config.buffer_dtype}, f32 "
      "activations, "
      f"reference {config.reference_dtype}. Errors are relative to the "
      "reference (max-norm unless noted); the state is the materialized "
      "master (checkpoint advanced over the buffer).",
      "",
      "Final state error, policy x L:",
      "",
      pivot,
      "",
      "All runs (baselines store the state in the dtype every step):",
      "",
      table,
      "",
  ])
  return common.write_summary(workdir, text)


def _decay_range(config) -> str:
  """exp(A * softplus(mean dt + dt_bias)) over the heads, as 'lo-hi'."""
  params = drift_params(_keys(config)[0], config)  # run_all's params
  # mean raw dt of testing.random_step_inputs: -0.5
  d = np.log1p(np.exp(-0.5 + np.asarray(params["dt_bias"], np.float64)))
  decay = np.exp(d * np.asarray(params["A"], np.float64))
  return f"{decay.min():.4f}-{decay.max():.4f}"


def _plots(config, workdir, records):
  Ls = list(config.buffer_lens)
  for metric, fname, ylabel in (
      ("state_max_rel", "state_error.png",
       "state: max|S - S_ref| / max|S_ref|"),
      ("out_max_rel", "output_error.png",
       "output: max over chunk of max|y - y_ref| / max|y_ref|")):
    fig, axes = common.new_figure(1, len(Ls), figsize=(6 * len(Ls), 4.5))
    for ax, L in zip(axes[0], Ls):
      for r in records:
        if r["kind"] == "replay" and r["L"] == L:
          ax.plot(r["points"], np.maximum(r[metric], 1e-17),
                  label=r["label"])
        elif r["kind"] == "baseline":
          ax.plot(r["points"], np.maximum(r[metric], 1e-17), "--",
                  alpha=0.6, label=f"baseline {r['label']}")
      ax.set_xscale("log")
      ax.set_yscale("log")
      ax.set_xlabel("decode step")
      ax.set_ylabel(ylabel)
      ax.set_title(f"replay L={L} (dashed: every-step baselines)")
      ax.grid(True, which="both", alpha=0.3)
      ax.legend(fontsize=7, ncol=2)
    common.save_plot(fig, os.path.join(workdir, fname))


def run(config, workdir: str) -> dict:
  """Runs the drift study into `workdir`; returns the records."""
  t0 = time.perf_counter()
  workdir = common.prepare_workdir(workdir, config)
  env = common.log_environment()
  writer = common.MetricsWriter(workdir)
  writer.write(kind="environment", **env)
  with precision_context(config.reference_dtype):
    records = run_all(config, writer)
  text = _report(config, workdir, records)
  _plots(config, workdir, records)
  common.log_block(text)
  wall = time.perf_counter() - t0
  logging.info("precision_drift finished in %.1fs; outputs in %s", wall,
               workdir)
  return dict(workdir=workdir, records=records, wall_s=wall)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/precision_drift")
