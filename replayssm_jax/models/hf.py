"""Hugging Face checkpoints: `Mamba2ForCausalLM` and `NemotronHForCausalLM`
(NemotronH's config forms and MoE tensors: `hf_nemotron`), Granite 4.0
hybrid and Bamba (`hf_granite`, `hf_bamba`), Qwen3.5 / Qwen3.5-MoE text
and Qwen3-Next (`hf_qwen`), Kimi Linear (`hf_kimi`).

`from_pretrained(directory)` reads config.json and the *.safetensors files
(one file or sharded with model.safetensors.index.json) and returns a ready
`HybridLM`. Tensor names and layouts are those of transformers:

  backbone.embeddings.weight                   [vocab, d]
  backbone.layers.{i}.norm.weight              [d]
  backbone.layers.{i}.mixer.in_proj.weight     [in_proj_dim, d]   (Mamba)
  backbone.layers.{i}.mixer.conv1d.weight      [conv_dim, 1, k]
  backbone.layers.{i}.mixer.conv1d.bias        [conv_dim]
  backbone.layers.{i}.mixer.{A_log, D, dt_bias} [H]
  backbone.layers.{i}.mixer.norm.weight        [d_inner]
  backbone.layers.{i}.mixer.out_proj.weight    [d, d_inner]
  backbone.layers.{i}.mixer.{q,k,v,o}_proj.weight                 (attention)
  backbone.layers.{i}.mixer.{up,down}_proj.weight                 (MLP)
  backbone.layers.{i}.mixer.{gate, experts, shared_experts}...    (MoE)
  backbone.norm_f.weight                       [d]
  lm_head.weight                               [vocab, d] (absent if tied)

Linear weights are stored [out, in] there and [in, out] here.
`export_hf_tensors` / `hf_config_dict` write the same layout (tests use them
to build synthetic checkpoints).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models import (hf_bamba, hf_granite, hf_kimi,
                                  hf_nemotron, hf_qwen)
from replayssm_jax.models import hf_tensors
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.model import HybridLM

# Architectures read by their own module (its config_from_hf and
# tensor_map).
FAMILIES = {m.ARCHITECTURE: m for m in (hf_granite, hf_bamba, hf_kimi)}
FAMILIES.update({a: hf_qwen for a in hf_qwen.ARCHITECTURES})
ARCHITECTURES = ("Mamba2ForCausalLM", "NemotronHForCausalLM") + tuple(
    FAMILIES)
MODEL_TYPES = {"mamba2": "Mamba2ForCausalLM",
               "nemotron_h": "NemotronHForCausalLM",
               **{m.MODEL_TYPE: m.ARCHITECTURE for m in (hf_granite,
                                                         hf_bamba, hf_kimi)},
               **hf_qwen.MODEL_TYPES}

_LINEARS = {
    "mamba": ("in_proj", "out_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


def tensor_map(cfg: ModelConfig) -> dict[str, tuple[tuple, str]]:
  """HF tensor name -> (parameter path in HybridLM, transform).

  Transforms: `hf_tensors`' ("id", "T", "T3", "conv", "gate" / "up").
  """
  m = {"backbone.embeddings.weight": (("embeddings", "weight"), "id"),
       "backbone.norm_f.weight": (("norm_f", "weight"), "id")}
  if not cfg.tie_embeddings:
    m["lm_head.weight"] = (("lm_head", "kernel"), "T")
  for i, kind in enumerate(cfg.block_kinds):
    hf = f"backbone.layers.{i}."
    me = ("blocks", i)
    m[hf + "norm.weight"] = (me + ("norm", "weight"), "id")
    mx = me + ("mixer",)
    if kind == "moe":
      m.update(hf_nemotron.moe_tensor_map(cfg, hf, mx))
      continue
    if kind == "mlp" and cfg.mlp_activation == "swiglu":
      m.update(hf_tensors.swiglu_tensors(hf + "mixer.", mx))
      continue
    names = ("up_proj", "down_proj") if kind == "mlp" else _LINEARS[kind]
    for n in names:
      m[hf + f"mixer.{n}.weight"] = (mx + (n, "kernel"), "T")
    if kind == "mamba":
      m[hf + "mixer.conv1d.weight"] = (mx + ("conv_weight",), "conv")
      m[hf + "mixer.conv1d.bias"] = (mx + ("conv_bias",), "id")
      for n in ("A_log", "D", "dt_bias"):
        m[hf + f"mixer.{n}"] = (mx + (n,), "id")
      m[hf + "mixer.norm.weight"] = (mx + ("norm", "weight"), "id")
  return m


# ------------------------------------------------------------- configs
_REQUIRED = object()


def _get(d: dict, *keys, default=_REQUIRED, kind=None):
  """The first of `keys` set in config.json (d), else `default`; a
  missing required key or a value of the wrong kind is a ValueError naming
  the key. kind: "int" (a positive integer), "float" or None (as is)."""
  for k in keys:
    if k in d and d[k] is not None:
      v, key = d[k], k
      break
  else:
    if default is _REQUIRED:
      raise ValueError(f"config.json: the key {' or '.join(map(repr, keys))}"
                       f" is required and missing.")
    v, key = default, keys[0]
  if kind == "int":
    return V.positive_int(f"config.json: {key}", v)
  if kind == "float" and (isinstance(v, bool)
                          or not isinstance(v, (int, float))):
    raise ValueError(f"config.json: {key} must be a number, got {v!r}.")
  return v


def config_from_hf(hf: dict[str, Any], dtype: str = "float32",
                   param_dtype: str | None = None) -> tuple[ModelConfig, str]:
  """(ModelConfig, architecture) from a parsed config.json."""
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type"))
  if arch not in ARCHITECTURES:
    raise ValueError(f"config.json: architecture must be one of "
                     f"{ARCHITECTURES}, got {archs or hf.get('model_type')!r}.")
  if arch in FAMILIES:
    return FAMILIES[arch].config_from_hf(hf, dtype, param_dtype), arch
  param_dtype = dtype if param_dtype is None else param_dtype
  d = _get(hf, "hidden_size", kind="int")
  common = dict(vocab_size=_get(hf, "vocab_size", kind="int"), d_model=d,
                chunk_size=_get(hf, "chunk_size", "mamba_chunk_size",
                                default=256, kind="int"),
                conv_kernel=_get(hf, "conv_kernel", "mamba_d_conv", default=4,
                                 kind="int"),
                n_groups=_get(hf, "n_groups", "mamba_n_groups", default=1,
                              kind="int"),
                norm_eps=float(_get(hf, "layer_norm_epsilon", "rms_norm_eps",
                                    default=1e-5, kind="float")),
                dtype=dtype, param_dtype=param_dtype)
  if arch == "Mamba2ForCausalLM":
    for key, ok in (("use_bias", False), ("use_conv_bias", True)):
      if hf.get(key, ok) != ok:
        raise ValueError(f"config.json: {key}={hf[key]!r} is not supported "
                         f"(only {ok}).")
    heads = _get(hf, "num_heads", kind="int")
    hdim = _get(hf, "head_dim", kind="int")
    expand = _get(hf, "expand", default=2, kind="int")
    if heads * hdim != expand * d:
      raise ValueError(f"config.json: num_heads * head_dim ({heads * hdim}) "
                       f"!= expand * hidden_size ({expand * d}).")
    cfg = ModelConfig(pattern="M" * _get(hf, "num_hidden_layers",
                                         kind="int"), ssm_heads=heads,
                      head_dim=hdim, d_state=_get(hf, "state_size",
                                                  kind="int"),
                      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                      **common)
    return cfg, arch
  return hf_nemotron.config(hf, common, _get), arch


def hf_config_dict(cfg: ModelConfig, architecture: str,
                   layer_types: bool = False) -> dict[str, Any]:
  """A config.json dict that `config_from_hf` maps back to `cfg` (dtypes
  aside); NemotronH: `layer_types` writes transformers 5's
  layers_block_type instead of hybrid_override_pattern."""
  if architecture == "Mamba2ForCausalLM":
    if set(cfg.pattern) != {"M"}:
      raise ValueError("Mamba2ForCausalLM needs an all-'M' pattern.")
    if cfg.d_inner % cfg.d_model:
      raise ValueError("Mamba2ForCausalLM needs d_inner = expand * d_model.")
    return dict(architectures=[architecture], model_type="mamba2",
                hidden_size=cfg.d_model, num_heads=cfg.ssm_heads,
                head_dim=cfg.head_dim, expand=cfg.d_inner // cfg.d_model,
                state_size=cfg.d_state, n_groups=cfg.n_groups,
                conv_kernel=cfg.conv_kernel, chunk_size=cfg.chunk_size,
                vocab_size=cfg.vocab_size, num_hidden_layers=cfg.n_layers,
                layer_norm_epsilon=cfg.norm_eps, use_bias=False,
                use_conv_bias=True, tie_word_embeddings=cfg.tie_embeddings)
  if architecture == "NemotronHForCausalLM":
    return hf_nemotron.config_dict(cfg, layer_types)
  raise ValueError(f"architecture must be one of {ARCHITECTURES}, got "
                   f"{architecture!r}.")


# ------------------------------------------------------------- tensors
def export_hf_tensors(model: HybridLM) -> dict[str, np.ndarray]:
  """The model's parameters under their HF names and layouts (numpy; MoE
  experts one tensor per expert, as NVIDIA's checkpoints)."""
  return hf_nemotron.unpack_tensors(
      hf_tensors.export_tensors(model, tensor_map(model.config)))


def _read_tensors(directory: str) -> dict[str, Any]:
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  index = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      try:
        files = sorted(set(json.load(f)["weight_map"].values()))
      except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"{index}: expected a JSON object with a "
                         f"'weight_map' of tensor name -> file, got "
                         f"{type(e).__name__}: {e}") from None
  else:
    files = sorted(f for f in os.listdir(directory)
                   if f.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no *.safetensors files in {directory!r}.")
  tensors = {}
  for fn in files:
    path = os.path.join(directory, fn)
    try:
      with safe_open(path, framework="flax") as f:
        for k in f.keys():
          tensors[k] = f.get_tensor(k)
    except FileNotFoundError:
      raise FileNotFoundError(
          f"{path}: listed in model.safetensors.index.json but missing."
      ) from None
    except Exception as e:  # safetensors' own errors (truncated, corrupt)
      raise ValueError(f"{path}: not a readable safetensors file "
                       f"(truncated or corrupt?): {type(e).__name__}: {e}"
                       ) from e
  return tensors


def load_tensors(model_cfg: ModelConfig, tensors: dict[str, Any]) -> HybridLM:
  """A HybridLM with the given HF-named tensors (checks names and shapes;
  NemotronH's "model." prefix and per-expert tensors are accepted:
  `hf_nemotron.pack_tensors`)."""
  return hf_tensors.load_tensors(model_cfg, hf_nemotron.pack_tensors(tensors),
                                 tensor_map(model_cfg))


def from_pretrained(directory: str, dtype: str = "float32",
                    param_dtype: str | None = None) -> HybridLM:
  """Loads a HF Mamba2ForCausalLM / NemotronHForCausalLM /
  GraniteMoeHybridForCausalLM / BambaForCausalLM / Qwen3_5ForCausalLM /
  Qwen3_5MoeForCausalLM / Qwen3_5(Moe)ForConditionalGeneration (its text
  model) / Qwen3NextForCausalLM / KimiLinearForCausalLM directory.

  Args:
    directory: holds config.json and model.safetensors (or shards listed in
      model.safetensors.index.json).
    dtype: activation dtype of the returned model.
    param_dtype: parameter dtype (default: dtype).

  Raises:
    ValueError: unsupported architecture/options, or tensors missing,
      unexpected or of the wrong shape (all listed).
  """
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no config.json in the checkpoint "
                            f"directory.")
  with open(path) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON (truncated?): {e}") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{path}: must hold a JSON object, got "
                     f"{type(hf).__name__}.")
  try:
    cfg, arch = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
  except ValueError as e:  # name the file, not just "config.json"
    raise ValueError(str(e).replace("config.json:", f"{path}:", 1)) from None
  if arch in hf_qwen.ARCHITECTURES:
    return hf_tensors.load_tensors(
        cfg, hf_qwen.pack_tensors(cfg, _read_tensors(directory)),
        hf_qwen.tensor_map(cfg))
  if arch == hf_kimi.ARCHITECTURE:
    return hf_tensors.load_tensors(
        cfg, hf_kimi.pack_tensors(cfg, _read_tensors(directory)),
        hf_kimi.tensor_map(cfg))
  if arch in FAMILIES:
    return hf_tensors.load_tensors(cfg, _read_tensors(directory),
                                   FAMILIES[arch].tensor_map(cfg))
  return load_tensors(cfg, _read_tensors(directory))


def eos_ids(directory: str) -> tuple[int, ...]:
  """The eos token ids of a checkpoint directory, for `generate(eos_id=)`
  and `serving.Request(eos_id=)`: generation_config.json's eos_token_id
  (an int or a list), else config.json's (a multimodal config's
  text_config too); () when neither names one.

  Raises:
    ValueError: naming the file whose eos_token_id is not an int >= 0 or a
      list of them, or that is not valid JSON.
  """
  for name in ("generation_config.json", "config.json"):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    try:
      with open(path) as f:
        d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(d, dict):
      continue
    eos = d.get("eos_token_id", (d.get("text_config") or {}).get(
        "eos_token_id"))
    if eos is None:
      continue
    ids = [eos] if not isinstance(eos, list) else eos
    if not ids or any(isinstance(i, bool) or not isinstance(i, int)
                      or i < 0 for i in ids):
      raise ValueError(f"{path}: eos_token_id must be an int >= 0 or a "
                       f"list of them, got {eos!r}.")
    return tuple(dict.fromkeys(ids))
  return ()
