"""NemotronH (`NemotronHForCausalLM`) config.json and tensors.

Both config forms are read as transformers' `NemotronHConfig` reads them:
NVIDIA's published `hybrid_override_pattern` (one char per block: M Mamba-2,
* attention, - MLP, E MoE; with its key names such as mamba_n_groups,
mamba_d_conv, mamba_chunk_size, mamba_dt_limit) and transformers 5's
`layers_block_type` (alias `layer_types`) list of "linear_attention",
"full_attention", "mlp", "moe" (legacy names "mamba" and "attention" are
remapped). A config key or value the model does not implement is a
ValueError naming it (multi-token prediction layers, a dt clamp other than
time_step_limit = [0, inf], sliding windows, biases, other activations).

Numerics as transformers' modeling_nemotron_h: the gated RMSNorm normalizes
groups of d_inner / n_groups channels; attention has no positional encoding
and scales by head_dim ** -0.5; the MoE router runs in float32. Keys that
do not change the forward pass are accepted as they are:
rescale_prenorm_residual (initialization only), residual_in_fp32 (not read
by transformers' block; the residual stream here is float32 whatever its
value), n_shared_experts and moe_shared_expert_overlap (transformers builds
one shared expert of moe_shared_expert_intermediate_size either way).

MoE tensors (per block i, NVIDIA's layout, which transformers also saves):
  backbone.layers.{i}.mixer.gate.weight                     [E, d]
  backbone.layers.{i}.mixer.gate.e_score_correction_bias    [E]
  backbone.layers.{i}.mixer.experts.{j}.up_proj.weight      [inter, d_in]
  backbone.layers.{i}.mixer.experts.{j}.down_proj.weight    [d_in, inter]
  backbone.layers.{i}.mixer.shared_experts.{up,down}_proj.weight
  backbone.layers.{i}.mixer.fc{1,2}_latent_proj.weight      (moe_latent_size)
`pack_tensors` stacks the per-expert tensors into
`mixer.experts.{up,down}_proj` [E, out, in] (the name transformers 5 gives
them in memory, also accepted as stored) and maps a "model." prefix to
"backbone."; `unpack_tensors` writes the per-expert form back.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.hf_tensors import json_float, stack_experts

ARCHITECTURE = "NemotronHForCausalLM"
PATTERN_OF = {"linear_attention": "M", "mamba": "M", "full_attention": "*",
              "attention": "*", "mlp": "-", "moe": "E"}
LAYER_TYPE_OF = {"M": "linear_attention", "*": "full_attention", "-": "mlp",
                 "E": "moe"}
_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)"
                     r"\.weight$")


def pattern(hf: dict[str, Any]) -> str:
  """The block pattern (M, *, -, E) of a NemotronH config.json."""
  types = hf.get("layers_block_type", hf.get("layer_types"))
  key = "layers_block_type" if "layers_block_type" in hf else "layer_types"
  if types is not None:
    if not isinstance(types, list) or not all(isinstance(t, str)
                                              for t in types):
      raise ValueError(f"config.json: {key} must be a list of layer type "
                       f"names, got {types!r}.")
    bad = sorted(set(types) - set(PATTERN_OF))
    if bad:
      raise ValueError(f"config.json: {key} holds unsupported layer types "
                       f"{bad} (supported: {sorted(PATTERN_OF)}).")
    if not types:
      raise ValueError(f"config.json: {key} is empty.")
    return "".join(PATTERN_OF[t] for t in types)
  pat = hf.get("hybrid_override_pattern")
  if pat is None:
    raise ValueError("config.json: NemotronH needs hybrid_override_pattern "
                     "or layers_block_type (or layer_types); none is set.")
  if not isinstance(pat, str) or not pat:
    raise ValueError(f"config.json: hybrid_override_pattern must be a "
                     f"string of M, *, -, E (non-empty), got {pat!r}.")
  bad = sorted(set(pat) - set(LAYER_TYPE_OF))
  if bad:
    raise ValueError(f"config.json: hybrid_override_pattern holds "
                     f"unsupported block kinds {bad} (only M, *, -, E).")
  return pat


def _refuse(hf, key, ok, what=None):
  """ValueError unless config.json's `key` (if set) is one of `ok`."""
  if key in hf and hf[key] is not None and json_float(hf[key]) not in ok:
    raise ValueError(f"config.json: {key}={hf[key]!r} is not supported "
                     f"({what or 'only ' + ' or '.join(map(repr, ok))}).")


def _check_unsupported(hf: dict[str, Any]) -> None:
  for key in ("mamba_proj_bias", "attention_bias", "mlp_bias", "use_bias"):
    _refuse(hf, key, (False,))
  for key in ("use_conv_bias", "mamba_conv_bias"):
    _refuse(hf, key, (True,))
  _refuse(hf, "mlp_hidden_act", ("relu2",))
  _refuse(hf, "mamba_hidden_act", ("silu",))
  _refuse(hf, "sliding_window", (), "sliding-window attention is not "
          "implemented; only null")
  _refuse(hf, "num_nextn_predict_layers", (0,), "multi-token prediction "
          "layers are not implemented; only 0")
  if hf.get("mtp_hybrid_override_pattern") and hf.get(
      "num_nextn_predict_layers"):
    raise ValueError("config.json: mtp_hybrid_override_pattern: "
                     "multi-token prediction layers are not implemented.")
  for key in ("time_step_limit", "mamba_dt_limit"):
    if key in hf and hf[key] is not None:
      lim = hf[key]
      vals = ([json_float(v) for v in lim] if isinstance(lim, (list, tuple))
              else None)
      if (vals is None or len(vals) != 2 or vals[0] != 0.0
          or not (isinstance(vals[1], float) and math.isinf(vals[1]))):
        raise ValueError(f"config.json: {key}={lim!r} is not supported (a "
                         f"dt clamp; only [0.0, Infinity], no clamp).")


def config(hf: dict[str, Any], common: dict[str, Any],
           get: Callable[..., Any]) -> ModelConfig:
  """ModelConfig of a NemotronH config.json (`common`: the fields shared
  with Mamba2 read by hf.config_from_hf, `get`: its key reader)."""
  pat = pattern(hf)
  _check_unsupported(hf)
  d = common["d_model"]
  common = dict(common)
  # NemotronHConfig's defaults where a key is absent.
  common["n_groups"] = get(hf, "n_groups", "mamba_n_groups", default=8,
                           kind="int")
  nh = get(hf, "num_attention_heads", default=32, kind="int")
  moe = {}
  if "E" in pat:
    latent = hf.get("moe_latent_size")
    moe = dict(
        n_routed_experts=get(hf, "n_routed_experts", "num_local_experts",
                             default=8, kind="int"),
        num_experts_per_tok=get(hf, "num_experts_per_tok", default=2,
                                kind="int"),
        moe_intermediate_size=get(hf, "moe_intermediate_size", default=7688,
                                  kind="int"),
        moe_shared_expert_intermediate_size=get(
            hf, "moe_shared_expert_intermediate_size", default=7688,
            kind="int"),
        n_group=get(hf, "n_group", default=1, kind="int"),
        topk_group=get(hf, "topk_group", default=1, kind="int"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(get(hf, "routed_scaling_factor",
                                        default=1.0, kind="float")),
        moe_router="sigmoid", moe_router_bias=True,
        moe_latent_size=(None if latent is None else get(
            hf, "moe_latent_size", kind="int")),
        moe_activation="relu2")
    e, g = moe["n_routed_experts"], moe["n_group"]
    if e % g or e // g < 2 and g > 1:
      raise ValueError(f"config.json: n_group={g} must divide "
                       f"n_routed_experts={e} into groups of >= 2 experts "
                       f"(a group's score is its top-2 sum).")
  return ModelConfig(
      pattern=pat, ssm_heads=get(hf, "mamba_num_heads", kind="int"),
      head_dim=get(hf, "mamba_head_dim", kind="int"),
      d_state=get(hf, "ssm_state_size", "mamba_d_state", default=128,
                  kind="int"),
      num_heads=nh, num_kv_heads=get(hf, "num_key_value_heads", default=nh,
                                     kind="int"),
      attn_head_dim=get(hf, "head_dim", "attention_head_dim",
                        default=d // nh, kind="int"),
      rope_theta=None,  # NemotronH attention has no positional encoding.
      intermediate_size=get(hf, "intermediate_size", default=4 * d,
                            kind="int"),
      mlp_activation="relu2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **common,
      **moe)


def config_dict(cfg: ModelConfig, layer_types: bool = False
                ) -> dict[str, Any]:
  """A NemotronH config.json dict for `cfg`: NVIDIA's form
  (hybrid_override_pattern) or, `layer_types`, transformers 5's
  (layers_block_type)."""
  if cfg.rope_theta is not None and "*" in cfg.pattern:
    raise ValueError("NemotronHForCausalLM attention has no RoPE: "
                     "rope_theta must be None.")
  if "-" in cfg.pattern and cfg.mlp_activation != "relu2":
    raise ValueError("NemotronHForCausalLM MLPs are relu2.")
  out = dict(architectures=[ARCHITECTURE], model_type="nemotron_h",
             num_hidden_layers=cfg.n_layers, hidden_size=cfg.d_model,
             vocab_size=cfg.vocab_size, mamba_num_heads=cfg.ssm_heads,
             mamba_head_dim=cfg.head_dim, ssm_state_size=cfg.d_state,
             n_groups=cfg.n_groups, conv_kernel=cfg.conv_kernel,
             chunk_size=cfg.chunk_size, num_attention_heads=cfg.num_heads,
             num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.attn_head_dim,
             intermediate_size=cfg.intermediate_size, mlp_hidden_act="relu2",
             layer_norm_epsilon=cfg.norm_eps,
             tie_word_embeddings=cfg.tie_embeddings, use_conv_bias=True,
             mamba_proj_bias=False, attention_bias=False, mlp_bias=False)
  if layer_types:
    out["layers_block_type"] = [LAYER_TYPE_OF[c] for c in cfg.pattern]
  else:
    out["hybrid_override_pattern"] = cfg.pattern
  if "E" in cfg.pattern:
    if (cfg.moe_router, cfg.moe_router_bias, cfg.moe_activation) != (
        "sigmoid", True, "relu2"):
      raise ValueError("NemotronHForCausalLM MoE blocks have the sigmoid "
                       "router with its correction bias and relu2 experts.")
    if not cfg.moe_shared_expert_intermediate_size:
      raise ValueError("NemotronHForCausalLM MoE blocks have a shared "
                       "expert (moe_shared_expert_intermediate_size > 0).")
    out.update(n_routed_experts=cfg.n_routed_experts,
               num_experts_per_tok=cfg.num_experts_per_tok,
               moe_intermediate_size=cfg.moe_intermediate_size,
               moe_shared_expert_intermediate_size=(
                   cfg.moe_shared_expert_intermediate_size),
               n_group=cfg.n_group, topk_group=cfg.topk_group,
               norm_topk_prob=cfg.norm_topk_prob,
               routed_scaling_factor=cfg.routed_scaling_factor,
               moe_latent_size=cfg.moe_latent_size, n_shared_experts=1)
  return out


def moe_tensor_map(cfg: ModelConfig, hf: str, mx: tuple
                   ) -> dict[str, tuple[tuple, str]]:
  """The MoE block's entries of hf.tensor_map (hf: "backbone.layers.{i}.",
  mx: the mixer's parameter path); "T3" swaps the last two axes."""
  m = {hf + "mixer.gate.weight": (mx + ("router",), "T"),
       hf + "mixer.gate.e_score_correction_bias": (mx + ("router_bias",),
                                                   "id"),
       hf + "mixer.experts.up_proj": (mx + ("up",), "T3"),
       hf + "mixer.experts.down_proj": (mx + ("down",), "T3"),
       hf + "mixer.shared_experts.up_proj.weight": (
           mx + ("shared_up", "kernel"), "T"),
       hf + "mixer.shared_experts.down_proj.weight": (
           mx + ("shared_down", "kernel"), "T")}
  if cfg.moe_latent_size:
    m[hf + "mixer.fc1_latent_proj.weight"] = (mx + ("fc1_latent", "kernel"),
                                              "T")
    m[hf + "mixer.fc2_latent_proj.weight"] = (mx + ("fc2_latent", "kernel"),
                                              "T")
  return m


def pack_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
  """Checkpoint tensors as tensor_map names them: "model." -> "backbone.",
  per-expert up/down weights stacked [E, out, in] (experts 0 .. E-1 must
  all be present)."""
  out, experts = {}, {}
  for name, arr in tensors.items():
    if name.startswith("model."):
      name = "backbone." + name[len("model."):]
    m = _EXPERT.match(name)
    if m:
      experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = arr
    else:
      out[name] = arr
  for (prefix, proj), by_index in experts.items():
    out[f"{prefix}.{proj}"] = stack_experts(prefix, proj, by_index)
  return out


def unpack_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The inverse of `pack_tensors` (per-expert names, "backbone.")."""
  out = {}
  for name, arr in tensors.items():
    m = re.match(r"^(.*\.mixer\.experts)\.(up_proj|down_proj)$", name)
    if m:
      for j in range(arr.shape[0]):
        out[f"{m.group(1)}.{j}.{m.group(2)}.weight"] = np.ascontiguousarray(
            arr[j])
    else:
      out[name] = arr
  return out
