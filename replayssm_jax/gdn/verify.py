"""Pure-JAX references of the GDN speculative verify (f32 accumulation).

`gdn_replay_verify_reference` computes the T window outputs of a
GDNReplayState from checkpoint + committed rings + the window and writes
the window's (d, k, g) behind the committed history, so that commit is a
counter move; `gdn_baseline_verify_reference` steps a full state through
the window keeping one state per position.

Window math (per value head; research notes §4.3): let S_h be the state
after the committed history (never formed on rows that do not flush), G_s
= g_0 + ... + g_s the window's log-decay prefix sums and, for any vector
x_s, h(x)_s = (exp(G_s) S_h)^T x_s (from the checkpoint and the rings, as
the decode step's). Unrolling the delta rule inside the window,

  d_s + sum_{i<s} A_si d_i = r_s,  A_si = beta_s exp(G_s - G_i) (k_i . k_s),
                                    r_s = beta_s (v_s - h(k)_s)

a unit-lower-triangular (I + A) system, solved by forward substitution, and

  o_s = h(q)_s + sum_{i<s} exp(G_s - G_i) (k_i . q_s) d_i + (k_s . q_s) d_s.

Earlier window tokens (i < s) enter with the rings' rounding (a decode step
would read them back from the rings), the position's own token as given:
with f32 rings this is exactly the stepwise form.

Early flush (as the Mamba-2 `replay_verify`): a row whose window would not
fit behind its history (count + T >= L) first folds its committed history
into the checkpoint (stored as a decode step's flush stores it) and places
the window at slot 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax.gdn.reference import (F32, HIGHEST, gdn_step_scan,
                                         prepare_qk)
from replayssm_jax.gdn.replay import fold, history
from replayssm_jax.reference import flush_stores, heads_from_groups


def _rounded(x, dtype):
  """x as read back from a ring of `dtype` (f32 values)."""
  return x.astype(dtype).astype(F32)


def solve_window(a, qk, beta, v, hk_, hq_, kh, qh, later, ring_dtype):
  """The forward substitution of a verify window and its outputs (the
  delta-rule windows of GDN and KDA share it):

    d_s = beta_s (v_s - h(k)_s) - sum_{i<s} a[s, i] d_i
    o_s = h(q)_s + sum_{i<s} qk[s, i] d_i + (k_s . q_s) d_s

  a, qk [b, T(s), T(i), HV] (zero where `later`: i >= s); beta [b, T, HV];
  v, hk_, hq_ [b, T, HV, V]; kh, qh [b, T, HV, K]; earlier updates enter
  rounded to `ring_dtype`, as the ring holds them. Returns (o, d, d as the
  ring holds it), each [b, T, HV, V] f32."""
  T = v.shape[1]
  r = beta.astype(F32)[..., None] * (v.astype(F32) - hk_)
  ds, d_prev = [], []
  for s in range(T):
    d = r[:, s]
    if s:
      d = d - jnp.einsum("bih,bihv->bhv", a[:, s, :s], jnp.stack(d_prev, 1),
                         precision=HIGHEST)
    ds.append(d)
    d_prev.append(_rounded(d, ring_dtype))
  d = jnp.stack(ds, 1)
  d_r = jnp.stack(d_prev, 1)
  own = jnp.sum(kh * qh, axis=-1)[..., None]  # [b, T, HV, 1]
  # Earlier tokens' updates: a select per (s, i) pair (T x T is small), so
  # a later token's d (NaN for a poisoned draft) never meets a zero weight.
  prev = jnp.sum(jnp.where(later[..., None], 0.0,
                           qk[..., None] * d_r[:, None]), axis=2)
  return hq_ + prev + own * d, d, d_r


def gdn_replay_verify_reference(rstate, q, k, v, g, beta, use_qk_l2norm=True,
                                scale=None, policy=None, layer=0):
  """Pure-JAX `gdn_replay_verify` (validated inputs; f32 accumulation).

  Returns (o [b, T, HV, V] in v.dtype, the state with the window pending
  behind the committed history: count unchanged, or 0 for rows that
  flushed early; rows whose count lies outside [0, L) output NaN and keep
  their count)."""
  L, T, hv = rstate.buffer_len, q.shape[1], v.shape[2]
  bdt = rstate.d_buf.dtype
  c = rstate.count.astype(jnp.int32)
  in_range = (c >= 0) & (c < L)

  # 1. Early flush of the committed history where the window does not fit.
  flush = c + T >= L
  d_h, k_h, g_h, live = history(rstate.d_buf, rstate.k_buf, rstate.g_buf, c)
  H = jnp.cumsum(g_h, axis=1)
  w = jnp.where(live[..., None], jnp.exp(H[:, -1:] - H), 0.0)
  folded = fold(rstate.checkpoint, d_h, k_h, w, jnp.exp(H[:, -1]))
  # Rows with no history fold nothing: they store nothing and (with a
  # read copy) read it like the rows that need no flush.
  folds = flush & in_range & (c > 0)
  master, extra = flush_stores(rstate, folded, folds, policy, layer)
  read = extra["checkpoint"].astype(F32)
  if rstate.read_copy is not None:  # folding rows: the stored master
    read = jnp.where(folds[:, None, None, None], master.astype(F32),
                     P.load(rstate.read_copy, rstate.read_scale))
  if rstate.step is not None:
    extra.update(row_id=rstate.row_id, step=rstate.step)
  base = jnp.where(flush, 0, c)  # committed tokens still in the rings

  # 2. History terms of every window position: h(k)_s and h(q)_s.
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)  # [b, T, HK, K]
  qh = heads_from_groups(qn, hv, axis=2)  # [b, T, HV, K]
  kh = heads_from_groups(kn, hv, axis=2)
  d_h, k_h, g_h, live = history(rstate.d_buf, rstate.k_buf, rstate.g_buf,
                                base)
  H = jnp.cumsum(g_h, axis=1)  # [b, L, HV]
  gw = g.astype(F32)
  G = jnp.cumsum(gw, axis=1)  # [b, T, HV]
  Gs = H[:, -1:] + G  # log-decay from the checkpoint through position s
  w_h = jnp.where(live[:, None, :, None],
                  jnp.exp(Gs[:, :, None] - H[:, None]), 0.0)  # [b, T, L, HV]

  def hist(x):  # x [b, T, HV, K] -> h(x) [b, T, HV, V]
    ck = jnp.einsum("bhkv,bshk->bshv", read, x, precision=HIGHEST)
    dots = jnp.einsum("blhk,bshk->bslh", k_h, x, precision=HIGHEST)
    return (jnp.exp(Gs)[..., None] * ck
            + jnp.einsum("bslh,blhv->bshv", w_h * dots, d_h,
                         precision=HIGHEST))

  hk_, hq_ = hist(kh), hist(qh)

  # 3. Forward substitution of (I + A) D = R over the window.
  causal = jnp.arange(T)[:, None] > jnp.arange(T)[None, :]  # s > i
  pair = jnp.where(causal[None, :, :, None],
                   jnp.exp(jnp.where(causal[None, :, :, None],
                                     G[:, :, None] - G[:, None], 0.0)),
                   0.0)  # [b, T(s), T(i), HV]
  k_prev = _rounded(kh, bdt)  # earlier tokens as the rings hold them
  # Pairs i >= s are selected away after the products: position s must
  # not see later tokens, whatever they hold.
  later = ~causal[None, :, :, None]
  a = jnp.where(later, 0.0, pair * jnp.einsum(
      "bihk,bshk->bsih", k_prev, kh, precision=HIGHEST))
  a = a * beta.astype(F32)[:, :, None]
  qk = jnp.where(later, 0.0, pair * jnp.einsum(
      "bihk,bshk->bsih", k_prev, qh, precision=HIGHEST))
  o, d, _ = solve_window(a, qk, beta, v, hk_, hq_, kh, qh, later, bdt)
  o = jnp.where(in_range[:, None, None, None], o, jnp.nan)

  # 4. The window's (d, k, g) into slots [base, base + T).
  def put(buf, win):
    def one(bf, x, i):
      return jax.lax.dynamic_update_slice_in_dim(bf, x.astype(bf.dtype), i,
                                                 0)
    return jax.vmap(one)(buf, win, jnp.clip(base, 0, L - T))

  new = rstate.replace(
      d_buf=put(rstate.d_buf, d), k_buf=put(rstate.k_buf, kn),
      g_buf=put(rstate.g_buf, gw),
      count=jnp.where(in_range, base, c).astype(jnp.int32),
      pending_window=T, **extra)
  return o.astype(v.dtype), new


def gdn_baseline_verify_reference(state, q, k, v, g, beta, use_qk_l2norm=True,
                                  scale=None):
  """The reference of `gdn_baseline_verify`: T reference baseline steps
  -> (o [b, T, HV, V], snapshots [b, T, HV, K, V] in state.dtype)."""
  return gdn_step_scan(state, q, k, v, g, beta, use_qk_l2norm, scale)
