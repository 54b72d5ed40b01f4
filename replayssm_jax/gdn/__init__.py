"""Gated DeltaNet (GDN) layers' decode state: baseline and ReplaySSM ops.

Public API (validated, dispatched; pure-JAX references in `reference`):
  gdn_gates              g = -exp(A_log) softplus(a + dt_bias), beta =
                         sigmoid(b) (float32).
  gdn_step               baseline decode step (full state read + written).
  gdn_chunked_prefill    chunked (WY / UT) prefill, any length, right
                         padding by a `valid` mask; == stepwise gdn_step.
  GDNReplayState         checkpoint + rings of corrected updates d, keys k
                         and log-decays g + per-row counter
                         (init_gdn_replay_state, gdn_replay_state_from).
  gdn_replay_step        ReplaySSM decode step (checkpoint written 1/L).
  gdn_materialize        the full current state of a GDNReplayState.
  gdn_replay_verify /    speculative window: all T outputs in one pass
  gdn_replay_commit      (forward substitution of (I + A)), commit by
                         counter (gdn_baseline_verify / _commit: one
                         snapshot per draft, for comparison).

State layout [batch, num_v_heads, key_dim, value_dim] (o = S^T q,
S <- alpha S + k d^T); q and k are L2-normalised inside the ops.
"""

from replayssm_jax.gdn.ops import (gdn_baseline_commit, gdn_baseline_verify,
                                   gdn_chunked_prefill, gdn_gates,
                                   gdn_materialize, gdn_replay_commit,
                                   gdn_replay_step, gdn_replay_verify,
                                   gdn_step)
from replayssm_jax.gdn.state import (GDNReplayState, gdn_replay_state_from,
                                     init_gdn_replay_state)

__all__ = [
    "GDNReplayState", "gdn_baseline_commit", "gdn_baseline_verify",
    "gdn_chunked_prefill", "gdn_gates", "gdn_materialize",
    "gdn_replay_commit", "gdn_replay_state_from", "gdn_replay_step",
    "gdn_replay_verify", "gdn_step", "init_gdn_replay_state",
]
