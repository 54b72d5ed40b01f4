"""Times two source trees side by side on one GPU, through public APIs only.

  python benchmarks/scripts/compare_trees.py --trees=OLD_TREE,NEW_TREE \
      --out=result.json

Each tree runs in its own subprocess (cwd and PYTHONPATH = the tree), in
the order given, then again in reverse order (--rounds, alternating; the
models in the first --model_rounds only; the table keeps each figure's
median over rounds). Per tree:

* kernel step, batch 256, 128 heads x 64, d_state 128, 8 groups, L 16,
  bf16 inputs and buffers: `selective_state_update` (baseline, f32 and f16
  state) and `replay_state_update` (f32, f16 checkpoint, f16 master + fp8
  read copy), with the rows' counters staggered (r mod L: 1/L of the rows
  flush at every step, the serving steady state) and aligned (all rows at
  the same counter: the mean over L steps, one of which flushes every row).
  16 steps per jitted fori_loop call, state donated; median over 15 calls
  after 3 warm-up calls, in µs per step. Each state is > 1 GB (f32) or
  > 0.5 GB, far past the 60 MB L2.
* hybrid_1b decode step (configs/hybrid_1b.py's model, random bf16 weights)
  at batch 256, baseline and replay (L 16, f32 state): 32 greedy steps per
  jitted fori_loop call after a 128-token prefill; median over 9 calls.
* speculative decoding at batch 256, window 4, 128-token prompts, 128 new
  tokens, sampling at temperature 1000 with a proposer whose drafts are
  accepted with probability 0.7 each (the flat-sampling oracle of
  experiments/specdec_bench.py): plain `generate` (replay), and
  `speculative_generate` with ssm_mode replay and baseline; decode tokens/s
  (end to end minus a separately timed prefill), best of 3 after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

B, H, P, N, G, L = 256, 128, 64, 128, 8, 16

# configs/hybrid_1b.py's model, repeated here: a config file imports
# ml_collections, which the GPU machine lacks, and each tree's config may
# differ; both trees are timed on these shapes.
MODEL = dict(vocab_size=32768, d_model=2048,
             pattern="M-M-M*-M-M-M*-M-M-M*-M-M-", ssm_heads=64, head_dim=64,
             d_state=128, n_groups=8, conv_kernel=4, chunk_size=256,
             num_heads=16, num_kv_heads=4, attn_head_dim=128,
             rope_theta=10000.0, intermediate_size=8192,
             mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
             dtype="bfloat16", param_dtype="bfloat16")


def _median(v):
  v = sorted(v)
  return v[len(v) // 2]


def _time_calls(f, state, calls, warm, steps):
  import jax
  for _ in range(warm):
    state = f(state)
  jax.block_until_ready(state)
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    state = f(state)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / steps * 1e6)
  return _median(times)


def kernel_times(small):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import replayssm_jax as rs
  from replayssm_jax import precision as prec
  from replayssm_jax import testing
  b, h, p, n, g = (4, 4, 16, 16, 2) if small else (B, H, P, N, G)
  steps = 16
  key = jax.random.PRNGKey(0)
  params = testing.random_params(key, h)
  tok = testing.random_step_inputs(key, b, h, p, n, g, jnp.bfloat16)
  kw = dict(**params, dt_softplus=True)
  out = {}
  for name, ck in (("f32", jnp.float32), ("f16", jnp.float16)):
    s0 = jax.random.normal(key, (b, h, p, n), jnp.float32).astype(ck)

    def base(s):
      def body(_, s):
        return rs.selective_state_update(s, **tok, **kw)[1]
      return jax.lax.fori_loop(0, steps, body, s)
    base = jax.jit(base, donate_argnums=0)
    out[f"baseline_{name}_us"] = _time_calls(base, s0, 15, 3, steps)
    del s0
  for name, ck, pol in (("f32", jnp.float32, None),
                        ("f16", jnp.float16, None),
                        ("f16+fp8", jnp.float16, "f16+fp8")):
    for fill in ("staggered", "aligned"):
      counts = (np.arange(b) % L if fill == "staggered"
                else np.zeros(b, np.int64))
      rstate, _ = testing.random_replay_state(
          jax.random.fold_in(key, 1), b, h, p, n, g, L, counts, params["A"],
          checkpoint_dtype=ck, buffer_dtype=jnp.bfloat16)
      if pol is not None:
        rstate = rstate.with_policy(prec.PrecisionPolicy.preset(pol))
      rstate = testing.fill_stale_slots(rstate, 0.0)

      def rep(s):
        def body(_, s):
          return rs.replay_state_update(s, **tok, **kw)[1]
        return jax.lax.fori_loop(0, steps, body, s)
      rep = jax.jit(rep, donate_argnums=0)
      out[f"replay_{name}_{fill}_us"] = _time_calls(rep, rstate, 15, 3,
                                                    steps)
      del rstate
  return out


def model_times(small):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from replayssm_jax import models
  cfg_kw = dict(MODEL)
  batch, prompt_len, new, window = 256, 128, 128, 4
  if small:
    cfg_kw.update(vocab_size=256, d_model=64, pattern="M-M*-", ssm_heads=4,
                  head_dim=16, d_state=16, n_groups=2, num_heads=4,
                  num_kv_heads=2, attn_head_dim=16, intermediate_size=128,
                  chunk_size=16)
    batch, prompt_len, new = 2, 8, 8
  cfg = models.ModelConfig(**cfg_kw)
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: models.HybridLM(cfg, rngs=nnx.Rngs(0))))
  init = jax.jit(lambda k: nnx.state(models.HybridLM(cfg, rngs=nnx.Rngs(k))))
  model = nnx.merge(graphdef, init(jax.random.PRNGKey(0)))
  params = nnx.state(model)
  prompts = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 0,
                               cfg.vocab_size, jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  out = {}
  steps = 32
  max_len = models.kv_cache_len(prompt_len + 12 * steps + new + window)

  def loop(params, tok, st):
    m = nnx.merge(graphdef, params)

    def body(_, c):
      t, s = c
      logits, s = m.step(t, s)
      return jnp.argmax(logits, -1).astype(jnp.int32), s
    return jax.lax.fori_loop(0, steps, body, (tok, st))
  loop = jax.jit(loop, donate_argnums=2)
  for mode in ("baseline", "replay"):
    st = model.init_state(batch, max_len, ssm_mode=mode, buffer_len=L)
    logits, st = models.prefill(model, prompts, lengths, st)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    tok = tok[:, -1] if tok.ndim == 2 else tok
    for _ in range(2):
      tok, st = loop(params, tok, st)
    jax.block_until_ready(st)
    times = []
    for _ in range(9):
      t0 = time.perf_counter()
      tok, st = loop(params, tok, st)
      jax.block_until_ready(st)
      times.append((time.perf_counter() - t0) / steps * 1e6)
    out[f"decode_{mode}_us"] = _median(times)
    del st

  sys.path.insert(0, os.getcwd())
  from experiments.specdec_bench import FlatOracleProposer
  proposer = FlatOracleProposer(0.7, cfg.vocab_size)
  samp = dict(temperature=1000.0)

  def best(fn):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      ts.append(time.perf_counter() - t0)
    return min(ts)

  def pre():
    st = model.init_state(batch, models.kv_cache_len(prompt_len + new
                                                     + window),
                          ssm_mode="replay", buffer_len=L)
    return models.prefill(model, prompts, lengths, st)[0]
  t_pre = best(pre)
  t_plain = best(lambda: models.generate(
      model, prompts, lengths, new, ssm_mode="replay", buffer_len=L,
      rng=jax.random.PRNGKey(2), **samp)[0])
  out["prefill_s"] = t_pre
  out["plain_tokens_per_s"] = batch * new / (t_plain - t_pre)
  for mode in ("replay", "baseline"):
    t = best(lambda: models.speculative_generate(  # pylint: disable=cell-var-from-loop
        model, proposer, prompts, lengths, new, window, ssm_mode=mode,
        buffer_len=L, rng=jax.random.PRNGKey(1), **samp)[0])
    out[f"spec_{mode}_tokens_per_s"] = batch * new / (t - t_pre)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--trees", default="")
  ap.add_argument("--out", default="compare_trees.json")
  ap.add_argument("--mode", default="compare",
                  choices=("compare", "kernels", "models"))
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--model_rounds", type=int, default=1,
                  help="rounds (of --rounds) that also time the models")
  a = ap.parse_args()
  if a.mode != "compare":
    fn = kernel_times if a.mode == "kernels" else model_times
    print("TIMES " + json.dumps(fn(a.small)), flush=True)
    return
  import jax
  trees = [t for t in a.trees.split(",") if t]
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d"), rounds={t: [] for t in trees})
  for r in range(a.rounds):
    for tree in (trees if r % 2 == 0 else trees[::-1]):
      rec = {}
      for mode in ("kernels", "models")[:2 if r < a.model_rounds else 1]:
        cmd = [sys.executable, os.path.abspath(__file__), f"--mode={mode}"]
        cmd += ["--small"] if a.small else []
        t0 = time.time()
        p = subprocess.run(cmd, cwd=tree, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=tree), check=False)
        line = [x for x in p.stdout.splitlines() if x.startswith("TIMES ")]
        rec.update(json.loads(line[0][6:]) if line
                   else {f"{mode}_error": p.stderr[-3000:]})
        print(f"round {r} {tree} {mode} {time.time() - t0:.0f}s", rec,
              flush=True)
      res["rounds"][tree].append(rec)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
  med = {}
  for tree, recs in res["rounds"].items():
    keys = sorted({k for rr in recs for k in rr if not k.endswith("error")})
    med[tree] = {k: _median([rr[k] for rr in recs if k in rr]) for k in keys}
  res["median"] = med
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)
  print(json.dumps(med, indent=1))


if __name__ == "__main__":
  main()
