"""The replay flush route on Mosaic GPU (`ReplayConfig(flush_route=
"mosaic_gpu")`, the default for plain f32 checkpoints at large batch on
Hopper): TMA-pipelined tiles, the checkpoint updated in place through a ref
in `pl.run_state` (the mesh discharge aliases a written input ref to its
output), y read from the new tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.ssu.mosaic import (_TMA_MAX_ELEMS, MosaicSSUConfig,
                                       _broadcast, _loader, _tile_transforms,
                                       counts_fit_tma, shape_problem)

F32 = jnp.float32


def _softplus(d):
  """softplus(d) = log1p(exp(d)) for d <= 20 (identity above), as
  `reference.process_dt`, from exp and log alone (Mosaic GPU has no log1p):
  log1p(e) = log(u) e / (u - 1) with u = 1 + e (exact to ~1 ulp; e where
  u rounds to 1)."""
  e = jnp.exp(jnp.minimum(d, 20.0))
  u = 1.0 + e
  small = u == 1.0
  lp = jnp.where(small, e, jnp.log(u) * e / jnp.where(small, 1.0, u - 1.0))
  return jnp.where(d <= 20.0, lp, d)


def _fold_pieces(a, pieces):
  """a (f32) as `pieces` bf16 arrays summing to it (~8 mantissa bits
  each: 3 pieces ~ f32, 2 ~ 16 bits)."""
  out = []
  for _ in range(pieces):
    hi = a.astype(jnp.bfloat16)
    out.append(hi)
    a = a - hi.astype(F32)
  return out


def _wgmma_fold(s, xb_ref, bb_ref, weights, pieces, interpret):
  """s + sum_t weights[t] x_t B_t^T over the buffer slots t < L-1 as one
  [P, L] x [L, N] tensor-core product (WGMMA): the weighted x^T is built
  in registers (WGMMA layout; column t from the row-layout load of x_t),
  split into bf16 pieces, against the B buffer tile in SMEM (bf16, exact).
  Slot L-1 (stale in every row's buffer) gets weight 0: it must hold a
  finite value (0 x inf is NaN), which `replay.replay_state_update`
  ensures by zeroing it before the launch."""
  load, tile = _loader(interpret), plgpu.Layout.WGMMA
  shape_a = (xb_ref.shape[1], xb_ref.shape[0])  # [P, L]
  col = jax.lax.broadcasted_iota(jnp.int32, shape_a, 1)
  if not interpret:
    col = plgpu.layout_cast(col, tile)
  a = jnp.zeros(shape_a, F32)
  for t, wt in enumerate(weights[:-1]):
    xt = load(xb_ref.at[t], tile.reduce(1)).astype(F32)
    a = jnp.where(col == t, _broadcast(xt * wt, shape_a, 0), a)
  parts = _fold_pieces(a, pieces)
  if interpret:
    b = bb_ref[...].astype(F32)
    for part in parts:
      s = s + jnp.dot(part.astype(F32), b, precision=jax.lax.Precision.HIGHEST)
    return s

  def product(acc_ref):
    for part in parts:
      plgpu.wgmma(acc_ref, part, bb_ref)

  return pl.run_state(product)(plgpu.ACC.init(s))


def _flush_tile(i, h, tiles, scalars, *, buffer_len, has_D, has_z,
                dt_softplus, fold_pieces, interpret):
  """Folds one flush row's head: the L-1 buffered tokens and the current
  one into its checkpoint tile, y read from the new tile.

  tiles: SMEM refs (checkpoint [P, N], x buffer [L, P], B buffer [L, N],
  current x [P], B [N], C [N], z [P] if has_z; outputs checkpoint [P, N],
  y [P]). scalars: the whole arrays (dt buffer [b, L, h], dt [b, h], A,
  D, dt_bias [h]; None where absent), read one element at a time.
  fold_pieces: 0 folds the buffer by exact f32 rank-1 updates, else as a
  tensor-core product with the weighted x in that many bf16 pieces
  (`_wgmma_fold`). The current token is one rank-1 update either way."""
  load, tile = _loader(interpret), plgpu.Layout.WGMMA
  row, col = tile.reduce(1), tile.reduce(0)
  ck_ref, xb_ref, bb_ref, x_ref, b_ref, c_ref, *rest = tiles
  z_ref = rest.pop(0) if has_z else None
  ck_out, y_out = rest
  dtb_ref, dt_ref, a_ref, d_ref, bias_ref = scalars
  d_cur = dt_ref[i, h].astype(F32)
  if bias_ref is not None:
    d_cur = d_cur + bias_ref[h].astype(F32)
  if dt_softplus:
    d_cur = _softplus(d_cur)
  a = a_ref[h].astype(F32)
  L = buffer_len
  dts = [dtb_ref[i, t, h] for t in range(L - 1)] + [d_cur]
  # s_t = dt_t exp(A sum_{u>t} dt_u); the tile decays by exp(A sum_t dt_t).
  weights, after = [None] * L, jnp.zeros((), F32)
  for t in reversed(range(L)):
    weights[t] = dts[t] * jnp.exp(a * after)
    after = after + dts[t]
  shape = ck_ref.shape
  s = load(ck_ref, tile).astype(F32) * jnp.exp(a * after)
  x_cur = load(x_ref, row).astype(F32)
  if fold_pieces:
    s = _wgmma_fold(s, xb_ref, bb_ref, weights, fold_pieces, interpret)
  else:
    for t in range(L - 1):
      xt = load(xb_ref.at[t], row).astype(F32)
      bt = load(bb_ref.at[t], col).astype(F32)
      s = s + (_broadcast(xt * weights[t], shape, 0)
               * _broadcast(bt, shape, 1))
  bv = _broadcast(load(b_ref, col).astype(F32), shape, 1)
  s = s + _broadcast(x_cur * weights[L - 1], shape, 0) * bv
  ck_out[...] = s.astype(ck_out.dtype)
  cv = _broadcast(load(c_ref, col).astype(F32), shape, 1)
  y = jnp.sum(s * cv, axis=1)
  if d_ref is not None:
    y = y + d_ref[h].astype(F32) * x_cur
  if has_z:
    zv = load(z_ref, row).astype(F32)
    y = y * zv / (1.0 + jnp.exp(-zv))
  y_out[...] = y.astype(y_out.dtype)


def _popcount(x):
  """Set bits of each uint32 (SWAR; Mosaic GPU has no population_count)."""
  u = lambda v: jnp.asarray(v, jnp.uint32)
  srl = jax.lax.shift_right_logical
  x = x - (srl(x, u(1)) & u(0x55555555))
  x = (x & u(0x33333333)) + (srl(x, u(2)) & u(0x33333333))
  x = (x + srl(x, u(4))) & u(0x0F0F0F0F)
  return srl(x * u(0x01010101), u(24))


def cta_tiles(cnt, c, *, L: int, nheads: int, num_ctas: int, chunk: int):
  """The tiles of CTA c of the persistent flush grid. The flush rows'
  heads form chunks of `chunk` heads (the r-th flush row's chunks are r *
  nheads / chunk ...), dealt out round-robin: CTA c folds chunks c, c +
  num_ctas, ..., so the CTAs at work at any moment read neighbouring
  tiles (a contiguous share per CTA is slower: benchmarks/VARIANTS.md).
  Returns (steps, chunk_row, head): CTA c folds `steps` tiles, its k-th at
  row chunk_row(k // chunk) and head head(k). cnt: the [batch] counters
  (an array, or an SMEM ref in the kernel), batch a multiple of 32; a flush row has count
  L-1. The flush rows are kept as a bit mask (batch / 32 words) and the
  r-th one found by popcounts, so no table is written."""
  batch = cnt.shape[0]
  u32 = lambda v: jnp.asarray(v, jnp.uint32)
  masks = []
  for w in range(batch // 32):
    masks.append(jax.lax.fori_loop(
        0, 32, lambda k, m, w=w: m | jax.lax.shift_left(
            u32(cnt[32 * w + k] == L - 1), u32(k)), u32(0), unroll=8))
  before, nflush = [], jnp.int32(0)  # flush rows in the words before w
  for m in masks:
    before.append(nflush)
    nflush = nflush + _popcount(m).astype(jnp.int32)
  per_row = nheads // chunk
  total = nflush * per_row
  mine = jnp.maximum(total - c + num_ctas - 1, 0) // num_ctas

  def chunk_row(q):
    rank = (c + q * num_ctas) // per_row
    word, m, r = 0, masks[0], rank
    for w in range(1, len(masks)):
      here = rank >= before[w]
      word = jnp.where(here, w, word)
      m = jnp.where(here, masks[w], m)
      r = jnp.where(here, rank - before[w], r)
    pos = jnp.int32(0)  # the bit of m's r-th set bit
    for width in (16, 8, 4, 2, 1):
      low = _popcount(jax.lax.shift_right_logical(m, pos.astype(jnp.uint32))
                      & u32((1 << width) - 1)).astype(jnp.int32)
      up = r >= low
      pos = jnp.where(up, pos + width, pos)
      r = jnp.where(up, r - low, r)
    return 32 * word + pos

  def head(k):
    return ((c + (k // chunk) * num_ctas) % per_row) * chunk + k % chunk

  return mine * chunk, chunk_row, head


def default_fold_pieces(checkpoint_dtype, buffer_len: int) -> int:
  """The flush fold of `flush`: a tensor-core product where the buffer is
  a whole number of 16-token WGMMA steps, with the weighted x in 3 bf16
  pieces (~f32) for an f32 checkpoint and 2 for 16-bit ones; otherwise 0
  (f32 rank-1 updates)."""
  if buffer_len % 16:
    return 0
  return 3 if jnp.dtype(checkpoint_dtype).itemsize >= 4 else 2


def flush(checkpoint, x_buf, b_buf, dt_buf, count, x, dt, A, B, C, D=None,
          z=None, dt_bias=None, dt_softplus=False, *,
          config: MosaicSSUConfig = MosaicSSUConfig(),
          fold_pieces: int | None = None, store_from_input: bool = False,
          num_ctas: int | None = None, interpret: bool = False):
  """The replay flush route on Mosaic GPU: rows with count == L-1 fold
  their L-1 buffered tokens and the current one into their checkpoint and
  read y from it (+ D x, silu(z) gate).

  Returns (y, checkpoint): y [batch, nheads, headdim] in x's dtype, a
  fresh array whose flush rows are written (other rows: unspecified; zero
  in interpret mode), and `checkpoint` with the flush rows' tiles
  replaced, updated in place (the GPU entry writes it through a ref,
  `pl.run_state`, so XLA aliases it; CTAs of other rows exit after reading
  the row's counter and store nothing). Matches the flush rows of
  `reference.replay_state_update` (the buffers are read only: a flush row
  does not append). fold_pieces: 0 folds by f32 rank-1 updates, 1-3 by
  WGMMA products of that many bf16 pieces of the weighted x with the B
  buffer (`_wgmma_fold`); None = `default_fold_pieces`.
  store_from_input (GPU entry): the new tile is written over its input
  tile in SMEM and stored from there (one TMA store per tile, awaited
  before the pipeline refills that slot) instead of through a separate
  output buffer: half the shared memory per CTA, so two CTAs fit per SM.
  num_ctas (GPU entry): None launches one CTA per (row, heads_per_program
  heads), a persistent grid of num_ctas CTAs otherwise, dealt the flush
  rows' chunks of heads_per_program heads round-robin (`cta_tiles`; needs
  batch a multiple of 32 for int32 counters: they reach SMEM by one TMA
  copy of 128-byte granules).
  """
  problem = shape_problem(checkpoint, on_gpu=not interpret)
  if problem is not None:
    raise NotImplementedError(problem)
  # (Interpret mode writes the tile through pallas_call's aliased output.)
  store_from_input = store_from_input and not interpret
  if interpret:
    num_ctas = None
  elif num_ctas is not None and (num_ctas < 1 or not counts_fit_tma(count)):
    raise NotImplementedError(
        f"The persistent Mosaic flush needs num_ctas >= 1 (got {num_ctas}) "
        f"and the counters a multiple of 128 bytes (batch "
        f"{checkpoint.shape[0]} x {count.dtype}): they reach SMEM by one "
        f"warpgroup TMA copy.")
  batch, nheads, headdim, dstate = checkpoint.shape
  L, ngroups = x_buf.shape[1], b_buf.shape[2]
  hpg = nheads // ngroups
  hpp = config.resolve_heads_per_program(nheads)
  entry = config.resolve_entry(interpret)
  sq = pl.Squeezed()
  if fold_pieces is None:
    fold_pieces = default_fold_pieces(checkpoint.dtype, L)
  if fold_pieces and (L % 16 or b_buf.dtype != jnp.bfloat16
                      or not 1 <= fold_pieces <= 3):
    raise NotImplementedError(
        f"fold_pieces = {fold_pieces} (a WGMMA fold) needs 1-3 pieces, "
        f"buffer_len a multiple of 16 (got {L}) and a bfloat16 B buffer "
        f"(got {b_buf.dtype}); use fold_pieces=0.")
  kw = dict(buffer_len=L, has_D=D is not None, has_z=z is not None,
            dt_softplus=dt_softplus, fold_pieces=fold_pieces,
            interpret=interpret)
  tile_kw = {} if interpret else dict(
      transforms=_tile_transforms(checkpoint.dtype))
  b_kw = {} if interpret or not fold_pieces else dict(
      transforms=_tile_transforms(b_buf.dtype, swizzle=32))  # K = 16

  def specs(i, head):
    """Block specs of (inputs, outputs); head(k) -> the head of step k."""
    tile = plgpu.BlockSpec((sq, sq, headdim, dstate),
                           lambda *k: (i(*k), head(*k), 0, 0), **tile_kw)
    vec = pl.BlockSpec((sq, sq, headdim), lambda *k: (i(*k), head(*k), 0))
    grp = pl.BlockSpec((sq, sq, dstate),
                       lambda *k: (i(*k), head(*k) // hpg, 0))
    ins = [tile,
           pl.BlockSpec((sq, L, sq, headdim),
                        lambda *k: (i(*k), 0, head(*k), 0)),
           plgpu.BlockSpec((sq, L, sq, dstate),
                           lambda *k: (i(*k), 0, head(*k) // hpg, 0),
                           **b_kw),
           vec, grp, grp] + ([vec] if z is not None else [])
    return ins, ([vec] if store_from_input else [tile, vec])

  tiled = [checkpoint, x_buf, b_buf, x, B, C] + ([z] if z is not None else [])
  scalars = [dt_buf, dt, A, D, dt_bias]
  present = [v for v in scalars if v is not None]

  def scalar_refs(refs):
    it = iter(refs)
    return [None if v is None else next(it) for v in scalars]

  y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if entry == "kernel":
    def pipeline(ck_ref, ins, scal, y_ref, row, head, steps):
      """Folds `steps` tiles, step k: (row(k), head(k))."""
      in_specs, out_specs = specs(row, head)

      def step(idx, *t):
        i, h = row(idx[0]), head(idx[0])
        if not store_from_input:
          return _flush_tile(i, h, t, scal, **kw)
        # The new tile overwrites its input slot and is stored from there;
        # the pipeline refills this slot right after the step, so the
        # store must have read it by then.
        _flush_tile(i, h, (*t[:-1], t[0], t[-1]), scal, **kw)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(t[0], ck_ref.at[i, h])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

      plgpu.emit_pipeline(
          step, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
          max_concurrent_steps=config.max_concurrent_steps,
      )(ck_ref, *ins, *([] if store_from_input else [ck_ref]), y_ref)

    def unpack(refs):
      n = len(tiled) - 1
      return refs[:n], scalar_refs(refs[n:n + len(present)]), refs[-1]

    if num_ctas is None:
      def body(ck_ref, cnt_ref, *refs):
        ins, scal, y_ref = unpack(refs)
        i, j = jax.lax.axis_index("row"), jax.lax.axis_index("block")

        @pl.when(cnt_ref[i] == L - 1)
        def _():
          pipeline(ck_ref, ins, scal, y_ref, lambda _: i,
                   lambda k: j * hpp + k, hpp)

      mesh = plgpu.Mesh(grid=(batch, nheads // hpp),
                        grid_names=("row", "block"),
                        kernel_name="replayssm_mosaic_replay_flush")
    else:
      # Persistent: CTA c folds every num_ctas-th chunk of heads_per_program
      # heads of the flush rows (`cta_tiles`), the counters read from SMEM.
      # TMA copies at most _TMA_MAX_ELEMS elements per dimension.
      count_parts = [pl.ds(off, min(_TMA_MAX_ELEMS, batch - off))
                     for off in range(0, batch, _TMA_MAX_ELEMS)]

      def body(ck_ref, cnt_ref, *refs):
        ins, scal, y_ref = unpack(refs)

        def scoped(cnt, bar):
          for k, part in enumerate(count_parts):
            plgpu.copy_gmem_to_smem(cnt_ref.at[part], cnt.at[part],
                                    bar.at[k])
          for k in range(len(count_parts)):
            plgpu.barrier_wait(bar.at[k])
          steps, chunk_row, head = cta_tiles(
              cnt, jax.lax.axis_index("cta"), L=L, nheads=nheads,
              num_ctas=num_ctas, chunk=hpp)

          def tabled(rows):
            # Each chunk's row found once, not in every index map.
            jax.lax.fori_loop(
                0, steps // hpp,
                lambda q, _: rows.__setitem__(q, chunk_row(q)), None)
            pipeline(ck_ref, ins, scal, y_ref, lambda k: rows[k // hpp],
                     head, steps)

          pl.when(steps > 0)(lambda: pl.run_scoped(
              tabled, plgpu.SMEM((-(-batch * nheads // hpp // num_ctas),),
                                 jnp.int32)))

        # (pl.kernel's scratch_types: "not supported by the Mosaic GPU
        # mpmd_map lowering" on the H200, jax 0.11.2.)
        pl.run_scoped(scoped, plgpu.SMEM((batch,), count.dtype),
                      plgpu.Barrier(num_arrivals=1,
                                    num_barriers=len(count_parts)))

      mesh = plgpu.Mesh(grid=(num_ctas,), grid_names=("cta",),
                        kernel_name="replayssm_mosaic_replay_flush")

    def stateful(refs):
      # The checkpoint is a ref the kernel writes (aliased in place); y is
      # the kernel's own output, stored into the second ref as a value.
      ck_ref, y_ref = refs
      y_ref[...] = pl.kernel(body, out_type=y_type, mesh=mesh,
                             compiler_params=plgpu.CompilerParams())(
          ck_ref, count, *tiled[1:], *present)

    ck, y = pl.run_state(stateful)((checkpoint, jnp.zeros(x.shape, x.dtype)))
    return y, ck

  # pl.pallas_call (interpret mode): grid (batch, nheads / hpp, hpp); the
  # aliased checkpoint blocks of other rows are copied through unchanged,
  # their y blocks zeroed.
  def kernel(cnt_ref, ck_in, *refs):
    n = len(tiled) - 1
    ins, scal = refs[:n], scalar_refs(refs[n:n + len(present)])
    ck_out, y_out = refs[n + len(present):]
    i = pl.program_id(0)
    h = pl.program_id(1) * hpp + pl.program_id(2)
    flush_row = cnt_ref[i] == L - 1

    @pl.when(flush_row)
    def _():
      _flush_tile(i, h, (ck_in, *ins, ck_out, y_out), scal, **kw)

    @pl.when(jnp.logical_not(flush_row))
    def _():
      ck_out[...] = ck_in[...]
      y_out[...] = jnp.zeros(y_out.shape, y_out.dtype)

  in_specs, out_specs = specs(lambda i, j, k: i,
                              lambda i, j, k: j * hpp + k)
  whole = lambda v: pl.BlockSpec(v.shape, lambda *_: (0,) * v.ndim)
  return pl.pallas_call(
      kernel, grid=(batch, nheads // hpp, hpp),
      in_specs=[whole(count), *in_specs, *map(whole, present)],
      out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct(checkpoint.shape, checkpoint.dtype),
                 y_type],
      input_output_aliases={1: 0},
      compiler_params=plgpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "sequential"),
          max_concurrent_steps=config.max_concurrent_steps),
      interpret=interpret, name="replayssm_mosaic_replay_flush",
  )(count, checkpoint, *tiled[1:], *present)[::-1]
