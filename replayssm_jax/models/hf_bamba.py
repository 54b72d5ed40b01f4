"""Hugging Face `BambaForCausalLM` checkpoints.

Bamba's decoder layer is Granite 4.0's two residual sublayers (see
`hf_granite`): a mixer (Mamba-2, or attention at the layers listed in
attn_layer_indices) and a gated SiLU MLP, each after its own RMSNorm, with
no multipliers. Its attention has RoPE on the first
partial_rotary_factor * head_dim dims of each head (rotate-half within
them; ModelConfig.rotary_dim) and the 1/sqrt(head_dim) score scale.
z_loss_coefficient weights a training loss only: it does not change the
logits.

Tensor names:

  model.embed_tokens.weight                          [vocab, d]
  model.layers.{i}.input_layernorm.weight            [d]
  model.layers.{i}.mamba.{in_proj, conv1d, ...}      (as Mamba-2's mixer)
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
  model.layers.{i}.pre_ff_layernorm.weight           [d]
  model.layers.{i}.feed_forward.{gate,up,down}_proj.weight
  model.final_layernorm.weight                       [d]
  lm_head.weight                                     [vocab, d] (absent if tied)
"""

from __future__ import annotations

from typing import Any

from replayssm_jax.models import hf_granite as G
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.hf_tensors import swiglu_tensors

ARCHITECTURE = "BambaForCausalLM"
MODEL_TYPE = "bamba"


def config_from_hf(hf: dict[str, Any], dtype: str = "float32",
                   param_dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a BambaForCausalLM config.json."""
  common = G.common_settings(hf, dtype, param_dtype)
  d = common["d_model"]
  n = G.get(hf, "num_hidden_layers", kind="int")
  G.refuse(hf, "mlp_bias", (False,), False)
  attn = hf.get("attn_layer_indices") or []
  if (not isinstance(attn, list)
      or not all(isinstance(i, int) and not isinstance(i, bool)
                 and 0 <= i < n for i in attn)):
    raise ValueError(f"config.json: attn_layer_indices must be a list of "
                     f"layer indices in [0, num_hidden_layers={n}), got "
                     f"{hf.get('attn_layer_indices')!r}.")
  kinds = ["*" if i in attn else "M" for i in range(n)]
  attention = G.attention_settings(hf, d)
  # transformers' BambaConfig defaults partial_rotary_factor to 0.5.
  rope_theta, factor = G.rope_settings(hf, default_factor=0.5)
  hd = attention["attn_head_dim"]
  if (isinstance(factor, bool) or not isinstance(factor, (int, float))
      or not 0 < factor <= 1 or int(hd * factor) % 2):
    raise ValueError(f"config.json: rope_parameters.partial_rotary_factor="
                     f"{factor!r} is not supported (a number in (0, 1] "
                     f"rotating an even number of the head_dim={hd} dims).")
  rotary_dim = int(hd * factor)
  return ModelConfig(
      pattern=G.layer_pattern(kinds),
      **G.mamba_settings(hf, d), **attention,
      rope_theta=rope_theta,
      rotary_dim=None if rotary_dim == hd else rotary_dim,
      intermediate_size=G.get(hf, "intermediate_size", 14336, "int"),
      mlp_activation="swiglu",
      norm_eps=G.get(hf, "rms_norm_eps", 1e-5, "float"),
      tie_embeddings=G.get(hf, "tie_word_embeddings", False, "bool"),
      **common)


def tensor_map(cfg: ModelConfig) -> dict[str, tuple]:
  """Bamba HF tensor name -> (parameter path, transform)."""
  def ffn_tensors(hf, kind, mlp):
    del kind  # always the SwiGLU MLP
    return swiglu_tensors(hf + "feed_forward.", mlp)
  return G.layer_tensor_map(cfg, "final_layernorm", "pre_ff_layernorm",
                            ffn_tensors)
