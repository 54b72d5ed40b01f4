"""Speculative decoding with a ReplayState: parallel verify, rollback by count.

A verify step feeds a window of T tokens per row (the last sampled token and
T-1 drafts). `replay_verify` computes the outputs of all T positions in one
parallel pass from the checkpoint + committed buffer + the window, writes
the window's inputs into the buffer after the committed history, and leaves
`count` (the committed history) unchanged. `replay_commit` then advances
`count` by the number of accepted tokens: rejected positions are simply
overwritten by the next window. No per-draft state is ever formed.

Flush policy: a row whose window would not fit behind its history with room
to spare (count + T >= L) first folds its committed history into the
checkpoint (the checkpoint's only write of that window, and only over
committed tokens), then places the window at slot 0. Hence count stays in
[0, L) after any acceptance pattern and the standard decode step
(`replay_state_update`) can continue from any committed state. This needs
buffer_len > T.

The ops check their arguments and run an implementation through the
dispatcher (`replayssm_jax.dispatch`); the pure-JAX references are in
`replayssm_jax.verify_reference` (re-exported here). See research notes
§3.2 for the engine designs this mirrors.
"""

from __future__ import annotations

import jax.numpy as jnp

from replayssm_jax import _validation as V
from replayssm_jax import dispatch as _dispatch
from replayssm_jax.state import ReplayState
# The references, re-exported (the kernels' tests and benchmarks use them).
from replayssm_jax.verify_reference import (baseline_verify_reference,
                                            replay_verify_reference,
                                            verify_bc, verify_readout,
                                            verify_terms)

__all__ = [
    "baseline_commit", "baseline_verify", "baseline_verify_reference",
    "replay_commit", "replay_verify", "replay_verify_reference", "verify_bc",
    "verify_readout", "verify_terms",
]


def _check_window(rstate: ReplayState, x, dt, A, B, C, D, z, dt_bias):
  b, h, p, n, g = (rstate.batch, rstate.nheads, rstate.headdim,
                   rstate.dstate, rstate.ngroups)
  V.check_floating("x", x)
  V.check_ndim("x", x, 4, "[batch, T, nheads, headdim]")
  T = x.shape[1]
  V.check_shape("x", x, (b, T, h, p), "[batch, T, nheads, headdim]")
  if T < 1:
    raise ValueError("x must hold a window of T >= 1 tokens, got T = 0.")
  if rstate.buffer_len <= T:
    raise ValueError(
        f"rstate.buffer_len ({rstate.buffer_len}) must exceed the window "
        f"length T ({T}): a window is placed behind the committed history "
        f"and the count must stay below buffer_len after any acceptance.")
  V.check_floating("dt", dt)
  V.check_shape("dt", dt, (b, T, h), "[batch, T, nheads]")
  for name, v in (("B", B), ("C", C)):
    V.check_floating(name, v)
    V.check_shape(name, v, (b, T, g, n), "[batch, T, ngroups, dstate]")
  if z is not None:
    V.check_floating("z", z)
    V.check_shape("z", z, (b, T, h, p), "[batch, T, nheads, headdim]")
  V.check_params(h, A=A, D=D, dt_bias=dt_bias)
  return T


def replay_verify(rstate: ReplayState, x, dt, A, B, C, D=None, z=None,
                  dt_bias=None, dt_softplus=False, *, policy=None, layer=0,
                  implementation: str | None = None, config=None):
  """Outputs of a T-token window from checkpoint + buffer, in one pass.

  Args:
    rstate: the committed state (count = committed history per row).
    x: [batch, T, nheads, headdim] window inputs (position 0 first).
    dt: [batch, T, nheads]; B, C: [batch, T, ngroups, dstate];
    z: optional [batch, T, nheads, headdim]; A, D, dt_bias, dt_softplus: as
      in `replay_state_update`.
    policy, layer: the state's `precision.PrecisionPolicy` and the layer
      index keying stochastic rounding, as in `replay_state_update`. With a
      read copy, rows that fold nothing (no early flush, or no history)
      read only the (dequantized) copy; early-flushing rows with a history
      fold it from the master + buffer,
      store the master in its dtype (stochastically with stochastic
      rounding, keyed by the row's current `step`), read the window out
      from the stored master and re-store the copy from it.
    implementation, config: as in `replay_state_update` (the dispatcher;
      the Pallas verify kernels take every policy with
      `VerifyConfig(readout="reduce")`, the default).

  Returns:
    (y [batch, T, nheads, headdim] in x.dtype: y[:, s] is the output of
     window position s given the committed history and window positions
     0..s; the state with the window's inputs pending behind the committed
     history (count unchanged, or 0 for rows that flushed)).
  """
  if not isinstance(rstate, ReplayState):
    raise TypeError(f"rstate must be a ReplayState, got "
                    f"{type(rstate).__name__}.")
  rstate.validate("rstate")
  if rstate.pending_window is not None:
    raise ValueError(
        f"rstate holds a pending window of {rstate.pending_window} tokens "
        f"from replay_verify; replay_commit it before the next verify.")
  T = _check_window(rstate, x, dt, A, B, C, D, z, dt_bias)
  args = dict(rstate=rstate, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=bool(dt_softplus),
              **_dispatch.policy_args(rstate, policy, layer))
  y, pending = _dispatch.dispatch("replay_verify", implementation, config,
                                  args)
  V.raise_if_invalid(_dispatch.invalid_rows(pending), "replay_verify")
  # (An implementation registered from outside may not set the window.)
  return y, pending.replace(pending_window=T)


def replay_commit(rstate: ReplayState, num_accepted,
                  window: int | None = None):
  """Makes the first num_accepted window tokens of each row history.

  Args:
    rstate: the state returned by `replay_verify` (it carries its window
      length T as `pending_window`; a committed state is refused).
    num_accepted: [batch] int32 in [1, T]: accepted tokens per row,
      counting the window's first (already sampled) token.
    window: optional, T again (checked against the state's: a mismatch is
      an error).

  Returns:
    The state with count advanced (rollback of the rest is implicit: their
    slots are overwritten by the next window), and with stochastic-rounding
    counters, `step` advanced by num_accepted (as many decode steps). Under
    jit an out-of-range num_accepted sets the row's count to -1, which makes
    every later output of the row NaN instead of silently wrong.
  """
  if not isinstance(rstate, ReplayState):
    raise TypeError(f"rstate must be a ReplayState, got "
                    f"{type(rstate).__name__}.")
  return commit_pending(rstate, num_accepted, window, "replay_commit",
                        "replay_verify")


def commit_pending(rstate, num_accepted, window, commit: str, verify: str):
  """A verified window's commit as a counter move, for any replay state
  with `pending_window`, `count` and `step` (Mamba-2, GDN): checks the
  window and num_accepted (messages naming the `commit` and `verify`
  functions), advances count (and step) by num_accepted, and under jit
  sets an out-of-range row's count to -1."""
  pending = rstate.pending_window
  if pending is None:
    raise ValueError(
        f"rstate has no pending window: {commit} takes the state returned "
        f"by {verify} (a committed state has nothing to commit).")
  if window is not None and V.positive_int("window", window) != pending:
    raise ValueError(
        f"window ({window}) does not match the pending window of rstate "
        f"({pending} tokens, from {verify}).")
  V.check_num_accepted(num_accepted, rstate.batch, pending)
  n = jnp.asarray(num_accepted, jnp.int32)
  ok = (n >= 1) & (n <= pending)
  extra = {} if rstate.step is None else dict(
      step=jnp.where(ok, rstate.step + n, rstate.step).astype(jnp.int32))
  V.raise_if_invalid(~ok, f"{commit} (num_accepted)")
  return rstate.replace(
      count=jnp.where(ok, rstate.count + n, -1).astype(jnp.int32),
      pending_window=None, **extra)


# ------------------------------------------------------------------ baseline
def baseline_verify(ssm_state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                    dt_softplus=False, *, implementation=None, config=None):
  """Snapshot-per-draft verify (what serving engines do without replay).

  Steps the full state through the window and keeps one full state per
  position (T state writes per step, T x the state memory).

  Args:
    ssm_state: [batch, nheads, headdim, dstate] committed state.
    x, dt, B, C, z: the window, as in `replay_verify`; A, D, dt_bias,
      dt_softplus as in `selective_state_update`.
    implementation, config: as in `selective_state_update` (the
      dispatcher): "reference" is a scan of T reference steps; the Pallas
      kernel reads the state once and writes each snapshot in place.

  Returns:
    (y [batch, T, nheads, headdim], snapshots [batch, T, nheads, headdim,
     dstate] in ssm_state.dtype: the state after each window position).
  """
  V.check_floating("ssm_state", ssm_state, V.STATE_DTYPES)
  V.check_ndim("ssm_state", ssm_state, 4, "[batch, nheads, headdim, dstate]")
  V.check_ndim("x", x, 4, "[batch, T, nheads, headdim]")
  args = dict(ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z,
              dt_bias=dt_bias, dt_softplus=dt_softplus)
  return _dispatch.dispatch("baseline_verify", implementation, config, args)


def baseline_commit(snapshots, num_accepted):
  """The snapshot of each row's last accepted position ([batch] in [1, T]).
  Under jit a row whose num_accepted lies outside [1, T] gets a NaN state
  (every later output of the row is NaN), not a neighbouring snapshot."""
  V.check_ndim("snapshots", snapshots, 5,
               "[batch, T, nheads, headdim, dstate]")
  b, T = snapshots.shape[:2]
  V.check_num_accepted(num_accepted, b, T)
  n = jnp.asarray(num_accepted, jnp.int32)
  ok = (n >= 1) & (n <= T)
  V.raise_if_invalid(~ok, "baseline_commit (num_accepted)")
  idx = jnp.clip(n - 1, 0, T - 1)
  snap = jnp.take_along_axis(snapshots, idx[:, None, None, None, None],
                             axis=1)[:, 0]
  return jnp.where(ok[:, None, None, None], snap, jnp.nan).astype(
      snapshots.dtype)
