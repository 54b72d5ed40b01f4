r"""Sharded decoding on a ("data", "model") mesh: baseline vs ReplaySSM.

For each mesh shape (data, model) of `bench.meshes` that fits the devices
(the others are skipped and logged): the model of `config.model` (random
weights) is placed with `sharding.shard_model`; for each global batch of
`bench.global_batches` and each ssm_mode the prompts are prefilled into a
state placed with `sharding.shard_state`, then `bench.new_tokens` greedy
decode steps run as one jitted loop (`decode_bench.decode_loop`, state
donated), timed as the median of `bench.repeats` calls after a compile +
warm-up call. Each record holds tokens/s, the per-device state bytes
(measured on the arrays' shards and predicted by
`replayssm_jax.sharding_traffic`), the predicted residual-stream all-reduce
bytes per step and per device next to the compiled loop's (the HLO's
all-reduces of [b_local, d_model]; its other collectives summed by kind),
and the predicted SSM HBM bytes per device. One `speculative_generate` run
per mesh and mode (window `bench.spec_window`, `NgramProposer`) at the
first global batch gives the speculative tokens/s.

Usage (see configs/multi_device_bench.py):
  python -m experiments.multi_device_bench \
      --config=configs/multi_device_bench.py --workdir=runs/multi_device_bench
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  python -m experiments.multi_device_bench \
      --config=configs/multi_device_bench.py:smoke \
      --workdir=runs/multi_device_bench_smoke   # CPU, about a minute

Outputs in --workdir: config.json, metrics.jsonl (environment + one line
per run or skipped mesh), summary.md, tokens_per_s.png.
"""

from __future__ import annotations

import contextlib
import os
import statistics

from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import common
from experiments.decode_bench import build_model, decode_loop
from replayssm_jax import sharding as SH
from replayssm_jax import sharding_traffic as ST
from replayssm_jax.models import (ModelConfig, NgramProposer, kv_cache_len,
                                  prefill, speculative_generate)

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "multi_device_bench.py")


def _shard_bytes(tree) -> int:
  """Bytes of the first device's shards of every leaf."""
  return sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree.leaves(tree))


def _hlo_summary(collectives, b_local: int, d_model: int) -> dict:
  resid = [c for c in collectives if c.op == "all-reduce"
           and c.shape == (b_local, d_model)]
  out = dict(hlo_residual_allreduce_bytes=sum(c.bytes for c in resid),
             hlo_residual_allreduces=len(resid))
  for op in ST.COLLECTIVE_OPS:
    out[f"hlo_{op.replace('-', '_')}_bytes"] = sum(
        c.bytes for c in collectives if c.op == op)
  return out


def bench_decode(model, smodel, mesh, config, batch: int, mode: str,
                 shape) -> dict:
  """One (mesh, batch, ssm_mode) decode timing record."""
  b, cfg = config.bench, model.config
  impl = b.implementation or None
  max_len = kv_cache_len(b.prompt_len + b.new_tokens)
  prompts = jax.random.randint(jax.random.PRNGKey(config.seed + batch),
                               (batch, b.prompt_len), 0, cfg.vocab_size,
                               jnp.int32)
  lengths = jnp.full((batch,), b.prompt_len, jnp.int32)
  stok, sln = SH.shard_batch(prompts, mesh), SH.shard_batch(lengths, mesh)
  graphdef, params = nnx.split(smodel)

  def fresh():
    st = SH.shard_state(model.init_state(
        batch, max_len, ssm_mode=mode, buffer_len=b.buffer_len,
        checkpoint_dtype=b.checkpoint_dtype), mesh, config=cfg)
    logits, st = prefill(smodel, stok, sln, st)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    # prefill's outputs take the layout XLA picked: back to the rules'.
    st = SH.shard_state(st, mesh, config=cfg)
    return jax.block_until_ready((tok, st))

  tok, st = fresh()
  held = _shard_bytes(st)
  hlo = ST.compiled_collectives(
      lambda p, t, s: decode_loop(graphdef, p, t, s, b.new_tokens, impl),
      params, tok, st)
  del tok, st

  def make():
    tok, st = fresh()
    return lambda: decode_loop(graphdef, params, tok, st, b.new_tokens, impl)

  _, med, times = common.best_of(make, b.repeats,
                                     reduce=statistics.median)
  cost = ST.decode_step_cost(
      cfg, shape[0], shape[1], batch, ssm_mode=mode, buffer_len=b.buffer_len,
      max_len=max_len, checkpoint_dtype=b.checkpoint_dtype,
      expert_parallel=b.expert_parallel, gather_logits=False)
  rec = dict(kind="decode", data=shape[0], model=shape[1],
             mesh=f"{shape[0]}x{shape[1]}", per_shard=b.per_shard,
             batch=batch,
             local_batch=cost.local_batch, ssm_mode=mode,
             buffer_len=b.buffer_len if mode == "replay" else None,
             new_tokens=b.new_tokens, tokens_per_s=batch * b.new_tokens / med,
             ms_per_step=1e3 * med / b.new_tokens, times_s=times,
             state_bytes_per_device=held,
             predicted_state_bytes_per_device=cost.state_bytes["total"],
             predicted_ssm_traffic_bytes=cost.ssm_traffic_bytes,
             predicted_psum_bytes=cost.psum_bytes,
             **_hlo_summary(hlo, cost.local_batch, cfg.d_model))
  logging.info("mesh %s batch %d %-8s: %.1f tokens/s, state %.3f MB/device, "
               "psum %d B/step predicted, %d B compiled", rec["mesh"], batch,
               mode, rec["tokens_per_s"], held / 2**20, cost.psum_bytes,
               rec["hlo_residual_allreduce_bytes"])
  return rec


def bench_spec(smodel, mesh, config, batch: int, mode: str, shape) -> dict:
  """One speculative_generate run (NgramProposer) on the mesh."""
  b, cfg = config.bench, smodel.config
  prompts = jax.random.randint(jax.random.PRNGKey(config.seed + 7),
                               (batch, b.prompt_len), 0, cfg.vocab_size,
                               jnp.int32)
  lengths = jnp.full((batch,), b.prompt_len, jnp.int32)
  stok, sln = SH.shard_batch(prompts, mesh), SH.shard_batch(lengths, mesh)
  proposer = NgramProposer(n=2)
  (out, _, stats), med, times = common.best_of(
      lambda: lambda: speculative_generate(
          smodel, proposer, stok, sln, b.spec_new_tokens, b.spec_window,
          ssm_mode=mode, buffer_len=b.buffer_len,
          implementation=b.implementation or None,
          checkpoint_dtype=b.checkpoint_dtype), b.repeats,
      reduce=statistics.median)
  del out
  rec = dict(kind="specdec", data=shape[0], model=shape[1],
             mesh=f"{shape[0]}x{shape[1]}", batch=batch, ssm_mode=mode,
             window=b.spec_window, new_tokens=b.spec_new_tokens,
             e2e_tokens_per_s=batch * b.spec_new_tokens / med, times_s=times,
             mean_accepted_length=float(stats.mean_accepted_length),
             iterations=int(stats.iterations))
  logging.info("mesh %s spec %-8s: %.1f tokens/s end to end (accepted "
               "length %.2f)", rec["mesh"], mode, rec["e2e_tokens_per_s"],
               rec["mean_accepted_length"])
  return rec


def _plot(records: list[dict], path: str):
  fig, axes = common.new_figure()
  ax = axes[0][0]
  meshes = list(dict.fromkeys(r["mesh"] for r in records
                              if r["kind"] == "decode"))
  for batch in sorted({r["batch"] for r in records if r["kind"] == "decode"}):
    for mode, style in (("baseline", "o--"), ("replay", "s-")):
      pts = {r["mesh"]: r["tokens_per_s"] for r in records
             if r["kind"] == "decode" and r["batch"] == batch
             and r["ssm_mode"] == mode}
      xs = [i for i, m in enumerate(meshes) if m in pts]
      if xs:
        ax.plot(xs, [pts[meshes[i]] for i in xs], style,
                label=f"{mode}, batch {batch}")
  ax.set_xticks(range(len(meshes)), meshes)
  ax.set_xlabel("mesh (data x model)")
  ax.set_ylabel("decode tokens/s")
  ax.legend()
  common.save_plot(fig, path)


def _check_meshes(meshes) -> list[tuple[int, int]]:
  out = []
  for shape in meshes:
    if (len(shape) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                               or v < 1 for v in shape)):
      raise ValueError(f"config.bench.meshes must hold (data, model) pairs "
                       f"of positive ints, got {shape!r}.")
    out.append(tuple(shape))
  return out


def run(config, workdir: str) -> dict:
  """Runs the benchmark into `workdir`; returns the records."""
  b = config.bench
  meshes = _check_meshes(b.meshes)
  workdir, env, writer = common.start_run(workdir, config)
  cfg = ModelConfig(**config.model.to_dict())
  model = build_model(cfg, config.seed)
  n_dev = jax.device_count()
  records, skipped = [], []
  for i, shape in enumerate(meshes):
    if shape[0] * shape[1] > n_dev:
      logging.warning("mesh %dx%d skipped: needs %d devices, %d available",
                      *shape, shape[0] * shape[1], n_dev)
      skipped.append(writer.write(dict(kind="skipped", data=shape[0],
                                       model=shape[1], devices=n_dev)))
      continue
    logging.info("[%d/%d] mesh %dx%d", i + 1, len(meshes), *shape)
    mesh = SH.make_mesh(*shape)
    smodel = SH.shard_model(model, mesh, expert_parallel=b.expert_parallel)
    # per_shard: the ops (kernels) run per shard under the context mesh.
    with (jax.set_mesh(mesh) if b.per_shard else contextlib.nullcontext()):
      for batch in b.global_batches:
        for mode in b.ssm_modes:
          records.append(writer.write(
              bench_decode(model, smodel, mesh, config, batch, mode, shape)))
      if b.spec_new_tokens:
        for mode in b.ssm_modes:
          records.append(writer.write(bench_spec(
              smodel, mesh, config, b.global_batches[0], mode, shape)))
  decode = [dict(r, state_MB=r["state_bytes_per_device"] / 2**20)
            for r in records if r["kind"] == "decode"]
  spec = [r for r in records if r["kind"] == "specdec"]
  text = (f"# multi_device_bench\n\nmodel: {cfg.pattern} d_model "
          f"{cfg.d_model}, {cfg.dtype}; {n_dev} devices, backend "
          f"{env['backend']} ({env['device_kind']})\n\n"
          "Per device and decode step; psum = the residual-stream "
          "all-reduces ([b_local, d_model]) predicted by "
          "`sharding_traffic` and found in the compiled loop.\n\n" +
          common.markdown_table(
              decode, ["mesh", "batch", "ssm_mode", "tokens_per_s",
                       "ms_per_step", "state_MB",
                       "predicted_state_bytes_per_device",
                       "predicted_psum_bytes",
                       "hlo_residual_allreduce_bytes",
                       "hlo_all_reduce_bytes", "hlo_all_gather_bytes",
                       "predicted_ssm_traffic_bytes"],
              formats=dict(tokens_per_s=".1f", ms_per_step=".3f",
                           state_MB=".4f",
                           predicted_ssm_traffic_bytes=".0f")) + "\n")
  if spec:
    text += ("\n## Speculative decoding (NgramProposer)\n\n" +
             common.markdown_table(
                 spec, ["mesh", "batch", "ssm_mode", "window",
                        "e2e_tokens_per_s", "mean_accepted_length"],
                 formats=dict(e2e_tokens_per_s=".1f",
                              mean_accepted_length=".2f")) + "\n")
  if skipped:
    text += ("\nSkipped (not enough devices): " + ", ".join(
        f"{r['data']}x{r['model']}" for r in skipped) + ".\n")
  common.log_block(common.write_summary(workdir, text))
  if decode:
    _plot(records, os.path.join(workdir, "tokens_per_s.png"))
  return dict(workdir=workdir, records=records, skipped=skipped)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/multi_device_bench")
