"""Where a speculative-decoding iteration's time goes (GPU diagnostic).

Times, per SSM mode, jitted loops of the pieces of one iteration of
`speculative_generate` on `--config` (default `configs/hybrid_1b.py`, or a
transformers config.json at its shape in bf16, e.g.
configs/qwen3_5_4b_text.json; random weights) after a prefill: the plain
decode step (step + argmax), verify of a T-token window (+ commit of 2
tokens: the state advances as in decoding), and `accept` on
[batch, T, vocab] logits (greedy and sampling), and lists the large copies
in the optimized HLO of the verify + commit loop (a full-state copy per
iteration would show there) and of the SSM-verify loop. The plain step,
the verify + commit and the window forward are also split per kernel
(`replayssm_jax.profiling.op_times`: GEMMs, Pallas kernels, copies, other
XLA fusions; `*_ops` in the JSON, per step). The verify is also
split: the SSM verify op alone over every Mamba layer's state (`ssm_verify_ms`: replay_verify, or
the snapshot baseline_verify, on random window inputs; None for a model
without Mamba layers), and the model's
full forward over the [batch, T] window without a decode state
(`window_forward_ms`: the same projections, MLPs and LM head for T tokens,
SSD over T tokens and attention within the window only). `loops`: the
same split of specdec_bench's own loops per iteration (`loop_splits`),
which adds what the pieces leave out (proposer, acceptance, bookkeeping).
`--sections` picks which of these run; the JSON is rewritten after each
piece, so a run cut by a time limit keeps what it finished.

  PYTHONPATH=. python benchmarks/scripts/specdec_profile.py --batch 256 \
      --out $OUT/specdec_profile.json
  PYTHONPATH=. python benchmarks/scripts/specdec_profile.py --batch 256 \
      --config configs/qwen3_5_4b_text.json --modes replay \
      --loops plain,replay --out $OUT/specdec_profile_qwen35_4b.json
"""

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.scripts.decode_step_profile import load_model_config
from configs import _decode_bench
from experiments.decode_bench import build_model
from experiments.specdec_bench import FlatOracleProposer
from replayssm_jax.models import (ModelConfig, generate, kv_cache_len, prefill,
                                  speculative_generate)
from replayssm_jax.models.generate import sampling_settings
from replayssm_jax.models.speculative import accept, commit_fn, verify_fn
from replayssm_jax import profiling
from replayssm_jax.precision import PrecisionPolicy
from replayssm_jax import speculative as spec

_SHAPE = re.compile(r"= (\w+)\[([\d,]*)\]")
_BYTES = dict(f32=4, bf16=2, f16=2, s32=4, pred=1, u32=4, s8=1)


def big_copies(hlo: str, min_bytes: int = 2**24) -> list[str]:
  """Top-level copy instructions moving >= min_bytes."""
  out = []
  for line in hlo.splitlines():
    if " copy(" not in line and " copy-start(" not in line:
      continue
    m = _SHAPE.search(line)
    if not m:
      continue
    n = 1
    for d in filter(None, m.group(2).split(",")):
      n *= int(d)
    nbytes = n * _BYTES.get(m.group(1), 4)
    if nbytes >= min_bytes:
      out.append(f"{nbytes / 2**20:.0f} MiB: {line.strip()[:160]}")
  return out


def timed(f, *args, steps):
  f(*args)  # compile + warm-up; args are not donated
  jax.block_until_ready(f(*args))
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    best = min(best, time.perf_counter() - t)
  return 1e3 * best / steps


def split_per_step(fn, *args, steps: int) -> dict:
  """profiling.op_times of a loop of `steps` steps (its 40 longest ops),
  per step."""
  t = profiling.op_times(fn, *args, iters=3, top=40)
  return dict(device_ms=t["device_ms"] / steps, wall_ms=t["wall_ms"] / steps,
              by_category={k: v / steps for k, v in t["by_category"].items()},
              top=[dict(o, ms=o["ms"] / steps) for o in t["top"]])


def _state_kw(mode: str, policy: PrecisionPolicy | None) -> dict:
  """init_state keywords: L 16, f32 states; replay states under `policy`
  if given."""
  if policy is not None and mode == "replay":
    return dict(buffer_len=16, checkpoint_dtype=policy.checkpoint_dtype,
                precision=policy)
  return dict(buffer_len=16, checkpoint_dtype="float32")


def loop_splits(model, prompts, lengths, t: int, n_new: int,
                names=("plain", "replay", "baseline"),
                policy: PrecisionPolicy | None = None) -> dict:
  """Per-kernel split of the benchmark's own loops, per iteration:
  `generate` (plain, replay state) and `speculative_generate` (replay and
  baseline) with specdec_bench's flat-sampling proposer (accept_prob 0.7,
  temperature 1000), each minus a prefill on a fresh state of its mode.
  Compared with the verify + commit split above, it shows what a loop
  iteration pays beyond verify + commit (proposer, acceptance, history
  updates, copies). idle_ms: the loop call's wall time minus its device
  time, per iteration (its prefill included): the time the device waits
  on the host (launches, graph updates, the while loop's predicate
  syncs). policy: the replay states' precision policy (plain and replay
  loops; the snapshot baseline stays f32)."""
  b = prompts.shape[0]
  proposer = FlatOracleProposer(0.7, model.config.vocab_size)
  out = {}
  for name in names:
    mode = "replay" if name == "plain" else name
    state_kw = _state_kw(mode, policy)
    kw = dict(state_kw, temperature=1000.0, rng=jax.random.PRNGKey(8))

    def pre(mode=mode):
      st = model.init_state(b, kv_cache_len(prompts.shape[1] + n_new + t),
                            ssm_mode=mode, **state_kw)
      return prefill(model, prompts, lengths, st)[0]

    if name == "plain":
      loop = lambda: generate(model, prompts, lengths, n_new,  # noqa: E731
                              ssm_mode=mode, **kw)[0]
      iters = n_new - 1  # the first token comes from the prefill
    else:
      loop = lambda mode=mode: speculative_generate(  # noqa: E731
          model, proposer, prompts, lengths, n_new, t, ssm_mode=mode,
          **kw)[2].iterations
      iters = int(loop())
    # Its 200 longest ops: the XLA ops ("other") of a replay iteration
    # (~2 ms at batch 256) are many small ones.
    tl = profiling.op_times(loop, iters=2, top=200)
    tp = profiling.op_times(pre, iters=2, top=40)
    cats = set(tl["by_category"]) | set(tp["by_category"])
    out[name] = dict(
        iterations=iters,
        device_ms=(tl["device_ms"] - tp["device_ms"]) / iters,
        by_category={k: (tl["by_category"].get(k, 0.0)
                         - tp["by_category"].get(k, 0.0)) / iters
                     for k in cats},
        # Ops the loop body runs (launched at least every other
        # iteration); the call's one-off ops (its own prefill's SSD scan
        # and projections among them, which `device_ms` subtracts through
        # the separate prefill) are left out: they would be listed
        # here at their time / iterations.
        loop_top=[dict(o, ms=o["ms"] / iters) for o in tl["top"]
                  if o["events_per_call"] >= iters / 2],
        prefill_ms=tp["device_ms"],
        idle_ms=(tl["wall_ms"] - tl["device_ms"]) / iters)
    print("loop", name, iters, "iterations",
          {k: round(v, 3) for k, v in out[name]["by_category"].items()},
          "device idle", round(out[name]["idle_ms"], 3), "ms per iteration",
          flush=True)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--window", type=int, default=4)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--out", default="specdec_profile.json")
  ap.add_argument("--precision", default="",
                  help="precision preset of the replay states, e.g. f32+fp8 "
                  "(the snapshot baseline stays f32)")
  ap.add_argument("--tiny", action="store_true", help="CPU check")
  ap.add_argument("--loops", default="plain,replay,baseline",
                  help="which of specdec_bench's loops to split")
  ap.add_argument("--modes", default="replay,baseline",
                  help="the state modes whose pieces are timed (baseline: "
                  "the snapshot-per-draft state)")
  ap.add_argument("--config", default="configs/hybrid_1b.py",
                  help="a configs/*.py file or a transformers config.json")
  ap.add_argument("--sections", default="forward,modes,accept,loops",
                  help="which parts to run (always in the order forward, "
                  "modes, accept, loops; the JSON is written after each, "
                  "so a run cut by a time limit keeps what it finished)")
  a = ap.parse_args()
  sections = a.sections.split(",")
  cfg = (ModelConfig(**_decode_bench.TINY_MODEL) if a.tiny
         else load_model_config(a.config))
  model = build_model(cfg, 0)
  graphdef, params = nnx.split(model)
  b, t, steps = a.batch, a.window, a.steps
  prompts = jax.random.randint(jax.random.PRNGKey(1), (b, 128), 0,
                               cfg.vocab_size, jnp.int32)
  lengths = jnp.full((b,), 128, jnp.int32)
  policy = PrecisionPolicy.preset(a.precision) if a.precision else None
  res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             config="tiny" if a.tiny else a.config, batch=b, window=t,
             steps=steps, precision=a.precision or None,
             modes={})

  def save():
    with open(a.out, "w") as fh:
      json.dump(res, fh, indent=1)

  @jax.jit
  def plain_loop(params, tok, st):
    m = nnx.merge(graphdef, params)

    def body(_, c):
      tok, st = c
      logits, st = m.step(tok, st)
      return jnp.argmax(logits, -1).astype(jnp.int32), st
    return jax.lax.fori_loop(0, steps, body, (tok, st))

  @jax.jit
  def verify_loop(params, win, st):
    m = nnx.merge(graphdef, params)

    def body(_, st):
      logits, pend = verify_fn(m, win, st, None)
      st = commit_fn(pend, jnp.full((b,), 2, jnp.int32))
      return st
    return jax.lax.fori_loop(0, steps, body, st)

  @jax.jit
  def verify_only(params, win, st):
    m = nnx.merge(graphdef, params)
    logits, pend = verify_fn(m, win, st, None)
    return logits, pend

  @jax.jit
  def forward_loop(params, win):
    m = nnx.merge(graphdef, params)

    def body(_, c):  # the next window depends on this one's logits
      win, sink = c
      logits = m(win)
      return (jnp.argmax(logits, -1).astype(jnp.int32),
              sink + logits[:1, 0, 0])
    return jax.lax.fori_loop(0, steps, body,
                             (win, jnp.zeros((1,), jnp.float32)))

  mamba = [i for i, blk in enumerate(model.blocks) if blk.kind == "mamba"]
  keys = jax.random.split(jax.random.PRNGKey(7), 4)
  dtype = jnp.dtype(cfg.dtype)
  wx = jax.random.normal(keys[0], (b, t, cfg.ssm_heads, cfg.head_dim), dtype)
  wdt = jax.random.uniform(keys[1], (b, t, cfg.ssm_heads), dtype, -3.0, 0.0)
  wB = jax.random.normal(keys[2], (b, t, cfg.n_groups, cfg.d_state), dtype)
  wC = jax.random.normal(keys[3], (b, t, cfg.n_groups, cfg.d_state), dtype)

  @jax.jit
  def ssm_verify_loop(params, ssm_states):
    m = nnx.merge(graphdef, params)

    def body(_, sink):
      for layer, (i, s) in enumerate(zip(mamba, ssm_states)):
        A, D, dt_bias = m.blocks[i].mixer._ssm_params()  # pylint: disable=protected-access
        x = wx + sink.astype(dtype)  # loop-carried: not hoisted
        if isinstance(s, jax.Array):
          y = spec.baseline_verify(s, x, wdt, A, wB, wC, D, None, dt_bias,
                                   True)[0]
        else:
          y = spec.replay_verify(s, x, wdt, A, wB, wC, D, None, dt_bias,
                                 True, policy=policy, layer=layer)[0]
        sink = sink + 1e-30 * y[:1, 0, 0, 0].astype(jnp.float32)
      return sink
    return jax.lax.fori_loop(0, steps, body, jnp.zeros((1,), jnp.float32))

  win0 = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0,
                            cfg.vocab_size, jnp.int32)
  if "forward" in sections:
    res["window_forward_ms"] = timed(forward_loop, params, win0, steps=steps)
    res["window_forward_ops"] = split_per_step(forward_loop, params, win0,
                                               steps=steps)
    print("window forward", res["window_forward_ms"], flush=True)
    save()

  for mode in a.modes.split(",") if "modes" in sections else ():
    st = model.init_state(b, kv_cache_len(128 + 4 * steps * t + 8),
                          ssm_mode=mode,
                          **_state_kw(mode, policy))
    logits, st = prefill(model, prompts, lengths, st)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    win = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0,
                             cfg.vocab_size, jnp.int32)
    r = res["modes"][mode] = dict(
        plain_step_ms=timed(plain_loop, params, tok, st, steps=steps),
        verify_commit_ms=timed(verify_loop, params, win, st, steps=steps),
        verify_only_ms=timed(verify_only, params, win, st, steps=1),
        ssm_verify_ms=timed(ssm_verify_loop, params,
                            tuple(st.layers[i].ssm for i in mamba),
                            steps=steps) if mamba else None)
    save()
    # Per-kernel split (jax.profiler trace), per step / per iteration.
    for name, fn, args in (("verify_commit", verify_loop, (params, win, st)),
                           ("plain_step", plain_loop, (params, tok, st))):
      r[f"{name}_ops"] = split_per_step(fn, *args, steps=steps)
      print(mode, name, r[f"{name}_ops"]["by_category"], flush=True)
      save()
    hlo = verify_loop.lower(params, win, st).compile().as_text()
    r["verify_loop_big_copies"] = big_copies(hlo)
    # Its states are loop-invariant inputs: a copy per call in the loop
    # would inflate ssm_verify_ms beyond the op's own cost.
    if mamba:
      hlo = ssm_verify_loop.lower(
          params, tuple(st.layers[i].ssm for i in mamba)).compile().as_text()
      r["ssm_verify_loop_big_copies"] = big_copies(hlo)
    save()
    print(mode, {k: v for k, v in r.items() if k.endswith("_ms")},
          len(r["verify_loop_big_copies"]), "big copies", flush=True)
    del st

  if "accept" in sections:
    logits = jax.random.normal(jax.random.PRNGKey(3),
                               (b, t, cfg.vocab_size))
    drafts = jax.random.randint(jax.random.PRNGKey(4), (b, t - 1), 0,
                                cfg.vocab_size, jnp.int32)
    nd = jnp.full((b,), t - 1, jnp.int32)
    q = jnp.full((b, t - 1, cfg.vocab_size), 1.0 / cfg.vocab_size)
    for name, temp, qq in (("greedy", 0.0, None), ("sampling", 1000.0, q)):
      sampling = sampling_settings(temp, None, None, None,
                                   jax.random.PRNGKey(5))
      f = jax.jit(lambda lg, qq, s=sampling: accept(lg, drafts, nd, qq, s,
                                                    jax.random.PRNGKey(6)))
      res[f"accept_{name}_ms"] = timed(f, logits, qq, steps=1)
    print({k: v for k, v in res.items() if k.startswith("accept")})
    save()
  if "loops" in sections:
    res["loops"] = loop_splits(model, prompts, lengths, t,
                               16 if a.tiny else 128, a.loops.split(","),
                               policy)
    save()


if __name__ == "__main__":
  main()
