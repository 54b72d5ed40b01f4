"""Precision policies: validation, quantization, stochastic
rounding, reproducibility, dual-precision semantics.

Tolerances are derived in the tests from the format's rounding step (never
taken from a looser table): e.g. an int8 round trip errs by at most half a
quantization step, scale / 2, plus a few f32 roundings of the amax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import harness

B, H, PD, N, G, L = 4, 4, 8, 16, 2, 4
NSTEPS = 2 * L + 2
EPS32 = float(np.finfo(np.float32).eps)
# Rows 0..3 start at counts 0, L-1 (flushes first), L//2, 1.
COUNTS = (0, L - 1, L // 2, 1)


# ------------------------------------------------------------------ helpers
def _params():
  return testing.random_params(jax.random.PRNGKey(1), H)


def _steps(seed=2, batch=B, nsteps=NSTEPS):
  return harness.time_major(testing.random_step_inputs(
      jax.random.PRNGKey(seed), batch, H, PD, N, G, seqlen=nsteps))


@functools.partial(jax.jit, static_argnames=("policy",),
                   compiler_options=harness.FAST_COMPILE)
def _wrap(s0, counts, row_id, step, *, policy):
  st = rs.ReplayState.from_ssm_state(s0, G, L, policy=policy, row_id=row_id,
                                     step=step)
  return st.replace(count=counts)


def _state(policy, batch=B, seed=3, counts=COUNTS, row_id=None, step=None):
  """A state of `policy` from a random full state [batch, H, PD, N], with
  counts (the buffers are empty zeros: the steps fill them)."""
  s0 = jax.random.normal(jax.random.PRNGKey(seed), (batch, H, PD, N))
  if policy.stochastic_rounding:
    row_id = jnp.arange(batch, dtype=jnp.int32) if row_id is None else row_id
    step = jnp.zeros((batch,), jnp.int32) if step is None else step
  return _wrap(s0, jnp.asarray(counts, jnp.int32), row_id, step,
               policy=policy)


_store = jax.jit(P.store, static_argnums=(1,))


def _tok(steps, t):
  return jax.tree.map(lambda a: a[t], steps)


@functools.partial(jax.jit, static_argnames=("policy", "layer"),
                   compiler_options=harness.FAST_COMPILE)
def _run(rstate, steps, params, *, policy, layer=0):
  """Replay decode over time-major steps; per-step y and stored fields."""
  def body(st, tok):
    y, st = rs.replay_state_update(
        st, **harness.step_kwargs(tok, params, True), policy=policy,
        layer=layer, implementation="reference")
    out = dict(y=y, checkpoint=st.checkpoint, count=st.count)
    if st.read_copy is not None:
      out["read_copy"] = st.read_copy
    if st.read_scale is not None:
      out["read_scale"] = st.read_scale
    return st, out
  return jax.lax.scan(body, rstate, steps)


def _bits(a):
  """Raw bits (numpy view) of a float or int array."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


_step = jax.jit(rs.replay_state_update,
                static_argnames=("dt_softplus", "policy", "layer",
                                 "implementation"),
                compiler_options=harness.FAST_COMPILE)


def _same_bits(a, b, what):
  np.testing.assert_array_equal(np.asarray(_bits(a)), np.asarray(_bits(b)),
                                err_msg=what)


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
  # A NaN row after many finite ones (XLA:CPU's max over this shape dropped
  # the NaN before quantize mapped NaN to inf).
  rows = jax.random.normal(jax.random.PRNGKey(13), (512, 16))
  big = jnp.concatenate([rows, rows[:1].at[0, 3].set(jnp.nan)])
  _, scale = P.quantize(big, dtype)
  assert np.isnan(float(scale[-1])) and np.isfinite(scale[:-1]).all()


def test_store_load_round_trip_floats():
  x = _rows()
  for dt in ("bfloat16", "float16", "float32"):
    stored, scale = P.store(x, dt)
    assert scale is None and stored.dtype == jnp.dtype(dt)
    _same_bits(P.load(stored), x.astype(dt).astype(jnp.float32), dt)


# ---------------------------------------------------------------------- SR
def _grid(dtype):
  """Every finite value of a float dtype, sorted (brute force)."""
  dt = np.dtype(getattr(ml_dtypes, dtype) if dtype != "float16"
                else np.float16)
  n = 2 ** (8 * dt.itemsize)
  ut = {1: np.uint8, 2: np.uint16}[dt.itemsize]
  with np.errstate(invalid="ignore"):  # NaN patterns, dropped below
    v = np.arange(n, dtype=np.uint64).astype(ut).view(dt).astype(np.float64)
  return np.unique(v[np.isfinite(v)])


def _neighbours(x, dtype):
  g = _grid(dtype)
  x = np.asarray(x, np.float64)
  hi = g[np.searchsorted(g, x, side="left")]
  lo = g[np.searchsorted(g, x, side="right") - 1]
  return lo, hi


_SR_X = {
    # normal range of each format, subnormal range, exact values, negatives
    "bfloat16": [1.0 + 1 / 3, -3.14159, 1e-6, -2.5e-39, 7e4, 1.5, 0.0],
    "float16": [1.0 + 1 / 3, -3.14159, 6.1e-5, 1e-6, -3e-8, 6e4, 1.5, 0.0],
    "float8_e4m3fn": [1.0 + 1 / 3, -3.14159, 0.013, 1e-3, -4.1e-4, 300.0,
                      1.5, 0.0],
}


@pytest.mark.parametrize("dtype", list(_SR_X))
def test_sr_neighbours_and_unbiased(dtype):
  """Every SR result is one of the two representable neighbours of x, and
  the frequency of rounding up matches (x - lo) / (hi - lo) within 5
  binomial standard deviations (so E[SR(x)] == x)."""
  x = np.asarray(_SR_X[dtype], np.float32)
  draws = 4096
  bits = jax.random.bits(jax.random.PRNGKey(9), (draws, x.size), jnp.uint32)
  r = np.asarray(jax.vmap(lambda b: P.stochastic_round(x, dtype, b))(bits)
                 .astype(jnp.float32), np.float64)
  lo, hi = _neighbours(x, dtype)
  assert np.all((r == lo) | (r == hi)), (r, lo, hi)
  span = np.where(hi > lo, hi - lo, 1.0)
  p = (x.astype(np.float64) - lo) / span
  freq = np.mean(r == hi, axis=0)
  freq = np.where(hi > lo, freq, 0.0)
  sigma = np.sqrt(p * (1 - p) / draws)
  assert np.all(np.abs(freq - p) <= 5 * sigma + 1.0 / draws), (freq, p)


@pytest.mark.parametrize("dtype, drop", [("bfloat16", 16), ("float16", 13)])
def test_sr_probability_is_exact_in_the_normal_range(dtype, drop):
  """Enumerating all 2^drop values of the random bits that SR uses, the
  number of round-ups is exactly (x - lo) / ulp * 2^drop: the dropped bits
  of x are added, not approximated."""
  x = np.asarray([1.0 + 1 / 3, -3.14159, 1234.567, 1e-3], np.float32)
  ks = jnp.arange(2**drop, dtype=jnp.uint32) << (32 - drop)
  r = np.asarray(jax.vmap(lambda k: P.stochastic_round(
      x, dtype, jnp.full(x.shape, k)))(ks).astype(jnp.float32), np.float64)
  lo, hi = _neighbours(x, dtype)
  lo, hi = (np.where(x < 0, hi, lo), np.where(x < 0, lo, hi))  # by |x|
  ups = np.sum(np.abs(r) == np.abs(hi), axis=0)
  expected = np.abs(x.astype(np.float64) - lo) / np.abs(hi - lo) * 2**drop
  np.testing.assert_array_equal(ups, expected)


def test_sr_nonfinite_and_out_of_range_use_nearest():
  x = jnp.asarray([jnp.inf, -jnp.inf, jnp.nan, 7e4], jnp.float32)
  bits = jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32)
  r = P.stochastic_round(x, "float16", bits)
  _same_bits(r, x.astype(jnp.float16), "f16 RN outside the range")


_random_bits = jax.jit(P.random_bits, static_argnums=(4, 5, 6))


def test_random_bits_depend_only_on_the_key():
  shape = (2, 3)
  i32 = lambda *v: jnp.asarray(v, jnp.int32)  # noqa: E731
  a = _random_bits(7, 1, i32(5, 9), i32(3, 4), shape, 0)
  b = _random_bits(7, 1, i32(9, 1), i32(4, 0), shape, 0)
  np.testing.assert_array_equal(a[1], b[0])  # row (9, step 4), any index
  for other in (_random_bits(8, 1, i32(5, 9), i32(3, 4), shape, 0),
                _random_bits(7, 2, i32(5, 9), i32(3, 4), shape, 0),
                _random_bits(7, 1, i32(5, 9), i32(3, 4), shape, 1),
                _random_bits(7, 1, i32(5, 9), i32(4, 4), shape, 0)):
    assert not np.array_equal(other[0], a[0])
  # Reference values: the documented fold_in chain + threefry2x32.
  k = jax.random.key(7, impl="threefry2x32")
  for v in (1, 0, 9, 4):
    k = jax.random.fold_in(k, v)
  from jax.extend import random as jex_random  # pylint: disable=g-import-not-at-top
  want = jex_random.threefry_2x32(jax.random.key_data(k),
                                  jnp.arange(6, dtype=jnp.uint32))
  np.testing.assert_array_equal(a[1].reshape(-1), want)


@pytest.mark.parametrize("rng", P.SR_RNGS)
@pytest.mark.parametrize("shape", [(2, 3), (3, 5, 7), (1,)])
def test_element_bits_equal_random_bits(shape, rng):
  """What a kernel computes per element (row keys + the hash of one flat
  index, in plain uint32 ops) equals random_bits, for even and odd row
  sizes and for any subset of the indices."""
  size = int(np.prod(shape))
  rid = jnp.asarray([5, 9, 2**30], jnp.int32)
  stp = jnp.asarray([3, 0, 2**31 - 1], jnp.int32)
  for site in (P.SITE_MASTER, P.SITE_READ_COPY):
    want = np.asarray(_random_bits(7, 2, rid, stp, shape, site, rng))
    keys = P.row_keys(7, 2, rid, stp, site)
    idx = jnp.arange(size, dtype=jnp.uint32)[::-1]  # any order
    got = jax.vmap(lambda k, i=idx: P.element_bits(k[0], k[1], i, size,
                                                   rng))(keys)
    np.testing.assert_array_equal(np.asarray(got)[:, ::-1],
                                  want.reshape(3, -1))


def _np_lowbias32(x):
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def test_hash32_bits_follow_the_documented_formula():
  """random_bits(..., "hash32") == lowbias32(lowbias32(i + k0) ^ k1) with
  the row keys of `row_keys`, recomputed in numpy's wrapping uint32."""
  rid = jnp.asarray([5, 9], jnp.int32)
  stp = jnp.asarray([3, 2**31 - 1], jnp.int32)
  got = np.asarray(_random_bits(7, 2, rid, stp, (4, 6), P.SITE_MASTER,
                                "hash32")).reshape(2, -1)
  keys = np.asarray(P.row_keys(7, 2, rid, stp, P.SITE_MASTER))
  i = np.arange(24, dtype=np.uint32)
  with np.errstate(over="ignore"):
    want = np.stack([_np_lowbias32(_np_lowbias32(i + k0) ^ k1)
                     for k0, k1 in keys])
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got, np.asarray(_random_bits(
      7, 2, rid, stp, (4, 6), P.SITE_MASTER, "threefry")).reshape(2, -1))


@pytest.mark.parametrize("rng", P.SR_RNGS)
def test_sr_bits_are_uniform_and_independent(rng):
  """The bits of 8 rows (ids x steps) x 2^14 elements: every bit is set
  with frequency 1/2 within 5 binomial sigmas; the top 4 bits of
  neighbouring elements, of the same element in neighbouring rows and in
  consecutive steps pass a chi-square test of independence (225 degrees of
  freedom, threshold p ~ 1e-6); SR of a constant through them is unbiased
  (the mean over a row is x within 5 sigmas)."""
  n = 2**14
  rid = jnp.asarray([0, 1, 0, 1, 2, 3, 2, 3], jnp.int32)
  stp = jnp.asarray([0, 0, 1, 1, 0, 0, 1, 1], jnp.int32)
  bits = np.asarray(_random_bits(5, 0, rid, stp, (n,), P.SITE_MASTER, rng))
  ones = (bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1
  freq = ones.mean(axis=(0, 1))
  assert np.all(np.abs(freq - 0.5) < 5 * np.sqrt(0.25 / bits.size)), freq

  def chi2(a, b):
    a, b = (a >> 28).ravel(), (b >> 28).ravel()
    obs = np.bincount(a * 16 + b, minlength=256).reshape(16, 16)
    exp = np.outer(np.bincount(a, minlength=16),
                   np.bincount(b, minlength=16)) / a.size
    return float(((obs - exp) ** 2 / exp).sum())

  # chi-square(225 dof: 15 x 15) exceeds 340 with p ~ 1e-6.
  for what, a, b in (("neighbour elements", bits[:, :-1], bits[:, 1:]),
                     ("neighbour rows", bits[0::2], bits[1::2]),
                     ("consecutive steps", bits[[0, 1, 4, 5]],
                      bits[[2, 3, 6, 7]])):
    assert chi2(a, b) < 340, (rng, what)
  x = np.float32(1.0 + 1 / 3)
  lo, hi = _neighbours(np.asarray([x]), "float16")
  r = np.asarray(P.stochastic_round(jnp.full(bits.shape, x), "float16",
                                    bits).astype(jnp.float32), np.float64)
  p = (x - lo[0]) / (hi[0] - lo[0])
  assert abs(np.mean(r == hi[0]) - p) < 5 * np.sqrt(p * (1 - p) / r.size)


# ---------------------------------------------------------- reproducibility
@pytest.mark.parametrize("name", ["f16+fp8+sr", "f32+int8+sr",
                                  "f16+fp8+sr:hash32"])
def test_sr_decode_is_bit_reproducible_across_runs_and_batches(name):
  """A row decodes to identical bits alone (batch 1) and embedded at index
  3 of a batch of 5 (other rows: other ids, steps and inputs); two runs give
  the same bits; another seed gives other bits."""
  pol = P.PrecisionPolicy.preset(name).replace(seed=11)
  params = _params()
  big_steps = _steps(seed=4, batch=5)
  big = _state(pol, batch=5, seed=6, counts=(0, 2, L - 1, 1, 3),
               row_id=jnp.asarray([40, 41, 42, 7, 43], jnp.int32),
               step=jnp.asarray([0, 5, 9, 100, 2], jnp.int32))
  alone = jax.tree.map(lambda a: a[3:4], big)
  alone_steps = jax.tree.map(lambda a: a[:, 3:4], big_steps)
  fin_big, out_big = _run(big, big_steps, params, policy=pol, layer=3)
  fin_1, out_1 = _run(alone, alone_steps, params, policy=pol, layer=3)
  _, out_again = _run(big, big_steps, params, policy=pol, layer=3)
  for key in out_big:
    _same_bits(out_big[key][:, 3:4], out_1[key], f"{name} {key}: batch")
    _same_bits(out_big[key], out_again[key], f"{name} {key}: rerun")
  np.testing.assert_array_equal(fin_big.step, big.step + NSTEPS)
  # Teeth: the stores really are stochastic (they differ from nearest).
  t = int(np.argmax(np.any(np.asarray(out_big["count"]) == 0, axis=1)))
  flushed = np.asarray(out_big["count"][t]) == 0
  master = out_big["checkpoint"][t].astype(jnp.float32)
  copy_rn, _ = _store(master, pol.read_dtype)
  assert not np.array_equal(_bits(copy_rn)[flushed],
                            _bits(out_big["read_copy"][t])[flushed])


# ---------------------------------------------------------- dual precision
@pytest.mark.parametrize("name", ["f32+int8", "f32+bf16", "f16+fp8+sr"])
def test_dual_precision_master_and_copy_invariants(name):
  """Non-flush steps leave master and copy bit-identical; after every flush
  the copy is the re-quantized stored master; a plain state whose
  checkpoint is the dequantized copy gives bit-identical non-flush
  outputs (so they are computed from the copy)."""
  pol = P.PrecisionPolicy.preset(name)
  params, steps = _params(), _steps()
  st = _state(pol)
  _, out = _run(st, steps, params, policy=pol)
  out = jax.tree.map(np.asarray, out)
  c0 = np.asarray(COUNTS)
  prev = jax.tree.map(np.asarray, dict(
      checkpoint=st.checkpoint, read_copy=st.read_copy,
      read_scale=st.read_scale))
  for t in range(NSTEPS):
    flush = (c0 + t) % L == L - 1
    for key in ("checkpoint", "read_copy", "read_scale"):
      if key not in out:
        continue
      _same_bits(out[key][t][~flush], prev[key][~flush],
                 f"{key} of non-flush rows, step {t}")
      prev[key] = out[key][t]
    if not pol.stochastic_rounding:
      copy, scale = _store(out["checkpoint"][t].astype(np.float32),
                           pol.read_dtype)
      _same_bits(out["read_copy"][t], copy, f"copy == q(master), step {t}")
      if scale is not None:
        _same_bits(out["read_scale"][t], scale, f"scale, step {t}")
    else:  # SR: the copy is a neighbour-rounding of the master
      master = out["checkpoint"][t].astype(np.float32)
      deq = out["read_copy"][t].astype(np.float32) * out["read_scale"][t][
          ..., None]
      s = out["read_scale"][t][..., None]
      # fp8 SR: within one fp8 ulp (2^-3 relative, 2^-9 scale subnormal).
      assert np.all(np.abs(deq - master) <= 2**-3 * np.abs(master)
                    + 2**-9 * s + 4 * EPS32 * np.abs(master).max())

  # One step: non-flush outputs == those of a plain state holding the copy.
  tok = _tok(steps, 0)
  y, _ = _step(st, **harness.step_kwargs(tok, params, True), policy=pol)
  plain = rs.ReplayState(checkpoint=P.load(st.read_copy, st.read_scale),
                         x_buf=st.x_buf, b_buf=st.b_buf, dt_buf=st.dt_buf,
                         count=st.count)
  y_plain, _ = _step(plain, **harness.step_kwargs(tok, params, True))
  non_flush = c0 != L - 1
  _same_bits(y[non_flush], y_plain[non_flush], "y from the read copy")


@pytest.mark.parametrize("name", ["f32+int8", "f32+fp8"])
def test_non_flush_steps_never_read_the_master(name):
  """Poisoning the master with NaN: non-flush rows' outputs stay finite
  (and their master stays as it was), a flushing row's output is NaN."""
  pol = P.PrecisionPolicy.preset(name)
  params, steps = _params(), _steps()
  st = _state(pol)
  bad = st.replace(checkpoint=jnp.full_like(st.checkpoint, jnp.nan))
  y, new = _step(bad, **harness.step_kwargs(_tok(steps, 0), params, True),
                 policy=pol)
  flush = np.asarray(COUNTS) == L - 1
  assert flush.any() and (~flush).any()
  assert np.all(np.isfinite(np.asarray(y[~flush])))
  assert np.all(np.isnan(np.asarray(y[flush])))
  # The flushed row's poisoned master poisons its copy too (never laundered).
  assert np.all(np.isnan(np.asarray(P.load(new.read_copy, new.read_scale)
                                    [flush])))


@pytest.mark.parametrize("name", ["f32", "bf16", "f16"])
def test_plain_policy_equals_the_existing_path_bit_for_bit(name):
  pol = P.PrecisionPolicy.preset(name).replace(buffer_dtype="float16")
  params, steps = _params(), _steps()
  s0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N))
  old = rs.ReplayState.from_ssm_state(
      s0, G, L, checkpoint_dtype=pol.checkpoint_dtype,
      buffer_dtype=jnp.float16)
  old = old.replace(count=jnp.asarray(COUNTS, jnp.int32))
  new = _state(pol)
  for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
    _same_bits(a, b, "constructed state")
  fin_new, out_new = _run(new, steps, params, policy=pol)
  fin_old, out_old = harness.replay_scan(old, steps, params,
                                         dt_softplus=True)
  _same_bits(out_new["y"], out_old, f"{name} y")
  for a, b in zip(jax.tree.leaves(fin_new), jax.tree.leaves(fin_old)):
    _same_bits(a, b, f"{name} final state")
  assert jax.tree.structure(fin_new) == jax.tree.structure(fin_old)


def test_int8_read_copy_error_is_bounded_by_the_quantization_step():
  """f32 master + int8 copy vs f32: the master (folded from master + buffer
  only) is bit-identical; the copy errs by <= scale/2 per element, so a
  non-flush output errs by <= decay * sum_n |C_n| * scale/2 * |silu(z)|
  (decay <= 1) plus f32 noise (f32 tolerance of the table)."""
  f32, q8 = P.PrecisionPolicy.preset("f32"), P.PrecisionPolicy.preset(
      "f32+int8")
  params, steps = _params(), _steps()
  _, out_32 = _run(_state(f32), steps, params, policy=f32)
  st8 = _state(q8)
  _, out_8 = _run(st8, steps, params, policy=q8)
  _same_bits(out_8["checkpoint"], out_32["checkpoint"], "master")
  master = out_8["checkpoint"]
  deq = P.load(out_8["read_copy"], out_8["read_scale"])
  s = out_8["read_scale"][..., None]
  assert np.all(np.abs(np.asarray(deq - master))
                <= 0.5 * np.asarray(s) + 4 * EPS32 * np.asarray(
                    jnp.max(jnp.abs(master), -1, keepdims=True)))
  # Output bound at step t uses the copy held before step t.
  scales = jnp.concatenate([st8.read_scale[None], out_8["read_scale"][:-1]])
  csum = jnp.sum(jnp.abs(steps["C"]), axis=-1)  # [T, b, g]
  csum = jnp.repeat(csum, H // G, axis=-1)[..., None]  # [T, b, h, 1]
  gate = jnp.abs(jax.nn.silu(steps["z"]))
  bound = (0.5 * scales * (1 + 8 * EPS32) + 4 * EPS32) * csum * gate
  tol = testing.TOLERANCES["float32"]
  scale_y = jnp.max(jnp.abs(out_32["y"]))
  err = jnp.abs(out_8["y"] - out_32["y"])
  assert bool(jnp.all(err <= bound + tol.atol * scale_y)), float(
      jnp.max(err - bound))
  assert float(jnp.max(err)) > 0  # teeth: the copy is really read


# ------------------------------------------------------- baseline contrast
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_baseline_rn_equals_the_plain_baseline(dtype):
  params, steps = _params(), _steps()
  s = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N)).astype(dtype)
  kw = harness.step_kwargs(_tok(steps, 0), params, True)
  y, new, scale = rs.selective_state_update_stored(s, **kw)
  y_ref, new_ref = rs.selective_state_update(s, **kw,
                                             implementation="reference")
  assert scale is None
  _same_bits(y, y_ref, "y")
  _same_bits(new, new_ref, "state")


def test_stored_baseline_int8_and_sr():
  params, steps = _params(), _steps()
  kw = harness.step_kwargs(_tok(steps, 0), params, True)
  s = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N))
  q, scale = P.quantize(s, "int8")
  y, q2, scale2 = rs.selective_state_update_stored(q, **kw, state_scale=scale)
  _, exact = rs.selective_state_update(P.dequantize(q, scale), **kw)
  q_ref, s_ref = P.quantize(exact, "int8")
  _same_bits(q2, q_ref, "int8 baseline store")
  _same_bits(scale2, s_ref, "int8 baseline scale")
  rid, stp = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 4, jnp.int32)
  sb = s.astype(jnp.float16)
  a = rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                       seed=3, row_id=rid, step=stp)[1]
  b = rs.selective_state_update_stored(sb[::-1], **{
      k: (v[::-1] if k in ("x", "dt", "B", "C", "z") else v)
      for k, v in kw.items()}, stochastic_rounding=True, seed=3,
                                       row_id=rid[::-1], step=stp)[1]
  _same_bits(a, b[::-1], "SR baseline independent of row order")
  h = rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                       seed=3, row_id=rid, step=stp,
                                       sr_rng="hash32")[1]
  _, new = rs.selective_state_update(sb.astype(jnp.float32), **kw)
  _same_bits(h, P.round_to(new, jnp.float16, P.random_bits(
      3, 0, rid, stp, sb.shape[1:], P.SITE_BASELINE, "hash32")),
             "SR baseline with the hash32 bits")
  assert not np.array_equal(_bits(h), _bits(a))
  _, exact = rs.selective_state_update(sb, **kw)
  lo_hi = [np.nextafter(np.asarray(exact, np.float16), d) for d in
           (np.float16(-np.inf), np.float16(np.inf))]
  a = np.asarray(a)
  ok = (a == np.asarray(exact.astype(jnp.float16))) | (a == lo_hi[0]) | (
      a == lo_hi[1])
  assert ok.all()
  with pytest.raises(ValueError, match=r"row_id \(\[batch\] int32\) is "
                     r"required"):
    rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True)
  with pytest.raises(ValueError, match=r"sr_rng must be one of"):
    rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                     row_id=rid, step=stp, sr_rng="x")
  with pytest.raises(ValueError, match=r"state_scale .* is required"):
    rs.selective_state_update_stored(q, **kw)


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
  mat = rs.materialize(st, _params()["A"])
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
  params, steps = _params(), _steps()
  kw = harness.step_kwargs(_tok(steps, 0), params, True)
  q8 = P.PrecisionPolicy.preset("f32+int8")
  st = _state(q8)
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
  _same_bits(y_none, y_pol, "policy None == the state's policy")
  win = testing.random_step_inputs(jax.random.PRNGKey(0), B, H, PD, N, G,
                                   seqlen=2)
  with pytest.raises(ValueError, match=r"rstate does not match policy "
                     r"'bf16': its checkpoint dtype is float32"):
    rs.replay_verify(st, **win, **params,
                     policy=P.PrecisionPolicy.preset("bf16"))
  with pytest.raises(ValueError, match=r"needs rstate.row_id and rstate.step"):
    rs.replay_verify(st, **win, **params,
                     policy=q8.replace(stochastic_rounding=True))
