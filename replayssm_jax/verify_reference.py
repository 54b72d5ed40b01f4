"""Pure-JAX references of the speculative verify window (f32 accumulation).

`replay_verify_reference` computes the T window outputs of a ReplayState
from its checkpoint + committed buffer + the window and writes the window
behind the history; `baseline_verify_reference` steps a full state through
the window keeping one state per position. `verify_terms`, `verify_readout`
and `verify_bc` are the pieces of the replay verify that the Pallas verify
kernel shares. The validated public ops are in `replayssm_jax.speculative`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax import reference
from replayssm_jax.reference import (F32, HIGHEST, _finish_output,
                                     fold_window, heads_from_groups,
                                     process_dt)
from replayssm_jax.state import ReplayState


def replay_verify_reference(rstate, x, dt, A, B, C, D=None, z=None,
                            dt_bias=None, dt_softplus=False, policy=None,
                            layer=0):
  """Pure-JAX `replay_verify` (validated inputs; f32 accumulation)."""
  L, T = rstate.buffer_len, x.shape[1]
  c = rstate.count.astype(jnp.int32)
  in_range = (c >= 0) & (c < L)
  slot = jnp.arange(L)[None, :]  # [1, L]

  # 1. Early flush of the committed history where the window would not fit.
  flush = c + T >= L
  hist = slot < c[:, None]
  folded, _, _ = fold_window(
      rstate.checkpoint,
      jnp.where(hist[..., None, None], rstate.x_buf.astype(F32), 0.0),
      jnp.where(hist[..., None, None], rstate.b_buf.astype(F32), 0.0),
      jnp.where(hist[..., None], rstate.dt_buf, 0.0), A)
  # The early flush stores as a decode step's flush does. Rows with no
  # history fold nothing: they store nothing and, with a read copy, read it
  # like the rows that need no flush.
  folds = flush & in_range & (c > 0)
  master, extra = reference.flush_stores(rstate, folded, folds, policy,
                                         layer)
  read = extra["checkpoint"]
  if rstate.read_copy is not None:  # folding rows: the stored master
    read = jnp.where(folds[:, None, None, None], master.astype(F32),
                     P.load(rstate.read_copy, rstate.read_scale))
  if rstate.step is not None:
    extra.update(row_id=rstate.row_id, step=rstate.step)
  base = jnp.where(flush, 0, c)  # committed tokens still in the buffer

  # 2. Window inputs into slots [base, base + T).
  d_win = process_dt(dt, dt_bias, dt_softplus)  # [b, T, h]

  def put(buf, win):
    def one(bf, w, i):
      return jax.lax.dynamic_update_slice_in_dim(bf, w.astype(bf.dtype), i,
                                                 0)
    return jax.vmap(one)(buf, win, jnp.clip(base, 0, L - T))
  x_buf, b_buf, dt_buf = (put(rstate.x_buf, x), put(rstate.b_buf, B),
                          put(rstate.dt_buf, d_win))

  # 3. Output of window position s: the checkpoint's readout, decayed over
  # the history and window tokens up to s, plus their own contributions.
  decay, own = verify_terms(rstate.x_buf, rstate.b_buf, rstate.dt_buf,
                            base, x, B, d_win, C, A)
  y = decay[..., None] * verify_readout(read, C) + own  # [b, T, h, p]
  y = _finish_output(y, x, D, z)
  y = jnp.where(in_range[:, None, None, None], y, jnp.nan)
  new = ReplayState(x_buf=x_buf, b_buf=b_buf, dt_buf=dt_buf,
                    count=jnp.where(in_range, base, c).astype(jnp.int32),
                    pending_window=T, **extra)
  return y.astype(x.dtype), new


def verify_terms(x_buf, b_buf, dt_buf, base, x, B, d_win, C, A,
                 form: str = "dot"):
  """Everything in the T window outputs but the checkpoint:
  y_s = decay_s * (S C_s) + extra_s, with S the (folded) checkpoint.

  Position s folds the row's committed history (buffer slots j < base) and
  the window tokens i <= s; earlier window tokens carry the buffer dtype's
  rounding (they are read back from it), the current one (i = s) is the
  caller's (as in the decode step).

  Args:
    x_buf, b_buf, dt_buf: the buffers before the window is appended
      ([b, L, h, p], [b, L, g, n], [b, L, h] processed dt).
    base: [b] int, committed slots still in the buffer.
    x: [b, T, h, p]; B, C: [b, T, g, n]; d_win: [b, T, h] processed dt.
    A: [h].

    form: "dot" (einsums over the slots) or "reduce" (elementwise products
      summed over the slots, which XLA emits as reduction fusions; the B.C
      products as `verify_bc`'s "reduce"). Both are f32 throughout.

  Returns:
    (decay [b, T, h], extra [b, T, h, p]), f32: sum_j w_sj (B_j . C_s) x_j
    over those slots, w_sj = d_j exp(A sum_{j < i <= s} d_i).
  """
  L, T, h = x_buf.shape[1], x.shape[1], x.shape[2]
  a = A.astype(F32)
  hist = jnp.arange(L)[None, :] < base[:, None]  # [b, L]
  # Stale slots (>= base) are selected away before any product: their
  # contents may be anything (a rejected draft's inf, NaN), and a zero
  # weight times inf is NaN.
  dh = jnp.where(hist[..., None], dt_buf.astype(F32), 0.0)  # [b, L, h]
  x_buf = jnp.where(hist[..., None, None], x_buf, jnp.zeros((), x_buf.dtype))
  b_buf = jnp.where(hist[..., None, None], b_buf, jnp.zeros((), b_buf.dtype))
  lam_h = jnp.cumsum(dh, axis=1) * a  # [b, L, h]
  lam_w = jnp.cumsum(d_win.astype(F32), axis=1) * a  # [b, T, h]
  lam = lam_h[:, -1:] + lam_w  # [b, T(s), h]: log-decay over slots <= s
  w_hist = dh[:, None] * jnp.exp(lam[:, :, None] - lam_h[:, None])
  causal = (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None, :, :,
                                                             None]
  w_win = d_win.astype(F32)[:, None] * jnp.exp(jnp.where(  # [b, T(s), T(i), h]
      causal, lam_w[:, :, None] - lam_w[:, None], 0.0))
  # B.C products in [b, T(s), slot, h] (head h reads its group's).
  to_heads = lambda v: heads_from_groups(  # noqa: E731
      jnp.transpose(v, (0, 3, 2, 1)), h, axis=3)
  bc_hist, bc_win, bc_own = verify_bc(b_buf, B, C, form=form)
  own = jnp.eye(T, dtype=bool)
  # The position's own token (i = s) with its B as given.
  bc_win = jnp.where(own, bc_own[:, :, None, :], bc_win)
  own = own[None, :, :, None]
  # Later window tokens (i > s) are selected away after the products:
  # position s must not see them, whatever they hold.
  k_win = jnp.where(causal, w_win * to_heads(bc_win), 0.0)  # [b, T(s), T(i), h]
  f = lambda v: v.astype(F32)  # noqa: E731
  k_hist = w_hist * to_heads(bc_hist)  # [b, T(s), L, h]
  earlier = causal & ~own
  x_prev = f(x.astype(x_buf.dtype))
  if form == "reduce":
    def weigh(k, v):  # [b, s, j, h] x [b, j, h, p] -> [b, s, h, p]
      return jnp.sum(k[..., None] * v[:, None], axis=2)
  else:
    def weigh(k, v):
      return jnp.einsum("bsjh,bjhp->bshp", k, v, precision=HIGHEST)
  # The window's earlier tokens: a select per (s, i) pair, T x T is small.
  prev = jnp.sum(jnp.where(earlier[..., None], k_win[..., None]
                           * x_prev[:, None], 0.0), axis=2)
  extra = (weigh(k_hist, f(x_buf)) + prev
           + jnp.einsum("bssh->bsh", k_win)[..., None] * f(x))
  return jnp.exp(lam), extra


def verify_readout(checkpoint, C):
  """The checkpoint read out against each window position's C: S C_s
  [b, T, h, p] f32 (f32 products and accumulation). Heads share their
  group's C, so the product runs per (row, group) over the group's heads'
  rows (one [h/g * p, n] x [n, T] product each), without C repeated per
  head."""
  b, h, p, n = checkpoint.shape
  T, g = C.shape[1], C.shape[2]
  ck = checkpoint.reshape(b, g, h // g, p, n).astype(F32)
  y = jnp.einsum("bgipn,bsgn->bsgip", ck, C.astype(F32), precision=HIGHEST)
  return y.reshape(b, T, h, p)


def verify_bc(b_buf, B, C, form: str = "dot"):
  """The B.C products of a verify window, per (row, group), in f32:
  history [b, g, L, T] (B as stored in the buffer, against each position's
  C), earlier window tokens [b, g, T(i), T(s)] (B rounded to the buffer
  dtype, as they are read back) and each position's own [b, g, T] (B as
  given). Reads the B buffer once per row, not once per head.

  form: "dot" (einsums; on the GPU XLA emits the history's as a GEMM
  fusion) or "reduce" (elementwise products summed over dstate, which XLA
  emits as reduction fusions). Both are f32 throughout."""
  if form not in ("dot", "reduce"):
    raise ValueError(f"form must be 'dot' or 'reduce', got {form!r}.")
  f = lambda v: v.astype(F32)  # noqa: E731
  c = f(C)  # [b, T, g, n]
  b_win = f(B.astype(b_buf.dtype))
  if form == "reduce":
    def prod(u, v):  # [b, i, g, n] x [b, s, g, n] -> [b, g, i, s]
      return jnp.transpose(jnp.sum(u[:, :, None] * v[:, None], axis=-1),
                           (0, 3, 1, 2))
    return (prod(f(b_buf), c), prod(b_win, c),
            jnp.transpose(jnp.sum(f(B) * c, axis=-1), (0, 2, 1)))
  hist = jnp.einsum("bjgn,bsgn->bgjs", f(b_buf), c, precision=HIGHEST)
  win = jnp.einsum("bign,bsgn->bgis", b_win, c, precision=HIGHEST)
  own = jnp.einsum("bsgn,bsgn->bgs", f(B), c, precision=HIGHEST)
  return hist, win, own


def baseline_verify_reference(ssm_state, x, dt, A, B, C, D=None, z=None,
                              dt_bias=None, dt_softplus=False):
  """The reference of `baseline_verify`: T reference baseline steps."""
  def step(state, tok):
    y, state = reference.selective_state_update(
        state, tok["x"], tok["dt"], A, tok["B"], tok["C"], D, tok["z"],
        dt_bias, dt_softplus)
    return state, (y, state)

  win = dict(x=x, dt=dt, B=B, C=C, z=z)
  win = {k: None if v is None else jnp.swapaxes(v, 0, 1)
         for k, v in win.items()}
  _, (ys, snaps) = jax.lax.scan(step, ssm_state, win)
  return jnp.swapaxes(ys, 0, 1), jnp.swapaxes(snaps, 0, 1)
