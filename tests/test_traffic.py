"""Tests of the bytes-per-step traffic model (`replayssm_jax.traffic`)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import traffic as T

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
NEMO = T.LayerDims.nemotron_h_8b()
SMALL = T.LayerDims(nheads=4, headdim=2, dstate=3, ngroups=2)


# ----------------------------------------------------------------- LayerDims
def test_layer_dims_presets_and_validation():
  assert (NEMO.nheads, NEMO.headdim, NEMO.dstate, NEMO.ngroups) == (
      128, 64, 128, 8)
  assert NEMO.state_elems == 1_048_576
  with pytest.raises(ValueError, match="divisible by ngroups"):
    T.LayerDims(nheads=6, headdim=2, dstate=3, ngroups=4)
  with pytest.raises(ValueError, match="headdim"):
    T.LayerDims(nheads=4, headdim=0, dstate=3, ngroups=2)
  with pytest.raises(TypeError, match="dstate"):
    T.LayerDims(nheads=4, headdim=2, dstate=3.0, ngroups=2)


# ------------------------------------------------------- hand-computed cases
def test_small_dims_by_hand():
  # H=4, P=2, N=3, G=2; f32 state (4 B), bf16 activations and buffers (2 B).
  S = 4 * 2 * 3 * 4  # 96
  io = (4 * 2 * 2  # x read
        + 4 * 2 * 2  # y write
        + 2 * 2 * 3 * 2  # B, C reads
        + 4 * 2)  # dt read
  assert io == 64
  params = 3 * 4 * 4  # A, D, dt_bias: f32 [4] each = 48
  assert T.state_bytes(SMALL, F32) == S
  assert T.token_io_bytes(SMALL, BF16) == io
  assert T.token_io_bytes(SMALL, BF16, has_z=True) == io + 16
  assert T.param_bytes(SMALL) == params
  assert T.param_bytes(SMALL, has_D=False, has_dt_bias=False) == 16
  # Baseline, batch 2: 2 * (2S + io) + params.
  assert T.baseline_step_bytes(SMALL, 2, F32) == 2 * (192 + 64) + 48 == 560
  assert T.baseline_step_bytes(SMALL, 2, F32, has_z=True) == 592
  assert T.baseline_step_bytes(SMALL, 1, F16, F32) == (
      2 * 48 + (16 + 16 + 24 + 8) * 2 + 48)

  # Replay, L=3, bf16 buffer: r = x 4*2*2 + B 2*3*2 + dt' 4*4 = 44.
  r = 16 + 12 + 16
  assert T.buffered_token_bytes(SMALL, BF16) == r == 44
  assert T.buffered_token_bytes(SMALL, F32) == 32 + 24 + 16
  row0 = S + 0 * r + io + r + 8  # 212: checkpoint, no history, append, count
  row1 = S + 1 * r + io + r + 8  # 256
  row2 = 2 * S + 2 * r + io + 8  # 352: flush, no append
  assert (row0, row1, row2) == (212, 256, 352)
  got = [T.replay_step_bytes(SMALL, 2, 3, f, F32) for f in range(3)]
  assert got == [2 * row0 + 48, 2 * row1 + 48, 2 * row2 + 48]
  assert got == [472, 560, 752]
  assert T.replay_amortized_bytes(SMALL, 2, 3, F32) == pytest.approx(1784 / 3)
  b = T.replay_breakdown(SMALL, 2, 3, F32)
  assert b.baseline == 560 and b.flush == 752
  assert b.non_flush_mean == pytest.approx((472 + 560) / 2)
  assert b.amortized == pytest.approx(1784 / 3)
  assert b.ratio == pytest.approx(1784 / 3 / 560)
  assert b.speedup == pytest.approx(560 * 3 / 1784)
  # Footprint: checkpoint + 3 slots + int32 count.
  assert T.replay_state_bytes(SMALL, 3, F32) == 96 + 3 * 44 + 4


def _nemotron_by_hand(s_bytes):
  """Nemotron-H 8B, batch 1, bf16 act/buffers, D and dt_bias, no z, L=16."""
  S = 128 * 64 * 128 * s_bytes
  io = 128 * 64 * 2 + 128 * 64 * 2 + 2 * 8 * 128 * 2 + 128 * 2  # 37,120
  assert io == 37_120
  params = 3 * 128 * 4  # 1,536
  r = 128 * 64 * 2 + 8 * 128 * 2 + 4 * 128  # 18,944 (research notes §2.2)
  assert r == 18_944
  L = 16
  base = 2 * S + io + params
  non_flush = [S + f * r + io + r + 8 + params for f in range(L - 1)]
  flush = 2 * S + (L - 1) * r + io + 8 + params
  # Closed form: S(1 + 1/L) + r(L-1)(L+2)/(2L) + io + 8 + params.
  amort = S * 17 / 16 + r * 15 * 18 / 32 + io + 8 + params
  assert (sum(non_flush) + flush) / L == pytest.approx(amort)
  return base, non_flush, flush, amort


@pytest.mark.parametrize("dtype,s_bytes,base,amort", [
    (F32, 4, 8_427_264, 4_654_952),
    (F16, 2, 4_232_960, 2_426_728),
])
def test_nemotron_l16_by_hand(dtype, s_bytes, base, amort):
  hb, non_flush, flush, ha = _nemotron_by_hand(s_bytes)
  assert (hb, ha) == (base, amort)
  assert T.baseline_step_bytes(NEMO, 1, dtype) == base
  for f in (0, 7, 14):
    assert T.replay_step_bytes(NEMO, 1, 16, f, dtype) == non_flush[f]
  assert T.replay_step_bytes(NEMO, 1, 16, 15, dtype) == flush
  assert T.replay_amortized_bytes(NEMO, 1, 16, dtype) == pytest.approx(amort)
  # Batch scales the per-row part only; parameters are read once per call.
  assert T.baseline_step_bytes(NEMO, 256, dtype) == 256 * (base - 1536) + 1536
  assert T.replay_amortized_bytes(NEMO, 256, 16, dtype) == pytest.approx(
      256 * (amort - 1536) + 1536)


def test_nemotron_f32_l16_ratio_matches_research_note():
  # Research notes §2.6: fp32 state, L=16 -> 0.550 (ideal 1.82x); the note
  # omits current-token I/O and counts (L+1)/2 instead of
  # (L-1)(L+2)/(2L) history reads, so agreement is to ~1%.
  b = T.replay_breakdown(NEMO, 256, 16, F32)
  assert b.ratio == pytest.approx(0.55, abs=0.01)
  assert b.speedup == pytest.approx(1.81, abs=0.03)
  # fp16 state: note says 0.570 (1.76x).
  assert T.replay_breakdown(NEMO, 256, 16, F16).ratio == pytest.approx(
      0.57, abs=0.01)
  # fp32 state, L=8: note says 0.573.
  assert T.replay_breakdown(NEMO, 256, 8, F32).ratio == pytest.approx(
      0.573, abs=0.01)


# ------------------------------------------------------------------ relations
@pytest.mark.parametrize("dims", [SMALL, NEMO])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_l1_replay_is_baseline_plus_counter(dims, dtype):
  # L = 1 flushes every step over an empty history: the baseline step plus
  # the int32 counter read + write.
  for batch in (1, 7):
    base = T.baseline_step_bytes(dims, batch, dtype)
    assert T.replay_step_bytes(dims, batch, 1, 0, dtype) == base + 8 * batch
    assert T.replay_amortized_bytes(dims, batch, 1, dtype) == base + 8 * batch
    assert T.replay_breakdown(dims, batch, 1, dtype).non_flush_mean is None


def test_monotonic_properties():
  L = 16
  steps = [T.replay_step_bytes(NEMO, 4, L, f, F32) for f in range(L)]
  # Non-flush bytes grow linearly with the fill, by r per row per token.
  diffs = np.diff(steps[:-1])
  assert np.all(diffs == 4 * T.buffered_token_bytes(NEMO))
  # The flush moves the most: the step before it reads L-2 history tokens
  # and appends one; the flush reads L-1 and appends none, so the difference
  # is exactly the checkpoint write S per row.
  assert steps[-1] > max(steps[:-1])
  assert steps[-1] - steps[-2] == 4 * T.state_bytes(NEMO, F32)
  # Amortized bytes are unimodal in L: decreasing up to the optimum and
  # increasing after it.
  costs = [T.replay_amortized_bytes(NEMO, 1, L, F32) for L in range(1, 65)]
  best = int(np.argmin(costs))
  assert np.all(np.diff(costs[:best + 1]) < 0)
  assert np.all(np.diff(costs[best:]) > 0)
  # Every L >= 2 beats the baseline at this shape.
  assert all(c < T.baseline_step_bytes(NEMO, 1, F32) for c in costs[1:])
  # A bigger state gains more: f32 ratio < f16 ratio < bf16 buffers in f32.
  for L in (4, 8, 16, 32):
    r32 = T.replay_breakdown(NEMO, 64, L, F32).ratio
    r16 = T.replay_breakdown(NEMO, 64, L, F16).ratio
    assert r32 < r16 < 1.0
    # f32 buffers cost more than bf16 buffers.
    assert (T.replay_amortized_bytes(NEMO, 64, L, F32, F32)
            > T.replay_amortized_bytes(NEMO, 64, L, F32, BF16))
  # Bytes grow linearly with the batch.
  b1 = T.baseline_step_bytes(NEMO, 1, F32)
  b2 = T.baseline_step_bytes(NEMO, 2, F32)
  assert T.baseline_step_bytes(NEMO, 10, F32) == b1 + 9 * (b2 - b1)


@pytest.mark.parametrize("dims,dtype,buf", [
    (NEMO, F32, BF16), (NEMO, F16, BF16), (NEMO, BF16, BF16),
    (NEMO, F32, F32), (SMALL, F32, BF16),
    (T.LayerDims(nheads=16, headdim=32, dstate=64, ngroups=2), F32, BF16),
])
def test_optimal_buffer_len_against_brute_force(dims, dtype, buf):
  max_len = 64

  def amortized(L):  # spelled out from the per-step model
    return sum(T.replay_step_bytes(dims, 3, L, f, dtype, buf)
               for f in range(L)) / L

  costs = {L: amortized(L) for L in range(1, max_len + 1)}
  brute = min(costs, key=lambda L: (costs[L], L))
  assert T.optimal_buffer_len(dims, dtype, buf, max_len=max_len) == brute
  approx = T.approx_optimal_buffer_len(dims, dtype, buf)
  if approx < max_len - 2:
    assert abs(brute - approx) <= 1.5
  # The model's exact interior optimum: minimizing (S-r)/L + rL/2.
  S, r = T.state_bytes(dims, dtype), T.buffered_token_bytes(dims, buf)
  assert approx == pytest.approx(math.sqrt(2 * S / r))


def test_nemotron_optimum():
  assert T.optimal_buffer_len(NEMO, F32) == 21  # research notes: L* ~= 21
  assert T.optimal_buffer_len(NEMO, F16) == 15  # research notes: L* ~= 15
  assert T.approx_optimal_buffer_len(NEMO, F32) == pytest.approx(21.04,
                                                                 abs=0.01)
  assert T.optimal_buffer_len(NEMO, F32, max_len=8) == 8


def test_traffic_table():
  rows = T.traffic_table(NEMO, 256, [1, 4, 16], F32)
  assert [r["L"] for r in rows] == [1, 4, 16]
  keys = {"L", "batch", "checkpoint_dtype", "read_dtype", "buffer_dtype",
          "act_dtype",
          "baseline_bytes", "replay_non_flush_bytes", "replay_flush_bytes",
          "replay_amortized_bytes", "ratio", "predicted_speedup"}
  for row in rows:
    assert set(row) == keys
    assert row["checkpoint_dtype"] == "float32"
    assert row["read_dtype"] is None
    assert row["buffer_dtype"] == "bfloat16"
    assert row["predicted_speedup"] == pytest.approx(1 / row["ratio"])
  assert rows[0]["replay_non_flush_bytes"] is None
  b16 = T.replay_breakdown(NEMO, 256, 16, F32)
  assert rows[2]["replay_amortized_bytes"] == b16.amortized
  assert rows[2]["replay_flush_bytes"] == b16.flush
  assert rows[2]["baseline_bytes"] == T.baseline_step_bytes(NEMO, 256, F32)


# ----------------------------------------------------- dual precision copies
def test_read_copy_small_dims_by_hand():
  # SMALL: H=4, P=2, N=3 (24 elements), f32 master S=96, bf16 buffers r=44,
  # token I/O 64, parameters 48 (see test_small_dims_by_hand).
  S, r, io, params = 96, 44, 64, 48
  scales = 4 * 2 * 4  # one f32 per (head, headdim-row)
  R = {"int8": 24 + scales, "float8_e4m3fn": 24 + scales,
       "bfloat16": 48, "float16": 48}
  assert R["int8"] == 56
  for rd, want in R.items():
    assert T.read_copy_bytes(SMALL, rd) == want
  assert T.read_copy_bytes(SMALL, None) == 0
  # L=3, int8 copy: non-flush rows read the copy (+ scales) instead of the
  # checkpoint; the flush reads + writes the master and writes the copy.
  row0 = 56 + 0 * r + io + r + 8  # 172
  row1 = 56 + 1 * r + io + r + 8  # 216
  row2 = 2 * S + 56 + 2 * r + io + 8  # 408
  assert (row0, row1, row2) == (172, 216, 408)
  got = [T.replay_step_bytes(SMALL, 2, 3, f, F32, read_dtype="int8")
         for f in range(3)]
  assert got == [2 * row0 + params, 2 * row1 + params, 2 * row2 + params]
  assert T.replay_amortized_bytes(SMALL, 2, 3, F32, read_dtype="int8") == (
      pytest.approx(sum(got) / 3))
  b = T.replay_breakdown(SMALL, 2, 3, F32, read_dtype=jnp.int8)
  assert b.flush == got[-1] and b.non_flush_mean == pytest.approx(
      (got[0] + got[1]) / 2)
  assert b.baseline == T.baseline_step_bytes(SMALL, 2, F32)
  # Footprint: checkpoint + copy + 3 slots + count.
  assert T.replay_state_bytes(SMALL, 3, F32, read_dtype="int8") == (
      96 + 56 + 3 * 44 + 4)


@pytest.mark.parametrize("ck,rd,copy_bytes", [
    (F32, "float8_e4m3fn", 1), (F32, "int8", 1), (F32, "bfloat16", 2),
    (F32, "float16", 2), (F16, "float8_e4m3fn", 1)])
def test_read_copy_relations(ck, rd, copy_bytes):
  """Against the same master without a copy: every non-flush step moves
  S - R fewer bytes per row, the flush R more (the copy write)."""
  L, batch = 16, 8
  S = T.state_bytes(NEMO, ck)
  R = NEMO.state_elems * copy_bytes + (
      4 * NEMO.nheads * NEMO.headdim if rd in ("float8_e4m3fn", "int8")
      else 0)
  assert T.read_copy_bytes(NEMO, rd) == R
  for f in range(L - 1):
    plain = T.replay_step_bytes(NEMO, batch, L, f, ck)
    dual = T.replay_step_bytes(NEMO, batch, L, f, ck, read_dtype=rd)
    assert plain - dual == batch * (S - R)
  assert (T.replay_step_bytes(NEMO, batch, L, L - 1, ck, read_dtype=rd)
          - T.replay_step_bytes(NEMO, batch, L, L - 1, ck)) == batch * R
  # A copy narrower than the master (an fp8 copy of an f32 master: a
  # quarter of the bytes, plus the scales): amortized it beats the plain
  # state at L = 16.
  assert (T.replay_amortized_bytes(NEMO, batch, L, ck, read_dtype=rd)
          < T.replay_amortized_bytes(NEMO, batch, L, ck))
  # The flush costs 2S over a copy read, so the optimum L is ~sqrt(2)
  # times longer; the brute force and the closed form agree.
  best = T.optimal_buffer_len(NEMO, ck, read_dtype=rd)
  approx = T.approx_optimal_buffer_len(NEMO, ck, read_dtype=rd)
  assert approx == pytest.approx(
      math.sqrt(2) * T.approx_optimal_buffer_len(NEMO, ck))
  assert abs(best - approx) <= 1.5
  assert best > T.optimal_buffer_len(NEMO, ck)
  row = T.traffic_table(NEMO, batch, [L], ck, read_dtype=rd)[0]
  assert row["read_dtype"] == jnp.dtype(rd).name
  assert row["replay_amortized_bytes"] == T.replay_amortized_bytes(
      NEMO, batch, L, ck, read_dtype=rd)


def test_argument_errors_name_the_argument():
  with pytest.raises(ValueError, match=r"fill must be in \[0, buffer_len\)"):
    T.replay_step_bytes(NEMO, 1, 4, 4, F32)
  with pytest.raises(ValueError, match="fill must be >= 0"):
    T.replay_step_bytes(NEMO, 1, 4, -1, F32)
  with pytest.raises(ValueError, match="buffer_len must be >= 1"):
    T.replay_amortized_bytes(NEMO, 1, 0, F32)
  with pytest.raises(ValueError, match="batch must be >= 1"):
    T.baseline_step_bytes(NEMO, 0, F32)
  with pytest.raises(TypeError, match="batch must be an int"):
    T.baseline_step_bytes(NEMO, 2.0, F32)
  with pytest.raises(TypeError, match="buffer_dtype"):
    T.replay_step_bytes(NEMO, 1, 4, 0, F32, jnp.int32)
  with pytest.raises(TypeError, match="act_dtype"):
    T.baseline_step_bytes(NEMO, 1, F32, "not-a-dtype")
  with pytest.raises(ValueError, match="max_len must be >= 1"):
    T.optimal_buffer_len(NEMO, F32, max_len=0)
  with pytest.raises(ValueError, match="buffer_lens"):
    T.traffic_table(NEMO, 1, [], F32)
  with pytest.raises(TypeError, match="read_dtype must be None or one of"):
    T.replay_step_bytes(NEMO, 1, 4, 0, F32, read_dtype=F32)
  with pytest.raises(TypeError, match="read_dtype"):
    T.read_copy_bytes(NEMO, "not-a-dtype")
  # numpy integers are accepted.
  assert T.replay_step_bytes(NEMO, np.int64(2), 4, np.int32(1), F32) == (
      T.replay_step_bytes(NEMO, 2, 4, 1, F32))
