"""Pure-JAX references of the KDA ReplaySSM speculative verify and commit
(f32 accumulation).

`kda_replay_verify_reference` computes the T window outputs of a
KDAReplayState from checkpoint + committed ring + the window, and writes
the window behind the committed history; `kda_replay_commit_reference`
makes the first n window tokens history.

Window math (per value head; notation of `kda.replay`): the committed
history is c = base tokens behind the checkpoint S_0 with running
log-decay H. Window position s has gate g_s (per key channel), G_s = H +
g_0 + ... + g_s (summed in that order, as decode steps do) and, for a
vector x_s, the history term

  h(x)_s = (diag(exp(G_s - H)) S_h)^T x_s
         = S_0^T (exp(G_s) x_s) + sum_{j<c} (k~_j . exp(G_s) x_s) d_j

(no state formed). With D_si = exp(g_{i+1} + ... + g_s) per channel (i <
s, each a sum of the window's own gates, never a difference of large
totals), the delta rule unrolled inside the window is a unit
lower-triangular system solved by forward substitution:

  d_s + sum_{i<s} A_si d_i = beta_s (v_s - h(k)_s),
      A_si = beta_s (k_i . (D_si k_s))
  o_s = h(q)_s + sum_{i<s} (k_i . (D_si q_s)) d_i + (k_s . q_s) d_s.

Earlier window updates d_i enter as the ring would hold them (rounded to
its dtype), as in `gdn.verify`.

The gate bound. A window token is written to the ring as a pre-decayed
key exp(-G_s) k_s only while every gate of the row's window up to it stays
within the state's gate_lower_bound (so G_s >= (L - 1) lb, as the decode
step guarantees); from a row's first position p outside the bound the key
slots hold zeros (finite, never read). `KDAWindow` keeps the window's
normalised keys, gates, running log-decays and updates. Commit of n
tokens is a counter move when n <= p (count base + n, g_sum G_{n-1});
otherwise it refolds: the state after the n tokens,

  S_n = diag(exp(G_{n-1})) S_0 + sum_{j<c} (exp(G_{n-1}) k~_j) d_j^T
        + sum_{s<n} (D_{n-1,s} k_s) d_s^T      (D_{n-1,n-1} = 1),

is stored as a flush stores it (master, read copy, stochastic rounding at
the step of the last accepted token) and the count restarts at 0: the
decode step would have flushed at position p as well.

Early flush (as `gdn.verify`): a row whose window would not fit behind its
history (c + T >= L) first folds its history into the checkpoint and
places the window at slot 0 (H = 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from replayssm_jax import precision as P
from replayssm_jax.gdn.reference import F32, HIGHEST, prepare_qk
from replayssm_jax.gdn.verify import solve_window
from replayssm_jax.kda.replay import history, history_state
from replayssm_jax.kda.state import KDAReplayState
from replayssm_jax.reference import flush_stores, heads_from_groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KDAWindow:
  """What `kda_replay_commit` needs of a verified window besides the state
  (all f32; T from the shapes).

  Attributes:
    k: [batch, T, HV, K] the window's normalised keys per value head.
    g: [batch, T, HV, K] its gates.
    G: [batch, T, HV, K] the running log-decay from the checkpoint through
      each position (the g_sum after it).
    d: [batch, T, HV, V] its corrected updates as the ring holds them.
    stored: [batch] int32, the window positions written to the ring as
      pre-decayed keys (the first position whose gate leaves the bound,
      or T).
  """
  k: jax.Array
  g: jax.Array
  G: jax.Array
  d: jax.Array
  stored: jax.Array

  @property
  def window(self) -> int:
    return self.k.shape[1]


def _pair_decays(g):
  """D [b, T(s), T(i), HV, K]: exp(g_{i+1} + ... + g_s) for i < s, 1 on
  the diagonal, 0 above it (selected, so no gate of a later position
  enters)."""
  T = g.shape[1]
  m = jnp.arange(T)
  # terms m with i < m <= s
  inside = (m[None, None, :] > m[None, :, None]) & (
      m[None, None, :] <= m[:, None, None])  # [s, i, m]
  sums = jnp.sum(jnp.where(inside[None, ..., None, None], g[:, None, None],
                           0.0), axis=3)  # [b, s, i, HV, K]
  lower = (m[:, None] >= m[None, :])[None, ..., None, None]
  return jnp.where(lower, jnp.exp(jnp.where(lower, sums, 0.0)), 0.0)


def kda_replay_verify_reference(rstate: KDAReplayState, q, k, v, g, beta,
                                use_qk_l2norm=True, scale=None, policy=None,
                                layer=0):
  """Pure-JAX `kda_replay_verify` (validated inputs; f32 accumulation).

  Returns (o [b, T, HV, V] in v.dtype, the state with the window written
  behind the committed history: count unchanged, or 0 for rows that
  flushed early, KDAWindow). Rows whose count lies outside [0, L) output
  NaN and keep their count."""
  L, T, hv = rstate.buffer_len, q.shape[1], v.shape[2]
  bdt = rstate.d_buf.dtype
  c = rstate.count.astype(jnp.int32)
  in_range = (c >= 0) & (c < L)

  # 1. Early flush of the committed history where the window does not fit.
  flush = c + T >= L
  d_h, k_h, H = history(rstate, c)
  folds = flush & in_range & (c > 0)
  master, extra = flush_stores(
      rstate, history_state(rstate.checkpoint, d_h, k_h, H), folds, policy,
      layer)
  base = jnp.where(flush, 0, c)
  read = extra["checkpoint"].astype(F32)
  if rstate.read_copy is not None:  # folding rows read the stored master
    read = jnp.where(folds[:, None, None, None], master.astype(F32),
                     P.load(rstate.read_copy, rstate.read_scale))
  d_h, k_h, H = history(rstate, base)

  # 2. The window's keys, gates and running log-decays.
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=2)  # [b, T, HV, K]
  kh = heads_from_groups(kn, hv, axis=2)
  gw = g.astype(F32)
  G, run = [], H
  for s in range(T):
    run = run + gw[:, s]
    G.append(run)
  G = jnp.stack(G, 1)  # [b, T, HV, K]
  e = jnp.exp(G)

  def hist(x):  # h(x)_s [b, T, HV, V]
    y = e * x
    ck = jnp.einsum("bhkv,bshk->bshv", read, y, precision=HIGHEST)
    dots = jnp.einsum("blhk,bshk->bslh", k_h, y, precision=HIGHEST)
    return ck + jnp.einsum("bslh,blhv->bshv", dots, d_h, precision=HIGHEST)

  hk_, hq_ = hist(kh), hist(qh)

  # 3. Forward substitution over the window (pairs i >= s selected away
  # after the products: position s never sees a later token).
  D = _pair_decays(gw)
  later = ~(jnp.arange(T)[:, None] > jnp.arange(T)[None, :])[
      None, :, :, None]
  pair = lambda x: jnp.where(later, 0.0, jnp.einsum(
      "bihk,bsihk->bsih", kh, D * x[:, :, None], precision=HIGHEST))
  a = pair(kh) * beta.astype(F32)[:, :, None]
  qk = pair(qh)
  o, d, d_r = solve_window(a, qk, beta, v, hk_, hq_, kh, qh, later, bdt)
  o = jnp.where(in_range[:, None, None, None], o, jnp.nan)

  # 4. The window into slots [base, base + T): pre-decayed keys up to the
  # first position outside the gate bound, zeros from there.
  ok = jnp.all(gw >= rstate.gate_lower_bound, axis=(2, 3))  # [b, T]
  stored = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  keep = (jnp.arange(T)[None, :] < stored[:, None])[..., None, None]
  k_dec = jnp.where(keep, kh * jnp.exp(-jnp.where(keep, G, 0.0)), 0.0)

  def put(buf, win):
    def one(bf, x, i):
      return jax.lax.dynamic_update_slice_in_dim(bf, x.astype(bf.dtype), i,
                                                 0)
    return jax.vmap(one)(buf, win, jnp.clip(base, 0, L - T))

  if rstate.step is not None:
    extra.update(row_id=rstate.row_id, step=rstate.step)
  new = rstate.replace(
      d_buf=put(rstate.d_buf, jnp.where(in_range[:, None, None, None], d,
                                        0.0)),
      k_buf=put(rstate.k_buf, k_dec),
      g_sum=jnp.where(folds[:, None, None], 0.0, rstate.g_sum),
      count=jnp.where(in_range, base, c).astype(jnp.int32), **extra)
  window = KDAWindow(k=kh, g=gw, G=G, d=d_r, stored=stored.astype(jnp.int32))
  return o.astype(v.dtype), new, window


def kda_replay_commit_reference(rstate: KDAReplayState, window: KDAWindow,
                                num_accepted, policy=None, layer=0):
  """Pure-JAX `kda_replay_commit` (validated inputs): rows whose n
  accepted tokens all have stored keys move their counter; the others
  refold into a new checkpoint (module docstring). A row whose
  num_accepted lies outside [1, T] gets count -1."""
  T = window.window
  n = jnp.asarray(num_accepted, jnp.int32)
  ok = (n >= 1) & (n <= T)
  last = jnp.clip(n - 1, 0, T - 1)
  pick = lambda x: x[jnp.arange(x.shape[0]), last]  # position n - 1
  G_n = pick(window.G)  # [b, HV, K]
  refold = ok & (n > window.stored)

  # The state after the n accepted tokens (refold rows).
  d_h, k_h, _ = history(rstate, rstate.count.astype(jnp.int32))
  s_h = history_state(rstate.checkpoint, d_h, k_h, G_n)
  D = pick(_pair_decays(window.g))  # [b, T(i), HV, K]: D_{n-1, i}
  accepted = (jnp.arange(T)[None, :] < n[:, None])[..., None, None]
  kw = jnp.where(accepted, D * window.k, 0.0)
  dw = jnp.where(accepted, window.d, 0.0)
  s_n = s_h + jnp.einsum("bihk,bihv->bhkv", kw, dw, precision=HIGHEST)
  at_last = rstate if rstate.step is None else rstate.replace(
      step=rstate.step + n - 1)
  _, extra = flush_stores(at_last, s_n, refold, policy, layer)
  if rstate.step is not None:
    extra.update(row_id=rstate.row_id,
                 step=jnp.where(ok, rstate.step + n,
                                rstate.step).astype(jnp.int32))
  count = jnp.where(refold, 0, rstate.count + n)
  return rstate.replace(
      g_sum=jnp.where(refold[:, None, None], 0.0, G_n),
      count=jnp.where(ok, count, -1).astype(jnp.int32), **extra)
