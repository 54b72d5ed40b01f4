"""Precision policies: validation, presets, quantization of read copies,
state creation and the checks of a state against its policy.

Tolerances are derived in the tests from the format's rounding step (never
taken from a looser table): e.g. an int8 round trip errs by at most half a
quantization step, scale / 2, plus a few f32 roundings of the amax.
Stochastic rounding: tests/test_precision_sr.py; decode under a policy:
tests/test_precision_decode.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import harness
from tests.precision_common import (B, EPS32, G, H, L, N, PD,
                                    assert_same_bits, make_params, make_state,
                                    make_steps, token_at)


# ------------------------------------------------------------------- policy
def test_presets_validate_and_are_static_jit_args():
  names = P.PrecisionPolicy.preset_names()
  assert {"f32", "bf16", "f16", "f32+bf16", "f32+f16", "f32+fp8",
          "f32+int8", "f16+sr"} <= set(names)
  for name in names:
    pol = P.PrecisionPolicy.preset(name)
    assert pol.name == name
    assert pol == P.PrecisionPolicy.preset(name)
    assert hash(pol) == hash(P.PrecisionPolicy.preset(name))
    assert name in P.__doc__  # documented in the table
  pol = P.PrecisionPolicy(jnp.float32, jnp.int8, jnp.float16)
  assert (pol.checkpoint_dtype, pol.read_dtype, pol.buffer_dtype) == (
      "float32", "int8", "float16")
  assert pol.quantized and not pol.plain

  traces = []

  @functools.partial(jax.jit, static_argnames="policy")
  def f(x, policy):
    traces.append(policy)
    return x.astype(policy.checkpoint_dtype)

  f(jnp.ones(2), policy=P.PrecisionPolicy.preset("bf16"))
  f(jnp.ones(2), policy=P.PrecisionPolicy(checkpoint_dtype=jnp.bfloat16))
  assert len(traces) == 1  # equal policies hash equal: one compile


def test_preset_names_take_the_sr_hash():
  pol = P.PrecisionPolicy.preset("f16+sr:hash32")
  assert pol == P.PrecisionPolicy.preset("f16+sr").replace(sr_rng="hash32")
  assert pol.name == "f16+sr:hash32" and pol != P.PrecisionPolicy.preset(
      "f16+sr")
  assert (pol.rounding, P.PrecisionPolicy.preset("f16+sr").rounding,
          P.PrecisionPolicy.preset("f16").rounding) == ("sr:hash32", "sr",
                                                          "rn")
  assert P.PrecisionPolicy.preset("f16+sr:threefry").name == "f16+sr"
  assert "f16+sr:hash32" in P.__doc__
  for bad in ("f16:hash32", "f16+sr:philox", "f16+sr:"):
    with pytest.raises(ValueError, match=r"a stochastic one optionally "
                       r"followed by ':<sr_rng>'"):
      P.PrecisionPolicy.preset(bad)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(checkpoint_dtype="int8"), ValueError, r"checkpoint_dtype must be"),
    (dict(checkpoint_dtype="float64"), ValueError, r"checkpoint_dtype"),
    (dict(read_dtype="float32"), ValueError, r"read_dtype must be one of"),
    (dict(checkpoint_dtype="float16", read_dtype="bfloat16"), ValueError,
     r"read_dtype \(bfloat16\) must be narrower than checkpoint_dtype"),
    (dict(buffer_dtype="int8"), ValueError, r"buffer_dtype must be"),
    (dict(stochastic_rounding=True), ValueError,
     r"stochastic_rounding=True needs a store narrower than float32"),
    (dict(checkpoint_dtype="bfloat16", stochastic_rounding=1), TypeError,
     r"stochastic_rounding must be a bool"),
    (dict(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*31\)"),
    (dict(seed=2**31), ValueError, r"seed must be an int"),
    (dict(seed=1.5), ValueError, r"seed must be an int"),
    (dict(seed=True), ValueError, r"seed must be an int"),
    (dict(checkpoint_dtype="float16", stochastic_rounding=True,
          sr_rng="philox"), ValueError,
     r"sr_rng must be one of \('threefry', 'hash32'\), got 'philox'"),
])
def test_policy_validation(kwargs, exc, match):
  with pytest.raises(exc, match=match):
    P.PrecisionPolicy(**kwargs)


def test_unknown_preset():
  with pytest.raises(ValueError, match=r"name must be one of .*'f32\+int8'"):
    P.PrecisionPolicy.preset("f8")


# ------------------------------------------------------------- quantization
def _rows(seed=0):
  """[rows, N] values whose rows span 12 decades of magnitude, + edge rows."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(k1, (64, N))
  mag = 10.0 ** jax.random.uniform(k2, (64, 1), minval=-6, maxval=6)
  return (x * mag).astype(jnp.float32)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("sr", [False, True], ids=["rn", "sr"])
def test_quantize_round_trip_error_bound(dtype, sr):
  """Per element: int8 |deq - x| <= scale/2 (RN) or < scale (SR); fp8
  <= 2^-4 |x| (3 mantissa bits, RN) or < 2^-3 |x| (SR) in the normal range,
  with the subnormal grid 2^-9 scale as the absolute floor; plus 4 f32
  roundings of amax (scaling, reciprocal, dequant multiply)."""
  x = _rows()
  bits = (jax.random.bits(jax.random.PRNGKey(5), x.shape, jnp.uint32)
          if sr else None)
  q, scale = P.quantize(x, dtype, bits)
  assert q.dtype == jnp.dtype(dtype) and q.shape == x.shape
  assert scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
  deq = P.dequantize(q, scale)
  amax = jnp.max(jnp.abs(x), axis=-1)
  qmax = P.QMAX[dtype]
  np.testing.assert_allclose(scale, amax / qmax, rtol=4 * EPS32)
  err = np.asarray(jnp.abs(deq - x))
  s = np.asarray(scale)[:, None]
  f32 = 4 * EPS32 * np.asarray(amax)[:, None]
  k = 2.0 if sr else 1.0  # SR may go to the farther neighbour
  if dtype == "int8":
    bound = k * 0.5 * s + f32
  else:
    bound = np.maximum(k * 2.0**-4 * np.abs(np.asarray(x)),
                       k * 2.0**-10 * s) + f32
  assert np.all(err <= bound), float(np.max(err / bound))
  # The amax element is represented (to f32 roundings) exactly.
  i = jnp.argmax(jnp.abs(x), axis=-1)
  top = jnp.take_along_axis(deq, i[:, None], axis=-1)[:, 0]
  np.testing.assert_allclose(jnp.abs(top), amax, rtol=4 * EPS32)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantize_zero_and_nonfinite_rows(dtype):
  x = jnp.stack([jnp.zeros(N), jnp.ones(N).at[3].set(jnp.nan),
                 jnp.ones(N).at[0].set(-jnp.inf), jnp.full(N, 1e-38)])
  q, scale = P.quantize(x, dtype)
  deq = np.asarray(P.dequantize(q, scale))
  np.testing.assert_array_equal(deq[0], np.zeros(N))  # amax == 0
  assert float(scale[0]) == 1.0
  assert np.all(np.isnan(deq[1])) and np.all(np.isnan(deq[2]))  # poisoned
  # 1e-38 would overflow encode = qmax / amax: stored as zeros, documented.
  np.testing.assert_array_equal(deq[3], np.zeros(N))
  # A NaN row after many finite ones: XLA:CPU's max over this shape can
  # drop a NaN, so quantize maps NaN to inf before the max.
  rows = jax.random.normal(jax.random.PRNGKey(13), (512, 16))
  big = jnp.concatenate([rows, rows[:1].at[0, 3].set(jnp.nan)])
  _, scale = P.quantize(big, dtype)
  assert np.isnan(float(scale[-1])) and np.isfinite(scale[:-1]).all()


def test_store_load_round_trip_floats():
  x = _rows()
  for dt in ("bfloat16", "float16", "float32"):
    stored, scale = P.store(x, dt)
    assert scale is None and stored.dtype == jnp.dtype(dt)
    assert_same_bits(P.load(stored), x.astype(dt).astype(jnp.float32), dt)


# ------------------------------------------------------- state and errors
def test_create_and_validate_policy_fields():
  pol = P.PrecisionPolicy.preset("f16+fp8+sr")
  st = rs.ReplayState.create(B, H, PD, N, G, L, policy=pol)
  assert st.checkpoint.dtype == jnp.float16
  assert st.read_copy.dtype == jnp.float8_e4m3fn
  assert st.read_scale.shape == (B, H, PD)
  np.testing.assert_array_equal(st.row_id, np.arange(B))
  np.testing.assert_array_equal(st.step, np.zeros(B))
  assert st.x_buf.dtype == jnp.bfloat16
  st.validate()
  assert len(jax.tree.leaves(st)) == 9
  mat = rs.materialize(st, make_params()["A"])
  assert mat.shape == (B, H, PD, N) and not np.any(np.asarray(mat))
  plain = rs.ReplayState.create(B, H, PD, N, G, L)
  assert len(jax.tree.leaves(plain)) == 5 and plain.read_copy is None
  with pytest.raises(ValueError, match=r"checkpoint_dtype \(float32\) "
                     r"contradicts the policy"):
    rs.ReplayState.create(B, H, PD, N, G, L, jnp.float32, policy=pol)
  with pytest.raises(ValueError, match=r"row_id and step are only used"):
    rs.ReplayState.create(B, H, PD, N, G, L, row_id=jnp.arange(B))
  with pytest.raises(ValueError, match=r"row_id must have shape"):
    rs.ReplayState.create(B, H, PD, N, G, L, policy=pol,
                          row_id=jnp.arange(B + 1))
  with pytest.raises(TypeError, match=r"policy must be a PrecisionPolicy"):
    rs.ReplayState.create(B, H, PD, N, G, L, policy="f32+int8")
  with pytest.raises(TypeError, match=r"rstate.read_copy must have a dtype"):
    st.replace(read_copy=st.checkpoint.astype(jnp.float32)).validate()
  with pytest.raises(ValueError, match=r"rstate.read_scale is required"):
    st.replace(read_scale=None).validate()
  with pytest.raises(ValueError, match=r"rstate.read_scale must have shape"):
    st.replace(read_scale=st.read_scale[..., :1]).validate()
  with pytest.raises(ValueError, match=r"must be given together"):
    st.replace(step=None).validate()
  with pytest.raises(TypeError, match=r"rstate.step must be int32"):
    st.replace(step=st.step.astype(jnp.int16)).validate()


def test_step_and_verify_check_policy_against_state():
  params, steps = make_params(), make_steps()
  kw = harness.step_kwargs(token_at(steps, 0), params, True)
  q8 = P.PrecisionPolicy.preset("f32+int8")
  st = make_state(q8)
  with pytest.raises(ValueError, match=r"rstate does not match policy "
                     r"'bf16': its checkpoint dtype is float32"):
    rs.replay_state_update(st, **kw, policy=P.PrecisionPolicy.preset("bf16"))
  with pytest.raises(ValueError, match=r"needs rstate.row_id and rstate.step"):
    rs.replay_state_update(st, **kw, policy=q8.replace(
        stochastic_rounding=True))
  with pytest.raises(ValueError, match=r"layer must be an int >= 0"):
    rs.replay_state_update(st, **kw, policy=q8, layer=-1)
  # policy=None: the state's own (round-to-nearest) policy, same result.
  y_none, new_none = rs.replay_state_update(st, **kw)
  y_pol, new_pol = rs.replay_state_update(st, **kw, policy=q8)
  assert_same_bits(y_none, y_pol, "policy None == the state's policy")
  win = testing.random_step_inputs(jax.random.PRNGKey(0), B, H, PD, N, G,
                                   seqlen=2)
  with pytest.raises(ValueError, match=r"rstate does not match policy "
                     r"'bf16': its checkpoint dtype is float32"):
    rs.replay_verify(st, **win, **params,
                     policy=P.PrecisionPolicy.preset("bf16"))
  with pytest.raises(ValueError, match=r"needs rstate.row_id and rstate.step"):
    rs.replay_verify(st, **win, **params,
                     policy=q8.replace(stochastic_rounding=True))
