"""replayssm_jax: ReplaySSM decode-state storage for Mamba-2 layers in JAX.

Public API:
  ReplayState                 checkpoint + input buffer + per-row counter.
  selective_state_update      baseline decode step (state read+written).
  replay_state_update         ReplaySSM decode step (checkpoint written 1/L).
  materialize                 the full current state of a ReplayState.
  PrecisionPolicy / precision storage policies: dual precision (master +
                              low-precision read copy), fp8/int8
                              quantization, stochastic rounding.
  selective_state_update_stored  baseline step storing its state in a low
                              precision every step (RN or SR), for contrast.
  replay_verify/replay_commit speculative window: parallel verify, rollback
                              by counter (baseline_verify/_commit: one
                              snapshot per draft, for comparison).
  ssd_chunked_scan            chunked SSD prefill.
  causal_conv1d(_update)      Mamba-2's short conv, prefill and decode step
                              (_update_ring: on a ring-buffer conv state).
  decode_attention            one query (or a verify window of T) per row
                              against the entries of its KV cache it sees
                              (the model's decode step and verify).
  traffic                     bytes-per-step model (baseline vs replay).
  debug_checks                context in which out-of-range values that
                              jit cannot check raise instead of giving
                              the row NaN outputs.
  implementations / register_implementation / Implementation
                              the dispatcher's table of each op's
                              implementations ("reference" and the kernels).

Modules of the dispatched ops: `ops` (decode step, attention, conv, norm;
re-exports the verify ops), `speculative` (verify / commit), their
references `reference`, `verify_reference`, `attention`, `conv`, `norm`,
the dispatcher `dispatch` and its entry type `registry.Implementation`.
"""

from replayssm_jax import gdn
from replayssm_jax import precision
from replayssm_jax import traffic
from replayssm_jax._validation import debug_checks
from replayssm_jax.conv import (causal_conv1d, causal_conv1d_update,
                                causal_conv1d_update_ring, conv_ring_ordered)
from replayssm_jax.dispatch import implementations, register_implementation
from replayssm_jax.ops import (decode_attention, materialize,
                               replay_state_update, selective_state_update,
                               selective_state_update_stored)
from replayssm_jax.precision import PrecisionPolicy
from replayssm_jax.registry import Implementation
from replayssm_jax.speculative import (baseline_commit, baseline_verify,
                                      replay_commit, replay_verify)
from replayssm_jax.ssd import ssd_chunked_scan
from replayssm_jax.state import ReplayState

__version__ = "0.1.0"

__all__ = [
    "PrecisionPolicy",
    "ReplayState",
    "debug_checks",
    "Implementation",
    "baseline_commit",
    "baseline_verify",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_update_ring",
    "conv_ring_ordered",
    "decode_attention",
    "implementations",
    "materialize",
    "precision",
    "register_implementation",
    "replay_commit",
    "replay_verify",
    "replay_state_update",
    "selective_state_update",
    "selective_state_update_stored",
    "ssd_chunked_scan",
    "traffic",
]
