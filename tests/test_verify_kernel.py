"""The speculative verify kernels' planning and GPU lowering (no GPU here).

* `verify.plan_verify`: the defaults a state gets, each field filled on its
  own (setting a field to its planned value, or any field to another
  value, leaves every other field as planned), and the combinations the
  kernels cannot run refused by name;
* every config and precision policy lowers to Triton for CUDA, launching
  the planned warps.

The kernels' results against the reference (interpret mode) are in
tests/test_speculative.py, their poisoned-input checks in
tests/test_poisoned_inputs.py.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import verify as verify_kernel
from replayssm_jax.state import ReplayState
from tests import kernel_harness

SDS = jax.ShapeDtypeStruct
H, HEADDIM, DSTATE, G, L, T = 32, 64, 128, 2, 16, 4


def _abstract_state(batch, ckpt, copy=None, buffer_len=L,
                    buffer_dtype=jnp.bfloat16):
  """A ReplayState of ShapeDtypeStructs (the plan reads shapes and dtypes
  only): bf16 buffers, an optional read copy (8-bit ones with scales)."""
  fields = {}
  if copy is not None:
    fields = dict(read_copy=SDS((batch, H, HEADDIM, DSTATE), copy),
                  read_scale=SDS((batch, H, HEADDIM), jnp.float32)
                  if jnp.dtype(copy).itemsize == 1 else None)
  return ReplayState(
      checkpoint=SDS((batch, H, HEADDIM, DSTATE), ckpt),
      x_buf=SDS((batch, buffer_len, H, HEADDIM), buffer_dtype),
      b_buf=SDS((batch, buffer_len, G, DSTATE), buffer_dtype),
      dt_buf=SDS((batch, buffer_len, H), jnp.float32),
      count=SDS((batch,), jnp.int32), **fields)


@pytest.fixture
def h200(monkeypatch):
  """jax.devices() as one H200 (132 SMs) while planning."""
  monkeypatch.setattr(jax, "devices",
                      lambda *_: [types.SimpleNamespace(core_count=132)])


F32, F16, FP8 = jnp.float32, jnp.float16, jnp.float8_e4m3fn
# (state, the plan's block_p and fold): the choices of the kernels'
# measured defaults (benchmarks/kernel_tuning/verify_window_kernel_h200.json), batch 1 / 64 / 256.
DEFAULT_CASES = {
    "f32-b1": ((1, F32), 16, "dot_bf16x3"),
    "f16-b1": ((1, F16), 16, "dot_bf16x2"),
    "f32-b64": ((64, F32), 16, "dot_bf16x3"),
    "f16+fp8-b64": ((64, F16, FP8), 16, "dot_bf16x2"),
    "f32-b256": ((256, F32), 32, "dot_bf16x3"),
    "f16-b256": ((256, F16), 32, "dot_bf16x2"),
    "f32+fp8-b256": ((256, F32, FP8), 32, "dot_bf16x3"),
    "f16+fp8-b256": ((256, F16, FP8), 32, "dot_bf16x2"),
    "f32+bf16-b256": ((256, F32, jnp.bfloat16), 32, "dot_bf16x3"),
}


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_default_plans(h200, name, interpret):
  """VerifyConfig() plans the kernels' measured defaults: block_p 32 once
  the grid is large, 16 below; the bf16 dot fold (three pieces on an f32
  master, two on a 16-bit one); 4 window warps and 2 fold warps; 32-column
  readout blocks; 4 fold programs per SM (8 in interpret mode, which also
  runs the multiply-adds as plain ops)."""
  args, block_p, fold = DEFAULT_CASES[name]
  plan = verify_kernel.plan_verify(pk.VerifyConfig(), _abstract_state(*args),
                                   interpret)
  assert plan == verify_kernel.VerifyPlan(
      block_p=block_p, num_warps=4, num_stages=1, fold=fold,
      fold_num_warps=2, readout_chunk=32,
      fold_programs=8 if interpret else 4 * 132, fma=not interpret)


def test_default_plans_off_the_dot_tiles(h200):
  """Below 16 buffer slots the fold is rank-1; with an f32 B buffer (no
  bf16 split) it is 3xTF32; dstate below 32 reads each row in one block."""
  plan = verify_kernel.plan_verify
  state = _abstract_state(256, F32, buffer_len=8)
  assert plan(pk.VerifyConfig(), state, False).fold == "rank1"
  state = _abstract_state(256, F32, buffer_dtype=F32)
  assert plan(pk.VerifyConfig(), state, False).fold == "dot_tf32x3"
  assert plan(pk.VerifyConfig(), state, True).fold == "dot_tf32x3"
  state = ReplayState(
      checkpoint=SDS((4, 4, 16, 16), F16), x_buf=SDS((4, L, 4, 16), F16),
      b_buf=SDS((4, L, 2, 16), F16), dt_buf=SDS((4, L, 4), F32),
      count=SDS((4,), jnp.int32))
  assert plan(pk.VerifyConfig(), state, False).readout_chunk == 16


def test_fold_programs_follow_the_device(monkeypatch):
  """4 fold programs per SM of the device the plan sees."""
  monkeypatch.setattr(jax, "devices",
                      lambda *_: [types.SimpleNamespace(core_count=78)])
  plan = verify_kernel.plan_verify(pk.VerifyConfig(),
                                   _abstract_state(256, F32), False)
  assert plan.fold_programs == 4 * 78


# One non-default value per field (each legal on the DEFAULT_CASES states).
OTHER_VALUES = dict(block_p=16, num_warps=8, num_stages=2, fold="rank1",
                    fold_num_warps=4, readout_chunk=16)


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_plan_fields_are_independent(h200, name, interpret):
  """Setting any one field to its planned value plans the same; setting it
  to another value changes that field of the plan only."""
  assert set(OTHER_VALUES) == {
      f.name for f in dataclasses.fields(pk.VerifyConfig)}
  state = _abstract_state(*DEFAULT_CASES[name][0])
  plan = lambda config: verify_kernel.plan_verify(  # noqa: E731
      config, state, interpret)
  base = plan(pk.VerifyConfig())
  for field, other in OTHER_VALUES.items():
    same = plan(pk.VerifyConfig(**{field: getattr(base, field)}))
    assert same == base, field
    changed = plan(pk.VerifyConfig(**{field: other}))
    assert changed == dataclasses.replace(base, **{field: other}), field


def test_impossible_configs_are_refused():
  """Field values the kernels do not take, and explicit folds the state
  cannot run, raise naming the field."""
  for field, bad in dict(block_p=24, num_warps=3, fold_num_warps=3,
                         readout_chunk=24, num_stages=0,
                         fold="dot_f32").items():
    with pytest.raises(ValueError, match=field):
      pk.VerifyConfig(**{field: bad})
  plan = verify_kernel.plan_verify
  with pytest.raises(NotImplementedError,
                     match=r"config.fold='dot_bf16x3' needs buffer_len and "
                     r"block_p >= 16"):
    plan(pk.VerifyConfig(fold="dot_bf16x3", block_p=8),
         _abstract_state(256, F32), True)
  with pytest.raises(NotImplementedError, match="needs bf16 B"):
    plan(pk.VerifyConfig(fold="dot_bf16x2"),
         _abstract_state(256, F16, buffer_dtype=F16), True)
  with pytest.raises(NotImplementedError,
                     match=r"block_p \(64\) must divide headdim"):
    plan(pk.VerifyConfig(block_p=64), _abstract_state(256, F32).replace(
        checkpoint=SDS((256, H, 96, DSTATE), F32)), True)


# ------------------------------------------------- GPU lowering (no GPU here)
def _lowering_case(batch, buffer_len, policy, dims=(4, 16, 16, 2)):
  """`kernel_harness.lowering_state` with its token as a T 2 window."""
  params, tok, rstate, pol = kernel_harness.lowering_state(
      batch, buffer_len, policy, dims)
  win = jax.tree.map(lambda v: jnp.stack([v, v], axis=1), tok)
  return params, win, rstate, pol


def _lower_verify(params, win, rstate, pol, config):
  return kernel_harness.lower_for_cuda(
      lambda r, t, layer: verify_kernel.replay_verify(
          r, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"],
          D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True,
          policy=pol, layer=layer, config=config),
      rstate, win, jnp.int32(2))  # a traced layer (a scan over layers)


@pytest.mark.parametrize("batch,buffer_len", [(6, 16), (1, 4)])
def test_verify_kernels_lower_to_triton(batch, buffer_len):
  """The fold (dot and rank-1) and window kernels lower for the GPU; the
  readouts' multiply-adds are PTX fma where a row spans several column
  blocks (dstate 16: one block by default, two at 8 columns)."""
  params, win, rstate, pol = _lowering_case(batch, buffer_len, None)
  configs = [pk.VerifyConfig(), pk.VerifyConfig(fold="rank1"),
             pk.VerifyConfig(readout_chunk=16),
             pk.VerifyConfig(readout_chunk=8)]
  if buffer_len >= 16:  # a dot fold needs L >= 16
    configs += [pk.VerifyConfig(fold="dot_tf32x3"),
                pk.VerifyConfig(fold="dot_bf16x3")]
  for config in configs:
    text = _lower_verify(params, win, rstate, pol, config)
    assert ("fma.rn.f32" in text) == (config.readout_chunk == 8), config


@pytest.mark.parametrize("policy", ["f32+bf16", "f32+int8", "f16+fp8+sr",
                                    "f32+int8+sr", "bf16+sr",
                                    "f16+sr:hash32"])
def test_verify_kernels_lower_to_triton_with_policies(policy):
  """Under a precision policy: copy stores in the fold, the window
  kernel's masked master / copy loads."""
  params, win, rstate, pol = _lowering_case(6, 16, policy)
  for config in (pk.VerifyConfig(), pk.VerifyConfig(readout_chunk=8)):
    _lower_verify(params, win, rstate, pol, config)


@pytest.mark.parametrize("config,warps", [
    (pk.VerifyConfig(), (2, 4)),
    (pk.VerifyConfig(fold_num_warps=4), (4, 4)),
    (pk.VerifyConfig(num_warps=8, fold_num_warps=1), (1, 8))])
def test_verify_launch_warps(config, warps):
  """The fold kernel launches 2 warps by default; fold_num_warps sets
  them, num_warps the window kernel's."""
  params, win, rstate, pol = _lowering_case(6, 16, None, (4, 64, 128, 2))
  text = _lower_verify(params, win, rstate, pol, config)
  assert kernel_harness.launched_warps(text) == {"replayssm_verify_fold": warps[0],
                                   "replayssm_verify_window": warps[1]}
