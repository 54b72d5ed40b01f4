"""The replay step's Triton output route: rows with count c < L-1 read
y = exp(Lambda) (S_0 C) + sum_j s_j (B_j . C) x_j (+ D x, * silu(z)) from
the checkpoint (or read copy) and the buffer, then append (x, dt', B) at
slot c; the checkpoint is only read."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import triton_utils as tu
from pallas_kernels.replay.program import Program, unpack, window_load

F32 = jnp.float32


def _output_kernel(*refs, has_D, has_z, has_bias, scaled=False, y_in=False,
                   has_rows=False, **kw):
  """Output route on the grid (headdim blocks x head blocks of a group,
  ngroups, batch): y from checkpoint + buffer; non-flush rows append,
  flush-row programs exit at once.

  The state read (ck_ref) is the checkpoint, or the state's read copy when it
  has one (then the master is not an input at all); `scaled`: an 8-bit copy
  whose per-row f32 scales follow the inputs (applied to the readout).
  y_in: a y input after the optional ones, aliased to the y output (the
  flush rows' y, already written by the Mosaic flush), never read.
  has_rows: a [batch] slot input after the optional ones (`Program`); the
  counters output then has the token rows' batch.
  """
  ins, opt, outs, rows = unpack(refs, 10 + scaled, 5 + y_in, has_D, has_z,
                                has_bias, has_rows)
  outs = outs[y_in:]
  p = Program.from_grid(ins[4], ins[6], ins[7], opt[2], rows_ref=rows, **kw)
  _output_route(p, ins, opt, outs, scaled=scaled, block_p=kw["block_p"],
                heads_per_program=kw["heads_per_program"])


def _output_route(p, ins, opt, outs, *, scaled, block_p, heads_per_program):
  """The output route of item p (refs as _output_kernel's): the program's
  B.C products once, then per head the tile's readout, the window terms
  and the appends."""

  def hist_load(ref, shape):
    return window_load(ref, p.hist, shape)

  d_ref, z_ref, _ = opt
  ck_ref, xb_ref, bb_ref, dtb_ref, _, x_ref, _, _, b_ref = ins[:9]
  c_ref = ins[9]
  scale_ref = ins[10] if scaled else None
  # Buffers are aliased input->output (same HBM on GPU; copies of the inputs
  # in interpret mode): read the inputs, store to the outputs.
  y_ref, xb_out, bb_out, dtb_out, cnt_out = outs
  b, sb, g, ps = p.b, p.sb, p.g, p.ps  # token row, state row
  appends = jnp.logical_not(p.flush) & p.valid

  @pl.when((g == 0) & (p.pid == 0))
  def _count():
    new = jnp.where(p.flush, 0, p.c + 1)
    cnt_out[b] = jnp.where(p.valid, new, p.c).astype(cnt_out.dtype)

  def route():
    cv = c_ref[b, g, :].astype(F32)  # [N]
    b_cur = b_ref[b, g, :].astype(F32)
    bc_cur = jnp.sum(b_cur * cv)
    # once per program, for all its heads
    b_hist = hist_load(bb_ref.at[sb, :, g, :], (p.L, cv.shape[0]))
    bc_hist = jnp.sum(b_hist * cv[None, :], axis=1)  # [L]
    bc = jnp.where(p.cur, bc_cur, bc_hist)  # [L]

    def one_head(r, carry):
      h = p.head0 + r
      # Issue the big read first so its latency overlaps the small math.
      s0 = tu.load_tile_blocks(ck_ref, (sb, p.head0 + r, ps), None)
      scale = None if scale_ref is None else scale_ref[sb, h, ps]
      d_cur, s, decay = p.window_weights(h, dtb_ref)
      k = s * bc
      x_in = x_ref[b, h, ps]  # [block_p]; the append stores it as loaded
      x_cur = x_in.astype(F32)
      x_hist = hist_load(xb_ref.at[sb, :, h, ps], (p.L, block_p))
      x_win = jnp.where(p.cur[:, None], x_cur[None, :], x_hist)
      (readout,) = tu.readouts(s0, [lambda cols: c_ref[b, g, cols]])
      if scale is not None:
        # precision.dequantize is q * scale per (head, headdim row), so the
        # scale factors out of the dstate sum: one multiply per row, not
        # per element (the reference rounds (q * scale) * C instead).
        readout = readout * scale
      y = decay * readout + jnp.sum(k[:, None] * x_win, axis=0)
      y = tu.finish_output(y, x_cur, None if d_ref is None else d_ref[h],
                           None if z_ref is None else z_ref[b, h, ps])
      y_ref[b, h, ps] = jnp.where(p.valid, y, jnp.nan).astype(y_ref.dtype)

      @pl.when(appends)
      def _append_x():
        xb_out[sb, p.c, h, ps] = x_in.astype(xb_out.dtype)

      @pl.when(appends & (p.pblk == 0))
      def _append_dt():
        dtb_out[sb, p.c, h] = d_cur

      return carry

    lax.fori_loop(0, heads_per_program, one_head, 0)

    @pl.when(appends & (p.pid == 0))
    def _append_b():
      bb_out[sb, p.c, g, :] = b_ref[b, g, :].astype(bb_out.dtype)

  pl.when(jnp.logical_not(p.flush))(route)
