"""The window coefficients of the GDN speculative verify: formed by a first
launch (one program per key head and row, `gdn_verify_weights`) or inside
each window program, by the same functions.

Row b keeps `base` committed tokens in its rings (0 on rows that fold
first); for window position s of value head h (key head hk), with q_s and
k_s normalised (q scaled) as the models do, k~_i = k_i as the key ring
stores it, G_s = g_0 + ... + g_s (the window's log-decays), H = the
history's log-decay sum and P_j = sum_{j < i < base} g_i, the window
program needs, besides its checkpoint tile and its value columns of the d
ring,

  weights[b, h, 0, s, j]  w_sj (k_j . k_s)    w_sj = exp(G_s + P_j), j < base
  weights[b, h, 1, s, j]  w_sj (k_j . q_s)    (0 at j >= base)
  scalars[b, h, s, 0]     exp(H + G_s)        the checkpoint readouts' decay
  scalars[b, h, s, 1:3]   f_q, f_k            q_s f_q, k_s f_k normalised
  scalars[b, h, s, 3]     k_s . q_s           d_s's own weight in o_s
  scalars[b, h, s, 4 + i] beta_s exp(G_s - G_i) (k~_i . k_s)   i < s
  scalars[b, h, s, 4 + T + i] exp(G_s - G_i) (k~_i . q_s)      i < s

so that d_s = beta_s (v_s - exp(H + G_s) S^T k_s - sum_j w_sj (k_j . k_s)
d_j) - sum_{i<s} scalars[.., 4 + i] d~_i and o_s = exp(H + G_s) S^T q_s +
sum_j w_sj (k_j . q_s) d_j + sum_{i<s} scalars[.., 4 + T + i] d~_i + (k_s .
q_s) d_s (`gdn.verify`'s forward substitution). Every one of them depends
on the keys, queries and log-decays only, the same for each value block: a
window program that forms them itself reduces the key ring and the
window's keys against each other 2 T (L + 1) + T (T - 1) times, once per
value block and value head; the launch does it once per key head.
Stale slots (j >= base) are loaded masked and their weights selected by
`jnp.where`: an inf / NaN there enters no product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.gdn import common

F32 = jnp.float32
# Warps of the weights launch's programs (an [L, key_dim] key window each;
# untimed, as the ring-weights launch's).
NUM_WARPS = 4


def history_base(c, window, L):
  """The committed tokens left in the rings behind the window (0 where the
  window does not fit and the row folds first)."""
  return jnp.where(c + window >= L, 0, c)


def key_terms(q_win, k_win, k_hist, ring_dtype, *, use_l2norm, scale):
  """The head-independent terms of each window position s, from its q_s
  and k_s as stored ([key_dim] each) and the masked key ring k_hist [L,
  key_dim] f32, yielded in order (a generator: a window program that
  forms them itself interleaves them with its own work, as it would
  inline): (f_q, f_k, kk_s [L], kq_s [L], own_s, gkk_s, gkq_s) with the
  Gram lists gkk_s[i] = k~_i . k_s, gkq_s[i] = k~_i . q_s (i < s)."""
  kept = []
  for q, k in zip(q_win, k_win):
    fq, fk = common.norm_factors((q, k), use_l2norm=use_l2norm, scale=scale)
    qn, kn = common.normalise_qk((q, k), use_l2norm=use_l2norm, scale=scale,
                                 factors=(fq, fk))
    yield (fq, fk, jnp.sum(k_hist * kn[None, :], axis=1),
           jnp.sum(k_hist * qn[None, :], axis=1), jnp.sum(kn * qn),
           [jnp.sum(ki * kn) for ki in kept],
           [jnp.sum(ki * qn) for ki in kept])
    kept.append(kn.astype(ring_dtype).astype(F32))


def head_terms(keys, g_hist, hist, g_win, beta):
  """One value head's coefficients per window position s, yielded in
  order: (decay, f_q, f_k, own, a_s, c_s, wk_s [L], wq_s [L]) with a_s,
  c_s lists of length s (the module docstring's scalars 4 + i and 4 + T +
  i), from `key_terms` (its generator, or a list of its items), the
  head's masked log-decay ring g_hist [L] (hist: j < base) and its window
  g, beta (T scalars each)."""
  j = jnp.arange(g_hist.shape[0])
  suffix = tu.suffix_sums(g_hist, j)
  h_last = jnp.sum(g_hist)
  G, G_prev = jnp.float32(0.0), []
  for s, (fq, fk, kk, kq, own, gkk, gkq) in enumerate(keys):
    G = G + g_win[s].astype(F32)
    bs = beta[s].astype(F32)
    w = jnp.where(hist, jnp.exp(G + suffix), 0.0)
    pair = [jnp.exp(G - Gi) for Gi in G_prev]
    yield (jnp.exp(h_last + G), fq, fk, own,
           [bs * p * x for p, x in zip(pair, gkk)],
           [p * x for p, x in zip(pair, gkq)],
           jnp.where(hist, w * kk, 0.0), jnp.where(hist, w * kq, 0.0))
    G_prev.append(G)


def load_history(kb_ref, gb_ref, b, hk, heads, hist):
  """The masked key ring [L, key_dim] f32 of key head hk and the masked
  log-decay rings [L] of `heads` (slots j >= base read as 0)."""
  L, K = kb_ref.shape[1], kb_ref.shape[3]
  k_hist = plgpu.load(kb_ref.at[b, :, hk, :], other=0.0,
                      mask=jnp.broadcast_to(hist[:, None], (L, K)))
  return k_hist.astype(F32), [
      plgpu.load(gb_ref.at[b, :, h], mask=hist, other=0.0) for h in heads]


def _weights_kernel(kb_ref, gb_ref, cnt_ref, q_ref, k_ref, g_ref, beta_ref,
                    w_ref, s_ref, *, window, heads_per_key, use_l2norm,
                    scale):
  hk, b = pl.program_id(0), pl.program_id(1)
  L = kb_ref.shape[1]
  base = history_base(cnt_ref[b], window, L)
  hist = jnp.arange(L) < base
  heads = [hk * heads_per_key + i for i in range(heads_per_key)]
  # Every load first (common's docstring), then the math.
  q_win = [q_ref[b, s, hk, :] for s in range(window)]
  k_win = [k_ref[b, s, hk, :] for s in range(window)]
  g_win = [[g_ref[b, s, h] for s in range(window)] for h in heads]
  beta = [[beta_ref[b, s, h] for s in range(window)] for h in heads]
  k_hist, g_hist = load_history(kb_ref, gb_ref, b, hk, heads, hist)
  keys = list(key_terms(q_win, k_win, k_hist, kb_ref.dtype,
                        use_l2norm=use_l2norm, scale=scale))
  for n, h in enumerate(heads):
    for s, (decay, fq, fk, own, a, c, wk, wq) in enumerate(
        head_terms(keys, g_hist[n], hist, g_win[n], beta[n])):
      w_ref[b, h, 0, s, :] = wk
      w_ref[b, h, 1, s, :] = wq
      for i, x in enumerate((decay, fq, fk, own)):
        s_ref[b, h, s, i] = x
      for i, (ai, ci) in enumerate(zip(a, c)):
        s_ref[b, h, s, 4 + i] = ai
        s_ref[b, h, s, 4 + window + i] = ci


def load_weights(w_ref, s_ref, b, h, window):
  """One value head's coefficients as `head_terms` gives them, from the
  launch's outputs."""
  out = []
  for s in range(window):
    out.append((s_ref[b, h, s, 0], s_ref[b, h, s, 1], s_ref[b, h, s, 2],
                s_ref[b, h, s, 3],
                [s_ref[b, h, s, 4 + i] for i in range(s)],
                [s_ref[b, h, s, 4 + window + i] for i in range(s)],
                w_ref[b, h, 0, s, :], w_ref[b, h, 1, s, :]))
  return out


def gdn_verify_weights(k_buf, g_buf, count, q, k, g, beta, *,
                       use_qk_l2norm=True, scale=None, interpret=False):
  """(weights [batch, HV, 2, T, L] f32, scalars [batch, HV, T, 4 + 2 T]
  f32) of the module docstring, from the key and log-decay rings
  ([batch, L, HK, K], [batch, L, HV]), the counters and the window's q, k
  ([batch, T, HK, K]), g and beta ([batch, T, HV]); scalars 4 + i and 4 +
  T + i at i >= s are left unwritten (never read). A counter outside [0,
  L) gives meaningless coefficients (the window's outputs are NaN on such
  rows)."""
  batch, L, hk, _ = k_buf.shape
  hv, T = g_buf.shape[2], q.shape[1]
  kernel = lambda *refs: _weights_kernel(
      *refs, window=T, heads_per_key=hv // hk, use_l2norm=use_qk_l2norm,
      scale=scale)
  return pl.pallas_call(
      kernel,
      grid=(hk, batch),
      out_shape=(jax.ShapeDtypeStruct((batch, hv, 2, T, L), F32),
                 jax.ShapeDtypeStruct((batch, hv, T, 4 + 2 * T), F32)),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS,
                                           num_stages=1),
      interpret=interpret,
      name="replayssm_gdn_verify_weights",
  )(k_buf, g_buf, count, q, k, g, beta)
