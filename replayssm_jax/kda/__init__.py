"""Kimi Delta Attention (KDA) layers' decode state: baseline and ReplaySSM
ops (reference level).

KDA is Gated DeltaNet (`replayssm_jax.gdn`) with a per-key-channel decay:
g is [..., num_v_heads, key_dim] per token. Public API (validated,
dispatched; pure-JAX references in `reference` / `replay`):
  kda_gates              Kimi Linear's gate -exp(A_log) softplus(f +
                         dt_bias) (or fla's bounded safe gate) and beta.
  kda_step               baseline decode step (full state read + written).
  kda_baseline_verify    a speculative window stepped from the baseline
                         state, one state snapshot per position (commit:
                         gdn.gdn_baseline_commit).
  kda_chunked_prefill    chunked (WY / UT) prefill, any length, right
                         padding by a `valid` mask; == stepwise kda_step.
  KDAReplayState         checkpoint + rings of corrected updates d and
                         PRE-DECAYED keys exp(-G_j) k_j + running log-decay
                         + per-row counter, under a gate bound with
                         (buffer_len - 1) |gate_lower_bound| <= 80
                         (init_kda_replay_state, kda_replay_state_from,
                         safe_gate_lower_bound).
  kda_replay_step        ReplaySSM decode step (checkpoint written 1/L).
  kda_replay_verify      a speculative window from checkpoint + ring in one
                         pass, written behind the history (KDAWindow: what
                         commit needs besides the state);
  kda_replay_commit      a counter move where the accepted tokens kept
                         their gates within the bound, else a refold of
                         them into a new checkpoint.
  kda_materialize        the full current state of a KDAReplayState.

State layout [batch, num_v_heads, key_dim, value_dim] (o = S^T q,
S <- diag(exp(g)) S + k d^T), as the GDN ops.
"""

from replayssm_jax.kda.ops import (kda_baseline_verify, kda_chunked_prefill,
                                   kda_gates, kda_materialize,
                                   kda_replay_commit, kda_replay_step,
                                   kda_replay_verify, kda_step)
from replayssm_jax.kda.state import (MAX_LOG_DECAY, KDAReplayState,
                                     init_kda_replay_state,
                                     kda_replay_state_from,
                                     safe_gate_lower_bound)
from replayssm_jax.kda.verify import KDAWindow

__all__ = [
    "KDAReplayState", "KDAWindow", "MAX_LOG_DECAY", "init_kda_replay_state",
    "kda_baseline_verify", "kda_chunked_prefill", "kda_gates",
    "kda_materialize",
    "kda_replay_commit", "kda_replay_state_from", "kda_replay_step",
    "kda_replay_verify", "kda_step",
    "safe_gate_lower_bound",
]
