"""Pure-JAX references of the Gated DeltaNet (GDN) ops (f32 accumulation).

These functions assume validated inputs (see `replayssm_jax.gdn.ops` for the
public, checked entry points). Everything is computed in float32 whatever
the input and storage dtypes; results are cast to the output / storage dtype
at the end.

Layout and math, per value head h (key head h // (HV // HK), as
transformers' repeat_interleave): the state S is [K, V] (transformers' /
fla's recurrent_state layout), alpha_t = exp(g_t),

  d_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)     (the corrected update)
  S_t = alpha_t S_{t-1} + k_t d_t^T
  o_t = S_t^T q_t

with q and k L2-normalised in f32 (x * rsqrt(sum x^2 + 1e-6), as fla's
`use_qk_l2norm_in_kernel`) and q then multiplied by `scale` (default
K ** -0.5; the scale applies with or without the normalisation).

Chunked form (`gdn_chunked_prefill`): inside a chunk with state S_0 at its
start and cumulative log-decays G_i = sum_{j <= i} g_j,

  (I + A) D = R,  A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i,
                  R_i = beta_i (v_i - exp(G_i) S_0^T k_i)
  o_i = exp(G_i) S_0^T q_i + sum_{j <= i} exp(G_i - G_j) (k_j . q_i) d_j
  S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j d_j^T

(the WY / UT form: one unit-lower-triangular solve per chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from replayssm_jax.reference import HIGHEST, heads_from_groups, process_dt

F32 = jnp.float32
L2NORM_EPS = 1e-6


def l2norm(x, eps: float = L2NORM_EPS):
  """x * rsqrt(sum(x^2, -1) + eps) in float32 (fla's / transformers')."""
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q, k, use_qk_l2norm: bool = True, scale=None):
  """(q normalised then scaled, k normalised), both float32."""
  qf, kf = q.astype(F32), k.astype(F32)
  if use_qk_l2norm:
    qf, kf = l2norm(qf), l2norm(kf)
  s = q.shape[-1] ** -0.5 if scale is None else float(scale)
  return qf * s, kf


def gdn_gates(a, b, A_log, dt_bias):
  """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), float32.

  a, b: [..., HV]; A_log, dt_bias: [HV]. softplus is the identity above
  20 (torch's threshold)."""
  sp = process_dt(a, dt_bias, dt_softplus=True)
  g = -jnp.exp(A_log.astype(F32)) * sp
  return g, jax.nn.sigmoid(b.astype(F32))


def readout(state, x):
  """S^T x per head: state [b, h, K, V] (any float), x [b, h, K] f32 ->
  [b, h, V] f32."""
  return jnp.einsum("bhkv,bhk->bhv", state.astype(F32), x, precision=HIGHEST)


def gdn_step(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """Baseline GDN decode step (reads and writes the full state).

  Shapes: state [b, HV, K, V]; q, k [b, HK, K]; v [b, HV, V]; g, beta
  [b, HV]. Returns (o [b, HV, V] in v.dtype, new state in state.dtype).
  """
  hv = v.shape[1]
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)
  qh = heads_from_groups(qn, hv, axis=1)  # [b, HV, K]
  kh = heads_from_groups(kn, hv, axis=1)
  s = state.astype(F32) * jnp.exp(g.astype(F32))[..., None, None]
  d = beta.astype(F32)[..., None] * (v.astype(F32) - readout(s, kh))
  s = s + kh[..., :, None] * d[..., None, :]
  o = readout(s, qh)
  return o.astype(v.dtype), s.astype(state.dtype)


def step_scan(step, state, q, k, v, g, beta, use_qk_l2norm=True,
              scale=None):
  """T baseline steps of `step` (a delta-rule decode step: `gdn_step`,
  `kda.reference.kda_step`) over [b, T, ...] inputs -> (o [b, T, HV, V],
  snapshots [b, T, HV, K, V] in state.dtype: the state after each
  position)."""
  def body(s, tok):
    o, s = step(s, *tok, use_qk_l2norm=use_qk_l2norm, scale=scale)
    return s, (o, s)

  toks = tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v, g, beta))
  _, (o, snaps) = jax.lax.scan(body, state, toks)
  return jnp.swapaxes(o, 0, 1), jnp.swapaxes(snaps, 0, 1)


def gdn_step_scan(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """`step_scan` of `gdn_step`."""
  return step_scan(gdn_step, state, q, k, v, g, beta, use_qk_l2norm, scale)


SOLVES = ("substitution", "inverse")
INVERSE_BLOCK = 16  # `invert_unit_lower`'s largest block by products


def invert_unit_lower(a, precision=HIGHEST):
  """(I + a)^-1, unit lower triangular, for a [..., C, C] strictly lower
  triangular (entries on and above the diagonal are ignored) by matrix
  products alone: a block of up to INVERSE_BLOCK rows as the product
  (I - a)(I + a^2)(I + a^4)... (a is nilpotent: the series
  sum_k (-a)^k ends at k = C - 1), a larger one by halves,
  [[T11, 0], [T21, T22]]^-1 = [[T11^-1, 0], [-T22^-1 T21 T11^-1, T22^-1]]."""
  c = a.shape[-1]
  mm = functools.partial(jnp.matmul, precision=precision)

  def invert(a):  # a strictly lower triangular, as its diagonal blocks
    c = a.shape[-1]
    if c <= INVERSE_BLOCK:
      inv, p, n = jnp.eye(c, dtype=a.dtype) - a, a, 2
      while n < c:
        p = mm(p, p)  # a^n
        inv = inv + mm(inv, p)  # covers the powers below 2n
        n *= 2
      return inv
    h = c // 2
    t11, t22 = invert(a[..., :h, :h]), invert(a[..., h:, h:])
    t21 = -mm(mm(t22, a[..., h:, :h]), t11)
    zero = jnp.zeros(t11.shape[:-1] + (c - h,), a.dtype)
    return jnp.concatenate([jnp.concatenate([t11, zero], -1),
                            jnp.concatenate([t21, t22], -1)], -2)

  return invert(jnp.where(jnp.tri(c, k=-1, dtype=bool), a, 0.0))


def causal_mix(w, d, precision=HIGHEST):
  """o[b, i, h] = sum_{j <= i} w[b, i, j, h] d[b, j, h] (w [b, C, C, h], d
  [b, C, h, V]): pairs j > i are selected away, and a non-finite d_j
  enters as 0 and makes positions >= j NaN, so position i never reads a
  later position's inf / NaN (0 times NaN would)."""
  c = w.shape[1]
  w = jnp.where(jnp.tri(c, dtype=bool)[None, :, :, None], w, 0.0)
  bad = ~jnp.all(jnp.isfinite(d), axis=-1)  # [b, C, h]
  o = jnp.einsum("bijh,bjhv->bihv", w, jnp.where(bad[..., None], 0.0, d),
                 precision=precision)
  return jnp.where((jnp.cumsum(bad, axis=1) > 0)[..., None], jnp.nan, o)


def solve_unit_lower(a, y, solve: str = "substitution", precision=HIGHEST):
  """X with (I + a) X = y; a [..., C, C] strictly lower triangular (entries
  on and above the diagonal are ignored), y [..., C, n]. solve:
  "substitution" (a triangular solve) or "inverse" (`invert_unit_lower`,
  then one product: matrix products only, as flash-linear-attention's
  chunked kernels form the WY system's inverse)."""
  c = a.shape[-1]
  if solve == "inverse":
    # The products would multiply a later row's inf / NaN by the zeros
    # above the diagonal: such rows enter as zeros, and their solutions and
    # every later one become NaN (as substitution makes them).
    bad = (jnp.any(jnp.tri(c, k=-1, dtype=bool) & ~jnp.isfinite(a), axis=-1)
           | ~jnp.all(jnp.isfinite(y), axis=-1))  # [..., C]
    x = jnp.matmul(invert_unit_lower(jnp.where(jnp.isfinite(a), a, 0.0),
                                     precision),
                   jnp.where(bad[..., None], 0.0, y), precision=precision)
    return jnp.where((jnp.cumsum(bad, axis=-1) > 0)[..., None], jnp.nan, x)
  eye = jnp.eye(c, dtype=a.dtype)
  lower = jnp.tril(a, -1) + eye
  return jax.lax.linalg.triangular_solve(lower, y, left_side=True,
                                         lower=True, unit_diagonal=True)


def time_chunks(x, size: int):
  """[b, T, ...] -> [n, b, size, ...]: the time axis zero padded to a
  multiple of `size` and split into n chunks, chunk-major."""
  b, t = x.shape[:2]
  x = jnp.pad(x, [(0, 0), (0, (-t) % size)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((b, -1, size) + x.shape[2:]), 1, 0)


def gdn_chunked_prefill(q, k, v, g, beta, chunk_size=64, initial_state=None,
                        valid=None, use_qk_l2norm=True, scale=None,
                        precision=HIGHEST, solve="substitution"):
  """Chunked GDN over a sequence (WY / UT form), == T `gdn_step` calls.

  Shapes: q, k [b, T, HK, K]; v [b, T, HV, V]; g, beta [b, T, HV];
  initial_state None (zeros) or [b, HV, K, V]; valid None or [b, T] bool.
  An invalid position leaves the state unchanged and outputs zeros: its
  inputs are selected away before any product (inf / NaN never reach the
  outputs or the state). Any T: the sequence is padded internally to a
  multiple of min(chunk_size, T).

  precision: of the f32 products (as `ssd.ssd_chunked_scan`'s).
  solve: how each chunk's unit-lower-triangular system is solved
  (`solve_unit_lower`).

  Returns (o [b, T, HV, V] in v.dtype, final state [b, HV, K, V] f32).
  """
  b, T, _, K = k.shape
  hv, V = v.shape[2], v.shape[3]
  qn, kn = prepare_qk(q, k, use_qk_l2norm, scale)  # [b, T, HK, K]
  vf, gf, bf = v.astype(F32), g.astype(F32), beta.astype(F32)
  if valid is not None:
    m = jnp.asarray(valid, bool)
    m3, m4 = m[:, :, None], m[:, :, None, None]
    qn, kn, vf = (jnp.where(m4, x, 0.0) for x in (qn, kn, vf))
    gf, bf = jnp.where(m3, gf, 0.0), jnp.where(m3, bf, 0.0)
  C = max(1, min(int(chunk_size), T))
  qg, kg, vc, gc, bc = (time_chunks(x, C) for x in (qn, kn, vf, gf, bf))
  to_v = lambda x, axis: heads_from_groups(x, hv, axis)  # noqa: E731
  qc, kc = to_v(qg, 3), to_v(kg, 3)  # [n, b, C, HV, K]
  G = jnp.cumsum(gc, axis=2)  # [n, b, C, h]
  i_ge_j = (jnp.arange(C)[:, None] >= jnp.arange(C)[None, :])[
      None, None, :, :, None]  # [1, 1, C(i), C(j), 1]
  diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [n, b, i, j, h]
  # Pairs j > i are selected away before the exp (their diff is positive).
  decay = jnp.where(i_ge_j, jnp.exp(jnp.where(i_ge_j, diff, 0.0)), 0.0)
  # Key products once per key head (its value heads share q and k), then
  # read by each value head.
  kk = to_v(jnp.einsum("nbihk,nbjhk->nbijh", kg, kg, precision=precision), 4)
  qk = to_v(jnp.einsum("nbihk,nbjhk->nbijh", qg, kg, precision=precision),
            4) * decay
  a = bc[:, :, :, None, :] * decay * kk  # diagonal ignored by the solve
  # One solve for both right-hand sides: beta v and beta exp(G) k.
  rhs = jnp.concatenate([bc[..., None] * vc,
                         (bc * jnp.exp(G))[..., None] * kc], axis=-1)
  to_mat = lambda x: jnp.moveaxis(x, 4, 2)  # noqa: E731  [n, b, h, i, j]
  rhs = jnp.moveaxis(rhs, 3, 2)  # [n, b, h, C, V + K]
  sol = jnp.moveaxis(solve_unit_lower(to_mat(a), rhs, solve, precision), 2,
                    3)
  u, w = sol[..., :V], sol[..., V:]  # [n, b, C, h, V], [n, b, C, h, K]
  q_dec = qc * jnp.exp(G)[..., None]
  g_last = G[:, :, -1]  # [n, b, h]
  k_dec = kc * jnp.exp(g_last[:, :, None] - G)[..., None]

  def body(s, xs):
    u, w, q_dec, k_dec, qk, g_last = xs
    d = u - jnp.einsum("bchk,bhkv->bchv", w, s, precision=precision)
    o = (jnp.einsum("bchk,bhkv->bchv", q_dec, s, precision=precision)
         + causal_mix(qk, d, precision))
    s = (jnp.exp(g_last)[..., None, None] * s
         + jnp.einsum("bchk,bchv->bhkv", k_dec, d, precision=precision))
    return s, o

  s0 = (jnp.zeros((b, hv, K, V), F32) if initial_state is None
        else initial_state.astype(F32))
  s, o = jax.lax.scan(body, s0, (u, w, q_dec, k_dec, qk, g_last))
  o = jnp.moveaxis(o, 0, 1).reshape((b, -1, hv, V))[:, :T]
  return o.astype(v.dtype), s
