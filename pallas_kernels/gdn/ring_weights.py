"""Pallas (Triton backend) kernel: the ring weights of the GDN replay step,
its first launch under `GDNConfig(ring_weights=True)`.

Row b with count c, value head h (key head hk); with the notation of
`replayssm_jax.gdn.replay` (H_j the log-decay sums over the live slots
j < c, G = H_{c-1} + g, w_j = exp(G - H_j)), the step's value columns
need, besides the checkpoint tile and the d ring,

  weights[b, h, 0, j] = w_j (k_j . k)  the coefficient of d_j in the
                                       correction kv = exp(G) S_0^T k + ...
  weights[b, h, 1, j] = w_j (k_j . q)  the coefficient of d_j in the output
  scalars[b, h, 0]    = exp(G)         the checkpoint readouts' decay
  scalars[b, h, 1]    = k . q          the current token's own d's weight
  scalars[b, h, 2:4]  = f_q, f_k       q f_q and k f_k are the normalised q
                                       and k (`common.norm_factors`)

(q, k normalised and q scaled as the step does), zero at slots j >= c:
the key and log-decay rings are loaded masked and the weights selected by
`jnp.where`, so a stale slot holding inf / NaN enters no product. They
depend only on the ring keys, the log-decays and the token's q, k and g,
never on the step's own result: the ring holds already-corrected d_j, so
the correction kv needs nothing the step computes, and the current
token's own d enters o through the scalar k . q alone. They are the same
for every value block.

One program per (key head, row) reduces the key ring against q and k once
and forms the weights of the key head's value heads; the step's
value-block programs then read 2 L + 2 floats each instead of loading the
[L, key_dim] key ring, reducing it twice and forming the decays again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.gdn import common

F32 = jnp.float32
# Warps of the weights kernel's programs (an [L, key_dim] key window each;
# untimed).
NUM_WARPS = 4


def _weights_kernel(kb_ref, gb_ref, cnt_ref, q_ref, k_ref, g_ref, *refs,
                    heads_per_key, use_l2norm, scale, has_rows=False):
  rows_ref, (w_ref, s_ref) = refs[0] if has_rows else None, refs[has_rows:]
  hk, b = pl.program_id(0), pl.program_id(1)
  sb, _ = common.state_row(rows_ref, b)  # the rings' row (token row: b)
  L, K = kb_ref.shape[1], kb_ref.shape[3]
  c = cnt_ref[sb]
  j = jnp.arange(L)
  hist = j < c
  # Every load first (common's docstring), then the math.
  qk = common.load_qk(q_ref, k_ref, b, hk)
  k_hist = plgpu.load(kb_ref.at[sb, :, hk, :], other=0.0,
                      mask=jnp.broadcast_to(hist[:, None], (L, K)))
  heads = [hk * heads_per_key + i for i in range(heads_per_key)]
  g_cur = [g_ref[b, h] for h in heads]
  g_hist = [plgpu.load(gb_ref.at[sb, :, h], mask=hist, other=0.0)
            for h in heads]
  fq, fk = common.norm_factors(qk, use_l2norm=use_l2norm, scale=scale)
  qn, kn = common.normalise_qk(qk, use_l2norm=use_l2norm, scale=scale,
                               factors=(fq, fk))
  k_hist = k_hist.astype(F32)
  kk = jnp.sum(k_hist * kn[None, :], axis=1)  # [L]
  kq = jnp.sum(k_hist * qn[None, :], axis=1)
  own = jnp.sum(kn * qn)
  for h, gc, gh in zip(heads, g_cur, g_hist):
    gw = jnp.where(j == c, gc.astype(F32), gh)  # zero past the current slot
    w = jnp.exp(tu.suffix_sums(gw, j))
    w_ref[b, h, 0, :] = jnp.where(hist, w * kk, 0.0)
    w_ref[b, h, 1, :] = jnp.where(hist, w * kq, 0.0)
    s_ref[b, h, 0] = jnp.exp(jnp.sum(gw))
    s_ref[b, h, 1] = own
    s_ref[b, h, 2] = fq
    s_ref[b, h, 3] = fk


def gdn_ring_weights(k_buf, g_buf, count, q, k, g, *, use_qk_l2norm=True,
                     scale=None, rows=None, interpret=False):
  """(weights [batch, HV, 2, L] f32, scalars [batch, HV, 4] f32) of the
  module docstring, from the key and log-decay rings ([batch, L, HK, K],
  [batch, L, HV]), the counters and the token's q, k ([batch, HK, K]) and
  g ([batch, HV]). A counter outside [0, L) gives meaningless weights (the
  step outputs NaN on such rows). rows: [batch] slots of the rings' and
  counters' rows (`common.Tile`), whose batch is then the pool's."""
  _, L, hk, _ = k_buf.shape
  batch, hv = q.shape[0], g_buf.shape[2]
  kernel = lambda *refs: _weights_kernel(
      *refs, heads_per_key=hv // hk, use_l2norm=use_qk_l2norm, scale=scale,
      has_rows=rows is not None)
  return pl.pallas_call(
      kernel,
      grid=(hk, batch),
      out_shape=(jax.ShapeDtypeStruct((batch, hv, 2, L), F32),
                 jax.ShapeDtypeStruct((batch, hv, 4), F32)),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS,
                                           num_stages=1),
      interpret=interpret,
      name="replayssm_gdn_ring_weights",
  )(k_buf, g_buf, count, q, k, g, *([] if rows is None else [rows]))
