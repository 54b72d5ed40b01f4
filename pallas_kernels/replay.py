"""Pallas (Triton backend) kernels: the ReplaySSM decode step.

Two kernels, both launched every step (the route of a row is data: no host
branch, one compile):

* output route (rows with count c < L-1): y = exp(Lambda) (S_0 C)
  + sum_j s_j (B_j . C) x_j + D x from the checkpoint S_0 and the buffer,
  then append (x, dt', B) at slot c. The checkpoint is only read.
* flush route (rows with c == L-1): fold the L-1 buffered tokens and the
  current one into a new checkpoint ([block_p, L] x [L, N] tensor-core
  dots, `fold_product`, or exact f32 rank-1 updates), store it, and read y
  from it.

Output-route grid: (headdim blocks x head blocks of one group, ngroups,
batch). A program owns `block_p` headdim rows of `heads_per_program` heads
of one B/C group of one row; it forms bc_j = B_j . C once, so the B buffer
is read once per group (not once per head) when a program holds the whole
group. The flush route runs by default on a small persistent grid whose
programs share out the (flush row, head, headdim block) items of the flush
rows only, so the ~(L-1)/L of rows that do not flush cost it nothing
(`ReplayConfig.flush_grid="rows"` launches it on the output grid instead,
with early exits). Keeping the fold in its own kernel keeps the output
route's register footprint at one checkpoint tile. At small batch both
routes share one launch (`ReplayConfig.fused_launch`): persistent flush
programs beside the output items, or, on an f32 checkpoint, the output
route's own programs folding their flush rows (`_fused_rows_kernel`).
`ReplayConfig.flush_route="mosaic_gpu"` folds the flush rows with the
Mosaic GPU kernel (`mosaic_gpu.flush`) before the output route instead.
`ReplayConfig.output_route="split"` (the default for 8-bit read copies at
large batch, `default_output_route`) runs the output route as two
kernels: the tile readout y0 = S C alone (`_readout_kernel`), then the
window terms, appends and counters per (group, row) (`_window_kernel`).

The checkpoint and the buffers are aliased input->output and only the
elements named above are stored: a non-flush step never writes the
checkpoint. New counters go to a fresh [batch] output (every program of a row
reads the old counter, so it cannot be updated in place). Matches
`replayssm_jax.reference.replay_state_update`.

Dual precision (a state with a read copy, `precision.PrecisionPolicy`): the
output route reads the read copy (bf16/f16, or fp8 e4m3/int8 dequantized
in f32 with its per-(row, head, headdim-row) scales) in place of the
checkpoint, which it does not take as an input at all; the flush route
reads the master + buffer, folds in f32, stores the master in its dtype and
the copy re-stored from the stored master (`precision.store`, scales from
the row amax over dstate), both aliased input->output so non-flush rows'
master, copy and scales keep their bits. Stochastic rounding of the flush
stores recomputes the reference's random bits per element in-kernel (the
policy's hash, `precision.element_bits`; keys per row from
`precision.row_keys`). A plain
state runs exactly the kernels above (same inputs, same code).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels import mosaic_gpu
from replayssm_jax import precision as P
from replayssm_jax import reference
from replayssm_jax.reference import process_dt

F32 = jnp.float32


class _Program:
  """One (row, heads, headdim block) work item and its token window."""

  def __init__(self, cnt_ref, dt_ref, a_ref, bias_ref, *, b, g, pblk, head0,
               buffer_len, block_p, dt_softplus, pid=None, count=None, **_):
    """count: the row's counter when known at trace time (then it is not
    loaded and the slot masks are constants), else read from cnt_ref."""
    self.L = buffer_len
    self.b, self.g, self.pblk, self.head0, self.pid = b, g, pblk, head0, pid
    self.ps = pl.ds(pblk * block_p, block_p)
    self.c = cnt_ref[b] if count is None else jnp.int32(count)
    # A counter outside [0, L) (possible only under jit) must not write out
    # of bounds: such a row appends nothing, keeps its count, outputs NaN.
    self.valid = (self.c >= 0) & (self.c < self.L)
    self.flush = self.c == self.L - 1
    self.j = jnp.arange(self.L)
    self.hist = self.j < self.c  # buffered slots
    self.cur = self.j == self.c  # the current token's logical slot
    self._dt, self._a, self._bias = dt_ref, a_ref, bias_ref
    self._softplus = dt_softplus

  @classmethod
  def from_grid(cls, *refs, **kw):
    """Grid (headdim blocks x head blocks of a group, ngroups, batch)."""
    return cls.from_ids(*refs, pid=pl.program_id(0), g=pl.program_id(1),
                        b=pl.program_id(2), **kw)

  @classmethod
  def from_ids(cls, *refs, pid, g, b, heads_per_program, heads_per_group,
               block_p, headdim, **kw):
    """The item of program (pid, g, b) of the output route's grid."""
    nblk_p = headdim // block_p
    return cls(*refs, b=b, g=g, pblk=pid % nblk_p, block_p=block_p,
               head0=g * heads_per_group + (pid // nblk_p) * heads_per_program,
               pid=pid, **kw)

  def window_loads(self, h, dtb_ref, valid=None, unmasked=False):
    """The global loads of window_from for head h (a dict, so a persistent
    loop can issue them an item ahead); valid masks the vector load;
    unmasked: load every slot and zero the unfilled ones after (the load
    does not wait on the counter)."""
    if unmasked:
      d_hist = jnp.where(self.hist, dtb_ref[self.b, :, h], 0.0)
    else:
      mask = self.hist if valid is None else self.hist & valid
      d_hist = plgpu.load(dtb_ref.at[self.b, :, h], mask=mask, other=0.0)
    ld = dict(dt=self._dt[self.b, h], a=self._a[h], d_hist=d_hist)
    if self._bias is not None:
      ld["bias"] = self._bias[h]
    return ld

  def window_from(self, ld):
    """dt' of the current token, the weights s_j and the decay, from
    window_loads."""
    d_cur = process_dt(ld["dt"], ld.get("bias"), self._softplus)
    dw = jnp.where(self.cur, d_cur, ld["d_hist"])  # zero past the current slot
    a = ld["a"].astype(F32)
    # s_j = d_j exp(A sum_{i>j} d_i)
    s = dw * jnp.exp(a * common.suffix_sums(dw, self.j))
    return d_cur, s, jnp.exp(a * jnp.sum(dw))

  def window_weights(self, h, dtb_ref, unmasked=False):
    """dt' of the current token, the weights s_j and the decay of head h."""
    return self.window_from(self.window_loads(h, dtb_ref,
                                              unmasked=unmasked))


def _window_load(ref, hist, shape, unmasked=False):
  """A buffer window [L, ...] (ref, of that shape) in f32: the filled
  slots (hist [L] bool), zeros past them; unmasked: every slot loaded and
  the unfilled ones zeroed after (the load does not wait on the
  counter)."""
  m = jnp.broadcast_to(hist.reshape(hist.shape + (1,) * (len(shape) - 1)),
                       shape)
  if unmasked:
    return jnp.where(m, plgpu.load(ref).astype(F32), 0.0)
  return plgpu.load(ref, mask=m, other=0.0).astype(F32)


def _unpack(refs, n_in, n_out, has_D, has_z, has_bias):
  it = iter(refs)
  ins = [next(it) for _ in range(n_in)]
  opt = [next(it) if flag else None for flag in (has_D, has_z, has_bias)]
  outs = [next(it) for _ in range(n_out)]
  return ins, opt, outs


def _output_kernel(*refs, has_D, has_z, has_bias, all_rows, precomputed_bc,
                   scaled=False, weights=False, prefetch_heads=False,
                   readout_chunk=None, unmasked=False, eager=False,
                   y_in=False, readout_dot=False, fma_asm=False, **kw):
  """Output route: y from checkpoint + buffer; non-flush rows append.

  With all_rows, flush rows take this route for y as well (the formula holds
  for any row), so no program waits on its row's counter before issuing the
  checkpoint read; the flush kernel then only stores the new checkpoint.
  Otherwise flush-row programs exit at once.

  The state read (ck_ref) is the checkpoint, or the state's read copy when it
  has one (then the master is not an input at all); `scaled`: an 8-bit copy
  whose per-row f32 scales follow the inputs (applied to the readout).
  weights: three inputs after C, `output_weights`' (k, decay, dt').
  y_in: a y input after the optional ones, aliased to the y output (the
  flush rows' y, already written by the Mosaic flush), never read.
  """
  ins, opt, outs = _unpack(
      refs, 10 + precomputed_bc + 3 * weights + scaled, 5 + y_in, has_D,
      has_z, has_bias)
  outs = outs[y_in:]
  p = _Program.from_grid(ins[4], ins[6], ins[7], opt[2], **kw)
  _output_route(p, ins, opt, outs, all_rows=all_rows,
                precomputed_bc=precomputed_bc, scaled=scaled, weights=weights,
                block_p=kw["block_p"],
                heads_per_program=kw["heads_per_program"],
                prefetch_heads=prefetch_heads, readout_chunk=readout_chunk,
                unmasked=unmasked, eager=eager, readout_dot=readout_dot,
                fma_asm=fma_asm)


def _output_route(p, ins, opt, outs, *, all_rows, precomputed_bc, scaled,
                  block_p, heads_per_program, weights=False,
                  prefetch_heads=False, readout_chunk=None, unmasked=False,
                  eager=False, readout_dot=False, fma_asm=False):
  """The output route of item p (see _output_kernel for the refs);
  weights: the window weights, decay and dt' are inputs
  (`ReplayConfig.output_weights`) instead of the program's B.C products
  and dt window;
  prefetch_heads: load the checkpoint tiles of all the program's heads
  before computing any (a Python loop over the heads); readout_chunk: the
  tile's column blocks (`common.load_tile_blocks`); unmasked: load every
  buffer slot and zero the unfilled ones after
  (`ReplayConfig.output_unmasked_buffers`); eager: every row's program
  computes (its loads do not wait on the row's counter), a flush row's y
  is not stored (the flush route stores it; `ReplayConfig.output_eager`);
  readout_dot: the tile read out by one tensor-core product
  (`common.readout_dot`, `ReplayConfig.readout="dot"`); fma_asm: the
  column blocks' products accumulated by PTX multiply-adds
  (`ReplayConfig.readout_fma`)."""

  def hist_load(ref, shape):
    return _window_load(ref, p.hist, shape, unmasked)

  d_ref, z_ref, _ = opt
  ck_ref, xb_ref, bb_ref, dtb_ref, _, x_ref, _, _, b_ref = ins[:9]
  c_ref = ins[9]
  scale_ref = ins[10 + precomputed_bc + 3 * weights] if scaled else None
  # Buffers are aliased input->output (same HBM on GPU; copies of the inputs
  # in interpret mode): read the inputs, store to the outputs.
  y_ref, xb_out, bb_out, dtb_out, cnt_out = outs
  b, g, ps = p.b, p.g, p.ps
  appends = jnp.logical_not(p.flush) & p.valid

  @pl.when((g == 0) & (p.pid == 0))
  def _count():
    new = jnp.where(p.flush, 0, p.c + 1)
    cnt_out[b] = jnp.where(p.valid, new, p.c).astype(cnt_out.dtype)

  def route():
    if not weights:
      cv = c_ref[b, g, :].astype(F32)  # [N]
      b_cur = b_ref[b, g, :].astype(F32)
      bc_cur = jnp.sum(b_cur * cv)
      if precomputed_bc:  # bc_j = B_j . C precomputed per (row, slot, group)
        bc_hist = hist_load(ins[10].at[b, :, g], (p.L,))
      else:  # once per program, for all its heads
        b_hist = hist_load(bb_ref.at[b, :, g, :], (p.L, cv.shape[0]))
        bc_hist = jnp.sum(b_hist * cv[None, :], axis=1)  # [L]
      bc = jnp.where(p.cur, bc_cur, bc_hist)  # [L]

    def load_tile(r):
      return common.load_tile_blocks(ck_ref, (b, p.head0 + r, ps),
                                     readout_chunk)

    def one_head(r, carry, s0=None):
      h = p.head0 + r
      if s0 is None:
        # Issue the big read first so its latency overlaps the small math.
        s0 = load_tile(r)
      scale = None if scale_ref is None else scale_ref[b, h, ps]
      if weights:  # k_j = s_j B_j . C, zero past the current slot
        k_ref, decay_ref, dcur_ref = ins[10:13]
        k, decay, d_cur = k_ref[b, :, h], decay_ref[b, h], dcur_ref[b, h]
      else:
        d_cur, s, decay = p.window_weights(h, dtb_ref, unmasked=unmasked)
        k = s * bc
      x_in = x_ref[b, h, ps]  # [block_p]; the append stores it as loaded
      x_cur = x_in.astype(F32)
      x_hist = hist_load(xb_ref.at[b, :, h, ps], (p.L, block_p))
      x_win = jnp.where(p.cur[:, None], x_cur[None, :], x_hist)
      if readout_dot:
        readout = common.readout_dot(s0[0], c_ref[b, g, :])  # [block_p]
      else:
        (readout,) = common.readouts(  # [block_p]
            s0, [lambda cols: c_ref[b, g, cols]], fma_asm)
      if scale is not None:
        # precision.dequantize is q * scale per (head, headdim row), so the
        # scale factors out of the dstate sum: one multiply per row, not
        # per element (the reference rounds (q * scale) * C instead).
        readout = readout * scale
      y = decay * readout + jnp.sum(k[:, None] * x_win, axis=0)
      y = common.finish_output(y, x_cur, None if d_ref is None else d_ref[h],
                               None if z_ref is None else z_ref[b, h, ps])
      y = jnp.where(p.valid, y, jnp.nan)
      if eager and not all_rows:
        # The tile a flush row read here may be the one its flush program
        # is rewriting (fused launch): the result is dropped.
        @pl.when(jnp.logical_not(p.flush))
        def _store_y():
          y_ref[b, h, ps] = y.astype(y_ref.dtype)
      else:
        y_ref[b, h, ps] = y.astype(y_ref.dtype)

      @pl.when(appends)
      def _append_x():
        xb_out[b, p.c, h, ps] = x_in.astype(xb_out.dtype)

      @pl.when(appends & (p.pblk == 0))
      def _append_dt():
        dtb_out[b, p.c, h] = d_cur

      return carry

    if prefetch_heads:  # every head's tile in flight before any math
      tiles = [load_tile(r) for r in range(heads_per_program)]
      for r, tile in enumerate(tiles):
        one_head(r, 0, tile)
    else:
      lax.fori_loop(0, heads_per_program, one_head, 0)

    @pl.when(appends & (p.pid == 0))
    def _append_b():
      bb_out[b, p.c, g, :] = b_ref[b, g, :].astype(bb_out.dtype)

  if all_rows or eager:
    route()
  else:
    pl.when(jnp.logical_not(p.flush))(route)


def _fold_loads(p, h, refs, *, fold_dot, block_p, valid=None):
  """The global loads of head h's fold outside its rank-1 loop (a dict):
  the checkpoint tile first (the big read), the current token, the dt
  window and, for a dot fold, the buffered x and B. valid (a traced bool)
  masks the vector loads, so a prefetch past a program's last item reads
  nothing."""
  ck_ref, xb_ref, bb_ref, dtb_ref, x_ref, b_ref = refs
  b, g, ps, L = p.b, p.g, p.ps, p.L

  def mask(shape, m=None):  # m & valid, broadcast to shape (None: none)
    if valid is not None:
      m = jnp.broadcast_to(valid, shape) if m is None else m & valid
    return None if m is None else jnp.broadcast_to(m, shape)

  s0_shape = (block_p, ck_ref.shape[-1])
  ld = dict(s0=plgpu.load(ck_ref.at[b, h, ps], mask=mask(s0_shape),
                          other=None if valid is None else 0,
                          eviction_policy="evict_first"))
  ld.update(p.window_loads(h, dtb_ref, valid))
  ld.update(x_cur=x_ref[b, h, ps], b_cur=b_ref[b, g, :])
  if fold_dot is not None:
    nstate = ck_ref.shape[-1]
    ld["b_hist"] = plgpu.load(bb_ref.at[b, :, g, :], other=0.0, mask=mask(
        (L, nstate), jnp.broadcast_to(p.hist[:, None], (L, nstate))))
    ld["x_hist"] = plgpu.load(xb_ref.at[b, :, h, ps], other=0.0, mask=mask(
        (L, block_p), jnp.broadcast_to(p.hist[:, None], (L, block_p))))
  return ld


def rank1_fold(st, a, token, n, *, unroll, suffix0=0.0):
  """st + sum_j s_j x_j B_j^T over tokens j = n-1, ..., 0 (newest first) by
  exact f32 rank-1 updates, s_j = d_j exp(a (suffix0 + sum_{i>j} d_i)).

  token(j) -> (d_j f32 scalar, x_j [block_p] f32, B_j [N] f32). Each weight
  comes from a running scalar suffix sum of the scalar d_j, so the loop
  holds no vector reduction (no cross-thread shuffles or barriers): its
  body is one FMA per tile element. unroll: a Python loop (Triton's scan
  lowering refuses unroll), else a fori_loop."""
  def body(i, carry):
    st, suffix = carry
    d, x, b = token(n - 1 - i)
    w = d * jnp.exp(a * suffix)
    return st + (w * x)[:, None] * b[None, :], suffix + d

  carry = (st, jnp.asarray(suffix0, F32))
  if unroll:
    for i in range(n):
      carry = body(i, carry)
  else:
    carry = lax.fori_loop(0, n, body, carry)
  return carry[0]


def fold_product(x_win, s, b_win, fold_dot, acc):
  """acc + sum_j s_j x_j B_j^T by tensor-core products -> [block_p, N] f32.

  x_win [L, block_p], b_win [L, N] in their stored dtypes, s [L] f32, acc
  [block_p, N] f32 (the decayed checkpoint tile). fold_dot: a lax
  precision (`_dot_precision`): the f32 dot of s x and B at that
  precision; or "bf16xK": B must be bf16 (exact in bf16), and X = s x
  (f32) is split into K bf16 pieces X = X_1 + ... + X_K (8 more mantissa
  bits each: K 3 carries all 24 of f32), folded by K bf16 dots with f32
  accumulation (products of bf16 values are exact in f32), smallest piece
  first. Unlike 3xTF32, neither operand needs 32-bit shared-memory tiles,
  and B is not split. The split is on the x side, [L, block_p], not on
  the weighted B, [L, N] as in session 13: half the elements to split (N
  is 128, block_p at most the headdim 64) and one shared-memory copy of B
  instead of K.

  Each dot's product is added to acc as it comes (acc + d_3 + d_2 + d_1),
  which Triton's combine pass turns into the dots' accumulator operand: the
  decayed tile is the accumulator, not a second tile beside the dots'
  sum. Nsight Compute on the H200 (all-rows flush, f16 checkpoint, batch
  256, L 16, 2 warps): 255 registers per thread either way, but no spills
  (66.6k spill requests before), and with the x-side split 21% fewer
  instructions (benchmarks/ncu_h200_flush_b256_f16_L16_session14.txt).
  """
  dims = (((0,), (0,)), ((), ()))
  xs = s[:, None] * x_win.astype(F32)  # [L, block_p]
  if not isinstance(fold_dot, str):
    return acc + lax.dot_general(xs, b_win.astype(F32), dims,
                                 precision=fold_dot,
                                 preferred_element_type=F32)
  return split_dot(xs, b_win, dims, int(fold_dot.removeprefix("bf16x")), acc)


def split_dot(a, b, dims, pieces: int, acc):
  """acc + a . b (lax.dot_general dimension numbers `dims`) in f32, for an
  f32 `a` and a bf16 `b`: a is split into `pieces` bf16 pieces a = a_1 +
  ... + a_K, each dotted with b in bf16 with f32 accumulation (products of
  bf16 values are exact in f32), smallest piece first, each product added
  as it comes (Triton's combine pass turns that into the dots' accumulator
  operand).

  The first piece is a's top 16 bits (truncated: a shift and a mask, no
  float conversion; the remainder a - a_1 is exact), the others the
  remainder rounded to bf16: two pieces carry about 16 mantissa bits
  (relative error <= 2^-15), three all 24 of f32. ptxas offline: the f16
  flush route 864 SASS instructions per program against 872 with a
  rounded first piece (session 33)."""
  bits = lax.bitcast_convert_type(a, jnp.uint32)
  split = [lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16),
                                    jnp.bfloat16)]
  rest = a - lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), F32)
  for _ in range(pieces - 1):
    piece = rest.astype(jnp.bfloat16)
    split.append(piece)
    rest = rest - piece.astype(F32)
  for piece in reversed(split):
    acc = acc + lax.dot_general(piece, b, dims, preferred_element_type=F32)
  return acc


def _fold_from(p, h, ld, refs, *, unroll, fold_dot):
  """The new checkpoint tile of head h from its _fold_loads (the rank-1
  fold loads each buffered token in its loop) -> ([block_p, N] f32,
  x_cur [block_p] f32)."""
  _, xb_ref, bb_ref, dtb_ref, _, _ = refs
  b, g, ps, L = p.b, p.g, p.ps, p.L
  d_cur, s, decay = p.window_from(ld)
  x_cur = ld["x_cur"].astype(F32)
  st = decay * ld["s0"].astype(F32)  # [block_p, N]
  if fold_dot is None:
    # The current token (weight d_cur), then the L-1 buffered ones.
    st = st + (d_cur * x_cur)[:, None] * ld["b_cur"].astype(F32)[None, :]

    def token(j):
      return (dtb_ref[b, j, h], xb_ref[b, j, h, ps].astype(F32),
              bb_ref[b, j, g, :].astype(F32))

    return rank1_fold(st, ld["a"].astype(F32), token, L - 1, unroll=unroll,
                      suffix0=d_cur), x_cur
  b_win = jnp.where(p.cur[:, None], ld["b_cur"][None, :],
                    ld["b_hist"])  # [L, N]
  x_win = jnp.where(p.cur[:, None], ld["x_cur"][None, :],
                    ld["x_hist"])  # [L, block_p]
  return fold_product(x_win, s, b_win, fold_dot, st), x_cur


def _fold_head(p, h, refs, *, unroll, fold_dot, block_p):
  """New checkpoint tile of head h of a flush row (count == L-1):
  decay * S_0 + sum_j s_j x_j B_j^T over the L tokens (L-1 buffered + the
  current one) -> ([block_p, N] f32, x_cur [block_p] f32).

  fold_dot: None folds with L exact f32 rank-1 updates (each extracts its
  weight s_j with a masked reduction); otherwise the fold is one
  [block_p, L] x [L, N] dot with this precision (needs L, block_p >= 16).
  """
  ld = _fold_loads(p, h, refs, fold_dot=fold_dot, block_p=block_p)
  return _fold_from(p, h, ld, refs, unroll=unroll, fold_dot=fold_dot)


@dataclasses.dataclass(frozen=True)
class _CopySpec:
  """What a flush stores besides the master of a state with a read copy
  and/or stochastic rounding (None for the plain state).

  Attributes:
    copy: the state has a read copy (an extra aliased input and output).
    scaled: the copy is 8-bit with [batch, nheads, headdim] f32 scales
      (another aliased input and output).
    sr_master, sr_copy: round the master / the copy stochastically; the
      threefry key data of each row and site come in one [batch, sites, 2]
      uint32 input (master first), see `precision.row_keys`.
    nheads, headdim, dstate: row shape (element indices of the random
      bits).
    rng: the per-element hash of the random bits (`precision.SR_RNGS`).
    reload: interpret mode: derive the copy from the master tile read back
      after its store. XLA:CPU recomputes the fold's last update (an
      elementwise a + b * c) inside each fusion that consumes it and
      contracts it to an FMA in some only, so the copy could round a value
      one f32 ulp away from the stored master (seen on f16 ties); an
      optimization barrier does not survive its fusion passes. Triton
      computes the tile once, so the GPU code keeps it in registers.
  """
  copy: bool
  scaled: bool
  sr_master: bool
  sr_copy: bool
  nheads: int
  headdim: int
  dstate: int
  reload: bool = False
  rng: str = "threefry"

  @property
  def n_in(self) -> int:
    return self.copy + self.scaled + (self.sr_master or self.sr_copy)

  @property
  def n_out(self) -> int:
    return self.copy + self.scaled


class _FlushStores:
  """The flush outputs (after y): master, then read copy and its scales;
  and the extra inputs (read copy, scales, SR keys) that come after y."""

  def __init__(self, outs, extra_ins, spec):
    self.spec = spec
    self.ck_out = outs[0]
    self.rc_out = outs[1] if spec is not None and spec.copy else None
    self.rs_out = outs[2] if spec is not None and spec.scaled else None
    nk = 0 if spec is None else spec.copy + spec.scaled
    self.keys_ref = (extra_ins[nk] if spec is not None
                     and (spec.sr_master or spec.sr_copy) else None)

  def _bits(self, b, site, index):
    k0, k1 = self.keys_ref[b, site, 0], self.keys_ref[b, site, 1]
    spec = self.spec
    return P.element_bits(k0, k1, index,
                          spec.nheads * spec.headdim * spec.dstate, spec.rng)

  def store(self, p, h, st):
    """Stores the master tile rounded to its dtype (maybe stochastically)
    and the read copy re-stored from it, like the reference's flush (a
    plain state: the checkpoint tile alone)."""
    b, ps, spec = p.b, p.ps, self.spec
    if spec is None:
      plgpu.store(self.ck_out.at[b, h, ps], st.astype(self.ck_out.dtype))
      return
    index = None
    if spec.sr_master or spec.sr_copy:
      # Flat element indices (h, p, n) of the tile within the row.
      block_p, n = st.shape
      rows = (jnp.arange(block_p, dtype=jnp.int32) + p.pblk * block_p
              + h * spec.headdim)
      index = (rows[:, None] * n + jnp.arange(n, dtype=jnp.int32)[None, :]
               ).astype(jnp.uint32)
    master = P.round_to(st, self.ck_out.dtype,
                        self._bits(b, 0, index) if spec.sr_master else None)
    plgpu.store(self.ck_out.at[b, h, ps], master)
    if spec.reload:  # interpret mode only, see _CopySpec.reload
      master = plgpu.load(self.ck_out.at[b, h, ps])
    if self.rc_out is None:
      return
    bits = self._bits(b, int(spec.sr_master), index) if spec.sr_copy else None
    mf = master.astype(F32)
    if self.rs_out is not None:
      q, scale = common.quantize_rows(mf, self.rc_out.dtype, bits)
      plgpu.store(self.rc_out.at[b, h, ps], q)
      self.rs_out[b, h, ps] = scale
    else:
      plgpu.store(self.rc_out.at[b, h, ps],
                  P.round_to(mf, self.rc_out.dtype, bits))


def _store_flush(p, h, st, x_cur, stores, y_out, c_ref, d_ref, z_ref):
  """Stores the new checkpoint tile (and y read from it, with y_out)."""
  b, ps = p.b, p.ps
  if y_out is not None:
    y = jnp.sum(st * c_ref[b, p.g, :].astype(F32)[None, :], axis=1)
    y = common.finish_output(y, x_cur, None if d_ref is None else d_ref[h],
                             None if z_ref is None else z_ref[b, h, ps])
    y_out[b, h, ps] = y.astype(y_out.dtype)
  stores.store(p, h, st)


def _flush_kernel(*refs, has_D, has_z, has_bias, writes_y, unroll, fold_dot,
                  copy_spec=None, **kw):
  """Flush route over the output route's grid: programs of non-flush rows
  exit at once (each still costs a launch slot); flush rows fold L tokens
  into a new checkpoint and store it, with writes_y also y (and with
  copy_spec the read copy, see _CopySpec)."""
  nin, nout = _copy_counts(copy_spec)
  ins, opt, outs = _unpack(
      refs, 10 + writes_y + nin, 1 + writes_y + nout, has_D, has_z, has_bias)
  _fold_flush_row(ins, opt, outs[0] if writes_y else None,
                  _FlushStores(outs[writes_y:], ins[10 + writes_y:],
                               copy_spec),
                  unroll=unroll, fold_dot=fold_dot, **kw)


def _fold_flush_row(ins, opt, y_out, stores, *, unroll, fold_dot, **kw):
  """The item of a program on the output route's grid (ins in the kernels'
  order: checkpoint, x / B / dt buffers, counters, x, dt, A, B, C): when
  its row flushes, the tiles of its heads folded and stored (with y when
  y_out is given) -> the item (`_Program`)."""
  d_ref, z_ref, bias_ref = opt
  p = _Program.from_grid(ins[4], ins[6], ins[7], bias_ref, **kw)
  fold_refs = (ins[0], ins[1], ins[2], ins[3], ins[5], ins[8])

  @pl.when(p.flush)
  def _fold():
    def one_head(r, carry):
      h = p.head0 + r
      st, x_cur = _fold_head(p, h, fold_refs, unroll=unroll,
                             fold_dot=fold_dot, block_p=kw["block_p"])
      _store_flush(p, h, st, x_cur, stores, y_out, ins[9], d_ref, z_ref)
      return carry

    lax.fori_loop(0, kw["heads_per_program"], one_head, 0)

  return p


def _flush_persistent_kernel(*refs, has_D, has_z, has_bias, writes_y,
                             unroll, fold_dot, num_programs, nheads,
                             heads_per_group, block_p, headdim,
                             copy_spec=None, **kw):
  """Flush route on a fixed grid of num_programs programs that share out
  the work items (flush row, head, headdim block) of the flush rows only
  (`persistent_items`). So the launch costs num_programs programs whatever
  the batch, and a step where 1/L of the rows flush does 1/L of the work
  (no early-exit program per non-flush row).
  """
  nin, nout = _copy_counts(copy_spec)
  ins, opt, outs = _unpack(
      refs, 10 + writes_y + nin, 1 + writes_y + nout, has_D, has_z, has_bias)
  y_out = outs[0] if writes_y else None
  stores = _FlushStores(outs[writes_y:], ins[10 + writes_y:], copy_spec)
  _flush_items(pl.program_id(0), ins[:10], opt, y_out,
               stores, unroll=unroll, fold_dot=fold_dot,
               num_programs=num_programs, nheads=nheads,
               heads_per_group=heads_per_group, block_p=block_p,
               headdim=headdim, **kw)


def _flush_items(pid, ins, opt, y_out, stores, *, unroll, fold_dot,
                 num_programs, nheads, heads_per_group, block_p, headdim,
                 prefetch=False, **kw):
  """The items of persistent flush program `pid` (of num_programs); with
  prefetch, each item's loads are issued while the previous one folds."""
  ck_ref, xb_ref, bb_ref, dtb_ref, cnt_ref, x_ref, dt_ref, a_ref, b_ref = (
      ins[:9])
  c_ref = ins[9]
  d_ref, z_ref, bias_ref = opt
  L = kw["buffer_len"]
  counts = cnt_ref[...]  # [batch] (padded to a power of two with -1)
  fold_refs = (ck_ref, xb_ref, bb_ref, dtb_ref, x_ref, b_ref)

  def program(b, h, pblk):
    # A flush row's counter is L-1: every load of the item depends only on
    # (b, h), so all of them issue at once.
    return _Program(cnt_ref, dt_ref, a_ref, bias_ref, b=b,
                    g=h // heads_per_group, pblk=pblk, head0=h,
                    block_p=block_p, count=L - 1, **kw)

  def item(b, h, pblk, loads=None):
    p = program(b, h, pblk)
    if loads is None:
      loads = _fold_loads(p, h, fold_refs, fold_dot=fold_dot,
                          block_p=block_p)
    st, x_cur = _fold_from(p, h, loads, fold_refs, unroll=unroll,
                           fold_dot=fold_dot)
    _store_flush(p, h, st, x_cur, stores, y_out, c_ref, d_ref, z_ref)

  def load(b, h, pblk, valid):
    p = program(b, h, pblk)
    return _fold_loads(p, h, fold_refs, fold_dot=fold_dot, block_p=block_p,
                       valid=valid)

  persistent_items(pid, counts == L - 1, item, num_programs=num_programs,
                   nheads=nheads, nblk=headdim // block_p,
                   load=load if prefetch else None, nrows=ck_ref.shape[0])


def persistent_items(pid, active, item, *, num_programs, nheads, nblk,
                     load=None, nrows=None):
  """Runs program `pid`'s share of the (active row, head, headdim block)
  work items of a persistent grid of num_programs programs: items w = pid,
  pid + num_programs, ...; item w belongs to the r-th active row, r = w //
  (nheads * nblk), whose index is the number of rows whose inclusive active
  count is <= r. Calls item(b, h, pblk) for each.

  With load (prefetch): item(b, h, pblk, loads) gets the result of
  load(b, h, pblk, valid), issued one item ahead, so the next item's
  global reads are in flight while this one computes (the program's first
  load precedes its loop; the load after its last item is masked off by
  valid, with the row index clamped below nrows).

  active: [batch] bool (padded rows False)."""
  flags = active.astype(jnp.int32)
  ranks = jnp.cumsum(flags)  # inclusive
  per_row = nheads * nblk
  total = jnp.sum(flags) * per_row  # (no ranks[-1]: Triton cannot slice)
  mine = jnp.maximum(total - pid + num_programs - 1, 0) // num_programs

  def ids(i):
    w = pid + i * num_programs
    r, rem = w // per_row, w % per_row
    # (Skipping this search by a lax.cond when every row is active made the
    # all-rows f32 flush 3-4% slower on the H200: flush_sweep_h200 run 19.)
    b = jnp.sum((ranks <= r).astype(jnp.int32))
    if nrows is not None:  # a prefetch past the last item: stay in bounds
      b = jnp.minimum(b, nrows - 1)
    return b, rem // nblk, rem % nblk

  if load is None:
    def body(i, carry):
      item(*ids(i))
      return carry

    lax.fori_loop(0, mine, body, 0)
    return

  def body_prefetch(i, cur):
    nxt = load(*ids(i + 1), i + 1 < mine)
    item(*ids(i), cur)
    return nxt

  lax.fori_loop(0, mine, body_prefetch, load(*ids(0), mine > 0))


def _fused_kernel(*refs, has_D, has_z, has_bias, num_programs,
                  out_programs, ngroups, unroll, fold_dot, nheads,
                  flush_block_p, prefetch=False, readout_chunk=None,
                  unmasked=False, eager=False, **kw):
  """Both routes in one launch (`ReplayConfig(fused_launch=True)`).

  Programs [0, num_programs) run the persistent flush route (first, so
  they start at once and their latency-bound folds overlap the output
  route's streaming); program num_programs + q runs item q of the output
  route's grid, flattened (headdim/head block, group, row). Inputs: those
  of the output kernel, then the [batch] counters padded to a power of two
  (the flush ranking's copy); outputs: y, buffers, counters, checkpoint
  (aliased to the input checkpoint: only flush rows' tiles are stored).
  """
  ins, opt, outs = _unpack(refs, 11, 6, has_D, has_z, has_bias)
  y_ref, ck_out = outs[0], outs[5]
  pid = pl.program_id(0)

  @pl.when(pid < num_programs)
  def _flush():
    flush_ins = list(ins[:10])
    flush_ins[4] = ins[10]  # the padded counters
    _flush_items(pid, flush_ins, opt, y_ref, _FlushStores([ck_out], [], None),
                 unroll=unroll, fold_dot=fold_dot, num_programs=num_programs,
                 nheads=nheads, heads_per_group=kw["heads_per_group"],
                 block_p=flush_block_p, headdim=kw["headdim"],
                 buffer_len=kw["buffer_len"],
                 dt_softplus=kw["dt_softplus"], prefetch=prefetch)

  @pl.when(pid >= num_programs)
  def _output():
    q = pid - num_programs
    p = _Program.from_ids(ins[4], ins[6], ins[7], opt[2],
                          pid=q % out_programs,
                          g=(q // out_programs) % ngroups,
                          b=q // (out_programs * ngroups), **kw)
    _output_route(p, ins[:10], opt, outs[:5], all_rows=False,
                  precomputed_bc=False, scaled=False, block_p=kw["block_p"],
                  heads_per_program=kw["heads_per_program"],
                  readout_chunk=readout_chunk, unmasked=unmasked, eager=eager)


def _fused_rows_kernel(*refs, has_D, has_z, has_bias, unroll, fold_dot,
                       readout_chunk=None, unmasked=False, eager=False,
                       **kw):
  """Both routes in one launch on the output route's grid
  (`ReplayConfig(fused_launch=True, flush_grid="rows")`): each program takes
  its row's route. A flush row's program folds its heads' tiles and stores
  them with y (as `_flush_kernel`), any other row's program reads out and
  appends (`_output_route`). So a step launches one program per output item
  and no flush programs (the persistent fused kernel adds `num_programs`,
  which exit at once on a non-flush step), at the register budget of the
  larger route. Inputs and outputs: those of `_fused_kernel` without the
  padded counters."""
  ins, opt, outs = _unpack(refs, 10, 6, has_D, has_z, has_bias)
  p = _fold_flush_row(ins, opt, outs[0], _FlushStores([outs[5]], [], None),
                      unroll=unroll, fold_dot=fold_dot, **kw)
  _output_route(p, ins, opt, outs[:5], all_rows=False,
                precomputed_bc=False, scaled=False, block_p=kw["block_p"],
                heads_per_program=kw["heads_per_program"],
                readout_chunk=readout_chunk, unmasked=unmasked, eager=eager)


def _readout_kernel(ck_ref, cnt_ref, c_ref, *rest, scaled, skip, block_p,
                    heads_per_group, headdim, buffer_len):
  """y0 = S C (times the 8-bit copy's row scales) of one [block_p, N]
  tile, f32, on the output route's grid (heads_per_program 1); skip: rows
  that do not take the output route (flushing or out-of-range counters)
  read nothing and leave y0 unset."""
  scale_ref = rest[0] if scaled else None
  y0_out = rest[scaled]
  pid, g, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  nblk = headdim // block_p
  h = g * heads_per_group + pid // nblk
  ps = pl.ds((pid % nblk) * block_p, block_p)

  def readout():
    tile = common.load_tile_blocks(ck_ref, (b, h, ps), None)
    (y0,) = common.readouts(tile, [lambda cols: c_ref[b, g, cols]])
    if scale_ref is not None:  # the scales factor out of the dstate sum
      y0 = y0 * scale_ref[b, h, ps]
    y0_out[b, h, ps] = y0

  if skip:
    c = cnt_ref[b]
    pl.when((c >= 0) & (c < buffer_len - 1))(readout)
  else:
    readout()


def _window_kernel(cnt_ref, xb_ref, bb_ref, dtb_ref, x_ref, dt_ref, a_ref,
                   b_ref, c_ref, y0_ref, *rest, has_D, has_z, has_bias,
                   dt_softplus, buffer_len, heads, per_group):
  """The output route's terms but the state readout, for `heads` heads of
  one group of one row (grid (ngroups, per_group // heads, batch)): the
  group's B.C products and the heads' window weights (as
  `_weights_kernel`), then y = decay y0 + sum_j k_j x_j (+ D x, * silu(z))
  for all the heads at once ([L, heads, headdim] x window), the appends of
  (x, dt' and, in the group's first program, B) at slot c and, in the
  row's first program, its new counter. Rows that flush are left to the
  flush route (y unset, no append)."""
  _, (d_ref, z_ref, bias_ref), outs = _unpack(rest, 0, 5, has_D, has_z,
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
        j, c, cv, _window_load(bb_ref.at[b, :, g, :], hist,
                               (L, cv.shape[0])), b_in,
        _window_load(dtb_ref.at[b, :, hs], hist, (L, heads)), dt_in, bias,
        a, dt_softplus)
    x_cur = x_in.astype(F32)
    x_hist = _window_load(xb_ref.at[b, :, hs, :], hist, (L,) + x_in.shape)
    # The current token's term on its own (its slot of x_hist is zero): k
    # at slot c is d' (B.C), its suffix sum being 0.
    y = (decay[:, None] * y0 + (d_cur * bc_cur)[:, None] * x_cur
         + jnp.sum(k[:, :, None] * x_hist, axis=0))
    y = common.finish_output(y, x_cur, d_vec, z)
    y_out[b, hs, :] = jnp.where(valid, y, jnp.nan).astype(y_out.dtype)

    @pl.when(appends)
    def _append():
      xb_out[b, c, hs, :] = x_in.astype(xb_out.dtype)
      dtb_out[b, c, hs] = d_cur

    @pl.when(appends & (q == 0))
    def _append_b():
      bb_out[b, c, g, :] = b_in.astype(bb_out.dtype)


# The split output route's launches (`ReplayConfig(output_route="split")`).
# window heads: heads per window program (None: the group's).
READOUT_LAUNCH = dict(num_warps=2, skip=True)
WINDOW_LAUNCH = dict(num_warps=4, heads=None)


def _split_output_route(rstate, read, x, dt, A, B, C, D, z, dt_bias,
                        dt_softplus, block_p, interpret):
  """The output route with output_route="split": the state read out by its
  own kernel (`_readout_kernel`: y0 = S C of the checkpoint or read copy,
  f32, [batch, nheads, headdim]), then every other term of y, the appends
  and the counters by a (group, row) kernel (`_window_kernel`). Returns (y,
  x_buf, b_buf, dt_buf, count); the flush route then writes the flush
  rows' y."""
  batch, nheads, headdim, _ = read.shape
  L, ngroups = rstate.buffer_len, rstate.ngroups
  per_group = nheads // ngroups
  why = _weights_kernel_problem(rstate)
  if why:
    raise NotImplementedError(f"output_route='split' needs {why}.")
  sds = jax.ShapeDtypeStruct
  scaled = rstate.read_scale is not None
  y0 = pl.pallas_call(
      functools.partial(_readout_kernel, scaled=scaled,
                        skip=READOUT_LAUNCH["skip"], block_p=block_p,
                        heads_per_group=per_group, headdim=headdim,
                        buffer_len=L),
      grid=((headdim // block_p) * per_group, ngroups, batch),
      out_shape=sds((batch, nheads, headdim), F32),
      compiler_params=plgpu.CompilerParams(
          num_warps=READOUT_LAUNCH["num_warps"]),
      interpret=interpret, name="replayssm_replay_readout",
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


def _mosaic_output_route(rstate, read, x, dt, A, B, C, D, z, dt_bias,
                         dt_softplus, interpret):
  """The output route with output_route="mosaic_gpu": y of every row from
  the Mosaic GPU readout of `read` (checkpoint or read copy) and XLA's
  window terms; non-flush rows append (x, B, dt') to the buffers and
  advance their counters. Returns (y, x_buf, b_buf, dt_buf, count); the
  flush route then overwrites the flush rows' y.

  XLA reads all L buffer slots (the Triton route loads only the filled
  ones: ~L/2 on average), and the flush rows' state tiles are read here as
  well as by the flush route."""
  L = rstate.buffer_len
  c = rstate.count.astype(jnp.int32)
  valid = (c >= 0) & (c < L)
  flush = c == L - 1
  appends = valid & jnp.logical_not(flush)
  d_cur = process_dt(dt, dt_bias, dt_softplus)  # [b, h]
  xw, bw, dw = reference.replay_window(rstate, x, B, d_cur)
  decay, weights = reference.window_weights(dw, A)
  y0 = mosaic_gpu.readout(read, C, interpret=interpret)
  if rstate.read_scale is not None:  # the 8-bit scales factor out of S C
    y0 = y0 * rstate.read_scale
  y = decay[..., None] * y0 + reference.window_output(xw, bw, weights, C)
  y = common.finish_output(y, x.astype(F32),
                           None if D is None else D[:, None], z)
  y = jnp.where(valid[:, None, None], y, jnp.nan).astype(x.dtype)

  slot = jnp.clip(c, 0, L - 1)
  append = functools.partial(reference.write_slot, idx=slot, where=appends)
  count = jnp.where(valid, jnp.where(flush, 0, c + 1), c)
  return (y, append(rstate.x_buf, x), append(rstate.b_buf, B),
          append(rstate.dt_buf, d_cur), count.astype(rstate.count.dtype))


def _copy_counts(spec):
  """(extra inputs, extra outputs) of the flush kernels for a _CopySpec."""
  return (0, 0) if spec is None else (spec.n_in, spec.n_out)


def _fold_dot(mode, buffer_len: int, block_p: int, interpret: bool, *,
              field: str, tile: str, b_dtypes, ck_dtype,
              fused: bool = False):
  """The dot form of a fold mode (None: rank-1 updates; a lax precision;
  or "bf16x2" / "bf16x3", see `fold_product`).

  mode None: where buffer_len and block_p >= 16 (Triton dot tiles), the
  bf16 split if every folded B (b_dtypes: the buffer's, the current
  token's) is bf16: "dot_bf16x2" for a 16-bit checkpoint (ck_dtype: the
  stored fold, which rounds to 11 / 8 mantissa bits, far above the two
  pieces' ~2^-15), "dot_bf16x3" for an f32 one unless the flush is
  `fused` with the output route ("dot_tf32x3" there); else "dot_tf32x3";
  below the tiles "rank1". A dot mode below the tiles is refused, naming
  `field` and `tile`, and a bf16 mode unless every folded B is bf16.

  H200: the bf16x3 fold took the all-rows flush step from 657 to 489 µs
  (f16 checkpoint) and 1011 to 754 µs (f32), batch 256, L 16 (session
  13, flush_sweep_h200.json run 9); two pieces took f16's a further 3-4%
  (run 13). The fused launch (batch 1), whose two routes share one
  register budget: with bf16x3 its f16 non-flush step was slower in both
  side-by-side runs of session 13 (kernel_batch1_h200.md: 3.16 vs 2.89
  µs, 3.61 vs 1.46, timings since found unsound at batch 1); with bf16x2
  (session 17, kernel_batch1_h200_session17.md) its f16 flush took 5.5
  against 3xTF32's 7.5 µs at the same non-flush step; on an f32
  checkpoint the non-flush step was 5% slower with it (4.37 vs 4.15 µs),
  so f32 keeps 3xTF32 there.

  XLA:CPU has no TF32 algorithms, so interpret mode runs "dot_tf32x3" in
  exact f32 (the kernel code is otherwise the same).
  """
  fits = min(buffer_len, block_p) >= 16
  bf16_b = all(jnp.dtype(d) == jnp.bfloat16 for d in b_dtypes)
  if mode is None:
    pieces = 2 if jnp.dtype(ck_dtype).itemsize <= 2 else 3
    mode = ("rank1" if not fits else
            f"dot_bf16x{pieces}" if bf16_b and not (fused and pieces == 3)
            else "dot_tf32x3")
  if mode == "rank1":
    return None
  if not fits:
    raise NotImplementedError(
        f"{field}={mode!r} needs buffer_len and {tile} >= 16 (Triton dot "
        f"tiles), got {buffer_len} and {block_p}.")
  if mode.startswith("dot_bf16"):
    if not bf16_b:
      raise NotImplementedError(
          f"{field}={mode!r} needs bf16 B (exact in its bf16 dots), got B "
          f"dtype(s) {sorted({str(jnp.dtype(d)) for d in b_dtypes})}; use "
          "'dot_tf32x3'.")
    return mode.removeprefix("dot_")
  return _dot_precision(mode, interpret)


def _dot_precision(mode: str, interpret: bool):
  """lax precision of "dot_f32" / "dot_tf32x3" (XLA:CPU has no TF32
  algorithms: exact f32 in interpret mode)."""
  if interpret or mode == "dot_f32":
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _default_flush_programs(interpret: bool) -> int:
  """4 programs per SM (one wave at the fold's register footprint)."""
  if interpret:
    return 8
  return 4 * getattr(jax.devices()[0], "core_count", 132)


def _pad_pow2(count):
  """[batch] counters padded with -1 (no route) to a power of two: the
  persistent kernels load them as one Triton vector."""
  batch = count.shape[0]
  pad = (1 << (batch - 1).bit_length()) - batch
  return jnp.pad(count, (0, pad), constant_values=-1) if pad else count


def default_block_p(batch: int, nheads: int, headdim: int) -> int:
  """Tuned on the H200 (benchmarks/kernel_sweep_h200.md): whole-headdim
  tiles once the grid has ~16 programs per SM, quarter tiles below (more
  programs to hide latency at small batch)."""
  return headdim if batch * nheads >= 16 * 132 else min(16, headdim)


def default_flush_launch(spec, master_dtype, num_warps: int | None = None,
                         max_registers: int | None = None):
  """(warps, register cap or None) of the flush-route kernel of a state
  (spec: its _CopySpec, None for a plain state; master_dtype: its
  checkpoint's) for the `ReplayConfig` fields flush_num_warps /
  flush_max_registers (None: the default). Warps: 4 (2 for a
  stochastically rounded master without a read copy: the plain default
  before session 15, not measured). Cap, at 4 warps (at other warps
  none), where the persistent loop would hold more registers than 4 (or
  3) programs per SM leave (ptxas puts ~40 of them on shared-memory
  offsets hoisted out of the loop); capped, ptxas rematerializes or spills
  a little (benchmarks/scripts/triton_offline.py):

  * plain state: 128 (uncapped ~167; capped +2% instructions, no spills
    on f16, 12 B spilled on f32), 4 programs per SM;
  * f32 master + 8-bit copy: 128 (uncapped 216; 36 B spilled), 4 per SM;
  * 16-bit master + 8-bit copy: 120 (f16 + fp8 uncapped 255; 8 B spilled
    at 120 since the flush reads y out before its stores, 320 B before),
    4 per SM; a bf16 master is not measured;
  * other read copies: 168 (f32 + bf16 160 either way), 3 per SM
    (`_flush_programs`);
  * stochastic rounding: none (not measured).

  H200, batch 256, L 16 (benchmarks/flush_sweep_h200.json runs 15-16,
  kernel_policies_h200_session15.md; README "Session 15"), all-rows flush step
  against the uncapped default of the time: f16 442-444 -> 403-414 µs,
  f32 734-736 -> 712-715 (2 warps uncapped, which session 11 found
  faster than 4 uncapped); batch 64 f16 117-118 -> 103-105. f32 + fp8
  copy 1139 -> 1017 (168: 1065), f16 + fp8 674 -> 575 at 168 (128: 965,
  spilling), f32 + bf16 1097 -> 942 at 168 (128: 1001). Session 36
  (benchmarks/output_split_h200_session36_*.json, y read out before the
  stores), the f16 + fp8 flush kernel: 470 µs at 120 against 527 at
  168, 514 at 128, 488 at 112 (8 warps at 128: flush step 775 against
  532)."""
  copy = spec is not None and spec.copy
  sr = spec is not None and (spec.sr_master or spec.sr_copy)
  # Without the lowering hook (common.capped_name) no default is capped,
  # and a plain state keeps session 14's uncapped 2 warps.
  can_cap = max_registers is not None or common.register_caps_supported()
  warps = num_warps or (4 if copy or (spec is None and can_cap) else 2)
  if max_registers is None and can_cap and warps == 4 and not sr:
    size = jnp.dtype(master_dtype).itemsize
    max_registers = (128 if spec is None or (spec.scaled and size == 4)
                     else 120 if spec.scaled and size == 2 else 168)
  return warps, max_registers


def _flush_programs(interpret: bool, warps: int, max_registers):
  """Persistent flush programs: as many per SM as the register file holds
  at the cap (at most 4), 4 per SM uncapped (2 warps x 255 registers)."""
  if interpret or max_registers is None:
    return _default_flush_programs(interpret)
  per_sm = max(1, min(4, 65536 // (32 * warps * max_registers)))
  return per_sm * getattr(jax.devices()[0], "core_count", 132)


def default_num_warps(read_dtype, fused: bool = False) -> int:
  """Warps per output-route program for `ReplayConfig(num_warps=None)`:
  2 when the route reads a 16- or 8-bit tile (checkpoint or read copy),
  4 for an f32 one and for the fused launch (batch 1, whose register
  budget the flush route shares; not measured at 2). H200, batch 256, L
  16: the fp8 copies' non-flush step 133 / 131 -> 115 / 113 µs at 2 warps
  (session 11, benchmarks/kernel_output_launch_h200_session11.md); the
  f16 checkpoint's 165 -> 162 µs (session 11) and 164.6 / 164.5 (default
  and a repeat) -> 160.6 µs (session 14, kernel_output_launch_h200.md)."""
  return 4 if fused or jnp.dtype(read_dtype).itemsize == 4 else 2


def default_flush_grid(fused: bool, ck_dtype, prefetch: bool,
                       same_tiles: bool) -> str:
  """The flush grid of `ReplayConfig(flush_grid=None)`: "rows" for the one
  launch (fused) on an f32 checkpoint, where a flush row's output-route
  program folds its own tiles (needs the flush tiles to be the output
  route's, `same_tiles`, and no flush_prefetch), else "persistent".

  H200, batch 1, L 16 (session 19, benchmarks/kernel_batch1_h200_session19.md
  runs 10-11): on f32 the rows form folded in 7.57-7.65 against 9.19-9.29
  µs at the same non-flush step (4.05-4.16 against 4.09-4.18), 0.94-0.96x
  the baseline amortized against 0.91-0.92x; on f16 its non-flush step was
  slower (3.62-3.64 against 3.32-3.59 µs), 0.80-0.81x against 0.80-0.87x.
  At batch 256 (`kernel_rows_fused_h200_session19.md`) the one launch is
  slower on both (the fold's registers and 43 KB of shared memory per
  program hold the output route's occupancy down), so separate launches
  stay the default there."""
  if (fused and jnp.dtype(ck_dtype).itemsize == 4 and not prefetch
      and same_tiles):
    return "rows"
  return "persistent"


def default_fused_launch(batch: int, nheads: int) -> bool:
  """Whether `ReplayConfig(fused_launch=None)` fuses the two routes (where
  fusing applies): below ~4 (row, head) pairs per SM, where a step is
  launch- and latency-bound. H200, 128 heads, L 16 (benchmarks/README.md):
  fused wins at batch 1 (f32 5.76 -> 4.23 µs amortized) and loses from
  batch 16 (f16 25.9 -> 30.5 µs) to 256 (f16 210 -> 387 µs), where the
  shared register budget cuts the output route's occupancy; batches 2-8
  are not measured."""
  return batch * nheads < 4 * 132


# The Mosaic flush that `default_flush_route` picks (H200, f32 checkpoint,
# L 16, benchmarks/kernel_mosaic_flush_h200_run{11,12}.md): all-rows flush
# 625-637 µs against Triton's 716-723 at batch 256, amortized 302.3-306.4
# against 307.6-311.8; batch 128 146.9 against 148.7.
MOSAIC_FLUSH_DEFAULT = dict(flush_route="mosaic_gpu", flush_grid="persistent",
                            flush_store_from_input=True,
                            flush_heads_per_program=4)
# Fields that configure the Triton flush route: setting any keeps it.
_TRITON_FLUSH_FIELDS = ("fused_launch", "output_all_rows", "flush_grid",
                        "flush_programs", "flush_block_p", "flush_unroll",
                        "flush_prefetch", "flush_num_warps",
                        "flush_num_stages", "flush_max_registers",
                        "flush_fold", "flush_heads_per_program")


def default_flush_route(config, rstate, plain: bool, interpret: bool,
                        compute_capability: tuple[int, int] | None = None
                        ) -> common.ReplayConfig:
  """`config` with its flush route resolved (`ReplayConfig(flush_route=
  None)`): the persistent Mosaic GPU flush (`MOSAIC_FLUSH_DEFAULT`) for a
  plain f32 checkpoint at batch >= 128 (a multiple of 32) with a bf16 B
  buffer of a multiple of 16 tokens on a Hopper-or-later GPU, where it was
  measured faster, when no Triton flush field is set; else "triton".
  f16 checkpoints stay on Triton (batch 256, run 11: amortized 182.3 µs
  against 177.2-177.5); at batch 128 the staggered-row step is 2-3%
  slower (166.1-166.8 against 162.7 µs), the amortized one 1.2% faster.
  `compute_capability`: (major, minor) of the device (None:
  `common.compute_capability()`'s)."""
  if config.flush_route is not None:
    return config
  cc = compute_capability or common.compute_capability()
  mosaic = (not interpret and plain
            and config.output_route in (None, "triton")
            and jnp.dtype(rstate.checkpoint.dtype) == F32
            and rstate.checkpoint.shape[0] >= 128
            and rstate.x_buf.shape[1] % 16 == 0
            and rstate.b_buf.dtype == jnp.bfloat16
            and jnp.dtype(rstate.count.dtype) == jnp.int32
            and mosaic_gpu.counts_fit_tma(rstate.count)
            and mosaic_gpu.shape_problem(rstate.checkpoint) is None
            and cc is not None and cc >= (9, 0)
            and not any(getattr(config, f) for f in _TRITON_FLUSH_FIELDS))
  return dataclasses.replace(
      config, **(MOSAIC_FLUSH_DEFAULT if mosaic
                 else dict(flush_route="triton")))


# Fields that configure the Triton output route: setting any keeps the
# output-route defaults below off.
_OUTPUT_FIELDS = ("block_p", "num_warps", "heads_per_program", "precompute_bc",
                  "output_all_rows", "output_prefetch",
                  "output_unmasked_buffers", "output_eager", "readout_chunk",
                  "readout_fma", "max_registers")
# The smallest (row, head) count at which an 8-bit read copy's output route
# is split (or, on the Triton route, takes its window weights from the
# weights kernel): the measured size.
_COPY8_MIN_PAIRS = 256 * 128
_WEIGHTS_MAX_REGISTERS = 64


def _copy8_default(config, rstate) -> bool:
  """Whether an 8-bit read copy's output-route defaults may apply: such a
  copy at >= _COPY8_MIN_PAIRS (row, head) pairs with power-of-two window
  blocks, no Triton output-route field, the "reduce" readout and no
  fused_launch=True."""
  return (rstate.read_copy is not None
          and jnp.dtype(rstate.read_copy.dtype).itemsize == 1
          and rstate.count.shape[0] * rstate.nheads >= _COPY8_MIN_PAIRS
          and _weights_kernel_problem(rstate) is None
          and config.readout == "reduce"
          and config.fused_launch is not True
          and not any(getattr(config, f) for f in _OUTPUT_FIELDS))


def default_output_route(config, rstate, interpret: bool
                         ) -> common.ReplayConfig:
  """`config` with `output_route` resolved (None: the default): "split"
  (`_split_output_route`) for a state with an 8-bit read copy (fp8 /
  int8) at >= 256 x 128 (row, head) pairs whose window blocks are powers
  of two, when no Triton output-route field, output_weights, readout,
  fused_launch=True or the Mosaic flush is set; else "triton".

  H200, batch 256, L 16 (session 36, benchmarks/kernel_policies_h200_
  session36_{split,final}.md; benchmarks/README.md "Session 36"), against
  the Triton route: f16 master + fp8 copy, non-flush step 97.4 / 98.7
  against 111.3 / 111.7 µs, amortized 2.32x / 2.29x the f16 baseline
  against 2.10x / 2.09x; f32 + fp8 1.85x against 1.71x; f32 + int8 1.76x
  against 1.29x. The plain f16 checkpoint stays on the Triton route
  (160.7 against 162.6 µs non-flush, within a run's spread); other
  batches are not measured."""
  del interpret  # (the other defaults' signature)
  if config.output_route is not None:
    return config
  pick = (_copy8_default(config, rstate) and config.output_weights is None
          and config.flush_route != "mosaic_gpu")
  return dataclasses.replace(config,
                             output_route="split" if pick else "triton")


def default_output_weights(config, rstate, interpret: bool
                           ) -> common.ReplayConfig:
  """`config` with `output_weights` resolved (None: the default): "pallas"
  with the output route capped at 64 registers for a state with an 8-bit
  read copy (fp8 / int8) at >= 256 x 128 (row, head) pairs, on the Triton
  output route with no other output-route field set; else False.

  H200, f16 master + fp8 copy, batch 256, L 16 (session 35,
  benchmarks/kernel_policies_h200_session35_*.md; README "Session 35"):
  non-flush step 111.4 / 111.3 / 112.0 µs against 114.2 / 115.0 / 115.5
  in three runs (amortized 2.06x the f16 baseline against 2.02x); traced
  (benchmarks/output_split_h200_session35_*.json), the route kernel 102.1
  µs plus the weights kernel's 7.3 against the default route's 112.5-114.6
  alone. Uncapped, or with XLA
  forming the weights, it was slower than the default; on an f16 tile the
  cap spills (287 µs against 162). int8 copies and other batches are not
  measured."""
  if config.output_weights is not None:
    return config
  pick = (_copy8_default(config, rstate)
          and config.output_route in (None, "triton")
          and (interpret or common.register_caps_supported()))
  if not pick:
    return dataclasses.replace(config, output_weights=False)
  return dataclasses.replace(config, output_weights="pallas",
                             max_registers=_WEIGHTS_MAX_REGISTERS)


def _copy_spec(rstate, policy, interpret):
  """The _CopySpec of a state and policy (None: the plain state)."""
  sr = policy is not None and policy.stochastic_rounding
  if rstate.read_copy is None and not sr:
    return None
  if sr and rstate.step is None:
    raise ValueError(
        f"policy {policy.name!r} rounds stochastically, which needs "
        f"rstate.row_id and rstate.step ([batch] int32).")
  copy = rstate.read_copy is not None
  scaled = rstate.read_scale is not None
  if copy and scaled != (jnp.dtype(rstate.read_copy.dtype).name
                         in P.QUANTIZED_DTYPES):
    raise ValueError(
        f"rstate.read_scale must be given exactly with an 8-bit read copy "
        f"(float8_e4m3fn/int8), got a {rstate.read_copy.dtype} copy and "
        f"read_scale={'None' if rstate.read_scale is None else 'array'}.")
  _, nheads, headdim, dstate = rstate.checkpoint.shape
  return _CopySpec(
      copy=copy, scaled=scaled,
      sr_master=sr and jnp.dtype(rstate.checkpoint.dtype) != jnp.dtype(F32),
      sr_copy=sr and copy, nheads=nheads, headdim=headdim, dstate=dstate,
      reload=interpret and copy, rng=policy.sr_rng if sr else "threefry")


def copy_operands(spec, policy, layer, rstate, first_in: int,
                  first_out: int):
  """The extra operands of a flush kernel for a _CopySpec (none without):
  (inputs: the read copy, its scales, the SR keys; {input: output} aliases
  of the copy and scales, numbered from first_in / first_out, so only the
  flushing rows' tiles are stored and the others keep their bits; their
  output shapes)."""
  ins, aliases, shapes = [], {}, ()
  if spec is None:
    return ins, aliases, shapes
  for v in (rstate.read_copy, rstate.read_scale):
    if v is not None:
      aliases[first_in + len(ins)] = first_out + len(ins)
      shapes += (jax.ShapeDtypeStruct(v.shape, v.dtype),)
      ins.append(v)
  keys = _sr_keys(spec, policy, layer, rstate)
  if keys is not None:
    ins.append(keys)
  return ins, aliases, shapes


def _sr_keys(spec, policy, layer, rstate):
  """[batch, sites, 2] uint32 key data of the stochastic stores (master
  first, then the read copy), or None."""
  sites = ([P.SITE_MASTER] if spec.sr_master else []) + (
      [P.SITE_READ_COPY] if spec.sr_copy else [])
  if not sites:
    return None
  return jnp.stack([P.row_keys(policy.seed, layer, rstate.row_id,
                               rstate.step, site) for site in sites], axis=1)


def output_weights(rstate, x, dt, A, B, C, dt_bias=None, dt_softplus=False):
  """The output route's window terms but the x window, per row and head
  (`ReplayConfig.output_weights`): (k [b, L, h], decay [b, h], dt' [b, h]),
  f32, from the window of `reference.replay_window` (slots j < count
  buffered, slot count the current token, zero past it): k_j = s_j (B_j .
  C) with `reference.window_weights`' s, so a row's output is decay * (S C)
  + sum_j k_j x_j. The B.C products are elementwise products summed over
  dstate, which XLA emits as a reduction fusion (as
  `speculative.verify_bc`'s "reduce"); the unused x window is not formed
  under jit."""
  d_cur = process_dt(dt, dt_bias, dt_softplus)  # [b, h]
  _, bw, dw = reference.replay_window(rstate, x, B, d_cur)
  decay, s = reference.window_weights(dw, A)
  bc = jnp.sum(bw * C.astype(F32)[:, None], axis=-1)  # [b, L, g]
  k = s * reference.heads_from_groups(bc, rstate.nheads, axis=2)
  return k, decay, d_cur


def _weights_kernel_problem(rstate) -> str | None:
  """Why `output_weights_kernel` cannot take rstate (its Triton blocks are
  a window [L, ...], a group's heads and dstate: powers of two), or None."""
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
  k = dw * jnp.exp(a[None, :] * common.suffix_sums(dw, j)) * bc[:, None]
  return k, jnp.exp(a * jnp.sum(dw, axis=0)), d_cur, bc_cur


def _weights_kernel(cnt_ref, bb_ref, dtb_ref, b_ref, c_ref, dt_ref, a_ref,
                    *rest, has_bias, dt_softplus, buffer_len, per_group,
                    unmasked, skip_flush):
  """`output_weights` for one (row, group): the group's B.C products of the
  window, then its heads' weights, decay and dt' (see
  `output_weights_kernel` for unmasked / skip_flush)."""
  bias_ref = rest[0] if has_bias else None
  k_out, decay_out, dcur_out = rest[has_bias:]
  g, b = pl.program_id(0), pl.program_id(1)
  L = buffer_len
  c = cnt_ref[b].astype(jnp.int32)
  j = jnp.arange(L, dtype=jnp.int32)
  hist = j < c
  hs = pl.ds(g * per_group, per_group)

  def window(ref, shape):
    return _window_load(ref, hist, shape, unmasked)

  def weights():
    cv = c_ref[b, g, :].astype(F32)  # [N]
    k, decay, d_cur, _ = _group_weights(
        j, c, cv, window(bb_ref.at[b, :, g, :], (L, cv.shape[0])),
        b_ref[b, g, :], window(dtb_ref.at[b, :, hs], (L, per_group)),
        dt_ref[b, hs], None if bias_ref is None else bias_ref[hs],
        a_ref[hs].astype(F32), dt_softplus)
    k_out[b, :, hs] = k
    decay_out[b, hs] = decay
    dcur_out[b, hs] = d_cur

  if skip_flush:
    pl.when(c != L - 1)(weights)
  else:
    weights()


# The weights kernel's launch (`output_weights_kernel`'s keywords).
# H200, f16 + fp8, batch 256, L 16 (session 36, benchmarks/
# output_split_h200_session36_*.json): 7.3 µs a non-flush step; skipping
# flush rows took the all-rows flush step's 9.0 to 2.2 µs; unmasked loads
# 8.1 (8.5 skipping), 4 warps 11.5.
WEIGHTS_LAUNCH = dict(num_warps=2, unmasked=False, skip_flush=True)


def output_weights_kernel(rstate, x, dt, A, B, C, dt_bias=None,
                          dt_softplus=False, *, interpret=False,
                          num_warps=2, unmasked=False, skip_flush=False):
  """`output_weights` (same arguments and results; x is unused) by one
  small Pallas kernel on a (group, row) grid (`ReplayConfig.
  output_weights="pallas"`): each program reads its row's B window once
  for the group and writes its heads' k, decay and dt'. The window weights
  from `common.suffix_sums`, as the output route's.

  unmasked: load every buffer slot and zero the unfilled ones after (the
  loads do not wait on the counter); skip_flush: a flushing row's (count
  L-1) program writes nothing (its results are left undefined: only for
  an output route that does not read flush rows)."""
  del x
  why = _weights_kernel_problem(rstate)
  if why:
    raise NotImplementedError(f"output_weights='pallas' needs {why}; use "
                              "output_weights='xla'.")
  batch, L = rstate.count.shape[0], rstate.buffer_len
  nheads, ngroups = rstate.nheads, rstate.ngroups
  per_group = nheads // ngroups
  sds = jax.ShapeDtypeStruct
  return pl.pallas_call(
      functools.partial(_weights_kernel, has_bias=dt_bias is not None,
                        dt_softplus=dt_softplus, buffer_len=L,
                        per_group=per_group, unmasked=unmasked,
                        skip_flush=skip_flush),
      grid=(ngroups, batch),
      out_shape=(sds((batch, L, nheads), F32), sds((batch, nheads), F32),
                 sds((batch, nheads), F32)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps),
      interpret=interpret, name="replayssm_replay_output_weights",
  )(rstate.count, rstate.b_buf, rstate.dt_buf, B, C, dt, A,
    *([] if dt_bias is None else [dt_bias]))


@functools.partial(jax.jit, static_argnames=("dt_softplus", "policy",
                                             "config", "interpret"))
def replay_state_update(rstate, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                        dt_softplus=False, policy=None, layer=0, *,
                        config: common.ReplayConfig = common.ReplayConfig(),
                        interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config.

  A state with a read copy (`precision.PrecisionPolicy.read_dtype`): the
  output route reads the copy (and its scales) instead of the master, the
  flush route reads the master + buffer and writes the master and the
  re-stored copy (aliased: non-flush rows' copies are never written). With
  `policy.stochastic_rounding` the flush stores round stochastically with
  the reference's bits (keyed by policy.seed, layer, row_id, step and the
  element index); `step` advances like the reference's.
  """
  from replayssm_jax.state import ReplayState  # pylint: disable=g-import-not-at-top
  spec = _copy_spec(rstate, policy, interpret)
  config = default_output_route(config, rstate, interpret)
  config = default_flush_route(config, rstate, spec is None, interpret)
  config = default_output_weights(config, rstate, interpret)
  batch, nheads, headdim, _ = rstate.checkpoint.shape
  ngroups = rstate.ngroups
  per_group = nheads // ngroups
  block_p = common.resolve_block_p(
      config.block_p or default_block_p(batch, nheads, headdim), headdim)
  flush_block_p = common.resolve_block_p(config.flush_block_p or block_p,
                                         headdim)
  hb = config.heads_per_program or 1
  flush_hb = config.flush_heads_per_program or hb
  mosaic_flush = config.flush_route == "mosaic_gpu"
  for field, v in (("heads_per_program", hb),
                   ("flush_heads_per_program", flush_hb)):
    if mosaic_flush and field == "flush_heads_per_program":
      if nheads % v:
        raise NotImplementedError(
            f"flush_heads_per_program ({v}) must divide nheads ({nheads}).")
    elif per_group % v:
      raise NotImplementedError(
          f"{field} ({v}) must divide nheads // ngroups ({per_group}).")
  if spec is not None and spec.copy and config.output_all_rows:
    raise NotImplementedError(
        "config.output_all_rows=True computes the flush rows' y from the "
        "state the output route reads, which with a read copy is the copy, "
        "not the rebuilt master (the reference reads y from the fold); use "
        "output_all_rows=False with a read copy.")
  # The output route reads the read copy (never the master) when there is
  # one; otherwise the same inputs and kernel code as the plain state.
  read = rstate.checkpoint if rstate.read_copy is None else rstate.read_copy
  scaled = rstate.read_scale is not None
  if config.readout == "dot" and config.output_route == "triton":
    why = common.dot_readout_problem(read.dtype, C.dtype)
    if why is None and min(block_p, rstate.dstate) < 16:
      why = (f"block_p ({block_p}) and dstate ({rstate.dstate}) must be >= "
             f"16 (Triton's smallest dot tile)")
    if why:
      raise NotImplementedError(f"config.readout='dot': {why}.")
  state_in = [read, rstate.x_buf, rstate.b_buf, rstate.dt_buf, rstate.count]
  token_in = [x, dt, A, B, C]
  optional = [v for v in (D, z, dt_bias) if v is not None]
  kw = dict(buffer_len=rstate.buffer_len, heads_per_program=hb,
            heads_per_group=per_group, block_p=block_p, headdim=headdim,
            has_D=D is not None, has_z=z is not None,
            has_bias=dt_bias is not None, dt_softplus=dt_softplus)
  def grid(bp, heads=hb):
    return ((headdim // bp) * (per_group // heads), ngroups, batch)

  flush_warps, flush_cap = default_flush_launch(
      spec, rstate.checkpoint.dtype, config.flush_num_warps,
      config.flush_max_registers)
  flush_params = plgpu.CompilerParams(
      num_warps=flush_warps,
      num_stages=config.flush_num_stages or config.num_stages)
  sds = jax.ShapeDtypeStruct
  count_pow2 = _pad_pow2(rstate.count)
  unsupported = [name for name, bad in (
      ("a read copy or stochastic rounding (a precision policy)",
       spec is not None),
      ("output_all_rows", config.output_all_rows),
      ("precompute_bc", config.precompute_bc),
      ("output_weights", config.output_weights),
      ("readout='dot'", config.readout != "reduce"),
      ("output_prefetch", config.output_prefetch),
      (f"output_route={config.output_route!r}",
       config.output_route != "triton"),
      ("flush_route='mosaic_gpu'", config.flush_route != "triton"),
  ) if bad]
  if config.fused_launch and unsupported:
    raise NotImplementedError(
        f"config.fused_launch=True does not support "
        f"{', '.join(unsupported)}; use fused_launch=False or None.")
  fused = config.fused_launch
  if fused is None:
    fused = (not unsupported and config.flush_grid != "rows"
             and default_fused_launch(batch, nheads))
  same_tiles = (flush_block_p, flush_hb) == (block_p, hb)
  flush_grid_kind = config.flush_grid or default_flush_grid(
      fused, rstate.checkpoint.dtype, config.flush_prefetch, same_tiles)
  fused_rows = fused and flush_grid_kind == "rows"
  if fused_rows and not same_tiles:
    raise NotImplementedError(
        f"config.fused_launch=True with flush_grid='rows' folds on the "
        f"output route's programs: flush_block_p ({flush_block_p}) and "
        f"flush_heads_per_program ({flush_hb}) must equal block_p "
        f"({block_p}) and heads_per_program ({hb}); leave them None.")
  # The fused kernel launches num_warps, capped at config.max_registers.
  nprog = config.flush_programs or (
      _default_flush_programs(interpret) if fused
      else _flush_programs(interpret, flush_warps, flush_cap))
  fold_dot = None if mosaic_flush else _fold_dot(
      config.flush_fold, rstate.buffer_len, flush_block_p, interpret,
      field="flush_fold", tile="the flush block_p",
      b_dtypes=(rstate.b_buf.dtype, B.dtype),
      ck_dtype=rstate.checkpoint.dtype, fused=fused)
  params = plgpu.CompilerParams(
      num_warps=config.num_warps or default_num_warps(read.dtype, fused),
      num_stages=config.num_stages)
  if fused:
    route_kw = dict(unroll=config.flush_unroll, fold_dot=fold_dot,
                    readout_chunk=config.readout_chunk,
                    unmasked=config.output_unmasked_buffers,
                    eager=config.output_eager, **kw)
    if fused_rows:
      kernel = functools.partial(_fused_rows_kernel, **route_kw)
      fused_grid, counts_in = grid(block_p), []
    else:
      n0 = grid(block_p)[0]
      kernel = functools.partial(
          _fused_kernel, num_programs=nprog, out_programs=n0,
          ngroups=ngroups, nheads=nheads, flush_block_p=flush_block_p,
          prefetch=config.flush_prefetch, **route_kw)
      fused_grid, counts_in = (nprog + n0 * ngroups * batch,), [count_pow2]
    y, xb, bb, dtb, cnt, ck = pl.pallas_call(
        kernel, grid=fused_grid,
        out_shape=(sds((batch, nheads, headdim), x.dtype),
                   sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                   sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                   sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                   sds(rstate.count.shape, rstate.count.dtype),
                   sds(rstate.checkpoint.shape, rstate.checkpoint.dtype)),
        input_output_aliases={0: 5, 1: 1, 2: 2, 3: 3},
        compiler_params=params, interpret=interpret,
        name=common.capped_name("replayssm_replay_fused_routes"
                                + ("_rows" if fused_rows else ""),
                                config.max_registers),
    )(rstate.checkpoint, rstate.x_buf, rstate.b_buf, rstate.dt_buf,
      rstate.count, *token_in, *counts_in, *optional)
    return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                          count=cnt)
  extra = []
  if config.precompute_bc:
    # bc[b, j, g] = B_j . C for every buffer slot (stale ones are masked in
    # the kernel): reads the B buffer once per row instead of per program.
    extra = [jnp.einsum("blgn,bgn->blg", rstate.b_buf.astype(F32),
                        C.astype(F32), precision=lax.Precision.HIGHEST)]
  elif config.output_weights:
    if config.output_weights == "pallas":
      launch = dict(WEIGHTS_LAUNCH)
      # Only a route that skips flush rows may leave their weights unset.
      launch["skip_flush"] &= not (config.output_all_rows
                                   or config.output_eager)
      extra = list(output_weights_kernel(rstate, x, dt, A, B, C, dt_bias,
                                         dt_softplus, interpret=interpret,
                                         **launch))
    else:
      extra = list(output_weights(rstate, x, dt, A, B, C, dt_bias,
                                  dt_softplus))
  if scaled:
    extra.append(rstate.read_scale)
  # Both routes always launch; each program exits at once on rows that are
  # not its route's (no host-side branch; every row's route is data).
  out_kw = dict(scaled=True) if scaled else {}
  y_flush = []
  if mosaic_flush:
    # The Mosaic flush runs first: a flush row's buffer slots are the same
    # before and after the output route (it does not append), and y comes
    # back as a fresh array (flush rows written) that the output route then
    # completes in place. (Updating the output route's y in place from the
    # Mosaic kernel gave garbage inside a lax.scan on the H200, jax 0.11.2.)
    if spec is not None:
      raise NotImplementedError(
          "flush_route='mosaic_gpu' folds plain states only, not a read "
          "copy or stochastic rounding (a precision policy); use "
          "flush_route='triton'.")
    fold_pieces = _MOSAIC_FOLDS.get(config.flush_fold)
    if fold_pieces is None:
      fold_pieces = mosaic_gpu.default_fold_pieces(rstate.checkpoint.dtype,
                                                   rstate.buffer_len)
    if fold_pieces:
      # The tensor-core fold runs over all L slots of the B buffer with
      # weight 0 at slot L-1, which no row ever holds history in (count <
      # L): zero that stale slot first (0 x inf is NaN). In place, on the
      # array the output route then appends to: one [batch, ngroups,
      # dstate] write.
      state_in[2] = rstate.b_buf.at[:, -1].set(0)
    y_part, ck = mosaic_gpu.flush(
        rstate.checkpoint, rstate.x_buf, state_in[2], rstate.dt_buf,
        rstate.count, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
        interpret=interpret,
        fold_pieces=fold_pieces,
        store_from_input=config.flush_store_from_input,
        num_ctas=(config.flush_programs
                  or 2 * getattr(jax.devices()[0], "core_count", 132)
                  if config.flush_grid == "persistent" else None),
        config=mosaic_gpu.MosaicSSUConfig(
            heads_per_program=config.flush_heads_per_program,
            max_concurrent_steps=config.flush_num_stages or 2))
    y_flush = [y_part]
    out_kw["y_in"] = True
    # The output route reads the updated checkpoint (its non-flush rows are
    # the old ones): reading the old array after the in-place update would
    # make XLA copy the whole checkpoint first (1090 µs per f32 step at
    # batch 256 on the H200 instead of 280).
    state_in[0] = ck
  if config.output_route == "mosaic_gpu":
    y, xb, bb, dtb, cnt = _mosaic_output_route(
        rstate, read, x, dt, A, B, C, D, z, dt_bias, dt_softplus, interpret)
  elif config.output_route == "split":
    y, xb, bb, dtb, cnt = _split_output_route(
        rstate, read, x, dt, A, B, C, D, z, dt_bias, dt_softplus, block_p,
        interpret)
  else:
    y, xb, bb, dtb, cnt = pl.pallas_call(
        functools.partial(_output_kernel, all_rows=config.output_all_rows,
                          precomputed_bc=config.precompute_bc,
                          weights=bool(config.output_weights),
                          prefetch_heads=config.output_prefetch,
                          readout_chunk=config.readout_chunk,
                          unmasked=config.output_unmasked_buffers,
                          eager=config.output_eager,
                          readout_dot=config.readout == "dot",
                          fma_asm=config.readout_fma and not interpret,
                          **out_kw,
                          **kw),
        grid=grid(block_p),
        out_shape=(sds((batch, nheads, headdim), x.dtype),
                   sds(rstate.x_buf.shape, rstate.x_buf.dtype),
                   sds(rstate.b_buf.shape, rstate.b_buf.dtype),
                   sds(rstate.dt_buf.shape, rstate.dt_buf.dtype),
                   sds(rstate.count.shape, rstate.count.dtype)),
        input_output_aliases={
            1: 1, 2: 2, 3: 3,
            **({len(state_in) + len(token_in) + len(extra) + len(optional):
                0} if y_flush else {})},
        compiler_params=params, interpret=interpret,
        name=common.capped_name("replayssm_replay_output_route",
                                config.max_registers),
    )(*state_in, *token_in, *extra, *optional, *y_flush)
  if mosaic_flush:
    return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                          count=cnt, **_step_fields(rstate))
  # The flush route reads the buffers after the output route: flush rows do
  # not append, so their slots are unchanged, and one copy of each buffer
  # stays live.
  writes_y = not config.output_all_rows
  flush_kw = dict(kw, block_p=flush_block_p, writes_y=writes_y,
                  unroll=config.flush_unroll, fold_dot=fold_dot)
  count = rstate.count
  if flush_grid_kind == "persistent":
    kernel = functools.partial(_flush_persistent_kernel, nheads=nheads,
                               num_programs=nprog,
                               prefetch=config.flush_prefetch, **flush_kw)
    flush_grid = (nprog,)
    count = count_pow2
  else:
    kernel = functools.partial(_flush_kernel,
                               **dict(flush_kw, heads_per_program=flush_hb))
    flush_grid = grid(flush_block_p, flush_hb)
  out_shape = ((sds(y.shape, y.dtype),) if writes_y else ()) + (
      sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),)
  aliases = {10: 0, 0: 1} if writes_y else {0: 0}
  copy_in, copy_aliases, copy_shapes = copy_operands(
      spec, policy, layer, rstate, 10 + writes_y, 1 + writes_y)
  if spec is not None:
    kernel = functools.partial(kernel, copy_spec=spec)
  aliases.update(copy_aliases)
  out_shape += copy_shapes
  outs = pl.pallas_call(
      kernel, grid=flush_grid,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=flush_params, interpret=interpret,
      name=common.capped_name("replayssm_replay_flush_route", flush_cap),
  )(rstate.checkpoint, xb, bb, dtb, count, *token_in,
    *([y] if writes_y else []), *copy_in, *optional)
  if writes_y:
    y, outs = outs[0], outs[1:]
  ck, outs = outs[0], outs[1:]
  fields = {}
  if spec is not None and spec.copy:
    fields["read_copy"] = outs[0]
    if spec.scaled:
      fields["read_scale"] = outs[1]
  return y, ReplayState(checkpoint=ck, x_buf=xb, b_buf=bb, dt_buf=dtb,
                        count=cnt, **fields, **_step_fields(rstate))


# ReplayConfig.flush_fold -> mosaic_gpu.flush(fold_pieces=...).
_MOSAIC_FOLDS = {"rank1": 0, "dot_bf16x2": 2, "dot_bf16x3": 3}


def _step_fields(rstate):
  """row_id / step of the new state: as the reference, step +1 per
  in-range row (none without stochastic-rounding counters)."""
  if rstate.step is None:
    return {}
  c = rstate.count
  in_range = (c >= 0) & (c < rstate.buffer_len)
  return dict(row_id=rstate.row_id,
              step=jnp.where(in_range, rstate.step + 1,
                             rstate.step).astype(jnp.int32))
