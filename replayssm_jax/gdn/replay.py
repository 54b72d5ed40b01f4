"""Pure-JAX references of the GDN ReplaySSM decode step and materialize.

Notation: row r holds c = count[r] buffered tokens (d_j, k_j, g_j), j < c,
behind its checkpoint S_0; the current token is (q, k, v, g, beta) at slot
c. With H_j = g_0 + ... + g_j over the buffered slots and G = H_{c-1} + g
(the log-decay from the checkpoint through the current token), the state
before the current token, decayed by alpha = exp(g), is

  alpha S_{c-1} = exp(G) S_0 + sum_{j<c} w_j k_j d_j^T,  w_j = exp(G - H_j)

so, with x^T S meaning the readout S^T x,

  S_{c-1} correction:  kv = exp(G) S_0^T k + sum_j w_j (k_j . k) d_j
  corrected update:    d  = beta (v - kv)
  output:              o  = exp(G) S_0^T q + sum_j w_j (k_j . q) d_j
                            + (k . q) d

from the checkpoint and the buffer alone (no state is formed). A flush row
(c == L - 1) forms S = alpha S_{c-1} + k d^T, stores it as the new
checkpoint and reads o from it.
"""

from __future__ import annotations

import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax.gdn.reference import F32, HIGHEST, prepare_qk, readout
from replayssm_jax.gdn.state import GDNReplayState
from replayssm_jax.reference import heads_from_groups, step_stores, write_slot


def history(d_buf, k_buf, g_buf, count):
  """The buffered slots j < count of every row, f32, stale slots selected
  away (zeros) before any product: (d [b, L, HV, V], k per value head
  [b, L, HV, K], g [b, L, HV], mask [b, L])."""
  L, hv = d_buf.shape[1], d_buf.shape[2]
  live = jnp.arange(L)[None, :] < count[:, None]
  d = jnp.where(live[..., None, None], d_buf.astype(F32), 0.0)
  k = jnp.where(live[..., None, None], k_buf.astype(F32), 0.0)
  g = jnp.where(live[..., None], g_buf.astype(F32), 0.0)
  return d, heads_from_groups(k, hv, axis=2), g, live


def fold(checkpoint, d, k, w, decay):
  """decay S_0 + sum_j w_j k_j d_j^T -> [b, HV, K, V] f32 (w [b, L, HV]
  zero at masked slots; d, k as from `history`)."""
  return (decay[..., None, None] * checkpoint.astype(F32)
          + jnp.einsum("blh,blhk,blhv->bhkv", w, k, d, precision=HIGHEST))


def gdn_materialize(rstate: GDNReplayState, dtype=F32):
  """The current full state: the checkpoint advanced over the buffered
  tokens. Rows whose count lies outside [0, L) (only under jit) are NaN."""
  c = rstate.count.astype(jnp.int32)
  d, k, g, live = history(rstate.d_buf, rstate.k_buf, rstate.g_buf, c)
  H = jnp.cumsum(g, axis=1)
  total = H[:, -1]
  w = jnp.where(live[..., None], jnp.exp(total[:, None] - H), 0.0)
  state = fold(rstate.checkpoint, d, k, w, jnp.exp(total))
  in_range = (c >= 0) & (c < rstate.buffer_len)
  state = jnp.where(in_range[:, None, None, None], state, jnp.nan)
  return state.astype(dtype)


def window_dots(k_hist, x):
  """k_j . x for every buffered slot: k_hist [b, L, HV, K], x [b, HV, K]
  -> [b, L, HV]."""
  return jnp.einsum("blhk,bhk->blh", k_hist, x, precision=HIGHEST)


def weighted_updates(w, dots, d):
  """sum_j w_j dots_j d_j -> [b, HV, V]."""
  return jnp.einsum("blh,blhv->bhv", w * dots, d, precision=HIGHEST)


def gdn_replay_step(rstate: GDNReplayState, q, k, v, g, beta,
                    use_qk_l2norm=True, scale=None, policy=None, layer=0):
  """GDN ReplaySSM decode step (reference).

  Row r with count c:
    * c < L - 1 (output-only route): o and the correction from checkpoint
      (or its read copy) + buffer; (d, k, g) appended at slot c, count ->
      c + 1; the checkpoint is untouched.
    * c == L - 1 (flush route): the new state is folded from the master
      checkpoint + buffer + current token, stored (master and read copy, as
      `reference.flush_stores`), o read from it, count -> 0.
  Rows whose count lies outside [0, L) (only under jit) get NaN outputs
  and keep their count (and checkpoint), as `replay_state_update`.
  `step` (stochastic-rounding counters) advances by one per in-range row.

  Returns (o [b, HV, V] in v.dtype, new GDNReplayState).
  """
  L, hv = rstate.buffer_len, v.shape[1]
  c = rstate.count.astype(jnp.int32)
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=1)  # [b, HV, K]
  kh = heads_from_groups(kn, hv, axis=1)
  gt, bt = g.astype(F32), beta.astype(F32)
  d_h, k_h, g_h, live = history(rstate.d_buf, rstate.k_buf, rstate.g_buf, c)
  H = jnp.cumsum(g_h, axis=1)
  G = H[:, -1] + gt  # [b, HV]
  decay = jnp.exp(G)
  w = jnp.where(live[..., None], jnp.exp(G[:, None] - H), 0.0)
  kk, kq = window_dots(k_h, kh), window_dots(k_h, qh)
  hist_k = weighted_updates(w, kk, d_h)  # [b, HV, V]
  hist_q = weighted_updates(w, kq, d_h)
  own = jnp.sum(kh * qh, axis=-1)[..., None]  # k . q  [b, HV, 1]
  vf = v.astype(F32)

  def route(s0):  # (d, o) reading the checkpoint values s0
    d = bt[..., None] * (vf - (decay[..., None] * readout(s0, kh) + hist_k))
    o = decay[..., None] * readout(s0, qh) + hist_q + own * d
    return d, o

  flush = c == L - 1
  master = rstate.checkpoint
  d_m, _ = route(master)
  if rstate.read_copy is None:
    d_r, o_r = route(master)
  else:  # output-only rows read the read copy, never the master
    d_r, o_r = route(P.load(rstate.read_copy, rstate.read_scale))
  d = jnp.where(flush[:, None, None], d_m, d_r)
  new_state = fold(master, d_h, k_h, w, decay) + kh[..., :, None] * d_m[
      ..., None, :]
  o_flush = readout(new_state, qh)
  o = jnp.where(flush[:, None, None], o_flush, o_r)
  in_range = (c >= 0) & (c < L)
  o = jnp.where(in_range[:, None, None], o, jnp.nan)

  slot = jnp.clip(c, 0, L - 1)
  new = GDNReplayState(
      d_buf=write_slot(rstate.d_buf, d, slot),
      k_buf=write_slot(rstate.k_buf, kn, slot),
      g_buf=write_slot(rstate.g_buf, gt, slot),
      **step_stores(rstate, new_state, flush, policy, layer))
  return o.astype(v.dtype), new
