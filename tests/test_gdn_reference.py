"""GDN reference ops: the decode step against a float64 loop, the chunked
prefill against the step, padding, grouped heads and argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import reference as R

TOL = testing.TOLERANCES["float32"]
B, HK, HV, K, VD = 3, 2, 4, 8, 6


def make_inputs(seed, batch=B, T=None, hk=HK, hv=HV, kd=K, vd=VD):
  """Fresh random q, k, v, g, beta (never zeros); g from gdn_gates."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  lead = (batch,) if T is None else (batch, T)
  q = jax.random.normal(ks[0], lead + (hk, kd), jnp.float32)
  k = jax.random.normal(ks[1], lead + (hk, kd), jnp.float32)
  v = jax.random.normal(ks[2], lead + (hv, vd), jnp.float32)
  a = jax.random.normal(ks[3], lead + (hv,), jnp.float32)
  b = jax.random.normal(ks[4], lead + (hv,), jnp.float32)
  A_log = jax.random.uniform(ks[5], (hv,), jnp.float32, -2.0, 1.0)
  dt_bias = jax.random.normal(ks[6], (hv,), jnp.float32) * 0.5
  g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
  state = jax.random.normal(ks[7], (batch, hv, kd, vd), jnp.float32)
  return dict(q=q, k=k, v=v, g=g, beta=beta), state


def numpy_loop(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """The delta rule token by token in float64 (transformers' recurrent
  form): [b, T, ...] inputs -> (o [b, T, HV, V], final state)."""
  f = lambda x: np.asarray(x, np.float64)  # noqa: E731
  s, q, k, v, g, beta = map(f, (state, q, k, v, g, beta))
  rep = v.shape[2] // q.shape[2]
  q, k = np.repeat(q, rep, axis=2), np.repeat(k, rep, axis=2)
  if use_qk_l2norm:
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
            for x in (q, k))
  q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
  out = []
  for t in range(q.shape[1]):
    s = s * np.exp(g[:, t])[..., None, None]
    kv = np.einsum("bhkv,bhk->bhv", s, k[:, t])
    d = beta[:, t][..., None] * (v[:, t] - kv)
    s = s + k[:, t][..., :, None] * d[..., None, :]
    out.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
  return np.stack(out, 1), s


_step = jax.jit(gdn.gdn_step, static_argnames=("use_qk_l2norm", "scale"))
# Jitted: one compilation per case instead of one per primitive and shape.
_prefill = jax.jit(gdn.gdn_chunked_prefill, static_argnames=(
    "chunk_size", "use_qk_l2norm", "scale", "implementation"))
_scan = jax.jit(R.gdn_step_scan)


@pytest.mark.parametrize("opts", [dict(), dict(use_qk_l2norm=False,
                                                scale=0.3)],
                         ids=["l2norm", "raw-scaled"])
@pytest.mark.parametrize("hk", [HK, HV], ids=["gqa", "mha"])
def test_step_matches_float64_loop(opts, hk):
  T = 6
  inp, state = make_inputs(1, T=T, hk=hk)
  want_o, want_s = numpy_loop(state, **inp, **opts)
  s = state
  for t in range(T):
    o, s = _step(s, *(inp[n][:, t] for n in ("q", "k", "v", "g", "beta")),
                 **opts)
    assert o.dtype == jnp.float32 and o.shape == (B, HV, VD)
    testing.assert_close(o, want_o[:, t], TOL, f"o at step {t}")
  testing.assert_close(s, want_s, TOL, "state")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_step_keeps_the_state_dtype(dtype):
  inp, state = make_inputs(2)
  st = state.astype(dtype)
  o, new = gdn.gdn_step(st, **inp)
  assert new.dtype == jnp.dtype(dtype)
  want_o, want_s = numpy_loop(st.astype(jnp.float32),
                              **{n: x[:, None] for n, x in inp.items()})
  testing.assert_close(o, want_o[:, 0], TOL, "o from a low-precision state")
  testing.assert_close(new, want_s, testing.tolerance(dtype), "stored state")


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


CHUNK_CASES = [(1, 64), (1, 1), (5, 4), (5, 64), (64, 16), (64, 64),
               (100, 16), (100, 64), (100, 7)]


@pytest.mark.parametrize("T,chunk", CHUNK_CASES,
                         ids=[f"T{t}-Q{c}" for t, c in CHUNK_CASES])
def test_chunked_matches_stepwise(T, chunk):
  inp, state = make_inputs(10 + T + chunk, T=T)
  want_o, snaps = _scan(state, **inp)
  o, s = _prefill(**inp, chunk_size=chunk,
                                 initial_state=state)
  assert o.shape == (B, T, HV, VD) and s.dtype == jnp.float32
  testing.assert_close(o, want_o, TOL, f"T={T} chunk={chunk} o")
  testing.assert_close(s, snaps[:, -1], TOL, f"T={T} chunk={chunk} state")


@pytest.mark.parametrize("hk", [1, HV], ids=["one-key-head", "mha"])
def test_chunked_heads_and_zero_initial_state(hk):
  T = 21
  inp, _ = make_inputs(30 + hk, T=T, hk=hk)
  zero = jnp.zeros((B, HV, K, VD), jnp.float32)
  want_o, snaps = _scan(zero, **inp)
  o, s = _prefill(**inp, chunk_size=8)
  testing.assert_close(o, want_o, TOL, "o")
  testing.assert_close(s, snaps[:, -1], TOL, "state")
  # Matches the float64 loop too (not only our own step).
  o64, s64 = numpy_loop(zero, **inp)
  testing.assert_close(o, o64, TOL, "o vs float64")
  testing.assert_close(s, s64, TOL, "state vs float64")


def test_padded_positions_never_reach_outputs_or_state():
  T, lengths = 13, np.array([13, 7, 1, 0])
  inp, state = make_inputs(40, batch=4, T=T)
  state = state.at[3].set(jax.random.normal(jax.random.PRNGKey(3),
                                            state.shape[1:]))
  valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
  want_o, snaps = _scan(state, **inp)
  poison = dict(q=jnp.nan, k=jnp.inf, v=jnp.nan, g=jnp.nan, beta=jnp.inf)
  bad = {n: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x,
                      poison[n]) for n, x in inp.items()}
  for chunk in (4, 64):
    o, s = _prefill(**bad, chunk_size=chunk,
                                   initial_state=state, valid=valid)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    np.testing.assert_array_equal(
        np.where(valid[..., None, None], 0.0, o), 0.0)
    for r, n in enumerate(lengths):
      if n:
        testing.assert_close(o[r, :n], want_o[r, :n], TOL, f"row {r} o")
        testing.assert_close(s[r], snaps[r, n - 1], TOL, f"row {r} state")
      else:
        testing.assert_close(s[r], state[r], TOL, "empty row keeps its state")


def test_dispatch_table():
  for op in ("gdn_step", "gdn_chunked_prefill"):
    assert "reference" in rs.implementations(op)
  inp, state = make_inputs(50)
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
  inp, state = make_inputs(60)
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
  inp, state = make_inputs(61, T=5)
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
  q, k, v, g, beta, s0 = _formula_inputs()
  o, s = _prefill(q, k, v, g, beta, chunk_size=2,
                                 initial_state=s0)
  testing.assert_close(o, HF_O, TOL, "chunked o vs transformers")
  testing.assert_close(s, HF_STATE, TOL, "chunked state vs transformers")
  o, snaps = _scan(s0, q, k, v, g, beta)
  testing.assert_close(o, HF_O, TOL, "stepwise o vs transformers")
  testing.assert_close(snaps[:, -1], HF_STATE, TOL, "stepwise state")
