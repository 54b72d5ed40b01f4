"""Tests of the hybrid LM (replayssm_jax.models): prefill/decode equivalence,
replay vs baseline decode, ragged batches, compile counts, sampling, HF
checkpoint round trips and error messages.

A tiny config (d_model 32, vocab 64, pattern "M-M*-M") keeps every test fast;
weights are random (norm weights too), inputs fresh random tokens.
"""

from __future__ import annotations

import functools
import importlib
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from replayssm_jax import materialize, testing
from replayssm_jax.models import (HybridLM, MambaState, ModelConfig,
                                  decode_step, prefill)
from replayssm_jax.models import hf
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.models.generate import generate
from pallas_kernels import attention as attention_kernel
import pallas_kernels as pk_configs
from tests.hf_common import fixture_dir
# The module (the package re-exports its function under the same name).
G = importlib.import_module("replayssm_jax.models.generate")

TINY = dict(vocab_size=64, d_model=32, pattern="M-M*-M", ssm_heads=4,
            head_dim=8, d_state=8, n_groups=2, conv_kernel=4, chunk_size=8,
            num_heads=4, num_kv_heads=2, attn_head_dim=8,
            intermediate_size=48)


@functools.partial(jax.jit, static_argnums=(0,))
def _random_params(cfg, key):
  """Initial parameters with the norm weights (ones) randomized too."""
  init_key, key = jax.random.split(key)
  params = nnx.state(HybridLM(cfg, rngs=nnx.Rngs(init_key)))
  flat = []
  for i, (path, var) in enumerate(nnx.to_flat_state(params)):
    val = var.get_value()
    if len(path) > 1 and path[-1] == "weight" and path[-2] in ("norm",
                                                               "norm_f"):
      noise = jax.random.normal(jax.random.fold_in(key, i), val.shape)
      val = (val.astype(jnp.float32) + 0.2 * noise).astype(val.dtype)
    flat.append((path, var.replace(val)))
  return nnx.from_flat_state(flat)


def make_model(seed=0, **overrides):
  """A tiny model with random weights (one compilation per config)."""
  cfg = ModelConfig(**{**TINY, **overrides})
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, _random_params(cfg, jax.random.PRNGKey(seed)))


@pytest.fixture(scope="module")
def model():
  return make_model(0)


@pytest.fixture(scope="module")
def model_bf16():
  return make_model(0, dtype="bfloat16", param_dtype="bfloat16")


def random_tokens(seed, shape, vocab=64):
  return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, vocab,
                            jnp.int32)


full_logits = jax.jit(lambda gp, tokens: nnx.merge(*gp)(tokens))


def forward(model, tokens):
  return full_logits(nnx.split(model), tokens)


# The shapes shared by most tests (so that they share compilations): three
# right-padded prompts of 10 slots, a state for 256 new tokens.
B, T, MAX_NEW, BUFFER_LEN = 3, 10, 256, 16
LENGTHS = (10, 4, 7)
MAX_LEN = T + MAX_NEW


@jax.jit
def _prefill_then_decode(gp, prompts, lengths, cont, state):
  """prefill + teacher-forced decode of cont [b, S] in one compilation ->
  (last prompt logits [b, vocab], logits [b, S, vocab], final state)."""
  model = nnx.merge(*gp)
  last, state = M.prefill_fn(model, prompts, lengths, state)

  def body(st, tok):
    logits, st = model.step(tok, st)
    return st, logits

  state, logits = jax.lax.scan(body, state, cont.T)
  return last, jnp.swapaxes(logits, 0, 1), state


def prefill_then_decode(model, prompts, lengths, cont, ssm_mode,
                        **state_kwargs):
  state = model.init_state(prompts.shape[0], MAX_LEN, ssm_mode=ssm_mode,
                           buffer_len=BUFFER_LEN, **state_kwargs)
  return _prefill_then_decode(nnx.split(model), prompts,
                              jnp.asarray(lengths, jnp.int32), cont, state)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("field,value", [
    ("pattern", "M-X"), ("pattern", ""), ("d_model", 0), ("vocab_size", -1),
    ("n_groups", 3), ("num_kv_heads", 3), ("mlp_activation", "gelu"),
    ("dtype", "float64"), ("norm_eps", 0.0), ("attn_head_dim", 7),
    ("conv_kernel", 1), ("rope_theta", -1.0), ("scan_precision", "float32"),
])
def test_bad_config_names_field(field, value):
  with pytest.raises((ValueError, TypeError), match=field):
    ModelConfig(**{**TINY, field: value})


def test_scan_precision_reaches_the_prefill_scan(model):
  """ModelConfig.scan_precision sets the SSD prefill's products: three
  bf16 passes give the default's logits within f32 rounding (a CPU computes
  f32 either way; a GPU's error is measured by
  benchmarks/scripts/prefill_scan_cost.py)."""
  tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 11), 0,
                              TINY["vocab_size"])
  x3 = make_model(0, scan_precision="BF16_BF16_F32_X3")
  want, got = model.forward(tokens)[0], x3.forward(tokens)[0]
  tol = testing.tolerance(jnp.float32)
  np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)


def test_config_derived_shapes():
  cfg = ModelConfig(**TINY)
  assert cfg.n_layers == 6
  assert cfg.block_kinds == ("mamba", "mlp", "mamba", "attention", "mlp",
                             "mamba")
  assert cfg.d_inner == 32 and cfg.conv_dim == 32 + 2 * 2 * 8
  assert cfg.in_proj_dim == 32 + cfg.conv_dim + 4
  # Fields of unused block kinds are not validated.
  ModelConfig(**{**TINY, "pattern": "MM", "num_kv_heads": 3})


# ----------------------------------------------- prefill + decode == forward
@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_ragged_prefill_and_decode_equal_full_forward(model, ssm_mode):
  """Right-padded prompts of lengths 10, 4, 7 (random ids in the padding),
  prefill, then 40 teacher-forced decode steps (2 replay flushes per row)
  == the full-sequence logits of each row's unpadded sequence."""
  steps = 40
  prompts = random_tokens(2, (B, T))
  cont = random_tokens(3, (B, steps))
  last, logits, state = prefill_then_decode(model, prompts, LENGTHS, cont,
                                            ssm_mode)
  assert last.shape == (B, 64) and logits.dtype == jnp.float32
  # Row r unpadded, then filler (causal: it cannot change the positions
  # compared), so all rows run in one batch of one shape.
  seqs = jnp.stack([
      jnp.concatenate([prompts[r, :n], cont[r], random_tokens(r, (T - n,))])
      for r, n in enumerate(LENGTHS)])  # [B, T + steps]
  full = forward(model, seqs)
  assert full.shape == (B, T + steps, 64) and full.dtype == jnp.float32
  for r, n in enumerate(LENGTHS):
    np.testing.assert_allclose(last[r], full[r, n - 1], atol=2e-5, rtol=2e-5,
                               err_msg=f"row {r}")
    np.testing.assert_allclose(logits[r], full[r, n:n + steps], atol=5e-5,
                               rtol=5e-5, err_msg=f"row {r}")
  np.testing.assert_array_equal(state.positions, np.array(LENGTHS) + steps)


def test_swiglu_mlp_and_its_decode(model):
  """mlp_activation="swiglu": the MLP is down(silu(gate(x)) * up(x))
  with gate and up packed as gate_up [d, 2, f] ([:, 0] the gate; checked
  against numpy in float64), the relu2 model has no gate, and the swiglu
  model's prefill + decode logits equal its full forward."""
  swiglu = make_model(5, mlp_activation="swiglu")
  mlp = swiglu.blocks[1].mixer  # pattern "M-M*-M": block 1 is an MLP
  assert not hasattr(mlp, "up_proj") and not hasattr(model.blocks[1].mixer,
                                                     "gate_up")
  h = jax.random.normal(jax.random.PRNGKey(4), (B, 32), jnp.float32)
  gate_up = np.asarray(mlp.gate_up[...], np.float64)
  assert gate_up.shape == (32, 2, swiglu.config.intermediate_size)
  down = np.asarray(mlp.down_proj.kernel[...], np.float64)
  hn = np.asarray(h, np.float64)
  g = hn @ gate_up[:, 0]
  expected = (g / (1 + np.exp(-g)) * (hn @ gate_up[:, 1])) @ down
  np.testing.assert_allclose(np.asarray(mlp(h)), expected, rtol=2e-5,
                             atol=2e-5)
  steps = 12
  prompts = random_tokens(20, (B, T))
  cont = random_tokens(21, (B, steps))
  seqs = jnp.stack([
      jnp.concatenate([prompts[r, :n], cont[r], random_tokens(r, (T - n,))])
      for r, n in enumerate(LENGTHS)])
  full = forward(swiglu, seqs)
  _, logits, _ = prefill_then_decode(swiglu, prompts, LENGTHS, cont, "replay")
  for r, n in enumerate(LENGTHS):
    np.testing.assert_allclose(logits[r, :steps], full[r, n:n + steps],
                               atol=5e-5, rtol=5e-5, err_msg=f"row {r}")


def test_ragged_prefill_state_equals_alone(model):
  """The SSM and conv states of a padded row equal the unpadded row's."""
  prompts = random_tokens(4, (B, T))
  state = model.init_state(B, MAX_LEN, ssm_mode="baseline")
  _, padded = prefill(model, prompts, jnp.asarray(LENGTHS), state)
  n = LENGTHS[1]
  alone_state = model.init_state(1, MAX_LEN, ssm_mode="baseline")
  _, alone = prefill(model, prompts[1:2, :n], jnp.array([n]), alone_state)
  np.testing.assert_array_equal(padded.positions, LENGTHS)
  for sp, sa in zip(padded.layers, alone.layers):
    if isinstance(sp, MambaState):
      np.testing.assert_allclose(sp.conv[1], sa.conv[0], atol=1e-6)
      np.testing.assert_allclose(sp.ssm[1], sa.ssm[0], atol=1e-5, rtol=1e-5)
    elif sp is not None:
      np.testing.assert_allclose(sp.k[1, :, :n], sa.k[0, :, :n], atol=1e-6)
      assert int(sp.length[1]) == n


def test_ring_conv_state_decodes_as_the_shifting_window(model):
  """The ring-buffer conv state (init_state's default) and the shifting
  window (conv_start None) give bit-identical decode logits and the same
  conv inputs after 13 ragged steps (13 is not a multiple of the ring's 3
  slots, so the rings end rotated)."""
  prompts = random_tokens(11, (B, T))
  cont = random_tokens(12, (B, 13))
  state = model.init_state(B, MAX_LEN, ssm_mode="replay",
                           buffer_len=BUFFER_LEN)
  shifting = state.replace(layers=tuple(
      s.replace(conv_start=None) if isinstance(s, MambaState) else s
      for s in state.layers))
  gp, lengths = nnx.split(model), jnp.asarray(LENGTHS, jnp.int32)
  _, ring_logits, ring = _prefill_then_decode(gp, prompts, lengths, cont,
                                              state)
  _, shift_logits, shift = _prefill_then_decode(gp, prompts, lengths, cont,
                                                shifting)
  np.testing.assert_array_equal(ring_logits, shift_logits)
  mamba = [(r, s) for r, s in zip(ring.layers, shift.layers)
           if isinstance(r, MambaState)]
  assert mamba
  for r, s in mamba:
    assert s.conv_start is None
    np.testing.assert_array_equal(r.conv_start, 13 % 3)
    np.testing.assert_array_equal(r.ordered_conv(), s.conv)


# ------------------------------------------------------ replay vs baseline
def test_replay_equals_baseline_greedy_256_f32(model):
  prompts = random_tokens(5, (B, T))
  out = {}
  for mode in ("replay", "baseline"):
    out[mode] = generate(model, prompts, jnp.asarray(LENGTHS), MAX_NEW,
                         ssm_mode=mode, buffer_len=BUFFER_LEN,
                         return_state=True)
  (tr, nr, sr), (tb, nb, sb) = out["replay"], out["baseline"]
  np.testing.assert_array_equal(tr, tb)
  np.testing.assert_array_equal(nr, MAX_NEW)
  np.testing.assert_array_equal(nb, MAX_NEW)
  assert len(set(np.asarray(tr).ravel().tolist())) > 8  # not degenerate
  # The replay state, materialized, is the baseline state.
  for lr, lb, blk in zip(sr.layers, sb.layers, model.blocks):
    if isinstance(lr, MambaState):
      A = -jnp.exp(blk.mixer.A_log[...])
      np.testing.assert_allclose(materialize(lr.ssm, A), lb.ssm, atol=1e-4,
                                 rtol=1e-4)
      np.testing.assert_allclose(lr.ordered_conv(), lb.ordered_conv(),
                                 atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["bf16_model", "bf16_buffers"])
def test_replay_vs_baseline_bf16(model, model_bf16, variant, record_property):
  """bf16 precision, two ways: a bf16 model (activations, hence buffered
  x/B, are bf16: the buffer is lossless) and an f32 model whose replay
  buffers are stored in bf16 (lossy). Replay and baseline are then not
  guaranteed bit-identical, so free-running greedy decodes may part ways at
  a near tie: record the first divergent step per row. Assert that
  teacher-forced logits (same tokens fed to both) stay within a bf16
  tolerance and do not drift over 256 steps."""
  if variant == "bf16_model":
    mdl, kw = model_bf16, {}
  else:
    mdl, kw = model, {"buffer_dtype": jnp.bfloat16}
  prompts = random_tokens(6, (B, T))
  lengths = jnp.asarray(LENGTHS)
  toks = {m: np.asarray(generate(mdl, prompts, lengths, MAX_NEW,
                                 ssm_mode=m, buffer_len=BUFFER_LEN,
                                 **(kw if m == "replay" else {}))[0])
          for m in ("replay", "baseline")}
  same = toks["replay"] == toks["baseline"]  # [B, 256]
  first = [int(np.argmin(r)) if not r.all() else MAX_NEW for r in same]
  record_property("first_divergence_per_row", first)
  cont = jnp.asarray(toks["baseline"])
  logits = {m: np.asarray(prefill_then_decode(
      mdl, prompts, LENGTHS, cont, m, **(kw if m == "replay" else {}))[1])
            for m in ("replay", "baseline")}
  diff = np.abs(logits["replay"] - logits["baseline"])  # [B, 256, vocab]
  scale = np.abs(logits["baseline"]).max()
  record_property("max_abs_logit_diff", float(diff.max()))
  print(f"{variant}: replay vs baseline first divergent greedy step per row "
        f"{first} (of {MAX_NEW}); teacher-forced max |logit diff| "
        f"{diff.max():.2e} (max |logit| {scale:.2f})")
  assert min(first) >= 1  # identical prefill => identical first token
  assert diff.max() <= 0.05 * scale, (diff.max(), scale)
  # No drift: the last 64 steps are no worse than 4x the first 64.
  assert diff[:, -64:].max() <= 4 * max(diff[:, :64].max(), 1e-3 * scale)


# -------------------------------------------------------------- compiles
def test_decode_compiles_once(model, monkeypatch):
  """decode_step and generate, called through the public API with new
  values (and sampling settings) of the same shapes, trace their jitted
  bodies once: the library's jits are replaced by the same jits of the
  bodies under chex.assert_max_traces(n=1), which raises on a second trace
  (checked live at the end with a new batch size)."""
  chex.clear_trace_counter()
  checked_decode = chex.assert_max_traces(M._decode_body, n=1)
  monkeypatch.setattr(M, "_decode_jit",
                      jax.jit(checked_decode, **M.DECODE_JIT_OPTIONS))
  monkeypatch.setattr(G, "_generate_jit", jax.jit(
      chex.assert_max_traces(G._generate_body, n=1),
      **G.GENERATE_JIT_OPTIONS))
  tokens = random_tokens(7, (B, T))
  state = model.init_state(B, MAX_LEN, ssm_mode="replay",
                           buffer_len=BUFFER_LEN)
  _, state = prefill(model, tokens, jnp.asarray(LENGTHS), state)
  tok = tokens[:, 0]
  for _ in range(20):  # crosses a flush (L = 16)
    logits, state = decode_step(model, tok, state)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
  np.testing.assert_array_equal(state.positions, np.array(LENGTHS) + 20)
  for seed in (8, 9):  # new values and sampling settings, same shapes
    generate(model, random_tokens(seed, (B, T)), jnp.array([3, 9, 10]),
             MAX_NEW, temperature=0.5 * seed, top_k=seed, top_p=0.9,
             rng=jax.random.PRNGKey(seed), eos_id=seed)
  small = model.init_state(B - 1, MAX_LEN, ssm_mode="replay",
                           buffer_len=BUFFER_LEN)
  _, small = prefill(model, tokens[1:], jnp.asarray(LENGTHS[1:]), small)
  with pytest.raises(AssertionError, match="traced > 1 times"):
    decode_step(model, tok[1:], small)  # another shape: a second trace


# -------------------------------------------------------------- sampling
def test_several_eos_ids(model):
  """eos_id as a sequence: a row stops at the first of its ids it emits;
  its later slots hold the first id; a resumed row whose pending token is
  any of them has stopped; a bad id is named."""
  prompts, lengths = random_tokens(11, (B, T)), jnp.asarray(LENGTHS)
  greedy, _ = generate(model, prompts, lengths, MAX_NEW)
  g = np.asarray(greedy)
  ids = (int(g[1, 5]), int(g[0, 2]))
  out, n = generate(model, prompts, lengths, MAX_NEW, eos_id=ids)
  o, n = np.asarray(out), np.asarray(n)
  for r in range(B):
    hits = np.nonzero(np.isin(g[r], ids))[0]
    stop = int(hits[0]) + 1 if hits.size else MAX_NEW
    assert n[r] == stop
    np.testing.assert_array_equal(o[r, :stop], g[r, :stop])
    assert (o[r, stop:] == ids[0]).all()
  assert n[0] <= 3 and n[1] <= 6
  state = model.init_state(B, MAX_LEN, buffer_len=BUFFER_LEN)
  _, state = prefill(model, prompts, lengths, state)
  rest, m, _ = G.generate_from_state(model, state, jnp.asarray(
      [ids[1], ids[0], ids[1]]), 3, eos_id=ids)
  np.testing.assert_array_equal(m, 0)
  np.testing.assert_array_equal(rest, ids[0])
  with pytest.raises(ValueError, match="eos_id must be None, an int or a "
                     "sequence"):
    generate(model, prompts, lengths, MAX_NEW,
             eos_id=(1, model.config.vocab_size))


def test_eos_stops_rows_and_top_k_1_is_greedy(model):
  prompts = random_tokens(10, (B, T))
  lengths = jnp.asarray(LENGTHS)
  greedy, n = generate(model, prompts, lengths, MAX_NEW)
  eos = int(greedy[0, 3])  # row 0 emits it at step 3 (maybe earlier too)
  out, n = generate(model, prompts, lengths, MAX_NEW, eos_id=eos)
  g, o, n = np.asarray(greedy), np.asarray(out), np.asarray(n)
  for r in range(B):
    hits = np.nonzero(g[r] == eos)[0]
    stop = int(hits[0]) + 1 if hits.size else MAX_NEW
    assert n[r] == stop
    np.testing.assert_array_equal(o[r, :stop], g[r, :stop])
    assert (o[r, stop:] == eos).all()
  assert n[0] <= 4
  topk1, _ = generate(model, prompts, lengths, MAX_NEW, temperature=0.7,
                      top_k=1, rng=jax.random.PRNGKey(0))
  np.testing.assert_array_equal(topk1, greedy)
  tiny_p, _ = generate(model, prompts, lengths, MAX_NEW, temperature=0.7,
                       top_p=1e-6, rng=jax.random.PRNGKey(0))
  np.testing.assert_array_equal(tiny_p, greedy)  # top-p keeps >= 1 token
  a, _ = generate(model, prompts, lengths, MAX_NEW, temperature=1.0,
                  rng=jax.random.PRNGKey(1))
  a2, _ = generate(model, prompts, lengths, MAX_NEW, temperature=1.0,
                   rng=jax.random.PRNGKey(2))
  assert (np.asarray(a) != np.asarray(greedy)).any()
  assert (np.asarray(a) != np.asarray(a2)).any()


# ---------------------------------------------------------- bad inputs
def test_bad_inputs_raise_clear_errors(model):
  state = model.init_state(B, MAX_LEN, buffer_len=BUFFER_LEN)
  tokens = random_tokens(11, (B, T))
  lengths = jnp.asarray(LENGTHS)
  with pytest.raises(TypeError, match="tokens"):
    prefill(model, tokens.astype(jnp.float32), lengths, state)
  with pytest.raises(ValueError, match="vocab_size"):
    prefill(model, tokens + 64, lengths, state)
  with pytest.raises(ValueError, match="lengths"):
    prefill(model, tokens, jnp.array([11, 4, 7]), state)
  with pytest.raises(ValueError, match="lengths"):
    prefill(model, tokens, jnp.array([0, 4, 7]), state)
  with pytest.raises(ValueError, match="lengths"):
    prefill(model, tokens, jnp.array([6, 6]), state)
  with pytest.raises(ValueError, match="batch"):
    prefill(model, tokens[:2], jnp.array([6, 6]), state)
  with pytest.raises(ValueError, match="max_len"):
    prefill(model, random_tokens(11, (B, MAX_LEN + 1)), lengths, state)
  with pytest.raises(TypeError, match="ModelState"):
    decode_step(model, tokens[:, 0], {"layers": ()})
  with pytest.raises(ValueError, match="ssm_mode"):
    model.init_state(B, 16, ssm_mode="fast")
  with pytest.raises(TypeError, match="checkpoint_dtype"):
    model.init_state(B, 16, checkpoint_dtype=jnp.int32)
  with pytest.raises(ValueError, match="buffer_len"):
    model.init_state(B, 16, buffer_len=0)
  with pytest.raises(ValueError, match="rng"):
    generate(model, tokens, lengths, 4, temperature=1.0)
  with pytest.raises(ValueError, match="top_p"):
    generate(model, tokens, lengths, 4, temperature=1.0, top_p=2.0,
             rng=jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, tokens, lengths, 0)
  with pytest.raises(TypeError, match="config"):
    HybridLM({"vocab_size": 8}, rngs=nnx.Rngs(0))
  _, state = prefill(model, tokens, lengths, state)
  with pytest.raises(ValueError, match="implementation"):
    decode_step(model, tokens[:, 0], state, implementation="nope")
  full = state.replace(positions=state.positions.at[1].set(MAX_LEN))
  with pytest.raises(ValueError, match="KV cache full: rows \\[1\\]"):
    decode_step(model, tokens[:, 0], full)


# ------------------------------------------------------------ checkpoints
def _write_checkpoint(directory, model, architecture, shards=1):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(hf.hf_config_dict(model.config, architecture), f)
  tensors = hf.export_hf_tensors(model)
  if shards == 1:
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return tensors
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, os.path.join(directory, fn))
    weight_map.update({n: fn for n in part})
  with open(os.path.join(directory, "model.safetensors.index.json"),
            "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return tensors


@pytest.mark.parametrize("architecture,overrides,shards", [
    ("Mamba2ForCausalLM", dict(pattern="MMM", n_groups=1,
                               tie_embeddings=True), 1),
    ("NemotronHForCausalLM", dict(rope_theta=None), 3),
])
def test_from_pretrained_round_trip(tmp_path, architecture, overrides,
                                    shards):
  model = make_model(3, **overrides)
  tensors = _write_checkpoint(str(tmp_path), model, architecture, shards)
  if architecture == "Mamba2ForCausalLM":
    assert "lm_head.weight" not in tensors
    assert tensors["backbone.layers.0.mixer.conv1d.weight"].shape == (
        model.config.conv_dim, 1, 4)
  else:
    assert tensors["backbone.layers.3.mixer.k_proj.weight"].shape == (16, 32)
    assert tensors["lm_head.weight"].shape == (64, 32)
  loaded = hf.from_pretrained(str(tmp_path))
  if architecture == "Mamba2ForCausalLM":  # attention/MLP fields unused
    fields = ("pattern", "ssm_heads", "head_dim", "d_state", "n_groups",
              "conv_kernel", "chunk_size", "vocab_size", "d_model",
              "tie_embeddings", "norm_eps")
    for f in fields:
      assert getattr(loaded.config, f) == getattr(model.config, f), f
  else:
    assert loaded.config == model.config
  tokens = random_tokens(12, (2, 9))
  np.testing.assert_array_equal(forward(loaded, tokens),
                                forward(model, tokens))


def test_eos_ids_of_a_checkpoint(tmp_path):
  fixture = fixture_dir("qwen3_5")
  assert hf.eos_ids(fixture) == (2,)  # generation_config.json

  def write(name, d):
    with open(tmp_path / name, "w") as f:
      json.dump(d, f)

  assert hf.eos_ids(str(tmp_path)) == ()  # neither file
  write("config.json", dict(text_config=dict(eos_token_id=7)))
  assert hf.eos_ids(str(tmp_path)) == (7,)  # a multimodal config's text
  write("generation_config.json", dict(eos_token_id=[5, 9, 5]))
  assert hf.eos_ids(str(tmp_path)) == (5, 9)  # generation config first
  write("generation_config.json", dict(eos_token_id="5"))
  with pytest.raises(ValueError, match="generation_config.json: "
                     "eos_token_id must be"):
    hf.eos_ids(str(tmp_path))


def test_from_pretrained_lists_bad_tensors(tmp_path):
  model = make_model(4, rope_theta=None)
  tensors = _write_checkpoint(str(tmp_path), model, "NemotronHForCausalLM")
  del tensors["backbone.layers.0.mixer.A_log"]
  tensors["backbone.layers.9.mixer.extra"] = np.ones(3, np.float32)
  save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
  with pytest.raises(ValueError) as e:
    hf.from_pretrained(str(tmp_path))
  assert "backbone.layers.0.mixer.A_log" in str(e.value)
  assert "backbone.layers.9.mixer.extra" in str(e.value)
  tensors = hf.export_hf_tensors(model)
  tensors["backbone.norm_f.weight"] = np.ones(5, np.float32)
  save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
  with pytest.raises(ValueError, match="backbone.norm_f.weight"):
    hf.from_pretrained(str(tmp_path))
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}, f)
  with pytest.raises(ValueError, match="architecture"):
    hf.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("entries,expected", [(1, 64), (64, 64), (65, 128),
                                              (388, 448)])
def test_kv_cache_len_rounds_up_to_the_attention_block(entries, expected):
  assert S.kv_cache_len(entries) == expected
  # Such a cache is one the attention kernel takes (blocks of >= 16).
  config = pk_configs.AttentionConfig()
  assert attention_kernel.shape_problem(128, expected, config) is None
  assert attention_kernel.shape_problem(128, 388, config) is not None
