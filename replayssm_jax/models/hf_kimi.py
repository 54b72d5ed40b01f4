"""Hugging Face Kimi Linear checkpoints (`KimiLinearForCausalLM`,
model_type kimi_linear).

A decoder layer is two residual sublayers (HF layer i is our blocks 2i and
2i + 1):

  h = h + mixer(input_layernorm(h))        Kimi Delta Attention ('K',
                                           `kda_block`) at the
                                           "linear_attention" layers, MLA
                                           ('*', `mla_attention`) at the
                                           "full_attention" ones
  h = h + mlp(post_attention_layernorm(h)) SwiGLU MLP ('-') at the "dense"
                                           layers, MoE ('E') at the
                                           "sparse" ones

Numerics (transformers' modeling_kimi_linear): plain RMSNorms (x / rms(x) *
w; the MLA latent norm with eps 1e-6); KDA: q, k, v projections, a
depthwise causal conv (no bias) + SiLU over [q | k | v], per-channel gate
g = -exp(A_log) softplus(f_b(f_a(h)) + dt_bias) (no lower bound), beta =
sigmoid(b_proj(h)), the delta rule with q, k L2-normalised, output RMSNorm
per head times sigmoid(g_b(g_a(h))), o_proj; MLA with no RoPE (the
"rope" key channels are shared by the heads but not rotated), score scale
(qk_nope + qk_rope) ** -0.5; MoE: sigmoid router + e_score_correction_bias
with grouped top-k (n_group, topk_group), renormalised (moe_renormalize),
times routed_scaling_factor, SwiGLU experts, plus the shared experts (one
SwiGLU MLP of width moe_intermediate_size * num_shared_experts).

Config forms: transformers' (layer_types / mlp_layer_types, linear_*
keys) and the published one (linear_attn_config with 1-indexed
full_attn_layers / kda_layers, head_dim, num_heads, short_conv_kernel_size;
first_k_dense_replace). Tensors (under `model.layers.{i}.`): the published
names, which transformers' save_pretrained writes back (self_attn.
{q,k,v}_proj, {q,k,v}_conv1d, f_a_proj, f_b_proj, A_log [1, 1, H, 1],
dt_bias [H * K], b_proj, g_a_proj, g_b_proj, o_norm, o_proj;
self_attn.{q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj};
block_sparse_moe.{gate_proj, up_proj, down_proj} (dense) or
block_sparse_moe.{gate.weight, gate.e_score_correction_bias,
experts.{e}.{w1, w2, w3}, shared_experts.{gate,up,down}_proj}), and
transformers' runtime names (mlp.*, self_attn.forget_gate.*, one conv1d,
stacked experts.gate_up_proj / down_proj). `pack_tensors` maps both onto
`tensor_map`'s names.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from replayssm_jax.models import hf_granite as G
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.hf_tensors import stack_gated_experts, swiglu_tensors

ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_TYPE = "kimi_linear"
_LAYER_TYPES = {"linear_attention": "K", "full_attention": "*"}
_MLP_TYPES = {"dense": "-", "sparse": "E"}


# ------------------------------------------------------------- configs
def _first(hf: dict, *keys, default=None):
  for k in keys:
    if hf.get(k) is not None:
      return k, hf[k]
  return keys[0], default


def _layer_types(hf: dict, n: int, lin: dict) -> list[str]:
  types = hf.get("layer_types")
  if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
    types = [None] * n
    for key, kind in (("full_attn_layers", "full_attention"),
                      ("kda_layers", "linear_attention")):
      for i in lin[key]:
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n:
          raise ValueError(f"config.json: linear_attn_config.{key} holds "
                           f"{i!r}, not a layer number in [1, {n}].")
        types[i - 1] = kind
  elif types is None:
    types = ["full_attention" if i and i % 4 == 0 else "linear_attention"
             for i in range(n)]
  return G.per_layer("layer_types", types, n, _LAYER_TYPES)


def _mlp_types(hf: dict, n: int) -> list[str]:
  types = hf.get("mlp_layer_types")
  if types is None:
    k = hf.get("first_k_dense_replace", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
      raise ValueError(f"config.json: first_k_dense_replace must be an int "
                       f">= 0, got {k!r}.")
    types = ["dense" if i < k else "sparse" for i in range(n)]
  return G.per_layer("mlp_layer_types", types, n, _MLP_TYPES, "entries")


def _int(hf, *keys, default=None):
  key, v = _first(hf, *keys, default=default)
  return G.get({key: v}, key, kind="int")


def config_from_hf(hf: dict[str, Any], dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a Kimi Linear config.json."""
  common = G.common_settings(hf, dtype, param_dtype)  # refuses hidden_act
  n = G.get(hf, "num_hidden_layers", kind="int")
  lin = hf.get("linear_attn_config") or {}
  if not isinstance(lin, dict):
    raise ValueError(f"config.json: linear_attn_config must be an object, "
                     f"got {lin!r}.")
  kinds, ffn = _layer_types(hf, n, lin), _mlp_types(hf, n)
  G.refuse(hf, "attention_bias", (False,), False)
  G.refuse(hf, "q_lora_rank", (None,), None)
  G.refuse(hf, "moe_router_activation_func", ("sigmoid",), "sigmoid")
  # The published remote code rotates k_rot / q's rope channels unless
  # mla_use_nope; transformers (the reference here) never does.
  G.refuse(hf, "mla_use_nope", (True,), True)
  nh = G.get(hf, "num_attention_heads", 32, "int")
  nkv = G.get(hf, "num_key_value_heads", nh, "int")
  if nkv != nh:
    raise ValueError(f"config.json: num_key_value_heads={nkv} must equal "
                     f"num_attention_heads={nh} (the latent attention "
                     f"decompresses one key / value per head).")
  nope = G.get(hf, "qk_nope_head_dim", 128, "int")
  rope = G.get(hf, "qk_rope_head_dim", 64, "int")
  vd = G.get(hf, "v_head_dim", 128, "int")
  hd = _int(lin, "head_dim", default=None) if "head_dim" in lin else (
      G.get(hf, "linear_head_dim", 128, "int"))
  heads = _int(lin, "num_heads") if "num_heads" in lin else (
      G.get(hf, "linear_num_heads", 32, "int"))
  conv = (_int(lin, "short_conv_kernel_size") if "short_conv_kernel_size"
          in lin else G.get(hf, "linear_conv_kernel_dim", 4, "int"))
  moe = {}
  if "E" in ffn:
    inter = G.get(hf, "moe_intermediate_size", 1024, "int")
    key, shared = _first(hf, "num_shared_experts", "n_shared_experts",
                         default=1)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
      raise ValueError(f"config.json: {key} must be an int >= 0, got "
                       f"{shared!r}.")
    key, norm = _first(hf, "moe_renormalize", "norm_topk_prob", default=True)
    if not isinstance(norm, bool):
      raise ValueError(f"config.json: {key} must be true or false, got "
                       f"{norm!r}.")
    moe = dict(
        n_routed_experts=_int(hf, "num_experts", "num_local_experts",
                              default=256),
        num_experts_per_tok=_int(hf, "num_experts_per_token",
                                 "num_experts_per_tok", default=8),
        moe_intermediate_size=inter,
        moe_shared_expert_intermediate_size=inter * shared,
        n_group=_int(hf, "num_expert_group", "n_group", default=1),
        topk_group=_int(hf, "topk_group", default=1),
        norm_topk_prob=norm, moe_router="sigmoid", moe_router_bias=True,
        moe_activation="swiglu",
        routed_scaling_factor=G.get(hf, "routed_scaling_factor", 2.446,
                                    "float"))
  return ModelConfig(
      pattern="".join(k + f for k, f in zip(kinds, ffn)), **moe,
      num_heads=nh, num_kv_heads=nh, attn_head_dim=max(nope + rope, vd),
      rope_theta=None, attention_multiplier=(nope + rope) ** -0.5,
      mla_kv_lora_rank=G.get(hf, "kv_lora_rank", 512, "int"),
      mla_qk_nope_head_dim=nope, mla_qk_rope_head_dim=rope, mla_v_head_dim=vd,
      conv_kernel=conv, gdn_num_k_heads=heads, gdn_num_v_heads=heads,
      gdn_k_dim=hd, gdn_v_dim=hd,
      intermediate_size=G.get(hf, "intermediate_size", 9216, "int"),
      mlp_activation="swiglu",
      norm_eps=G.get(hf, "rms_norm_eps", 1e-5, "float"),
      tie_embeddings=G.get(hf, "tie_word_embeddings", False, "bool"),
      **common)


# ------------------------------------------------------------- tensors
def _kda_tensors(p: str, mx: tuple):
  m = {p + f"{n}.weight": (mx + (ours, "kernel"), "T") for n, ours in (
      ("in_proj", "in_proj"), ("f_b_proj", "f_b_proj"),
      ("g_b_proj", "g_b_proj"), ("o_proj", "out_proj"))}
  m[p + "conv1d.weight"] = (mx + ("conv_weight",), "conv")
  m[p + "A_log"] = (mx + ("A_log",), "id")
  m[p + "dt_bias"] = (mx + ("dt_bias",), "id")
  m[p + "o_norm.weight"] = (mx + ("norm_weight",), "id")
  return m


def _mla_tensors(p: str, mx: tuple):
  m = {p + f"{n}.weight": (mx + (ours, "kernel"), "T") for n, ours in (
      ("q_proj", "q_proj"), ("kv_a_proj_with_mqa", "kv_a_proj"),
      ("kv_b_proj", "kv_b_proj"), ("o_proj", "o_proj"))}
  m[p + "kv_a_layernorm.weight"] = (mx + ("kv_a_norm", "weight"), "id")
  return m


def _ffn_tensors(p: str, kind: str, mx: tuple):
  if kind == "mlp":
    return swiglu_tensors(p, mx)
  m = {p + "gate.weight": (mx + ("router",), "T"),
       p + "gate.e_score_correction_bias": (mx + ("router_bias",), "id"),
       p + "experts.gate_up_proj": (mx + ("up",), "T3"),
       p + "experts.down_proj": (mx + ("down",), "T3")}
  m[p + "shared_experts.gate_up_proj.weight"] = (mx + ("shared_up", "kernel"),
                                                 "T")
  m[p + "shared_experts.down_proj.weight"] = (mx + ("shared_down", "kernel"),
                                              "T")
  return m


def tensor_map(cfg: ModelConfig) -> dict[str, tuple]:
  """HF tensor name -> (parameter path, transform), as
  `pack_tensors` names them."""
  def mixer(hf, kind, block):
    named = _kda_tensors if kind == "kda" else _mla_tensors
    return named(hf + "self_attn.", block + ("mixer",))
  return G.layer_tensor_map(
      cfg, "norm", "post_attention_layernorm",
      lambda hf, kind, mx: _ffn_tensors(hf + "mlp.", kind, mx), mixer)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_KDA_IN = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")


def _pack_kda(cfg: ModelConfig, p: str, out: dict, missing: list,
              bad: list) -> None:
  """One KDA layer's tensors under p = model.layers.{i}.self_attn.: the six
  input projections fused into in_proj.weight (a missing or misshapen one
  is added to `missing` / `bad`), the three convs into conv1d.weight, A_log
  / dt_bias reshaped."""
  hv, K = cfg.gdn_num_v_heads, cfg.gdn_k_dim
  kd = cfg.gdn_key_dim
  rows = dict(q_proj=kd, k_proj=kd, v_proj=cfg.gdn_value_dim, f_a_proj=K,
              g_a_proj=cfg.gdn_v_dim, b_proj=hv)
  if p + "in_proj.weight" not in out:
    ok = True
    for n in _KDA_IN:
      arr, want = out.get(p + n + ".weight"), (rows[n], cfg.d_model)
      if arr is None:
        missing.append(p + n + ".weight")
      elif tuple(np.shape(arr)) != want:
        bad.append(f"{p}{n}.weight: expected {want}, got "
                   f"{tuple(np.shape(arr))}")
      ok = ok and arr is not None and tuple(np.shape(arr)) == want
    if ok:
      out[p + "in_proj.weight"] = np.concatenate(
          [np.asarray(out.pop(p + n + ".weight")) for n in _KDA_IN], axis=0)
  convs = [p + f"{c}_conv1d.weight" for c in "qkv"]
  if all(n in out for n in convs):
    out[p + "conv1d.weight"] = np.concatenate(
        [np.asarray(out.pop(n)) for n in convs], axis=0)
  if p + "A_log" in out and np.asarray(out[p + "A_log"]).size == hv:
    out[p + "A_log"] = np.asarray(out[p + "A_log"]).reshape(hv)
  if p + "dt_bias" in out and np.asarray(out[p + "dt_bias"]).size == hv * K:
    out[p + "dt_bias"] = np.asarray(out[p + "dt_bias"]).reshape(hv, K)


def pack_tensors(cfg: ModelConfig, tensors: dict[str, Any]
                 ) -> dict[str, Any]:
  """Checkpoint tensors (published or transformers' runtime names) as
  `tensor_map` names them: .block_sparse_moe. -> .mlp., the forget gate's
  tensors at self_attn., per-expert w1 / w3 stacked as experts.gate_up_proj
  [E, 2I, d] ([gate; up] rows), w2 as experts.down_proj [E, d, I], the
  shared experts' gate_proj / up_proj as shared_experts.gate_up_proj.weight,
  each KDA layer's projections / convs fused (`_pack_kda`; a missing or
  misshapen projection is a ValueError naming it). Anything else that does
  not fit is left as it is, for `hf_tensors.load_tensors` to report."""
  out, experts = {}, {}
  for name, arr in tensors.items():
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(
        ".self_attn.forget_gate.", ".self_attn.")
    m = _EXPERT.match(name)
    if m:
      experts.setdefault(m.group(1), {}).setdefault(
          m.group(3), {})[int(m.group(2))] = arr
    else:
      out[name] = arr
  stack_gated_experts(experts, out, "w1", "w3", "w2", "shared_experts")
  missing, bad = [], []
  for i, kind in enumerate(cfg.block_kinds[::2]):
    if kind == "kda":
      _pack_kda(cfg, f"model.layers.{i}.self_attn.", out, missing, bad)
  if missing or bad:
    raise ValueError(f"checkpoint tensors do not match the config: missing "
                     f"{missing}; wrong shapes {bad}.")
  return out
