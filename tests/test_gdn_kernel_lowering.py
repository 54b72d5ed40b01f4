"""The GDN Pallas kernels lowered for CUDA on this CPU machine (jax.export
cross-lowering through the Pallas Triton backend, which interpret mode
skips): every state dtype, precision policy and launch field lowers (the
replay step's ring-weights launch and its two-launch form included), the
warps reach the launch, and the state / checkpoint and rings are aliased
input -> output (the in-place updates)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gdn as kg
from pallas_kernels.gdn.ring_weights import NUM_WARPS as RING_WEIGHTS_WARPS
from replayssm_jax import PrecisionPolicy
from replayssm_jax.gdn import testing as GT
from tests.kernel_harness import launched_warps, lower_for_cuda

B, HK, HV, K, VD, L = 4, 2, 4, 16, 32, 8


def _aliases(text, name):
  """{output index: operand index} of the Triton call named `name`."""
  line = next(ln for ln in text.splitlines()
              if "__gpu$xla.gpu.triton" in ln and f'name = "{name}"' in ln)
  # (a call with one output has no tuple index: output 0)
  return {int(o or 0): int(i) for o, i in re.findall(
      r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)", line)}


@pytest.mark.parametrize("state_dtype,config", [
    ("float32", kg.GDNConfig()), ("bfloat16", kg.GDNConfig(block_v=8)),
    ("float16", kg.GDNConfig(block_v=32, num_warps=8)),
    ("float32", kg.GDNConfig(heads_per_program=2, num_stages=3))], ids=str)
def test_step_kernel_lowers_in_place(state_dtype, config):
  tok = GT.random_inputs(jax.random.PRNGKey(0), B, HK, HV, K, VD,
                         dtype=jnp.bfloat16)
  state = jax.ShapeDtypeStruct((B, HV, K, VD), jnp.dtype(state_dtype))
  text = lower_for_cuda(
      lambda s, t: kg.gdn_step(s, t["q"], t["k"], t["v"], t["g"], t["beta"],
                               config=config), state, tok)
  p = kg.plan(config, K, VD, rows=B * HV)
  assert launched_warps(text) == {"replayssm_gdn_step": p.num_warps}
  assert _aliases(text, "replayssm_gdn_step") == {1: 0}  # state -> state


def _lowered_replay_step(pol, config):
  """The CUDA lowering (text) of the replay step on a ragged state stored
  per `pol` (None: f32)."""
  rstate, _ = GT.random_gdn_replay_state(
      jax.random.PRNGKey(1), B, HK, HV, K, VD, L, GT.ragged_counts(B, L),
      checkpoint_dtype=jnp.float32 if pol is None else pol.checkpoint_dtype,
      buffer_dtype=jnp.bfloat16)
  if pol is not None:
    rstate = rstate.with_policy(pol)
  tok = GT.random_inputs(jax.random.PRNGKey(2), B, HK, HV, K, VD,
                         dtype=jnp.bfloat16)
  return lower_for_cuda(
      lambda r, t: kg.gdn_replay_step(r, t["q"], t["k"], t["v"], t["g"],
                                      t["beta"], policy=pol, config=config),
      rstate, tok)


@pytest.mark.parametrize("policy,ring_weights", [
    (None, False), ("f16", False), ("f32+bf16", False), ("f32+int8", False),
    ("f32+fp8", False), ("f16+fp8+sr", False), ("bf16+sr", False),
    (None, True), ("f16", True), ("f32+fp8", True), ("f16+fp8+sr", True)],
                         ids=str)
def test_replay_kernel_lowers_in_place(policy, ring_weights):
  pol = None if policy is None else PrecisionPolicy.preset(policy)
  text = _lowered_replay_step(pol, kg.GDNConfig(ring_weights=ring_weights))
  aliases = _aliases(text, "replayssm_gdn_replay_step")
  # o and the counters are fresh; rings and checkpoint in place, and the
  # read copy (and its scales) with a copy.
  copy = pol is not None and pol.read_dtype is not None
  scaled = copy and pol.read_dtype in ("int8", "float8_e4m3fn")
  assert set(aliases) == {1, 2, 3, 5} | ({6} if copy else set()) | (
      {7} if scaled else set())
  whole_rows = copy or (pol is not None and pol.stochastic_rounding)
  warps = {"replayssm_gdn_replay_step": kg.plan(None, K, VD, whole_rows,
                                                rows=B * HV).num_warps}
  if ring_weights:  # the weights launch writes fresh outputs only
    warps["replayssm_gdn_ring_weights"] = RING_WEIGHTS_WARPS
    assert not _aliases(text, "replayssm_gdn_ring_weights")
  assert launched_warps(text) == warps


@pytest.mark.parametrize("policy,heads_per_program", [
    (None, None), ("f32+int8", None), ("f16+fp8+sr", None), (None, 2),
    ("f32+int8", 4)], ids=str)
def test_replay_kernel_split_routes_lower_in_place(policy, heads_per_program):
  """`GDNConfig(split_routes=True)`: the output launch appends to the rings
  in place and leaves the checkpoint (and copy) aliased; the flush launch
  stores into all of them and into the output launch's o and counters
  (its last two operands). With heads_per_program the output launch's
  head loop lowers, pipelined over 3 stages."""
  pol = None if policy is None else PrecisionPolicy.preset(policy)
  text = _lowered_replay_step(pol, kg.GDNConfig(
      split_routes=True, heads_per_program=heads_per_program,
      num_stages=3 if heads_per_program else None))
  n_copy = 0 if pol is None or pol.read_dtype is None else (
      2 if pol.read_dtype in ("int8", "float8_e4m3fn") else 1)
  out = _aliases(text, "replayssm_gdn_replay_output")
  flush = _aliases(text, "replayssm_gdn_replay_flush")
  state = {1, 2, 3, 5} | set(range(6, 6 + n_copy))
  assert set(out) == state
  assert set(flush) == state | {0, 4}
  n_ops = max(flush.values()) + 1
  assert (flush[0], flush[4]) == (n_ops - 2, n_ops - 1)
  assert set(launched_warps(text)) == {"replayssm_gdn_replay_output",
                                       "replayssm_gdn_replay_flush"}


@pytest.mark.parametrize("policy", [None, "f32+fp8"], ids=str)
def test_flush_num_warps_reach_the_flush_launch(policy):
  # Under split routes flush_num_warps sets the flush launch's warps and
  # leaves the output launch's as they were; one launch refuses it.
  pol = None if policy is None else PrecisionPolicy.preset(policy)
  base = launched_warps(_lowered_replay_step(pol, kg.GDNConfig(
      split_routes=True)))
  text = _lowered_replay_step(pol, kg.GDNConfig(split_routes=True,
                                                flush_num_warps=8))
  assert launched_warps(text) == dict(base, replayssm_gdn_replay_flush=8)
  assert base["replayssm_gdn_replay_flush"] != 8
  with pytest.raises(NotImplementedError, match="flush_num_warps"):
    kg.plan(kg.GDNConfig(split_routes=False, flush_num_warps=8), K, VD,
            rows=B * HV, kernel="replay")
  with pytest.raises(NotImplementedError, match="flush_num_warps"):
    kg.plan(kg.GDNConfig(flush_num_warps=8), K, VD, kernel="verify")


def test_max_registers_caps_the_replay_launches():
  # GDNConfig.max_registers tags the replay step's launches (one, or both
  # of split routes) for a register cap (`triton_utils.capped_name`), not
  # its ring-weights launch; the other kernels refuse it by name.
  one = launched_warps(_lowered_replay_step(None, kg.GDNConfig(
      max_registers=128, ring_weights=True)))
  assert set(one) == {"replayssm_gdn_replay_step__maxnreg128",
                      "replayssm_gdn_ring_weights"}
  split = launched_warps(_lowered_replay_step(None, kg.GDNConfig(
      max_registers=120, split_routes=True)))
  assert set(split) == {"replayssm_gdn_replay_output__maxnreg120",
                        "replayssm_gdn_replay_flush__maxnreg120"}
  for kernel in ("step", "verify"):
    with pytest.raises(NotImplementedError, match="max_registers"):
      kg.plan(kg.GDNConfig(max_registers=128), K, VD, kernel=kernel)
  with pytest.raises(ValueError, match="max_registers must be"):
    kg.GDNConfig(max_registers=100)


@pytest.mark.parametrize("T,policy", [(3, None), (8, None), (1, "f16"),
                                      (4, "f32+int8"), (2, "f16+fp8+sr"),
                                      (3, "bf16+sr")], ids=str)
def test_verify_kernels_lower_in_place(T, policy):
  pol = None if policy is None else PrecisionPolicy.preset(policy)
  rstate, _ = GT.random_gdn_replay_state(
      jax.random.PRNGKey(3), B, HK, HV, K, VD, 16, (0, 15, 4, 9),
      checkpoint_dtype=jnp.float32 if pol is None else pol.checkpoint_dtype,
      buffer_dtype=jnp.bfloat16)
  if pol is not None:
    rstate = rstate.with_policy(pol)
  win = GT.random_inputs(jax.random.PRNGKey(4), B, HK, HV, K, VD, T=T,
                         dtype=jnp.bfloat16)
  text = lower_for_cuda(
      lambda r, t: kg.gdn_replay_verify(r, t["q"], t["k"], t["v"], t["g"],
                                        t["beta"], policy=pol), rstate, win)
  copy = pol is not None and pol.read_dtype is not None
  scaled = copy and pol.read_dtype in ("int8", "float8_e4m3fn")
  # The fold stores the checkpoint (and copy, scales) in place; the
  # window kernel the rings.
  assert set(_aliases(text, "replayssm_gdn_verify_fold")) == {0} | (
      {1} if copy else set()) | ({2} if scaled else set())
  assert set(_aliases(text, "replayssm_gdn_verify_window")) == {1, 2, 3}
  # The window's coefficients first (by default), writing new arrays.
  assert not _aliases(text, "replayssm_gdn_verify_weights")
  assert set(launched_warps(text)) == {"replayssm_gdn_verify_weights",
                                       "replayssm_gdn_verify_fold",
                                       "replayssm_gdn_verify_window"}
  # The fold's warps follow the plan at the checkpoint's dtype.
  whole = copy or (pol is not None and pol.stochastic_rounding)
  p = kg.plan(None, K, VD, whole_rows=whole, kernel="verify",
              state_dtype=rstate.checkpoint.dtype)
  assert launched_warps(text)["replayssm_gdn_verify_fold"] == p.num_warps


def test_default_plans():
  # The step kernels' defaults at the Qwen3.5-shaped layer the H200 sweep
  # timed (value heads 32, key_dim = value_dim = 128): [128, 64] tiles
  # with 4 warps; batch 1 (32 rows) halves the tile to keep >= 256
  # programs; whole rows (a read copy) with 4 warps. The verify kernels:
  # [128, 32] tiles with 4 warps, 2 for a 16-bit checkpoint (8 warps over
  # whole rows, whatever the dtype).
  step = lambda batch, **kw: kg.plan(None, 128, 128, rows=batch * 32, **kw)
  assert (step(1).block_v, step(1).num_warps) == (16, 4)
  assert (step(64).block_v, step(256).block_v, step(512).block_v) == (
      64, 64, 64)
  assert step(256, whole_rows=True) == kg.GDNPlan(128, 4, 1)
  # The baseline step's stages follow its state dtype.
  stages = lambda dt: kg.plan(None, 128, 128, rows=256 * 32,
                              state_dtype=dt).num_stages
  assert (stages(jnp.float32), stages(jnp.float16), stages(None)) == (3, 2, 1)
  assert kg.plan(None, 128, 128).block_v == 64  # rows unknown
  verify = lambda **kw: kg.plan(None, 128, 128, kernel="verify", **kw)
  assert (verify().block_v, verify().num_warps) == (32, 4)
  warps = lambda dt, **kw: verify(state_dtype=dt, **kw).num_warps
  assert (warps(jnp.float32), warps(jnp.float16), warps(jnp.bfloat16)) == (
      4, 2, 2)
  assert warps(jnp.float16, whole_rows=True) == 8
  # With a read copy both launches take whole rows (8 warps) by default;
  # block_v then sets the window launch's tiles (the fold's stay whole).
  assert verify(whole_rows=True) == kg.GDNPlan(128, 8, 1, ring_weights=True)
  tiled = kg.plan(kg.GDNConfig(block_v=32), 128, 128, kernel="verify",
                  whole_rows=True)
  assert (tiled.block_v, tiled.output_block_v, tiled.num_warps,
          tiled.output_num_warps) == (128, 32, 8, 4)
  # Explicit fields win over the defaults.
  mine = kg.plan(kg.GDNConfig(block_v=32, num_warps=2), 128, 128,
                 rows=256 * 32)
  assert (mine.block_v, mine.num_warps) == (32, 2)
  with pytest.raises(ValueError, match="kernel"):
    kg.plan(None, 128, 128, kernel="fold")
  # The replay step's ring-weights launch: on by default without a read
  # copy from batch x value heads 2048; the verify's coefficients launch:
  # always; the baseline step: never.
  replay = lambda rows, **kw: kg.plan(None, 128, 128, rows=rows,
                                      kernel="replay", **kw).ring_weights
  assert (replay(64 * 32), replay(256 * 32), replay(32 * 32),
          replay(256 * 32, whole_rows=True)) == (True, True, False, False)
  assert not step(256).ring_weights
  assert verify().ring_weights and verify(whole_rows=True).ring_weights
  off = kg.plan(kg.GDNConfig(ring_weights=False), 128, 128, rows=256 * 32,
                kernel="replay")
  assert not off.ring_weights
  assert kg.plan(kg.GDNConfig(ring_weights=True), 128, 128, rows=256 * 32,
                 kernel="replay") == kg.GDNPlan(64, 4, 1, ring_weights=True)
  # The replay step's two-launch form: by default for a read copy from
  # batch x value heads 2048 (its output launch in value tiles), else off.
  split = lambda rows, **kw: kg.plan(None, 128, 128, rows=rows,
                                     kernel="replay", **kw)
  assert not split(256 * 32).split_routes
  assert not split(256 * 32, whole_rows=True).split_routes  # SR, no copy
  copy = split(64 * 32, whole_rows=True, read_copy=True)
  assert (copy.split_routes, copy.block_v, copy.output_block_v) == (
      True, 128, 64)
  assert not split(32 * 32, whole_rows=True, read_copy=True).split_routes
  assert kg.plan(kg.GDNConfig(split_routes=True), 128, 128,
                 kernel="replay").split_routes
  # A state that flushes whole rows: only the flush launch takes them, the
  # output launch value tiles (its default, or block_v).
  whole = lambda **kw: kg.plan(kg.GDNConfig(split_routes=True, **kw), 128,
                               128, whole_rows=True, rows=256 * 32,
                               kernel="replay")
  assert (whole().block_v, whole().output_block_v) == (128, 64)
  assert whole(block_v=32).output_block_v == 32
  assert kg.plan(None, 128, 128, whole_rows=True, rows=256 * 32,
                 kernel="replay").output_block_v == 0  # one launch
