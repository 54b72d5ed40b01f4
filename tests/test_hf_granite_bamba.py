"""Granite 4.0 hybrid and Bamba checkpoints: `from_pretrained` against
transformers' outputs (tests/fixtures/hf/<name>: config.json,
model.safetensors and expected.npz with the input tokens, transformers'
float32 logits and greedy tokens), the Granite / Bamba numerics of
ModelConfig on every path, and the refusals of what is not implemented."""

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import models
from replayssm_jax.models import hf, hf_bamba, hf_granite, hf_tensors
from replayssm_jax.models.config import ModelConfig
from tests.hf_common import fixture_dir

PARITY = ("granite_hybrid_dense", "bamba", "granite_hybrid_moe")


@pytest.fixture(scope="module", params=PARITY)
def loaded(request):
  d = fixture_dir(request.param)
  return hf.from_pretrained(d), dict(np.load(os.path.join(d, "expected.npz")))


def test_full_forward_logits_equal_transformers(loaded):
  model, exp = loaded
  logits = np.asarray(model(jnp.asarray(exp["input_ids"])))
  ref = exp["logits"]
  assert logits.shape == ref.shape
  rel = np.abs(logits - ref).max() / np.abs(ref).max()
  assert rel <= 1e-4, rel


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_greedy_generate_equals_transformers(loaded, ssm_mode):
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  out, n = models.generate(model, jnp.asarray(ids),
                           jnp.full((ids.shape[0],), ids.shape[1]),
                           want.shape[1], ssm_mode=ssm_mode)
  np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(np.asarray(n), want.shape[1])


def test_speculative_verify_path_equals_transformers(loaded):
  """The target's verify windows (the model as its own draft) give
  transformers' greedy tokens."""
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  out = models.speculative_generate(
      model, models.DraftModelProposer(model), jnp.asarray(ids),
      jnp.full((ids.shape[0],), ids.shape[1]), want.shape[1], 3)[0]
  np.testing.assert_array_equal(np.asarray(out), want)


def test_layer_pattern_and_numerics_fields():
  d = fixture_dir("granite_hybrid_dense")
  with open(os.path.join(d, "config.json")) as f:
    cfg, arch = hf.config_from_hf(json.load(f))
  assert arch == "GraniteMoeHybridForCausalLM"
  assert cfg.pattern == "M-M-*-M-*-M-"  # layer i: blocks 2i (mixer), 2i+1
  assert cfg.rope_theta is None  # position_embedding_type "nope"
  assert (cfg.embedding_multiplier, cfg.residual_multiplier,
          cfg.attention_multiplier, cfg.logits_scaling) == (12.0, 0.22, 0.15,
                                                            2.0)
  d = fixture_dir("bamba")
  with open(os.path.join(d, "config.json")) as f:
    cfg, arch = hf.config_from_hf(json.load(f))
  assert arch == "BambaForCausalLM"
  assert cfg.pattern == "M-M-*-M-*-M-"  # attn_layer_indices [2, 4]
  assert cfg.rotary_dim == cfg.attn_head_dim // 2  # partial_rotary 0.5
  assert cfg.attention_multiplier is None


# ------------------------------------------ numerics on every path (no HF)
SCALED = ModelConfig(
    vocab_size=64, d_model=32, pattern="M-*-M-", ssm_heads=4, head_dim=16,
    d_state=8, n_groups=2, chunk_size=4, num_heads=4, num_kv_heads=2,
    attn_head_dim=8, rope_theta=1e4, rotary_dim=4, intermediate_size=48,
    mlp_activation="swiglu", embedding_multiplier=3.0,
    residual_multiplier=0.4, attention_multiplier=0.7, logits_scaling=1.7)


def test_scaled_config_prefill_step_equal_full_forward():
  """With every Granite / Bamba field set, prefill then decode steps give
  the full forward's logits (each field is used on both paths)."""
  model = models.HybridLM(SCALED, rngs=nnx.Rngs(3))
  toks = jax.random.randint(jax.random.PRNGKey(0), (2, 10), 0, 64)
  full = np.asarray(model(toks))
  for mode in ("replay", "baseline"):
    state = model.init_state(2, 16, ssm_mode=mode, buffer_len=4)
    last, state = models.prefill(model, toks[:, :6], jnp.full((2,), 6), state)
    got = [np.asarray(last)]
    for t in range(6, 10):
      lg, state = models.decode_step(model, toks[:, t], state)
      got.append(np.asarray(lg))
    np.testing.assert_allclose(np.stack(got, 1), full[:, 5:], atol=2e-4,
                               rtol=2e-4)


def test_default_fields_keep_the_graph():
  """The fields at their defaults leave the model as before (the scaling
  code is skipped): same logits as a config without them."""
  base = SCALED.replace(embedding_multiplier=1.0, residual_multiplier=1.0,
                        attention_multiplier=None, logits_scaling=1.0,
                        rotary_dim=None)
  explicit = base.replace(attention_multiplier=8 ** -0.5, rotary_dim=8)
  toks = jnp.arange(12).reshape(2, 6)
  a = models.HybridLM(base, rngs=nnx.Rngs(1))(toks)
  b = models.HybridLM(explicit, rngs=nnx.Rngs(1))(toks)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("embedding_multiplier", 0.0), ("residual_multiplier", -1.0),
    ("logits_scaling", float("inf")), ("attention_multiplier", True),
    ("rotary_dim", 3), ("rotary_dim", 10)])
def test_bad_numerics_fields_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
    SCALED.replace(**{field: value})


# ------------------------------------------------------------- refusals
GRANITE = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid", "hidden_size": 32, "vocab_size": 96,
    "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2,
    "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16,
    "mamba_n_groups": 2, "mamba_expand": 2, "shared_intermediate_size": 48,
    "num_local_experts": 0, "position_embedding_type": "rope",
    "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
    "time_step_limit": [0.0, {"__float__": "Infinity"}]}
BAMBA = {
    "architectures": ["BambaForCausalLM"], "model_type": "bamba",
    "hidden_size": 32, "vocab_size": 96, "num_hidden_layers": 3,
    "attn_layer_indices": [1], "num_attention_heads": 4,
    "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 8,
    "mamba_d_state": 16, "mamba_expand": 2, "intermediate_size": 64,
    "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                        "partial_rotary_factor": 0.5}}


def test_synthetic_configs_read():
  cfg, _ = hf.config_from_hf(GRANITE)
  assert cfg.pattern == "M-*-" and cfg.rope_theta == 1e4
  assert cfg.rotary_dim is None and cfg.mlp_activation == "swiglu"
  cfg, _ = hf.config_from_hf({**BAMBA, "architectures": None})  # model_type
  assert cfg.pattern == "M-*-M-" and cfg.rotary_dim == 4


def test_granite_moe_config_maps_onto_the_moe_block():
  cfg, _ = hf.config_from_hf({**GRANITE, "num_local_experts": 4,
                              "num_experts_per_tok": 2,
                              "intermediate_size": 16})
  assert cfg.pattern == "ME*E"
  assert (cfg.n_routed_experts, cfg.num_experts_per_tok,
          cfg.moe_intermediate_size,
          cfg.moe_shared_expert_intermediate_size) == (4, 2, 16, 48)
  assert (cfg.moe_router, cfg.moe_activation, cfg.norm_topk_prob,
          cfg.moe_router_bias) == ("softmax_topk", "swiglu", False, False)


@pytest.mark.parametrize("base,key,value", [
    (GRANITE, "num_local_experts", 0.5),
    (GRANITE, "position_embedding_type", "alibi"),
    (GRANITE, "layer_types", ["mamba", "moe"]),
    (GRANITE, "layer_types", [["mamba"], "attention"]),
    (GRANITE, "layer_types", ["mamba"]),
    (GRANITE, "hidden_act", "gelu"),
    (GRANITE, "time_step_limit", [0.0, 0.1]),
    (GRANITE, "time_step_limit", [0.001, {"__float__": "Infinity"}]),
    (GRANITE, "mamba_proj_bias", True),
    (GRANITE, "mamba_conv_bias", False),
    (GRANITE, "attention_bias", True),
    (GRANITE, "logits_scaling", 0),
    (GRANITE, "rope_parameters", {"rope_theta": 1e4, "rope_type": "yarn"}),
    (GRANITE, "rope_parameters", {"rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}),
    (BAMBA, "attn_layer_indices", [3]),
    (BAMBA, "mlp_bias", True),
    (BAMBA, "rope_parameters", {"rope_theta": 1e4,
                                "partial_rotary_factor": 0.25 + 0.125}),
    (BAMBA, "mamba_d_head", 5),
])
def test_unsupported_keys_are_value_errors_naming_them(base, key, value):
  hf_dict = copy.deepcopy(base)
  hf_dict[key] = value
  with pytest.raises(ValueError, match=key.split(".")[0]):
    hf.config_from_hf(hf_dict)


def test_bad_tensors_listed(tmp_path):
  """A checkpoint missing a tensor / with a wrong shape: every one named."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  cfg, _ = hf.config_from_hf(GRANITE)
  model = models.HybridLM(cfg, rngs=nnx.Rngs(0))
  tensors = hf_tensors.export_tensors(model, hf_granite.tensor_map(cfg))
  tensors.pop("model.layers.1.self_attn.k_proj.weight")
  tensors["model.layers.0.shared_mlp.input_linear.weight"] = np.zeros(
      (95, 32), np.float32)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(GRANITE, f)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="layers.1.self_attn.k_proj"):
    hf.from_pretrained(str(tmp_path))
  tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros(
      (16, 32), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"input_linear.weight: expected "
                     r"\(96, 32\), got \(95, 32\)"):
    hf.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("family,base", [
    (hf_granite, GRANITE), (hf_bamba, BAMBA),
    (hf_granite, {**GRANITE, "num_local_experts": 4,
                  "intermediate_size": 16})])
def test_export_load_round_trip(tmp_path, family, base):
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  cfg, _ = hf.config_from_hf(base)
  model = models.HybridLM(cfg, rngs=nnx.Rngs(5))
  tmap = family.tensor_map(cfg)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(base, f)
  save_file(hf_tensors.export_tensors(model, tmap),
            str(tmp_path / "model.safetensors"))
  loaded = hf.from_pretrained(str(tmp_path))
  toks = jnp.arange(10).reshape(2, 5)
  np.testing.assert_array_equal(np.asarray(model(toks)),
                                np.asarray(loaded(toks)))
