"""The replay step's Triton flush route: rows with count c == L-1 fold the
L-1 buffered tokens and the current one into a new checkpoint (rank-1
updates or tensor-core products, `fold.py`), store it (with a read copy
re-stored from it, `program.FlushStores`) and read y from it. On the
output route's grid (programs of non-flush rows exit at once) or on a
persistent grid whose programs share out the flush rows' items."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.replay.fold import fold_product, persistent_items
from pallas_kernels.replay.fold import rank1_fold
from pallas_kernels.replay.program import (copy_counts, FlushStores,
                                           Program, unpack)

F32 = jnp.float32


def _fold_loads(p, h, refs, *, fold_dot, block_p):
  """The global loads of head h's fold outside its rank-1 loop (a dict):
  the checkpoint tile first (the big read), the current token, the dt
  window and, for a dot fold, the buffered x and B."""
  ck_ref, xb_ref, bb_ref, dtb_ref, x_ref, b_ref = refs
  b, sb, g, ps, L = p.b, p.sb, p.g, p.ps, p.L  # token row, state row
  ld = dict(s0=plgpu.load(ck_ref.at[sb, h, ps],
                          eviction_policy="evict_first"))
  ld.update(p.window_loads(h, dtb_ref))
  ld.update(x_cur=x_ref[b, h, ps], b_cur=b_ref[b, g, :])
  if fold_dot is not None:
    nstate = ck_ref.shape[-1]
    ld["b_hist"] = plgpu.load(bb_ref.at[sb, :, g, :], other=0.0,
                              mask=jnp.broadcast_to(p.hist[:, None],
                                                    (L, nstate)))
    ld["x_hist"] = plgpu.load(xb_ref.at[sb, :, h, ps], other=0.0,
                              mask=jnp.broadcast_to(p.hist[:, None],
                                                    (L, block_p)))
  return ld


def _fold_head(p, h, refs, *, fold_dot, block_p):
  """New checkpoint tile of head h of a flush row (count == L-1):
  decay * S_0 + sum_j s_j x_j B_j^T over the L tokens (L-1 buffered + the
  current one) -> ([block_p, N] f32, x_cur [block_p] f32).

  fold_dot: None folds with exact f32 rank-1 updates (each buffered token
  loaded in the loop); otherwise one [block_p, L] x [L, N] product in this
  form (`fold_product`; needs L, block_p >= 16)."""
  ld = _fold_loads(p, h, refs, fold_dot=fold_dot, block_p=block_p)
  _, xb_ref, bb_ref, dtb_ref, _, _ = refs
  sb, g, ps, L = p.sb, p.g, p.ps, p.L
  d_cur, s, decay = p.window_from(ld)
  x_cur = ld["x_cur"].astype(F32)
  st = decay * ld["s0"].astype(F32)  # [block_p, N]
  if fold_dot is None:
    # The current token (weight d_cur), then the L-1 buffered ones.
    st = st + (d_cur * x_cur)[:, None] * ld["b_cur"].astype(F32)[None, :]

    def token(j):
      return (dtb_ref[sb, j, h], xb_ref[sb, j, h, ps].astype(F32),
              bb_ref[sb, j, g, :].astype(F32))

    return rank1_fold(st, ld["a"].astype(F32), token, L - 1,
                      suffix0=d_cur), x_cur
  b_win = jnp.where(p.cur[:, None], ld["b_cur"][None, :],
                    ld["b_hist"])  # [L, N]
  x_win = jnp.where(p.cur[:, None], ld["x_cur"][None, :],
                    ld["x_hist"])  # [L, block_p]
  return fold_product(x_win, s, b_win, fold_dot, st), x_cur


def _store_flush(p, h, st, x_cur, stores, y_out, c_ref, d_ref, z_ref):
  """Stores y read from the new checkpoint tile, then the tile."""
  b, ps = p.b, p.ps
  y = jnp.sum(st * c_ref[b, p.g, :].astype(F32)[None, :], axis=1)
  y = tu.finish_output(y, x_cur, None if d_ref is None else d_ref[h],
                       None if z_ref is None else z_ref[b, h, ps])
  y_out[b, h, ps] = y.astype(y_out.dtype)
  stores.store(p, h, st)


def _flush_refs(refs, has_D, has_z, has_bias, copy_spec, has_rows=False):
  """(inputs, [D, z, bias], y output, FlushStores, slots ref or None) of a
  flush kernel: inputs checkpoint, x / B / dt buffers, counters, x, dt, A,
  B, C, y, the copy's (`copy_operands`); outputs y, checkpoint, the
  copy's."""
  nin, nout = copy_counts(copy_spec)
  ins, opt, outs, rows = unpack(refs, 11 + nin, 2 + nout, has_D, has_z,
                                has_bias, has_rows)
  return (ins, opt, outs[0], FlushStores(outs[1:], ins[11:], copy_spec),
          rows)


def _flush_kernel(*refs, has_D, has_z, has_bias, fold_dot, copy_spec=None,
                  has_rows=False, **kw):
  """Flush route over the output route's grid: programs of non-flush rows
  exit at once (each still costs a launch slot); flush rows fold L tokens
  into a new checkpoint and store it and y (and with copy_spec the read
  copy, see CopySpec). has_rows: a slot input (`Program`)."""
  ins, opt, y_out, stores, rows = _flush_refs(refs, has_D, has_z, has_bias,
                                              copy_spec, has_rows)
  _fold_flush_row(ins, opt, y_out, stores, fold_dot=fold_dot, rows_ref=rows,
                  **kw)


def _fold_flush_row(ins, opt, y_out, stores, *, fold_dot, **kw):
  """The item of a program on the output route's grid (ins in the kernels'
  order: checkpoint, x / B / dt buffers, counters, x, dt, A, B, C): when
  its row flushes, the tiles of its heads folded and stored with y -> the
  item (`Program`)."""
  d_ref, z_ref, bias_ref = opt
  p = Program.from_grid(ins[4], ins[6], ins[7], bias_ref, **kw)
  fold_refs = (ins[0], ins[1], ins[2], ins[3], ins[5], ins[8])

  @pl.when(p.flush)
  def _fold():
    def one_head(r, carry):
      h = p.head0 + r
      st, x_cur = _fold_head(p, h, fold_refs, fold_dot=fold_dot,
                             block_p=kw["block_p"])
      _store_flush(p, h, st, x_cur, stores, y_out, ins[9], d_ref, z_ref)
      return carry

    lax.fori_loop(0, kw["heads_per_program"], one_head, 0)

  return p


def _flush_persistent_kernel(*refs, has_D, has_z, has_bias, fold_dot,
                             num_programs, nheads, heads_per_group, block_p,
                             headdim, copy_spec=None, has_rows=False, **kw):
  """Flush route on a fixed grid of num_programs programs that share out
  the work items (flush row, head, headdim block) of the flush rows only
  (`persistent_items`). So the launch costs num_programs programs whatever
  the batch, and a step where 1/L of the rows flush does 1/L of the work
  (no early-exit program per non-flush row). The counters come padded to a
  power of two with -1 (with has_rows: the token rows' counters, padding
  rows -1, and a slot input follows the optional ones).
  """
  ins, opt, y_out, stores, rows = _flush_refs(refs, has_D, has_z, has_bias,
                                              copy_spec, has_rows)
  _flush_items(pl.program_id(0), ins[:10], opt, y_out, stores,
               fold_dot=fold_dot, num_programs=num_programs, nheads=nheads,
               heads_per_group=heads_per_group, block_p=block_p,
               headdim=headdim, rows_ref=rows, **kw)


def _flush_items(pid, ins, opt, y_out, stores, *, fold_dot, num_programs,
                 nheads, heads_per_group, block_p, headdim, rows_ref=None,
                 **kw):
  """The items of persistent flush program `pid` (of num_programs); the
  counters ins[4] are the token rows' (`Program` for rows_ref)."""
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, x_ref, dt_ref, a_ref, b_ref = (
      ins[:9])
  c_ref = ins[9]
  d_ref, z_ref, bias_ref = opt
  L = kw["buffer_len"]
  counts = cnt_ref[...]  # [batch] (padded to a power of two with -1)
  fold_refs = (ck_ref, xb_ref, bb_ref, dtb_ref, x_ref, b_ref)

  def item(b, h, pblk):
    # A flush row's counter is L-1: every load of the item depends only on
    # (b, h), so all of them issue at once.
    p = Program(cnt_ref, dt_ref, a_ref, bias_ref, b=b,
                 g=h // heads_per_group, pblk=pblk, head0=h,
                 block_p=block_p, count=L - 1, rows_ref=rows_ref, **kw)
    st, x_cur = _fold_head(p, h, fold_refs, fold_dot=fold_dot,
                           block_p=block_p)
    _store_flush(p, h, st, x_cur, stores, y_out, c_ref, d_ref, z_ref)

  persistent_items(pid, counts == L - 1, item, num_programs=num_programs,
                   nheads=nheads, nblk=headdim // block_p,
                   nrows=x_ref.shape[0])
