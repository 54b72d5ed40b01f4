"""Pure-JAX references of the Kimi Delta Attention (KDA) ops (f32
accumulation).

KDA is Gated DeltaNet with a per-key-channel decay: the log-gate g_t of a
value head is a [K] vector instead of a scalar. Per value head h (key head
h // (HV // HK)), with the state S [K, V] (transformers' / fla's
recurrent_state layout) and alpha_t = exp(g_t) in R^K,

  d_t = beta_t (v_t - (diag(alpha_t) S_{t-1})^T k_t)   (corrected update)
  S_t = diag(alpha_t) S_{t-1} + k_t d_t^T
  o_t = S_t^T q_t

with q, k L2-normalised in f32 (x / sqrt(sum x^2 + 1e-6), fla's
`use_qk_l2norm_in_kernel`) and q then multiplied by `scale` (default
K ** -0.5).

Gate (Kimi Linear's forget gate): for the [HV * K] projection f of a token,
  g = -exp(A_log[h]) * softplus(f + dt_bias)   (softplus = x above 20)
which has no lower bound; fla's "safe gate" form bounds it:
  g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)),  in [lb, 0].

Chunked form (`kda_chunked_prefill`): inside a chunk with state S_0 at its
start and channel-wise cumulative log-decays G_i = sum_{j <= i} g_j [K],

  (I + A) D = R,  A_ij = beta_i sum_c k_i[c] exp(G_i - G_j)[c] k_j[c], j < i
                  R_i = beta_i (v_i - S_0^T (exp(G_i) k_i))
  o_i = S_0^T (exp(G_i) q_i) + sum_{j <= i} (q_i . exp(G_i - G_j) k_j) d_j
  S_C = diag(exp(G_C)) S_0 + sum_j (exp(G_C - G_j) k_j) d_j^T

The pairwise decays exp(G_i - G_j) (j <= i, so never above 1) are formed
directly from the differences: no exp(-G) factor that could overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replayssm_jax.gdn.reference import (F32, HIGHEST, causal_mix,
                                         prepare_qk, readout,
                                         solve_unit_lower, step_scan,
                                         time_chunks)
from replayssm_jax.reference import heads_from_groups, process_dt

SOFTPLUS_THRESHOLD = 20.0


def kda_gates(f, b, A_log, dt_bias, lower_bound=None):
  """(g f32 [..., HV, K], beta f32 [..., HV]).

  f: [..., HV, K] gate projection (f_b(f_a(x)) in Kimi Linear);
  b: [..., HV] (b_proj(x)); A_log: [HV]; dt_bias: [HV, K].
  lower_bound None: g = -exp(A_log) softplus(f + dt_bias) (Kimi Linear);
  a float lb < 0: g = lb * sigmoid(exp(A_log) (f + dt_bias)) (fla's safe
  gate, g in [lb, 0]).$
  """
  a = jnp.exp(A_log.astype(F32))[:, None]  # [HV, 1]
  if lower_bound is None:
    g = -a * process_dt(f, dt_bias, dt_softplus=True)
  else:
    x = f.astype(F32) + dt_bias.astype(F32)
    g = float(lower_bound) * jax.nn.sigmoid(a * x)
  return g, jax.nn.sigmoid(b.astype(F32))


def kda_step(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """Baseline KDA decode step (reads and writes the full state).

  Shapes: state [b, HV, K, V]; q, k [b, HK, K]; v [b, HV, V]; g [b, HV, K];
  beta [b, HV]. Returns (o [b, HV, V] in v.dtype, new state in
  state.dtype).
  """
  hv = v.shape[1]
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=1)  # [b, HV, K]
  kh = heads_from_groups(kn, hv, axis=1)
  o, s = delta_rule(state.astype(F32), qh, kh, v, g, beta)
  return o.astype(v.dtype), s.astype(state.dtype)


def delta_rule(s, qh, kh, v, g, beta):
  """One KDA step on an f32 state s [b, HV, K, V] with prepared (per value
  head) qh, kh [b, HV, K] -> (o [b, HV, V] f32, new state f32)."""
  s = s * jnp.exp(g.astype(F32))[..., None]
  d = beta.astype(F32)[..., None] * (v.astype(F32) - readout(s, kh))
  s = s + kh[..., :, None] * d[..., None, :]
  return readout(s, qh), s


def kda_step_scan(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """`gdn.reference.step_scan` of `kda_step`: T baseline steps ->
  (o [b, T, HV, V], snapshots [b, T, HV, K, V] in state.dtype)."""
  return step_scan(kda_step, state, q, k, v, g, beta, use_qk_l2norm, scale)


def kda_chunked_prefill(q, k, v, g, beta, chunk_size=64, initial_state=None,
                        valid=None, use_qk_l2norm=True, scale=None,
                        solve="substitution"):
  """Chunked KDA over a sequence (WY / UT form), == T `kda_step` calls.

  Shapes: q, k [b, T, HK, K]; v [b, T, HV, V]; g [b, T, HV, K]; beta
  [b, T, HV]; initial_state None (zeros) or [b, HV, K, V]; valid None or
  [b, T] bool. An invalid position leaves the state unchanged and outputs
  zeros: its inputs are selected away before any product (inf / NaN never
  reach the outputs or the state). Any T: the sequence is padded
  internally to a multiple of min(chunk_size, T). The chunks are scanned:
  one chunk's pairwise decays [b, C, C, HV, K] are live at a time. solve:
  as in `gdn.reference.solve_unit_lower`.

  Returns (o [b, T, HV, V] in v.dtype, final state [b, HV, K, V] f32).
  """
  b, T, _, K = k.shape
  hv, V = v.shape[2], v.shape[3]
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=2)  # [b, T, HV, K]
  kh = heads_from_groups(kn, hv, axis=2)
  vf, gf, bf = v.astype(F32), g.astype(F32), beta.astype(F32)
  if valid is not None:
    m = jnp.asarray(valid, bool)
    m3, m4 = m[:, :, None], m[:, :, None, None]
    qh, kh, vf, gf = (jnp.where(m4, x, 0.0) for x in (qh, kh, vf, gf))
    bf = jnp.where(m3, bf, 0.0)
  C = max(1, min(int(chunk_size), T))
  i_ge_j = (jnp.arange(C)[:, None] >= jnp.arange(C)[None, :])[
      None, :, :, None, None]  # [1, C(i), C(j), 1, 1]

  def body(s, xs):  # one chunk: the [C, C, K] pairwise decays live here only
    qc, kc, vc, gc, bc = xs  # [b, C, h, K] / [b, C, h, V] / [b, C, h]
    G = jnp.cumsum(gc, axis=1)  # [b, C, h, K]
    diff = G[:, :, None] - G[:, None, :]  # [b, i, j, h, K]
    # Pairs j > i are selected away before the exp (their diff is positive).
    decay = jnp.where(i_ge_j, jnp.exp(jnp.where(i_ge_j, diff, 0.0)), 0.0)
    kk = jnp.einsum("bihc,bijhc,bjhc->bijh", kc, decay, kc,
                    precision=HIGHEST)
    qk = jnp.einsum("bihc,bijhc,bjhc->bijh", qc, decay, kc,
                    precision=HIGHEST)
    a = bc[:, :, None, :] * kk  # diagonal ignored by the solve
    # One solve for both right-hand sides: beta v and beta exp(G) k.
    rhs = jnp.concatenate([bc[..., None] * vc,
                           bc[..., None] * jnp.exp(G) * kc], axis=-1)
    sol = solve_unit_lower(jnp.moveaxis(a, 3, 1),  # [b, h, i, j]
                           jnp.moveaxis(rhs, 2, 1),  # [b, h, C, V + K]
                           solve)
    sol = jnp.moveaxis(sol, 1, 2)
    u, w = sol[..., :V], sol[..., V:]  # [b, C, h, V], [b, C, h, K]
    g_last = G[:, -1]  # [b, h, K]
    d = u - jnp.einsum("bchk,bhkv->bchv", w, s, precision=HIGHEST)
    o = (jnp.einsum("bchk,bhkv->bchv", qc * jnp.exp(G), s, precision=HIGHEST)
         + causal_mix(qk, d))
    k_dec = kc * jnp.exp(g_last[:, None] - G)
    s = (jnp.exp(g_last)[..., None] * s
         + jnp.einsum("bchk,bchv->bhkv", k_dec, d, precision=HIGHEST))
    return s, o

  s0 = (jnp.zeros((b, hv, K, V), F32) if initial_state is None
        else initial_state.astype(F32))
  s, o = jax.lax.scan(body, s0, tuple(time_chunks(x, C)
                                      for x in (qh, kh, vf, gf, bf)))
  o = jnp.moveaxis(o, 0, 1).reshape((b, -1, hv, V))[:, :T]
  return o.astype(v.dtype), s
