"""Stochastic rounding of the precision policies: neighbours, unbiasedness,
exact round-up probabilities, non-finite inputs, and the random bits
(threefry and hash32) it draws.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from replayssm_jax import precision as P
from tests.precision_common import assert_same_bits


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
  assert_same_bits(r, x.astype(jnp.float16), "f16 RN outside the range")


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
