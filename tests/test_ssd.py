"""Chunked SSD prefill == token-by-token baseline; prefill -> replay decode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import replayssm_jax as rs
from replayssm_jax import testing
from tests import cases as C
from tests import harness

F32_TOL = testing.TOLERANCES["float32"]


def _baseline(seq, params, init, dims, dt_softplus):
  """Stepwise baseline from init (zeros, the meaning of None, otherwise)."""
  state0 = (jnp.zeros((dims.batch, dims.nheads, dims.headdim, dims.dstate),
                      jnp.float32) if init is None else init)
  final, ys = harness.baseline_scan(state0, harness.time_major(seq), params,
                                    dt_softplus=dt_softplus)
  return jnp.swapaxes(ys, 0, 1), final


def test_case_list_covers_ragged_seqlens():
  assert any(c.seqlen % c.chunk_size for c in C.SSD_CASES)
  assert any(c.seqlen < c.chunk_size for c in C.SSD_CASES)
  assert all(c.dims.ngroups < c.dims.nheads for c in C.SSD_CASES)


@pytest.mark.parametrize("case", C.SSD_CASES, ids=C.case_id)
def test_ssd_matches_stepwise_baseline(case):
  params, seq, init = harness.ssd_inputs(case)
  y, final = harness.run_ssd(seq, params, case.chunk_size, case.dt_softplus,
                             init)
  y_ref, final_ref = _baseline(seq, params, init, case.dims,
                               case.dt_softplus)
  assert y.shape == seq["x"].shape and y.dtype == seq["x"].dtype
  assert final.dtype == jnp.float32
  testing.assert_close(y, y_ref, F32_TOL, f"{case.id} y")
  testing.assert_close(final, final_ref, F32_TOL, f"{case.id} final state")


@pytest.mark.parametrize("seqlen,split,chunk", C.SSD_SPLITS,
                         ids=[f"T{t}-at{s}-Q{q}" for t, s, q in C.SSD_SPLITS])
def test_ssd_split_sequence_with_carried_state(seqlen, split, chunk):
  case = C.SsdCase(seqlen, chunk, seed=1000 + split)
  params, seq, init = harness.ssd_inputs(case)
  y, final = harness.run_ssd(seq, params, chunk, True, init)
  first = {k: v[:, :split] for k, v in seq.items()}
  second = {k: v[:, split:] for k, v in seq.items()}
  y1, s1 = harness.run_ssd(first, params, chunk, True, init)
  y2, s2 = harness.run_ssd(second, params, chunk, True, s1)
  testing.assert_close(jnp.concatenate([y1, y2], axis=1), y, F32_TOL,
                       "split y")
  testing.assert_close(s2, final, F32_TOL, "split final state")


@pytest.mark.parametrize(
    "prefill_len,chunk,buffer_len,buffer_dtype", C.PREFILL_DECODE_CASES,
    ids=[f"T{t}-Q{q}-L{L}-{d}" for t, q, L, d in C.PREFILL_DECODE_CASES])
def test_chunked_prefill_then_replay_decode(prefill_len, chunk, buffer_len,
                                            buffer_dtype):
  """prefill (chunked) -> ReplayState.from_ssm_state -> replay steps ==
  the baseline decoding every token one by one from the same start."""
  ndec = 3 * buffer_len + 2
  case = C.SsdCase(prefill_len, chunk, seed=2000 + buffer_len)
  params, seq, init = harness.ssd_inputs(case, seqlen=prefill_len + ndec)
  pre = {k: v[:, :prefill_len] for k, v in seq.items()}
  dec = harness.time_major({k: v[:, prefill_len:] for k, v in seq.items()})

  y_pre, s_pre = harness.run_ssd(pre, params, chunk, True, init)
  rstate = rs.ReplayState.from_ssm_state(s_pre, case.dims.ngroups,
                                         buffer_len,
                                         buffer_dtype=buffer_dtype)
  final_r, y_dec = harness.replay_scan(rstate, dec, params, dt_softplus=True)
  y_ref, final_ref = _baseline(seq, params, init, case.dims, True)

  testing.assert_close(y_pre, y_ref[:, :prefill_len], F32_TOL, "prefill y")
  tol = testing.tolerance(buffer_dtype)
  testing.assert_close(jnp.swapaxes(y_dec, 0, 1), y_ref[:, prefill_len:],
                       tol, "decode y")
  testing.assert_close(rs.materialize(final_r, params["A"]), final_ref, tol,
                       "final state")
  assert int(jax.device_get(final_r.count[0])) == ndec % buffer_len


def test_short_sequence_is_not_padded_to_chunk_size():
  """A 5-token sequence with chunk_size 256 runs as one 5-token chunk: no
  intermediate of the traced computation has a 256-long axis (a model's
  forward over a short speculative window must not pay for a full
  chunk)."""
  case = C.SsdCase(5, 256, seed=3000)
  params, seq, init = harness.ssd_inputs(case)
  jaxpr = jax.make_jaxpr(lambda s: rs.ssd_chunked_scan(
      s["x"], s["dt"], params["A"], s["B"], s["C"], 256, D=params["D"],
      z=s["z"], dt_bias=params["dt_bias"], dt_softplus=case.dt_softplus,
      initial_state=init))(seq)
  dims = {d for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars
          for d in getattr(v.aval, "shape", ())}
  inner = {d for eqn in jaxpr.jaxpr.eqns if "jaxpr" in eqn.params
           for e in eqn.params["jaxpr"].jaxpr.eqns for v in e.outvars
           for d in getattr(v.aval, "shape", ())}
  assert 5 in inner and 256 not in dims | inner, sorted(dims | inner)
  y, final = harness.run_ssd(seq, params, 256, case.dt_softplus, init)
  y_ref, final_ref = _baseline(seq, params, init, case.dims,
                               case.dt_softplus)
  testing.assert_close(y, y_ref, F32_TOL, "y")
  testing.assert_close(final, final_ref, F32_TOL, "final state")


@pytest.mark.parametrize("q", (256, 64, 48, 16, 8))
@pytest.mark.parametrize("scale", (0.01, 1.0, 50.0))
def test_blocked_decay_sums(q, scale):
  """`ssd._segsum_blocked` (no masked [Q, Q] cumulative sum) against the
  float64 sums: -inf above the diagonal, the sums within float32
  rounding, whatever their size (terms of one sign, never a difference of
  prefix sums); Q not a multiple of the block falls back to the masked
  form."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from replayssm_jax import ssd  # pylint: disable=g-import-not-at-top
  a = -jnp.abs(jax.random.normal(jax.random.PRNGKey(q), (2, 3, q))) * scale
  c = np.cumsum(np.asarray(a, np.float64), axis=-1)
  want = np.where(np.tril(np.ones((q, q), bool)),
                  c[..., :, None] - c[..., None, :], -np.inf)
  got = np.asarray(ssd._segsum_blocked(a), np.float64)  # pylint: disable=protected-access
  live = np.isfinite(want)
  np.testing.assert_array_equal(np.isfinite(got), live)
  testing.assert_close(got[live], want[live], F32_TOL, f"Q {q}")
