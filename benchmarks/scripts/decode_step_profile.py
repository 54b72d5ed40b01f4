"""Where the full decode step's time goes, kernel by kernel (GPU diagnostic).

Profiles a jitted loop of `steps` greedy decode steps of a random-weight
model after a prefill (as experiments/decode_bench.py times it), per SSM
mode, with `replayssm_jax.profiling.op_times`, and names every traced op by
the source of the jax operation it came from (the `op_name` / source line
metadata of the optimized HLO). `by_source` sums the ops per source line, so
the time of e.g. the conv update or the attention softmax over all layers is
one row. XLA's CUDA graphs are turned off so that their kernels can be split
(see profiling.py): the loop's wall time is then a little longer than
decode_bench's.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python \
      benchmarks/scripts/decode_step_profile.py --config configs/hybrid_1b.py \
      --batch 256 --out $OUT/decode_step_profile.json

`--config` also takes a transformers config.json (random bf16 weights at
its shape), e.g. configs/qwen3_5_4b_text.json. `--part prefill` profiles
one batched prefill of [batch, prompt_len] instead (what the serving
engine's admission runs), by block; `--part pool` the serving pool's
dispatch of `steps` greedy steps (`serving.step_n`) over `batch` slots of
`--max_len` entries, every slot active after a prefill of prompt_len
tokens (what the engine decodes; the ops outside the model's blocks are
its bookkeeping). `--max_len` also sets the decode part's KV cache length.
"""

import argparse
import collections
import datetime
import functools
import gzip
import importlib.util
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from experiments.decode_bench import build_model
from replayssm_jax import profiling, ssd
from replayssm_jax import serving
from replayssm_jax.models import ModelConfig, hf, prefill
from replayssm_jax.models.model import prefill_fn

_BLOCKS = ("mamba", "gdn", "kda", "attention", "mlp", "moe", "lm_head")
_PIECES = ("in_proj", "conv", "ssm", "gated_norm", "out_proj", "qkv",
           "kv_write", "attend", "o_proj")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{([^}]*)\}")
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def op_sources(hlo_text: str) -> dict:
  """instruction name -> "op_name @ file:line" from the HLO metadata."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    meta = {k: v.strip('"') for k, v in _FIELD.findall(m.group(2))}
    op = meta.get("op_name", "")
    op = re.sub(r"^jit\([^)]*\)/", "", op)
    src = os.path.basename(meta.get("source_file", ""))
    where = f"{src}:{meta['source_line']}" if "source_line" in meta else ""
    out[m.group(1)] = f"{op} @ {where}" if where else op
  return out


def load_config(path: str):
  """get_config() of a configs/*.py file (its default ConfigDict)."""
  spec = importlib.util.spec_from_file_location("cfgmod", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def load_model_config(path: str) -> ModelConfig:
  """The ModelConfig of a configs/*.py file (its get_config().model), or
  of a transformers config.json (its shape in bf16, as
  random_weight_decode.py builds it)."""
  if path.endswith(".json"):
    with open(path) as f:
      cfg, _ = hf.config_from_hf(json.load(f))
    return cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
  return ModelConfig(**load_config(path).model.to_dict())


def scope(source: str) -> str:
  """The model's named scope of an op ("mamba/conv", "attention", ...; see
  models/layers.py), or "(outside blocks)"."""
  parts = source.split(" @ ")[0].split("/")
  for i, p in enumerate(parts):
    if p in _BLOCKS:
      nxt = parts[i + 1] if i + 1 < len(parts) else ""
      return f"{p}/{nxt}" if nxt in _PIECES else f"{p} (rest)"
  return "(outside blocks)"


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--config", default="configs/hybrid_1b.py")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--modes", default="baseline,replay")
  ap.add_argument("--iters", type=int, default=3)
  ap.add_argument("--top", type=int, default=60)
  ap.add_argument("--out", required=True)
  ap.add_argument("--part", default="decode",
                  choices=("decode", "prefill", "pool"),
                  help="prefill: profile one batched prefill of "
                  "[batch, prompt_len] from a fresh state instead (times "
                  "per prefill call; --steps unused); pool: the serving "
                  "pool's step_n dispatch")
  ap.add_argument("--max_len", type=int, default=0,
                  help="KV cache entries per row (0: the decode part's "
                  "shortest that fits its calls; 1024 for the pool part)")
  ap.add_argument("--hlo_dir", default="",
                  help="also write each mode's optimized HLO (gzipped) here")
  ap.add_argument("--segsum_difference", action="store_true",
                  help="the Mamba-2 prefill's within-chunk decay sums as "
                  "differences of one cumulative sum "
                  "(prefill_scan_cost.py's variant) in place of "
                  "ssd._segsum_blocked's sums of one sign")
  ap.add_argument("--segsum_masked", action="store_true",
                  help="the same sums by ssd._segsum_masked (one masked "
                  "[Q, Q] cumulative sum) instead of the default "
                  "ssd._segsum_blocked")
  a = ap.parse_args()
  if a.segsum_difference:
    from prefill_scan_cost import _segsum_difference  # pylint: disable=g-import-not-at-top
    ssd._segsum = _segsum_difference  # read when the prefill is traced
  elif a.segsum_masked:
    ssd._segsum = ssd._segsum_masked

  cfg = load_model_config(a.config)
  model = build_model(cfg, 0)
  graphdef, params = nnx.split(model)
  prompts = jax.random.randint(jax.random.PRNGKey(1), (a.batch, a.prompt_len),
                               0, cfg.vocab_size, jnp.int32)
  lengths = jnp.full((a.batch,), a.prompt_len, jnp.int32)

  # The state is donated, as in decode_bench's loop (without, a step pays
  # 0.19-0.22 ms copying it once per call).
  @functools.partial(jax.jit, donate_argnums=2)
  def loop(params, tok, st):
    m = nnx.merge(graphdef, params)

    def body(_, c):
      t, s = c
      logits, s = m.step(t, s)
      return jnp.argmax(logits, -1).astype(jnp.int32), s

    return jax.lax.fori_loop(0, a.steps, body, (tok, st))

  @jax.jit
  def prefill_loop(params, tokens, lens, st):
    return prefill_fn(nnx.merge(graphdef, params), tokens, lens, st)

  result = dict(
      command=" ".join([os.path.basename(sys.executable)] + sys.argv),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      device=jax.devices()[0].device_kind, jax=jax.__version__,
      xla_flags=os.environ.get("XLA_FLAGS", ""), config=a.config,
      batch=a.batch, prompt_len=a.prompt_len, steps=a.steps, part=a.part,
      modes={})
  # A KV cache of a multiple of 16 entries, so the Pallas decode attention
  # takes it (at 273 entries the dispatcher runs XLA's attention), with
  # room for the untimed call and the `iters` timed ones: each call
  # continues the decode from the state the last one returned.
  max_len = -(-(a.prompt_len + a.steps * (a.iters + 1) + 1) // 16) * 16
  max_len = max(max_len, a.max_len or (1024 if a.part == "pool" else 0))
  result["max_len"] = max_len
  for mode in a.modes.split(","):
    st = model.init_state(a.batch, max_len, ssm_mode=mode,
                          buffer_len=a.buffer_len,
                          checkpoint_dtype=jnp.float32)
    if a.part == "prefill":
      fresh = st
      hlo = prefill_loop.lower(params, prompts, lengths, fresh).compile(
      ).as_text()

      def call():
        return prefill_loop(params, prompts, lengths, fresh)[0]
    elif a.part == "pool":
      logits, st = prefill(model, prompts, lengths, st)
      pool = serving.Pool(state=st, active=jnp.ones((a.batch,), bool),
                          tokens=jnp.argmax(logits, -1).astype(jnp.int32),
                          max_len=max_len)
      sampling, rng = serving.pool.resolve_sampling(0.0, None, None, None)
      hlo = serving.pool._step_n_jit.lower(  # pylint: disable=protected-access
          graphdef, params, pool, a.steps, False, sampling, rng,
          None).compile().as_text()
      carry = [pool]

      def call():
        carry[0] = serving.step_n(model, carry[0], a.steps,
                                  parts=(graphdef, params))[0]
        return carry[0].tokens
    else:
      logits, st = prefill(model, prompts, lengths, st)
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      hlo = loop.lower(params, tok, st).compile().as_text()
      carry = [tok, st]

      def call():
        carry[:] = loop(params, *carry)
        return carry[0]
    sources = op_sources(hlo)
    if a.hlo_dir:
      os.makedirs(a.hlo_dir, exist_ok=True)
      with gzip.open(os.path.join(a.hlo_dir, f"{a.part}_loop_{mode}.hlo.gz"),
                     "wt") as f:
        f.write(hlo)
    t = profiling.op_times(call, iters=a.iters, top=10**6)
    calls_per_step = 1 if a.part == "prefill" else a.steps
    per_step = lambda ms: ms / calls_per_step  # noqa: E731
    by_source = collections.defaultdict(lambda: [0.0, 0, set(), 0.0])
    by_scope = collections.defaultdict(float)
    for row in t["top"]:
      row["source"] = sources.get(row["hlo_op"], f"? {row['kernel']}")
      row["ms"] = per_step(row["ms"])
      agg = by_source[row["source"]]
      agg[0] += row["ms"]
      agg[1] += 1
      agg[2].add(row["category"])
      agg[3] += row["events_per_call"] / calls_per_step
      by_scope[scope(row["source"])] += row["ms"]
    ranked = sorted(by_source.items(), key=lambda kv: -kv[1][0])
    result["modes"][mode] = dict(
        ms_per_step=per_step(t["device_ms"]),
        wall_ms_per_step=per_step(t["wall_ms"]),
        by_category={k: per_step(v) for k, v in t["by_category"].items()},
        by_scope=dict(sorted(by_scope.items(), key=lambda kv: -kv[1])),
        by_source=[dict(source=s, ms=v[0], ops=v[1],
                        launches_per_step=v[3], categories=sorted(v[2]))
                   for s, v in ranked[:a.top]],
        top_ops=t["top"][:a.top])
    unit = "prefill" if a.part == "prefill" else "step"
    print(f"== {mode}: {per_step(t['device_ms']):.3f} ms/{unit} on the "
          f"device",
          {k: round(per_step(v), 3) for k, v in t["by_category"].items()})
    for s, ms in sorted(by_scope.items(), key=lambda kv: -kv[1]):
      print(f"  scope {s:28s} {ms:8.4f} ms")
    for s, v in ranked[:a.top]:
      print(f"  {v[0]:8.4f} ms  {v[1]:4d} ops {v[3]:6.1f} launches/step "
            f"{'/'.join(sorted(v[2])):6s}  {s[:150]}")
    for row in t["top"][:20]:  # launches' spread: e.g. flush launches with
      # no row due (most steps) vs the step where every row flushes
      print(f"  op {row['hlo_op'][:40]:40s} {row['events_per_call']:5.1f} "
            f"launches/call, µs min {row['min_us']:.1f} median "
            f"{row['median_us']:.1f} max {row['max_us']:.1f}")
    del st
  with open(a.out, "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
