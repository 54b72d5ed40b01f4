"""Pallas (Triton backend) kernel: ReplaySSM decode step, both routes in one.

Grid: (headdim blocks x head blocks of one group, ngroups, batch). A program
owns `block_p` headdim rows of `heads_per_program` heads of one B/C group of
one row. It

  1. reads the row's counter c and decides its route (flush iff c == L-1);
  2. loads the group's B window (buffered slots < c, the current B at slot c)
     and forms bc_j = B_j . C once for all its heads;
  3. per head: loads the dt window, forms the weights
     s_j = d_j exp(A * sum_{i>j} d_i) and the decay exp(A * sum_i d_i), reads
     the checkpoint tile [P, N] and the x window, and writes
     y = decay * (S_0 C) + sum_j s_j bc_j x_j  (+ D x, * silu(z));
  4. flush rows fold the L tokens into a new checkpoint and store it; every
     other row appends (x, dt', B) at slot c and never touches the checkpoint.

The checkpoint and the buffers are aliased input->output and only the
elements named above are stored, so a non-flush step costs one checkpoint
read (no write). The new counters go to a fresh [batch] output (not aliased:
every program of a row reads the old counter). Matches
`replayssm_jax.reference.replay_state_update`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common

F32 = jnp.float32


def _replay_kernel(*refs, buffer_len, heads_per_program, heads_per_group,
                   block_p, has_D, has_z, has_bias, dt_softplus):
  it = iter(refs)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref = (next(it) for _ in range(5))
  x_ref, dt_ref, a_ref, b_ref, c_ref = (next(it) for _ in range(5))
  d_ref = next(it) if has_D else None
  z_ref = next(it) if has_z else None
  bias_ref = next(it) if has_bias else None
  # Aliased outputs (same HBM buffers as ck/xb/bb/dtb on GPU; copies of the
  # inputs in interpret mode): read the inputs, store to these.
  y_ref, ck_out, xb_out, bb_out, dtb_out, cnt_out = (next(it)
                                                     for _ in range(6))
  L = buffer_len
  pid, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nblk_p = ck_ref.shape[-2] // block_p
  pblk, blk = pid % nblk_p, pid // nblk_p
  ps = pl.ds(pblk * block_p, block_p)
  nstate = ck_ref.shape[-1]

  c = cnt_ref[b]
  flush = c == L - 1
  j = jnp.arange(L)
  hist = j < c  # buffered slots
  cur = j == c  # the current token's logical slot

  # Group-shared B window and its dot products with C (once per program).
  cv = c_ref[b, g, :].astype(F32)  # [N]
  b_cur = b_ref[b, g, :].astype(F32)  # [N]
  b_hist = plgpu.load(bb_ref.at[b, :, g, :],
                      mask=jnp.broadcast_to(hist[:, None], (L, nstate)),
                      other=0.0).astype(F32)  # [L, N]
  b_win = jnp.where(cur[:, None], b_cur[None, :], b_hist)
  bc = jnp.sum(b_win * cv[None, :], axis=1)  # [L]
  after = j[:, None] < j[None, :]  # [j, i]: i > j

  def one_head(r, carry):
    h = g * heads_per_group + blk * heads_per_program + r
    d_cur = common.process_dt(dt_ref[b, h], bias_ref[h] if has_bias else None,
                              dt_softplus)
    d_hist = plgpu.load(dtb_ref.at[b, :, h], mask=hist, other=0.0)  # [L]
    dw = jnp.where(cur, d_cur, d_hist)  # zero past the current slot
    a = a_ref[h].astype(F32)
    suffix = jnp.sum(jnp.where(after, dw[None, :], 0.0), axis=1)  # [L]
    s = dw * jnp.exp(a * suffix)  # [L]
    decay = jnp.exp(a * jnp.sum(dw))

    x_cur = x_ref[b, h, ps].astype(F32)  # [block_p]
    x_hist = plgpu.load(xb_ref.at[b, :, h, ps],
                        mask=jnp.broadcast_to(hist[:, None], (L, block_p)),
                        other=0.0).astype(F32)  # [L, block_p]
    x_win = jnp.where(cur[:, None], x_cur[None, :], x_hist)
    s0 = plgpu.load(ck_ref.at[b, h, ps],
                    eviction_policy="evict_first").astype(F32)  # [block_p, N]
    readout = jnp.sum(s0 * cv[None, :], axis=1)  # [block_p]
    y = decay * readout + jnp.sum((s * bc)[:, None] * x_win, axis=0)
    y = common.finish_output(y, x_cur, d_ref[h] if has_D else None,
                             z_ref[b, h, ps] if has_z else None)
    y_ref[b, h, ps] = y.astype(y_ref.dtype)

    @pl.when(flush)
    def _fold():
      # New checkpoint = decay * S_0 + sum_j s_j x_j B_j^T over the L tokens
      # (L-1 buffered + current); exact f32 rank-1 updates, no tf32 dot.
      st = decay * s0
      for jj in range(L - 1):
        s_j = jnp.sum(jnp.where(j == jj, s, 0.0))
        x_j = xb_ref[b, jj, h, ps].astype(F32)
        b_j = bb_ref[b, jj, g, :].astype(F32)
        st = st + (s_j * x_j)[:, None] * b_j[None, :]
      s_last = jnp.sum(jnp.where(j == L - 1, s, 0.0))
      st = st + (s_last * x_cur)[:, None] * b_cur[None, :]
      plgpu.store(ck_out.at[b, h, ps], st.astype(ck_out.dtype))

    @pl.when(jnp.logical_not(flush))
    def _append():
      xb_out[b, c, h, ps] = x_ref[b, h, ps].astype(xb_out.dtype)

    @pl.when(jnp.logical_not(flush) & (pblk == 0))
    def _append_dt():
      dtb_out[b, c, h] = d_cur

    return carry

  lax.fori_loop(0, heads_per_program, one_head, 0)

  @pl.when(jnp.logical_not(flush) & (pid == 0))
  def _append_b():
    bb_out[b, c, g, :] = b_ref[b, g, :].astype(bb_out.dtype)

  @pl.when((g == 0) & (pid == 0))
  def _count():
    cnt_out[b] = jnp.where(flush, 0, c + 1).astype(cnt_out.dtype)


def default_heads_per_program(batch: int, nheads: int, ngroups: int) -> int:
  """Whole groups per program once there are enough programs to fill the
  GPU; fewer heads per program (more programs) at small batch."""
  per_group = nheads // ngroups
  hb = per_group
  # Aim for >= 4 programs per SM (~132 SMs on H100/H200).
  while hb > 1 and batch * nheads // hb < 4 * 132:
    hb //= 2
  return hb


@functools.partial(jax.jit, static_argnames=("dt_softplus", "config",
                                             "interpret"))
def replay_state_update(rstate, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                        dt_softplus=False, *,
                        config: common.ReplayConfig = common.ReplayConfig(),
                        interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config."""
  from replayssm_jax.state import ReplayState  # pylint: disable=g-import-not-at-top
  batch, nheads, headdim, _ = rstate.checkpoint.shape
  ngroups = rstate.ngroups
  per_group = nheads // ngroups
  block_p = common.resolve_block_p(config.block_p, headdim)
  hb = config.heads_per_program or default_heads_per_program(
      batch, nheads, ngroups)
  if per_group % hb:
    raise NotImplementedError(
        f"heads_per_program ({hb}) must divide nheads // ngroups "
        f"({per_group}).")
  operands = [rstate.checkpoint, rstate.x_buf, rstate.b_buf, rstate.dt_buf,
              rstate.count, x, dt, A, B, C]
  operands += [v for v in (D, z, dt_bias) if v is not None]
  kernel = functools.partial(
      _replay_kernel, buffer_len=rstate.buffer_len, heads_per_program=hb,
      heads_per_group=per_group, block_p=block_p, has_D=D is not None, has_z=z is not None,
      has_bias=dt_bias is not None, dt_softplus=dt_softplus)
  sds = jax.ShapeDtypeStruct
  y, ck, xb, bb, dtb, cnt = pl.pallas_call(
      kernel,
      grid=((headdim // block_p) * (per_group // hb), ngroups, batch),
      out_shape=(sds((batch, nheads, headdim), x.dtype),
                 sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),
                 sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                 sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                 sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                 sds(rstate.count.shape, rstate.count.dtype)),
      input_output_aliases={0: 1, 1: 2, 2: 3, 3: 4},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="replayssm_replay_state_update",
  )(*operands)
  return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                        count=cnt)
