"""Hugging Face Qwen3.5 (text), Qwen3.5-MoE (text) and Qwen3-Next checkpoints.

Architectures: `Qwen3_5ForCausalLM` (model_type qwen3_5_text),
`Qwen3_5MoeForCausalLM` (qwen3_5_moe_text), their multimodal
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
(qwen3_5 / qwen3_5_moe: the text model is loaded, from text_config and the
model.language_model.* tensors; the vision tower model.visual.* is
skipped, as are the multi-token-prediction mtp.* tensors) and
`Qwen3NextForCausalLM` (model_type qwen3_next).

A decoder layer is two residual sublayers, as Granite's (`hf_granite`):

  h = h + mixer(input_layernorm(h))        Gated DeltaNet ('G') at the
                                           "linear_attention" layers, gated
                                           attention ('*') at the
                                           "full_attention" ones
  h = h + mlp(post_attention_layernorm(h)) SwiGLU MLP ('-') (Qwen3.5), a
                                           mixture of experts ('E') at
                                           every layer (Qwen3.5-MoE), or,
                                           Qwen3-Next with num_experts > 0,
                                           MoE at the layers not in
                                           mlp_only_layers with (i + 1) %
                                           decoder_sparse_step == 0

so HF layer i is our blocks 2i and 2i + 1. Numerics:
  * every RMSNorm but the GDN's gated one is zero-centred: x / rms(x) *
    (1 + w) (transform "plus1": stored as 1 + w, exact in float32; with
    param_dtype bfloat16, 1 + w is rounded to it, where transformers adds
    the 1 in float32);
  * attention: q_proj yields [query; gate] per head, q_norm / k_norm over
    each head, RoPE on the first
    partial_rotary_factor * head_dim dims (rotate-half), softmax scale
    head_dim ** -0.5, output times sigmoid(gate) before o_proj. Qwen3.5's
    multimodal RoPE (mrope_section) rotates text tokens as plain RoPE: all
    three position components of a text token are its position;
  * Gated DeltaNet: `gdn_block`, whose one in_proj [qkv | z | b | a] fuses
    Qwen3.5's in_proj_qkv / z / b / a (`pack_tensors`); Qwen3-Next's
    in_proj_qkvz rows are grouped per key head ([q, k, v, z] of the key
    head's value heads) and in_proj_ba's ([b, a]) likewise: regrouped;
  * MoE: softmax over all experts, top num_experts_per_tok, renormalised
    when norm_topk_prob (Qwen3.5-MoE: always); SwiGLU experts; the shared
    expert (SwiGLU) times sigmoid(shared_expert_gate(h)).

Tensor names (under `model.`; Qwen3_5ForConditionalGeneration:
`model.language_model.`):

  embed_tokens.weight, norm.weight, layers.{i}.input_layernorm.weight,
  layers.{i}.post_attention_layernorm.weight
  layers.{i}.linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a,
    out_proj}.weight (Qwen3.5) | {in_proj_qkvz, in_proj_ba, out_proj}.weight
    (Qwen3-Next); conv1d.weight [conv_dim, 1, k], A_log, dt_bias [HV],
    norm.weight [V]
  layers.{i}.self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}
  layers.{i}.mlp.{gate_proj, up_proj, down_proj}.weight          (MLP)
  layers.{i}.mlp.gate.weight [E, d], mlp.experts.{e}.{gate_proj, up_proj,
    down_proj}.weight (or stacked mlp.experts.gate_up_proj [E, 2I, d] /
    mlp.experts.down_proj [E, d, I]), mlp.shared_expert.{gate_proj,
    up_proj, down_proj}.weight, mlp.shared_expert_gate.weight [1, d] (MoE)
  lm_head.weight (absent if tied)
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models import hf_granite as G
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.hf_tensors import stack_gated_experts, swiglu_tensors

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                 "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                 "Qwen3NextForCausalLM")
MODEL_TYPES = {"qwen3_5_text": "Qwen3_5ForCausalLM",
               "qwen3_5": "Qwen3_5ForConditionalGeneration",
               "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
               "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
               "qwen3_next": "Qwen3NextForCausalLM"}
_MULTIMODAL = ("Qwen3_5ForConditionalGeneration",
               "Qwen3_5MoeForConditionalGeneration")
_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
        "Qwen3NextForCausalLM")
_LAYER_TYPES = {"linear_attention": "G", "full_attention": "*"}
_MISSING = object()


# ------------------------------------------------------------- configs
def _architecture(hf: dict) -> str:
  archs = hf.get("architectures") or [MODEL_TYPES.get(hf.get("model_type"))]
  return archs[0]


def text_config(hf: dict) -> dict:
  """The text model's config: text_config of a
  Qwen3_5(Moe)ForConditionalGeneration config.json (with its top-level
  tie_word_embeddings, which transformers ties by), else hf itself."""
  arch = _architecture(hf)
  if arch not in _MULTIMODAL:
    return hf
  text = hf.get("text_config")
  if not isinstance(text, dict):
    raise ValueError(f"config.json: a {arch} config needs a text_config "
                     f"object (its text model is what loads), got "
                     f"{text!r}.")
  return dict(text, tie_word_embeddings=hf.get("tie_word_embeddings",
                                               False))


def layer_kinds(hf: dict, n: int) -> list[str]:
  """'G' / '*' per HF layer from layer_types (or full_attention_interval:
  every interval-th layer full attention, as transformers' default)."""
  types = hf.get("layer_types")
  if types is None:
    k = G.get(hf, "full_attention_interval", 4, "int")
    types = ["full_attention" if (i + 1) % k == 0 else "linear_attention"
             for i in range(n)]
  return G.per_layer("layer_types", types, n, _LAYER_TYPES)


def _moe_layers(hf: dict, n: int) -> tuple[list[bool], dict[str, Any]]:
  """Which layers are MoE, and the MoE fields of ModelConfig (Qwen3-Next's
  keys; Qwen3.5-MoE has no decoder_sparse_step / mlp_only_layers /
  norm_topk_prob: all layers, renormalised)."""
  experts = hf.get("num_experts", 512)
  if experts in (0, None):
    return [False] * n, {}
  experts = V.positive_int("config.json: num_experts", experts)
  step = G.get(hf, "decoder_sparse_step", 1, "int")
  only = hf.get("mlp_only_layers") or []
  if (not isinstance(only, list)
      or not all(isinstance(i, int) and not isinstance(i, bool)
                 for i in only)):
    raise ValueError(f"config.json: mlp_only_layers must be a list of layer "
                     f"indices, got {hf.get('mlp_only_layers')!r}.")
  is_moe = [i not in only and (i + 1) % step == 0 for i in range(n)]
  shared = hf.get("shared_expert_intermediate_size", 512)
  if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
    raise ValueError(f"config.json: shared_expert_intermediate_size must be "
                     f"an int >= 0, got {shared!r}.")
  return is_moe, dict(
      n_routed_experts=experts,
      num_experts_per_tok=G.get(hf, "num_experts_per_tok", 10, "int"),
      moe_intermediate_size=G.get(hf, "moe_intermediate_size", 512, "int"),
      moe_shared_expert_intermediate_size=shared,
      moe_shared_expert_gate=True, moe_router="softmax",
      moe_activation="swiglu", moe_router_bias=False,
      norm_topk_prob=G.get(hf, "norm_topk_prob", True, "bool"),
      routed_scaling_factor=1.0)


def config_from_hf(hf: dict[str, Any], dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a Qwen3.5 text / Qwen3-Next config.json."""
  arch = _architecture(hf)
  hf = text_config(hf)
  common = G.common_settings(hf, dtype, param_dtype)  # refuses hidden_act
  n = G.get(hf, "num_hidden_layers", kind="int")
  kinds = layer_kinds(hf, n)
  G.refuse(hf, "attention_bias", (False,), False)
  # transformers' Qwen3.5 / Qwen3-Next attention is always gated, never
  # windowed: a config saying otherwise describes another model.
  G.refuse(hf, "attn_output_gate", (True,), True)
  G.refuse(hf, "use_sliding_window", (False,), False)
  is_moe, moe = ([False] * n, {})
  if arch in _MOE:
    is_moe, moe = _moe_layers(hf, n)
  ffn = ["E" if m else "-" for m in is_moe]
  nh = G.get(hf, "num_attention_heads", 16, "int")
  hd = G.get(hf, "head_dim", 256, "int")
  theta, factor = G.rope_settings(hf, default_factor=0.25)
  if (isinstance(factor, bool) or not isinstance(factor, (int, float))
      or not 0 < factor <= 1 or int(hd * factor) < 2 or int(hd * factor) % 2):
    raise ValueError(f"config.json: rope_parameters.partial_rotary_factor="
                     f"{factor!r} is not supported (a number in (0, 1] "
                     f"rotating an even number of the head_dim={hd} dims).")
  rotary_dim = int(hd * factor)
  nkv = G.get(hf, "num_key_value_heads", 2, "int")
  hk = G.get(hf, "linear_num_key_heads", 16, "int")
  hv = G.get(hf, "linear_num_value_heads", 32, "int")
  for (kn, k), (vn, v) in ((("num_key_value_heads", nkv),
                            ("num_attention_heads", nh)),
                           (("linear_num_key_heads", hk),
                            ("linear_num_value_heads", hv))):
    if v % k:
      raise ValueError(f"config.json: {kn}={k} must divide {vn}={v}.")
  return ModelConfig(
      pattern="".join(k + f for k, f in zip(kinds, ffn)), **moe,
      num_heads=nh, num_kv_heads=nkv,
      attn_head_dim=hd, rope_theta=theta,
      rotary_dim=None if rotary_dim == hd else rotary_dim,
      attn_qk_norm=True, attn_output_gate=True,
      conv_kernel=G.get(hf, "linear_conv_kernel_dim", 4, "int"),
      gdn_num_k_heads=hk, gdn_num_v_heads=hv,
      gdn_k_dim=G.get(hf, "linear_key_head_dim", 128, "int"),
      gdn_v_dim=G.get(hf, "linear_value_head_dim", 128, "int"),
      intermediate_size=G.get(hf, "intermediate_size", 5632, "int"),
      mlp_activation="swiglu",
      norm_eps=G.get(hf, "rms_norm_eps", 1e-6, "float"),
      tie_embeddings=G.get(hf, "tie_word_embeddings", False, "bool"),
      **common)


# ------------------------------------------------------------- tensors
def _qkvz_rows(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
  """Qwen3-Next: the rows of in_proj_qkvz ([q, k, v, z] per key head) in
  our [q | k | v | z] order, and of in_proj_ba ([b, a] per key head) in
  [b | a] order."""
  hk, kd, vd = cfg.gdn_num_k_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
  r = cfg.gdn_num_v_heads // hk
  w = 2 * kd + 2 * r * vd  # rows per key head
  qkvz = np.arange(hk * w).reshape(hk, w)
  ba = np.arange(hk * 2 * r).reshape(hk, 2 * r)
  pieces = (qkvz[:, :kd], qkvz[:, kd:2 * kd], qkvz[:, 2 * kd:2 * kd + r * vd],
            qkvz[:, 2 * kd + r * vd:])
  return (np.concatenate([p.reshape(-1) for p in pieces]),
          np.concatenate([ba[:, :r].reshape(-1), ba[:, r:].reshape(-1)]))


_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_FUSED = ("in_proj_qkvz", "in_proj_ba")


def _fuse_gdn_in_proj(cfg: ModelConfig, tensors: dict[str, Any]) -> None:
  """Replaces each GDN layer's input projections by one
  linear_attn.in_proj.weight [qkv | z | b | a] (in place); a missing or
  misshapen one is a ValueError naming it."""
  d, cd, vd = cfg.d_model, cfg.gdn_conv_dim, cfg.gdn_value_dim
  hv = cfg.gdn_num_v_heads
  rows = {"in_proj_qkv": cd, "in_proj_z": vd, "in_proj_b": hv,
          "in_proj_a": hv, "in_proj_qkvz": cd + vd, "in_proj_ba": 2 * hv}
  missing, bad = [], []
  for i, kind in enumerate(cfg.block_kinds[::2]):
    p = f"model.layers.{i}.linear_attn."
    if kind != "gdn" or p + "in_proj.weight" in tensors:
      continue
    fused = any(p + n + ".weight" in tensors for n in _FUSED)
    names = _FUSED if fused else _SPLIT
    parts = []
    for n in names:
      arr = tensors.get(p + n + ".weight")
      if arr is None:
        missing.append(p + n + ".weight")
      elif tuple(arr.shape) != (rows[n], d):
        bad.append(f"{p}{n}.weight: expected {(rows[n], d)}, got "
                   f"{tuple(arr.shape)}")
      parts.append(arr)
    if any(a is None or tuple(a.shape) != (rows[n], d)
           for a, n in zip(parts, names)):
      continue
    for n in names:
      del tensors[p + n + ".weight"]
    parts = [np.asarray(a) for a in parts]
    if fused:
      qkvz, ba = _qkvz_rows(cfg)
      parts = [parts[0][qkvz], parts[1][ba]]
    tensors[p + "in_proj.weight"] = np.concatenate(parts, axis=0)
  if missing or bad:
    raise ValueError(f"checkpoint tensors do not match the config: missing "
                     f"{missing}; wrong shapes {bad}.")


def _gdn_tensors(p: str, mx: tuple):
  m = {p + "in_proj.weight": (mx + ("in_proj", "kernel"), "T"),
       p + "out_proj.weight": (mx + ("out_proj", "kernel"), "T"),
       p + "conv1d.weight": (mx + ("conv_weight",), "conv")}
  for n in ("A_log", "dt_bias"):
    m[p + n] = (mx + (n,), "id")
  m[p + "norm.weight"] = (mx + ("norm_weight",), "id")
  return m


def _attention_tensors(p: str, mx: tuple):
  m = {p + f"{n}.weight": (mx + (n, "kernel"), "T")
       for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
  for n in ("q_norm", "k_norm"):
    m[p + f"{n}.weight"] = (mx + (n, "weight"), "plus1")
  return m


def _ffn_tensors(p: str, kind: str, mx: tuple):
  if kind == "mlp":
    return swiglu_tensors(p, mx)
  return {p + "gate.weight": (mx + ("router",), "T"),
          p + "experts.gate_up_proj": (mx + ("up",), "T3"),
          p + "experts.down_proj": (mx + ("down",), "T3"),
          p + "shared_expert.gate_up_proj.weight":
              (mx + ("shared_up", "kernel"), "T"),
          p + "shared_expert.down_proj.weight":
              (mx + ("shared_down", "kernel"), "T"),
          p + "shared_expert_gate.weight": (mx + ("shared_gate",), "T")}


def tensor_map(cfg: ModelConfig) -> dict[str, tuple]:
  """HF tensor name -> (parameter path, transform) under model.*,
  as `pack_tensors` names them (the norms' weights stored as offsets from
  one)."""
  def mixer(hf, kind, block):
    if kind == "gdn":
      return _gdn_tensors(hf + "linear_attn.", block + ("mixer",))
    return _attention_tensors(hf + "self_attn.", block + ("mixer",))
  return G.layer_tensor_map(
      cfg, "norm", "post_attention_layernorm",
      lambda hf, kind, mx: _ffn_tensors(hf + "mlp.", kind, mx), mixer,
      norm="plus1")


_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SKIPPED = ("model.visual.", "mtp.")


def pack_tensors(cfg: ModelConfig, tensors: dict[str, Any]
                 ) -> dict[str, Any]:
  """Checkpoint tensors as `tensor_map` names them: model.language_model.*
  -> model.* (model.visual.* and mtp.* dropped), each GDN layer's input
  projections fused into linear_attn.in_proj.weight [qkv | z | b | a],
  per-expert weights stacked (experts.gate_up_proj [E, 2I, d] with each
  expert's [gate; up] rows, experts.down_proj [E, d, I]), the shared
  expert's gate_proj / up_proj rows as one
  shared_expert.gate_up_proj.weight [gate; up]."""
  out, experts = {}, {}
  for name, arr in tensors.items():
    if name.startswith("model.language_model."):
      name = "model." + name[len("model.language_model."):]
    elif name.startswith(_SKIPPED):
      continue
    m = _EXPERT.match(name)
    if m:
      experts.setdefault(m.group(1), {}).setdefault(
          m.group(3), {})[int(m.group(2))] = arr
    else:
      out[name] = arr
  stack_gated_experts(experts, out, "gate_proj", "up_proj", "down_proj",
                      "shared_expert")
  _fuse_gdn_in_proj(cfg, out)
  return out
