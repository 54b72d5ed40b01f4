"""The Pallas kernels lowered for CUDA on this CPU machine (jax.export
cross-lowering: every pallas_call goes through the Pallas Triton or Mosaic
GPU lowering, which interpret mode skips), the launch parameters read from
the lowered calls, and what only lowering refuses."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import testing
from tests.kernel_harness import launched_warps as _launched_warps
from tests.kernel_harness import lower_for_cuda as _lower_for_cuda
from tests.kernel_harness import lower_replay as _lower_replay
from tests.kernel_harness import lowering_state as _lowering_state

LOWERING_REPLAY_CONFIGS = [
    pk.ReplayConfig(),
    pk.ReplayConfig(flush_fold="rank1"),
    pk.ReplayConfig(flush_grid="rows", heads_per_program=2),
    pk.ReplayConfig(fused_launch=True),
    pk.ReplayConfig(fused_launch=False),
    pk.ReplayConfig(fused_launch=False, flush_num_warps=8, num_stages=3),
    pk.ReplayConfig(flush_fold="dot_bf16x3"),
    pk.ReplayConfig(fused_launch=False, max_registers=96),
    pk.ReplayConfig(flush_grid="rows", fused_launch=True),
    pk.ReplayConfig(output_route="split"),
]


# (config, precision policy): every config with the plain state (None);
# bf16 / int8 read copies, fp8 loads and stores with an f16 master, and
# stochastic rounding of a copy, of both stores and of a master without a
# copy, on the default config and on the rows flush grid.
_ROWS_CONFIG = pk.ReplayConfig(flush_grid="rows", heads_per_program=2,
                               flush_fold="rank1")
LOWERING_CASES = [(c, None) for c in LOWERING_REPLAY_CONFIGS] + [
    (LOWERING_REPLAY_CONFIGS[0], name) for name in (
        "f32+bf16", "f32+int8", "f16+fp8+sr", "f32+int8+sr", "bf16+sr",
        "f16+sr:hash32")] + [
    (_ROWS_CONFIG, "f32+int8"), (_ROWS_CONFIG, "f16+fp8+sr"),
    (LOWERING_REPLAY_CONFIGS[5], "f32+fp8+sr"),
    (LOWERING_REPLAY_CONFIGS[7], "f16+fp8"),
    (LOWERING_REPLAY_CONFIGS[-1], "f32+int8"),
    (LOWERING_REPLAY_CONFIGS[-1], "f16+fp8")]


@pytest.mark.parametrize("config,policy", LOWERING_CASES, ids=str)
@pytest.mark.parametrize("batch,buffer_len", [(6, 16), (1, 4)])
def test_kernels_lower_to_triton(config, batch, buffer_len, policy):
  """Every kernel, tuning field and precision policy lowers for the GPU
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


def test_replay_fused_launch_warps():
  """The fused launch (both routes in one kernel) keeps 4 warps on a
  16-bit checkpoint by default: its flush route shares the register
  budget, and 2 warps were never measured there."""
  params, tok, rstate, pol = _lowering_state(1, 16, None, (4, 64, 128, 2))
  text = _lower_replay(pk.ReplayConfig(fused_launch=True), params, tok,
                       rstate, pol)
  assert _launched_warps(text) == {"replayssm_replay_fused_routes": 4}


@pytest.mark.parametrize("ckpt_dtype,variant,batch", [
    ("float32", {}, 32), ("float16", {}, 32),
    ("float32", dict(flush_grid="rows"), 32),
    ("float16", dict(flush_grid="rows", flush_fold="rank1"), 32),
    # The counters reach SMEM in TMA copies of <= 256 elements (one copy
    # of 512 does not lower).
    ("float32", dict(flush_grid="persistent"), 512)],
    ids=str)
def test_mosaic_flush_route_lowers_for_cuda_in_place(ckpt_dtype, variant,
                                                     batch):
  """ReplayConfig(flush_route="mosaic_gpu") lowers for CUDA at GPU shapes
  (register layouts, swizzled tiles, the TMA pipeline, WGMMA: interpret
  mode checks none of these), the tile stored from its input slot, on the
  persistent and the rows grid, and the Mosaic call aliases the
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


def test_mosaic_flush_refusals_at_lowering():
  """The persistent Mosaic flush needs whole 128-byte counter granules, its
  WGMMA fold a multiple of 16 tokens, and a plain state."""
  with pytest.raises(NotImplementedError, match="multiple of 128 bytes"):
    _lower_replay(pk.ReplayConfig(flush_route="mosaic_gpu",
                                  flush_grid="persistent"),
                  *_lowering_state(6, 16, None, (4, 64, 128, 2))[:3], None)
  with pytest.raises(NotImplementedError, match="buffer_len a multiple of 16"):
    _lower_replay(pk.ReplayConfig(flush_route="mosaic_gpu",
                                  flush_fold="dot_bf16x3"),
                  *_lowering_state(2, 4, None, (4, 64, 128, 2))[:3], None)
  params, tok, rstate, pol = _lowering_state(2, 4, "f32+int8",
                                             (4, 16, 16, 2))
  with pytest.raises(NotImplementedError, match="plain states only"):
    rs.replay_state_update(rstate, **tok, **params, dt_softplus=True,
                           policy=pol, implementation="pallas",
                           config=pk.ReplayConfig(flush_route="mosaic_gpu"))
