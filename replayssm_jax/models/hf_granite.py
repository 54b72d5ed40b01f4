"""Hugging Face `GraniteMoeHybridForCausalLM` (Granite 4.0 hybrid) checkpoints.

A Granite / Bamba decoder layer is two residual sublayers,

  h = h + mixer(input_layernorm(h))          (Mamba-2 or attention)
  h = h + ffn(post_attention_layernorm(h))   (Bamba: pre_ff_layernorm)

so HF layer i is our blocks 2i (its mixer: 'M' or '*') and 2i + 1 (an MLP,
'-'): `layer_pattern` expands the layer types into a pattern like
"M-M-*-". Granite's numerics beyond Mamba-2 / attention / MLP are
ModelConfig fields: embedding_multiplier, residual_multiplier (each
sublayer's output before the residual add), attention_multiplier (the
attention score scale), logits_scaling (logits divided by it), and no RoPE
unless position_embedding_type is "rope".

Tensor names (Granite; `hf_bamba` lists Bamba's):

  model.embed_tokens.weight                          [vocab, d]
  model.layers.{i}.input_layernorm.weight            [d]
  model.layers.{i}.mamba.{in_proj, conv1d, ...}      (as Mamba-2's mixer)
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
  model.layers.{i}.post_attention_layernorm.weight   [d]
  model.layers.{i}.shared_mlp.input_linear.weight    [2 f, d]  ([gate; up])
  model.layers.{i}.shared_mlp.output_linear.weight   [d, f]
  model.norm.weight                                  [d]
  lm_head.weight                                     [vocab, d] (absent if tied)

num_local_experts > 0: each feed-forward block is a mixture of experts
('E', replayssm_jax.models.moe): its
router, experts and the shared MLP (as the block's shared expert) under

  model.layers.{i}.block_sparse_moe.input_linear.weight   [E, 2 inter, d]
  model.layers.{i}.block_sparse_moe.output_linear.weight  [E, d, inter]
  model.layers.{i}.block_sparse_moe.router.layer.weight   [E, d]

This module does not import `hf` (which dispatches to it): `tensor_map`
entries are HF name -> (parameter path, transform) (`hf_tensors`; the
shared MLP's fused [gate; up] input_linear is the packed gate_up kernel,
transform "gate_up").
"""

from __future__ import annotations

import math
from typing import Any


from replayssm_jax import _validation as V
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.hf_tensors import json_float

ARCHITECTURE = "GraniteMoeHybridForCausalLM"
MODEL_TYPE = "granitemoehybrid"

_LAYER_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*",
                "full_attention": "*"}
_MISSING = object()


# ------------------------------------------------------------- configs
def get(hf: dict, key: str, default=_MISSING, kind=None):
  """config.json's `key` (None counts as absent: `default`); a missing
  required key or a value of the wrong kind is a ValueError naming it.
  kind: "int" (positive), "float" (a positive finite number), "bool" or
  None (as is)."""
  v = hf.get(key)
  if v is None:
    if default is _MISSING:
      raise ValueError(f"config.json: the key {key!r} is required and "
                       f"missing.")
    v = default
  if kind == "int":
    return V.positive_int(f"config.json: {key}", v)
  if kind == "float":
    if (isinstance(v, bool) or not isinstance(v, (int, float))
        or not math.isfinite(v) or v <= 0):
      raise ValueError(f"config.json: {key} must be a positive finite "
                       f"number, got {v!r}.")
    return float(v)
  if kind == "bool" and not isinstance(v, bool):
    raise ValueError(f"config.json: {key} must be true or false, got "
                     f"{v!r}.")
  return v


def refuse(hf: dict, key: str, allowed, default):
  """A ValueError naming `key` and its value unless the value (default if
  absent) is one of `allowed`."""
  v = hf.get(key, default)
  if v not in allowed:
    raise ValueError(f"config.json: {key}={v!r} is not supported (only "
                     f"{' or '.join(map(repr, allowed))}).")


def per_layer(key: str, types, n: int, table: dict, what: str = "layer types"
              ) -> list:
  """config.json's `key`, a list of n names each in `table`, as their
  table values; a ValueError naming the key and the first bad entry
  otherwise."""
  if not isinstance(types, list) or len(types) != n:
    raise ValueError(f"config.json: {key} must be a list of "
                     f"num_hidden_layers={n} {what}, got {types!r}.")
  bad = [t for t in types if not isinstance(t, str) or t not in table]
  if bad:
    raise ValueError(f"config.json: {key} holds {bad[0]!r}, not supported "
                     f"(only {tuple(table)}).")
  return [table[t] for t in types]


def layer_pattern(kinds, ffn: str = "-") -> str:
  """HF layer kinds ('M' / '*' per layer) -> our pattern: each layer's
  mixer block, then its feed-forward block `ffn` ('-' an MLP: "M-*-...";
  'E' a mixture of experts)."""
  return "".join(k + ffn for k in kinds)


def mamba_settings(hf: dict, d: int) -> dict[str, Any]:
  """The Mamba-2 fields of ModelConfig from the mamba_* keys Granite 4.0
  and Bamba share (and the refusals of what the mixer does not do)."""
  heads = get(hf, "mamba_n_heads", 128, "int")
  expand = get(hf, "mamba_expand", 2, "int")
  hdim = hf.get("mamba_d_head", "auto")
  if hdim in (None, "auto"):
    hdim = expand * d // heads
  hdim = V.positive_int("config.json: mamba_d_head", hdim)
  if heads * hdim != expand * d:
    raise ValueError(f"config.json: mamba_n_heads * mamba_d_head "
                     f"({heads} * {hdim}) != mamba_expand * hidden_size "
                     f"({expand} * {d}).")
  refuse(hf, "mamba_proj_bias", (False,), False)
  refuse(hf, "mamba_conv_bias", (True,), True)
  limit = hf.get("time_step_limit", (0.0, float("inf")))
  if isinstance(limit, (list, tuple)):
    limit = tuple(json_float(v) for v in limit)
  # softplus(dt) > 0, so a lower limit <= 0 and no upper limit clamp nothing.
  if limit is not None and (
      not isinstance(limit, tuple) or len(limit) != 2
      or not all(isinstance(v, (int, float)) for v in limit)
      or limit[0] > 0 or limit[1] != float("inf")):
    raise ValueError(f"config.json: time_step_limit={limit!r} is not "
                     f"supported (only (0.0, inf): dt is not clamped).")
  return dict(ssm_heads=heads, head_dim=hdim,
              d_state=get(hf, "mamba_d_state", 256, "int"),
              n_groups=get(hf, "mamba_n_groups", 1, "int"),
              conv_kernel=get(hf, "mamba_d_conv", 4, "int"),
              chunk_size=get(hf, "mamba_chunk_size", 256, "int"))


def rope_settings(hf: dict, default_factor: float = 1.0
                  ) -> tuple[float, float]:
  """(rope_theta, partial_rotary_factor) from rope_parameters (or the
  older top-level keys); only the default RoPE type."""
  rp = hf.get("rope_parameters")
  if rp is None:
    refuse(hf, "rope_scaling", (None,), None)
    rp = {"rope_theta": hf.get("rope_theta", 1e4),
          "partial_rotary_factor": hf.get("partial_rotary_factor",
                                          default_factor)}
  if not isinstance(rp, dict):
    raise ValueError(f"config.json: rope_parameters must be an object, got "
                     f"{rp!r}.")
  rtype = rp.get("rope_type", rp.get("type", "default"))
  if rtype != "default":
    raise ValueError(f"config.json: rope_parameters.rope_type={rtype!r} is "
                     f"not supported (only 'default').")
  theta = get(rp, "rope_theta", 1e4, "float")
  return theta, rp.get("partial_rotary_factor", default_factor)


def attention_settings(hf: dict, d: int) -> dict[str, Any]:
  nh = get(hf, "num_attention_heads", 32, "int")
  refuse(hf, "attention_bias", (False,), False)
  return dict(num_heads=nh,
              num_kv_heads=get(hf, "num_key_value_heads", nh, "int"),
              attn_head_dim=get(hf, "head_dim", d // nh, "int"))


def common_settings(hf: dict, dtype: str, param_dtype: str | None):
  refuse(hf, "hidden_act", ("silu",), "silu")
  return dict(vocab_size=get(hf, "vocab_size", kind="int"),
              d_model=get(hf, "hidden_size", kind="int"),
              dtype=dtype,
              param_dtype=dtype if param_dtype is None else param_dtype)


def moe_settings(hf: dict) -> dict[str, Any]:
  """The MoE fields of ModelConfig for num_local_experts > 0 (else {}):
  the router's softmax over the top-k logits, fused [gate; up] SiLU
  experts and the shared MLP as the block's shared expert."""
  experts = hf.get("num_local_experts", 8)  # transformers' default
  if experts in (0, None):
    return {}
  experts = V.positive_int("config.json: num_local_experts", experts)
  return dict(n_routed_experts=experts,
              num_experts_per_tok=get(hf, "num_experts_per_tok", 2, "int"),
              moe_intermediate_size=get(hf, "intermediate_size", 11008,
                                        "int"),
              moe_shared_expert_intermediate_size=get(
                  hf, "shared_intermediate_size", 1024, "int"),
              moe_router="softmax_topk", moe_activation="swiglu",
              norm_topk_prob=False, moe_router_bias=False,
              routed_scaling_factor=1.0)


def config_from_hf(hf: dict[str, Any], dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a GraniteMoeHybridForCausalLM config.json."""
  common = common_settings(hf, dtype, param_dtype)
  moe = moe_settings(hf)
  d = common["d_model"]
  n = get(hf, "num_hidden_layers", kind="int")
  types = hf.get("layer_types", hf.get("layers_block_type"))
  if types is None:
    types = ["mamba"] * n
  kinds = per_layer("layer_types", types, n, _LAYER_TYPES)
  pos = hf.get("position_embedding_type")
  if pos not in (None, "nope", "rope"):
    raise ValueError(f"config.json: position_embedding_type={pos!r} is not "
                     f"supported (only 'rope', 'nope' or null).")
  rope_theta = None
  if pos == "rope":
    rope_theta, factor = rope_settings(hf)
    if factor != 1.0:
      raise ValueError(f"config.json: rope_parameters.partial_rotary_factor"
                       f"={factor!r} is not supported for Granite (only "
                       f"1.0).")
  attention_multiplier = get(hf, "attention_multiplier", 1.0, "float")
  return ModelConfig(
      pattern=layer_pattern(kinds, "E" if moe else "-"), **moe,
      **mamba_settings(hf, d), **attention_settings(hf, d),
      rope_theta=rope_theta,
      intermediate_size=get(hf, "shared_intermediate_size", 1024, "int"),
      mlp_activation="swiglu",
      norm_eps=get(hf, "rms_norm_eps", 1e-6, "float"),
      tie_embeddings=get(hf, "tie_word_embeddings", False, "bool"),
      embedding_multiplier=get(hf, "embedding_multiplier", 1.0, "float"),
      residual_multiplier=get(hf, "residual_multiplier", 1.0, "float"),
      attention_multiplier=attention_multiplier,
      logits_scaling=get(hf, "logits_scaling", 1.0, "float"), **common)


# ------------------------------------------------------------- tensors
def mixer_tensors(hf: str, kind: str, me: tuple):
  """The HF names of layer prefix `hf`'s mixer (`kind` of block path me:
  "mamba" under `hf + "mamba."`, "attention" under `hf + "self_attn."`)."""
  mx = me + ("mixer",)
  m = {}
  if kind == "mamba":
    p = hf + "mamba."
    for n in ("in_proj", "out_proj"):
      m[p + f"{n}.weight"] = (mx + (n, "kernel"), "T")
    m[p + "conv1d.weight"] = (mx + ("conv_weight",), "conv")
    m[p + "conv1d.bias"] = (mx + ("conv_bias",), "id")
    for n in ("A_log", "D", "dt_bias"):
      m[p + n] = (mx + (n,), "id")
    m[p + "norm.weight"] = (mx + ("norm", "weight"), "id")
  else:
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
      m[hf + f"self_attn.{n}.weight"] = (mx + (n, "kernel"), "T")
  return m


def layer_tensor_map(cfg: ModelConfig, final_norm: str, ffn_norm: str,
                     ffn_tensors, mixer=None,
                     norm: str = "id") -> dict[str, tuple]:
  """HF tensor name -> (parameter path, transform) of a family whose
  layer i is our blocks 2i (its mixer, named by `mixer(hf_prefix, kind,
  block_path)`, default Granite's / Bamba's `mixer_tensors`) and 2i+1
  (its feed-forward, named by `ffn_tensors(hf_prefix, kind,
  mixer_path)`), under model.*; the norms' weights through `norm` ("id",
  or "plus1" for weights stored as offsets from one)."""
  mixer = mixer_tensors if mixer is None else mixer
  m = {"model.embed_tokens.weight": (("embeddings", "weight"), "id"),
       f"model.{final_norm}.weight": (("norm_f", "weight"), norm)}
  if not cfg.tie_embeddings:
    m["lm_head.weight"] = (("lm_head", "kernel"), "T")
  kinds = cfg.block_kinds
  for i in range(len(kinds) // 2):
    hf = f"model.layers.{i}."
    mix, ffn = ("blocks", 2 * i), ("blocks", 2 * i + 1)
    m[hf + "input_layernorm.weight"] = (mix + ("norm", "weight"), norm)
    m.update(mixer(hf, kinds[2 * i], mix))
    m[hf + f"{ffn_norm}.weight"] = (ffn + ("norm", "weight"), norm)
    m.update(ffn_tensors(hf, kinds[2 * i + 1], ffn + ("mixer",)))
  return m


def tensor_map(cfg: ModelConfig) -> dict[str, tuple]:
  """Granite HF tensor name -> (parameter path, transform)."""
  def ffn_tensors(hf, kind, mlp):
    if kind == "moe":
      return _moe_tensors(hf, mlp)
    return {hf + "shared_mlp.input_linear.weight":  # [gate; up] rows
                (mlp + ("gate_up",), "gate_up"),
            hf + "shared_mlp.output_linear.weight":
                (mlp + ("down_proj", "kernel"), "T")}
  return layer_tensor_map(cfg, "norm", "post_attention_layernorm",
                          ffn_tensors)


def _moe_tensors(hf: str, mx: tuple) -> dict[str, tuple]:
  """A MoE layer's tensors: the experts [E, 2 inter, d] / [E, d, inter]
  ("T3": the last two axes swapped), the router [E, d], the shared MLP
  as the block's shared expert (fused [gate; up] as the experts')."""
  p = hf + "block_sparse_moe."
  return {p + "input_linear.weight": (mx + ("up",), "T3"),
          p + "output_linear.weight": (mx + ("down",), "T3"),
          p + "router.layer.weight": (mx + ("router",), "T"),
          hf + "shared_mlp.input_linear.weight":
              (mx + ("shared_up", "kernel"), "T"),
          hf + "shared_mlp.output_linear.weight":
              (mx + ("shared_down", "kernel"), "T")}
