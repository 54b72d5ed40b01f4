"""Pallas (Triton backend) kernel: the baseline GDN decode step.

One program per (value block, value head, row): read the [key_dim, block_v]
state tile, decay it, form the corrected update d = beta (v - S^T k) of
its columns, add k d^T, write the tile back in place (the state is aliased
input -> output: donated, the step updates it without a copy) and write
o = S^T q. q and k (key head h // (HV // HK)) are L2-normalised in f32
inside the kernel. With `GDNConfig.heads_per_program` each program steps
through that many value heads in a loop. Matches
`replayssm_jax.gdn.reference.gdn_step`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn import common
from pallas_kernels.gdn.config import GDNConfig, plan

F32 = jnp.float32


def _step_kernel(state_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, *refs,
                 heads_per_key, block_v, use_l2norm, scale,
                 heads_per_program=1, has_rows=False):
  # state_out_ref aliases state_ref (one HBM buffer on the GPU; a copy of
  # the input in interpret mode): read one, write the other. has_rows: a
  # [batch] slot input before the outputs (`common.Tile`).
  rows_ref, (o_ref, state_out_ref) = (refs[0] if has_rows else None,
                                      refs[has_rows:])
  tile = common.Tile(heads_per_key=heads_per_key, block_v=block_v,
                     rows_ref=rows_ref)

  def head(t):
    b, sb, h, vs = t.b, t.sb, t.h, t.vs
    # Every load first (common's docstring), then the math.
    s = plgpu.load(state_ref.at[sb, h, :, vs], eviction_policy="evict_first")
    qk = common.load_qk(q_ref, k_ref, b, t.hk)
    g, beta, v = g_ref[b, h], beta_ref[b, h], v_ref[b, h, vs]
    qn, kn = common.normalise_qk(qk, use_l2norm=use_l2norm, scale=scale)
    s = s.astype(F32) * jnp.exp(g.astype(F32))  # [K, block_v]
    d = beta.astype(F32) * (v.astype(F32) - common.readout(s, kn))
    s = s + kn[:, None] * d[None, :]
    o = common.readout(s, qn)

    common.when_live(t.live, lambda: plgpu.store(
        state_out_ref.at[sb, h, :, vs], s.astype(state_out_ref.dtype)))

    o_ref[b, h, vs] = jnp.where(t.live, o, jnp.nan).astype(o_ref.dtype)

  common.each_head(tile, heads_per_program, head)


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "scale",
                                             "config", "interpret"))
def gdn_step(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None, *,
             rows=None, config: GDNConfig | None = None,
             interpret: bool = False):
  """Same signature and results as `gdn.reference.gdn_step`, plus a tuning
  config; the state is updated in place (input_output_aliases: donate it
  to skip XLA's copy). rows: [batch] int32 slots of the state's rows
  (`replayssm_jax.slots`, effective: -1 for a padding row)."""
  _, hv, K, Vd = state.shape
  batch, hk = q.shape[0], q.shape[1]
  p = plan(config, K, Vd, rows=batch * hv, state_dtype=state.dtype,
           num_v_heads=hv)
  kernel = functools.partial(
      _step_kernel, heads_per_key=hv // hk, block_v=p.block_v,
      use_l2norm=use_qk_l2norm, scale=scale,
      heads_per_program=p.heads_per_program, has_rows=rows is not None)
  o, new_state = pl.pallas_call(
      kernel,
      grid=(Vd // p.block_v, hv // p.heads_per_program, batch),
      out_shape=(jax.ShapeDtypeStruct((batch, hv, Vd), v.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)),
      input_output_aliases={0: 1},
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps,
                                           num_stages=p.num_stages),
      interpret=interpret,
      name="replayssm_gdn_step",
  )(state, q, k, v, g, beta, *([] if rows is None else [rows]))
  return o, new_state
