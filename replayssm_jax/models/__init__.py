"""Hybrid Mamba-2 / Gated DeltaNet / attention / MLP language models on the
replayssm_jax ops.

  ModelConfig       architecture (Nemotron-H style layer pattern).
  HybridLM          the Flax NNX model (parameters only).
  ModelState        decode state (per-layer states + per-row positions);
                    init_state(precision=PrecisionPolicy) stores the Mamba
                    states per a precision policy (StoredSSMState: a
                    baseline state stored in 8 bits / with SR).
  prefill           right-padded prompts -> decode state.
  prefill_from_state  a right-padded chunk appended to each row of a decode
                    state in one parallel pass (chunked prefill).
  decode_step       one token per row.
  generate          jit-compiled sampling loop (lax.while_loop).
  generate_from_state  that loop continued from a decode state.
  save_state / restore_state  exact save / restore of a ModelState
                    (orbax; `replayssm_jax.models.checkpointing`).
  verify / commit   speculative window: one parallel pass, then rollback
                    (replay: counter move; baseline: snapshot per position).
  speculative_generate  jit-compiled speculative decoding loop with a
                    Proposer (DraftModelProposer, NgramProposer).
  kv_cache_len      a KV-cache length the attention kernel tiles (the
                    loops' own caches use it; so should a caller's).
  from_pretrained   Hugging Face Mamba2 / NemotronH / Granite 4.0 hybrid /
                    Bamba / Qwen3.5 (text) / Qwen3-Next checkpoint directory.
"""

from replayssm_jax.models.checkpointing import restore_state, save_state
from replayssm_jax.models.chunked_prefill import prefill_from_state
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.generate import generate, generate_from_state
from replayssm_jax.models.hf import from_pretrained
from replayssm_jax.models.model import HybridLM, decode_step, prefill
from replayssm_jax.models.speculative import (DraftModelProposer,
                                              NgramProposer, PendingState,
                                              Proposal, ProposalContext,
                                              Proposer, SpecStats, commit,
                                              speculative_generate, verify)
from replayssm_jax.models.states import (AttentionState, GDNState,
                                         MambaState, ModelState,
                                         StoredSSMState, kv_cache_len)

__all__ = [
    "AttentionState",
    "DraftModelProposer",
    "GDNState",
    "HybridLM",
    "MambaState",
    "ModelConfig",
    "ModelState",
    "NgramProposer",
    "PendingState",
    "Proposal",
    "ProposalContext",
    "Proposer",
    "SpecStats",
    "StoredSSMState",
    "commit",
    "decode_step",
    "from_pretrained",
    "generate",
    "generate_from_state",
    "kv_cache_len",
    "prefill",
    "prefill_from_state",
    "restore_state",
    "save_state",
    "speculative_generate",
    "verify",
]
