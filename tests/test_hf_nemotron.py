"""NemotronH checkpoints written by transformers: logits and greedy decoding
equal to transformers' (tests/fixtures/hf/<name>/expected.npz), both config
forms, MoE round trips through the exporter, and refusals naming the key."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from replayssm_jax import models
from replayssm_jax.models import hf
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.testing import max_rel_error
from tests.hf_common import fixture_dir

NAMES = ("nemotron_h", "nemotron_h_legacy_config", "nemotron_h_moe",
         "nemotron_h_moe_latent")


def _fixture(name):
  d = fixture_dir(name)
  return d, np.load(os.path.join(d, "expected.npz"))


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
  d, z = _fixture(name)
  model = models.from_pretrained(d)
  logits = model(jnp.asarray(z["input_ids"], jnp.int32))
  assert max_rel_error(logits, z["logits"]) <= 1e-4


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(name, ssm_mode):
  d, z = _fixture(name)
  model = models.from_pretrained(d)
  ids = jnp.asarray(z["input_ids"], jnp.int32)
  b, t = ids.shape
  toks, lens = models.generate(model, ids, jnp.full((b,), t, jnp.int32),
                               z["greedy"].shape[1], ssm_mode=ssm_mode,
                               buffer_len=4)
  np.testing.assert_array_equal(np.asarray(toks), z["greedy"])
  assert (np.asarray(lens) == z["greedy"].shape[1]).all()


def test_config_forms_agree():
  """NVIDIA's hybrid_override_pattern form and transformers 5's
  layers_block_type / layer_types (legacy names too) read the same."""
  base = dict(architectures=["NemotronHForCausalLM"], hidden_size=32,
              vocab_size=64, mamba_num_heads=4, mamba_head_dim=16,
              ssm_state_size=8, mamba_n_groups=2, mamba_d_conv=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              n_routed_experts=4, moe_intermediate_size=8,
              moe_shared_expert_intermediate_size=8, num_experts_per_tok=2)
  forms = [dict(hybrid_override_pattern="M*-E"),
           dict(layers_block_type=["linear_attention", "full_attention",
                                   "mlp", "moe"]),
           dict(layer_types=["mamba", "attention", "mlp", "moe"])]
  cfgs = [hf.config_from_hf({**base, **f})[0] for f in forms]
  assert all(c == cfgs[0] for c in cfgs)
  assert cfgs[0].pattern == "M*-E" and cfgs[0].n_groups == 2
  assert cfgs[0].n_routed_experts == 4


def _moe_model(**kw):
  base = dict(vocab_size=64, d_model=32, pattern="ME*-E", ssm_heads=4,
              head_dim=8, d_state=8, n_groups=2, chunk_size=4, num_heads=4,
              num_kv_heads=2, attn_head_dim=8, rope_theta=None,
              intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
              n_group=4, topk_group=2, routed_scaling_factor=2.5)
  base.update(kw)
  return models.HybridLM(ModelConfig(**base), rngs=nnx.Rngs(0))


def _write(directory, model, layer_types=False, tensors=None):
  os.makedirs(directory, exist_ok=True)
  cfg = hf.hf_config_dict(model.config, "NemotronHForCausalLM", layer_types)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg, f)
  save_file(hf.export_hf_tensors(model) if tensors is None else tensors,
            os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("latent,layer_types", [(None, False), (12, True)])
def test_moe_export_round_trip(tmp_path, latent, layer_types):
  model = _moe_model(moe_latent_size=latent)
  _write(str(tmp_path), model, layer_types)
  names = set(hf.export_hf_tensors(model))
  assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in names
  assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in names
  loaded = models.from_pretrained(str(tmp_path))
  assert loaded.config == model.config
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 64)
  np.testing.assert_array_equal(np.asarray(loaded(tokens)),
                                np.asarray(model(tokens)))


def test_stacked_experts_and_model_prefix(tmp_path):
  """transformers 5's in-memory names (model. prefix, stacked experts)
  load as well."""
  model = _moe_model()
  t = hf.export_hf_tensors(model)
  out = {}
  for name, arr in t.items():
    name = name.replace("backbone.", "model.", 1)
    if ".experts." in name:
      head, rest = name.split(".experts.")
      j, proj = rest.split(".")[:2]
      key = f"{head}.experts.{proj}"
      out.setdefault(key, {})[int(j)] = arr
    else:
      out[name] = arr
  out = {k: (np.stack([v[j] for j in sorted(v)]) if isinstance(v, dict)
             else v) for k, v in out.items()}
  _write(str(tmp_path), model, tensors=out)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 5), 0, 64)
  np.testing.assert_array_equal(
      np.asarray(models.from_pretrained(str(tmp_path))(tokens)),
      np.asarray(model(tokens)))


@pytest.mark.parametrize("change,key", [
    (dict(layers_block_type=["linear_attention", "sliding_attention"]),
     "layers_block_type"),
    (dict(hybrid_override_pattern="M*X"), "hybrid_override_pattern"),
    (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (dict(time_step_limit=[0.0, 0.5]), "time_step_limit"),
    (dict(mamba_dt_limit=[0.01, {"__float__": "Infinity"}]),
     "mamba_dt_limit"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act"),
    (dict(mamba_hidden_act="relu"), "mamba_hidden_act"),
    (dict(sliding_window=128), "sliding_window"),
    (dict(use_conv_bias=False), "use_conv_bias"),
    (dict(n_group=3), "n_group"),
])
def test_refusals_name_the_key(tmp_path, change, key):
  model = _moe_model()
  _write(str(tmp_path), model)
  with open(tmp_path / "config.json") as f:
    cfg = json.load(f)
  if "layers_block_type" in change:
    cfg.pop("hybrid_override_pattern")
  cfg.update(change)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError, match=key):
    models.from_pretrained(str(tmp_path))


def test_default_dt_limit_accepted():
  """[0, inf] (no clamp), as JSON Infinity or transformers' tagged float."""
  base = hf.hf_config_dict(_moe_model().config, "NemotronHForCausalLM")
  for lim in ([0.0, float("inf")], [0.0, {"__float__": "Infinity"}]):
    hf.config_from_hf({**base, "time_step_limit": lim})


def test_missing_pattern_is_a_value_error():
  base = hf.hf_config_dict(_moe_model().config, "NemotronHForCausalLM")
  base.pop("hybrid_override_pattern")
  with pytest.raises(ValueError, match="hybrid_override_pattern"):
    hf.config_from_hf(base)


def test_expert_stacking_checks_and_pairs():
  """hf_tensors' stacking (every MoE reader's): experts 0 .. E-1 of one
  shape or a ValueError naming the tensors; gate and up stacked as one
  [E, 2I, d] of [gate; up] rows, a shared expert's halves fused."""
  from replayssm_jax.models import hf_tensors as T  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  w = lambda *s: rng.standard_normal(s).astype(np.float32)
  with pytest.raises(ValueError, match=r"m\.experts\.\*\.up\.weight holds "
                     r"experts \[0, 2\], expected 0 \.\. 1"):
    T.stack_experts("m.experts", "up", {0: w(3, 2), 2: w(3, 2)})
  with pytest.raises(ValueError, match="different shapes"):
    T.stack_experts("m.experts", "up", {0: w(3, 2), 1: w(2, 2)})
  g, u, d = [w(3, 2), w(3, 2)], [w(3, 2), w(3, 2)], [w(2, 3), w(2, 3)]
  sg, su = w(4, 2), w(4, 2)
  out = {"m.shared.gate_proj.weight": sg, "m.shared.up_proj.weight": su}
  T.stack_gated_experts(
      {"m.experts": {"g": dict(enumerate(g)), "u": dict(enumerate(u)),
                     "d": dict(enumerate(d))}}, out, "g", "u", "d", "shared")
  assert sorted(out) == ["m.experts.down_proj", "m.experts.gate_up_proj",
                         "m.shared.gate_up_proj.weight"]
  np.testing.assert_array_equal(out["m.experts.gate_up_proj"][1],
                                np.concatenate([g[1], u[1]]))
  np.testing.assert_array_equal(out["m.experts.down_proj"], np.stack(d))
  np.testing.assert_array_equal(out["m.shared.gate_up_proj.weight"],
                                np.concatenate([sg, su]))
  with pytest.raises(ValueError, match=r"m\.experts\.\*\.g and u differ"):
    T.stack_gated_experts({"m.experts": {"g": {0: w(3, 2)},
                                         "u": {0: w(4, 2)}}}, {}, "g", "u",
                          "d", "shared")
