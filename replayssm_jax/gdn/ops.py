"""Public, validated GDN ops routed through the implementation dispatcher.

Each op checks its arguments once at trace time (errors name the argument),
then runs an implementation through `replayssm_jax.dispatch`, like the
Mamba-2 ops of `replayssm_jax.ops`:

  implementation=None         the fastest registered implementation that
                              supports the inputs (the reference always
                              does);
  implementation="reference"  the pure-JAX reference (`gdn.reference`,
                              `gdn.replay`, `gdn.verify`);
  any other registered name   that implementation, with no fallback.

The GDN ops' table entries ("gdn_step", "gdn_chunked_prefill", ...) are
added to the dispatcher's table when this module is imported, each with its
reference registered; kernels register further entries with
`replayssm_jax.register_implementation(op, Implementation(...))`.
"""

from __future__ import annotations

from replayssm_jax import _validation as V
from replayssm_jax import dispatch as _dispatch
from replayssm_jax.dispatch import dispatch
from replayssm_jax import precision as P
from replayssm_jax import slots
from replayssm_jax.gdn import checks
from replayssm_jax.gdn import reference
from replayssm_jax.gdn import replay
from replayssm_jax.gdn import verify
from replayssm_jax.gdn.state import GDNReplayState, policy_args
from replayssm_jax.speculative import baseline_commit, commit_pending

OPS = {
    "gdn_step": reference.gdn_step,
    "gdn_chunked_prefill": reference.gdn_chunked_prefill,
    "gdn_replay_step": replay.gdn_replay_step,
    "gdn_replay_verify": verify.gdn_replay_verify_reference,
    "gdn_baseline_verify": verify.gdn_baseline_verify_reference,
}


for _op, _fn in OPS.items():
  _dispatch.register_op(_op, _fn)


def gdn_gates(a, b, A_log, dt_bias):
  """The decay log-gate and the update strength of each token.

  Args:
    a, b: [..., num_v_heads] projections (any float dtype).
    A_log, dt_bias: [num_v_heads].

  Returns:
    (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), float32
    [..., num_v_heads].
  """
  for name, x in (("a", a), ("b", b)):
    V.check_floating(name, x)
    if x.ndim < 1:
      raise ValueError(f"{name} must be [..., num_v_heads], got a scalar.")
  h = a.shape[-1]
  V.check_shape("b", b, a.shape, "a's shape [..., num_v_heads]")
  for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
    V.check_floating(name, x)
    V.check_shape(name, x, (h,), "[num_v_heads]")
  return reference.gdn_gates(a, b, A_log, dt_bias)


def gdn_step(state, q, k, v, g, beta, *, use_qk_l2norm: bool = True,
             scale=None, rows=None, implementation: str | None = None,
             config=None):
  """Baseline GDN decode step (the full state is read and written).

  Args:
    state: [batch, num_v_heads, key_dim, value_dim] f32/bf16/f16 state
      (o = S^T q, S <- alpha S + k d^T); accumulation is f32.
    q, k: [batch, num_k_heads, key_dim]; num_v_heads % num_k_heads == 0.
    v: [batch, num_v_heads, value_dim].
    g, beta: [batch, num_v_heads] (`gdn_gates`).
    use_qk_l2norm: L2-normalise q and k in f32 (eps 1e-6) inside the op.
    scale: q's scale after normalisation (default key_dim ** -0.5).
    rows: optional [batch] int32, a state row (slot) per token row of a
      state with any number of rows (`replayssm_jax.slots`).
    implementation, config: see the module docstring.

  Returns:
    (o [batch, num_v_heads, value_dim] in v.dtype, new state in its dtype).
  """
  b, hv, K, Vd = checks.check_state("state", state)
  b, rows = slots.token_rows(b, q, rows)
  checks.check_token(b, hv, K, Vd, q, k, v, g, beta)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(state=state, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
  return _dispatch.dispatch_rows("gdn_step", implementation, config, args,
                                 rows, ("state",))


def gdn_chunked_prefill(q, k, v, g, beta, *, chunk_size: int = 64,
                        initial_state=None, valid=None,
                        use_qk_l2norm: bool = True, scale=None,
                        implementation: str | None = None, config=None,
                        precision=reference.HIGHEST,
                        solve: str = "substitution"):
  """GDN over a sequence in chunks (WY / UT form); == T `gdn_step` calls.

  Args:
    q, k: [batch, T, num_k_heads, key_dim]; v [batch, T, num_v_heads,
      value_dim]; g, beta [batch, T, num_v_heads]. Any T >= 1 (padded
      internally to the chunk).
    chunk_size: positions per chunk (an int >= 1; a chunk never exceeds T).
    initial_state: None (zeros) or [batch, num_v_heads, key_dim, value_dim].
    valid: None or [batch, T] bool (right padding): an invalid position
      leaves the state unchanged and outputs zeros; its inputs (inf / NaN
      included) are selected away and never reach an output or the state.
    use_qk_l2norm, scale: as in `gdn_step`.
    implementation, config: see the module docstring.
    precision: of the chunked form's f32 products (a `jax.lax.Precision`
      or a dot algorithm name, as `ssd.ssd_chunked_scan`'s; default
      HIGHEST: true f32).
    solve: each chunk's unit-lower-triangular system by "substitution" (a
      triangular solve) or "inverse" (its inverse from matrix products,
      then one product; `reference.solve_unit_lower`).

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype, final state
     [batch, num_v_heads, key_dim, value_dim] float32).
  """
  checks.check_sequence(q, k, v, g, beta, initial_state, valid, chunk_size)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(q=q, k=k, v=v, g=g, beta=beta, chunk_size=int(chunk_size),
              initial_state=initial_state, valid=valid,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              precision=precision, solve=checks.check_solve(solve))
  return dispatch("gdn_chunked_prefill", implementation, config, args)


def check_rstate(rstate, rows=None) -> GDNReplayState:
  if not isinstance(rstate, GDNReplayState):
    raise TypeError(f"rstate must be a GDNReplayState, got "
                    f"{type(rstate).__name__}.")
  return rstate.validate("rstate", rows)


def gdn_replay_step(rstate: GDNReplayState, q, k, v, g, beta, *,
                    use_qk_l2norm: bool = True, scale=None,
                    policy: P.PrecisionPolicy | None = None, layer=0,
                    rows=None, implementation: str | None = None,
                    config=None):
  """GDN ReplaySSM decode step: `gdn_step` with a `GDNReplayState`.

  Rows with count < L-1 compute o and the correction S_{t-1}^T k_t from
  checkpoint + buffer and append (d_t, k_t, g_t) (checkpoint untouched);
  rows with count == L-1 fold the L tokens into a new checkpoint (flush)
  and reset their count. L = 1 is the baseline step with the state stored
  in the checkpoint dtype.

  Args:
    rstate: the committed state (`init_gdn_replay_state`,
      `gdn_replay_state_from`); a state pending a verify window is refused.
    q, k, v, g, beta, use_qk_l2norm, scale: as in `gdn_step` (use the same
      use_qk_l2norm / scale at every step: the k ring holds the keys as the
      step normalised them).
    policy: optional `precision.PrecisionPolicy` the state was built with
      (None: the one its dtypes imply, round to nearest). With a read copy,
      non-flush rows read only the (dequantized) copy and flush rows write
      master + copy; with stochastic rounding, flush stores round
      stochastically keyed by (policy.seed, layer, row_id, step, element).
    layer: layer index (int >= 0 or an int32 scalar) keying stochastic
      rounding.
    rows: optional [batch] int32, a state row (slot) per token row (see
      `gdn_step`).
    implementation, config: see the module docstring.

  Returns:
    (o [batch, num_v_heads, value_dim] in v.dtype, new GDNReplayState).
    Under jit a row whose count lies outside [0, L) outputs NaN and keeps
    its count (every later output of the row is NaN).
  """
  check_rstate(rstate, rows)
  if rstate.pending_window is not None:
    raise ValueError(
        f"rstate holds a pending window of {rstate.pending_window} tokens "
        f"from gdn_replay_verify; gdn_replay_commit it first.")
  batch, rows = slots.token_rows(rstate.batch, q, rows)
  checks.check_token(batch, rstate.num_v_heads, rstate.key_dim,
                     rstate.value_dim, q, k, v, g, beta,
                     hk=rstate.num_k_heads)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(rstate=rstate, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              **policy_args(rstate, policy, layer))
  o, new = _dispatch.dispatch_rows("gdn_replay_step", implementation,
                                   config, args, rows, ("rstate",))
  V.raise_if_invalid(_dispatch.invalid_rows(new, rows), "gdn_replay_step")
  return o, new


def gdn_materialize(rstate: GDNReplayState, dtype=None):
  """The full current state [batch, num_v_heads, key_dim, value_dim] of a
  committed GDNReplayState (checkpoint advanced over the buffered tokens,
  f32, returned in `dtype`, default float32)."""
  check_rstate(rstate)
  if dtype is not None:
    V.check_dtype_arg("dtype", dtype)
  return replay.gdn_materialize(rstate, reference.F32 if dtype is None
                                else dtype)


# --------------------------------------------------------- speculative
def gdn_replay_verify(rstate: GDNReplayState, q, k, v, g, beta, *,
                      use_qk_l2norm: bool = True, scale=None,
                      policy: P.PrecisionPolicy | None = None, layer=0,
                      implementation: str | None = None, config=None):
  """Outputs of a T-token window from checkpoint + rings, in one pass.

  The window's corrected updates come from one forward substitution of a
  unit-lower-triangular (I + A) system; its (d, k, g) are written into the
  rings behind the committed history (count unchanged), so
  `gdn_replay_commit` is a counter move. A row whose window would not fit
  (count + T >= L) first folds its committed history into the checkpoint
  (early flush) and places the window at slot 0. Needs buffer_len > T.

  Args:
    rstate: the committed state (count = committed history per row).
    q, k: [batch, T, num_k_heads, key_dim]; v [batch, T, num_v_heads,
      value_dim]; g, beta [batch, T, num_v_heads] (position 0 first).
    use_qk_l2norm, scale: as in `gdn_replay_step`.
    policy, layer: as in `gdn_replay_step`; rows that fold nothing read
      only the read copy, early-flushing rows with a history fold it from
      the master + rings, store master and copy (stochastically with
      stochastic rounding, keyed by the row's current `step`) and read the
      window out from the stored master.
    implementation, config: see the module docstring.

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype: o[:, s] given the
     committed history and window positions 0..s; the state with the
     window pending (`pending_window` = T)).
  """
  check_rstate(rstate)
  if rstate.pending_window is not None:
    raise ValueError(
        f"rstate holds a pending window of {rstate.pending_window} tokens "
        f"from gdn_replay_verify; gdn_replay_commit it before the next "
        f"verify.")
  T, _ = checks.check_token(rstate.batch, rstate.num_v_heads,
                            rstate.key_dim, rstate.value_dim, q, k, v, g,
                            beta, hk=rstate.num_k_heads, window=True)
  checks.check_window_fits(rstate.buffer_len, T)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(rstate=rstate, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale,
              **policy_args(rstate, policy, layer))
  o, pending = dispatch("gdn_replay_verify", implementation, config, args)
  V.raise_if_invalid(_dispatch.invalid_rows(pending), "gdn_replay_verify")
  return o, pending.replace(pending_window=T)


def gdn_replay_commit(rstate: GDNReplayState, num_accepted,
                      window: int | None = None):
  """Makes the first num_accepted window tokens of each row history.

  Args:
    rstate: the state `gdn_replay_verify` returned (a committed state is
      refused).
    num_accepted: [batch] int32 in [1, T]: accepted tokens per row,
      counting the window's first (already sampled) token.
    window: optional, T again (checked against the state's).

  Returns:
    The state with count advanced by num_accepted (the rejected tokens'
    slots are stale and overwritten later) and, with stochastic-rounding
    counters, `step` advanced by num_accepted. Under jit a row whose
    num_accepted lies outside [1, T] gets count -1: every later output of
    the row is NaN.
  """
  if not isinstance(rstate, GDNReplayState):
    raise TypeError(f"rstate must be a GDNReplayState, got "
                    f"{type(rstate).__name__}.")
  return commit_pending(rstate, num_accepted, window, "gdn_replay_commit",
                        "gdn_replay_verify")


def gdn_baseline_verify(state, q, k, v, g, beta, *,
                        use_qk_l2norm: bool = True, scale=None,
                        implementation: str | None = None, config=None):
  """Snapshot-per-draft verify (what engines do without replay): steps the
  full state through the window, keeping one state per position.

  Args:
    state: [batch, num_v_heads, key_dim, value_dim] committed state.
    q, k, v, g, beta: the window, as in `gdn_replay_verify`.
    use_qk_l2norm, scale, implementation, config: as in `gdn_step`.

  Returns:
    (o [batch, T, num_v_heads, value_dim] in v.dtype, snapshots [batch, T,
     num_v_heads, key_dim, value_dim] in state.dtype: the state after each
     window position).
  """
  b, hv, K, Vd = checks.check_state("state", state)
  checks.check_token(b, hv, K, Vd, q, k, v, g, beta, window=True)
  checks.check_options(use_qk_l2norm, scale)
  args = dict(state=state, q=q, k=k, v=v, g=g, beta=beta,
              use_qk_l2norm=bool(use_qk_l2norm), scale=scale)
  return dispatch("gdn_baseline_verify", implementation, config, args)


def gdn_baseline_commit(snapshots, num_accepted):
  """The snapshot of each row's last accepted position (num_accepted
  [batch] in [1, T]); under jit a row outside [1, T] gets a NaN state."""
  V.check_ndim("snapshots", snapshots, 5,
               "[batch, T, num_v_heads, key_dim, value_dim]")
  return baseline_commit(snapshots, num_accepted)
