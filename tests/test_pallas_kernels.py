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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
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
    pk.ReplayConfig(),
    pk.ReplayConfig(block_p=4, heads_per_program=2),
    pk.ReplayConfig(block_p=8, heads_per_program=4, precompute_bc=True),
    pk.ReplayConfig(block_p=16, output_all_rows=True),
    pk.ReplayConfig(block_p=8, heads_per_program=2, precompute_bc=True,
                    output_all_rows=True),
    pk.ReplayConfig(block_p=16, flush_block_p=4, flush_unroll=False),
    pk.ReplayConfig(flush_grid="rows"),
    # Fewer programs than work items: each program loops over several.
    pk.ReplayConfig(block_p=4, flush_block_p=8, flush_grid="persistent",
                    flush_programs=3),
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


@pytest.mark.parametrize("config,state_dtype,options", SSU_CASES, ids=str)
def test_baseline_kernel_step(config, state_dtype, options):
  with_D, with_z, with_bias = options
  params, tok = _step_inputs(7, with_D=with_D, with_z=with_z,
                             with_dt_bias=with_bias)
  state = harness.random_state(jax.random.PRNGKey(3), DIMS,
                               jnp.dtype(state_dtype))
  state_before = np.asarray(state)
  kw = dict(**tok, **params, dt_softplus=with_bias)
  y_ref, s_ref = rs.selective_state_update(state, **kw,
                                           implementation="reference")
  y, s = rs.selective_state_update(state, **kw, implementation="pallas",
                                   config=config)
  tol = testing.tolerance(state_dtype)
  testing.assert_close(y, y_ref, testing.TOLERANCES["float32"], "y")
  assert s.dtype == s_ref.dtype
  testing.assert_close(s, s_ref, tol, "state")
  np.testing.assert_array_equal(np.asarray(state), state_before)  # no mutation


def _mixed_state(ckpt_dtype, buffer_len, seed):
  """A ragged state whose rows include both flush (count L-1) and
  non-flush rows."""
  d = DIMS
  counts = np.array(C.ragged_counts(d.batch, buffer_len))
  counts[1] = buffer_len - 1  # a flush row
  params, tok = _step_inputs(seed)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(seed + 1), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.dtype(ckpt_dtype), buffer_dtype=jnp.bfloat16)
  return params, tok, rstate, counts


@pytest.mark.parametrize("config", REPLAY_CONFIGS, ids=str)
@pytest.mark.parametrize("ckpt_dtype,buffer_len",
                         [("float32", 4), ("float16", 8), ("bfloat16", 2),
                          ("float32", 1)])
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
  # every other slot is bit-identical to the input.
  for name in ("x_buf", "b_buf", "dt_buf"):
    new, ref, old = (np.asarray(getattr(s, name)) for s in (r, r_ref, rstate))
    for row in range(DIMS.batch):
      for slot in range(buffer_len):
        if slot == counts[row] and not flush[row]:
          np.testing.assert_array_equal(new[row, slot], ref[row, slot],
                                        err_msg=f"{name} appended slot")
        else:
          np.testing.assert_array_equal(
              harness.bits(new[row, slot]), harness.bits(old[row, slot]),
              err_msg=f"{name}[{row}, {slot}] was written")


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
  params, tok, rstate, _ = _mixed_state("float32", L, 61)
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


@pytest.mark.parametrize("grid", ["rows", "persistent"])
@pytest.mark.parametrize("fold", ["dot_tf32x3", "dot_f32"])
def test_replay_kernel_dot_fold(fold, grid):
  """The tensor-core fold variants (exact f32 in interpret mode) equal the
  reference on flush rows and refuse tiles smaller than Triton's dot."""
  params, tok, rstate, counts = _mixed_state("float32", 16, 71)
  kw = dict(**tok, **params, dt_softplus=True)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(rstate, **kw, implementation="pallas",
                                config=pk.ReplayConfig(block_p=16,
                                                       flush_fold=fold,
                                                       flush_grid=grid))
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


def test_config_for_the_reference_is_refused():
  params, tok, rstate, _ = _mixed_state("float32", 4, 81)
  with pytest.raises(ValueError, match="'reference' takes no config"):
    rs.replay_state_update(rstate, **tok, **params,
                           implementation="reference",
                           config=pk.ReplayConfig())


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
                    precompute_bc=True, output_all_rows=True),
]


@pytest.mark.parametrize("config", LOWERING_REPLAY_CONFIGS, ids=str)
@pytest.mark.parametrize("batch,buffer_len", [(6, 16), (1, 4)])
def test_kernels_lower_to_triton(config, batch, buffer_len):
  """Every kernel and tuning option lowers for the GPU (found on the H200:
  a fully unrolled fori_loop and a vector slice have no Triton lowering)."""
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  from pallas_kernels import ssu as ssu_kernel  # pylint: disable=g-import-not-at-top
  from pallas_kernels import verify as verify_kernel  # pylint: disable=g-import-not-at-top
  h, p, n, g = 4, 16, 16, 2
  key = jax.random.PRNGKey(5)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  tok = testing.random_step_inputs(key, batch, h, p, n, g, jnp.bfloat16,
                                   with_z=True)
  counts = np.arange(batch) % buffer_len
  rstate, _ = testing.random_replay_state(
      key, batch, h, p, n, g, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.float16, buffer_dtype=jnp.bfloat16)
  kw = dict(D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True)

  def replay():
    _lower_for_cuda(
        lambda r, t: replay_kernel.replay_state_update(
            r, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"], **kw,
            config=config),
        rstate, tok)

  if config.flush_fold in ("dot_f32", "dot_tf32x3") and buffer_len < 16:
    with pytest.raises(NotImplementedError, match="block_p >= 16"):
      replay()
  else:
    replay()
  if config == LOWERING_REPLAY_CONFIGS[0]:
    state = rstate.checkpoint
    _lower_for_cuda(
        lambda s, t: ssu_kernel.selective_state_update(
            s, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"], **kw),
        state, tok)
    win = jax.tree.map(lambda v: jnp.stack([v, v], axis=1), tok)  # T = 2
    if buffer_len > 2:
      _lower_for_cuda(
          lambda r, t: verify_kernel.replay_verify(
              r, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"],
              **kw),
          rstate, win)
