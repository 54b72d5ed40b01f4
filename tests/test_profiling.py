"""replayssm_jax.profiling: per-op device time from a jax.profiler trace."""

import jax
import jax.numpy as jnp
import pytest

from replayssm_jax import profiling


@pytest.mark.parametrize("hlo_op,kernel,expected", [
    ("custom-call.3", "replayssm_replay_output_route", "pallas"),
    ("fusion.12", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "gemm"),
    ("cublas-gemm.1", "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT", "gemm"),
    ("dot.4", "dot.4", "gemm"),
    # op_times passes all of an op's kernels: a GEMM custom call that
    # memsets its output first is a GEMM.
    ("custom-call.48",
     "Memset 3 nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_NNT", "gemm"),
    ("copy.482", "copy.482", "copy"),
    ("loop_add_fusion", "loop_add_fusion", "other"),
    ("input_reduce_fusion.2", "input_reduce_fusion.2", "other"),
])
def test_category_from_names(hlo_op, kernel, expected):
  assert profiling.category(hlo_op, kernel) == expected


def test_op_times_splits_a_traced_call():
  """The traced ops of a jitted loop: per-call times that sum to the
  device time, ranked longest first, with no enclosing loop op counted on
  top of its body."""
  w = jax.random.normal(jax.random.PRNGKey(0), (256, 256))

  @jax.jit
  def f(x):
    return jax.lax.fori_loop(0, 4, lambda _, y: jnp.tanh(y @ w), x).sum()

  t = profiling.op_times(f, jax.random.normal(jax.random.PRNGKey(1),
                                              (256, 256)), iters=2)
  assert t["iters"] == 2 and t["top"]
  assert t["device_ms"] == pytest.approx(sum(t["by_category"].values()))
  ms = [o["ms"] for o in t["top"]]
  assert ms == sorted(ms, reverse=True) and ms[0] > 0
  assert not any(o["hlo_op"].startswith("while") for o in t["top"])
  assert set(t["by_category"]) <= {"pallas", "gemm", "copy", "other"}
  for o in t["top"]:  # each op's launches: count per call and spread
    assert o["events_per_call"] > 0
    assert 0 <= o["min_us"] <= o["median_us"] <= o["max_us"]
    # the spread's events are the op's time: n events of at most max_us
    assert o["ms"] * 1e3 <= o["events_per_call"] * o["max_us"] * (1 + 1e-9)


def test_op_times_rejects_bad_iters():
  with pytest.raises(ValueError, match="iters must be >= 1"):
    profiling.op_times(jnp.sin, jnp.ones(3), iters=0)
