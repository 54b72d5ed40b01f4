"""Pure-JAX reference math for one Mamba-2 decode step (baseline and replay).

These functions assume validated inputs (see `replayssm_jax.ops` for the
public, checked entry points). Everything is computed in float32 whatever the
storage dtypes; results are cast back to the storage dtype at the end.

Notation (research notes §2.4): for a window of w tokens with processed steps
d_j (dt after bias and softplus), Lambda_j = A * sum_{i<=j} d_i and
Lambda = Lambda_w:

  S_w = exp(Lambda) S_0 + sum_j s_j x_j B_j^T,  s_j = d_j exp(Lambda - Lambda_j)
  y_w = exp(Lambda) (S_0 C_w) + sum_j s_j (B_j . C_w) x_j + D x_w
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax.state import ReplayState

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def process_dt(dt, dt_bias=None, dt_softplus=False):
  """dt' = softplus(dt + dt_bias) in float32 (softplus is the identity > 20)."""
  d = dt.astype(F32)
  if dt_bias is not None:
    d = d + dt_bias.astype(F32)
  if dt_softplus:
    d = jnp.where(d <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(d, 20.0))), d)
  return d


def heads_from_groups(v, nheads: int, axis: int):
  """[.., ngroups, ..] -> [.., nheads, ..]: head h reads group h // (H/G)."""
  return jnp.repeat(v, nheads // v.shape[axis], axis=axis)


def _finish_output(y, x, D, z):
  if D is not None:
    y = y + D.astype(F32)[:, None] * x.astype(F32)
  if z is not None:
    y = y * jax.nn.silu(z.astype(F32))
  return y


def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None,
                           dt_bias=None, dt_softplus=False):
  """Baseline decode step: reads and writes the full state.

  Shapes: ssm_state [b, h, p, n]; x, z [b, h, p]; dt [b, h]; A, D, dt_bias [h];
  B, C [b, g, n]. Returns (y [b, h, p] in x.dtype, new state in
  ssm_state.dtype).
  """
  h = x.shape[1]
  d = process_dt(dt, dt_bias, dt_softplus)  # [b, h]
  decay = jnp.exp(d * A.astype(F32))  # [b, h]
  bh = heads_from_groups(B.astype(F32), h, axis=1)  # [b, h, n]
  ch = heads_from_groups(C.astype(F32), h, axis=1)
  dx = d[..., None] * x.astype(F32)  # [b, h, p]
  state = (ssm_state.astype(F32) * decay[..., None, None]
           + dx[..., None] * bh[:, :, None, :])
  y = jnp.einsum("bhpn,bhn->bhp", state, ch, precision=HIGHEST)
  y = _finish_output(y, x, D, z)
  return y.astype(x.dtype), state.astype(ssm_state.dtype)


def fold_window(checkpoint, xw, bw, dw, A):
  """Advances a checkpoint over a window of buffered tokens.

  Args:
    checkpoint: [b, h, p, n] state before the window.
    xw: [b, w, h, p] window inputs (any float dtype).
    bw: [b, w, g, n] window B.
    dw: [b, w, h] processed dt, **zero at masked positions** (a zero step
      neither decays nor adds, so masked slots drop out exactly).
    A: [h].

  Returns:
    (state [b, h, p, n] f32, decay exp(Lambda) [b, h], weights s [b, w, h]).
  """
  h = checkpoint.shape[1]
  decay, s = window_weights(dw, A)
  sx = s[..., None] * xw.astype(F32)  # [b, w, h, p]
  bh = heads_from_groups(bw.astype(F32), h, axis=2)  # [b, w, h, n]
  state = (decay[..., None, None] * checkpoint.astype(F32)
           + jnp.einsum("bwhp,bwhn->bhpn", sx, bh, precision=HIGHEST))
  return state, decay, s


def window_weights(dw, A):
  """(decay exp(Lambda) [b, h], weights s [b, w, h]) of a window: s_j =
  dw_j exp(A sum_{i>j} dw_i); dw [b, w, h] is zero at masked positions."""
  lam = jnp.cumsum(dw, axis=1) * A.astype(F32)  # [b, w, h]
  lam_tot = lam[:, -1]  # masked (zero) steps add nothing to the sum
  return jnp.exp(lam_tot), dw * jnp.exp(lam_tot[:, None] - lam)


def replay_window(rstate: ReplayState, x, B, d_cur):
  """The decode step's window of every row, f32: buffered slots [0, c) and
  the current token (x, B, processed dt d_cur) at slot c, zero beyond ->
  (xw [b, L, h, p], bw [b, L, g, n], dw [b, L, h])."""
  c = rstate.count.astype(jnp.int32)
  slot = jnp.arange(rstate.buffer_len)[None, :]
  at_c = slot == c[:, None]  # [b, L]
  valid = slot <= c[:, None]
  xw = jnp.where(at_c[..., None, None], x.astype(F32)[:, None],
                 rstate.x_buf.astype(F32))
  bw = jnp.where(at_c[..., None, None], B.astype(F32)[:, None],
                 rstate.b_buf.astype(F32))
  dw = jnp.where(at_c[..., None], d_cur[:, None], rstate.dt_buf)
  return (jnp.where(valid[..., None, None], xw, 0.0),
          jnp.where(valid[..., None, None], bw, 0.0),
          jnp.where(valid[..., None], dw, 0.0))


def window_output(xw, bw, s, C):
  """The window's part of the output, sum_j s_j (B_j . C) x_j -> [b, h, p]
  (xw, bw from `replay_window`, s from `window_weights`)."""
  bc = jnp.einsum("bwgn,bgn->bwg", bw, C.astype(F32), precision=HIGHEST)
  bc = heads_from_groups(bc, xw.shape[2], axis=2)  # [b, w, h]
  return jnp.einsum("bwh,bwhp->bhp", s * bc, xw, precision=HIGHEST)


def _buffer_mask(count, length):
  return jnp.arange(length)[None, :] < count[:, None]  # [b, L]


def materialize(rstate: ReplayState, A, dtype=F32):
  """The current full state: checkpoint advanced over the buffered tokens.

  Rows whose count lies outside [0, L) (possible only under jit) are NaN.
  """
  valid = _buffer_mask(rstate.count, rstate.buffer_len)
  dw = jnp.where(valid[..., None], rstate.dt_buf, 0.0)
  xw = jnp.where(valid[..., None, None], rstate.x_buf.astype(F32), 0.0)
  bw = jnp.where(valid[..., None, None], rstate.b_buf.astype(F32), 0.0)
  state, _, _ = fold_window(rstate.checkpoint, xw, bw, dw, A)
  c = rstate.count
  in_range = (c >= 0) & (c < rstate.buffer_len)
  state = jnp.where(in_range[:, None, None, None], state, jnp.nan)
  return state.astype(dtype)


def write_slot(buf, value, idx, where=None):
  """buf[r, idx[r]] = value[r] for every row r (where given: only the rows
  with where[r]; the others keep the slot's old value)."""
  if where is None:
    def one(b, v, i):
      return jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0)
    return jax.vmap(one)(buf, value, idx)

  def masked(b, v, i, w):
    old = jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(
        b, jnp.where(w, v.astype(b.dtype), old), i, 0)
  return jax.vmap(masked)(buf, value, idx, where)


def flush_stores(rstate: ReplayState, new_state, flush, policy=None,
                 layer=0):
  """The stores of the flushing rows (`flush` [b] bool) of new_state
  (f32 [b, h, p, n]), as a flush makes them: the master in its dtype and,
  with a read copy, the copy (and scales) re-stored from the stored master;
  with stochastic rounding both rounded with the bits of (policy.seed,
  layer, row_id, step) at their store sites. Other rows keep theirs.

  Returns (the stored master of every row, dict of the new checkpoint,
  read_copy and read_scale fields).
  """
  sr = policy is not None and policy.stochastic_rounding
  shape = rstate.checkpoint.shape[1:]

  def sr_bits(site):
    return P.random_bits(policy.seed, layer, rstate.row_id, rstate.step,
                         shape, site, policy.sr_rng) if sr else None

  ck_dtype = rstate.checkpoint.dtype
  master = P.round_to(new_state, ck_dtype, sr_bits(P.SITE_MASTER)
                      if ck_dtype != jnp.dtype(F32) else None)
  flush4 = flush[:, None, None, None]
  fields = dict(checkpoint=jnp.where(flush4, master, rstate.checkpoint))
  if rstate.read_copy is not None:
    copy, scale = P.store(master.astype(F32), rstate.read_copy.dtype,
                          sr_bits(P.SITE_READ_COPY))
    fields["read_copy"] = jnp.where(flush4, copy, rstate.read_copy)
    if scale is not None:
      fields["read_scale"] = jnp.where(flush[:, None, None], scale,
                                       rstate.read_scale)
  return master, fields


def step_stores(rstate, new_state, flush, policy=None, layer=0) -> dict:
  """What one replay decode step writes besides its ring slots, for any
  replay state (Mamba-2, GDN, KDA): `flush_stores`' fields, the counter (0
  after a flush, + 1 otherwise) and, with stochastic-rounding counters,
  step + 1; rows whose count lies outside [0, L) keep count and step."""
  c, L = rstate.count, rstate.buffer_len
  in_range = (c >= 0) & (c < L)
  _, fields = flush_stores(rstate, new_state, flush, policy, layer)
  if rstate.step is not None:
    fields["row_id"] = rstate.row_id
    fields["step"] = jnp.where(in_range, rstate.step + 1,
                               rstate.step).astype(jnp.int32)
  fields["count"] = jnp.where(in_range, jnp.where(flush, 0, c + 1),
                              c).astype(jnp.int32)
  return fields


def replay_state_update(rstate: ReplayState, x, dt, A, B, C, D=None, z=None,
                        dt_bias=None, dt_softplus=False, policy=None,
                        layer=0):
  """ReplaySSM decode step (reference).

  Row r with count c = rstate.count[r]:
    * c < L - 1 (output-only route): y from checkpoint + buffer + current
      token, the token is appended at slot c, count -> c + 1; the checkpoint is
      left untouched.
    * c == L - 1 (flush route): the c buffered tokens and the current one are
      folded into a new checkpoint, y is read from it, count -> 0.
  Rows whose count lies outside [0, L) (only possible under jit, where values
  cannot be checked) get NaN outputs rather than a silently wrong answer, and
  keep their count (and checkpoint), so every later output of the row is NaN
  too instead of silently resuming from a state that lost tokens.

  Precision (`policy`, a validated `precision.PrecisionPolicy` matching the
  state, or None = round to nearest):
    * with a read copy, output-only rows read the dequantized read copy in
      place of the checkpoint (never the master); flush rows fold from the
      master + buffer, store the master in its dtype and the read copy
      re-quantized from the stored master;
    * with stochastic rounding, both flush stores round stochastically with
      bits keyed by (policy.seed, layer, row_id, step, element) (see
      `precision.random_bits`); `step` advances by one per in-range row.
  """
  L = rstate.buffer_len
  h = x.shape[1]
  c = rstate.count.astype(jnp.int32)
  d_cur = process_dt(dt, dt_bias, dt_softplus)  # [b, h]

  # Window = buffered slots [0, c) plus the current token logically at slot c.
  xw, bw, dw = replay_window(rstate, x, B, d_cur)
  new_state, decay, s = fold_window(rstate.checkpoint, xw, bw, dw, A)
  ch = heads_from_groups(C.astype(F32), h, axis=1)  # [b, h, n]

  # Output-only route: never forms the state, reads the read copy if any.
  if rstate.read_copy is None:
    read = rstate.checkpoint.astype(F32)
  else:
    read = P.load(rstate.read_copy, rstate.read_scale)
  readout = jnp.einsum("bhpn,bhn->bhp", read, ch, precision=HIGHEST)
  y_out = decay[..., None] * readout + window_output(xw, bw, s, C)
  # Flush route: read the output from the rebuilt state.
  y_flush = jnp.einsum("bhpn,bhn->bhp", new_state, ch, precision=HIGHEST)

  flush = c == L - 1
  y = jnp.where(flush[:, None, None], y_flush, y_out)
  y = _finish_output(y, x, D, z)
  in_range = (c >= 0) & (c < L)
  y = jnp.where(in_range[:, None, None], y, jnp.nan)

  slot_idx = jnp.clip(c, 0, L - 1)
  new_rstate = ReplayState(
      x_buf=write_slot(rstate.x_buf, x, slot_idx),
      b_buf=write_slot(rstate.b_buf, B, slot_idx),
      dt_buf=write_slot(rstate.dt_buf, d_cur, slot_idx),
      **step_stores(rstate, new_state, flush, policy, layer))
  return y.astype(x.dtype), new_rstate


def selective_state_update_stored(ssm_state, x, dt, A, B, C, D=None, z=None,
                                  dt_bias=None, dt_softplus=False, *,
                                  state_scale=None,
                                  stochastic_rounding=False, seed=0,
                                  layer=0, row_id=None, step=None,
                                  sr_rng="threefry"):
  """Baseline decode step whose state is *stored* in a low precision.

  The stored state (ssm_state in its dtype: f32/bf16/f16, or fp8 e4m3 /
  int8 with `state_scale` [b, h, p]) is loaded to f32, advanced one token
  in f32 and stored back in its dtype every step: round to nearest, or
  stochastic rounding keyed by (seed, layer, row_id, step, element) like a
  ReplayState flush (store site `precision.SITE_BASELINE`, hash `sr_rng`).
  This is the contrast of the precision study: the baseline rounds the
  state every step, replay once per L steps.

  Returns:
    (y [b, h, p] in x.dtype, new state in ssm_state.dtype, new scale
    [b, h, p] float32 or None).
  """
  state = P.load(ssm_state, state_scale)
  y, new = selective_state_update(state, x, dt, A, B, C, D, z, dt_bias,
                                  dt_softplus)
  bits = None
  if stochastic_rounding and jnp.dtype(ssm_state.dtype) != jnp.dtype(F32):
    bits = P.random_bits(seed, layer, row_id, step, ssm_state.shape[1:],
                         P.SITE_BASELINE, sr_rng)
  stored, scale = P.store(new, ssm_state.dtype, bits)
  return y, stored, scale
