"""Pure-JAX references of the KDA ReplaySSM decode step and materialize.

Notation: row r holds c = count[r] buffered tokens (d_j, k~_j =
exp(-G_j) k_j) behind its checkpoint S_0, and H = G_{c-1} (`g_sum`, 0 at
c = 0); the current token is (q, k, v, g, beta). With G = H + g and
e = exp(G) (channel-wise), the state before the current token decayed by
exp(g) reads

  (diag(exp(g)) S_{c-1})^T x = S_0^T (e x) + sum_{j<c} (k~_j . e x) d_j

so, from the checkpoint and the ring alone (no state is formed):

  correction:        kv = S_0^T (e k) + sum_j (k~_j . e k) d_j
  corrected update:  d  = beta (v - kv)
  output:            o  = S_0^T (e q) + sum_j (k~_j . e q) d_j + (k . q) d
  append:            k~_c = exp(-G) k,  g_sum <- G,  count <- c + 1.

A flush row (c == L - 1, or a gate below the state's gate_lower_bound in
any channel) forms the state of its history, S_{c-1} = diag(exp(H)) S_0 +
sum_j (exp(H) k~_j) d_j^T (exp(H) k~_j = exp(H - G_j) k_j, never above
|k_j|), steps it with the baseline rule, stores it as the new checkpoint
and restarts its count at 0.
"""

from __future__ import annotations

import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax.gdn.reference import F32, HIGHEST, prepare_qk, readout
from replayssm_jax.kda.reference import delta_rule
from replayssm_jax.kda.state import KDAReplayState
from replayssm_jax.reference import heads_from_groups, step_stores, write_slot


def history(rstate: KDAReplayState, count):
  """The live slots j < count of every row, f32, stale slots (and g_sum
  at count 0) selected away before any product: (d [b, L, HV, V],
  pre-decayed k [b, L, HV, K], H [b, HV, K])."""
  L = rstate.buffer_len
  live = (jnp.arange(L)[None, :] < count[:, None])[..., None, None]
  d = jnp.where(live, rstate.d_buf.astype(F32), 0.0)
  k = jnp.where(live, rstate.k_buf.astype(F32), 0.0)
  H = jnp.where((count > 0)[:, None, None], rstate.g_sum, 0.0)
  return d, k, H


def history_state(checkpoint, d, k, H):
  """diag(exp(H)) S_0 + sum_j (exp(H) k~_j) d_j^T -> [b, HV, K, V] f32."""
  e = jnp.exp(H)
  return (e[..., None] * checkpoint.astype(F32)
          + jnp.einsum("blhk,blhv->bhkv", e[:, None] * k, d,
                       precision=HIGHEST))


def kda_materialize(rstate: KDAReplayState, dtype=F32):
  """The current full state. Rows whose count lies outside [0, L) (only
  under jit) are NaN."""
  c = rstate.count.astype(jnp.int32)
  d, k, H = history(rstate, c)
  state = history_state(rstate.checkpoint, d, k, H)
  in_range = (c >= 0) & (c < rstate.buffer_len)
  state = jnp.where(in_range[:, None, None, None], state, jnp.nan)
  return state.astype(dtype)


def _hist_readout(s0, d, k, x):
  """S_0^T x + sum_j (k~_j . x) d_j -> [b, HV, V] (x [b, HV, K] f32)."""
  dots = jnp.einsum("blhk,bhk->blh", k, x, precision=HIGHEST)
  return readout(s0, x) + jnp.einsum("blh,blhv->bhv", dots, d,
                                     precision=HIGHEST)


def kda_replay_step(rstate: KDAReplayState, q, k, v, g, beta,
                    use_qk_l2norm=True, scale=None, policy=None, layer=0):
  """KDA ReplaySSM decode step (reference).

  Row r with count c:
    * c < L - 1 and every channel of g >= gate_lower_bound (output-only
      route): o and the correction from checkpoint (or its read copy) +
      ring; (d, exp(-G) k) appended at slot c, g_sum -> G, count -> c + 1;
      the checkpoint is untouched.
    * otherwise (flush route): the history state from the master + ring,
      one baseline step, stored (master and read copy, as
      `reference.flush_stores`), count -> 0.
  Rows whose count lies outside [0, L) (only under jit) get NaN outputs
  and keep their count, checkpoint and ring.

  Returns (o [b, HV, V] in v.dtype, new KDAReplayState).
  """
  L, hv = rstate.buffer_len, v.shape[1]
  c = rstate.count.astype(jnp.int32)
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=1)  # [b, HV, K]
  kh = heads_from_groups(kn, hv, axis=1)
  gt, bt, vf = g.astype(F32), beta.astype(F32), v.astype(F32)
  d_h, k_h, H = history(rstate, c)
  G = H + gt
  e = jnp.exp(G)
  in_range = (c >= 0) & (c < L)
  in_bound = jnp.all(gt >= rstate.gate_lower_bound, axis=(1, 2))
  flush = in_range & ((c == L - 1) | ~in_bound)

  s0 = (rstate.checkpoint if rstate.read_copy is None
        else P.load(rstate.read_copy, rstate.read_scale))
  kv = _hist_readout(s0, d_h, k_h, e * kh)
  d = bt[..., None] * (vf - kv)
  own = jnp.sum(kh * qh, axis=-1)[..., None]
  o_r = _hist_readout(s0, d_h, k_h, e * qh) + own * d

  s_hist = history_state(rstate.checkpoint, d_h, k_h, H)
  o_f, new_state = delta_rule(s_hist, qh, kh, vf, gt, bt)
  f3 = flush[:, None, None]
  o = jnp.where(f3, o_f, o_r)
  o = jnp.where(in_range[:, None, None], o, jnp.nan)

  append = in_range & ~flush
  a3 = append[:, None, None]
  # Flush rows' slot goes stale; zeros keep the ring finite.
  k_dec = jnp.where(a3, kh * jnp.exp(-jnp.where(a3, G, 0.0)), 0.0)
  slot = jnp.clip(c, 0, L - 1)
  new = KDAReplayState(
      d_buf=write_slot(rstate.d_buf, jnp.where(a3, d, 0.0), slot, in_range),
      k_buf=write_slot(rstate.k_buf, k_dec, slot, in_range),
      g_sum=jnp.where(a3, G, jnp.where(f3, 0.0, rstate.g_sum)),
      gate_lower_bound=rstate.gate_lower_bound,
      **step_stores(rstate, new_state, flush, policy, layer))
  return o.astype(v.dtype), new
