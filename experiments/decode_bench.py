r"""Decode throughput of a whole hybrid LM: baseline vs ReplaySSM states.

Builds the model of `config.model` with random weights (one jitted init).
For each batch of `bench.batches` and each state (baseline, and replay for
each `bench.buffer_lens` L, also with each `bench.replay_policies`
precision preset): prefills `bench.prompt_len` random tokens per
row, then times `bench.new_tokens` greedy decode steps of the full model
(embedding, every block, LM head, argmax) run as one jitted
`lax.fori_loop` with the decode state donated. Reports tokens/s, ms/step
(best of `bench.repeats`, after a compile + warm-up run) and the
decode-state bytes.

At each batch of `bench.split_batches` the step is also timed part by
part, each part as its own jitted loop of `new_tokens` steps on fixed
inputs with its states threaded through: every Mamba-2 mixer (in_proj,
conv, SSM, gated norm, out_proj; per state), the SSM op alone of every
Mamba layer (per state), every attention mixer, every MLP, and the
embedding + final norm + LM head + argmax. The parts explain the
replay/baseline ratio: only the Mamba parts differ between the states.

Usage (see configs/{tiny,mamba2_130m,hybrid_1b,nemotron_h_8b}.py):
  python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir=runs/decode_bench_hybrid_1b
  python -m experiments.decode_bench --config=configs/tiny.py:smoke \
      --workdir=runs/decode_bench_smoke

Outputs in --workdir: config.json, metrics.jsonl (environment + one line
per timed run), summary.md, decode_speedup.png.
"""

from __future__ import annotations

import functools
import os

from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx

from experiments import common
from replayssm_jax import precision as P
from replayssm_jax.models import HybridLM, ModelConfig, kv_cache_len, prefill
from replayssm_jax.models.blocks import Block

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "configs", "tiny.py")


def build_model(cfg: ModelConfig, seed: int) -> HybridLM:
  """Random-weight model, initialized under jit (no eager op storm): one
  compiled initializer per block kind, called for each block with its own
  key, and HybridLM's own init for the rest (its blocks' part unused, so
  XLA drops it), so that the compile time does not grow with the number of
  layers (the Qwen3.5-4B shape as one program: about 75 s of compiling on
  an H100)."""
  graphdef, state = nnx.split(nnx.eval_shape(
      lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  pure = state.to_pure_dict()
  kinds = cfg.block_kinds
  keys = jax.random.split(jax.random.PRNGKey(seed), len(kinds) + 1)
  outer = jax.jit(lambda key: {
      name: sub for name, sub in nnx.state(HybridLM(
          cfg, rngs=nnx.Rngs(key))).to_pure_dict().items()
      if name != "blocks"})
  pure.update(outer(keys[-1]))
  block_init = {
      kind: jax.jit(lambda key, kind=kind: nnx.state(
          Block(kind, cfg, rngs=nnx.Rngs(key))))
      for kind in set(kinds)}
  for i, kind in enumerate(kinds):
    pure["blocks"][i] = block_init[kind](keys[i]).to_pure_dict()
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


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


class _Setup:
  """Model, prompts and state factory of one batch."""

  def __init__(self, model, config, batch: int):
    b = self.b = config.bench
    self.model, self.batch = model, batch
    cfg = model.config
    self.prompts = jax.random.randint(
        jax.random.PRNGKey(config.seed + 1), (batch, b.prompt_len), 0,
        cfg.vocab_size, jnp.int32)
    self.lengths = jnp.full((batch,), b.prompt_len, jnp.int32)
    self.kw = {k: getattr(b, k) for k in ("buffer_dtype", "kv_dtype")
               if getattr(b, k)}
    self.impl = b.implementation or None

  def state(self, mode: str, buffer_len, policy: str = ""):
    """(first token, decode state after the prompts); policy: a
    `PrecisionPolicy` preset for the SSM states ("": plain
    `bench.checkpoint_dtype`).

    With `bench.prefill_rows` > 0 the prompts are prefilled that many rows
    at a time and the row states concatenated (the 8B model's whole-batch
    prefill at batch 256 needs more than the H200's memory).
    """
    b = self.b
    rows = b.prefill_rows or self.batch
    kw = (dict(self.kw, precision=P.PrecisionPolicy.preset(policy)) if policy
          else dict(self.kw, checkpoint_dtype=b.checkpoint_dtype))
    tokens, states = [], []
    for r0 in range(0, self.batch, rows):
      n = min(rows, self.batch - r0)
      st = self.model.init_state(n, kv_cache_len(b.prompt_len + b.new_tokens),
                                 ssm_mode=mode, buffer_len=buffer_len or 16,
                                 **kw)
      logits, st = prefill(self.model, self.prompts[r0:r0 + n],
                           self.lengths[r0:r0 + n], st)
      tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
      states.append(st)
    if len(states) == 1:
      return tokens[0], states[0]
    return jnp.concatenate(tokens), _concat_rows(states)


def _concat_rows(states: list):
  """The row blocks' states concatenated leaf by leaf. Empties `states` and
  drops each block's leaf once copied, so peak memory is about one state
  plus one leaf, not two states (8B, batch 256: 28 GB each)."""
  treedef = jax.tree.structure(states[0])
  parts = [jax.tree.leaves(s) for s in states]
  states.clear()
  out = []
  for i in range(len(parts[0])):
    out.append(jnp.concatenate([p[i] for p in parts]))
    for p in parts:
      p[i] = None
  return jax.tree.unflatten(treedef, out)


def bench_mode(setup: _Setup, mode: str, buffer_len, policy: str = ""
               ) -> dict:
  b = setup.b
  graphdef, params = nnx.split(setup.model)

  def make():
    tok, st = setup.state(mode, buffer_len, policy)
    jax.block_until_ready((tok, st))
    make.state_bytes = _state_bytes(st)
    return lambda: decode_loop(graphdef, params, tok, st, b.new_tokens,
                               setup.impl)

  _, best, times = common.best_of(make, b.repeats)
  rec = dict(kind="decode", ssm_mode=mode, batch=setup.batch,
             prompt_len=b.prompt_len, new_tokens=b.new_tokens,
             buffer_len=buffer_len, policy=policy,
             tokens_per_s=setup.batch * b.new_tokens / best,
             ms_per_step=1e3 * best / b.new_tokens, times_s=times,
             state_bytes=make.state_bytes)
  logging.info("batch %d %s%s L=%s: %.1f tokens/s, %.3f ms/step, state "
               "%.1f MB", setup.batch, mode, f" {policy}" if policy else "",
               buffer_len, rec["tokens_per_s"], rec["ms_per_step"],
               rec["state_bytes"] / 2**20)
  return rec


# ------------------------------------------------------------ time split
PARTS = ("mamba", "ssm", "attention", "mlp", "embed_head")


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6), donate_argnums=(3,))
def part_loop(graphdef, params, inputs, layers, steps, implementation,
              part):
  """`steps` decode steps of one part of the model.

  layers: the per-layer states of the part's layers (donated); inputs: the
  first step's activations (see `_part_inputs`; the SSM op alone runs on
  them every step). Returns (layers, sink): the sink sums a slice of every
  output so that no step is dead code.
  """
  model = nnx.merge(graphdef, params)
  idx = _part_layers(model, part)

  # Each iteration's input is the previous one's output (as in decoding):
  # with loop-invariant inputs XLA would hoist the projections of the fixed
  # activations out of the loop and time only what depends on the state.
  def body(_, carry):
    layers, h, tok, sink = carry
    layers = list(layers)
    if part == "embed_head":
      tok = jnp.argmax(model.logits(model.embeddings(tok)), -1)
      return tuple(layers), h, tok.astype(jnp.int32), sink
    for n, i in enumerate(idx):
      blk = model.blocks[i]
      if part == "ssm":  # opaque kernel on fixed inputs, stateful
        y, layers[n] = _ssm_op(blk.mixer, inputs, layers[n], implementation,
                               layer=n)
      else:
        y, layers[n] = blk(h, layers[n], implementation=implementation)
        yf = y.astype(jnp.float32)
        h = (yf * jax.lax.rsqrt(jnp.mean(yf * yf, -1, keepdims=True)
                                + 1e-6)).astype(h.dtype)
      sink = sink + y.reshape(y.shape[0], -1)[:1, 0].astype(jnp.float32)
    return tuple(layers), h, tok, sink

  layers, _, tok, sink = jax.lax.fori_loop(
      0, steps, body, (tuple(layers), inputs["h"], inputs["token"],
                       jnp.zeros((1,), jnp.float32)))
  return layers, sink + tok[:1].astype(jnp.float32)


def _part_layers(model, part: str) -> list[int]:
  kind = {"mamba": "mamba", "ssm": "mamba", "attention": "attention",
          "mlp": "mlp"}.get(part)
  return [i for i, blk in enumerate(model.blocks) if blk.kind == kind]


def _ssm_op(mixer, inputs, state, implementation, layer: int):
  """The SSM op of one Mamba layer's MambaState (its precision policy and
  Mamba index passed as the mixer's step passes them)."""
  from replayssm_jax import ops  # pylint: disable=g-import-not-at-top
  A, D, dt_bias = mixer._ssm_params()  # pylint: disable=protected-access
  args = (inputs["x"], inputs["dt"], A, inputs["B"], inputs["C"])
  kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True,
            implementation=implementation)
  if isinstance(state.ssm, jax.Array):
    y, ssm = ops.selective_state_update(state.ssm, *args, **kw)
  else:
    y, ssm = ops.replay_state_update(state.ssm, *args, policy=state.precision,
                                     layer=layer, **kw)
  return y, state.replace(ssm=ssm)


def _part_inputs(cfg, batch: int, seed: int) -> dict:
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  dt = jnp.dtype(cfg.dtype)
  normal = lambda k, shape: jax.random.normal(k, shape, dt)  # noqa: E731
  return dict(
      h=normal(keys[0], (batch, cfg.d_model)),
      token=jax.random.randint(keys[1], (batch,), 0, cfg.vocab_size),
      x=normal(keys[2], (batch, cfg.ssm_heads, cfg.head_dim)),
      dt=jax.random.uniform(keys[3], (batch, cfg.ssm_heads), dt, -3.0, 0.0),
      B=normal(keys[4], (batch, cfg.n_groups, cfg.d_state)),
      C=normal(keys[5], (batch, cfg.n_groups, cfg.d_state)))


def bench_parts(setup: _Setup, config, modes) -> list[dict]:
  """Times every part at one batch; modes: [(ssm_mode, buffer_len,
  policy)]."""
  b, model = setup.b, setup.model
  graphdef, params = nnx.split(model)
  inputs = _part_inputs(model.config, setup.batch, config.seed + 7)
  records = []
  for part in PARTS:
    idx = _part_layers(model, part)
    if part != "embed_head" and not idx:
      continue
    # Only the Mamba parts depend on the SSM state.
    for mode, L, pol in (modes if part in ("mamba", "ssm") else [modes[0]]):
      def make(mode=mode, L=L, pol=pol):
        if part in ("mlp", "embed_head"):  # stateless parts
          layers = tuple(None for _ in idx)
        else:
          _, st = setup.state(mode, L, pol)
          # Wait for the whole prefill, not only the part's layers.
          jax.block_until_ready(st)
          layers = tuple(st.layers[i] for i in idx)
        return lambda: part_loop(graphdef, params, inputs, layers,
                                 b.new_tokens, setup.impl, part)

      _, best, times = common.best_of(make, b.repeats)
      stateful = part in ("mamba", "ssm")
      rec = dict(kind="part", part=part, layers=len(idx),
                 ssm_mode=mode if stateful else None,
                 buffer_len=L if stateful else None,
                 policy=pol if stateful else None,
                 batch=setup.batch, ms_per_step=1e3 * best / b.new_tokens,
                 times_s=times)
      logging.info("batch %d part %-10s %-8s %s L=%-4s: %.3f ms/step",
                   setup.batch, part, rec["ssm_mode"] or "-",
                   rec["policy"] or "", L, rec["ms_per_step"])
      records.append(rec)
  return records


def _split_table(decode: list[dict], parts: list[dict]) -> str:
  """Per state: full step, the parts, their sum, and the SSM share."""
  rows = []
  for d in decode:
    if d["batch"] not in {p["batch"] for p in parts}:
      continue
    mine = {p["part"]: p["ms_per_step"] for p in parts
            if p["batch"] == d["batch"] and p["ssm_mode"] in (None,
                                                              d["ssm_mode"])
            and p["buffer_len"] in (None, d["buffer_len"])
            and p["policy"] in (None, d["policy"])}
    total = sum(v for k, v in mine.items() if k != "ssm")
    rows.append(dict(batch=d["batch"], ssm_mode=d["ssm_mode"],
                     buffer_len=d["buffer_len"], policy=d["policy"] or "-",
                     step_ms=d["ms_per_step"],
                     **{f"{k}_ms": v for k, v in mine.items()},
                     parts_sum_ms=total,
                     ssm_share=mine.get("ssm", 0.0) / d["ms_per_step"]))
  if not rows:
    return ""
  cols = list(dict.fromkeys(k for r in rows for k in r))
  return "\n## Time split (ms per step)\n\n" + common.markdown_table(
      rows, cols, formats={c: ".3f" for c in cols if c.endswith("_ms")}
      | dict(ssm_share=".2f")) + "\n"


def _plot(rows: list[dict], path: str):
  fig, axes = common.new_figure()
  ax = axes[0][0]
  for L, pol in sorted({(r["buffer_len"], r["policy"]) for r in rows
                        if r["buffer_len"]}):
    pts = sorted((r["batch"], r["speedup"]) for r in rows
                 if (r["buffer_len"], r["policy"]) == (L, pol)
                 and r["speedup"])
    if pts:
      ax.plot(*zip(*pts), "o-" if not pol else "s--",
              label=f"replay L={L}" + (f" {pol}" if pol else ""))
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch")
  ax.set_ylabel("decode tokens/s vs baseline")
  ax.legend()
  common.save_plot(fig, path)


def run(config, workdir: str) -> dict:
  """Runs the benchmark into `workdir`; returns the records."""
  for name in config.bench.replay_policies:
    try:
      P.PrecisionPolicy.preset(name)
    except ValueError as e:
      raise ValueError(f"config.bench.replay_policies: {e}") from None
  workdir, env, writer = common.start_run(workdir, config)
  cfg = ModelConfig(**config.model.to_dict())
  model = build_model(cfg, config.seed)
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
  b = config.bench
  modes = [(m, L, "") for m in b.ssm_modes
           for L in (b.buffer_lens if m == "replay" else (None,))]
  modes += [("replay", L, pol) for pol in b.replay_policies
            for L in b.buffer_lens]
  records, parts = [], []
  for i, batch in enumerate(b.batches):
    logging.info("[%d/%d] batch %d", i + 1, len(b.batches), batch)
    setup = _Setup(model, config, batch)
    for mode, L, pol in modes:
      records.append(writer.write(bench_mode(setup, mode, L, pol),
                                  n_params=n_params))
    if batch in b.split_batches:
      parts += [writer.write(p) for p in bench_parts(setup, config, modes)]
  rows = [dict(r) for r in records]
  for r in rows:
    base = next((q for q in rows if q["batch"] == r["batch"]
                 and q["ssm_mode"] == "baseline" and not q["policy"]), None)
    r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    r["state_MB"] = r["state_bytes"] / 2**20
  table = [dict(r, policy=r["policy"] or "-") for r in rows]
  text = (f"# decode_bench\n\nmodel: {cfg.pattern} d_model {cfg.d_model}, "
          f"{n_params / 1e6:.1f}M params, {cfg.dtype}; backend "
          f"{env['backend']} ({env['device_kind']})\n\n" +
          common.markdown_table(table, ["batch", "ssm_mode", "buffer_len",
                                        "policy", "tokens_per_s",
                                        "ms_per_step", "speedup",
                                        "state_MB"],
                                 formats=dict(tokens_per_s=".1f",
                                              ms_per_step=".3f",
                                              speedup=".2f",
                                              state_MB=".2f")) + "\n" +
          _split_table(records, parts))
  common.log_block(common.write_summary(workdir, text))
  _plot(rows, os.path.join(workdir, "decode_speedup.png"))
  return dict(workdir=workdir, records=records, parts=parts)


if __name__ == "__main__":
  common.run_app(run, default_config=_DEFAULT_CONFIG,
                 default_workdir="runs/decode_bench")
