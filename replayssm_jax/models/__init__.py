"""Hybrid Mamba-2 / attention / MLP language models on the replayssm_jax ops.

  ModelConfig       architecture (Nemotron-H style layer pattern).
  HybridLM          the Flax NNX model (parameters only).
  ModelState        decode state (per-layer states + per-row positions).
  prefill           right-padded prompts -> decode state.
  decode_step       one token per row.
  generate          jit-compiled sampling loop (lax.while_loop).
  from_pretrained   Hugging Face Mamba2 / NemotronH checkpoint directory.
"""

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.generate import generate
from replayssm_jax.models.hf import from_pretrained
from replayssm_jax.models.model import HybridLM, decode_step, prefill
from replayssm_jax.models.states import AttentionState, MambaState, ModelState

__all__ = [
    "AttentionState",
    "HybridLM",
    "MambaState",
    "ModelConfig",
    "ModelState",
    "decode_step",
    "from_pretrained",
    "generate",
    "prefill",
]
