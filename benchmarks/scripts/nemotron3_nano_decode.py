"""Decode-step throughput of a Nemotron 3 Nano-shaped model (random bf16
weights at NVIDIA's published config, configs/nemotron3_nano_30b_a3b.json:
52 blocks, 23 Mamba-2 / 23 MoE (128 routed experts, top 6, one shared) / 6
attention, d_model 2688), baseline and replay SSM states, per batch.

  python benchmarks/scripts/nemotron3_nano_decode.py --out=result.json \
      [--batches=1,64,256] [--small]

Per (batch, mode): the state starts empty (position 0); one jitted call
runs 16 greedy decode steps (`experiments.decode_bench.decode_loop`,
state donated); median of 5 calls after one warm-up call, in µs per step, and
the decode state's bytes. `--small` shrinks the model to run on a CPU.
Records are written after each one, so a run cut short keeps what it has.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
STEPS, CALLS = 16, 5


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="nemotron3_nano_decode.json")
  ap.add_argument("--batches", default="1,64,256")
  ap.add_argument("--modes", default="baseline,replay")
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--budget_s", type=float, default=1e9,
                  help="start no new record after this many seconds")
  a = ap.parse_args()
  import sys  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from experiments.decode_bench import build_model, decode_loop  # pylint: disable=g-import-not-at-top
  from replayssm_jax import models  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import hf  # pylint: disable=g-import-not-at-top
  t_start = time.time()
  with open(os.path.join(ROOT, "configs", "nemotron3_nano_30b_a3b.json")) as f:
    cfg, _ = hf.config_from_hf(json.load(f))
  cfg = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  if a.small:
    cfg = cfg.replace(vocab_size=256, d_model=64, ssm_heads=4, head_dim=16,
                      d_state=16, n_groups=2, num_heads=4, num_kv_heads=2,
                      attn_head_dim=16, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32,
                      moe_shared_expert_intermediate_size=64,
                      intermediate_size=32, pattern="MEM*E")
  model = build_model(cfg, seed=0)
  graphdef, params = nnx.split(model)
  jax.block_until_ready(params)
  n_params = sum(v.size for v in jax.tree.leaves(params))
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d"), params=int(n_params),
             config="configs/nemotron3_nano_30b_a3b.json" + (
                 " (--small)" if a.small else ""),
             init_s=time.time() - t_start, records=[])
  print(f"{n_params / 1e9:.2f}B parameters, init {res['init_s']:.0f} s",
        flush=True)

  def loop(tok, st):
    return decode_loop(graphdef, params, tok, st, STEPS, None)
  for batch in map(int, a.batches.split(",")):
    for mode in a.modes.split(","):
      if time.time() - t_start > a.budget_s:
        print("budget reached", flush=True)
        break
      t0 = time.time()
      st = model.init_state(batch, models.kv_cache_len(STEPS * (CALLS + 2)),
                            ssm_mode=mode, buffer_len=16)
      state_bytes = sum(v.nbytes for v in jax.tree.leaves(st))
      tok = jnp.ones((batch,), jnp.int32)
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
      rec = dict(batch=batch, mode=mode, step_us=us,
                 tokens_per_s=batch / us * 1e6, state_bytes=int(state_bytes),
                 times_us=times, first_call_s=compile_s)
      print(rec, flush=True)
      res["records"].append(rec)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
      del st
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
