"""Both replay routes in one Triton launch (`ReplayConfig.fused_launch`, the
default at small batch, where a step is launch- and latency-bound)."""

from __future__ import annotations

from jax.experimental import pallas as pl

from pallas_kernels.replay.flush import _flush_items, _fold_flush_row
from pallas_kernels.replay.output import _output_route
from pallas_kernels.replay.program import FlushStores, Program, unpack


def _fused_kernel(*refs, has_D, has_z, has_bias, num_programs,
                  out_programs, ngroups, fold_dot, nheads, **kw):
  """Programs [0, num_programs) run the persistent flush route (first, so
  they start at once and their latency-bound folds overlap the output
  route's streaming); program num_programs + q runs item q of the output
  route's grid, flattened (headdim/head block, group, row). Inputs: those
  of the output kernel, then the [batch] counters padded to a power of two
  (the flush ranking's copy); outputs: y, buffers, counters, checkpoint
  (aliased to the input checkpoint: only flush rows' tiles are stored).
  """
  ins, opt, outs, _ = unpack(refs, 11, 6, has_D, has_z, has_bias)
  y_ref, ck_out = outs[0], outs[5]
  pid = pl.program_id(0)

  @pl.when(pid < num_programs)
  def _flush():
    flush_ins = list(ins[:10])
    flush_ins[4] = ins[10]  # the padded counters
    _flush_items(pid, flush_ins, opt, y_ref, FlushStores([ck_out], [], None),
                 fold_dot=fold_dot, num_programs=num_programs,
                 nheads=nheads, heads_per_group=kw["heads_per_group"],
                 block_p=kw["block_p"], headdim=kw["headdim"],
                 buffer_len=kw["buffer_len"], dt_softplus=kw["dt_softplus"])

  @pl.when(pid >= num_programs)
  def _output():
    q = pid - num_programs
    p = Program.from_ids(ins[4], ins[6], ins[7], opt[2],
                          pid=q % out_programs,
                          g=(q // out_programs) % ngroups,
                          b=q // (out_programs * ngroups), **kw)
    _output_route(p, ins[:10], opt, outs[:5], scaled=False,
                  block_p=kw["block_p"],
                  heads_per_program=kw["heads_per_program"])


def _fused_rows_kernel(*refs, has_D, has_z, has_bias, fold_dot, **kw):
  """Both routes on the output route's grid (`flush_grid="rows"`): a
  flush row's program folds its heads' tiles and stores them with y,
  any other row's program reads out and appends. So a step launches one
  program per output item and no flush programs, at the register budget of
  the larger route. Inputs and outputs: those of `_fused_kernel` without
  the padded counters."""
  ins, opt, outs, _ = unpack(refs, 10, 6, has_D, has_z, has_bias)
  p = _fold_flush_row(ins, opt, outs[0], FlushStores([outs[5]], [], None),
                      fold_dot=fold_dot, **kw)
  _output_route(p, ins, opt, outs[:5], scaled=False, block_p=kw["block_p"],
                heads_per_program=kw["heads_per_program"])
