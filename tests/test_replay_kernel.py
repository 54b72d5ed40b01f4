"""The replay step's Pallas kernels (interpret mode on CPU) against the
reference.

* Multi-step decodes of the shared case list (`cases.REPLAY_CASES`, those
  whose shapes the Triton kernels take: power-of-two headdim, dstate, L) with
  implementation="pallas" vs the baseline, the same checks as
  tests/test_replay.py: outputs, materialized state, and the checkpoint
  written exactly on flush steps.
* Single steps vs the reference for every route and tuning field, with a
  batch mixing flush and non-flush rows: the checkpoint of a non-flush row
  and the stale buffer slots stay bit-identical, fresh outputs start as NaN
  in interpret mode (pallas' uninitialized value), so an element the kernel
  forgets to write fails the comparison.
* The dispatcher: None picks the reference off-GPU, a named implementation
  never falls back, a kernel that cannot take the shapes says why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import testing
from tests import cases as C
from tests import harness
from tests.kernel_harness import DIMS, check_step, mixed_state


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

REPLAY_CONFIGS = [
    pk.ReplayConfig(),  # fused launch at this batch (default_fused_launch)
    pk.ReplayConfig(block_p=4, heads_per_program=2, fused_launch=False),
    pk.ReplayConfig(block_p=8, heads_per_program=4, fused_launch=False),
    # The rows flush grid, two heads per program of each route.
    pk.ReplayConfig(flush_grid="rows", heads_per_program=2,
                    fused_launch=False),
    # The persistent flush grid (8 programs in interpret mode) with more
    # items than programs: each program loops over several.
    pk.ReplayConfig(block_p=4, flush_grid="persistent", fused_launch=False),
    # Both routes in one launch (flush programs first, then output items).
    pk.ReplayConfig(block_p=4, heads_per_program=2, fused_launch=True),
    # The state read out by its own kernel, the rest of y, the appends and
    # the counters by a (group, row) kernel.
    pk.ReplayConfig(output_route="split"),
    pk.ReplayConfig(output_route="split", block_p=8, flush_fold="rank1",
                    flush_grid="rows"),
    # One launch on the output grid: flush rows' programs fold their tiles.
    pk.ReplayConfig(flush_grid="rows", fused_launch=True),
    pk.ReplayConfig(block_p=8, heads_per_program=2, flush_grid="rows",
                    flush_fold="rank1", fused_launch=True),
    # The flush rows folded by the Mosaic GPU kernel (mosaic_flush.flush).
    pk.ReplayConfig(flush_route="mosaic_gpu"),
    pk.ReplayConfig(block_p=8, flush_route="mosaic_gpu", flush_grid="rows",
                    num_stages=2),
    # Launch fields (warps, stages, register caps: no effect in interpret
    # mode beyond being accepted).
    pk.ReplayConfig(num_warps=2, num_stages=2, flush_num_warps=8,
                    flush_max_registers=128, max_registers=96,
                    fused_launch=False),
]

# Each config on two of the four (state dtype, L) pairs, in rotation: every
# pair meets half the configs (interpret mode compiles each case apart).
_STEP_STATES = [("float32", 4), ("float16", 8), ("bfloat16", 2),
                ("float32", 1)]


@pytest.mark.parametrize("config,ckpt_dtype,buffer_len", [
    (c,) + _STEP_STATES[(i + k) % len(_STEP_STATES)]
    for i, c in enumerate(REPLAY_CONFIGS) for k in (0, 1)], ids=str)
def test_replay_kernel_step(config, ckpt_dtype, buffer_len):
  params, tok, rstate, counts = mixed_state(ckpt_dtype, buffer_len, 11)
  check_step(rstate, counts, buffer_len, ckpt_dtype, config, **tok,
             **params, dt_softplus=True)


@pytest.mark.parametrize("fused", [False, True])
def test_replay_kernel_step_every_row_flushes(fused):
  """A step where every row flushes: the persistent flush programs share out
  every row's items (`replay.persistent_items`), here 8 programs looping
  over 80 items."""
  params, tok, rstate, counts = mixed_state("float32", 4, 23,
                                            flush_rows=range(DIMS.batch))
  assert (counts == 3).all()
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(block_p=8, flush_grid="persistent",
                             fused_launch=fused))
  tol = testing.tolerance("bfloat16", "float32")
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(r.checkpoint, r_ref.checkpoint, tol, "checkpoint")
  np.testing.assert_array_equal(r.count, r_ref.count)


def test_replay_kernel_jitted_in_a_loop_compiles_once():
  params, tok, rstate, _ = mixed_state("float32", 4, 21)
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


def test_replay_kernel_out_of_range_count_under_jit():
  """Under jit counts cannot be checked: the kernel must neither write out of
  bounds nor resume silently. Bad rows output NaN, keep their count and
  leave their buffers and checkpoint untouched; other rows are unaffected."""
  L = 4
  # Every row's slots 0..L-2 filled, so the good rows' counts read no stale
  # (poisoned) slot.
  params, tok, rstate, _ = mixed_state("float32", L, 61,
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
def test_replay_kernel_dot_fold(grid, fused):
  """The 3xTF32 tensor-core fold (exact f32 in interpret mode) equals the
  reference on flush rows (in a flush launch of its own and, fused, on the
  output route's programs) and refuses tiles smaller than Triton's dot."""
  params, tok, rstate, _ = mixed_state("float32", 16, 71)
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(block_p=16, flush_fold="dot_tf32x3",
                             flush_grid=grid, fused_launch=fused))
  tol = testing.tolerance("bfloat16")  # bf16 buffers
  testing.assert_close(y, y_ref, tol, "y")
  testing.assert_close(r.checkpoint, r_ref.checkpoint, tol, "checkpoint")
  np.testing.assert_array_equal(r.count, r_ref.count)
  with pytest.raises(NotImplementedError, match="block_p >= 16"):
    rs.replay_state_update(rstate, **kw, implementation="pallas",
                           config=pk.ReplayConfig(block_p=8,
                                                  flush_fold="dot_tf32x3"))
  with pytest.raises(ValueError, match="flush_fold must be one of"):
    pk.ReplayConfig(flush_fold="dot_f32")


# Pieces of the bf16 split fold -> its error bound against the exact f32
# dot on the f32 checkpoint, relative to the largest |element|. Interpret
# mode runs the bf16 dots exactly, so this is the split's truncation (the
# remainder of X = s x after K 8-bit pieces, ~2^-8K of X) plus f32 rounding;
# measured on this case: 5.8e-8 (x3), 2.8e-6 (x2).
_BF16_FOLD_RTOL = {"dot_bf16x3": 5e-7, "dot_bf16x2": 2e-5}


def test_replay_kernel_bf16_fold():
  """The bf16-split folds (bf16 B, weighted x in 3 / 2 bf16 pieces) equal
  the exact f32 dot fold (3xTF32 runs exactly in interpret mode) to the
  split's precision and the reference to the usual tolerance; they refuse
  B that bf16 does not hold exactly."""
  params, tok, rstate, _ = mixed_state("float32", 16, 71)
  tok = jax.tree.map(lambda v: v.astype(jnp.bfloat16), tok)
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")

  def run(f):
    return rs.replay_state_update(
        rstate, **kw, implementation="pallas",
        config=pk.ReplayConfig(block_p=16, flush_fold=f))

  _, r32 = run("dot_tf32x3")
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
  kw["B"] = kw["B"].astype(jnp.float32)
  with pytest.raises(NotImplementedError, match="needs bf16 B"):
    run("dot_bf16x3")


def test_config_fields_are_checked():
  for field, bad, match in (
      ("output_route", "mosaic_gpu", "output_route must be one of"),
      ("flush_route", "cuda", "flush_route must be one of"),
      ("flush_grid", "all", "flush_grid must be one of"),
      ("num_warps", 3, "num_warps must be a power of two"),
      ("flush_num_warps", 3, "flush_num_warps must be a power of two"),
      ("block_p", 3, "block_p must be a power of two"),
      ("heads_per_program", 0, "heads_per_program"),
      ("num_stages", 0, "num_stages"),
      ("fused_launch", "yes", "fused_launch must be None or a bool")):
    with pytest.raises(ValueError, match=match):
      pk.ReplayConfig(**{field: bad})
  for bad in (100, 16, 264, 128.0):
    for field in ("flush_max_registers", "max_registers"):
      with pytest.raises(ValueError, match=f"{field} must be None or a "
                         "multiple of 8"):
        pk.ReplayConfig(**{field: bad})
  with pytest.raises(ValueError, match="num_warps must be a power of two"):
    pk.SSUConfig(num_warps=None)


def test_fields_that_do_not_apply_are_refused_by_name():
  """A field the resolved routes do not use is refused, naming it and how
  to take the route it configures; other fields never change a route."""
  params, tok, rstate, _ = mixed_state("float32", 4, 77)
  kw = dict(**tok, **params, implementation="pallas")
  for config, match in (
      # fused by default at this batch: one kernel, no flush launch
      (pk.ReplayConfig(flush_num_warps=2), r"flush_num_warps do.*fused"),
      (pk.ReplayConfig(flush_max_registers=128), "flush_max_registers"),
      (pk.ReplayConfig(flush_route="mosaic_gpu", fused_launch=False,
                       flush_num_warps=4), "Mosaic GPU flush"),
      (pk.ReplayConfig(output_route="split", heads_per_program=2),
       "reads one head per program"),
      (pk.ReplayConfig(output_route="split", fused_launch=True),
       "fused_launch=True does not support output_route='split'"),
      (pk.ReplayConfig(flush_route="mosaic_gpu", fused_launch=True),
       "fused_launch=True does not support flush_route='mosaic_gpu'"),
      (pk.ReplayConfig(flush_route="mosaic_gpu", output_route="split"),
       "needs output_route='triton'"),
      (pk.ReplayConfig(flush_route="mosaic_gpu", flush_fold="dot_tf32x3"),
       "folds by"),
      (pk.ReplayConfig(heads_per_program=3, fused_launch=False),
       r"heads_per_program \(3\) must divide")):
    with pytest.raises(NotImplementedError, match=match):
      rs.replay_state_update(rstate, **kw, config=config)


def test_config_for_the_reference_is_refused():
  params, tok, rstate, _ = mixed_state("float32", 4, 81)
  with pytest.raises(ValueError, match="'reference' takes no config"):
    rs.replay_state_update(rstate, **tok, **params,
                           implementation="reference",
                           config=pk.ReplayConfig())


# ------------------------------------------------------------- dispatcher

def test_dispatcher_lists_and_picks():
  assert rs.implementations("replay_state_update")[0] == "pallas"
  assert "reference" in rs.implementations("selective_state_update")
  params, tok, rstate, _ = mixed_state("float32", 4, 31)
  kw = dict(**tok, **params, dt_softplus=True)
  y_auto, _ = rs.replay_state_update(rstate, **kw)
  y_ref, _ = rs.replay_state_update(rstate, **kw, implementation="reference")
  # Off-GPU, None must not pick the (slow) interpret-mode kernel.
  assert not pk.on_gpu()
  np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_ref))


def test_dispatcher_errors():
  params, tok, rstate, _ = mixed_state("float32", 4, 41)
  kw = dict(**tok, **params, dt_softplus=True)
  with pytest.raises(ValueError, match="implementation must be None or one"):
    rs.replay_state_update(rstate, **kw, implementation="triton")
  with pytest.raises(ValueError, match="config can only be given"):
    rs.replay_state_update(rstate, **kw, config=pk.ReplayConfig())
  # buffer_len 3 is not a power of two: the kernel says why, no fallback.
  params3, tok3, rstate3, _ = mixed_state("float32", 3, 51)
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


# ------------------------------------------------ the Mosaic GPU flush route

@pytest.mark.parametrize("ckpt_dtype,fold", [
    ("float32", None), ("float16", None), ("float32", "dot_bf16x2"),
    ("bfloat16", "rank1")], ids=str)
def test_mosaic_flush_folds_at_16_tokens(ckpt_dtype, fold):
  """The Mosaic flush's WGMMA fold (buffer_len 16: bf16 pieces of the
  weighted x against the B buffer; the default there) and its rank-1 fold
  against the reference, interpret mode, flush and non-flush rows mixed."""
  params, tok, rstate, counts = mixed_state(ckpt_dtype, 16, 31,
                                            flush_rows=(0, 3))
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(
      rstate, **kw, implementation="pallas",
      config=pk.ReplayConfig(flush_route="mosaic_gpu", flush_fold=fold))
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
  """The persistent Mosaic flush's work split (`mosaic_flush.cta_tiles`,
  the same code the kernel runs on its SMEM counters): over all CTAs, every
  flush row's every head exactly once and no other row, the CTAs' shares
  within one chunk of each other."""
  from pallas_kernels.replay import mosaic_flush  # pylint: disable=g-import-not-at-top
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
    steps, chunk_row, head = mosaic_flush.cta_tiles(
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
