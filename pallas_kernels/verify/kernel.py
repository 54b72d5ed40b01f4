"""Pallas (Triton backend) kernels: speculative verify on a ReplayState.

Matches `replayssm_jax.verify_reference.replay_verify_reference`. Two kernels,
both launched every verify, rows routed by data:

* fold kernel (rows whose window does not fit behind their history,
  count + T >= L, with count > 0): folds the committed history into the
  checkpoint and stores it (the window's only checkpoint write). A fixed
  persistent grid shares out the folding rows' (row, head, headdim block)
  items, as the replay step's flush route; the fold is one tensor-core dot
  where L and block_p >= 16 (`replay.fold.fold_product`), else exact f32 rank-1
  updates.
* window kernel (every row; grid headdim blocks x heads of one group,
  ngroups, batch: one head per program): the T window outputs
  y_s = decay_s * (S C_s) + extra_s, where XLA forms decay and extra (the
  history and window terms, `verify_reference.verify_terms`) before the kernel
  and the kernel reads the folded checkpoint S out against the T
  positions' C; then appends the window's inputs behind the history. The
  checkpoint is only read.

T, L, headdim and dstate must be powers of two (Triton blocks).

A precision policy (read copy, stochastic rounding): the fold kernel also
stores the folding rows' re-quantized copy (`replay.FlushStores`, the
decode step's flush stores), and the window kernel reads each row's tile
from the master if the row folded, else from the copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.replay import fold
from pallas_kernels.replay.program import (FlushStores, Program, copy_counts,
                                           copy_operands, copy_spec, pad_pow2,
                                           unpack)
from pallas_kernels.verify.config import VerifyConfig, plan_verify
from replayssm_jax.reference import process_dt
from replayssm_jax.verify_reference import verify_terms

F32 = jnp.float32


# ------------------------------------------------------------ fold kernel
def _folds(c, window, L):
  """Rows whose window does not fit behind their history fold it first."""
  return (c >= 0) & (c < L) & (c + window >= L) & (c > 0)


def _history_dt(p, dtb_ref, hist):
  """(d_j [L], sum_{i>j} d_i [L]) of head p.head0's buffered history
  slots `hist` (zero elsewhere)."""
  d_hist = plgpu.load(dtb_ref.at[p.b, :, p.head0], mask=hist, other=0.0)
  return d_hist, tu.suffix_sums(d_hist, p.j)


def _fold_history(p, refs, stores, *, block_p, fold_dot):
  """checkpoint tile of head p.head0 <- advanced over the row's c buffered
  tokens: decay * S_0 + sum_j s_j x_j B_j^T (j < c), stored (`stores`, a
  replay.FlushStores: with a copy spec also the re-stored read copy).
  fold_dot: None for exact f32 rank-1 updates, else one [block_p, L] x
  [L, N] dot in this form (`replay.fold.fold_product`)."""
  ck_ref, xb_ref, bb_ref, dtb_ref, a_ref = refs
  b, g, ps, L, h, c = p.b, p.g, p.ps, p.L, p.head0, p.c
  s0 = plgpu.load(ck_ref.at[b, h, ps]).astype(F32)
  nstate = s0.shape[-1]
  hist = p.j < c
  d_hist, suffix = _history_dt(p, dtb_ref, hist)
  a = a_ref[h].astype(F32)
  decay = jnp.exp(a * jnp.sum(d_hist))
  if fold_dot is None:
    def token(j):  # slots j >= c hold no history: weight 0, loads masked
      live = j < c
      return (jnp.where(live, dtb_ref[b, j, h], 0.0),
              plgpu.load(xb_ref.at[b, j, h, ps], other=0.0,
                         mask=jnp.broadcast_to(live, (block_p,))
                         ).astype(F32),
              plgpu.load(bb_ref.at[b, j, g, :], other=0.0,
                         mask=jnp.broadcast_to(live, (nstate,))
                         ).astype(F32))

    st = fold.rank1_fold(decay * s0, a, token, L, unroll=False)
  else:
    x_hist = plgpu.load(xb_ref.at[b, :, h, ps],
                        mask=jnp.broadcast_to(hist[:, None], (L, block_p)),
                        other=0.0)  # [L, block_p]
    b_hist = plgpu.load(bb_ref.at[b, :, g, :],
                        mask=jnp.broadcast_to(hist[:, None], (L, nstate)),
                        other=0.0)  # [L, N]
    s = d_hist * jnp.exp(a * suffix)  # the weights s_j
    st = fold.fold_product(x_hist, s, b_hist, fold_dot, decay * s0)
  stores.store(p, h, st)


def _fold_kernel(*refs, window, has_D, has_z, has_bias, fold_dot,
                 num_programs, nheads, heads_per_group, block_p, headdim,
                 buffer_len, copy_spec=None, **kw):
  """Early flush on a fixed grid of num_programs programs sharing out the
  (folding row, head, headdim block) items (`replay.fold.persistent_items`):
  rows that do not fold cost no program. The counters come padded to a
  power of two with -1. Refs: the 10 inputs (checkpoint, buffers, counts,
  window x, dt, A, B, C), the copy spec's extra inputs (read copy, scales,
  SR keys), D / z / dt_bias, then the outputs (master, read copy,
  scales)."""
  nin, nout = copy_counts(copy_spec)
  ins, _, outs, _ = unpack(refs, 10 + nin, 1 + nout, has_D, has_z,
                           has_bias)
  stores = FlushStores(outs, ins[10:], copy_spec)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, _, _, a_ref, _, _ = ins[:10]
  refs = (ck_ref, xb_ref, bb_ref, dtb_ref, a_ref)

  def item(b, h, pblk):
    p = Program(cnt_ref, None, a_ref, None, b=b, g=h // heads_per_group,
                 pblk=pblk, head0=h, block_p=block_p,
                 buffer_len=buffer_len, **kw)
    _fold_history(p, refs, stores, block_p=block_p, fold_dot=fold_dot)

  fold.persistent_items(pl.program_id(0),
                        _folds(cnt_ref[...], window, buffer_len), item,
                        num_programs=num_programs, nheads=nheads,
                        nblk=headdim // block_p)


# ---------------------------------------------------------- window kernel
def _window_kernel(*refs, window, has_D, has_z, readout_chunk, fma,
                   copy=False, scaled=False, **kw):
  """Window outputs decay_s * (S C_s) + extra_s; append the window. Refs:
  checkpoint, buffers, counts, window x, processed dt, A, B, C, the terms
  decay [b, T, h] and extra [b, T, h, p] (`verify_reference.verify_terms`),
  with `copy` the read copy (then with `scaled` its scales), D / z, then
  the outputs (y, buffers, counts)."""
  n_in = 12 + copy + scaled
  ins, (d_ref, z_ref, _), outs, _ = unpack(refs, n_in, 5, has_D, has_z,
                                         False)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, x_ref, dt_ref, a_ref, b_ref = (
      ins[:9])
  c_ref, decay_ref, extra_ref = ins[9:12]
  y_ref = outs[0]
  T = window
  p = Program.from_grid(cnt_ref, None, a_ref, None, dt_softplus=False, **kw)
  b, g, ps, L, c, h = p.b, p.g, p.ps, p.L, p.c, p.head0
  base = jnp.where(c + T >= L, 0, c)  # committed tokens left in the buffer
  # The window's x rows and the terms are loaded once, before the
  # checkpoint is read out (not per position behind the previous output
  # store): benchmarks/kernel_tuning/verify_window_kernel_h200.json.
  xs = [x_ref[b, s, h, ps] for s in range(T)]
  terms = [(decay_ref[b, s, h], extra_ref[b, s, h, ps]) for s in range(T)]
  tile = (b, h, ps)
  vectors = [lambda cols, s=s: c_ref[b, s, g, cols] for s in range(T)]
  if copy:
    readouts = _copy_readouts(
        ck_ref, ins[12], ins[13] if scaled else None, tile, vectors,
        _folds(c, T, L), readout_chunk, kw["block_p"], fma)
  else:
    readouts = tu.readouts(
        tu.load_tile_blocks(ck_ref, tile, readout_chunk), vectors, fma)
  ys = [decay * r + extra for (decay, extra), r in zip(terms, readouts)]
  for s, y in enumerate(ys):
    y = tu.finish_output(y, xs[s].astype(F32),
                             None if d_ref is None else d_ref[h],
                             None if z_ref is None else z_ref[b, s, h, ps])
    y_ref[b, s, h, ps] = jnp.where(p.valid, y, jnp.nan).astype(y_ref.dtype)

  _append_window(p, refs=(dt_ref, b_ref), outs=outs[1:], window=T,
                 base=base, xs=xs)


def _copy_readouts(ck_ref, rc_ref, rs_ref, tile, vectors, folded, chunk,
                   block_p, fma):
  """The readouts (`tu.readouts`) of a state with a read copy: the
  stored master's tile if the row folded its history in this verify (as
  the reference reads it), else the read copy's (dequantized: its per-row
  scales factor out of the dstate sums, as in the decode step's output
  route). Each source is a masked load, so a program reads the bytes of
  one of them (and issues the loads, converts and sum of both)."""
  master = tu.load_tile_blocks(ck_ref, tile, chunk, folded, block_p)
  q = tu.load_tile_blocks(rc_ref, tile, chunk, ~folded, block_p)
  outs = tu.readouts([m.astype(F32) + v.astype(F32)
                          for m, v in zip(master, q)], vectors, fma)
  if rs_ref is not None:
    scale = jnp.where(folded, 1.0, rs_ref[tile])  # [block_p]
    outs = [o * scale for o in outs]
  return outs


def _append_window(p, refs, outs, *, window, base, xs):
  """Appends the window's inputs (dt processed) behind the row's committed
  history and stores the row's new count. xs: the window's x rows of this
  program ([block_p] each, loaded by the caller)."""
  dt_ref, b_ref = refs
  xb_out, bb_out, dtb_out, cnt_out = outs
  b, g, ps, h, c, T = p.b, p.g, p.ps, p.head0, p.c, window

  @pl.when(p.valid)
  def _append():
    for i in range(T):
      xb_out[b, base + i, h, ps] = xs[i].astype(xb_out.dtype)

    @pl.when(p.pblk == 0)
    def _append_dt():
      for i in range(T):
        dtb_out[b, base + i, h] = dt_ref[b, i, h]

    @pl.when(p.pid == 0)  # the group's first head, first headdim block
    def _append_b():
      for i in range(T):
        bb_out[b, base + i, g, :] = b_ref[b, i, g, :].astype(bb_out.dtype)

  @pl.when((g == 0) & (p.pid == 0))
  def _count():
    cnt_out[b] = jnp.where(p.valid, base, c).astype(cnt_out.dtype)


# ---------------------------------------------------------------- launch
@functools.partial(jax.jit, static_argnames=("dt_softplus", "policy",
                                             "config", "interpret"))
def replay_verify(rstate, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                  dt_softplus=False, policy=None, layer=0, *,
                  config: VerifyConfig = VerifyConfig(),
                  interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config
  (`plan_verify` fills its unset fields).

  A state with a read copy or stochastic rounding (`policy`): the fold
  kernel stores the folding rows' master and re-stored copy (aliased, as
  the decode step's flush: `replay.FlushStores`); the window kernel reads
  each row's tile from the master if it folded, else from the copy.
  """
  from replayssm_jax.state import ReplayState  # pylint: disable=g-import-not-at-top
  plan = plan_verify(config, rstate, interpret)
  spec = copy_spec(rstate, policy, interpret)
  copy = rstate.read_copy is not None
  batch, nheads, headdim, _ = rstate.checkpoint.shape
  T, ngroups = x.shape[1], rstate.ngroups
  per_group = nheads // ngroups
  kw = dict(buffer_len=rstate.buffer_len, heads_per_program=1,
            heads_per_group=per_group, block_p=plan.block_p, headdim=headdim,
            window=T, has_D=D is not None, has_z=z is not None)
  sds = jax.ShapeDtypeStruct
  # 1. Early flush of the committed history (in place, folding rows only).
  fold_dot = fold.fold_dot(plan.fold, rstate.buffer_len, plan.block_p,
                           interpret, field="config.fold", tile="block_p",
                           b_dtypes=(rstate.b_buf.dtype,),
                           ck_dtype=rstate.checkpoint.dtype)
  fold_kernel = functools.partial(
      _fold_kernel, nheads=nheads, num_programs=plan.fold_programs,
      dt_softplus=dt_softplus, fold_dot=fold_dot,
      has_bias=dt_bias is not None, **kw)
  copy_in, aliases, copy_shapes = copy_operands(spec, policy, layer, rstate,
                                                10, 1)
  if spec is not None:
    fold_kernel = functools.partial(fold_kernel, copy_spec=spec)
  ck, *copy_out = pl.pallas_call(
      fold_kernel, grid=(plan.fold_programs,),
      out_shape=(sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),
                 *copy_shapes),
      input_output_aliases={0: 0, **aliases},
      compiler_params=plgpu.CompilerParams(num_warps=plan.fold_num_warps,
                                           num_stages=plan.num_stages),
      interpret=interpret, name="replayssm_verify_fold",
  )(rstate.checkpoint, rstate.x_buf, rstate.b_buf, rstate.dt_buf,
    pad_pow2(rstate.count), x, dt, A, B, C, *copy_in,
    *[v for v in (D, z, dt_bias) if v is not None])
  # 2. Window outputs and appends (reads the folded checkpoint). XLA forms
  # the processed dt (appended as it is, not formed per program) and the
  # terms, summing over the slots by reduction fusions (form "reduce").
  c = rstate.count.astype(jnp.int32)
  d_win = process_dt(dt, dt_bias, dt_softplus)
  terms = verify_terms(rstate.x_buf, rstate.b_buf, rstate.dt_buf,
                       jnp.where(c + T >= rstate.buffer_len, 0, c), x, B,
                       d_win, C, A, form="reduce")
  y, xb, bb, dtb, cnt = pl.pallas_call(
      functools.partial(_window_kernel, readout_chunk=plan.readout_chunk,
                        fma=plan.fma, copy=copy,
                        scaled=rstate.read_scale is not None, **kw),
      grid=((headdim // plan.block_p) * per_group, ngroups, batch),
      out_shape=(sds(x.shape, x.dtype),
                 sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                 sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                 sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                 sds(rstate.count.shape, rstate.count.dtype)),
      input_output_aliases={1: 1, 2: 2, 3: 3},
      compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                           num_stages=plan.num_stages),
      interpret=interpret, name="replayssm_verify_window",
  )(ck, rstate.x_buf, rstate.b_buf, rstate.dt_buf, rstate.count, x, d_win,
    A, B, C, *terms, *copy_out, *[v for v in (D, z) if v is not None])
  fields = {}
  if copy:
    fields["read_copy"] = copy_out[0]
    if rstate.read_scale is not None:
      fields["read_scale"] = copy_out[1]
  if rstate.step is not None:  # commit advances step
    fields.update(row_id=rstate.row_id, step=rstate.step)
  return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                        count=cnt, pending_window=T, **fields)
