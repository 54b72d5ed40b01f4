"""Qwen3.5 (text) and Qwen3-Next checkpoints: `from_pretrained` against
transformers' outputs (tests/fixtures/hf/qwen3_5 and qwen3_next: config.json,
model.safetensors and expected.npz with the prompt tokens, transformers'
float32 logits and greedy tokens), the multimodal directory layout, the
tensor map's round trip, and the refusals of what is not implemented."""

import copy
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from replayssm_jax import models
from replayssm_jax.models import hf, hf_qwen, hf_tensors
from tests.hf_common import fixture_dir

PARITY = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


def read_config(name):
  with open(os.path.join(fixture_dir(name), "config.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module", params=PARITY)
def loaded(request):
  d = fixture_dir(request.param)
  return hf.from_pretrained(d), dict(np.load(os.path.join(d, "expected.npz")))


def rel_err(a, b):
  return np.abs(np.asarray(a) - b).max() / np.abs(b).max()


def test_full_forward_logits_equal_transformers(loaded):
  model, exp = loaded
  logits = np.asarray(model(jnp.asarray(exp["input_ids"])))
  assert logits.shape == exp["logits"].shape
  assert rel_err(logits, exp["logits"]) <= 1e-4


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_greedy_generate_equals_transformers(loaded, ssm_mode):
  """Prefill, then decode steps (replay buffer_len 3: flushes on the way)."""
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  out, n = models.generate(model, jnp.asarray(ids),
                           jnp.full((ids.shape[0],), ids.shape[1]),
                           want.shape[1], ssm_mode=ssm_mode, buffer_len=3)
  np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(np.asarray(n), want.shape[1])


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_speculative_generate_equals_transformers(loaded, ssm_mode):
  """The target's verify windows (the model as its own draft) give
  transformers' greedy tokens."""
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  out = models.speculative_generate(
      model, models.DraftModelProposer(model), jnp.asarray(ids),
      jnp.full((ids.shape[0],), ids.shape[1]), want.shape[1], 3,
      ssm_mode=ssm_mode, buffer_len=4)[0]
  np.testing.assert_array_equal(np.asarray(out), want)


def test_layer_pattern_and_fields():
  cfg, arch = hf.config_from_hf(read_config("qwen3_5"))
  assert arch == "Qwen3_5ForCausalLM"
  assert cfg.pattern == "G-G-*-G-"  # layer i: blocks 2i (mixer), 2i+1
  assert cfg.tie_embeddings and cfg.rotary_dim == 4  # 0.25 * head_dim 16
  assert (cfg.gdn_num_k_heads, cfg.gdn_num_v_heads, cfg.gdn_k_dim,
          cfg.gdn_v_dim) == (2, 4, 8, 8)
  assert cfg.attn_qk_norm and cfg.attn_output_gate
  cfg, arch = hf.config_from_hf(read_config("qwen3_next"))
  assert arch == "Qwen3NextForCausalLM"
  assert cfg.pattern == "GEG-*EGE"  # mlp_only_layers [1]
  assert (cfg.moe_router, cfg.n_routed_experts, cfg.num_experts_per_tok,
          cfg.moe_shared_expert_gate) == ("softmax", 4, 2, True)
  cfg, arch = hf.config_from_hf(read_config("qwen3_5_moe"))
  assert arch == "Qwen3_5MoeForCausalLM"
  assert cfg.pattern == "GEGE*EGE" and cfg.norm_topk_prob


def test_published_config_forms():
  """Keys the published configs carry: Qwen3.5's multimodal RoPE section
  and attn_output_gate, Qwen3-Next's top-level rope_theta /
  partial_rotary_factor (transformers 4's form)."""
  c = read_config("qwen3_5")
  c["rope_parameters"].update(mrope_section=[11, 11, 10],
                              mrope_interleaved=True)
  c.update(attn_output_gate=True, mtp_num_hidden_layers=1,
           mamba_ssm_dtype="float32")
  assert hf.config_from_hf(c)[0] == hf.config_from_hf(
      read_config("qwen3_5"))[0]
  c = read_config("qwen3_next")
  rp = c.pop("rope_parameters")
  c.update(rope_theta=rp["rope_theta"], rope_scaling=None,
           partial_rotary_factor=0.25, use_sliding_window=False)
  assert hf.config_from_hf(c)[0] == hf.config_from_hf(
      read_config("qwen3_next"))[0]


def test_layer_types_from_full_attention_interval():
  c = read_config("qwen3_5")
  del c["layer_types"]
  c.update(num_hidden_layers=6, full_attention_interval=3)
  cfg, _ = hf.config_from_hf(c)
  assert cfg.pattern == "G-G-*-G-G-*-"
  c = read_config("qwen3_next")
  del c["mlp_only_layers"]
  c["decoder_sparse_step"] = 2
  assert hf.config_from_hf(c)[0].pattern == "G-GE*-GE"


def test_conditional_generation_directory_loads_its_text_model(tmp_path):
  """A Qwen3_5ForConditionalGeneration directory (text_config, tensors
  under model.language_model., a vision tower and mtp tensors) loads the
  same text model as the Qwen3_5ForCausalLM one."""
  src = fixture_dir("qwen3_5")
  text = read_config("qwen3_5")
  cj = {"architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5", "tie_word_embeddings": True,
        "text_config": dict(text, architectures=None), "vision_config": {
            "depth": 1, "hidden_size": 16, "model_type": "qwen3_5_vision"}}
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cj, f)
  tensors = {k.replace("model.", "model.language_model.", 1): v
             for k, v in load_file(os.path.join(
                 src, "model.safetensors")).items()}
  tensors["model.visual.patch_embed.proj.weight"] = np.ones((4, 3),
                                                            np.float32)
  tensors["mtp.fc.weight"] = np.ones((2, 2), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  exp = np.load(os.path.join(src, "expected.npz"))
  model = hf.from_pretrained(str(tmp_path))
  logits = model(jnp.asarray(exp["input_ids"]))
  assert rel_err(logits, exp["logits"]) <= 1e-4
  cj.pop("text_config")
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cj, f)
  with pytest.raises(ValueError, match="text_config"):
    hf.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("case", PARITY)
def test_tensor_map_round_trip(case):
  """Exporting the loaded model under the tensor map gives the checkpoint's
  tensors back as `pack_tensors` lays them out (1 + w norms)."""
  d = fixture_dir(case)
  model = hf.from_pretrained(d)
  tensors = hf_qwen.pack_tensors(model.config, load_file(
      os.path.join(d, "model.safetensors")))
  out = hf_tensors.export_tensors(model, hf_qwen.tensor_map(model.config))
  assert sorted(out) == sorted(tensors)
  for name, arr in tensors.items():
    np.testing.assert_allclose(out[name], arr, atol=1e-6, err_msg=name)


# ------------------------------------------------------------- refusals
@pytest.mark.parametrize("case,edit,match", [
    ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3_5", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3_5", {"attn_output_gate": False}, "attn_output_gate=False"),
    ("qwen3_next", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3_5", {"layer_types": ["linear_attention", "sliding_attention",
                                 "full_attention", "linear_attention"]},
     "'sliding_attention'"),
    ("qwen3_5", {"layer_types": ["linear_attention"]}, "layer_types"),
    ("qwen3_5", {"rope_parameters": {"rope_type": "yarn",
                                     "rope_theta": 1e4}}, "'yarn'"),
    ("qwen3_5", {"rope_parameters": {"rope_type": "default",
                                     "rope_theta": 1e4,
                                     "partial_rotary_factor": 0.1}},
     "partial_rotary_factor=0.1"),
    ("qwen3_5", {"linear_num_key_heads": 3},
     "linear_num_key_heads=3 must divide linear_num_value_heads=4"),
    ("qwen3_5", {"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ("qwen3_5", {"num_hidden_layers": None}, "num_hidden_layers"),
    ("qwen3_next", {"num_experts": -2}, "num_experts"),
    ("qwen3_next", {"mlp_only_layers": "all"}, "mlp_only_layers"),
    ("qwen3_next", {"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ("qwen3_next", {"architectures": ["Qwen3MoeForCausalLM"]},
     "Qwen3MoeForCausalLM"),
])
def test_unsupported_config_names_key(case, edit, match):
  c = copy.deepcopy(read_config(case))
  c.update(edit)
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(c)


def test_wrong_tensor_shapes_and_names_are_listed(tmp_path):
  src = fixture_dir("qwen3_next")
  with open(os.path.join(src, "config.json")) as f:
    cj = json.load(f)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(cj, f)
  good = load_file(os.path.join(src, "model.safetensors"))
  for edit, match in (
      ({"model.layers.0.linear_attn.in_proj_qkvz.weight": np.zeros(
          (95, 32), np.float32)},
       r"layers.0.linear_attn.in_proj_qkvz.weight: expected \(96, 32\), "
       r"got \(95, 32\)"),
      ({"model.layers.3.linear_attn.in_proj_ba.weight": None},
       r"missing \['model.layers.3.linear_attn.in_proj_ba.weight'\]"),
      ({"model.layers.2.self_attn.k_norm.weight": None},
       "self_attn.k_norm.weight"),
      ({"model.layers.2.self_attn.q_proj.weight": np.zeros(
          (64, 32), np.float32)},
       r"q_proj.weight: expected \(128, 32\), got \(64, 32\)")):
    tensors = dict(good)
    for k, v in edit.items():
      if v is None:
        del tensors[k]
      else:
        tensors[k] = v
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
      hf.from_pretrained(str(tmp_path))


def test_softmax_router():
  """route(router="softmax"): the softmax over all experts, its top k,
  renormalised with norm_topk_prob (Qwen3-Next / Qwen3.5-MoE)."""
  from replayssm_jax.models.moe import route
  logits = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  idx = np.argsort(-p, -1)[:, :2]
  top = np.take_along_axis(p, idx, -1)
  for norm, want in ((False, top), (True, top / top.sum(-1, keepdims=True))):
    w, e = route(jnp.asarray(logits), top_k=2, router="softmax",
                 norm_topk_prob=norm)
    np.testing.assert_array_equal(np.asarray(e), idx)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
