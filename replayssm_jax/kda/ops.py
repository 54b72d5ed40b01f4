"""Public, validated KDA ops routed through the implementation dispatcher.

As `replayssm_jax.gdn.ops`: each op checks its arguments once at trace
time (errors name the argument), then runs an implementation through
`replayssm_jax.dispatch` (implementation=None: the fastest registered one
that supports the inputs; "reference": the pure-JAX reference). The table
entries "kda_step", "kda_chunked_prefill", "kda_replay_step",
"kda_replay_verify" and "kda_baseline_verify" are added with their
references when this module is imported.
"""

from __future__ import annotations

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax import dispatch as _dispatch
from replayssm_jax import precision as P
from replayssm_jax.dispatch import dispatch
from replayssm_jax.gdn import checks
from replayssm_jax.gdn.state import policy_args
from replayssm_jax.kda import reference
from replayssm_jax.kda import replay
from replayssm_jax.kda import verify
from replayssm_jax.kda.state import KDAReplayState

OPS = {
    "kda_step": reference.kda_step,
    "kda_chunked_prefill": reference.kda_chunked_prefill,
    "kda_replay_step": replay.kda_replay_step,
    "kda_replay_verify": verify.kda_replay_verify_reference,
    "kda_baseline_verify": reference.kda_step_scan,
}
for _op, _fn in OPS.items():
  _dispatch.register_op(_op, _fn)


def kda_gates(f, b, A_log, dt_bias, *, lower_bound=None):
  """The per-channel decay log-gate and the update strength of each token.

  Args:
    f: [..., num_v_heads, key_dim] gate projection (Kimi Linear's
      f_b_proj(f_a_proj(x)) viewed per head).
    b: [..., num_v_heads] (b_proj(x)).
    A_log: [num_v_heads]; dt_bias: [num_v_heads, key_dim].
    lower_bound: None (Kimi Linear: g = -exp(A_log) softplus(f + dt_bias),
      unbounded below) or a float < 0 (fla's safe gate: g = lower_bound *
      sigmoid(exp(A_log) (f + dt_bias)), in [lower_bound, 0]).

  Returns:
    (g float32 [..., num_v_heads, key_dim], beta = sigmoid(b) float32
     [..., num_v_heads]).
  """
  V.check_floating("f", f)
  if f.ndim < 2:
    raise ValueError(f"f must be [..., num_v_heads, key_dim], got shape "
                     f"{tuple(f.shape)}.")
  hv, K = f.shape[-2:]
  V.check_floating("b", b)
  V.check_shape("b", b, f.shape[:-1], "f's shape without key_dim")
  V.check_floating("A_log", A_log)
  V.check_shape("A_log", A_log, (hv,), "[num_v_heads]")
  V.check_floating("dt_bias", dt_bias)
  V.check_shape("dt_bias", dt_bias, (hv, K), "[num_v_heads, key_dim]")
  if lower_bound is not None:
    lb = lower_bound
    if (isinstance(lb, (bool, np.bool_)) or not isinstance(
        lb, (int, float, np.integer, np.floating))
        or not np.isfinite(float(lb)) or float(lb) >= 0):
      raise ValueError(f"lower_bound must be None or a finite float < 0, "
                       f"got {lb!r}.")
    lower_bound = float(lb)
  return reference.kda_gates(f, b, A_log, dt_bias, lower_bound)


def check_token(batch, hv, K, Vd, q, k, v, g, beta, window=False):
  """One token ([batch, ...]) or a sequence ([batch, T, ...]), g per head
  and key channel; returns T (None for one token)."""
  return checks.check_token(batch, hv, K, Vd, q, k, v, g, beta,
                            window=window, per_channel_gate=True)[0]


def kda_step(state, q, k, v, g, beta, *, use_qk_l2norm: bool = True,
             scale=None, implementation: str | None = None, config=None):
  """Baseline KDA decode step (the full state is read and written).

  Args:
    state: [batch, num_v_heads, key_dim, value_dim] f32/bf16/f16 (o = S^T
      q, S <- diag(exp(g)) S + k d^T); accumulation is f32.
    q, k: [batch, num_k_heads, key_dim]; v [batch, num_v_heads, value_dim].
    g: [batch, num_v_heads, key_dim] per-channel log-gates (`kda_gates`);
      beta: [batch, num_v_heads].
    use_qk_l2norm, scale, implementation, config: as `gdn.gdn_step`.

  Returns:
    (o [batch, num_v_heads, value_dim] in v.dtype, new state in its dtype).
  """
  b, hv, K, Vd = checks.check_state("state", state)
  check_token(b, hv, K, Vd, q, k, v, g, beta)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(state=state, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
  return dispatch("kda_step", implementation, config, args)


def kda_baseline_verify(state, q, k, v, g, beta, *,
                        use_qk_l2norm: bool = True, scale=None,
                        implementation: str | None = None, config=None):
  """Snapshot-per-draft verify of a speculative window (the baseline
  state's): steps the full state through the window, keeping one state per
  position; commit picks one (`gdn.gdn_baseline_commit`).

  Args:
    state: [batch, num_v_heads, key_dim, value_dim] committed state.
    q, k: [batch, T, num_k_heads, key_dim]; v [batch, T, num_v_heads,
      value_dim]; g [batch, T, num_v_heads, key_dim]; beta [batch, T,
      num_v_heads]: the window.
    use_qk_l2norm, scale, implementation, config: as `kda_step`.

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype, snapshots [batch, T,
     num_v_heads, key_dim, value_dim] in state.dtype: the state after each
     window position).
  """
  b, hv, K, Vd = checks.check_state("state", state)
  check_token(b, hv, K, Vd, q, k, v, g, beta, window=True)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(state=state, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
  return dispatch("kda_baseline_verify", implementation, config, args)


def kda_chunked_prefill(q, k, v, g, beta, *, chunk_size: int = 64,
                        initial_state=None, valid=None,
                        use_qk_l2norm: bool = True, scale=None,
                        implementation: str | None = None, config=None,
                        solve: str = "substitution"):
  """KDA over a sequence in chunks (WY / UT form); == T `kda_step` calls.

  Args:
    q, k: [batch, T, num_k_heads, key_dim]; v [batch, T, num_v_heads,
      value_dim]; g [batch, T, num_v_heads, key_dim]; beta [batch, T,
      num_v_heads]. Any T >= 1.
    chunk_size, initial_state, valid, use_qk_l2norm, scale,
    implementation, config, solve: as `gdn.gdn_chunked_prefill` (an invalid
      position leaves the state unchanged and outputs zeros; inf / NaN in
      it never reach an output or the state).

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype, final state
     [batch, num_v_heads, key_dim, value_dim] float32).
  """
  V.check_floating("q", q)
  V.check_ndim("q", q, 4, "[batch, T, num_k_heads, key_dim]")
  V.check_floating("v", v)
  V.check_ndim("v", v, 4, "[batch, T, num_v_heads, value_dim]")
  b, _, _, K = q.shape
  hv, Vd = v.shape[2], v.shape[3]
  T = check_token(b, hv, K, Vd, q, k, v, g, beta, window=True)
  V.int_at_least("chunk_size", chunk_size)
  if initial_state is not None:
    checks.check_state("initial_state", initial_state, V.FLOAT_DTYPES)
    V.check_shape("initial_state", initial_state, (b, hv, K, Vd),
                  checks.STATE_LAYOUT)
  if valid is not None:
    V.check_array("valid", valid)
    if np.dtype(valid.dtype) != np.dtype(bool):
      raise TypeError(f"valid must be a bool array [batch, T], got dtype "
                      f"{valid.dtype}.")
    V.check_shape("valid", valid, (b, T), "[batch, T]")
  checks.check_options(use_qk_l2norm, scale)
  args = dict(q=q, k=k, v=v, g=g, beta=beta, chunk_size=int(chunk_size),
              initial_state=initial_state, valid=valid,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              solve=checks.check_solve(solve))
  return dispatch("kda_chunked_prefill", implementation, config, args)


def check_rstate(rstate) -> KDAReplayState:
  if not isinstance(rstate, KDAReplayState):
    raise TypeError(f"rstate must be a KDAReplayState, got "
                    f"{type(rstate).__name__}.")
  return rstate.validate("rstate")


def kda_replay_step(rstate: KDAReplayState, q, k, v, g, beta, *,
                    use_qk_l2norm: bool = True, scale=None,
                    policy: P.PrecisionPolicy | None = None, layer=0,
                    implementation: str | None = None, config=None):
  """KDA ReplaySSM decode step: `kda_step` with a `KDAReplayState`.

  Rows with count < L-1 whose gate stays within rstate.gate_lower_bound
  compute o and the correction from checkpoint + ring and append (d,
  pre-decayed k) (checkpoint untouched); the other rows fold the ring and
  the token into a new checkpoint (flush) and reset their count. With
  every gate within the bound the checkpoint is written exactly every L
  steps; a gate below it flushes the row early (still exact).

  Args:
    rstate: `init_kda_replay_state` / `kda_replay_state_from`.
    q, k, v, g, beta, use_qk_l2norm, scale: as `kda_step` (the same
      use_qk_l2norm / scale at every step).
    policy, layer, implementation, config: as `gdn.gdn_replay_step`.

  Returns:
    (o [batch, num_v_heads, value_dim] in v.dtype, new KDAReplayState).
    Under jit a row whose count lies outside [0, L) outputs NaN and keeps
    its count.
  """
  check_rstate(rstate)
  check_token(rstate.batch, rstate.num_v_heads, rstate.key_dim,
              rstate.value_dim, q, k, v, g, beta)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(rstate=rstate, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              **policy_args(rstate, policy, layer))
  o, new = dispatch("kda_replay_step", implementation, config, args)
  V.raise_if_invalid(_dispatch.invalid_rows(new), "kda_replay_step")
  return o, new


def kda_materialize(rstate: KDAReplayState, dtype=None):
  """The full current state [batch, num_v_heads, key_dim, value_dim] of a
  KDAReplayState (f32, returned in `dtype`, default float32)."""
  check_rstate(rstate)
  if dtype is not None:
    V.check_dtype_arg("dtype", dtype)
  return replay.kda_materialize(rstate, reference.F32 if dtype is None
                                else dtype)


def kda_replay_verify(rstate: KDAReplayState, q, k, v, g, beta, *,
                      use_qk_l2norm: bool = True, scale=None,
                      policy: P.PrecisionPolicy | None = None, layer=0,
                      implementation: str | None = None, config=None):
  """Outputs of a T-token speculative window from checkpoint + ring, in one
  pass (`kda.verify` has the math).

  The window's corrected updates come from one forward substitution; the
  window is written behind the committed history (count unchanged), its
  keys pre-decayed up to the first position whose gate leaves the state's
  gate bound. A row whose window would not fit (count + T >= L) first
  folds its history into the checkpoint (early flush). Needs
  buffer_len > T.

  Args:
    rstate: the committed state.
    q, k: [batch, T, num_k_heads, key_dim]; v [batch, T, num_v_heads,
      value_dim]; g [batch, T, num_v_heads, key_dim]; beta [batch, T,
      num_v_heads] (position 0 first).
    use_qk_l2norm, scale, policy, layer, implementation, config: as
      `kda_replay_step` (an early flush stores as a decode step's flush).

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype: o[:, s] given the
     committed history and window positions 0..s; the state with the
     window written; a `KDAWindow` for `kda_replay_commit`).
  """
  check_rstate(rstate)
  T = check_token(rstate.batch, rstate.num_v_heads, rstate.key_dim,
                  rstate.value_dim, q, k, v, g, beta, window=True)
  checks.check_window_fits(rstate.buffer_len, T)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(rstate=rstate, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              **policy_args(rstate, policy, layer))
  o, pending, window = dispatch("kda_replay_verify", implementation, config,
                                args)
  V.raise_if_invalid(_dispatch.invalid_rows(pending), "kda_replay_verify")
  return o, pending, window


def kda_replay_commit(rstate: KDAReplayState, window: verify.KDAWindow,
                      num_accepted, *,
                      policy: P.PrecisionPolicy | None = None, layer=0):
  """Makes the first num_accepted window tokens of each row history.

  Args:
    rstate, window: the state and `KDAWindow` from `kda_replay_verify`.
    num_accepted: [batch] int32 in [1, T]: accepted tokens per row,
      counting the window's first (already sampled) token.
    policy, layer: as the verify's (a refold stores as a flush does).

  Returns:
    The committed state: a counter move (count + n, g_sum the log-decay
    through the last accepted token) for rows whose accepted tokens all
    kept their gates within the bound; the others store the state after
    their accepted tokens as a new checkpoint (count 0). Under jit a row
    whose num_accepted lies outside [1, T] gets count -1: every later
    output of the row is NaN.
  """
  check_rstate(rstate)
  if not isinstance(window, verify.KDAWindow):
    raise TypeError(f"window must be the KDAWindow from kda_replay_verify, "
                    f"got {type(window).__name__}.")
  b, T = window.k.shape[:2]
  if b != rstate.batch or window.k.shape[2:] != (rstate.num_v_heads,
                                                  rstate.key_dim):
    raise ValueError(
        f"window (keys {window.k.shape}) does not belong to rstate (batch "
        f"{rstate.batch}, {rstate.num_v_heads} value heads, key_dim "
        f"{rstate.key_dim}).")
  V.check_num_accepted(num_accepted, rstate.batch, T)
  new = verify.kda_replay_commit_reference(
      rstate, window, num_accepted,
      **policy_args(rstate, policy, layer))
  V.raise_if_invalid(new.count < 0, "kda_replay_commit (num_accepted)")
  return new
