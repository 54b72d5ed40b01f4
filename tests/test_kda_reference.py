"""KDA reference ops, the cases of their own (those both delta-rule
families share: tests/test_delta_rule_reference.py): the gates, chunks of
strong decays, transformers' recurrence on fixed inputs, the baseline
verify's snapshots, the dispatch table and argument checks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import kda
from replayssm_jax import testing
from tests.delta_rule_families import (B, HV, K, KDA, VD,
                                       assert_matches_values, numpy_loop,
                                       reference_inputs)

TOL = testing.TOLERANCES["float32"]
TOKS = ("q", "k", "v", "g", "beta")


def test_gates_match_formula():
  f = jnp.asarray([[[-30.0, -1.0, 0.5, 25.0], [2.0, 0.0, -3.0, 19.0]]])
  b = jnp.asarray([[-2.0, 3.0]], jnp.bfloat16)
  A_log = jnp.asarray([0.1, -1.0])
  dt_bias = jnp.asarray([[0.2, 0.0, -0.3, 1.0], [0.0, 0.5, 0.1, 2.0]])
  g, beta = kda.kda_gates(f, b, A_log, dt_bias)
  assert g.shape == (1, 2, 4) and g.dtype == beta.dtype == jnp.float32
  x = np.asarray(f, np.float64) + np.asarray(dt_bias, np.float64)
  a = np.exp(np.asarray(A_log, np.float64))[:, None]
  sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
  np.testing.assert_allclose(g, -a * sp, rtol=1e-6)
  bb = np.asarray(b.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(beta, 1 / (1 + np.exp(-bb)), rtol=1e-6)
  g2, _ = kda.kda_gates(f, b, A_log, dt_bias, lower_bound=-5.0)
  np.testing.assert_allclose(g2, -5.0 / (1 + np.exp(-a * x)), rtol=1e-6)
  assert np.all(np.asarray(g2) >= -5.0) and np.all(np.asarray(g2) <= 0)


def test_chunked_strong_decays_and_zero_initial_state():
  """Channels decaying by exp(-40) and more per token (the pairwise decays
  of a chunk are formed from differences: nothing overflows)."""
  T = 21
  inp, _ = reference_inputs(KDA, 31, T=T, hk=1)
  inp["g"] = inp["g"] * 20.0
  assert float(jnp.min(inp["g"])) < -40
  zero = jnp.zeros((B, HV, K, VD), jnp.float32)
  o, s = kda.kda_chunked_prefill(**inp, chunk_size=8)
  assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
  o64, s64 = numpy_loop(zero, **inp)
  testing.assert_close(o, o64, TOL, "o vs float64")
  testing.assert_close(s, s64, TOL, "state vs float64")


def _formula_inputs():
  """Deterministic inputs (no RNG) of a 5-token sequence, batch 1, two
  heads, K = 4, V = 3, per-channel log-gates in [-1.55, -0.05]."""
  def idx(*s):
    return np.arange(int(np.prod(s)), dtype=np.float64).reshape(s)
  q = np.sin(1.3 * idx(1, 5, 2, 4) + 0.2)
  k = np.cos(0.7 * idx(1, 5, 2, 4) + 0.5)
  v = np.sin(0.9 * idx(1, 5, 2, 3) + 1.0)
  g = -0.05 - 1.5 * (1 + np.sin(0.8 * idx(1, 5, 2, 4))) / 2
  beta = 0.2 + 0.6 * (1 + np.cos(idx(1, 5, 2))) / 2
  s0 = 0.5 * np.cos(0.3 * idx(1, 2, 4, 3))
  return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0)]


# transformers' recurrent_kimi_delta_attention(q, k, v, g, beta, s0, True,
# use_qk_l2norm_in_kernel=True) on _formula_inputs (torch, CPU, float32;
# its chunk_kimi_delta_attention with chunk_size=2 agrees to 7.5e-8).
HF_O = np.array([
    0.2292487, 0.2427261, 0.0741285, 0.0841115, 0.0864263, 0.1507302,
    -0.1051286, -0.2138650, -0.1650689, -0.0553842, -0.2176237, -0.2373876,
    0.0653516, 0.0433044, -0.0090978, 0.0033525, 0.0748246, 0.0412458,
    -0.1249559, -0.0720935, 0.0351564, -0.2525935, -0.2538522, -0.0351170,
    -0.1213376, -0.2029778, -0.1311109, 0.1787264, 0.0278412, -0.1534941,
]).reshape((1, 5, 2, 3))
HF_STATE = np.array([
    0.0745358, 0.1940624, 0.1673849, -0.0856680, -0.0612639, 0.0094467,
    -0.2119053, -0.2790249, -0.1349315, -0.2991048, -0.4098287, -0.2102450,
    0.0050465, 0.1834579, 0.2185299, -0.3706442, -0.0731346, 0.2447667,
    -0.3950246, -0.3359938, 0.0481143, -0.2269317, -0.3832791, -0.2693485,
]).reshape((1, 2, 4, 3))


def test_matches_transformers_kda_recurrence():
  assert_matches_values(KDA, _formula_inputs(), HF_O, HF_STATE, TOL)


def test_baseline_verify_snapshots_equal_the_float64_loop():
  """`kda_baseline_verify`: each window position's output and state
  snapshot equal the float64 loop's after that many tokens; bad windows
  are named."""
  T = 4
  inp, state = reference_inputs(KDA, 45, T=T)
  o, snaps = kda.kda_baseline_verify(state, **inp)
  assert snaps.shape == (B, T, HV, K, VD) and snaps.dtype == state.dtype
  for t in range(1, T + 1):
    want_o, want_s = numpy_loop(state, *(inp[n][:, :t] for n in TOKS))
    testing.assert_close(o[:, t - 1], want_o[:, -1], TOL, f"o at {t}")
    testing.assert_close(snaps[:, t - 1], want_s, TOL, f"snapshot {t}")
  with pytest.raises(ValueError, match="g"):
    kda.kda_baseline_verify(state, **{**inp, "g": inp["g"][..., :-1]})


def test_dispatch_table():
  for op in ("kda_step", "kda_chunked_prefill", "kda_replay_step",
             "kda_baseline_verify"):
    assert "reference" in rs.implementations(op)
  inp, state = reference_inputs(KDA, 50)
  o, _ = kda.kda_step(state, **inp, implementation="reference")
  o2, _ = kda.kda_step(state, **inp)
  np.testing.assert_array_equal(o, o2)
  with pytest.raises(ValueError, match="implementation"):
    kda.kda_step(state, **inp, implementation="no-such-kernel")


def test_bad_arguments_name_the_argument():
  inp, state = reference_inputs(KDA, 60)
  good = dict(state=state, **inp)
  cases = [
      ("state", dict(state=state[0])),
      ("q", dict(q=inp["q"][:, :, :-1])),
      ("k", dict(k=inp["k"][:, :1])),
      ("v", dict(v=inp["v"][:, :, :-1])),
      ("g", dict(g=inp["g"][..., 0])),
      ("g", dict(g=inp["g"][..., :-1])),
      ("beta", dict(beta=inp["beta"][:1])),
      ("num_v_heads", dict(q=jnp.ones((B, 3, K)), k=jnp.ones((B, 3, K)))),
      ("scale", dict(scale=-1.0)),
  ]
  for name, change in cases:
    with pytest.raises(ValueError, match=name):
      kda.kda_step(**{**good, **change})
  seq, _ = reference_inputs(KDA, 61, T=5)
  for name, change in [("g", dict(g=seq["g"][:, :, :, :-1])),
                       ("chunk_size", dict(chunk_size=0)),
                       ("initial_state", dict(initial_state=state[:, :1])),
                       ("valid", dict(valid=jnp.ones((B, 4), bool)))]:
    with pytest.raises(ValueError, match=name):
      kda.kda_chunked_prefill(**{**seq, **change})
  f = jnp.ones((2, HV, K))
  for name, args in [("dt_bias", (f, jnp.ones((2, HV)), jnp.ones(HV),
                                  jnp.ones(HV))),
                     ("b", (f, jnp.ones((2, HV, 1)), jnp.ones(HV),
                            jnp.ones((HV, K)))),
                     ("A_log", (f, jnp.ones((2, HV)), jnp.ones(HV + 1),
                                jnp.ones((HV, K))))]:
    with pytest.raises(ValueError, match=name):
      kda.kda_gates(*args)
  with pytest.raises(ValueError, match="lower_bound"):
    kda.kda_gates(f, jnp.ones((2, HV)), jnp.ones(HV), jnp.ones((HV, K)),
                  lower_bound=1.0)
