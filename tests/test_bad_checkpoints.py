"""Broken checkpoints and mismatched states get errors that name the file,
key, argument or layer and say what was expected."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from safetensors.numpy import save_file

from replayssm_jax import PrecisionPolicy
from replayssm_jax.models import from_pretrained, hf
from replayssm_jax.models import model as M
from tests.test_models import make_model

NEMOTRON = dict(rope_theta=None, mlp_activation="relu2")


@pytest.fixture(scope="module")
def model():
  return make_model(0, **NEMOTRON)


@pytest.fixture
def ckpt(tmp_path, model):
  save_file(hf.export_hf_tensors(model), str(tmp_path / "model.safetensors"))
  cfg = hf.hf_config_dict(model.config, "NemotronHForCausalLM")
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  return tmp_path, cfg


def test_a_good_checkpoint_loads(ckpt, model):
  loaded = from_pretrained(str(ckpt[0]))
  assert loaded.config.pattern == model.config.pattern


def test_truncated_config_names_the_file(ckpt):
  d, cfg = ckpt
  (d / "config.json").write_text(json.dumps(cfg)[:40])
  with pytest.raises(ValueError, match=rf"{d}/config.json: not valid JSON"):
    from_pretrained(str(d))


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", "32", "hidden_size must be a positive int, got '32'"),
    ("mamba_num_heads", None, "the key 'mamba_num_heads' is required"),
    ("hybrid_override_pattern", 5, "hybrid_override_pattern must be a "
     "string")])
def test_bad_config_values_name_the_key(ckpt, key, value, match):
  d, cfg = ckpt
  cfg = dict(cfg)
  if value is None:
    del cfg[key]
  else:
    cfg[key] = value
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=rf"{d}/config.json: {match}"):
    from_pretrained(str(d))


def test_truncated_safetensors_names_the_file(ckpt):
  d, _ = ckpt
  path = d / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=rf"{path}: not a readable "
                     r"safetensors file"):
    from_pretrained(str(d))


def test_missing_config_names_the_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=rf"{tmp_path}/config.json"):
    from_pretrained(str(tmp_path))


def test_preset_of_a_non_string_is_a_type_error():
  with pytest.raises(TypeError, match="name must be a preset name"):
    PrecisionPolicy.preset(None)


def test_a_state_of_another_model_is_refused(model):
  other = make_model(0, **NEMOTRON, ssm_heads=8, head_dim=4)
  with pytest.raises(ValueError, match=r"state.layers\[0\].ssm.checkpoint "
                     r"\[nheads, headdim, dstate\] has sizes \(8, 4, 8\), "
                     r"the model's mamba layer 0 expects \(4, 8, 8\)"):
    M.decode_step(model, jnp.array([1, 2]), other.init_state(2, 16))


def test_layer_states_out_of_order_are_refused(model):
  state = model.init_state(2, 16)
  permuted = state.replace(layers=state.layers[::-1])
  with pytest.raises(ValueError, match=r"state.layers\[\d\] is of type "
                     r"\w+, but the model's layer \d is a \w+ block"):
    M.decode_step(model, jnp.array([1, 2]), permuted)
