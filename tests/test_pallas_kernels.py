"""Pallas kernels (run in interpret mode on CPU) against the reference.

* Multi-step decodes of the shared case list (`cases.REPLAY_CASES`, those
  whose shapes the Triton kernels take: power-of-two headdim, dstate, L) with
  implementation="pallas" vs the baseline, the same checks as
  tests/test_replay.py: outputs, materialized state, and the checkpoint
  written exactly on flush steps.
* Single steps of both kernels vs the reference for every tuning variant,
  with a batch mixing flush and non-flush rows: the checkpoint of a non-flush
  row and the stale buffer slots stay bit-identical, fresh outputs start as
  NaN in interpret mode (pallas' uninitialized value), so an element the
  kernel forgets to write fails the comparison.
* The dispatcher: None picks the reference off-GPU, a named implementation
  never falls back, a kernel that cannot take the shapes says why.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import ops as rs_ops
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import cases as C
from tests import harness


def _pow2(v):
  return v & (v - 1) == 0


def _kernel_case(case) -> bool:
  d = case.dims
  return all(_pow2(v) for v in (d.headdim, d.dstate, case.buffer_len))


KERNEL_CASES = [c for c in C.REPLAY_CASES if _kernel_case(c)]


def test_kernel_case_list_covers_the_issue():
  lens = {c.buffer_len for c in KERNEL_CASES}
  assert {1, 2, 4, 8, 16, 32} <= lens
  assert {c.checkpoint_dtype for c in KERNEL_CASES} >= {
      "float32", "bfloat16", "float16"}
  assert any(not (c.with_D or c.with_z or c.with_dt_bias)
             for c in KERNEL_CASES)
  assert all(c.dims.ngroups < c.dims.nheads for c in KERNEL_CASES)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=C.case_id)
def test_pallas_decode_matches_baseline(case):
  inputs, final, out = harness.run_decode(case, implementation="pallas")
  _, ref_final, ref = harness.run_decode(case, implementation="reference",
                                         inputs=inputs)
  tol = testing.tolerance(*case.dtypes)
  for t in range(case.nsteps):
    testing.assert_close(out["y_replay"][t], out["y_base"][t], tol,
                         f"{case.id} y at step {t}")
  testing.assert_close(out["state_replay"][-1], out["state_base"][-1], tol,
                       f"{case.id} final state")
  # Same cadence as the reference: the checkpoint bits change exactly on
  # the flush steps of each row, and the counters agree.
  np.testing.assert_array_equal(out["wrote"], ref["wrote"])
  np.testing.assert_array_equal(out["count"], ref["count"])
  np.testing.assert_array_equal(final.count, ref_final.count)


# ---------------------------------------------------------------- one step

DIMS = C.Dims(batch=5, nheads=8, headdim=16, dstate=16, ngroups=2)
SSU_CONFIGS = [pk.SSUConfig(), pk.SSUConfig(block_p=4),
               pk.SSUConfig(block_p=None, num_warps=2)]
REPLAY_CONFIGS = [
    pk.ReplayConfig(),  # fused launch at this batch (default_fused_launch)
    pk.ReplayConfig(block_p=4, heads_per_program=2, fused_launch=False),
    pk.ReplayConfig(block_p=8, heads_per_program=4, precompute_bc=True),
    pk.ReplayConfig(block_p=16, output_all_rows=True),
    pk.ReplayConfig(block_p=8, heads_per_program=2, precompute_bc=True,
                    output_all_rows=True),
    pk.ReplayConfig(block_p=16, flush_block_p=4, flush_unroll=False),
    # The rows flush grid with two heads per flush program.
    pk.ReplayConfig(flush_grid="rows", flush_heads_per_program=2),
    # Fewer programs than work items: each program loops over several.
    pk.ReplayConfig(block_p=4, flush_block_p=8, flush_grid="persistent",
                    flush_programs=3, fused_launch=False),
    # All of a program's checkpoint tiles loaded before its math.
    pk.ReplayConfig(block_p=8, heads_per_program=2, output_prefetch=True),
    # Both routes in one launch (flush programs first, then output items).
    pk.ReplayConfig(block_p=4, heads_per_program=2, flush_programs=3,
                    fused_launch=True),
    # The output route's state read by the Mosaic GPU readout kernel.
    pk.ReplayConfig(output_route="mosaic_gpu", flush_programs=3),
    # The state tile read out in dstate column blocks (both launch forms).
    pk.ReplayConfig(block_p=8, readout_chunk=4, fused_launch=False),
    pk.ReplayConfig(readout_chunk=8, fused_launch=True),
    pk.ReplayConfig(block_p=8, heads_per_program=2, output_prefetch=True,
                    readout_chunk=4),
    # Buffer windows loaded unmasked, the junk past each counter zeroed.
    pk.ReplayConfig(block_p=8, output_unmasked_buffers=True,
                    fused_launch=False),
    pk.ReplayConfig(block_p=8, heads_per_program=2, precompute_bc=True,
                    output_unmasked_buffers=True),
    # The window weights, decay and dt' formed by XLA (output_weights).
    pk.ReplayConfig(block_p=8, heads_per_program=2, output_weights=True,
                    fused_launch=False),
    pk.ReplayConfig(block_p=16, output_weights=True, output_all_rows=True,
                    output_unmasked_buffers=True, fused_launch=False),
    # ... by the small weights kernel.
    pk.ReplayConfig(block_p=8, output_weights="pallas", fused_launch=False),
    # The state read out by its own kernel, the rest of y, the appends and
    # the counters by a (group, row) kernel.
    pk.ReplayConfig(output_route="split"),
    pk.ReplayConfig(output_route="split", block_p=8, heads_per_program=2,
                    flush_fold="rank1"),
    # Every row's output program computes (flush rows' y dropped), in one
    # launch with the flush route and in its own.
    pk.ReplayConfig(output_eager=True, output_unmasked_buffers=True,
                    flush_programs=3, fused_launch=True),
    pk.ReplayConfig(block_p=8, output_eager=True, fused_launch=False),
    # One launch on the output grid: flush rows' programs fold their tiles.
    pk.ReplayConfig(flush_grid="rows", fused_launch=True),
    pk.ReplayConfig(block_p=8, heads_per_program=2, flush_grid="rows",
                    flush_fold="rank1", fused_launch=True),
    # The flush rows folded by the Mosaic GPU kernel (mosaic_gpu.flush).
    pk.ReplayConfig(flush_route="mosaic_gpu"),
    pk.ReplayConfig(block_p=8, flush_route="mosaic_gpu",
                    flush_heads_per_program=2, flush_num_stages=3),
]


def _step_inputs(seed, dtype="float32", *, with_D=True, with_z=True,
                 with_dt_bias=True):
  d = DIMS
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, d.nheads, with_D=with_D,
                                 with_dt_bias=with_dt_bias)
  tok = testing.random_step_inputs(jax.random.fold_in(key, 1), d.batch,
                                   d.nheads, d.headdim, d.dstate, d.ngroups,
                                   jnp.dtype(dtype), with_z=with_z)
  return params, tok


# Every config, state dtype and option set appears (not the full product:
# interpret mode compiles each combination separately).
SSU_CASES = [
    (SSU_CONFIGS[0], "float32", (True, True, True)),
    (SSU_CONFIGS[0], "bfloat16", (False, False, False)),
    (SSU_CONFIGS[1], "float16", (True, True, True)),
    (SSU_CONFIGS[1], "float32", (True, False, True)),
    (SSU_CONFIGS[2], "bfloat16", (True, False, True)),
    (SSU_CONFIGS[2], "float16", (False, False, False)),
]


# Mosaic GPU baseline kernel (implementation "pallas_mosaic_gpu"): every
# state dtype, option set and tuning field, in interpret mode.
MOSAIC_CASES = [
    (pk.MosaicSSUConfig(), "float32", (True, True, True)),
    (pk.MosaicSSUConfig(heads_per_program=1), "bfloat16", (False, False,
                                                           False)),
    (pk.MosaicSSUConfig(heads_per_program=4, max_concurrent_steps=3),
     "float16", (True, True, True)),
    (pk.MosaicSSUConfig(heads_per_program=2), "float32", (True, False,
                                                          True)),
]


@pytest.mark.parametrize(
    "impl,config,state_dtype,options",
    [("pallas",) + c for c in SSU_CASES]
    + [("pallas_mosaic_gpu",) + c for c in MOSAIC_CASES], ids=str)
def test_baseline_kernel_step(impl, config, state_dtype, options):
  with_D, with_z, with_bias = options
  params, tok = _step_inputs(7, with_D=with_D, with_z=with_z,
                             with_dt_bias=with_bias)
  state = harness.random_state(jax.random.PRNGKey(3), DIMS,
                               jnp.dtype(state_dtype))
  state_before = np.asarray(state)
  kw = dict(**tok, **params, dt_softplus=with_bias)
  y_ref, s_ref = rs.selective_state_update(state, **kw,
                                           implementation="reference")
  y, s = rs.selective_state_update(state, **kw, implementation=impl,
                                   config=config)
  tol = testing.tolerance(state_dtype)
  assert y.dtype == y_ref.dtype
  testing.assert_close(y, y_ref, testing.TOLERANCES["float32"], "y")
  assert s.dtype == s_ref.dtype
  testing.assert_close(s, s_ref, tol, "state")
  np.testing.assert_array_equal(np.asarray(state), state_before)  # no mutation


def _mixed_state(ckpt_dtype, buffer_len, seed, flush_rows=(1,)):
  """A ragged state whose rows include both flush (count L-1) and
  non-flush rows."""
  d = DIMS
  counts = np.array(C.ragged_counts(d.batch, buffer_len))
  counts[list(flush_rows)] = buffer_len - 1
  params, tok = _step_inputs(seed)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(seed + 1), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.dtype(ckpt_dtype), buffer_dtype=jnp.bfloat16)
  return params, tok, rstate, counts


# Each config on two of the four (state dtype, L) pairs, in rotation: every
# pair meets half the configs (interpret mode compiles each case apart;
# the full product took ~4 min of worker time, 2 of CI's wall time).
_STEP_STATES = [("float32", 4), ("float16", 8), ("bfloat16", 2),
                ("float32", 1)]


@pytest.mark.parametrize("config,ckpt_dtype,buffer_len", [
    (c,) + _STEP_STATES[(i + k) % len(_STEP_STATES)]
    for i, c in enumerate(REPLAY_CONFIGS) for k in (0, 1)], ids=str)
def test_replay_kernel_step(config, ckpt_dtype, buffer_len):
  params, tok, rstate, counts = _mixed_state(ckpt_dtype, buffer_len, 11)
  kw = dict(**tok, **params, dt_softplus=True)
  before = jax.tree.map(np.asarray, rstate)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(rstate, **kw, implementation="pallas",
                                config=config)
  # Inputs are not mutated.
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, rstate), before)
  testing.assert_close(y, y_ref, testing.tolerance("bfloat16", ckpt_dtype),
                       "y")
  np.testing.assert_array_equal(r.count, r_ref.count)
  flush = counts == buffer_len - 1
  assert flush.any() and (buffer_len == 1 or (~flush).any())
  # Non-flush rows: checkpoint bit-identical (never written).
  same = ~np.asarray(harness.rows_changed(rstate.checkpoint, r.checkpoint))
  assert same[~flush].all(), "kernel wrote a non-flush row's checkpoint"
  # Flush rows: the new checkpoint equals the reference's.
  testing.assert_close(np.asarray(r.checkpoint, np.float32)[flush],
                       np.asarray(r_ref.checkpoint, np.float32)[flush],
                       testing.tolerance("bfloat16", ckpt_dtype),
                       "flushed checkpoint")
  # Buffers: the appended slot of non-flush rows equals the reference's;
  # every other slot is bit-identical to the input, but for the B buffer's
  # last slot, which no row holds history in (count < L) and which the
  # Mosaic tensor-core flush zeroes.
  for name in ("x_buf", "b_buf", "dt_buf"):
    new, ref, old = (np.asarray(getattr(s, name)) for s in (r, r_ref, rstate))
    for row in range(DIMS.batch):
      for slot in range(buffer_len):
        if slot == counts[row] and not flush[row]:
          np.testing.assert_array_equal(new[row, slot], ref[row, slot],
                                        err_msg=f"{name} appended slot")
        elif (name == "b_buf" and slot == buffer_len - 1
              and not np.any(new[row, slot])):
          continue
        else:
          np.testing.assert_array_equal(
              harness.bits(new[row, slot]), harness.bits(old[row, slot]),
              err_msg=f"{name}[{row}, {slot}] was written")


@pytest.mark.parametrize("fused", [False, True])
def test_replay_kernel_step_every_row_flushes(fused):
  """A step where every row flushes: the persistent flush programs share out
  every row's items (`replay.persistent_items`), here 3 programs looping
  over 80 items."""
  params, tok, rstate, counts = _mixed_state("float32", 4, 23,
                                             flush_rows=range(DIMS.batch))
  assert (counts == 3).all()
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(block_p=8, flush_programs=3,
                             fused_launch=fused))
  tol = testing.tolerance("bfloat16", "float32")
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(r.checkpoint, r_ref.checkpoint, tol, "checkpoint")
  np.testing.assert_array_equal(r.count, r_ref.count)


def test_replay_kernel_jitted_in_a_loop_compiles_once():
  params, tok, rstate, _ = _mixed_state("float32", 4, 21)
  traces = []

  @jax.jit
  def step(r):
    traces.append(1)
    return rs.replay_state_update(r, **tok, **params, dt_softplus=True,
                                  implementation="pallas")

  ys = []
  for _ in range(5):
    y, rstate = step(rstate)
    ys.append(y)
  assert len(traces) == 1
  assert all(np.isfinite(np.asarray(y)).all() for y in ys)


@pytest.mark.parametrize("route", ["mosaic_gpu", "split"])
def test_output_route_config_is_checked(route):
  with pytest.raises(ValueError, match="output_route must be one of"):
    pk.ReplayConfig(output_route="cuda")
  for clash in (dict(fused_launch=True), dict(output_all_rows=True),
                dict(precompute_bc=True), dict(output_prefetch=True),
                dict(readout_chunk=16), dict(output_weights=True)):
    with pytest.raises(ValueError, match=f"{next(iter(clash))}"):
      pk.ReplayConfig(output_route=route, **clash)
  with pytest.raises(ValueError, match="needs output_route='triton'"):
    pk.ReplayConfig(output_route=route, flush_route="mosaic_gpu")
  with pytest.raises(ValueError, match="precompute_bc"):
    pk.ReplayConfig(output_weights=True, precompute_bc=True)


def test_mosaic_kernel_refusals():
  state = jnp.zeros((2, 8, 16, 16), jnp.float32)
  assert pk.mosaic_kernel.shape_problem(state, on_gpu=False) is None
  assert "headdim = 16 is not a multiple of 64" in (
      pk.mosaic_kernel.shape_problem(state))
  narrow = jnp.zeros((2, 8, 64, 16), jnp.float16)  # 32-byte state rows
  assert "not a multiple of 128" in pk.mosaic_kernel.shape_problem(narrow)
  assert pk.mosaic_kernel.shape_problem(
      jnp.zeros((2, 8, 64, 128), jnp.float16)) is None
  with pytest.raises(ValueError, match="max_concurrent_steps must be"):
    pk.MosaicSSUConfig(max_concurrent_steps=0)
  params, tok = _step_inputs(9)
  state = harness.random_state(jax.random.PRNGKey(5), DIMS)
  with pytest.raises(NotImplementedError, match="does not divide nheads"):
    rs.selective_state_update(state, **tok, **params,
                              implementation="pallas_mosaic_gpu",
                              config=pk.MosaicSSUConfig(heads_per_program=3))
  with pytest.raises(NotImplementedError, match="runs on the GPU only"):
    rs.selective_state_update(state, **tok, **params,
                              implementation="pallas_mosaic_gpu",
                              config=pk.MosaicSSUConfig(entry="kernel"))
  with pytest.raises(ValueError, match="entry must be"):
    pk.MosaicSSUConfig(entry="triton")
  # Never picked by implementation=None: within 0-4% of the Triton kernel
  # on the H200 and without an in-place state update (mosaic_gpu.py).
  table = rs_ops._REGISTRY["selective_state_update"]  # pylint: disable=protected-access
  assert not table["pallas_mosaic_gpu"].preferred()


# ------------------------------------------------------------- dispatcher

def test_dispatcher_lists_and_picks():
  assert rs.implementations("replay_state_update")[0] == "pallas"
  assert "reference" in rs.implementations("selective_state_update")
  params, tok, rstate, _ = _mixed_state("float32", 4, 31)
  kw = dict(**tok, **params, dt_softplus=True)
  y_auto, _ = rs.replay_state_update(rstate, **kw)
  y_ref, _ = rs.replay_state_update(rstate, **kw, implementation="reference")
  # Off-GPU, None must not pick the (slow) interpret-mode kernel.
  assert not pk.on_gpu()
  np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_ref))


def test_dispatcher_errors():
  params, tok, rstate, _ = _mixed_state("float32", 4, 41)
  kw = dict(**tok, **params, dt_softplus=True)
  with pytest.raises(ValueError, match="implementation must be None or one"):
    rs.replay_state_update(rstate, **kw, implementation="triton")
  with pytest.raises(ValueError, match="config can only be given"):
    rs.replay_state_update(rstate, **kw, config=pk.ReplayConfig())
  # buffer_len 3 is not a power of two: the kernel says why, no fallback.
  params3, tok3, rstate3, _ = _mixed_state("float32", 3, 51)
  with pytest.raises(NotImplementedError, match="buffer_len = 3"):
    rs.replay_state_update(rstate3, **tok3, **params3,
                           implementation="pallas")
  odd = C.ODD_DIMS
  state = harness.random_state(jax.random.PRNGKey(0), odd)
  tok_odd = testing.random_step_inputs(jax.random.PRNGKey(1), odd.batch,
                                       odd.nheads, odd.headdim, odd.dstate,
                                       odd.ngroups)
  p_odd = testing.random_params(jax.random.PRNGKey(2), odd.nheads)
  with pytest.raises(NotImplementedError, match="headdim = 12"):
    rs.selective_state_update(state, **tok_odd, **p_odd,
                              implementation="pallas")
  with pytest.raises(ValueError, match="block_p must be a power of two"):
    pk.SSUConfig(block_p=3)
  with pytest.raises(ValueError, match="heads_per_program"):
    pk.ReplayConfig(heads_per_program=0)


def test_replay_kernel_out_of_range_count_under_jit():
  """Under jit counts cannot be checked: the kernel must neither write out of
  bounds nor resume silently. Bad rows output NaN, keep their count and
  leave their buffers and checkpoint untouched; other rows are unaffected."""
  L = 4
  # Every row's slots 0..L-2 filled, so the good rows' counts read no stale
  # (poisoned) slot.
  params, tok, rstate, _ = _mixed_state("float32", L, 61,
                                        flush_rows=range(DIMS.batch))
  bad = rstate.replace(count=jnp.asarray([-1, L, 0, 2, 3], jnp.int32))
  step = jax.jit(lambda r, impl: rs.replay_state_update(
      r, **tok, **params, dt_softplus=True, implementation=impl),
                 static_argnums=1)
  y, new = step(bad, "pallas")
  y_ref, new_ref = step(bad, "reference")
  y = np.asarray(y)
  assert np.all(np.isnan(y[:2])) and np.all(np.isfinite(y[2:]))
  testing.assert_close(y[2:], np.asarray(y_ref)[2:],
                       testing.tolerance("bfloat16"), "good rows")
  np.testing.assert_array_equal(new.count, [-1, L, 1, 3, 0])
  np.testing.assert_array_equal(new.count, new_ref.count)
  for name in ("checkpoint", "x_buf", "b_buf", "dt_buf"):
    np.testing.assert_array_equal(
        harness.bits(getattr(new, name)[:2]),
        harness.bits(getattr(bad, name)[:2]), err_msg=name)


@pytest.mark.parametrize("grid,fused", [("rows", False),
                                        ("persistent", False),
                                        ("rows", True)])
@pytest.mark.parametrize("fold", ["dot_tf32x3", "dot_f32"])
def test_replay_kernel_dot_fold(fold, grid, fused):
  """The tensor-core fold variants (exact f32 in interpret mode) equal the
  reference on flush rows (in a flush launch of their own and, fused, on
  the output route's programs) and refuse tiles smaller than Triton's
  dot."""
  params, tok, rstate, counts = _mixed_state("float32", 16, 71)
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(rstate, **kw, implementation="pallas",
                                config=pk.ReplayConfig(block_p=16,
                                                       flush_fold=fold,
                                                       flush_grid=grid,
                                                       fused_launch=fused))
  tol = testing.tolerance("bfloat16")  # bf16 buffers
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(r.checkpoint, r_ref.checkpoint, tol, "checkpoint")
  np.testing.assert_array_equal(r.count, r_ref.count)
  with pytest.raises(NotImplementedError, match="block_p >= 16"):
    rs.replay_state_update(rstate, **kw, implementation="pallas",
                           config=pk.ReplayConfig(block_p=8,
                                                  flush_fold=fold))
  with pytest.raises(ValueError, match="flush_fold must be one of"):
    pk.ReplayConfig(flush_fold="tf32")


# Pieces of the bf16 split fold -> its error bound against the exact f32
# dot on the f32 checkpoint, relative to the largest |element|. Interpret
# mode runs the bf16 dots exactly, so this is the split's truncation (the
# remainder of X = s x after K 8-bit pieces, ~2^-8K of X) plus f32 rounding;
# measured on this case: 5.8e-8 (x3), 2.8e-6 (x2).
_BF16_FOLD_RTOL = {"dot_bf16x3": 5e-7, "dot_bf16x2": 2e-5}


def test_replay_kernel_bf16_fold():
  """The bf16-split folds (bf16 B, weighted x in 3 / 2 bf16 pieces) equal
  the exact f32 dot fold to the split's precision and the reference to the
  usual tolerance; they refuse B that bf16 does not hold exactly."""
  params, tok, rstate, _ = _mixed_state("float32", 16, 71)
  tok = jax.tree.map(lambda v: v.astype(jnp.bfloat16), tok)
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")

  def run(f):
    return rs.replay_state_update(
        rstate, **kw, implementation="pallas",
        config=pk.ReplayConfig(block_p=16, flush_fold=f))

  _, r32 = run("dot_f32")
  scale = float(jnp.max(jnp.abs(r32.checkpoint)))
  for fold, rtol in _BF16_FOLD_RTOL.items():
    y, r = run(fold)
    np.testing.assert_allclose(r.checkpoint, r32.checkpoint, rtol=0,
                               atol=rtol * scale, err_msg=fold)
    tol = testing.tolerance("bfloat16")  # bf16 buffers and inputs
    testing.assert_close(y, y_ref, tol, f"{fold} y")
    testing.assert_close(r.checkpoint, r_ref.checkpoint, tol,
                         f"{fold} checkpoint")
    np.testing.assert_array_equal(r.count, r_ref.count)
  # The default: the bf16 split for bf16 B (two pieces for a 16-bit
  # checkpoint, three for f32 in a flush launch of its own), 3xTF32
  # otherwise, rank-1 below Triton's dot tiles.
  from pallas_kernels import replay as rk  # pylint: disable=g-import-not-at-top
  bf, f32 = jnp.bfloat16, jnp.float32
  default = functools.partial(rk._fold_dot, None, field="f", tile="t")  # pylint: disable=protected-access
  assert default(16, 16, False, b_dtypes=(bf, bf), ck_dtype=f32) == "bf16x3"
  for ck in (jnp.float16, bf):
    assert default(16, 16, False, b_dtypes=(bf, bf), ck_dtype=ck) == "bf16x2"
  assert (default(16, 16, False, b_dtypes=(bf, f32), ck_dtype=f32)
          == jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)
  assert default(16, 16, False, b_dtypes=(bf, bf), ck_dtype=f32,
                 fused=True) == (
      jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)  # shares its registers
  assert default(16, 16, False, b_dtypes=(bf, bf), ck_dtype=jnp.float16,
                 fused=True) == "bf16x2"
  assert default(8, 16, False, b_dtypes=(bf, bf), ck_dtype=f32) is None
  kw["B"] = kw["B"].astype(jnp.float32)
  with pytest.raises(NotImplementedError, match="needs bf16 B"):
    run("dot_bf16x3")


@pytest.mark.parametrize("buffer_len,fold", [(16, None), (4, "rank1")])
@pytest.mark.parametrize("fused,programs", [(False, 3), (False, 64),
                                            (True, 3)])
def test_replay_kernel_flush_prefetch(buffer_len, fold, fused, programs):
  """flush_prefetch only moves the persistent flush loop's loads one item
  ahead: the results are bit-identical to the plain loop's and equal the
  reference, with several items per program (3 programs), programs with
  none (64 programs: the masked first load) and in the fused launch."""
  params, tok, rstate, counts = _mixed_state("float16", buffer_len, 73,
                                             flush_rows=(0, 1, 3))
  assert (counts == buffer_len - 1).sum() == 3
  kw = dict(**tok, **params, dt_softplus=True)
  base = dict(block_p=16 if fold is None else 8, flush_fold=fold,
              flush_programs=programs, fused_launch=fused)
  y0, r0 = rs.replay_state_update(rstate, **kw, implementation="pallas",
                                  config=pk.ReplayConfig(**base))
  y1, r1 = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(**base, flush_prefetch=True, flush_num_warps=8,
                             flush_num_stages=2, flush_max_registers=128))
  exact = [(y0, y1), (r0.checkpoint, r1.checkpoint)]
  if fold == "rank1":
    # Not bit for bit in interpret mode: XLA:CPU fuses the rank-1 loop's
    # multiply-adds (and contracts them to FMAs) differently around the
    # two loops' load placements, so the f32 tile may differ by an ulp or
    # so (seen: y 2.4e-7 apart, one f16 checkpoint element 1 ulp apart);
    # within 1 f16 ulp here, the buffers and counters bit for bit.
    for a, b in exact:
      np.testing.assert_allclose(np.asarray(b, np.float32),
                                 np.asarray(a, np.float32), rtol=2**-10,
                                 atol=1e-6)
    exact = []
  for a, b in exact + list(zip(jax.tree.leaves(r0.replace(checkpoint=None)),
                               jax.tree.leaves(r1.replace(checkpoint=None)))):
    np.testing.assert_array_equal(harness.bits(a), harness.bits(b))
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  tol = testing.tolerance("bfloat16", "float16")
  testing.assert_close(y1, y_ref, tol, "y")
  testing.assert_close(r1.checkpoint, r_ref.checkpoint, tol, "checkpoint")


def test_flush_launch_fields_are_checked():
  with pytest.raises(ValueError, match="flush_prefetch=True needs"):
    pk.ReplayConfig(flush_prefetch=True, flush_grid="rows")
  with pytest.raises(ValueError, match="flush_heads_per_program needs"):
    pk.ReplayConfig(flush_heads_per_program=2)
  with pytest.raises(ValueError, match="flush_num_warps"):
    pk.ReplayConfig(flush_num_warps=3)
  with pytest.raises(ValueError, match="num_warps must be a power of two"):
    pk.ReplayConfig(num_warps=3)
  # None (a per-call default) is ReplayConfig's; the other kernels need an int.
  with pytest.raises(ValueError, match="num_warps must be a power of two"):
    pk.SSUConfig(num_warps=None)
  with pytest.raises(ValueError, match="flush_num_stages"):
    pk.ReplayConfig(flush_num_stages=0)
  for bad in (100, 16, 264, 128.0):
    with pytest.raises(ValueError, match="flush_max_registers must be None or"
                       " a multiple of 8"):
      pk.ReplayConfig(flush_max_registers=bad)
  params, tok, rstate, _ = _mixed_state("float32", 4, 77)
  with pytest.raises(NotImplementedError, match=r"flush_heads_per_program "
                     r"\(3\) must divide"):
    rs.replay_state_update(rstate, **tok, **params, implementation="pallas",
                           config=pk.ReplayConfig(flush_grid="rows",
                                                  flush_heads_per_program=3))
  with pytest.raises(NotImplementedError, match="output_prefetch"):
    rs.replay_state_update(rstate, **tok, **params, implementation="pallas",
                           config=pk.ReplayConfig(fused_launch=True,
                                                  output_prefetch=True))
  for mismatch in (dict(flush_block_p=4), dict(flush_heads_per_program=2)):
    with pytest.raises(NotImplementedError,
                       match=r"folds on the output route's programs"):
      rs.replay_state_update(
          rstate, **tok, **params, implementation="pallas",
          config=pk.ReplayConfig(fused_launch=True, flush_grid="rows",
                                 **mismatch))


def test_config_for_the_reference_is_refused():
  params, tok, rstate, _ = _mixed_state("float32", 4, 81)
  with pytest.raises(ValueError, match="'reference' takes no config"):
    rs.replay_state_update(rstate, **tok, **params,
                           implementation="reference",
                           config=pk.ReplayConfig())


# ------------------------------------------ dual precision (issue 6, kernels)
# Every read dtype with an f32 master, an f16 master with an fp8 copy, and
# stochastic rounding (int8 copy; f16 master + fp8 copy: both stores, with
# each per-element hash), each with another tuning config. (SR of a master
# without a copy, "bf16+sr", is the f16+fp8+sr master path without the
# copy; it is lowered below.)
POLICY_CASES = [
    ("f32+bf16", pk.ReplayConfig()),
    ("f32+f16", pk.ReplayConfig(block_p=4, heads_per_program=2)),
    ("f32+fp8", pk.ReplayConfig(flush_grid="rows", precompute_bc=True)),
    ("f32+int8", pk.ReplayConfig(block_p=8, flush_block_p=4,
                                 flush_programs=3)),
    ("f16+fp8", pk.ReplayConfig(heads_per_program=2, output_prefetch=True,
                                flush_prefetch=True, flush_programs=3)),
    ("f32+int8+sr", pk.ReplayConfig(flush_grid="rows", heads_per_program=2)),
    ("f16+fp8+sr", pk.ReplayConfig(block_p=8, flush_programs=3)),
    ("f16+fp8+sr:hash32", pk.ReplayConfig()),
    ("f16+fp8", pk.ReplayConfig(output_weights=True, fused_launch=False)),
    ("f16+fp8", pk.ReplayConfig(output_weights="pallas", max_registers=64,
                                fused_launch=False)),
    ("f32+fp8", pk.ReplayConfig(output_route="mosaic_gpu")),
    ("f32+int8", pk.ReplayConfig(output_route="mosaic_gpu",
                                 flush_grid="rows")),
    ("f16+fp8", pk.ReplayConfig(readout_chunk=4, readout_fma=True)),
    # The tile read out by one tensor-core product (readout="dot").
    ("f16+fp8", pk.ReplayConfig(readout="dot", fused_launch=False)),
    ("f32+int8", pk.ReplayConfig(readout="dot", heads_per_program=2,
                                 fused_launch=False)),
    ("f32+f16", pk.ReplayConfig(readout="dot", output_weights=True,
                                fused_launch=False)),
    # The readout kernel, then the (group, row) window kernel.
    ("f16+fp8", pk.ReplayConfig(output_route="split")),
    ("f32+int8", pk.ReplayConfig(output_route="split", block_p=8,
                                 flush_grid="rows")),
    ("f32+bf16", pk.ReplayConfig(output_route="split")),
]
POLICY_L = 4
POLICY_STEPS = 2 * POLICY_L + 1  # every row flushes twice
POLICY_LAYER = 3


def _policy_state(policy, seed):
  """A ragged state of `policy` (random master, buffers and junk in stale
  slots; rows 1 and 4 flush at the first step), its read copy stored from
  the master and, with stochastic rounding, random row ids and steps."""
  d = DIMS
  counts = np.array(C.ragged_counts(d.batch, POLICY_L))
  counts[4] = POLICY_L - 1
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, d.nheads)
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, POLICY_L, counts, params["A"],
      checkpoint_dtype=policy.checkpoint_dtype,
      buffer_dtype=policy.buffer_dtype)
  rstate = harness.with_policy_fields(rstate, policy, [17, 3, 40, 8, 25],
                                      [5, 0, 12, 7, 30])
  steps = harness.time_major(testing.random_step_inputs(
      jax.random.fold_in(key, 2), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, seqlen=POLICY_STEPS))
  return params, rstate, steps


@functools.partial(jax.jit, static_argnames=("policy", "config"),
                   compiler_options=harness.FAST_COMPILE)
def _policy_decode(rstate, steps, params, *, policy, config):
  """POLICY_STEPS decode steps of the kernel and of the reference.

  Per step: the kernel runs on its state, where (the state having a read
  copy) the master of every non-flush row is replaced by NaN: a read of it
  would show in y, and its bits show that it was not written (the carried
  state keeps the true master). The reference runs on the kernel's true
  state ("forced": one-step errors) and on its own state ("free": the whole
  decode).
  """
  L = POLICY_L

  def body(carry, tok):
    ks, rs_free = carry
    kw = dict(**harness.step_kwargs(tok, params, True), policy=policy,
              layer=POLICY_LAYER)
    flush = (ks.count == L - 1)[:, None, None, None]
    poisoned = ks
    if ks.read_copy is not None:
      poisoned = ks.replace(checkpoint=jnp.where(
          flush, ks.checkpoint, jnp.nan).astype(ks.checkpoint.dtype))
    y_k, k_out = rs.replay_state_update(poisoned, **kw,
                                        implementation="pallas",
                                        config=config)
    y_f, f_out = rs.replay_state_update(ks, **kw, implementation="reference")
    y_r, rs_free = rs.replay_state_update(rs_free, **kw,
                                          implementation="reference")
    out = dict(y_k=y_k, y_f=y_f, y_r=y_r, k_in=poisoned, k_out=k_out,
               f_out=f_out)
    ks = k_out.replace(checkpoint=jnp.where(flush, k_out.checkpoint,
                                            ks.checkpoint))
    return (ks, rs_free), out

  (ks, rs_free), out = jax.lax.scan(body, (rstate, rstate), steps)
  return ks, rs_free, out


def _np_bits(a):
  """Raw bits (numpy view) of a numpy array of 1-, 2- or 4-byte items."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


_store = jax.jit(P.store, static_argnums=(1,))
_random_bits = jax.jit(P.random_bits, static_argnums=(0, 4, 5, 6))


@pytest.mark.parametrize("name,config", POLICY_CASES,
                         ids=[n for n, _ in POLICY_CASES])
def test_replay_kernel_read_copy_decode(name, config):
  """Kernel vs reference over 2L+1 steps with ragged counters (flush and
  non-flush rows in every step):

  * each step from the same state: y within f32 tolerance (with a copy,
    non-flush rows read the same copy, computed without the master, which
    is NaN for them); non-flush rows' master, read copy and scales
    bit-identical
    (never written); flush rows' master within the master dtype's
    tolerance and their copy exactly `precision.store` of the kernel's
    stored master (with stochastic rounding: with the reference's random
    bits); counters, row ids and steps equal;
  * free-running: y within the tolerance of the policy's lowest storage
    dtype (testing.TOLERANCES).
  """
  pol = P.PrecisionPolicy.preset(name)
  params, rstate, steps = _policy_state(pol, seed=91)
  if config.readout == "dot":  # needs a 16-bit C (the model's bf16)
    steps = dict(steps, C=steps["C"].astype(jnp.bfloat16))
  before = jax.tree.map(np.asarray, rstate)
  ks, rs_free, out = _policy_decode(rstate, steps, params, policy=pol,
                                    config=config)
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, rstate), before)  # no mutation
  out = jax.tree.map(np.asarray, out)
  shape = rstate.checkpoint.shape[1:]
  f32 = testing.TOLERANCES["float32"]
  master_tol = testing.tolerance(pol.checkpoint_dtype)
  flush_rows = 0
  for t in range(POLICY_STEPS):
    kin, kout, fout = (jax.tree.map(lambda v, t=t: v[t], out[k])
                       for k in ("k_in", "k_out", "f_out"))
    flush = kin.count == POLICY_L - 1
    assert flush.any() and (~flush).any(), f"step {t}: not ragged"
    flush_rows += int(flush.sum())
    testing.assert_close(out["y_k"][t], out["y_f"][t], f32, f"y, step {t}")
    for field in ("checkpoint", "read_copy", "read_scale"):
      new, old = getattr(kout, field), getattr(kin, field)
      assert (new is None) == (old is None), field
      if old is not None:
        np.testing.assert_array_equal(
            _np_bits(new[~flush]), _np_bits(old[~flush]),
            err_msg=f"{name}: a non-flush row's {field} was written, step "
            f"{t}")
    master = kout.checkpoint.astype(np.float32)
    testing.assert_close(master[flush],
                         fout.checkpoint[flush].astype(np.float32),
                         master_tol, f"flushed master, step {t}")
    if pol.read_dtype is not None:
      bits = None
      if pol.stochastic_rounding:
        bits = _random_bits(pol.seed, POLICY_LAYER, kin.row_id, kin.step,
                            shape, P.SITE_READ_COPY, pol.sr_rng)
      copy, scale = _store(master, pol.read_dtype, bits)
      np.testing.assert_array_equal(
          _np_bits(kout.read_copy[flush]), _np_bits(copy)[flush],
          err_msg=f"{name}: copy != store(master), step {t}")
      if scale is not None:
        np.testing.assert_array_equal(
            _np_bits(kout.read_scale[flush]), _np_bits(scale)[flush],
            err_msg=f"{name}: scale != store(master), step {t}")
      if pol.stochastic_rounding:  # teeth: it really rounds stochastically
        rn, _ = _store(master, pol.read_dtype, None)
        assert not np.array_equal(_np_bits(rn)[flush],
                                  _np_bits(copy)[flush])
    for field in ("count", "row_id", "step"):
      a, b = getattr(kout, field), getattr(fout, field)
      assert (a is None) == (b is None), field
      if a is not None:
        np.testing.assert_array_equal(a, b, err_msg=f"{field}, step {t}")
  assert flush_rows >= 2 * DIMS.batch  # every row flushed at least twice
  tol = testing.tolerance(pol.checkpoint_dtype, pol.read_dtype,
                          pol.buffer_dtype)
  testing.assert_close(out["y_k"], out["y_r"], tol, f"{name} free-running y")
  final = [s.checkpoint if s.read_copy is None
           else P.load(s.read_copy, s.read_scale) for s in (ks, rs_free)]
  testing.assert_close(final[0], final[1], tol,
                       f"{name} free-running final copy")


def test_readout_dot_matches_f64_across_magnitudes():
  """common.readout_dot (the output route's readout="dot") against an f64
  readout for each tile dtype it takes, C in bf16 / f16 from 2^-120 to
  2^120 (the power-of-two scale keeps f16 in range), all-zero C and a NaN
  in C. Bound: f32 accumulation over N plus the documented 2^-38 max|C|
  |S| of C entries under f16's range after scaling."""
  from pallas_kernels import common  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(21)
  rows, n = 16, 128
  s = jax.random.normal(key, (rows, n)) * 40
  c0 = jax.random.normal(jax.random.fold_in(key, 1), (n,))
  c0 = c0 * jnp.exp2(jnp.round(jax.random.uniform(  # a 2^-30..1 spread
      jax.random.fold_in(key, 2), (n,), minval=-30, maxval=0)))
  for tile_dtype in (jnp.float16, jnp.float8_e4m3fn, jnp.int8):
    tile = (jnp.clip(jnp.round(s), -127, 127).astype(tile_dtype)
            if tile_dtype == jnp.int8 else s.astype(tile_dtype))
    tf = np.asarray(tile.astype(jnp.float32), np.float64)
    for c_dtype, exps in ((jnp.bfloat16, (-120, -60, 0, 60, 120)),
                          (jnp.float16, (-4, 0, 4))):
      for e in exps:
        c = (c0 * 2.0 ** e).astype(c_dtype)
        cf = np.asarray(c.astype(jnp.float32), np.float64)
        want = tf @ cf
        got = np.asarray(common.readout_dot(tile, c), np.float64)
        bound = (1e-5 * (np.abs(tf) @ np.abs(cf))
                 + 2.0 ** -37 * np.abs(cf).max() * np.abs(tf).sum(1))
        err = np.abs(got - want)
        assert (err <= bound).all(), (
            f"{tile.dtype} x {c.dtype} 2^{e}: max err / bound "
            f"{(err / bound).max():.3g}")
    np.testing.assert_array_equal(
        common.readout_dot(tile, jnp.zeros(n, jnp.bfloat16)), 0.0)
    assert np.isnan(common.readout_dot(
        tile, c0.astype(jnp.bfloat16).at[5].set(jnp.nan))).all()
  with pytest.raises(NotImplementedError, match="read tile must be one of"):
    rs.replay_state_update(
        *_readout_dot_case(jnp.float32, jnp.bfloat16), implementation="pallas",
        config=pk.ReplayConfig(readout="dot"))
  with pytest.raises(NotImplementedError, match="C must be one of"):
    rs.replay_state_update(
        *_readout_dot_case(jnp.float16, jnp.float32), implementation="pallas",
        config=pk.ReplayConfig(readout="dot"))
  with pytest.raises(ValueError, match="leave readout_chunk None"):
    pk.ReplayConfig(readout="dot", readout_chunk=32)
  with pytest.raises(ValueError, match="set readout_chunk"):
    pk.ReplayConfig(readout_fma=True)
  with pytest.raises(ValueError, match="output_weights must be"):
    pk.ReplayConfig(output_weights="triton")
  with pytest.raises(ValueError, match="readout must be one of"):
    pk.ReplayConfig(readout="mma")


def _readout_dot_case(ckpt_dtype, c_dtype):
  """(rstate, x, dt, A, B, C) of a small state for readout="dot"'s
  argument checks."""
  d = DIMS
  params = testing.random_params(jax.random.PRNGKey(3), d.nheads)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(4), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, 4, np.zeros(d.batch, np.int32), params["A"],
      checkpoint_dtype=ckpt_dtype, buffer_dtype=jnp.bfloat16)
  tok = testing.random_step_inputs(jax.random.PRNGKey(5), d.batch, d.nheads,
                                   d.headdim, d.dstate, d.ngroups)
  return (rstate, tok["x"], tok["dt"], params["A"], tok["B"],
          tok["C"].astype(c_dtype))


def test_kernel_quantize_rows_matches_precision_quantize():
  """The kernels' 8-bit store (Triton-lowerable ops) equals
  precision.quantize bit for bit, nearest and stochastic, on random rows
  and on the edge rows: zero, tiny (encode overflows), huge, NaN, inf,
  -inf, and int8 ties (x.5 after scaling)."""
  from pallas_kernels import common  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(13)
  n = 16
  # 512 random rows: each row's amax element lands within an ulp or two of
  # qmax after scaling, above it in some rows (the kernel does not clip
  # round-to-nearest values there, the reference does).
  x = jax.random.normal(key, (512, n)) * jnp.exp(
      jax.random.normal(jax.random.fold_in(key, 1), (512, 1)) * 3)
  ties = (jnp.arange(n, dtype=jnp.float32) - 7.5) * 127 / 8.5  # k + 0.5
  edge = jnp.stack([
      jnp.zeros(n), jnp.full(n, 1e-39), jnp.full(n, -3e38),
      x[0].at[3].set(jnp.nan), x[1].at[0].set(jnp.inf),
      x[2].at[5].set(-jnp.inf), ties.at[0].set(8.5 * 127 / 8.5),
      jnp.linspace(-1, 1, n) * 1e-30])
  x = jnp.concatenate([x, edge])
  bits = jax.random.bits(jax.random.fold_in(key, 2), x.shape, jnp.uint32)
  for dtype in P.QUANTIZED_DTYPES:
    for b in (None, bits):
      q, scale = common.quantize_rows(x, dtype, b)
      q_ref, scale_ref = P.quantize(x, dtype, b)
      what = f"{dtype} {'SR' if b is not None else 'RN'}"
      np.testing.assert_array_equal(_np_bits(q), _np_bits(q_ref),
                                    err_msg=what)
      np.testing.assert_array_equal(_np_bits(scale), _np_bits(scale_ref),
                                    err_msg=what)
  v = jnp.concatenate([jnp.arange(-130, 131) * 0.5,
                       jax.random.uniform(key, (512,), minval=-127,
                                          maxval=127)])
  np.testing.assert_array_equal(common.round_half_even(v), jnp.round(v))


def test_fused_launch_refuses_xla_weights():
  params, tok, rstate, _ = _mixed_state(jnp.float32, 8, 12)
  with pytest.raises(NotImplementedError,
                     match="fused_launch=True does not support output_weights"):
    rs.replay_state_update(
        rstate, **tok, **params, dt_softplus=True, implementation="pallas",
        config=pk.ReplayConfig(fused_launch=True, output_weights=True))


def test_replay_kernel_precision_refusals(monkeypatch):
  """What the kernels refuse names the field: output_all_rows with a read
  copy (its flush rows' y would come from the copy); the fused launch with
  a precision policy; an fp8 copy on a GPU
  below sm_89 (no Triton fp8 conversions); stochastic rounding without
  row_id/step (only reachable past the op's own check)."""
  pol = P.PrecisionPolicy.preset("f32+fp8")
  params, rstate, steps = _policy_state(pol, seed=93)
  kw = dict(**harness.step_kwargs(jax.tree.map(lambda a: a[0], steps),
                                  params, True), policy=pol)
  with pytest.raises(NotImplementedError, match="output_all_rows"):
    rs.replay_state_update(rstate, **kw, implementation="pallas",
                           config=pk.ReplayConfig(output_all_rows=True))
  with pytest.raises(NotImplementedError,
                     match=r"fused_launch=True does not support a read copy"):
    rs.replay_state_update(rstate, **kw, implementation="pallas",
                           config=pk.ReplayConfig(fused_launch=True))
  monkeypatch.setattr(pk, "_compute_capability", lambda: (8, 0))
  with pytest.raises(NotImplementedError,
                     match=r"rstate.read_copy is float8_e4m3fn.*8\.0"):
    rs.replay_state_update(rstate, **kw, implementation="pallas")
  int8 = P.PrecisionPolicy.preset("f32+int8")
  _, r8, _ = _policy_state(int8, seed=94)
  assert pk._replay_supports(rstate=r8, policy=int8) is None  # sm_80: ok
  monkeypatch.setattr(pk, "_compute_capability", lambda: (9, 0))
  assert pk._replay_supports(rstate=rstate, policy=pol) is None
  sr = P.PrecisionPolicy.preset("f32+fp8+sr")
  why = pk._replay_supports(rstate=rstate, policy=sr)
  assert "rstate.row_id and rstate.step" in why, why


@pytest.mark.parametrize("ckpt", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("batch,fused", [(1, True), (66, False)])
def test_default_fused_launch_by_batch(batch, fused, ckpt):
  """ReplayConfig(fused_launch=None) launches both routes as one kernel
  at small batch (8 heads: batch * 8 < 4 * 132) and as two above; the one
  launch folds on the output route's programs on an f32 checkpoint
  (flush_grid=None -> "rows"), on persistent flush programs otherwise."""
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  assert replay_kernel.default_fused_launch(batch, 8) == fused
  h, p, n, g, L = 8, 16, 16, 2, 16
  sds = jax.ShapeDtypeStruct
  rstate = rs.ReplayState(
      checkpoint=sds((batch, h, p, n), ckpt),
      x_buf=sds((batch, L, h, p), jnp.bfloat16),
      b_buf=sds((batch, L, g, n), jnp.bfloat16),
      dt_buf=sds((batch, L, h), jnp.float32),
      count=sds((batch,), jnp.int32))
  jaxpr = str(jax.make_jaxpr(
      lambda r, x, dt, A, B, C: replay_kernel.replay_state_update(
          r, x, dt, A, B, C, interpret=True))(
              rstate, sds((batch, h, p), jnp.bfloat16),
              sds((batch, h), jnp.bfloat16), sds((h,), jnp.float32),
              sds((batch, g, n), jnp.bfloat16),
              sds((batch, g, n), jnp.bfloat16)))
  assert ("replayssm_replay_fused_routes" in jaxpr) == fused
  assert ("replayssm_replay_output_route" in jaxpr) == (not fused)
  rows = fused and ckpt == jnp.float32
  assert ("replayssm_replay_fused_routes_rows" in jaxpr) == rows
  # Separate launches: the output route and the flush route's kernel.
  assert ("replayssm_replay_flush_route" in jaxpr) == (not fused)


# ------------------------------------------------- GPU lowering (no GPU here)
def _lower_for_cuda(fn, *args):
  """Lowers fn for CUDA on this CPU machine (jax.export cross-lowering):
  every pallas_call is lowered to Triton IR by the Pallas Triton backend,
  so an op it cannot lower (interpret mode runs anything) fails here."""
  from jax import export  # pylint: disable=g-import-not-at-top
  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exp = export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[triton])(*args)
  text = exp.mlir_module()
  assert "triton" in text  # the kernels were lowered, not skipped
  return text


LOWERING_REPLAY_CONFIGS = [
    pk.ReplayConfig(),
    pk.ReplayConfig(flush_fold="dot_f32"),
    pk.ReplayConfig(flush_fold="rank1", flush_unroll=True),
    pk.ReplayConfig(flush_grid="rows", heads_per_program=2,
                    flush_heads_per_program=2, precompute_bc=True,
                    output_all_rows=True),
    pk.ReplayConfig(fused_launch=True),
    pk.ReplayConfig(fused_launch=False),
    pk.ReplayConfig(fused_launch=False, flush_prefetch=True,
                    flush_num_warps=8, flush_num_stages=3),
    pk.ReplayConfig(fused_launch=True, flush_prefetch=True),
    pk.ReplayConfig(heads_per_program=2, output_prefetch=True),
    pk.ReplayConfig(readout_chunk=32, fused_launch=False),
    pk.ReplayConfig(readout_chunk=16, fused_launch=True),
    pk.ReplayConfig(flush_fold="dot_bf16x3"),
    pk.ReplayConfig(output_unmasked_buffers=True, fused_launch=False,
                    max_registers=96),
    pk.ReplayConfig(output_eager=True, output_unmasked_buffers=True,
                    fused_launch=True),
    pk.ReplayConfig(flush_grid="rows", fused_launch=True),
    pk.ReplayConfig(readout="dot"),
    pk.ReplayConfig(output_weights="pallas", max_registers=64),
    pk.ReplayConfig(readout_chunk=32, readout_fma=True, fused_launch=False),
    pk.ReplayConfig(output_route="split"),
]


# (config, precision policy): every config with the plain state (None);
# bf16 / int8 read copies, fp8 loads and stores with an f16 master, and
# stochastic rounding of a copy, of both stores and of a master without a
# copy, on the default config and on the rows flush grid; a copy with
# output_all_rows (refused).
_ROWS_CONFIG = pk.ReplayConfig(flush_grid="rows", heads_per_program=2,
                               precompute_bc=True, flush_fold="rank1",
                               flush_unroll=True)
LOWERING_CASES = [(c, None) for c in LOWERING_REPLAY_CONFIGS] + [
    (LOWERING_REPLAY_CONFIGS[0], name) for name in (
        "f32+bf16", "f32+int8", "f16+fp8+sr", "f32+int8+sr", "bf16+sr",
        "f16+sr:hash32")] + [
    (_ROWS_CONFIG, "f32+int8"), (_ROWS_CONFIG, "f16+fp8+sr"),
    (LOWERING_REPLAY_CONFIGS[3], "f32+fp8"),
    (LOWERING_REPLAY_CONFIGS[6], "f32+fp8+sr"),
    (LOWERING_REPLAY_CONFIGS[8], "f32+fp8"),
    (LOWERING_REPLAY_CONFIGS[9], "f16+fp8"),
    (LOWERING_REPLAY_CONFIGS[12], "f16+fp8"),
    (LOWERING_REPLAY_CONFIGS[-1], "f32+int8")] + [
        (c, "f16+fp8") for c in LOWERING_REPLAY_CONFIGS[-3:]]


def _lowering_state(batch, buffer_len, policy, dims):
  """(params, token, ragged replay state of `policy` (None: f16 checkpoint)
  with its read copy and SR counters, the policy) at dims (h, p, n, g)."""
  h, p, n, g = dims
  key = jax.random.PRNGKey(5)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  tok = testing.random_step_inputs(key, batch, h, p, n, g, jnp.bfloat16,
                                   with_z=True)
  counts = np.arange(batch) % buffer_len
  pol = None if policy is None else P.PrecisionPolicy.preset(policy)
  rstate, _ = testing.random_replay_state(
      key, batch, h, p, n, g, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.float16 if pol is None else pol.checkpoint_dtype,
      buffer_dtype=jnp.bfloat16)
  return params, tok, harness.with_policy_fields(
      rstate, pol, np.arange(batch), np.zeros(batch)), pol


def _lower_replay(config, params, tok, rstate, pol):
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  kw = dict(D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True)
  return _lower_for_cuda(
      lambda r, t, layer: replay_kernel.replay_state_update(
          r, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"], **kw,
          policy=pol, layer=layer, config=config),
      rstate, tok, jnp.int32(2))  # a traced layer (a scan over layers)


@pytest.mark.parametrize("config,policy", LOWERING_CASES, ids=str)
@pytest.mark.parametrize("batch,buffer_len", [(6, 16), (1, 4)])
def test_kernels_lower_to_triton(config, batch, buffer_len, policy):
  """Every kernel, tuning option and precision policy lowers for the GPU
  (found on the H200: a fully unrolled fori_loop and a vector slice have no
  Triton lowering; fp8 converts lower for sm_89+)."""
  from pallas_kernels import ssu as ssu_kernel  # pylint: disable=g-import-not-at-top
  params, tok, rstate, pol = _lowering_state(batch, buffer_len, policy,
                                             (4, 16, 16, 2))
  kw = dict(D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True)

  def replay():
    _lower_replay(config, params, tok, rstate, pol)

  if config.flush_fold not in (None, "rank1") and buffer_len < 16:
    with pytest.raises(NotImplementedError, match="block_p >= 16"):
      replay()
  elif config.output_all_rows and rstate.read_copy is not None:
    with pytest.raises(NotImplementedError, match="output_all_rows"):
      replay()
  else:
    replay()
  if config == LOWERING_REPLAY_CONFIGS[0] and policy is None:
    state = rstate.checkpoint
    _lower_for_cuda(
        lambda s, t: ssu_kernel.selective_state_update(
            s, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"], **kw),
        state, tok)


@pytest.mark.parametrize("state_dtype,config", [
    ("float32", pk.MosaicSSUConfig()),
    ("float16", pk.MosaicSSUConfig(heads_per_program=2,
                                   max_concurrent_steps=3)),
    ("bfloat16", pk.MosaicSSUConfig(heads_per_program=1)),
    ("float32", pk.MosaicSSUConfig(entry="pallas_call")),
    ("float16", pk.MosaicSSUConfig(entry="pallas_call", heads_per_program=4,
                                   max_concurrent_steps=3))], ids=str)
def test_mosaic_kernel_lowers_for_cuda(state_dtype, config):
  """The Mosaic GPU kernel lowers for CUDA at the GPU shapes it accepts
  (headdim 64, 128-byte state rows): register layouts, SMEM tiling and
  swizzle, the pipelined grid; interpret mode checks none of these."""
  from jax import export  # pylint: disable=g-import-not-at-top
  b, h, p, n, g = 2, 4, 64, 128, 2
  key = jax.random.PRNGKey(6)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  tok = testing.random_step_inputs(key, b, h, p, n, g, jnp.bfloat16,
                                   with_z=True)
  state = jax.ShapeDtypeStruct((b, h, p, n), jnp.dtype(state_dtype))
  assert pk.mosaic_kernel.shape_problem(state) is None

  def step(state, tok, params):
    return pk.mosaic_kernel.selective_state_update(
        state, **tok, **params, dt_softplus=True, config=config)

  text = export.export(jax.jit(step), platforms=["cuda"])(
      state, tok, params).mlir_module()
  assert "mosaic_gpu" in text  # the kernel was lowered, not skipped


@pytest.mark.parametrize("policy,config,warps,cap", [
    (None, pk.ReplayConfig(fused_launch=False), (2, 4), 128),  # f16 ckpt
    ("f32", pk.ReplayConfig(fused_launch=False), (4, 4), 128),
    ("f32+fp8", pk.ReplayConfig(), (2, 4), 128),
    ("f32+int8", pk.ReplayConfig(), (2, 4), 128),
    ("f32+bf16", pk.ReplayConfig(), (2, 4), 168),
    ("f16+fp8", pk.ReplayConfig(), (2, 4), 120),
    ("f32+fp8+sr", pk.ReplayConfig(), (2, 4), None),
    ("f16+sr", pk.ReplayConfig(), (2, 2), None),
    ("f32+fp8", pk.ReplayConfig(num_warps=8, flush_num_warps=2), (8, 2),
     None),
    ("f32+fp8", pk.ReplayConfig(flush_max_registers=168), (2, 4), 168),
    # A cap is the default at 4 flush warps only; set, it is kept.
    ("f32", pk.ReplayConfig(fused_launch=False, flush_num_warps=2), (4, 2),
     None),
    ("f32", pk.ReplayConfig(fused_launch=False, flush_num_warps=8,
                            flush_max_registers=96), (4, 8), 96),
    (None, pk.ReplayConfig(fused_launch=False, max_registers=104), (2, 4),
     128),
])
def test_replay_launch_warps(policy, config, warps, cap):
  """The warps each replay kernel is launched with, read from the Triton
  custom calls, and the flush route's register cap (its name's suffix,
  common.capped_name): by default 2 warps for the output route over a 16-
  or 8-bit tile (checkpoint or read copy) and 4 over an f32 one; 4 for
  the flush route (2 on a stochastically rounded master without a copy),
  capped at 128 registers on a plain state and an f32 master with an
  8-bit copy, 120 on a 16-bit master with one, 168 with other copies,
  none with stochastic rounding
  (replay.default_flush_launch); fields that are set are used as
  given."""
  params, tok, rstate, pol = _lowering_state(6, 16, policy, (4, 64, 128, 2))
  text = _lower_replay(config, params, tok, rstate, pol)
  flush = "replayssm_replay_flush_route" + (f"__maxnreg{cap}" if cap else "")
  out = "replayssm_replay_output_route" + (
      f"__maxnreg{config.max_registers}" if config.max_registers else "")
  assert _launched_warps(text) == {out: warps[0], flush: warps[1]}


def test_fused_launch_takes_the_register_cap():
  """ReplayConfig.max_registers caps the fused (one-launch) kernel too."""
  params, tok, rstate, pol = _lowering_state(1, 16, None, (4, 64, 128, 2))
  for cap, name in ((None, "replayssm_replay_fused_routes"),
                    (128, "replayssm_replay_fused_routes__maxnreg128")):
    text = _lower_replay(pk.ReplayConfig(fused_launch=True, max_registers=cap),
                         params, tok, rstate, pol)
    assert _launched_warps(text) == {name: 4}


def test_flush_programs_fit_the_register_file():
  """Persistent flush programs per SM: as many as 64K registers hold at
  the cap (at most 4), 4 uncapped; 8 in all in interpret mode."""
  sms = 132  # the CPU device reports no core_count
  assert pk.replay_kernel._flush_programs(False, 4, 128) == 4 * sms
  assert pk.replay_kernel._flush_programs(False, 4, 168) == 3 * sms
  assert pk.replay_kernel._flush_programs(False, 4, 120) == 4 * sms
  assert pk.replay_kernel._flush_programs(False, 8, 256) == 1 * sms
  assert pk.replay_kernel._flush_programs(False, 2, None) == 4 * sms
  assert pk.replay_kernel._flush_programs(True, 4, 168) == 8


def test_replay_fused_launch_warps():
  """The fused launch (both routes in one kernel) keeps 4 warps on a
  16-bit checkpoint by default: its flush route shares the register
  budget, and 2 warps were never measured there."""
  params, tok, rstate, pol = _lowering_state(1, 16, None, (4, 64, 128, 2))
  text = _lower_replay(pk.ReplayConfig(fused_launch=True), params, tok,
                       rstate, pol)
  assert _launched_warps(text) == {"replayssm_replay_fused_routes": 4}


def _launched_warps(text):
  """{kernel name: num_warps} of the Triton custom calls in lowered text."""
  return {name: int(w) for name, w in re.findall(
      r'name = "(replayssm_\w+)", num_stages = \d+ : i32, '
      r'num_warps = (\d+) : i32', text)}


@pytest.mark.parametrize("policy", [None, "f32+fp8", "f32+int8",
                                    "f16+fp8+sr"])
def test_mosaic_output_route_lowers_for_cuda(policy):
  """ReplayConfig(output_route="mosaic_gpu") lowers for CUDA at GPU shapes:
  the Mosaic readout of the checkpoint or 8-bit read copy, the Triton flush
  route after it."""
  params, tok, rstate, pol = _lowering_state(6, 16, policy, (4, 64, 128, 2))
  text = _lower_replay(pk.ReplayConfig(output_route="mosaic_gpu"), params,
                       tok, rstate, pol)
  assert "mosaic_gpu" in text and "replayssm_replay_output_route" not in text


@pytest.mark.parametrize("ckpt_dtype,variant,batch", [
    ("float32", {}, 32), ("float16", {}, 32),
    ("float32", dict(flush_store_from_input=True), 32),
    ("float32", dict(flush_grid="persistent", flush_programs=5), 32),
    ("float16", dict(flush_grid="persistent", flush_store_from_input=True),
     32),
    # The counters reach SMEM in TMA copies of <= 256 elements (one copy
    # of 512 failed to lower on the H200, session 22).
    ("float32", dict(flush_grid="persistent", flush_store_from_input=True,
                     flush_heads_per_program=4), 512)],
    ids=str)
def test_mosaic_flush_route_lowers_for_cuda_in_place(ckpt_dtype, variant,
                                                     batch):
  """ReplayConfig(flush_route="mosaic_gpu") lowers for CUDA at GPU shapes
  (register layouts, swizzled tiles, the TMA pipeline, WGMMA: interpret
  mode checks none of these), also with the tile stored from its input
  slot and on the persistent grid, and the Mosaic call aliases the
  checkpoint input -> output (`pl.run_state`), so the flush writes it in
  place; its y is a fresh output (the output route completes it in
  place)."""
  params, tok, rstate, _ = _lowering_state(batch, 16, None, (4, 64, 128, 2))
  rstate = rstate.replace(
      checkpoint=rstate.checkpoint.astype(jnp.dtype(ckpt_dtype)))
  text = _lower_replay(
      pk.ReplayConfig(flush_route="mosaic_gpu", **variant),
      params, tok, rstate, None)
  assert "replayssm_replay_flush_route" not in text
  calls = [ln for ln in text.splitlines() if "@mosaic_gpu" in ln]
  assert len(calls) == 1
  aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = "
                       r"(\d+)", calls[0])
  assert len(aliases) == 1, aliases
  sig = calls[0].rsplit(": (", 1)[1]
  operand_types = re.findall(r"tensor<[^>]*>", sig.split("->")[0])
  result_types = re.findall(r"tensor<[^>]*>", sig.split("->")[1])
  ck_type = (f"tensor<{batch}x4x64x128x"
             f"{'f32' if ckpt_dtype == 'float32' else 'f16'}>")
  assert operand_types[int(aliases[0][1])] == ck_type
  assert result_types[int(aliases[0][0])] == ck_type
  assert f"tensor<{batch}x4x64xbf16>" in result_types  # y


@pytest.mark.parametrize("ckpt_dtype,fold", [
    ("float32", None), ("float16", None), ("float32", "dot_bf16x2"),
    ("bfloat16", "rank1")], ids=str)
def test_mosaic_flush_folds_at_16_tokens(ckpt_dtype, fold):
  """The Mosaic flush's WGMMA fold (buffer_len 16: bf16 pieces of the
  weighted x against the B buffer; the default there) and its rank-1 fold
  against the reference, interpret mode, flush and non-flush rows mixed."""
  params, tok, rstate, counts = _mixed_state(ckpt_dtype, 16, 31,
                                             flush_rows=(0, 3))
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(flush_route="mosaic_gpu", flush_fold=fold,
                             flush_heads_per_program=4))
  tol = testing.tolerance("bfloat16", ckpt_dtype)
  testing.assert_close(y, y_ref, tol, "y")
  flush = counts == 15
  testing.assert_close(np.asarray(r.checkpoint, np.float32)[flush],
                       np.asarray(r_ref.checkpoint, np.float32)[flush], tol,
                       "flushed checkpoint")
  np.testing.assert_array_equal(harness.bits(np.asarray(r.checkpoint)[~flush]),
                                harness.bits(np.asarray(rstate.checkpoint)
                                             [~flush]))
  np.testing.assert_array_equal(r.count, r_ref.count)


@pytest.mark.parametrize("batch,num_ctas,chunk,pattern", [
    (256, 264, 8, "all"), (256, 264, 8, "random"), (256, 264, 8, "none"),
    (64, 5, 4, "random"), (32, 40, 8, "one"), (96, 7, 2, "last")], ids=str)
def test_mosaic_persistent_flush_tiles_cover_the_flush_rows_once(
    batch, num_ctas, chunk, pattern):
  """The persistent Mosaic flush's work split (`mosaic_gpu.cta_tiles`, the
  same code the kernel runs on its SMEM counters): over all CTAs, every
  flush row's every head exactly once and no other row, the CTAs' shares
  within one chunk of each other."""
  L, nheads = 16, 8
  rng = np.random.default_rng(batch * 7 + num_ctas)
  counts = rng.integers(0, L - 1, batch)
  flush = {"all": np.ones(batch, bool), "none": np.zeros(batch, bool),
           "one": np.arange(batch) == batch // 2,
           "last": np.arange(batch) >= batch - 33,  # across a mask word
           "random": rng.random(batch) < 0.4}[pattern]
  counts[flush] = L - 1
  longest = -(-batch * nheads // num_ctas) + chunk

  @jax.jit
  @jax.vmap
  def tiles(c):
    steps, chunk_row, head = pk.mosaic_gpu.cta_tiles(
        jnp.asarray(counts, jnp.int32), c, L=L, nheads=nheads,
        num_ctas=num_ctas, chunk=chunk)
    k = jnp.arange(longest)
    return steps, chunk_row(k // chunk), head(k)

  steps, rows, heads = map(np.asarray, tiles(jnp.arange(num_ctas)))
  got = sorted((rows[c, k], heads[c, k]) for c in range(num_ctas)
               for k in range(steps[c]))
  want = [(b, h) for b in np.flatnonzero(flush) for h in range(nheads)]
  assert got == want
  assert steps.max() - steps.min() <= chunk


def test_mosaic_flush_route_config_is_checked():
  with pytest.raises(ValueError, match="flush_route must be one of"):
    pk.ReplayConfig(flush_route="cuda")
  for clash in (dict(fused_launch=True), dict(output_all_rows=True),
                dict(flush_prefetch=True), dict(flush_num_warps=2)):
    with pytest.raises(ValueError, match="replaces the Triton flush route"):
      pk.ReplayConfig(flush_route="mosaic_gpu", **clash)
  with pytest.raises(ValueError, match="needs output_route='triton'"):
    pk.ReplayConfig(flush_route="mosaic_gpu", output_route="mosaic_gpu")
  with pytest.raises(ValueError, match="flush_store_from_input=True needs"):
    pk.ReplayConfig(flush_store_from_input=True)
  with pytest.raises(ValueError, match="flush_programs with flush_route"):
    pk.ReplayConfig(flush_route="mosaic_gpu", flush_programs=4)
  with pytest.raises(NotImplementedError, match="multiple of 128 bytes"):
    _lower_replay(pk.ReplayConfig(flush_route="mosaic_gpu",
                                  flush_grid="persistent"),
                  *_lowering_state(6, 16, None, (4, 64, 128, 2))[:3], None)
  with pytest.raises(ValueError, match="folds by 'rank1', 'dot_bf16x2'"):
    pk.ReplayConfig(flush_route="mosaic_gpu", flush_fold="dot_tf32x3")
  with pytest.raises(NotImplementedError, match="buffer_len a multiple of 16"):
    _lower_replay(pk.ReplayConfig(flush_route="mosaic_gpu",
                                  flush_fold="dot_bf16x3"),
                  *_lowering_state(2, 4, None, (4, 64, 128, 2))[:3], None)
  with pytest.raises(ValueError, match="flush_heads_per_program needs"):
    pk.ReplayConfig(flush_heads_per_program=2)
  params, tok, rstate, pol = _lowering_state(2, 4, "f32+int8",
                                             (4, 16, 16, 2))
  with pytest.raises(NotImplementedError, match="plain states only"):
    rs.replay_state_update(rstate, **tok, **params, dt_softplus=True,
                           policy=pol, implementation="pallas",
                           config=pk.ReplayConfig(flush_route="mosaic_gpu"))


def test_register_caps_without_the_lowering_hook(monkeypatch):
  """Where jax lacks the lowering hook (common.capped_name), the default
  flush launch falls back to the uncapped session-14 defaults and an
  explicit cap is refused by name, not dropped."""
  monkeypatch.setattr(pk.common, "_cap_hook_error", "AttributeError('x')")
  assert not pk.common.register_caps_supported()
  launch = pk.replay_kernel.default_flush_launch
  assert launch(None, jnp.float16) == (2, None)
  assert launch(None, jnp.float32, num_warps=4) == (4, None)
  assert launch(None, jnp.float32, 4, 128) == (4, 128)
  with pytest.raises(NotImplementedError, match="register cap"):
    pk.common.capped_name("k", 128)
  assert pk.common.capped_name("k", None) == "k"


def _abstract_state(batch=256, copy=jnp.float8_e4m3fn, h=128, g=8, L=16):
  """A ReplayState of shapes only (f16 master, `copy` read copy or None)
  at the 8B layer's dims."""
  p, n, sds = 64, 128, jax.ShapeDtypeStruct
  return rs.ReplayState(
      checkpoint=sds((batch, h, p, n), jnp.float16),
      x_buf=sds((batch, L, h, p), jnp.bfloat16),
      b_buf=sds((batch, L, g, n), jnp.bfloat16),
      dt_buf=sds((batch, L, h), jnp.float32),
      count=sds((batch,), jnp.int32),
      read_copy=None if copy is None else sds((batch, h, p, n), copy),
      read_scale=None if copy is None else sds((batch, h, p), jnp.float32))


def _states_off_the_8bit_defaults():
  """(state, default config) pairs that no 8-bit-copy default takes: too
  few (row, head) pairs, a 16-bit or no read copy, 12 heads per group."""
  state = _abstract_state
  return [(rstate, pk.ReplayConfig()) for rstate in (
      state(batch=128), state(copy=jnp.bfloat16), state(copy=None),
      state(h=96, g=8))]


def test_default_output_route_where_measured_faster():
  """ReplayConfig(output_route=None) resolves to the split route only for
  an 8-bit read copy at >= 256 x 128 (row, head) pairs with power-of-two
  windows and no output-route field, output_weights, readout, fused launch
  or Mosaic flush set; everything else gets "triton", and an explicit
  value is kept."""
  resolve = pk.replay_kernel.default_output_route
  state = _abstract_state
  assert resolve(pk.ReplayConfig(), state(), False).output_route == "split"
  assert resolve(pk.ReplayConfig(), state(batch=512, copy=jnp.int8),
                 False).output_route == "split"
  for rstate, config in _states_off_the_8bit_defaults() + [
      (state(), pk.ReplayConfig(max_registers=96)),
      (state(), pk.ReplayConfig(output_weights="pallas")),
      (state(), pk.ReplayConfig(readout="dot")),
      (state(), pk.ReplayConfig(fused_launch=True)),
      (state(), pk.ReplayConfig(flush_route="mosaic_gpu"))]:
    got = resolve(config, rstate, False)
    assert got.output_route == "triton", (rstate.count.shape, config)
  for explicit in ("triton", "split", "mosaic_gpu"):
    config = pk.ReplayConfig(output_route=explicit)
    assert resolve(config, state(), False) is config


def test_default_output_weights_where_measured_faster():
  """ReplayConfig(output_weights=None) on the Triton route resolves to the
  weights kernel with the route capped at 64 registers only for an 8-bit
  read copy at >= 256 x 128 (row, head) pairs with no other output-route
  field set; everything else gets False, and an explicit value is
  kept."""
  resolve = pk.replay_kernel.default_output_weights
  state = _abstract_state
  got = resolve(pk.ReplayConfig(), state(), False)
  assert (got.output_weights, got.max_registers) == ("pallas", 64)
  assert resolve(pk.ReplayConfig(), state(batch=512, copy=jnp.int8),
                 False).output_weights == "pallas"
  for rstate, config in _states_off_the_8bit_defaults() + [
      (state(), pk.ReplayConfig(max_registers=96)),
      (state(), pk.ReplayConfig(heads_per_program=2)),
      (state(), pk.ReplayConfig(readout="dot")),
      (state(), pk.ReplayConfig(output_route="split")),
      (state(), pk.ReplayConfig(output_route="mosaic_gpu"))]:
    got = resolve(config, rstate, False)
    assert got.output_weights is False, (rstate.count.shape, config)
    assert got.max_registers == config.max_registers
  for explicit in (False, True, "xla", "pallas"):
    config = pk.ReplayConfig(output_weights=explicit)
    assert resolve(config, state(), False) is config


@pytest.mark.parametrize("launch", [
    dict(), dict(unmasked=True), dict(skip_flush=True),
    dict(unmasked=True, skip_flush=True, num_warps=4)], ids=str)
def test_weights_kernel_launches_match_xla(launch):
  """The weights kernel (interpret mode) in each launch form gives XLA's
  `output_weights` on ragged counters with stale junk past them (every
  row, or, with skip_flush, every row that does not flush), and lowers for
  the GPU."""
  b, h, p, n, g, L = 6, 4, 16, 16, 2, 8
  key = jax.random.PRNGKey(11)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  tok = testing.random_step_inputs(key, b, h, p, n, g, jnp.bfloat16)
  counts = np.array([0, 3, L - 1, 5, L - 1, 1])
  rstate, _ = testing.random_replay_state(
      key, b, h, p, n, g, L, counts, params["A"],
      checkpoint_dtype=jnp.float16, buffer_dtype=jnp.bfloat16)
  args = (rstate, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
          params["dt_bias"], True)
  want = pk.replay_kernel.output_weights(*args)
  got = pk.replay_kernel.output_weights_kernel(*args, interpret=True,
                                               **launch)
  rows = (counts != L - 1) if launch.get("skip_flush") else np.ones(b, bool)
  for name, w, v in zip(("k", "decay", "dt'"), want, got):
    testing.assert_close(np.asarray(v)[rows], np.asarray(w)[rows],
                         testing.tolerance(jnp.float32), name)
  _lower_for_cuda(
      lambda *a: pk.replay_kernel.output_weights_kernel(
          *a, dt_softplus=True, **launch), *args[:-1])


def test_default_flush_route_picks_mosaic_where_measured_faster():
  """ReplayConfig(flush_route=None) resolves to the persistent Mosaic flush
  only for a plain f32 checkpoint at batch >= 128 with a bf16 B buffer of a
  multiple of 16 tokens on a Hopper-or-later GPU with no Triton flush field
  set; everything else (and interpret mode) keeps the Triton flush."""
  resolve = pk.replay_kernel.default_flush_route
  sds = jax.ShapeDtypeStruct

  def state(batch=256, ckpt=jnp.float32, L=16, b_dtype=jnp.bfloat16,
            dims=(8, 64, 128, 2)):
    h, p, n, g = dims
    return rs.ReplayState(
        checkpoint=sds((batch, h, p, n), ckpt),
        x_buf=sds((batch, L, h, p), jnp.bfloat16),
        b_buf=sds((batch, L, g, n), b_dtype),
        dt_buf=sds((batch, L, h), jnp.float32),
        count=sds((batch,), jnp.int32))

  def route(config=pk.ReplayConfig(), rstate=None, plain=True,
            interpret=False, cc=(9, 0)):
    return resolve(config, rstate or state(), plain, interpret, cc)

  mosaic = route()
  for field, value in pk.replay_kernel.MOSAIC_FLUSH_DEFAULT.items():
    assert getattr(mosaic, field) == value, field
  assert route(rstate=state(batch=128)).flush_route == "mosaic_gpu"
  for kw in (dict(rstate=state(batch=64)), dict(rstate=state(batch=144)),
             dict(rstate=state(ckpt=jnp.float16)),
             dict(rstate=state(L=8)), dict(rstate=state(b_dtype=jnp.float32)),
             dict(rstate=state(dims=(8, 32, 128, 2))),  # headdim not 64k
             dict(plain=False), dict(interpret=True), dict(cc=(8, 0)),
             dict(config=pk.ReplayConfig(flush_num_warps=2)),
             dict(config=pk.ReplayConfig(flush_grid="persistent")),
             dict(config=pk.ReplayConfig(output_route="mosaic_gpu"))):
    got = route(**kw)
    assert got.flush_route == "triton", kw
    assert not got.flush_store_from_input, kw
  explicit = pk.ReplayConfig(flush_route="triton")
  assert route(config=explicit) is explicit
  # On this CPU (no compute capability) the device's own never picks Mosaic.
  assert resolve(pk.ReplayConfig(), state(), True, False).flush_route == (
      "triton")
