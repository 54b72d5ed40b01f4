"""`replay_state_update`: the replay step's launches, as its plan
(`config.plan_replay_step`) says.

Both routes launch every step (the route of a row is data: no host branch,
one compile). The checkpoint and the buffers are aliased input->output and
only the elements a route owns are stored: a non-flush step never writes
the checkpoint. New counters go to a fresh [batch] output (every program of
a row reads the old counter, so it cannot be updated in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.replay.config import ReplayConfig, plan_replay_step
from pallas_kernels.replay.flush import (_flush_kernel,
                                         _flush_persistent_kernel)
from pallas_kernels.replay.fused import _fused_kernel, _fused_rows_kernel
from pallas_kernels.replay.mosaic_flush import flush as mosaic_flush
from pallas_kernels.replay.output import _output_kernel
from pallas_kernels.replay.program import (pad_pow2, step_fields,
                                           copy_operands)
from pallas_kernels.replay.split import _split_output_route
from pallas_kernels.ssu.mosaic import MosaicSSUConfig
from replayssm_jax import slots


def _state_shapes(rstate, x, *, checkpoint=False):
  """Out shapes (y, x / B / dt buffers, counters of x's rows[,
  checkpoint])."""
  sds = jax.ShapeDtypeStruct
  shapes = (sds(x.shape, x.dtype),
            sds(rstate.x_buf.shape, rstate.x_buf.dtype),
            sds(rstate.b_buf.shape, rstate.b_buf.dtype),
            sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
            sds(x.shape[:1], rstate.count.dtype))
  if checkpoint:
    shapes += (sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),)
  return shapes


@functools.partial(jax.jit, static_argnames=("dt_softplus", "policy",
                                             "config", "interpret"))
def replay_state_update(rstate, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                        dt_softplus=False, policy=None, layer=0, *,
                        rows=None, config: ReplayConfig = ReplayConfig(),
                        interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config.

  A state with a read copy (`precision.PrecisionPolicy.read_dtype`): the
  output route reads the copy (and its scales) instead of the master, the
  flush route reads the master + buffer and writes the master and the
  re-stored copy (aliased: non-flush rows' copies are never written). With
  `policy.stochastic_rounding` the flush stores round stochastically with
  the reference's bits (keyed by policy.seed, layer, row_id, step and the
  element index); `step` advances like the reference's.

  rows: [batch] int32 slots of the state's rows (`replayssm_jax.slots`,
  effective: -1 for a padding row): token row i steps state row rows[i] in
  place (the state may have any number of rows; the Triton routes in two
  launches, `config.plan_replay_step`).
  """
  from replayssm_jax.state import ReplayState  # pylint: disable=g-import-not-at-top
  plan = plan_replay_step(config, rstate, policy, B.dtype, interpret,
                          tu.compute_capability(), tu.core_count(),
                          rows=None if rows is None else x.shape[0])
  spec = plan.copy_spec
  _, nheads, headdim, _ = rstate.checkpoint.shape
  batch = x.shape[0]
  ngroups = rstate.ngroups
  per_group = nheads // ngroups
  block_p, hb = plan.block_p, plan.heads_per_program
  # The output route reads the read copy (never the master) when there is
  # one; otherwise the same inputs and kernel code as the plain state.
  read = rstate.checkpoint if rstate.read_copy is None else rstate.read_copy
  scaled = rstate.read_scale is not None
  state_in = [read, rstate.x_buf, rstate.b_buf, rstate.dt_buf, rstate.count]
  token_in = [x, dt, A, B, C]
  optional = [v for v in (D, z, dt_bias) if v is not None]
  # The slots follow the optional inputs (`program.unpack`).
  slot_in = [] if rows is None else [rows]
  kw = dict(buffer_len=rstate.buffer_len, heads_per_program=hb,
            heads_per_group=per_group, block_p=block_p, headdim=headdim,
            has_D=D is not None, has_z=z is not None,
            has_bias=dt_bias is not None, dt_softplus=dt_softplus)

  def grid(heads=hb):
    return ((headdim // block_p) * (per_group // heads), ngroups, batch)

  params = plgpu.CompilerParams(num_warps=plan.num_warps,
                                num_stages=plan.num_stages)
  if plan.fused_launch:
    if plan.flush_grid == "rows":
      kernel = functools.partial(_fused_rows_kernel, fold_dot=plan.fold_dot,
                                 **kw)
      fused_grid, counts_in = grid(), []
    else:
      n0 = grid()[0]
      kernel = functools.partial(
          _fused_kernel, num_programs=plan.flush_programs, out_programs=n0,
          ngroups=ngroups, nheads=nheads, fold_dot=plan.fold_dot, **kw)
      fused_grid = (plan.flush_programs + n0 * ngroups * batch,)
      counts_in = [pad_pow2(rstate.count)]
    rows = "_rows" if plan.flush_grid == "rows" else ""
    y, xb, bb, dtb, cnt, ck = pl.pallas_call(
        kernel, grid=fused_grid,
        out_shape=_state_shapes(rstate, x, checkpoint=True),
        input_output_aliases={0: 5, 1: 1, 2: 2, 3: 3},
        compiler_params=params, interpret=interpret,
        name=tu.capped_name("replayssm_replay_fused_routes" + rows,
                            plan.max_registers),
    )(rstate.checkpoint, rstate.x_buf, rstate.b_buf, rstate.dt_buf,
      rstate.count, *token_in, *counts_in, *optional)
    return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                          count=cnt)
  extra = [rstate.read_scale] if scaled else []
  out_kw = dict(scaled=True) if scaled else {}
  y_flush = []
  if plan.flush_route == "mosaic_gpu":
    # The Mosaic flush runs first: a flush row's buffer slots are the same
    # before and after the output route (it does not append), and y comes
    # back as a fresh array (flush rows written) that the output route then
    # completes in place. (Updating the output route's y in place from the
    # Mosaic kernel gave garbage inside a lax.scan on the H200, jax 0.11.2.)
    if plan.mosaic_fold_pieces:
      # The tensor-core fold runs over all L slots of the B buffer with
      # weight 0 at slot L-1, which no row ever holds history in (count <
      # L): zero that stale slot first (0 x inf is NaN). In place, on the
      # array the output route then appends to: one [batch, ngroups,
      # dstate] write.
      state_in[2] = rstate.b_buf.at[:, -1].set(0)
    y_part, ck = mosaic_flush(
        rstate.checkpoint, rstate.x_buf, state_in[2], rstate.dt_buf,
        rstate.count, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
        interpret=interpret, fold_pieces=plan.mosaic_fold_pieces,
        store_from_input=plan.mosaic_store_from_input,
        num_ctas=plan.flush_programs,
        config=MosaicSSUConfig(
            heads_per_program=plan.flush_heads_per_program,
            max_concurrent_steps=plan.mosaic_stages))
    y_flush = [y_part]
    out_kw["y_in"] = True
    # The output route reads the updated checkpoint (its non-flush rows are
    # the old ones): reading the old array after the in-place update would
    # make XLA copy the whole checkpoint first (a full extra read and
    # write of it every step).
    state_in[0] = ck
  if plan.output_route == "split":
    y, xb, bb, dtb, cnt = _split_output_route(
        rstate, read, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
        block_p=block_p, num_warps=plan.num_warps,
        num_stages=plan.num_stages, max_registers=plan.max_registers,
        interpret=interpret)
  else:
    y_alias = ({len(state_in) + len(token_in) + len(extra) + len(optional):
                0} if y_flush else {})
    y, xb, bb, dtb, cnt = pl.pallas_call(
        functools.partial(_output_kernel, **out_kw, **kw,
                          has_rows=rows is not None),
        grid=grid(),
        out_shape=_state_shapes(rstate, x),
        input_output_aliases={1: 1, 2: 2, 3: 3, **y_alias},
        compiler_params=params, interpret=interpret,
        name=tu.capped_name("replayssm_replay_output_route",
                            plan.max_registers),
    )(*state_in, *token_in, *extra, *optional, *slot_in, *y_flush)
  if rows is not None:  # the token rows' new counters into the state's
    cnt = slots.scatter(rstate.count, cnt, rows)
  if plan.flush_route == "mosaic_gpu":
    return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                          count=cnt, **step_fields(rstate))
  # The flush route reads the buffers after the output route: flush rows do
  # not append, so their slots are unchanged, and one copy of each buffer
  # stays live.
  flush_kw = dict(kw, fold_dot=plan.fold_dot, has_rows=rows is not None)
  count = rstate.count
  if plan.flush_grid == "persistent":
    kernel = functools.partial(_flush_persistent_kernel, nheads=nheads,
                               num_programs=plan.flush_programs, **flush_kw)
    flush_grid = (plan.flush_programs,)
    if rows is not None:  # the token rows' counters (padding rows: -1)
      count = jnp.where(rows < 0, -1, count[jnp.maximum(rows, 0)])
    count = pad_pow2(count)
  else:
    kernel = functools.partial(
        _flush_kernel,
        **dict(flush_kw, heads_per_program=plan.flush_heads_per_program))
    flush_grid = grid(plan.flush_heads_per_program)
  sds = jax.ShapeDtypeStruct
  out_shape = (sds(y.shape, y.dtype),
               sds(rstate.checkpoint.shape, rstate.checkpoint.dtype))
  aliases = {10: 0, 0: 1}
  copy_in, copy_aliases, copy_shapes = copy_operands(
      spec, policy, layer, rstate, 11, 2)
  if spec is not None:
    kernel = functools.partial(kernel, copy_spec=spec)
  aliases.update(copy_aliases)
  out_shape += copy_shapes
  outs = pl.pallas_call(
      kernel, grid=flush_grid, out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(
          num_warps=plan.flush_num_warps, num_stages=plan.flush_num_stages),
      interpret=interpret,
      name=tu.capped_name("replayssm_replay_flush_route",
                          plan.flush_max_registers),
  )(rstate.checkpoint, xb, bb, dtb, count, *token_in, y, *copy_in,
    *optional, *slot_in)
  y, ck, outs = outs[0], outs[1], outs[2:]
  fields = {}
  if spec is not None and spec.copy:
    fields["read_copy"] = outs[0]
    if spec.scaled:
      fields["read_scale"] = outs[1]
  return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                        count=cnt, **fields, **step_fields(rstate, rows))
