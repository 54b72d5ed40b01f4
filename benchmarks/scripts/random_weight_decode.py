"""Decode throughput of a model of a published shape with random bf16
weights, baseline and replay SSM states, per batch. The shape comes from a
transformers config.json (`--hf_config`):
configs/nemotron3_nano_30b_a3b.json (NVIDIA's published Nemotron 3 Nano
config: 52 blocks, 23 Mamba-2 / 23 MoE (128 routed experts, top 6, one
shared) / 6 attention, d_model 2688) or configs/qwen3_5_4b_text.json
(Qwen3.5-4B's text model: 32 layers, 24 Gated DeltaNet (16 key / 32 value
heads of 128) and 8 gated attention layers, each with a dense MLP).

  python benchmarks/scripts/random_weight_decode.py --out=result.json \
      [--hf_config=configs/nemotron3_nano_30b_a3b.json] [--parts=step,spec] \
      [--batches=1,64,256] [--spec_batches=256,64,1] [--small]

Part "step" (records with part "step"), per (batch, mode): the state
starts empty (position 0) and each row gets its own random first token;
one jitted call runs 16 greedy decode steps
(`experiments.decode_bench.decode_loop`, state donated); median of 5 calls
after one warm-up call, in µs per step, and the decode state's bytes.
`--precisions` adds replay states under precision presets (e.g. f32+fp8:
an f32 master checkpoint with an fp8 read copy that non-flush steps read),
timed against the same f32 baseline state.

Part "spec" (records with part "spec"), per batch:
`experiments.specdec_bench.bench_batch` with SPEC below: plain `generate`
with the replay state ("plain") and the baseline state
("plain_baseline"), and `speculative_generate` (window 4;
`--spec_windows`) with the snapshot baseline and replay, sampling at a
high temperature with its oracle proposer at acceptance 0.7 per draft
(random weights give no meaningful drafts of their own; see that
module); `--spec_precision` sets the replay states' precision preset
there. Best of 2 runs after a compile + warm-up run; tokens/s of the
decode (prefill subtracted) and end to end. A run that does not fit in
device memory is recorded as such.

Records are written after each one, so a run cut short keeps what it has;
`--budget_s` starts no new batch after that many seconds. A MoE routing
bias is set to zeros (transformers' initial value; `--random_router_bias`
keeps the library's random one). `--small` shrinks the model (its first
eight blocks at toy widths) to run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import types

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
STEPS, CALLS = 16, 5
SPEC = dict(windows=(4,), compactions=(0,), ssm_modes=("baseline", "replay"),
            plain_baseline=True, buffer_len=16, prompt_len=32, new_tokens=64,
            proposer="flat_sampling", temperature=1000.0, accept_prob=0.7,
            checkpoint_dtype="float32", precision="", repeats=2,
            implementation="")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="random_weight_decode.json")
  ap.add_argument("--hf_config", default="configs/nemotron3_nano_30b_a3b.json",
                  help="a transformers config.json, relative to the "
                  "repository root or absolute")
  ap.add_argument("--parts", default="step,spec")
  ap.add_argument("--batches", default="1,64,256")
  ap.add_argument("--spec_batches", default="256,64,1")
  ap.add_argument("--modes", default="baseline,replay")
  ap.add_argument("--precisions", default="",
                  help="part step: precision presets of further replay "
                  "states, e.g. f32+fp8,f32+bf16")
  ap.add_argument("--spec_precision", default="",
                  help="part spec: a precision preset of the replay states "
                  "(plain and speculative decoding with them; the snapshot "
                  "baseline and plain_baseline keep f32 states)")
  ap.add_argument("--spec_windows", default="4",
                  help="speculative windows (tokens a verify checks: the "
                  "drafts and one more), comma-separated")
  ap.add_argument("--spec_compactions", default="0",
                  help="speculative decoding's compaction settings (0: the "
                  "static batch; k: the batch halved up to k times as rows "
                  "finish, which cuts the idle tail of a static batch)")
  ap.add_argument("--spec_modes", default="replay,baseline",
                  help="speculative decoding's state modes, in this order "
                  "(baseline: the snapshot-per-draft state)")
  ap.add_argument("--implementation", default="",
                  help="the SSM ops' implementation (default: the "
                  "dispatcher's choice; 'reference': pure JAX)")
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--random_router_bias", action="store_true",
                  help="keep the random MoE routing bias (default: zeros)")
  ap.add_argument("--prng_impl", default="",
                  help="jax_default_prng_impl for the random weights "
                  "(e.g. rbg); default: jax's")
  ap.add_argument("--budget_s", type=float, default=1e9,
                  help="start no new record after this many seconds")
  a = ap.parse_args()
  if a.prng_impl:
    jax.config.update("jax_default_prng_impl", a.prng_impl)
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from experiments.decode_bench import build_model, decode_loop  # pylint: disable=g-import-not-at-top
  from experiments.specdec_bench import bench_batch  # pylint: disable=g-import-not-at-top
  from replayssm_jax import models  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import hf  # pylint: disable=g-import-not-at-top
  from replayssm_jax.precision import PrecisionPolicy  # pylint: disable=g-import-not-at-top
  t_start = time.time()
  with open(os.path.join(ROOT, a.hf_config)) as f:
    cfg, _ = hf.config_from_hf(json.load(f))
  cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  if a.small:
    cfg = cfg.replace(vocab_size=256, d_model=64, ssm_heads=4, head_dim=16,
                      d_state=16, n_groups=2, num_heads=4, num_kv_heads=2,
                      attn_head_dim=16, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      moe_shared_expert_intermediate_size=(
                          64 if cfg.moe_shared_expert_intermediate_size
                          else 0),
                      intermediate_size=32, gdn_num_k_heads=1,
                      gdn_num_v_heads=2, gdn_k_dim=16, gdn_v_dim=16,
                      rotary_dim=(8 if cfg.rotary_dim else cfg.rotary_dim),
                      pattern=cfg.pattern[:8])
  model = build_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  if not a.random_router_bias:
    # transformers initialises e_score_correction_bias to zeros, and a
    # trained one balances the experts' load; a random one (the library's
    # init, so that tests exercise it) sends most tokens to a few experts.
    params = jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.zeros_like(v) if "router_bias" in
        jax.tree_util.keystr(path) else v, params)
    model = nnx.merge(graphdef, params)
  jax.block_until_ready(params)
  n_params = sum(v.size for v in jax.tree.leaves(params))
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d"), params=int(n_params),
             prng_impl=jax.config.jax_default_prng_impl,
             router_bias="random" if a.random_router_bias else "zeros",
             implementation=a.implementation or "default",
             config=a.hf_config + (" (--small)" if a.small else ""),
             init_s=time.time() - t_start, records=[])
  print(f"{n_params / 1e9:.2f}B parameters, init {res['init_s']:.0f} s",
        flush=True)

  parts = a.parts.split(",")

  def save(rec):
    print(rec, flush=True)
    res["records"].append(rec)
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)
    return rec

  def loop(tok, st):
    return decode_loop(graphdef, params, tok, st, STEPS,
                       a.implementation or None)

  presets = [p for p in a.precisions.split(",") if p]
  runs = [(m, "") for m in a.modes.split(",")] + [("replay", p)
                                                   for p in presets]
  for batch in map(int, a.batches.split(",")) if "step" in parts else ():
    for mode, preset in runs:
      if time.time() - t_start > a.budget_s:
        print("budget reached", flush=True)
        break
      t0 = time.time()
      policy = PrecisionPolicy.preset(preset) if preset else None
      st = model.init_state(batch, models.kv_cache_len(STEPS * (CALLS + 2)),
                            ssm_mode=mode, buffer_len=16, precision=policy)
      state_bytes = sum(v.nbytes for v in jax.tree.leaves(st))
      # Distinct rows: identical rows would all route to the same experts.
      tok = jax.random.randint(jax.random.PRNGKey(batch), (batch,), 0,
                               cfg.vocab_size, jnp.int32)
      tok, st = loop(tok, st)
      jax.block_until_ready(st)
      compile_s = time.time() - t0
      times = []
      for _ in range(CALLS):
        t1 = time.perf_counter()
        tok, st = loop(tok, st)
        jax.block_until_ready(st)
        times.append((time.perf_counter() - t1) / STEPS * 1e6)
      us = sorted(times)[len(times) // 2]
      save(dict(part="step", batch=batch, mode=mode,
                precision=preset or None, step_us=us,
                tokens_per_s=batch / us * 1e6, state_bytes=int(state_bytes),
                times_us=times, first_call_s=compile_s))
      del st

  spec = dict(SPEC, implementation=a.implementation,
              ssm_modes=tuple(a.spec_modes.split(",")),
              windows=tuple(int(w) for w in a.spec_windows.split(",")),
              compactions=tuple(int(c) for c in a.spec_compactions.split(",")),
              precision=a.spec_precision,
              **(dict(prompt_len=4, new_tokens=8, repeats=1)
                 if a.small else {}))
  config = types.SimpleNamespace(seed=0, bench=types.SimpleNamespace(**spec))
  res["spec_settings"] = spec
  writer = types.SimpleNamespace(
      write=lambda rec: save(dict(rec, part="spec")))
  for batch in map(int, a.spec_batches.split(",")) if "spec" in parts else ():
    if time.time() - t_start > a.budget_s:
      print("budget reached", flush=True)
      break
    bench_batch(model, config, batch, writer)
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
