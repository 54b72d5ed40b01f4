"""Pallas (Triton backend) kernels: speculative verify on a GDNReplayState.

Matches `replayssm_jax.gdn.verify.gdn_replay_verify_reference`. Two
launches, rows routed by data, both on the grid (value blocks, value
heads, rows), after, with `GDNConfig.ring_weights`, a first launch of one
program per (key head, row) that forms the window's coefficients
(`verify_weights.gdn_verify_weights`):

* fold kernel (rows whose window does not fit behind their history,
  count + T >= L, with count > 0): folds the committed history into the
  master checkpoint tile by exact f32 rank-1 updates and stores it (with
  a read copy / stochastic rounding, the replay step's flush stores,
  `replay.program.FlushStores`); other rows' programs exit at once. The
  window's only checkpoint write; it runs before the window kernel, whose
  programs of the same row overwrite the ring slots the fold reads.
* window kernel (every row): from the (folded) checkpoint tile (the read
  copy on rows that did not fold), the d ring's live history and the
  window's coefficients (read from the first launch, or formed by the
  program itself by the same functions: `verify_weights`), the history
  terms h(k)_s, h(q)_s of the T positions; the window's corrected updates
  by forward substitution of the unit-lower-triangular (I + A) system in
  registers (T <= 8, unrolled: research notes §4.3); the outputs o_s;
  then (d_s, k_s, g_s) written into the rings behind the history (count
  unchanged; 0 on rows that folded, whose window starts at slot 0).

With a read copy or stochastic rounding the fold kernel stores whole
checkpoint rows (the copy's scales and the random bits span a row); the
window kernel, which only reads the checkpoint or copy, takes whole rows
too by default (timed) or the value tiles of `GDNConfig.block_v`
(`GDNPlan.output_block_v`, `output_num_warps`).

A counter outside [0, L) (only under jit): NaN outputs, nothing written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn import common
from pallas_kernels.gdn import verify_weights as VW
from pallas_kernels.gdn.config import GDNConfig, plan
from pallas_kernels.replay.program import (FlushStores, WholeTile,
                                           copy_counts, copy_operands,
                                           copy_spec)

F32 = jnp.float32


def _folds(c, window, L):
  """Rows whose window does not fit behind their history fold it first."""
  return (c >= 0) & (c < L) & (c + window >= L) & (c > 0)


# ------------------------------------------------------------ fold kernel
def _fold_kernel(*refs, window, heads_per_key, block_v, spec):
  """Refs: checkpoint, d / k / g rings, counters, the copy spec's extra
  inputs; outputs: checkpoint (and read copy, scales)."""
  n_in, _ = copy_counts(spec)
  ck_ref, db_ref, kb_ref, gb_ref, cnt_ref = refs[:5]
  extra = refs[5:5 + n_in]
  outs = refs[5 + n_in:]
  t = common.Tile(heads_per_key=heads_per_key, block_v=block_v)
  b, h, hk, vs = t.b, t.h, t.hk, t.vs
  L = db_ref.shape[1]
  c = cnt_ref[b]

  @pl.when(_folds(c, window, L))
  def _fold():
    st = plgpu.load(ck_ref.at[b, h, :, vs],
                    eviction_policy="evict_first").astype(F32)

    def body(i, carry):  # slots newest first; j >= c hold no history
      st, suffix = carry
      j = L - 1 - i
      live = j < c
      kj = plgpu.load(kb_ref.at[b, j, hk, :], other=0.0,
                      mask=jnp.broadcast_to(live, (st.shape[0],)))
      dj = plgpu.load(db_ref.at[b, j, h, vs], other=0.0,
                      mask=jnp.broadcast_to(live, (block_v,)))
      gj = jnp.where(live, gb_ref[b, j, h], 0.0)
      w = jnp.exp(suffix)
      st = st + (w * kj.astype(F32))[:, None] * dj.astype(F32)[None, :]
      return st, suffix + gj

    # decay exp(sum of the history's g) applied by the running suffix: the
    # tile is scaled once at the end (the suffix then is that sum).
    acc, total = lax.fori_loop(0, L, body, (jnp.zeros_like(st),
                                            jnp.float32(0.0)))
    st = jnp.exp(total) * st + acc
    if spec is None:
      plgpu.store(outs[0].at[b, h, :, vs], st.astype(outs[0].dtype))
    else:
      FlushStores(outs, extra, spec).store(WholeTile(b, st.shape[0]), h, st)


# ---------------------------------------------------------- window kernel
def _window_kernel(*refs, window, heads_per_key, block_v, use_l2norm,
                   scale, copy, scaled, weights):
  """Refs: checkpoint (folded), d / k / g rings, counters, q, k, v, g,
  beta ([batch, T, ...]), with `copy` the read copy (and with `scaled` its
  scales), with `weights` the weights launch's two outputs; outputs: o,
  d / k / g rings, counters."""
  n_in = 10 + copy + scaled + 2 * weights
  (ck_ref, db_ref, kb_ref, gb_ref, cnt_ref, q_ref, k_ref, v_ref, g_ref,
   beta_ref) = refs[:10]
  o_ref, db_out, kb_out, gb_out, cnt_out = refs[n_in:]
  t = common.Tile(heads_per_key=heads_per_key, block_v=block_v)
  b, h, hk, vs = t.b, t.h, t.hk, t.vs
  L, K = db_ref.shape[1], ck_ref.shape[2]
  T = window
  c = cnt_ref[b]
  valid = (c >= 0) & (c < L)
  folds = _folds(c, T, L)
  base = VW.history_base(c, T, L)  # committed tokens left in the rings
  # Every load first (common's docstring), then the math.
  if copy:
    master = plgpu.load(ck_ref.at[b, h, :, vs], mask=jnp.broadcast_to(
        folds, (K, block_v)), other=0.0, eviction_policy="evict_first")
    read = plgpu.load(refs[10].at[b, h, :, vs], mask=jnp.broadcast_to(
        ~folds, (K, block_v)), other=0.0, eviction_policy="evict_first")
    if scaled:
      scales = refs[11][b, h, :]
  else:
    s0 = plgpu.load(ck_ref.at[b, h, :, vs], eviction_policy="evict_first")
  hist = jnp.arange(L) < base
  d_hist = plgpu.load(db_ref.at[b, :, h, vs], other=0.0,
                      mask=jnp.broadcast_to(hist[:, None], (L, block_v)))
  q_win = [q_ref[b, s, hk, :] for s in range(T)]
  k_win = [k_ref[b, s, hk, :] for s in range(T)]
  v_win = [v_ref[b, s, h, vs] for s in range(T)]
  g_win = [g_ref[b, s, h] for s in range(T)]
  beta = [beta_ref[b, s, h] for s in range(T)]
  if weights:
    coefficients = VW.load_weights(*refs[n_in - 2:n_in], b, h, T)
  else:
    k_hist, (g_hist,) = VW.load_history(kb_ref, gb_ref, b, hk, [h], hist)
    coefficients = VW.head_terms(
        VW.key_terms(q_win, k_win, k_hist, kb_ref.dtype,
                     use_l2norm=use_l2norm, scale=scale),
        g_hist, hist, g_win, beta)
  if copy:
    read = read.astype(F32)
    if scaled:
      read = read * scales[:, None]  # precision.dequantize
    s0 = jnp.where(folds, master.astype(F32), read)
  s0 = s0.astype(F32)
  d_hist = d_hist.astype(F32)
  bdt = db_ref.dtype
  d_prev = []
  slot0 = jnp.clip(base, 0, L - T)
  for s, (decay, fq, fk, own, a, cq, wk, wq) in enumerate(coefficients):
    qn = q_win[s].astype(F32) * fq
    kn = k_win[s].astype(F32) * fk
    hist_k = jnp.sum(wk[:, None] * d_hist, axis=0)  # [block_v]
    d = beta[s].astype(F32) * (v_win[s].astype(F32)
                               - (decay * common.readout(s0, kn) + hist_k))
    o = decay * common.readout(s0, qn) + jnp.sum(wq[:, None] * d_hist,
                                                 axis=0)
    # Forward substitution of (I + A) D = R: the earlier window tokens
    # (i < s only) as the rings hold them.
    for ai, ci, di in zip(a, cq, d_prev):
      d = d - ai * di
      o = o + ci * di
    o = o + own * d
    o_ref[b, s, h, vs] = jnp.where(valid, o, jnp.nan).astype(o_ref.dtype)
    d_prev.append(d.astype(bdt).astype(F32))
    slot = slot0 + s

    @pl.when(valid)
    def _append_d():
      db_out[b, slot, h, vs] = d.astype(db_out.dtype)

    @pl.when(valid & (t.vblk == 0))
    def _append_g():
      gb_out[b, slot, h] = g_win[s].astype(gb_out.dtype)

    @pl.when(valid & t.first_of_key)
    def _append_k():
      kb_out[b, slot, hk, :] = kn.astype(kb_out.dtype)

  @pl.when((h == 0) & (t.vblk == 0))
  def _count():
    cnt_out[b] = jnp.where(valid, base, c).astype(cnt_out.dtype)


@functools.partial(jax.jit, static_argnames=("use_qk_l2norm", "scale",
                                             "policy", "config",
                                             "interpret"))
def gdn_replay_verify(rstate, q, k, v, g, beta, use_qk_l2norm=True,
                      scale=None, policy=None, layer=0, *,
                      config: GDNConfig | None = None,
                      interpret: bool = False):
  """Same signature and results as
  `gdn.verify.gdn_replay_verify_reference`, plus a tuning config (the
  window: [batch, T, ...] inputs, T <= 8 and < buffer_len)."""
  spec = copy_spec(rstate, policy, interpret)
  batch, hv, K, Vd = rstate.checkpoint.shape
  T = q.shape[1]
  hk = rstate.k_buf.shape[2]
  p = plan(config, K, Vd, whole_rows=spec is not None, kernel="verify",
           state_dtype=rstate.checkpoint.dtype)
  # The window launch's tile: block_v's value tiles where a copy makes the
  # fold store whole rows (output_block_v), else the fold's.
  wbv, wwarps = p.launch("output")
  weights = ()
  if p.ring_weights:
    weights = VW.gdn_verify_weights(
        rstate.k_buf, rstate.g_buf, rstate.count, q, k, g, beta,
        use_qk_l2norm=use_qk_l2norm, scale=scale, interpret=interpret)
  sds = jax.ShapeDtypeStruct
  grid = (Vd // p.block_v, hv, batch)
  params = plgpu.CompilerParams(num_warps=p.num_warps,
                                num_stages=p.num_stages)
  kw = dict(window=T, heads_per_key=hv // hk, block_v=p.block_v)
  copy_in, copy_aliases, copy_shapes = copy_operands(
      spec, policy, layer, rstate, 5, 1)
  folded = pl.pallas_call(
      functools.partial(_fold_kernel, spec=spec, **kw), grid=grid,
      out_shape=(sds(rstate.checkpoint.shape, rstate.checkpoint.dtype),)
      + copy_shapes,
      input_output_aliases={0: 0, **copy_aliases},
      compiler_params=params, interpret=interpret,
      name="replayssm_gdn_verify_fold",
  )(rstate.checkpoint, rstate.d_buf, rstate.k_buf, rstate.g_buf,
    rstate.count, *copy_in)
  ck, fields = folded[0], {}
  if spec is not None and spec.copy:
    fields["read_copy"] = folded[1]
    if spec.scaled:
      fields["read_scale"] = folded[2]
  read = [fields[n] for n in ("read_copy", "read_scale") if n in fields]
  o, db, kb, gb, cnt = pl.pallas_call(
      functools.partial(_window_kernel, use_l2norm=use_qk_l2norm,
                        scale=scale, copy="read_copy" in fields,
                        scaled="read_scale" in fields,
                        weights=p.ring_weights, **dict(kw, block_v=wbv)),
      grid=(Vd // wbv, hv, batch),
      out_shape=(sds((batch, T, hv, Vd), v.dtype),
                 sds(rstate.d_buf.shape, rstate.d_buf.dtype),
                 sds(rstate.k_buf.shape, rstate.k_buf.dtype),
                 sds(rstate.g_buf.shape, rstate.g_buf.dtype),
                 sds(rstate.count.shape, rstate.count.dtype)),
      input_output_aliases={1: 1, 2: 2, 3: 3},
      compiler_params=plgpu.CompilerParams(num_warps=wwarps,
                                           num_stages=p.num_stages),
      interpret=interpret, name="replayssm_gdn_verify_window",
  )(ck, rstate.d_buf, rstate.k_buf, rstate.g_buf, rstate.count, q, k, v, g,
    beta, *read, *weights)
  return o, rstate.replace(checkpoint=ck, d_buf=db, k_buf=kb, g_buf=gb,
                           count=cnt, pending_window=T, **fields)
