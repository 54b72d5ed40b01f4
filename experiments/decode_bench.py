r"""Decode throughput of a whole hybrid LM: baseline vs ReplaySSM states.

For each `bench.ssm_modes` entry: builds the model of `config.model` with
random weights (one jitted init), prefills `bench.batch` random prompts of
`bench.prompt_len` tokens, then times `bench.new_tokens` greedy decode steps
of the full model (embedding, every block, LM head, argmax) run as one
jitted `lax.fori_loop` with the decode state donated. Reports tokens/s and
ms/step (best of `bench.repeats`, after a compile + warm-up run) and the
decode-state bytes.

Usage (see configs/{tiny,mamba2_130m,hybrid_1b,nemotron_h_8b}.py):
  python -m experiments.decode_bench --config=configs/tiny.py:smoke \
      --workdir=runs/decode_bench_smoke

Outputs in --workdir: config.json, metrics.jsonl (environment + one line per
mode), summary.md.
"""

from __future__ import annotations

import functools
import os
import time

from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import common
from replayssm_jax.models import HybridLM, ModelConfig, prefill

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "tiny.py")


def build_model(cfg: ModelConfig, seed: int) -> HybridLM:
  """Random-weight model, initialized under one jit (no eager op storm)."""
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  init = jax.jit(lambda key: nnx.state(HybridLM(cfg, rngs=nnx.Rngs(key))))
  return nnx.merge(graphdef, init(jax.random.PRNGKey(seed)))


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(3,))
def decode_loop(graphdef, params, token, state, steps, implementation):
  """`steps` greedy decode steps of the full model -> (last token, state)."""
  model = nnx.merge(graphdef, params)

  def body(_, carry):
    tok, st = carry
    logits, st = model.step(tok, st, implementation)
    return jnp.argmax(logits, -1).astype(jnp.int32), st

  return jax.lax.fori_loop(0, steps, body, (token, state))


def _state_bytes(state) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def bench_mode(model, config, mode: str) -> dict:
  b = config.bench
  cfg = model.config
  kw = {k: getattr(b, k) for k in ("buffer_dtype", "kv_dtype") if getattr(
      b, k)}
  prompts = jax.random.randint(jax.random.PRNGKey(config.seed + 1),
                               (b.batch, b.prompt_len), 0, cfg.vocab_size,
                               jnp.int32)
  lengths = jnp.full((b.batch,), b.prompt_len, jnp.int32)
  graphdef, params = nnx.split(model)
  impl = b.implementation or None

  def fresh_state():
    st = model.init_state(b.batch, b.prompt_len + b.new_tokens,
                          ssm_mode=mode, buffer_len=b.buffer_len,
                          checkpoint_dtype=b.checkpoint_dtype, **kw)
    logits, st = prefill(model, prompts, lengths, st)
    return jnp.argmax(logits, -1).astype(jnp.int32), st

  times = []
  for i in range(b.repeats + 1):  # run 0: compile + warm-up
    tok, st = fresh_state()
    state_bytes = _state_bytes(st)
    jax.block_until_ready((tok, st))
    t0 = time.perf_counter()
    tok, st = decode_loop(graphdef, params, tok, st, b.new_tokens, impl)
    jax.block_until_ready((tok, st))
    if i:
      times.append(time.perf_counter() - t0)
  best = min(times)
  rec = dict(kind="decode", ssm_mode=mode, batch=b.batch,
             prompt_len=b.prompt_len, new_tokens=b.new_tokens,
             buffer_len=b.buffer_len if mode == "replay" else None,
             tokens_per_s=b.batch * b.new_tokens / best,
             ms_per_step=1e3 * best / b.new_tokens, times_s=times,
             state_bytes=state_bytes)
  logging.info("%s: %.1f tokens/s, %.3f ms/step, state %.1f MB", mode,
               rec["tokens_per_s"], rec["ms_per_step"], state_bytes / 2**20)
  return rec


def run(config, workdir: str) -> dict:
  """Runs the benchmark into `workdir`; returns the per-mode records."""
  workdir = common.prepare_workdir(workdir, config)
  env = common.log_environment()
  writer = common.MetricsWriter(workdir)
  writer.write(kind="environment", **env)
  cfg = ModelConfig(**config.model.to_dict())
  model = build_model(cfg, config.seed)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  records = []
  for mode in config.bench.ssm_modes:
    records.append(writer.write(bench_mode(model, config, mode),
                                n_params=n_params))
  rows = [dict(r) for r in records]
  base = {r["ssm_mode"]: r["tokens_per_s"] for r in rows}
  for r in rows:
    r["speedup"] = (r["tokens_per_s"] / base["baseline"]
                    if "baseline" in base else None)
    r["state_MB"] = r["state_bytes"] / 2**20
  text = (f"# decode_bench\n\nmodel: {cfg.pattern} d_model {cfg.d_model}, "
          f"{n_params / 1e6:.1f}M params, {cfg.dtype}; backend "
          f"{env['backend']} ({env['device_kind']})\n\n" +
          common.markdown_table(rows, ["ssm_mode", "buffer_len", "batch",
                                       "tokens_per_s", "ms_per_step",
                                       "speedup", "state_MB"],
                                 formats=dict(tokens_per_s=".1f",
                                              ms_per_step=".3f",
                                              speedup=".2f",
                                              state_MB=".2f")) + "\n")
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(text)
  common.log_block(text)
  return dict(workdir=workdir, records=records)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/decode_bench")
