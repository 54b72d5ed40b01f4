"""Recurrent-layer state error along a long decode, against float64.

For a trained model the study decodes a token stream of
`state_error.steps` tokens (`state_error.source`: "generation", the f32
baseline's greedy continuation of validation prompts, or "text",
validation windows) once with the f32 baseline state, recording at every
step the inputs of the selected recurrent layers' state ops
(`state_error.layers`, indices among the Mamba-2 / Gated DeltaNet blocks):
Mamba-2 x, dt, B, C after the conv; Gated DeltaNet q, k, v, g, beta. Each
decode configuration (`runs.sub_runs(config, model, config.state_error)`,
plus the f32 baseline itself as the floor) then steps each layer's state
over those same inputs from the same starting state (after the first
token), beside a float64 recurrence of the exact update (Mamba-2:
`experiments.precision_drift`'s runners, fed the recorded inputs; Gated
DeltaNet: the delta rule below). Same inputs in every run: the errors are
those of storing the state, not of activations that drift apart.

Measured at log-spaced steps: max |S - S64| / max |S64| and the Frobenius
ratio of the materialized state (replay: the master advanced over the
buffer), and per step the output's max |y - y64| / max |y64| (maximum and
mean over each chunk). A read copy shows in the outputs (read between
flushes) and, for Gated DeltaNet, in the master too (each step's update
d = beta (v - S^T k) reads the state). Outputs leave the op in the model's
activation dtype (bf16 for the text models): the f32 baseline's row gives
that floor.

The recording loop is `HybridLM.step` with the layer inputs read on the
side; `capture_check` records the largest difference between its logits
and `tasks.decode_logits`' on the same stream (they run the same ops).
The slices of a split study (`config.shared_dir`) record once and share
the recording and the f32 floor's errors, as they share the f32
reference's generations.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments import precision_drift as PD
from experiments.precision_lib import generation
from experiments.precision_lib import runs as R
from experiments.precision_lib import shared
import replayssm_jax as rs
from replayssm_jax import gdn
from replayssm_jax import tasks
from replayssm_jax.conv import causal_conv1d_update
from replayssm_jax.models import states as S
from replayssm_jax import precision as P
from replayssm_jax.precision import PrecisionPolicy
from replayssm_jax.reference import HIGHEST, heads_from_groups

F32 = jnp.float32
KINDS = ("mamba", "gdn")  # recurrent mixers the stage measures


# ----------------------------------------------------------------- stream
def stream(name, model, task, config) -> np.ndarray:
  """[rows, steps] int32 tokens decoded by the stage."""
  se = config.state_error
  steps, rows = int(se.steps), int(se.rows)
  if steps < 2 or rows < 1:
    raise ValueError(f"state_error.steps must be >= 2 and rows >= 1, got "
                     f"{steps} and {rows}.")
  if se.source == "text":
    return dataclasses.replace(task, seq_len=steps).batch(
        0, rows, "val")["inputs"]
  if se.source != "generation":
    raise ValueError(f"state_error.source must be 'generation' or 'text', "
                     f"got {se.source!r}.")
  p = generation.prompts(task, config, rows)
  if steps <= p.shape[1]:
    return p[:, :steps]
  new = generation.reference_run(name, model, p, config, "greedy",
                                 steps - p.shape[1])["tokens"]
  return np.concatenate([p, new], axis=1).astype(np.int32)


def layer_blocks(model, layers) -> list[int]:
  """Block indices of the recurrent layers `layers` (indices among the
  recurrent blocks; negative from the end), in order, once each."""
  rec = [i for i, k in enumerate(model.config.block_kinds) if k in KINDS]
  if not rec:
    raise ValueError(f"pattern {model.config.pattern!r} holds no Mamba-2 "
                     f"or Gated DeltaNet block.")
  out = []
  for j in layers:
    if not -len(rec) <= int(j) < len(rec):
      raise ValueError(f"state_error.layers: {j} is out of range for "
                       f"{len(rec)} recurrent layers.")
    out.append(rec[int(j)])
  return sorted(set(out))


# ---------------------------------------------------------------- capture
def _mamba_inputs(mixer, h, s: S.MambaState) -> dict:
  """The SSM op's inputs of one decode step (as `Mamba2Mixer.step`)."""
  zxbcdt = mixer.in_proj(h)
  _, xbc, dt = mixer._split(zxbcdt)  # pylint: disable=protected-access
  xbc, _ = causal_conv1d_update(xbc, s.ordered_conv(), mixer.conv_weight[...],
                                mixer.conv_bias[...], activation="silu")
  x, b, c = mixer._split_xbc(xbc)  # pylint: disable=protected-access
  return dict(x=x, dt=dt, B=b, C=c)


def _gdn_inputs(mixer, h, s: S.GDNState) -> dict:
  """The delta rule's inputs of one decode step (as `GDNMixer.step`)."""
  qkv, _, g, beta = mixer._project(h)  # pylint: disable=protected-access
  xc, _ = causal_conv1d_update(qkv, s.conv, mixer.conv_weight[...], None,
                               activation="silu")
  q, k, v = mixer._split(xc)  # pylint: disable=protected-access
  return dict(q=q, k=k, v=v, g=g, beta=beta)


def _step(model, token, state, blocks):
  """`HybridLM.step` (reference ops), also returning the recorded layers'
  op inputs."""
  x = model.embeddings(token).astype(F32)
  y, layers, rec = None, [], {}
  for i, (block, s, layer) in enumerate(zip(model.blocks, state.layers,
                                            model.mamba_indices())):
    x, h = model.add_norm(x, y, block.norm, None)
    if i in blocks:
      fn = _mamba_inputs if block.kind == "mamba" else _gdn_inputs
      rec[i] = fn(block.mixer, h, s)
    y, s = block.mix(h, s, layer=layer)
    layers.append(s)
  _, h = model.add_norm(x, y, model.norm_f, None)
  return model.head(h), S.ModelState(layers=tuple(layers),
                                     positions=state.positions + 1), rec


@functools.partial(jax.jit, static_argnums=(0, 3))
def _capture_jit(graphdef, params, tokens, blocks):
  model = nnx.merge(graphdef, params)
  b, t = tokens.shape
  state = model.init_state(b, S.kv_cache_len(t), ssm_mode="baseline")
  _, state = model.forward(tokens[:, :1], jnp.ones((b,), jnp.int32), state)
  init = {i: state.layers[i].ssm for i in blocks}

  def body(st, tok):
    logits, st, rec = _step(model, tok, st, blocks)
    return st, (rec, logits)

  _, (rec, logits) = jax.lax.scan(body, state, tokens[:, 1:].T)
  return init, rec, logits


def capture(model, tokens, blocks):
  """({block: f32 state after the first token}, {block: {name: [steps - 1,
  rows, ...] op inputs}}, logits [steps - 1, rows, vocab])."""
  graphdef, params = nnx.split(model)
  return _capture_jit(graphdef, params, jnp.asarray(tokens, jnp.int32),
                      tuple(blocks))


def captured(name, model, tokens, blocks, config):
  """(init, rec) of `capture`, and the largest |logit| difference between
  the recording loop and `tasks.decode_logits` on the same stream (None
  without state_error.capture_check): computed once for the slices of a
  split study that share `config.shared_dir` (shared.py)."""
  check = bool(config.state_error.get("capture_check", True))

  def compute():
    init, rec, logits = capture(model, tokens, blocks)
    out = {f"init_{b}": init[b] for b in blocks}
    for b in blocks:
      out.update({f"rec_{b}_{k}": v for k, v in rec[b].items()})
    if check:
      ref = tasks.decode_logits(model, tokens, "baseline", 1)[:, 1:]
      out["check"] = jnp.max(jnp.abs(jnp.swapaxes(logits, 0, 1) - ref))
    return out

  def key():
    return shared.key(name, "state_error_capture", tokens=np.asarray(tokens),
                      blocks=tuple(blocks), check=check,
                      model_config=repr(model.config),
                      params=shared.fingerprint(model))

  out = shared.computed_once(config.get("shared_dir", ""), key, compute)
  init = {b: jnp.asarray(out[f"init_{b}"]) for b in blocks}
  rec = {b: {k[len(f"rec_{b}_"):]: jnp.asarray(v) for k, v in out.items()
             if k.startswith(f"rec_{b}_")} for b in blocks}
  return init, rec, float(out["check"]) if check else None


# ------------------------------------------------------------ GDN runners
def _gdn_ref_step(state, tok):
  """The delta rule in state.dtype (float64): q, k L2-normalised (eps
  1e-6), q scaled by K ** -0.5; S = e^g S; d = beta (v - S^T k);
  S += k d^T; o = S^T q."""
  dt = state.dtype
  hv = tok["v"].shape[1]

  def l2(x):
    x = x.astype(dt)
    return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)

  q = heads_from_groups(l2(tok["q"]) * tok["q"].shape[-1] ** -0.5, hv, 1)
  k = heads_from_groups(l2(tok["k"]), hv, 1)
  state = state * jnp.exp(tok["g"].astype(dt))[..., None, None]
  d = tok["beta"].astype(dt)[..., None] * (
      tok["v"].astype(dt) - jnp.einsum("bhkv,bhk->bhv", state, k,
                                       precision=HIGHEST))
  state = state + k[..., :, None] * d[..., None, :]
  return state, jnp.einsum("bhkv,bhk->bhv", state, q, precision=HIGHEST)


@functools.partial(jax.jit, static_argnames=("policy", "layer", "replay"))
def advance_gdn(carry, t0, n, inputs, *, policy, layer, replay):
  """n steps of a GDN state (replay under `policy`, or a baseline state
  stored every step: an array in its dtype, or a StoredSSMState per
  `policy`) beside the float64 recurrence; (carry, stats)."""
  def body(t, c):
    ref, st, mx, sm = c
    tok = {k: v[t] for k, v in inputs.items()}
    ref, o_ref = _gdn_ref_step(ref, tok)
    args = (tok["q"], tok["k"], tok["v"], tok["g"], tok["beta"])
    if replay:
      o, st = gdn.gdn_replay_step(st, *args, policy=policy, layer=layer,
                                  implementation="reference")
    elif isinstance(st, S.StoredSSMState):
      o, st = S.step_stored(st, policy, layer, lambda s: gdn.gdn_step(
          s, *args, implementation="reference"))
    else:
      o, st = gdn.gdn_step(st, *args, implementation="reference")
    err = jnp.max(jnp.abs(o.astype(ref.dtype) - o_ref)) / jnp.maximum(
        jnp.max(jnp.abs(o_ref)), 1e-30)
    err = jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)
    return ref, st, jnp.maximum(mx, err), sm + err

  ref, st = carry
  zero = jnp.zeros((), ref.dtype)
  ref, st, mx, sm = jax.lax.fori_loop(t0, t0 + n, body, (ref, st, zero, zero))
  full = S.full_ssm_state(st)
  st_max, st_fro = PD.rel_errors(full, ref)
  return (ref, st), dict(out_max=mx, out_mean=sm / n, state_max=st_max,
                         state_fro=st_fro)


# -------------------------------------------------------------------- runs
def _layer_stats(model, block, layer, s0, inputs, run: R.Run, points,
                 ref_dtype):
  """Per-point stats of one run on one layer."""
  ref0 = s0.astype(ref_dtype)
  if model.config.block_kinds[block] == "gdn":
    if run.kind == "replay":
      st = gdn.gdn_replay_state_from(
          s0, run.L, num_k_heads=model.config.gdn_num_k_heads,
          policy=run.policy, layer=layer)
    else:  # stored as the model's baseline state is (a StoredSSMState
      # for 8-bit or stochastically rounded storage)
      rows = jnp.arange(s0.shape[0], dtype=jnp.int32)
      st = S.store_baseline(s0, run.policy, run.storage_dtype, rows,
                            jnp.zeros_like(rows), layer)
    return PD.drive(advance_gdn, (ref0, st), points, inputs=inputs,
                    policy=run.policy, layer=layer,
                    replay=run.kind == "replay")[1]
  mixer = model.blocks[block].mixer
  A, _, dt_bias = mixer._ssm_params()  # pylint: disable=protected-access
  b, h, p, n = s0.shape
  dims = (b, h, p, n, model.config.n_groups)
  common = dict(key=jax.random.PRNGKey(0), params=dict(A=A, dt_bias=dt_bias),
                dims=dims, layer=layer, inputs=inputs)
  if run.kind == "replay":
    rst = rs.ReplayState.from_ssm_state(s0, dims[4], run.L,
                                        policy=run.policy, layer=layer)
    return PD.drive(PD.advance_replay, (ref0, rst), points,
                    policy=run.policy, **common)[1]
  kind, _, sr_rng = run.rounding.partition(":")
  stored, scale = P.store(s0, run.storage_dtype)
  return PD.drive(PD.advance_baseline, (ref0, stored, scale), points,
                  sr=kind == "sr", seed=run.policy.seed,
                  sr_rng=sr_rng or "threefry", **common)[1]


def floor_stats(name, model, block, tokens, points, ref_dtype, compute,
                config) -> dict[str, list[float]]:
  """compute() (the floor run's `_layer_stats` on one block), once for
  every slice of a split study that shares `config.shared_dir`: every
  slice reports the floor beside its own runs."""

  def key():
    return shared.key(name, f"state_error_floor_{block}",
                      tokens=np.asarray(tokens), points=np.asarray(points),
                      reference_dtype=jnp.dtype(ref_dtype).name,
                      model_config=repr(model.config),
                      params=shared.fingerprint(model))

  out = shared.computed_once(
      config.get("shared_dir", ""), key,
      lambda: {k: np.asarray(v, np.float64) for k, v in compute().items()})
  return {k: np.asarray(v).tolist() for k, v in out.items()}


def floor_run(config) -> R.Run:
  """The f32 baseline itself (its error against float64 is the floor)."""
  policy = PrecisionPolicy(checkpoint_dtype="float32").replace(
      buffer_dtype=config.buffer_dtype, seed=config.sr_seed)
  return R.Run("baseline", "f32+rn", "f32", policy, None, "float32", "rn")


def measure(name, model, task, config, writer) -> list[dict]:
  """The state-error records of one model (one per layer x run)."""
  se = config.state_error
  blocks = layer_blocks(model, se.layers)
  floor = floor_run(config)
  runs = [floor] + R.sub_runs(config, se)
  idents = [(block, run, dict(kind="state_error", model=name, block=block,
                              run_kind=run.kind, label=run.label, L=run.L))
            for block in blocks for run in runs]
  records = [r for r in map(writer.done, (i for *_, i in idents)) if r]
  todo = [(b, r, i) for b, r, i in idents if not writer.done(i)]
  if not todo:  # a resumed study's, all done
    return records
  t0 = time.perf_counter()
  tokens = stream(name, model, task, config)
  init, rec, check = captured(name, model, tokens, blocks, config)
  steps = tokens.shape[1] - 1
  writer.write(kind="state_error_stream", model=name, source=se.source,
               rows=int(tokens.shape[0]), steps=steps, blocks=blocks,
               capture_max_logit_diff=check,
               capture_s=time.perf_counter() - t0)
  logging.info("%s: recorded %d steps x %d rows of blocks %s (capture vs "
               "decode_logits: max |logit diff| %s)", name, steps,
               tokens.shape[0], blocks, check)
  points = PD.measure_points(steps, int(se.num_points))
  layer_of = model.mamba_indices()
  with PD.precision_context(se.reference_dtype):
    ref_dtype = jnp.dtype(se.reference_dtype)
    for block, run, ident in todo:
      t1 = time.perf_counter()
      compute = functools.partial(_layer_stats, model, block,
                                  layer_of[block], init[block], rec[block],
                                  run, points, ref_dtype)
      stats = (floor_stats(name, model, block, tokens, points, ref_dtype,
                           compute, config) if run is floor else compute())
      r = writer.write(dict(
          ident, mixer=model.config.block_kinds[block],
          layer=layer_of[block], policy=run.policy_name, source=se.source,
          reference_dtype=ref_dtype.name, steps=steps,
          points=points.tolist(),
          final_state_max_rel=stats["state_max"][-1],
          final_state_fro_rel=stats["state_fro"][-1],
          peak_state_max_rel=float(np.max(stats["state_max"])),
          max_out_rel=float(np.max(stats["out_max"])),
          wall_s=time.perf_counter() - t1,
          **{f"{k}_rel": v for k, v in stats.items()}))
      records.append(r)
      R.release_compiled()
      logging.info("%s block %d (%s) %-8s %-12s L=%-3s: final state err "
                   "%.2e, max output err %.2e", name, block, r["mixer"],
                   run.kind, run.label, run.L or "-",
                   r["final_state_max_rel"], r["max_out_rel"])
  return records
