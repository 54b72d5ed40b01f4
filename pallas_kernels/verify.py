"""Pallas (Triton backend) kernels: speculative verify on a ReplayState.

Matches `replayssm_jax.speculative.replay_verify_reference`. Two kernels,
both launched every step, rows routed by data:

* fold kernel (rows whose window does not fit behind their history,
  count + T >= L, with count > 0): folds the committed history into the
  checkpoint and stores it (the window's only checkpoint write);
* verify kernel (every row): outputs of the T window positions from the
  checkpoint (as left by the fold kernel) + committed history + window, in
  one pass with no per-token state, then appends the window's inputs behind
  the history. The checkpoint is only read.

Window-kernel grid: (headdim blocks x heads of one group, ngroups, batch),
one head per program. The fold kernel runs by default on a small
persistent grid that shares out the folding rows' (row, head, headdim
block) items (as the replay step's flush route; `VerifyConfig.fold_grid`),
folding with tensor-core dots where L and block_p >= 16 (bf16 dots of
the bf16 B with the weighted x split in three, else 3xTF32; see
`replay.fold_product`). T, L, headdim and
dstate must be powers of two (Triton blocks).

A precision policy (read copy, stochastic rounding): the fold kernel also
stores the folding rows' re-quantized copy (`replay._FlushStores`, the
decode step's flush stores), and the window kernel reads each row's tile
from the master if the row folded, else from the copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.replay import (_FlushStores, _Program, _copy_counts,
                                   _copy_spec, _dot_precision, _flush_programs,
                                   _fold_dot, _pad_pow2, _unpack,
                                   copy_operands, fold_product,
                                   persistent_items, rank1_fold)
from pallas_kernels.replay import default_block_p as _step_block_p
from replayssm_jax.reference import process_dt
from replayssm_jax.speculative import verify_bc, verify_readout, verify_terms

F32 = jnp.float32


def default_block_p(batch: int, nheads: int, headdim: int) -> int:
  """The replay step's heuristic (`replay.default_block_p`) capped at 32.
  H200, hybrid_1b's layer at batch 256, T 4, L 16 (verify_sweep_h200.json,
  sweep 3, B.C precomputed): window kernel 0.382 ms at block_p 32, 0.403
  at 16, 0.434 at 64."""
  return min(32, _step_block_p(batch, nheads, headdim))


def _folds(c, window, L):
  """Rows whose window does not fit behind their history fold it first."""
  return (c >= 0) & (c < L) & (c + window >= L) & (c > 0)


def _history_dt(p, dtb_ref, hist):
  """(d_j [L], sum_{i>j} d_i [L]) of head p.head0's buffered history
  slots `hist` (zero elsewhere)."""
  d_hist = plgpu.load(dtb_ref.at[p.b, :, p.head0], mask=hist, other=0.0)
  return d_hist, common.suffix_sums(d_hist, p.j)


def _history_x(p, xb_ref, hist, block_p):
  """x of head p.head0's buffered history slots `hist` ([L, block_p] in
  the buffer dtype; zeros elsewhere, those loads masked off)."""
  return plgpu.load(xb_ref.at[p.b, :, p.head0, p.ps],
                    mask=jnp.broadcast_to(hist[:, None], (p.L, block_p)),
                    other=0.0)


def _fold_history(p, refs, stores, *, block_p, fold_dot):
  """checkpoint tile of head p.head0 <- advanced over the row's c buffered
  tokens: decay * S_0 + sum_j s_j x_j B_j^T (j < c), stored (`stores`, a
  replay._FlushStores: with a copy spec also the re-stored read copy).
  fold_dot: None for exact f32 rank-1 updates, else one [block_p, L] x
  [L, N] dot with this precision (L, block_p >= 16)."""
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

    st = rank1_fold(decay * s0, a, token, L, unroll=False)
  else:
    x_hist = _history_x(p, xb_ref, hist, block_p)
    b_hist = plgpu.load(bb_ref.at[b, :, g, :],
                        mask=jnp.broadcast_to(hist[:, None], (L, nstate)),
                        other=0.0)  # [L, N]
    s = d_hist * jnp.exp(a * suffix)  # the weights s_j
    st = fold_product(x_hist, s, b_hist, fold_dot, decay * s0)
  stores.store(p, h, st)


def _fold_stores(refs, has_D, has_z, has_bias, copy_spec):
  """(the 10 inputs, _FlushStores) of a fold kernel's refs: inputs, the
  copy spec's extra inputs (read copy, scales, SR keys), D / z / dt_bias,
  then the outputs (master, read copy, scales)."""
  nin, nout = _copy_counts(copy_spec)
  ins, _, outs = _unpack(refs, 10 + nin, 1 + nout, has_D, has_z, has_bias)
  return ins[:10], _FlushStores(outs, ins[10:], copy_spec)


def _fold_kernel(*refs, window, has_D, has_z, has_bias, fold_dot,
                 copy_spec=None, **kw):
  """Early flush on the window kernel's grid: programs of rows that do not
  fold exit at once."""
  ins, stores = _fold_stores(refs, has_D, has_z, has_bias, copy_spec)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, _, _, a_ref, _, _ = ins
  p = _Program.from_grid(cnt_ref, None, a_ref, None, **kw)
  pl.when(_folds(p.c, window, p.L))(functools.partial(
      _fold_history, p, (ck_ref, xb_ref, bb_ref, dtb_ref, a_ref), stores,
      block_p=kw["block_p"], fold_dot=fold_dot))


def _fold_persistent_kernel(*refs, window, has_D, has_z, has_bias, fold_dot,
                            num_programs, nheads, heads_per_group, block_p,
                            headdim, buffer_len, copy_spec=None, **kw):
  """Early flush on a fixed grid of num_programs programs sharing out the
  (folding row, head, headdim block) items, as the replay step's persistent
  flush route: rows that do not fold cost no program. The counters come
  padded to a power of two with -1."""
  ins, stores = _fold_stores(refs, has_D, has_z, has_bias, copy_spec)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, _, _, a_ref, _, _ = ins
  refs = (ck_ref, xb_ref, bb_ref, dtb_ref, a_ref)

  def item(b, h, pblk):
    p = _Program(cnt_ref, None, a_ref, None, b=b, g=h // heads_per_group,
                 pblk=pblk, head0=h, block_p=block_p,
                 buffer_len=buffer_len, **kw)
    _fold_history(p, refs, stores, block_p=block_p, fold_dot=fold_dot)

  persistent_items(pl.program_id(0),
                   _folds(cnt_ref[...], window, buffer_len), item,
                   num_programs=num_programs, nheads=nheads,
                   nblk=headdim // block_p)


def _verify_kernel(*refs, window, has_D, has_z, has_bias, dt_softplus,
                   precompute, readout_dot, xla_readout, readout_chunk,
                   readout_fma=False, copy=False, scaled=False,
                   copy_readout="masked", **kw):
  """Window outputs from checkpoint + history + window; append the window.
  precompute (`VerifyConfig.precompute`): "bc" adds three inputs after C,
  the B.C products of `speculative.verify_bc`; "terms" two, the decay and extra
  terms of `speculative.verify_terms` (the kernel then only reads the
  checkpoint tile out against each position's C). readout_dot: see
  `_readouts` (not None: one more input, C padded, last). xla_readout: one
  more input, last, the readouts of `speculative.verify_readout` [b, T, h,
  p] (the checkpoint is then not read). copy (with readout "reduce"): the
  read copy, then with `scaled` its scales, come last: rows that folded read
  the checkpoint (the stored master), the others the copy (`_copy_readouts`,
  as `copy_readout` says). readout_fma: the column blocks' products summed
  by PTX multiply-adds (`common.fma`).
  """
  n_pre = dict(none=0, bc=3, terms=2)[precompute]
  n_read = 10 + n_pre + (readout_dot is not None or xla_readout)
  ins, (d_ref, z_ref, bias_ref), outs = _unpack(
      refs, n_read + copy + scaled, 5, has_D, has_z, has_bias)
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, x_ref, dt_ref, a_ref, b_ref = (
      ins[:9])
  c_ref = ins[9]
  y_ref = outs[0]
  T = window
  p = _Program.from_grid(cnt_ref, None, a_ref, None,
                         dt_softplus=dt_softplus, **kw)
  b, g, ps, L, c, h = p.b, p.g, p.ps, p.L, p.c, p.head0
  base = jnp.where(c + T >= L, 0, c)  # committed tokens left in the buffer
  hist = p.j < base
  bias = None if bias_ref is None else bias_ref[h]
  # The window's x rows and (with "terms") the XLA-formed terms are loaded
  # once, before the checkpoint is read out. Loaded per position behind the
  # previous output store's barriers, and x again by the append, they left
  # the output stores and the append 39% of the kernel's stall samples
  # (Nsight Compute, session 34, batch 512). With XLA's processed dt (below):
  # window kernel 0.377 ms against 0.423 at batch 512, 0.194 against 0.218
  # at 256 (benchmarks/verify_sweep_h200.json sweep 24).
  xs = [x_ref[b, s, h, ps] for s in range(T)]
  if precompute == "terms":
    decay_ref, extra_ref = ins[10:12]
    terms = [(decay_ref[b, s, h], extra_ref[b, s, h, ps]) for s in range(T)]

  if xla_readout:
    readouts = [ins[10 + n_pre][b, s, h, ps] for s in range(T)]
  elif copy:
    readouts = _copy_readouts(
        ck_ref, ins[n_read], ins[n_read + 1] if scaled else None, (b, h, ps),
        [lambda cols, s=s: c_ref[b, s, g, cols] for s in range(T)],
        _folds(c, T, L), readout_chunk, kw["block_p"],
        copy_readout == "branch", readout_fma)
  else:
    readouts = _readouts(ck_ref, (b, h, ps), c_ref if readout_dot is None
                         else ins[10 + n_pre], b, g, T, readout_dot,
                         readout_chunk, readout_fma)
  if precompute == "terms":
    ys = [decay * r + extra for (decay, extra), r in zip(terms, readouts)]
  else:
    ys = _window_outputs_from_weights(
        p, (xb_ref, bb_ref, dtb_ref, a_ref), readouts,
        (x_ref, dt_ref, b_ref, c_ref), bias, hist,
        tuple(ins[10:13]) if precompute == "bc" else None, window=T,
        dt_softplus=dt_softplus, block_p=kw["block_p"])
  for s, y in enumerate(ys):
    y = common.finish_output(y, xs[s].astype(F32),
                             None if d_ref is None else d_ref[h],
                             None if z_ref is None else z_ref[b, s, h, ps])
    y_ref[b, s, h, ps] = jnp.where(p.valid, y, jnp.nan).astype(y_ref.dtype)

  _append_window(p, refs=(dt_ref, b_ref, bias_ref), outs=outs[1:],
                 window=T, base=base, dt_softplus=dt_softplus, xs=xs)


def _readouts(ck_ref, tile, c_ref, b, g, window, readout_dot, chunk,
              fma_asm=False):
  """S C_s ([block_p] f32) of the checkpoint tile (ck_ref[tile]:
  [block_p, N]) for the T window positions: T dstate reductions
  (readout_dot None) over [block_p, chunk] column blocks
  (`common.readouts`), or one [block_p, N] x [N, TP] dot at that
  precision, c_ref then holding C padded with zero rows to TP = 16
  positions (Triton's smallest dot tile)."""
  if readout_dot is None:
    return common.readouts(
        common.load_tile_blocks(ck_ref, tile, chunk),
        [lambda cols, s=s: c_ref[b, s, g, cols] for s in range(window)],
        fma_asm)
  s0 = plgpu.load(ck_ref.at[tile], eviction_policy="evict_first").astype(F32)
  cw = c_ref[b, :, g, :].astype(F32)  # [TP, N]
  y0 = lax.dot_general(s0, cw, (((1,), (1,)), ((), ())),
                       precision=readout_dot, preferred_element_type=F32)
  return [_column(y0, s) for s in range(window)]


def _copy_readouts(ck_ref, rc_ref, rs_ref, tile, vectors, folded, chunk,
                   block_p, branch=False, fma_asm=False):
  """The readouts (`common.readouts`) of a state with a read copy: the
  stored master's tile if the row folded its history in this verify (as
  the reference reads it), else the read copy's (dequantized: its per-row
  scales factor out of the dstate sums, as in the decode step's output
  route). branch False (`VerifyConfig.copy_readout` "masked"): each source
  is a masked load, so a program reads the bytes of one of them but issues
  the loads, converts and sum of both; True ("branch"): a `lax.cond` on the
  row's fold, so a program runs one source's loads and readouts."""
  if branch:
    def from_master():
      return tuple(common.readouts(
          common.load_tile_blocks(ck_ref, tile, chunk), vectors, fma_asm))

    def from_copy():
      outs = common.readouts(common.load_tile_blocks(rc_ref, tile, chunk),
                             vectors, fma_asm)
      if rs_ref is not None:
        outs = [o * rs_ref[tile] for o in outs]
      return tuple(outs)
    return list(lax.cond(folded, from_master, from_copy))
  master = common.load_tile_blocks(ck_ref, tile, chunk, folded, block_p)
  q = common.load_tile_blocks(rc_ref, tile, chunk, ~folded, block_p)
  outs = common.readouts([m.astype(F32) + v.astype(F32)
                          for m, v in zip(master, q)], vectors, fma_asm)
  if rs_ref is not None:
    scale = jnp.where(folded, 1.0, rs_ref[tile])  # [block_p]
    outs = [o * scale for o in outs]
  return outs


def _column(tile, s):
  """tile[:, s] of a 2-D tile (a static column, by a masked reduction)."""
  cols = jnp.arange(tile.shape[1])
  return jnp.sum(jnp.where(cols[None, :] == s, tile, 0.0), axis=1)


def _window_outputs_from_weights(p, refs, readouts, win_refs, bias, hist, bc,
                                 *, window, dt_softplus, block_p):
  """The T window outputs ([block_p] f32 each, before D and z) from the
  checkpoint's readouts (`_readouts`) and the decay weights of the history
  (slots `hist`) and the window, position by position: two dstate
  reductions per position. bc: the refs of `speculative.verify_bc` (then the B.C
  products are loaded, not reduced)."""
  xb_ref, bb_ref, dtb_ref, a_ref = refs
  b, g, ps, L, h = p.b, p.g, p.ps, p.L, p.head0
  nstate = bb_ref.shape[-1]
  a = a_ref[h].astype(F32)
  d_hist, suf_hist = _history_dt(p, dtb_ref, hist)
  x_hist = _history_x(p, xb_ref, hist, block_p).astype(F32)
  b_hist = None if bc is not None else plgpu.load(
      bb_ref.at[b, :, g, :], mask=jnp.broadcast_to(hist[:, None],
                                                   (L, nstate)),
      other=0.0).astype(F32)  # [L, N]
  x_ref, dt_ref, b_ref, c_ref = win_refs
  T = window
  jw = jnp.arange(T)
  d_win = process_dt(dt_ref[b, :, h], bias, dt_softplus)  # [T]
  # Earlier window tokens are read back from the buffer, so they carry its
  # rounding; the current position uses the caller's values (as the
  # reference and the decode step do).
  x_win = x_ref[b, :, h, ps].astype(F32)  # [T, block_p]
  x_win_st = x_win.astype(xb_ref.dtype).astype(F32)
  if bc is None:
    b_win = b_ref[b, :, g, :].astype(F32)  # [T, N]
    b_win_st = b_win.astype(bb_ref.dtype).astype(F32)
  else:
    hist_ref, win_ref, own_ref = bc
    bc_hist_all = plgpu.load(  # [L, T]
        hist_ref.at[b, g], mask=jnp.broadcast_to(hist[:, None],
                                                 hist_ref.shape[2:]),
        other=0.0)
    bc_win_all = win_ref[b, g]  # [T, T]: earlier token i, position s
    bc_own = own_ref[b, g]  # [T]
  after_w = jw[:, None] < jw[None, :]
  ys = []
  for s in range(T):
    dws = jnp.where(jw <= s, d_win, 0.0)  # [T]
    tot_win = jnp.sum(dws)
    suf_win = jnp.sum(jnp.where(after_w, dws[None, :], 0.0), axis=1)
    w_hist = d_hist * jnp.exp(a * (suf_hist + tot_win))  # [L]
    w_win = dws * jnp.exp(a * suf_win)  # [T]
    decay = jnp.exp(a * (jnp.sum(d_hist) + tot_win))
    cs = c_ref[b, s, g, :].astype(F32)  # [N]
    cur = (jw == s)[:, None]
    xw = jnp.where(cur, x_win, x_win_st)
    if bc is None:
      bc_hist = jnp.sum(b_hist * cs[None, :], axis=1)  # [L]
      bc_win = jnp.sum(jnp.where(cur, b_win, b_win_st) * cs[None, :], axis=1)
    else:
      bc_hist = _column(bc_hist_all, s)  # [L]
      bc_win = jnp.where(jw == s, bc_own, _column(bc_win_all, s))
    ys.append(
        decay * readouts[s]
        + jnp.sum((w_hist * bc_hist)[:, None] * x_hist, axis=0)
        # Later positions (i > s) selected away: they may hold anything.
        + jnp.sum(jnp.where((jw <= s)[:, None],
                            (w_win * bc_win)[:, None] * xw, 0.0), axis=0))
  return ys


def _append_window(p, refs, outs, *, window, base, dt_softplus, xs):
  """Appends the window's inputs behind the row's committed history and
  stores the row's new count (the verify kernels' common tail). xs: the
  window's x rows of this program ([block_p] each, loaded by the caller)."""
  dt_ref, b_ref, bias_ref = refs
  xb_out, bb_out, dtb_out, cnt_out = outs
  b, g, ps, h, c, T = p.b, p.g, p.ps, p.head0, p.c, window
  bias = None if bias_ref is None else bias_ref[h]

  @pl.when(p.valid)
  def _append():
    for i in range(T):
      xb_out[b, base + i, h, ps] = xs[i].astype(xb_out.dtype)

    @pl.when(p.pblk == 0)
    def _append_dt():
      for i in range(T):
        dtb_out[b, base + i, h] = process_dt(dt_ref[b, i, h], bias,
                                             dt_softplus)

    @pl.when(p.pid == 0)  # the group's first head, first headdim block
    def _append_b():
      for i in range(T):
        bb_out[b, base + i, g, :] = b_ref[b, i, g, :].astype(bb_out.dtype)

  @pl.when((g == 0) & (p.pid == 0))
  def _count():
    cnt_out[b] = jnp.where(p.valid, base, c).astype(cnt_out.dtype)


# `VerifyConfig(fold_num_warps=None)` (H200 sweeps: see its docstring).
DEFAULT_FOLD_NUM_WARPS = 2


@functools.partial(jax.jit, static_argnames=("dt_softplus", "policy",
                                             "config", "interpret"))
def replay_verify(rstate, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                  dt_softplus=False, policy=None, layer=0, *,
                  config: common.VerifyConfig = common.VerifyConfig(),
                  interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config.

  A state with a read copy or stochastic rounding (`policy`): the fold
  kernel stores the folding rows' master and re-stored copy (aliased, as
  the decode step's flush: `replay._FlushStores`); the window kernel reads
  each row's tile from the master if it folded, else from the copy (config
  .readout "reduce" only).
  """
  from replayssm_jax.state import ReplayState  # pylint: disable=g-import-not-at-top
  spec = _copy_spec(rstate, policy, interpret)
  copy = rstate.read_copy is not None
  if copy and config.readout != "reduce":
    raise NotImplementedError(
        f"config.readout={config.readout!r} reads the checkpoint of every "
        f"row; a state with a read copy needs readout='reduce' (rows that "
        f"fold nothing read the copy).")
  batch, nheads, headdim, _ = rstate.checkpoint.shape
  T, ngroups = x.shape[1], rstate.ngroups
  per_group = nheads // ngroups
  block_p = common.resolve_block_p(
      config.block_p or default_block_p(batch, nheads, headdim), headdim)
  kw = dict(buffer_len=rstate.buffer_len, heads_per_program=1,
            heads_per_group=per_group, block_p=block_p, headdim=headdim,
            window=T, has_D=D is not None, has_z=z is not None,
            has_bias=dt_bias is not None)
  grid = ((headdim // block_p) * per_group, ngroups, batch)
  params = plgpu.CompilerParams(num_warps=config.num_warps,
                                num_stages=config.num_stages)
  sds = jax.ShapeDtypeStruct
  token_in = [x, dt, A, B, C]
  optional = [v for v in (D, z, dt_bias) if v is not None]
  # 1. Early flush of the committed history (in place, folding rows only).
  fold_kw = dict(kw, dt_softplus=dt_softplus,
                 fold_dot=_fold_dot(config.fold, rstate.buffer_len, block_p,
                                    interpret, field="config.fold",
                                    tile="block_p",
                                    b_dtypes=(rstate.b_buf.dtype,),
                                    ck_dtype=rstate.checkpoint.dtype))
  count = rstate.count
  fold_warps = config.fold_num_warps or DEFAULT_FOLD_NUM_WARPS
  if config.fold_grid == "persistent":
    nprog = config.fold_programs or _flush_programs(
        interpret, fold_warps, config.fold_max_registers)
    fold_kernel = functools.partial(_fold_persistent_kernel, nheads=nheads,
                                    num_programs=nprog, **fold_kw)
    fold_grid = (nprog,)
    count = _pad_pow2(count)
  else:
    fold_kernel = functools.partial(_fold_kernel, **fold_kw)
    fold_grid = grid
  fold_params = plgpu.CompilerParams(num_warps=fold_warps,
                                     num_stages=config.num_stages)
  copy_in, aliases, copy_shapes = copy_operands(spec, policy, layer, rstate,
                                                10, 1)
  if spec is not None:
    fold_kernel = functools.partial(fold_kernel, copy_spec=spec)
  ck, *copy_out = pl.pallas_call(
      fold_kernel, grid=fold_grid,
      out_shape=(sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),
                 *copy_shapes),
      input_output_aliases={0: 0, **aliases}, compiler_params=fold_params,
      interpret=interpret,
      name=common.capped_name("replayssm_verify_fold",
                              config.fold_max_registers),
  )(rstate.checkpoint, rstate.x_buf, rstate.b_buf, rstate.dt_buf,
    count, *token_in, *copy_in, *optional)
  # 2. Window outputs and appends (reads the folded checkpoint).
  # The kernel's inputs: "<x>_reduce" is <x> formed by XLA reductions
  # instead of einsums.
  precompute = config.precompute.removesuffix("_reduce")
  form = "dot" if precompute == config.precompute else "reduce"
  win_in, win_optional, win_kw, win_softplus = (token_in, optional, kw,
                                                dt_softplus)
  if precompute == "bc":
    pre = verify_bc(rstate.b_buf, B, C, form=form)
  elif precompute == "terms":
    c = rstate.count.astype(jnp.int32)
    d_win = process_dt(dt, dt_bias, dt_softplus)
    pre = verify_terms(rstate.x_buf, rstate.b_buf, rstate.dt_buf,
                       jnp.where(c + T >= rstate.buffer_len, 0, c), x, B,
                       d_win, C, A, form=form)
    # The kernel appends this processed dt (XLA's, as the terms use it)
    # instead of forming it per program (Nsight Compute, session 34: the
    # softplus and its dt loads were 14% of the window kernel's executed
    # instructions and 11% of its stall samples at batch 512).
    win_in = [x, d_win, A, B, C]
    win_optional = [v for v in (D, z) if v is not None]
    win_kw = dict(kw, has_bias=False)
    win_softplus = False
  else:
    pre = ()
  readout_dot = None
  if config.readout == "xla":
    pre = (*pre, verify_readout(ck, C))
  elif config.readout != "reduce":
    if min(block_p, rstate.dstate) < 16:
      raise NotImplementedError(
          f"config.readout={config.readout!r} needs block_p and dstate >= 16 "
          f"(Triton dot tiles), got {block_p} and {rstate.dstate}.")
    readout_dot = _dot_precision(config.readout, interpret)
    pre = (*pre, jnp.pad(C, ((0, 0), (0, max(16, T) - T), (0, 0), (0, 0))))
  y, xb, bb, dtb, cnt = pl.pallas_call(
      functools.partial(_verify_kernel, dt_softplus=win_softplus,
                        precompute=precompute,
                        readout_dot=readout_dot,
                        xla_readout=config.readout == "xla",
                        readout_chunk=config.readout_chunk,
                        readout_fma=config.readout_fma and not interpret,
                        copy=copy,
                        copy_readout=config.copy_readout,
                        scaled=rstate.read_scale is not None, **win_kw),
      grid=grid,
      out_shape=(sds(x.shape, x.dtype),
                 sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                 sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                 sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                 sds(rstate.count.shape, rstate.count.dtype)),
      input_output_aliases={1: 1, 2: 2, 3: 3}, compiler_params=params,
      interpret=interpret,
      name=common.capped_name("replayssm_verify_window",
                              config.max_registers),
  )(ck, rstate.x_buf, rstate.b_buf, rstate.dt_buf, rstate.count, *win_in,
    *pre, *copy_out, *win_optional)
  fields = {}
  if copy:
    fields["read_copy"] = copy_out[0]
    if rstate.read_scale is not None:
      fields["read_scale"] = copy_out[1]
  if rstate.step is not None:  # commit advances step
    fields.update(row_id=rstate.row_id, step=rstate.step)
  return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                        count=cnt, pending_window=T, **fields)
