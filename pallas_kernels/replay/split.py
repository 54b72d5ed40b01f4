"""The replay step's split output route (`ReplayConfig(output_route=
"split")`, the default for 8-bit read copies at large batch): the state
read out (y0 = S C of the checkpoint or read copy, scaled) by its own
kernel, then the window terms, appends and counters by a (group, row)
kernel."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.replay.program import unpack, window_load
from replayssm_jax.reference import process_dt

F32 = jnp.float32

# The window kernel's launch; heads: heads per window program (None: the
# group's). The readout kernel's warps: `ReplayConfig.num_warps`, default
# READOUT_WARPS; it skips the rows that do not take the output route.
READOUT_WARPS = 2
WINDOW_LAUNCH = dict(num_warps=4, heads=None)


def split_problem(rstate) -> str | None:
  """Why the split route's window kernel cannot take rstate (its Triton
  blocks are a window [L, ...], a group's heads and dstate: powers of two),
  or None."""
  for name, v in (("buffer_len", rstate.buffer_len),
                  ("nheads // ngroups", rstate.nheads // rstate.ngroups),
                  ("dstate", rstate.dstate)):
    if v & (v - 1):
      return f"{name} a power of two (Triton blocks), got {v}"
  return None


def _group_weights(j, c, cv, b_hist, b_in, d_hist, dt_in, bias, a,
                   dt_softplus):
  """The window terms of some heads of one group of one row, from their
  loads (slots j = arange(L), counter c; C cv [N] f32; the B window
  b_hist [L, N] and the dt window d_hist [L, heads], zero past the
  buffered slots; the token's B b_in [N], dt dt_in [heads], dt_bias bias;
  A a [heads] f32) -> (k [L, heads]: k_j = s_j B_j . C with
  `reference.window_weights`' s, zero past slot c; decay [heads]; dt'
  [heads]; the token's B . C)."""
  cur = j == c
  bc_hist = jnp.sum(b_hist.astype(F32) * cv[None, :], axis=1)  # [L]
  bc_cur = jnp.sum(b_in.astype(F32) * cv)
  bc = jnp.where(cur, bc_cur, bc_hist)
  d_cur = process_dt(dt_in, bias, dt_softplus)  # [heads]
  dw = jnp.where(cur[:, None], d_cur[None, :], d_hist)  # zero past slot c
  k = dw * jnp.exp(a[None, :] * tu.suffix_sums(dw, j)) * bc[:, None]
  return k, jnp.exp(a * jnp.sum(dw, axis=0)), d_cur, bc_cur


def _readout_kernel(ck_ref, cnt_ref, c_ref, *rest, scaled, block_p,
                    heads_per_group, headdim, buffer_len):
  """y0 = S C (times the 8-bit copy's row scales) of one [block_p, N]
  tile, f32, on the output route's grid (heads_per_program 1); rows that do
  not take the output route (flushing or out-of-range counters) read
  nothing and leave y0 unset."""
  scale_ref = rest[0] if scaled else None
  y0_out = rest[scaled]
  pid, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nblk = headdim // block_p
  h = g * heads_per_group + pid // nblk
  ps = pl.ds((pid % nblk) * block_p, block_p)

  def readout():
    tile = tu.load_tile_blocks(ck_ref, (b, h, ps), None)
    (y0,) = tu.readouts(tile, [lambda cols: c_ref[b, g, cols]])
    if scale_ref is not None:  # the scales factor out of the dstate sum
      y0 = y0 * scale_ref[b, h, ps]
    y0_out[b, h, ps] = y0

  c = cnt_ref[b]
  pl.when((c >= 0) & (c < buffer_len - 1))(readout)


def _window_kernel(cnt_ref, xb_ref, bb_ref, dtb_ref, x_ref, dt_ref, a_ref,
                   b_ref, c_ref, y0_ref, *rest, has_D, has_z, has_bias,
                   dt_softplus, buffer_len, heads, per_group):
  """The output route's terms but the state readout, for `heads` heads of one
  group of one row (grid (ngroups, per_group // heads, batch)): the group's
  B.C products and the heads' window weights, then y = decay y0 + sum_j k_j
  x_j (+ D x, * silu(z)) for all the heads at once ([L, heads, headdim] x
  window), the appends of (x, dt' and, in the group's first program, B) at
  slot c and, in the row's first program, its new counter. Rows that flush
  are left to the flush route (y unset, no append)."""
  _, (d_ref, z_ref, bias_ref), outs, _ = unpack(rest, 0, 5, has_D, has_z,
                                              has_bias)
  y_out, xb_out, bb_out, dtb_out, cnt_out = outs
  g, q, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  L = buffer_len
  c = cnt_ref[b].astype(jnp.int32)
  valid = (c >= 0) & (c < L)
  flush = c == L - 1
  appends = valid & jnp.logical_not(flush)
  j = jnp.arange(L, dtype=jnp.int32)
  hist = j < c
  hs = pl.ds(g * per_group + q * heads, heads)

  @pl.when((g == 0) & (q == 0))
  def _count():
    new = jnp.where(flush, 0, c + 1)
    cnt_out[b] = jnp.where(valid, new, c).astype(cnt_out.dtype)

  # The loads that do not depend on the counter issue before its branch
  # (with the counter's load); the windows' masked loads wait for it.
  cv = c_ref[b, g, :].astype(F32)  # [N]
  b_in = b_ref[b, g, :]
  x_in = x_ref[b, hs, :]  # [heads, headdim]; appended as loaded
  y0 = y0_ref[b, hs, :]
  dt_in, a = dt_ref[b, hs], a_ref[hs].astype(F32)
  bias = None if bias_ref is None else bias_ref[hs]
  d_vec = None if d_ref is None else d_ref[hs].astype(F32)[:, None]
  z = None if z_ref is None else z_ref[b, hs, :]

  @pl.when(jnp.logical_not(flush))
  def _route():
    k, decay, d_cur, bc_cur = _group_weights(
        j, c, cv, window_load(bb_ref.at[b, :, g, :], hist,
                               (L, cv.shape[0])), b_in,
        window_load(dtb_ref.at[b, :, hs], hist, (L, heads)), dt_in, bias,
        a, dt_softplus)
    x_cur = x_in.astype(F32)
    x_hist = window_load(xb_ref.at[b, :, hs, :], hist, (L,) + x_in.shape)
    # The current token's term on its own (its slot of x_hist is zero): k
    # at slot c is d' (B.C), its suffix sum being 0.
    y = (decay[:, None] * y0 + (d_cur * bc_cur)[:, None] * x_cur
         + jnp.sum(k[:, :, None] * x_hist, axis=0))
    y = tu.finish_output(y, x_cur, d_vec, z)
    y_out[b, hs, :] = jnp.where(valid, y, jnp.nan).astype(y_out.dtype)

    @pl.when(appends)
    def _append():
      xb_out[b, c, hs, :] = x_in.astype(xb_out.dtype)
      dtb_out[b, c, hs] = d_cur

    @pl.when(appends & (q == 0))
    def _append_b():
      bb_out[b, c, g, :] = b_in.astype(bb_out.dtype)


def _split_output_route(rstate, read, x, dt, A, B, C, D, z, dt_bias,
                        dt_softplus, *, block_p, num_warps, num_stages,
                        max_registers, interpret):
  """The output route with output_route="split": the state read out by its
  own kernel (`_readout_kernel`: y0 = S C of the checkpoint or read copy,
  f32, [batch, nheads, headdim]), then every other term of y, the appends
  and the counters by a (group, row) kernel (`_window_kernel`). Returns (y,
  x_buf, b_buf, dt_buf, count); the flush route then writes the flush
  rows' y. num_warps, num_stages, max_registers: the readout kernel's."""
  batch, nheads, headdim, _ = read.shape
  L, ngroups = rstate.buffer_len, rstate.ngroups
  per_group = nheads // ngroups
  why = split_problem(rstate)
  if why:
    raise NotImplementedError(f"output_route='split' needs {why}.")
  sds = jax.ShapeDtypeStruct
  scaled = rstate.read_scale is not None
  y0 = pl.pallas_call(
      functools.partial(_readout_kernel, scaled=scaled, block_p=block_p,
                        heads_per_group=per_group, headdim=headdim,
                        buffer_len=L),
      grid=((headdim // block_p) * per_group, ngroups, batch),
      out_shape=sds((batch, nheads, headdim), F32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name=tu.capped_name("replayssm_replay_readout", max_registers),
  )(read, rstate.count, C, *([rstate.read_scale] if scaled else []))
  optional = [v for v in (D, z, dt_bias) if v is not None]
  heads = min(WINDOW_LAUNCH["heads"] or per_group, per_group)
  if per_group % heads or heads & (heads - 1):
    raise NotImplementedError(
        f"WINDOW_LAUNCH['heads'] ({heads}) must be a power of two dividing "
        f"nheads // ngroups ({per_group}).")
  return pl.pallas_call(
      functools.partial(_window_kernel, has_D=D is not None,
                        has_z=z is not None, has_bias=dt_bias is not None,
                        dt_softplus=dt_softplus, buffer_len=L, heads=heads,
                        per_group=per_group),
      grid=(ngroups, per_group // heads, batch),
      out_shape=(sds((batch, nheads, headdim), x.dtype),
                 sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                 sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                 sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                 sds(rstate.count.shape, rstate.count.dtype)),
      input_output_aliases={1: 1, 2: 2, 3: 3},
      compiler_params=plgpu.CompilerParams(
          num_warps=WINDOW_LAUNCH["num_warps"]),
      interpret=interpret, name="replayssm_replay_window",
  )(rstate.count, rstate.x_buf, rstate.b_buf, rstate.dt_buf, x, dt, A, B, C,
    y0, *optional)


