"""Pallas (Triton backend) kernel: the GDN ReplaySSM decode step.

One launch, grid (value blocks, value heads, rows); a row's route is data
(no host branch). Row b with count c (research notes §10, the GDN form of
the replay step; `replayssm_jax.gdn.replay` has the derivation):

* output route (c < L-1): from the checkpoint tile S_0 (or the read copy)
  and the rings' live slots j < c (ring windows loaded whole, their stale
  slots selected away before any product), kv = exp(G) S_0^T k + sum_j
  w_j (k_j . k) d_j, the corrected update d = beta (v - kv) and o = exp(G)
  S_0^T q + sum_j w_j (k_j . q) d_j + (k . q) d; (d, k, g) appended at
  slot c. The checkpoint is only read:
  it is aliased input -> output and never stored on these rows.
* flush route (c == L-1): the L-1 buffered tokens and the current one are
  folded into the master tile by tensor-core products where the ring and
  the keys reach 16 (else, or with `GDNConfig.flush_fold="rank1"`, by
  exact f32 rank-1 updates), the new
  checkpoint stored (with a read copy re-stored from it and stochastic
  rounding as the reference's flush, `replay.program.FlushStores`) and o
  read from it.
* a counter outside [0, L) (only under jit): NaN output, nothing written,
  count kept.

With ring weights (`GDNConfig.ring_weights`; by default for a state
without read copy at batch x value heads >= 2048) a first launch
(`ring_weights.gdn_ring_weights`) forms each (row, value head)'s weights of
the live d_j in kv and o, exp(G) and k . q once, and the step's programs
read them instead of the key ring (which only flush rows then read, to
fold); the routes are otherwise the same.

With split routes (`GDNConfig.split_routes`) the two routes are two
launches over the grid: the output launch (programs of flush rows exit at
once) appends and counts; the flush launch (programs of the other rows
exit at once) reads the same counters and stores the flush rows' o into
the output launch's o. Only the flush launch stores whole rows, so with a
read copy the output launch reads the copy in value tiles; its programs
may step through several value heads in a loop
(`GDNConfig.heads_per_program`).

The rings are aliased input -> output (only slot c of appending rows is
stored); the counters go to a fresh output. Matches
`replayssm_jax.gdn.replay.gdn_replay_step`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.gdn import common
from pallas_kernels.gdn.config import GDNConfig, plan
from pallas_kernels.gdn.ring_weights import gdn_ring_weights
from pallas_kernels.replay import fold
from pallas_kernels.replay.program import (FlushStores, WholeTile,
                                           copy_counts, copy_operands,
                                           copy_spec, step_fields)
from replayssm_jax import slots

F32 = jnp.float32
_N_IN = 10  # checkpoint, d / k / g rings, counters, q, k, v, g, beta
_N_OUT = 6  # o, d / k / g rings, counters, checkpoint


class _Row:
  """The ring window of a program's row: counter, route masks and the
  token's log-decay."""

  def __init__(self, cnt_ref, g_ref, t, h, L):
    """t: the program's tile (`common.Tile`: token row b, state row sb)."""
    self.L = L
    self.c = cnt_ref[t.sb]
    self.valid = (self.c >= 0) & (self.c < L) & t.live
    self.flush = (self.c == L - 1) & t.live
    self.j = jnp.arange(L)
    self.hist = self.j < self.c
    self.g_cur = g_ref[t.b, h].astype(F32)

  def decays(self, g_hist):
    """(w_j = exp(G - H_j) of the live slots, zeros past; exp(G)) from the
    log-decay ring's live slots g_hist (`load_g`)."""
    # zero past the current slot
    gw = jnp.where(self.j == self.c, self.g_cur, g_hist)
    w = jnp.where(self.hist, jnp.exp(tu.suffix_sums(gw, self.j)), 0.0)
    return w, jnp.exp(jnp.sum(gw))

  def load_g(self, gb_ref, b, h):
    """The log-decay ring's live slots [L] (zeros past)."""
    return plgpu.load(gb_ref.at[b, :, h], mask=self.hist, other=0.0)

  def window(self, ref, shape):
    """The live slots of a ring window ref ([L, n]) in f32, zeros past:
    the whole window is loaded (its load waits for nothing) and the stale
    slots are selected away."""
    m = jnp.broadcast_to(self.hist[:, None], shape)
    return jnp.where(m, plgpu.load(ref).astype(F32), 0.0)


def _fold(st, row, t, db_ref, kb_ref, gb_ref):
  """st + sum_{j < L-1} w_j k_j d_j^T (newest first), the weights from a
  running suffix sum of the log-decays (no vector reduction in the loop;
  its body is one FMA per tile element)."""
  b, h, hk, vs = t.sb, t.h, t.hk, t.vs  # the rings' row

  def body(i, carry):
    st, suffix = carry
    j = row.L - 2 - i
    kj = kb_ref[b, j, hk, :].astype(F32)
    dj = db_ref[b, j, h, vs].astype(F32)
    st = st + (jnp.exp(suffix) * kj)[:, None] * dj[None, :]
    return st, suffix + gb_ref[b, j, h]

  return lax.fori_loop(0, row.L - 1, body, (st, row.g_cur))[0]


def _fold_dot_operands(row, t, kb_ref, gb_ref, key_dim):
  """The key window [L, key_dim] and log-decay ring [L] of the flush
  fold's tensor-core form, loaded on flush rows only (masked: the output
  route's rows read neither) with the stale slots read as 0."""
  live = row.flush & row.hist
  k_win = plgpu.load(kb_ref.at[t.sb, :, t.hk, :], other=0.0,
                     mask=jnp.broadcast_to(live[:, None], (row.L, key_dim)))
  return k_win, plgpu.load(gb_ref.at[t.sb, :, t.h], mask=live, other=0.0)


def _load_ring(row, t, kb_ref, gb_ref, weights, key_dim):
  """The loads behind `_ring_coefficients` and the token's normalisation:
  (ring, factors), ring the ring-weights launch's weights and scalars of
  this (row, value head) and factors its (f_q, f_k) (`common.norm_factors`),
  or without the launch (weights None) the live slots of the key and
  log-decay rings and None."""
  b, h = t.b, t.h
  if weights is not None:  # the token rows'
    w_ref, s_ref = weights
    return ((w_ref[b, h, 0, :], w_ref[b, h, 1, :], s_ref[b, h, 0],
             s_ref[b, h, 1]), (s_ref[b, h, 2], s_ref[b, h, 3]))
  return (row.window(kb_ref.at[t.sb, :, t.hk, :], (row.L, key_dim)),
          row.load_g(gb_ref, t.sb, h)), None


def _ring_coefficients(row, ring, qn, kn, weights):
  """(coefficients of the live d_j [L] in kv and in o, exp(G), k . q):
  `_load_ring`'s weights as loaded (weights given), or formed here from
  its key and log-decay windows."""
  if weights is not None:
    return ring
  k_hist, g_hist = ring
  w, decay = row.decays(g_hist)
  kk = jnp.sum(k_hist * kn[None, :], axis=1)  # [L]
  kq = jnp.sum(k_hist * qn[None, :], axis=1)
  return w * kk, w * kq, decay, jnp.sum(kn * qn)


def _replay_kernel(*refs, heads_per_key, block_v, use_l2norm, scale,
                   spec, ring_weights, route, heads_per_program=1,
                   fold_dot=None, has_rows=False):
  n_in, _ = copy_counts(spec)
  n_w = 2 if ring_weights else 0  # the ring-weights launch's outputs
  # The flush launch of split routes takes two more inputs, the output
  # launch's o and counters, aliased to its own (it stores neither).
  n_x = 2 if route == "flush" else 0
  # has_rows: a [batch] slot input last (`common.Tile`).
  n_all = _N_IN + n_in + n_w + n_x + has_rows
  ins, outs = refs[:n_all], refs[n_all:]
  rows_ref = ins[-1] if has_rows else None
  (ck_ref, db_ref, kb_ref, gb_ref, cnt_ref, q_ref, k_ref, v_ref, g_ref,
   beta_ref) = ins[:_N_IN]
  extra = ins[_N_IN:_N_IN + n_in]
  weights = ins[_N_IN + n_in:_N_IN + n_in + n_w] or None
  o_ref, db_out, kb_out, gb_out, cnt_out, ck_out = outs[:_N_OUT]
  # With heads_per_program > 1 (the output launch only) the grid's second
  # axis is blocks of value heads, stepped through in a loop.
  tile = common.Tile(heads_per_key=heads_per_key, block_v=block_v,
                     rows_ref=rows_ref)
  # b: the token row (q, k, v, g, beta, o, the ring weights, the new
  # counter); sb: the state row (checkpoint, copy, rings, old counter).
  b, sb, K, L = tile.b, tile.sb, ck_ref.shape[2], db_ref.shape[1]
  copy = spec is not None and spec.copy

  def routes(t):
    h, hk, vs = t.h, t.hk, t.vs
    row = _Row(cnt_ref, g_ref, t, h, L)
    # The state tile: the master on flush rows (and on plain states), the
    # read copy on the others; masked loads, so a row reads one of the two
    # only. An 8-bit copy's scales (one per key row) multiply the vectors
    # read out against it, tile^T (scale * x) (precision.dequantize: K
    # products where the tile would take K x block_v).
    scales = None
    if copy:
      master = plgpu.load(ck_ref.at[sb, h, :, vs], mask=jnp.broadcast_to(
          row.flush, (K, block_v)), other=0.0, eviction_policy="evict_first")
      rc_ref = extra[0]
      read = plgpu.load(rc_ref.at[sb, h, :, vs], mask=jnp.broadcast_to(
          ~row.flush, (K, block_v)), other=0.0,
                        eviction_policy="evict_first")
      if spec.scaled:
        scales = extra[1][sb, h, :]
      s0 = jnp.where(row.flush, master.astype(F32), read.astype(F32))
    else:
      s0 = plgpu.load(ck_ref.at[sb, h, :, vs],
                      eviction_policy="evict_first").astype(F32)
    qk = common.load_qk(q_ref, k_ref, b, hk)
    beta, v = beta_ref[b, h], v_ref[b, h, vs]
    ring, factors = _load_ring(row, t, kb_ref, gb_ref, weights, K)
    d_hist = row.window(db_ref.at[sb, :, h, vs], (row.L, block_v))
    if fold_dot is not None and route != "output":
      # Without the ring-weights launch the ring's live slots are loaded
      # already (a flush row's live slots are the fold's).
      k_fold, g_fold = (ring if weights is None else
                        _fold_dot_operands(row, t, kb_ref, gb_ref, K))
    # Every load above, the math below (common's docstring).
    qn, kn = common.normalise_qk(qk, use_l2norm=use_l2norm, scale=scale,
                                 factors=factors)
    coef_k, coef_q, decay, own = _ring_coefficients(row, ring, qn, kn,
                                                    weights)
    kr, qr = kn, qn  # the vectors read out against s0
    if scales is not None:
      kr = jnp.where(row.flush, kn, kn * scales)
      qr = jnp.where(row.flush, qn, qn * scales)
    hist_k = jnp.sum(coef_k[:, None] * d_hist, axis=0)  # [block_v]
    d = beta.astype(F32) * (
        v.astype(F32) - (decay * common.readout(s0, kr) + hist_k))

    def output():
      hist_q = jnp.sum(coef_q[:, None] * d_hist, axis=0)
      o = decay * common.readout(s0, qr) + hist_q + own * d
      o_ref[b, h, vs] = jnp.where(row.valid, o, jnp.nan).astype(o_ref.dtype)

    def flush():
      acc = decay * s0 + kn[:, None] * d[None, :]
      if fold_dot is None:
        st = _fold(acc, row, t, db_ref, kb_ref, gb_ref)
      else:  # the live slots' w_j k_j d_j^T as tensor-core products
        st = fold.fold_product(k_fold, row.decays(g_fold)[0],
                               d_hist.astype(db_ref.dtype), fold_dot, acc)
      o_ref[b, h, vs] = common.readout(st, qn).astype(o_ref.dtype)
      if spec is None:
        plgpu.store(ck_out.at[sb, h, :, vs], st.astype(ck_out.dtype))
      else:  # whole rows (block_v == value_dim): the Mamba-2 flush stores
        stores = FlushStores(outs[_N_OUT - 1:], extra, spec)
        stores.store(WholeTile(sb, K), h, st)

    if route == "both":
      pl.when(~row.flush)(output)
      pl.when(row.flush)(flush)
    else:
      (output if route == "output" else flush)()
    if route == "flush":
      return
    appends = row.valid & ~row.flush

    @pl.when(appends)
    def _append_d():
      db_out[sb, row.c, h, vs] = d.astype(db_out.dtype)

    @pl.when(appends & (t.vblk == 0))
    def _append_g():
      gb_out[sb, row.c, h] = row.g_cur

    @pl.when(appends & t.first_of_key)
    def _append_k():
      kb_out[sb, row.c, hk, :] = kn.astype(kb_out.dtype)

  row = _Row(cnt_ref, g_ref, tile, 0, L)  # the row's counter and routes

  heads = lambda: common.each_head(tile, heads_per_program, routes)
  if route == "both":
    heads()
  else:  # a split launch's programs of the other route's rows exit at once
    pl.when(row.flush if route == "flush" else ~row.flush)(heads)
  if route == "flush":
    return

  @pl.when((tile.h == 0) & (tile.vblk == 0))
  def _count():
    new = jnp.where(row.flush, 0, row.c + 1)
    cnt_out[b] = jnp.where(row.valid, new, row.c).astype(cnt_out.dtype)


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "scale",
                                             "policy", "config",
                                             "interpret"))
def gdn_replay_step(rstate, q, k, v, g, beta, use_qk_l2norm=True,
                    scale=None, policy=None, layer=0, *, rows=None,
                    config: GDNConfig | None = None,
                    interpret: bool = False):
  """Same signature and results as `gdn.replay.gdn_replay_step`, plus a
  tuning config. A read copy (bf16/f16, or fp8/int8 with scales) is read
  by output-route rows in place of the master; flush rows store master
  and copy (stochastically with `policy.stochastic_rounding`, with the
  reference's bits); these need block_v = value_dim (under
  config.split_routes in the flush launch only). config.ring_weights: the
  ring weights from a first launch (`ring_weights.gdn_ring_weights`), then
  the step. rows: [batch] int32 slots of the state's rows
  (`replayssm_jax.slots`, effective: -1 for a padding row), stepped in
  place; the new counters come back as the token rows' and are scattered
  into the state's."""
  spec = copy_spec(rstate, policy, interpret)
  _, hv, K, Vd = rstate.checkpoint.shape
  batch = q.shape[0]
  hk = rstate.k_buf.shape[2]
  p = plan(config, K, Vd, whole_rows=spec is not None, rows=batch * hv,
           kernel="replay", read_copy=spec is not None and spec.copy,
           num_v_heads=hv)
  sds = jax.ShapeDtypeStruct
  out_shape = (sds(v.shape, v.dtype),
               sds(rstate.d_buf.shape, rstate.d_buf.dtype),
               sds(rstate.k_buf.shape, rstate.k_buf.dtype),
               sds(rstate.g_buf.shape, rstate.g_buf.dtype),
               sds((batch,), rstate.count.dtype),
               sds(rstate.checkpoint.shape, rstate.checkpoint.dtype))
  copy_in, copy_aliases, copy_shapes = copy_operands(
      spec, policy, layer, rstate, _N_IN, _N_OUT)
  fold_dot = None
  L = rstate.d_buf.shape[1]
  mode = fold.default_fold_mode(L, K, (rstate.d_buf.dtype,),
                                rstate.checkpoint.dtype)
  if p.flush_fold == "dot" and mode == "rank1":
    raise NotImplementedError(
        f"GDNConfig.flush_fold='dot' needs buffer_len and key_dim >= 16 "
        f"(Triton dot tiles), got {L} and {K}; leave it None.")
  if p.flush_fold != "rank1" and mode != "rank1":
    fold_dot = fold.fold_dot(mode, L, K, interpret,
                             field="GDNConfig.flush_fold", tile="key_dim",
                             b_dtypes=(rstate.d_buf.dtype,),
                             ck_dtype=rstate.checkpoint.dtype)
  weights = ()
  if p.ring_weights:  # after the copy operands: their aliases keep numbers
    weights = gdn_ring_weights(rstate.k_buf, rstate.g_buf, rstate.count, q,
                               k, g, use_qk_l2norm=use_qk_l2norm,
                               scale=scale, rows=rows, interpret=interpret)

  def launch(route, state_ins, copy_ins, more_ins=(), more_aliases=None):
    bv, warps = p.launch(route)
    hpp = p.heads_per_program if route == "output" else 1
    kernel = functools.partial(
        _replay_kernel, heads_per_key=hv // hk, block_v=bv,
        use_l2norm=use_qk_l2norm, scale=scale, spec=spec,
        ring_weights=p.ring_weights, route=route, heads_per_program=hpp,
        fold_dot=fold_dot, has_rows=rows is not None)
    return pl.pallas_call(
        kernel,
        grid=(Vd // bv, hv // hpp, batch),
        out_shape=out_shape + copy_shapes,
        input_output_aliases={0: 5, 1: 1, 2: 2, 3: 3, **copy_aliases,
                              **(more_aliases or {})},
        compiler_params=plgpu.CompilerParams(num_warps=warps,
                                             num_stages=p.num_stages),
        interpret=interpret,
        name=tu.capped_name("replayssm_gdn_replay_step" if route == "both"
                            else f"replayssm_gdn_replay_{route}",
                            p.max_registers),
    )(*state_ins, rstate.count, q, k, v, g, beta, *copy_ins, *weights,
      *more_ins, *([] if rows is None else [rows]))

  state_ins = (rstate.checkpoint, rstate.d_buf, rstate.k_buf, rstate.g_buf)
  if not p.split_routes:
    outs = launch("both", state_ins, copy_in)
  else:
    # The output launch appends and counts; the flush launch reads the same
    # (old) counters, folds the flush rows into the checkpoint (and copy)
    # and stores their o into the output launch's o.
    outs = launch("output", state_ins, copy_in)
    n_copy = len(copy_shapes)
    first_more = _N_IN + len(copy_in) + len(weights)
    outs = launch(
        "flush", (outs[5], *outs[1:4]),
        [*outs[_N_OUT:], *copy_in[n_copy:]], more_ins=(outs[0], outs[4]),
        more_aliases={first_more: 0, first_more + 1: 4})
  o, db, kb, gb, cnt, ck = outs[:_N_OUT]
  if rows is not None:  # the token rows' new counters into the state's
    cnt = slots.scatter(rstate.count, cnt, rows)
  fields = {}
  if spec is not None and spec.copy:
    fields["read_copy"] = outs[_N_OUT]
    if spec.scaled:
      fields["read_scale"] = outs[_N_OUT + 1]
  return o, rstate.replace(checkpoint=ck, d_buf=db, k_buf=kb, g_buf=gb,
                           count=cnt, **fields, **step_fields(rstate, rows))
