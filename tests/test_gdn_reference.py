"""GDN reference ops, the cases of its own (those both delta-rule families
share: tests/test_delta_rule_reference.py): the gates, the dispatch table,
argument checks and transformers' values on fixed inputs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import reference as R
from tests.delta_rule_families import (B, GDN, K, assert_matches_values,
                                       reference_inputs)

TOL = testing.TOLERANCES["float32"]


def test_gates_match_formula():
  a = jnp.asarray([[-30.0, -1.0, 0.5, 25.0]], jnp.float32)
  b = jnp.asarray([[-2.0, 0.0, 1.0, 3.0]], jnp.bfloat16)
  A_log = jnp.asarray([0.1, -1.0, 0.5, 0.0], jnp.float32)
  dt_bias = jnp.asarray([0.2, 0.0, -0.3, 1.0], jnp.float32)
  g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
  assert g.dtype == beta.dtype == jnp.float32
  x = np.asarray(a, np.float64) + np.asarray(dt_bias, np.float64)
  sp = np.where(x > 20, x, np.log1p(np.exp(x)))
  np.testing.assert_allclose(g, -np.exp(np.asarray(A_log, np.float64)) * sp,
                             rtol=1e-6)
  bb = np.asarray(b.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(beta, 1 / (1 + np.exp(-bb)), rtol=1e-6)
  assert np.all(np.asarray(g) < 0)


def test_dispatch_table():
  for op in ("gdn_step", "gdn_chunked_prefill"):
    assert "reference" in rs.implementations(op)
  inp, state = reference_inputs(GDN, 50)
  o, _ = gdn.gdn_step(state, **inp, implementation="reference")
  o2, _ = gdn.gdn_step(state, **inp)
  np.testing.assert_array_equal(o, o2)
  with pytest.raises(ValueError, match="implementation"):
    gdn.gdn_step(state, **inp, implementation="no-such-kernel")
  # A kernel registers like a Mamba-2 one and receives the op's arguments.
  seen = {}

  def fake(**kw):
    seen.update(kw)
    return R.gdn_step(**kw)

  rs.register_implementation("gdn_step", rs.Implementation(
      "fake", fake, preferred=lambda: False))
  try:
    gdn.gdn_step(state, **inp, implementation="fake")
    assert set(seen) == {"state", "q", "k", "v", "g", "beta",
                         "use_qk_l2norm", "scale"}
  finally:
    del rs.ops._REGISTRY["gdn_step"]["fake"]  # pylint: disable=protected-access


def _bad_step_cases():
  inp, state = reference_inputs(GDN, 60)
  q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
  return [
      ("state", dict(state=state[0])),
      ("q", dict(q=q[:, :, :-1])),
      ("k", dict(k=k[:, :1])),
      ("v", dict(v=v[:, :, :-1])),
      ("g", dict(g=g[:, :-1])),
      ("beta", dict(beta=beta[:1])),
      ("num_v_heads", dict(q=jnp.zeros((B, 3, K)), k=jnp.zeros((B, 3, K)))),
      ("scale", dict(scale=-1.0)),
  ], dict(state=state, **inp)


def test_bad_step_arguments_name_the_argument():
  cases, good = _bad_step_cases()
  for name, change in cases:
    with pytest.raises(ValueError, match=name):
      gdn.gdn_step(**{**good, **change})
  with pytest.raises(TypeError, match="use_qk_l2norm"):
    gdn.gdn_step(**good, use_qk_l2norm=1)


def test_bad_prefill_arguments_name_the_argument():
  inp, state = reference_inputs(GDN, 61, T=5)
  bad = [
      ("q", dict(q=inp["q"][:, :, 0])),
      ("k", dict(k=inp["k"][:, :, :, :-1])),
      ("v", dict(v=inp["v"][:, :4])),
      ("g", dict(g=inp["g"][..., :-1])),
      ("beta", dict(beta=inp["beta"][:, :4])),
      ("chunk_size", dict(chunk_size=0)),
      ("initial_state", dict(initial_state=state[:, :1])),
      ("valid", dict(valid=jnp.ones((B, 4), bool))),
  ]
  for name, change in bad:
    with pytest.raises(ValueError, match=name):
      gdn.gdn_chunked_prefill(**{**inp, **change})
  with pytest.raises(TypeError, match="valid"):
    gdn.gdn_chunked_prefill(**inp, valid=jnp.ones((B, 5), jnp.int32))
  with pytest.raises(ValueError, match="b"):
    gdn.gdn_gates(jnp.zeros((2, 4)), jnp.zeros((2, 3)), jnp.zeros(4),
                  jnp.zeros(4))
  with pytest.raises(ValueError, match="A_log"):
    gdn.gdn_gates(jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.zeros(3),
                  jnp.zeros(4))


def _formula_inputs():
  """Deterministic inputs (no RNG) of a 5-token sequence, batch 1, one key
  head serving two value heads, K = 4, V = 3."""
  def idx(*s):
    return np.arange(int(np.prod(s)), dtype=np.float64).reshape(s)
  q = np.sin(1.3 * idx(1, 5, 1, 4) + 0.2)
  k = np.cos(0.7 * idx(1, 5, 1, 4) + 0.5)
  v = np.sin(0.9 * idx(1, 5, 2, 3) + 1.0)
  g = -0.1 - 0.4 * (1 + np.sin(idx(1, 5, 2))) / 2
  beta = 0.2 + 0.6 * (1 + np.cos(idx(1, 5, 2))) / 2
  s0 = 0.5 * np.cos(0.3 * idx(1, 2, 4, 3))
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]


# transformers' torch_recurrent_gated_delta_rule(q, k, v, g, beta,
# initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
# on _formula_inputs (torch, CPU, float32; its chunked form agrees to 6e-8).
HF_O = np.array([
    0.2782899, 0.2628766, 0.0635883, -0.1307729, -0.1890266, -0.0910040,
    -0.0790009, -0.0780798, -0.0356941, 0.1255676, 0.1757809, 0.1447723,
    -0.0274106, -0.0562106, -0.0570474, -0.0722415, 0.0838618, 0.2094731,
    -0.2808509, -0.1966488, 0.0339560, 0.1911354, 0.2366636, 0.1034496,
    0.0765991, 0.1142873, 0.0724413, -0.0202947, -0.0851457, -0.1051541
]).reshape((1, 5, 2, 3))
HF_STATE = np.array([
    0.1014357, -0.0288784, -0.1293121, 0.0164229, -0.1697634, -0.2249648,
    -0.0930327, -0.2405520, -0.2167156, -0.1526227, -0.1846269,
    -0.0867086, -0.1909497, -0.2029707, -0.0840694, -0.1710789,
    -0.0957296, 0.0562221, -0.0653328, 0.0542872, 0.1603630, 0.0548382,
    0.1573323, 0.1644206
]).reshape((1, 2, 4, 3))


def test_matches_transformers_gated_delta_rule():
  assert_matches_values(GDN, _formula_inputs(), HF_O, HF_STATE, TOL)
