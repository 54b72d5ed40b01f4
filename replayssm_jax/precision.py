"""Storage-precision policies for a ReplayState: dual precision, quantized
read copies and stochastic rounding (research notes §5).

A `PrecisionPolicy` says how the decode state is stored:

* `checkpoint_dtype`: the *master* checkpoint (float32, bfloat16, float16).
  Flush steps fold the buffered tokens into it and store it back.
* `read_dtype`: None (single precision: the decode steps read the master),
  or a low-precision *read copy* of the master (bfloat16, float16,
  float8_e4m3fn, int8). Non-flush steps read only the copy (less traffic per
  step); flush steps read the master + buffer and write both the master and
  the re-quantized copy. float8_e4m3fn and int8 copies carry one float32
  scale per (row, head, headdim-row), see `quantize`.
* `buffer_dtype`: storage of the x and B input buffers (dt is always f32).
* `stochastic_rounding`: how a flush rounds the f32 fold result when it
  stores it into a narrower dtype (the master if bf16/f16, the read copy);
  False = round to nearest even. Buffers are always rounded to nearest.
* `seed`: of the counter-based RNG of stochastic rounding (`random_bits`).
* `sr_rng`: the per-element hash that turns a row key and an element index
  into random bits: "threefry" (jax's threefry2x32, 20 rounds, the
  default) or "hash32" (two rounds of a 32-bit integer mixer, about a
  sixth of threefry's integer operations; see `hash32_bits`). A preset
  name takes it as a suffix: "f16+sr:hash32".

Presets (`PrecisionPolicy.preset(name)`; buffers bfloat16 in all of them,
override with `.replace(buffer_dtype=...)`):

| name           | master   | read copy      | rounding of flush stores |
|----------------|----------|----------------|--------------------------|
| "f32"          | float32  | -              | (exact)                  |
| "bf16"         | bfloat16 | -              | nearest                  |
| "f16"          | float16  | -              | nearest                  |
| "bf16+sr"      | bfloat16 | -              | stochastic               |
| "f16+sr"       | float16  | -              | stochastic               |
| "f32+bf16"     | float32  | bfloat16       | nearest                  |
| "f32+f16"      | float32  | float16        | nearest                  |
| "f32+fp8"      | float32  | float8_e4m3fn  | nearest                  |
| "f32+int8"     | float32  | int8           | nearest                  |
| "f32+fp8+sr"   | float32  | float8_e4m3fn  | stochastic (copy)        |
| "f32+int8+sr"  | float32  | int8           | stochastic (copy)        |
| "f16+fp8"      | float16  | float8_e4m3fn  | nearest                  |
| "f16+fp8+sr"   | float16  | float8_e4m3fn  | stochastic (both)        |

Stochastic rounding (SR) is reproducible: the random bits of a store depend
only on (seed, layer, row id, step, element index) and a constant tag of
the store site (`random_bits`), never on the batch a row sits in or its
index there: the state ops (`replay_state_update`, `replay_verify`) give a
row the same bits alone or in any batch. A model's decode step does not:
the projections around those ops are XLA matmuls whose blocking (and so
float summation order) may depend on the batch size, so a row's states in
a batch of 1 and of 6 agree to rounding, not bit for bit.
SR of f32 -> bf16 / f16 / fp8 adds uniform random bits below the target
mantissa to the f32 bit pattern and truncates (exact: P(round up) equals
the dropped fraction of an ulp); in the subnormal range of f16 / fp8 the
dropped fraction is resolved to 2^-32 of an ulp. int8 SR is
floor(v + U[0, 1)) with a 24-bit U.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:  # public since jax 0.4.x; the private path is a guard for later moves
  from jax.extend.random import threefry_2x32 as _threefry_2x32
except ImportError:  # pragma: no cover
  from jax._src.prng import threefry_2x32 as _threefry_2x32  # pylint: disable=g-import-not-at-top

F32 = jnp.float32

CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")
READ_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "int8")
BUFFER_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZED_DTYPES = ("float8_e4m3fn", "int8")  # carry a per-row f32 scale
# qmax of the 8-bit formats: the largest magnitude a scaled row maps to.
QMAX = {"float8_e4m3fn": 448.0, "int8": 127.0}

# Store sites: a constant tag folded into the RNG key so that two stores of
# the same (row, step) (the master and its read copy) use independent bits.
SITE_MASTER = 0
SITE_READ_COPY = 1
SITE_INIT_MASTER = 2
SITE_INIT_READ_COPY = 3
SITE_BASELINE = 4

# Per-element hashes of stochastic rounding (`element_bits`).
SR_RNGS = ("threefry", "hash32")


def _dtype_name(name: str, dtype: Any, allowed, optional=False):
  if dtype is None and optional:
    return None
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or dt.name not in allowed:
    got = dt.name if dt is not None else repr(dtype)
    opts = ("None, " if optional else "") + ", ".join(allowed)
    raise ValueError(f"{name} must be one of ({opts}), got {got}.")
  return dt.name


_PRESETS = {
    "f32": dict(checkpoint_dtype="float32"),
    "bf16": dict(checkpoint_dtype="bfloat16"),
    "f16": dict(checkpoint_dtype="float16"),
    "bf16+sr": dict(checkpoint_dtype="bfloat16", stochastic_rounding=True),
    "f16+sr": dict(checkpoint_dtype="float16", stochastic_rounding=True),
    "f32+bf16": dict(checkpoint_dtype="float32", read_dtype="bfloat16"),
    "f32+f16": dict(checkpoint_dtype="float32", read_dtype="float16"),
    "f32+fp8": dict(checkpoint_dtype="float32", read_dtype="float8_e4m3fn"),
    "f32+int8": dict(checkpoint_dtype="float32", read_dtype="int8"),
    "f32+fp8+sr": dict(checkpoint_dtype="float32",
                       read_dtype="float8_e4m3fn", stochastic_rounding=True),
    "f32+int8+sr": dict(checkpoint_dtype="float32", read_dtype="int8",
                        stochastic_rounding=True),
    "f16+fp8": dict(checkpoint_dtype="float16", read_dtype="float8_e4m3fn"),
    "f16+fp8+sr": dict(checkpoint_dtype="float16",
                       read_dtype="float8_e4m3fn", stochastic_rounding=True),
}


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """How a ReplayState is stored (hashable: usable as a static jit arg).

  Dtypes may be given as jnp dtypes or names; they are kept as canonical
  names ("float32", "float8_e4m3fn", ...).

  Attributes:
    checkpoint_dtype: master checkpoint dtype (float32, bfloat16, float16).
    read_dtype: None, or the dtype of a read copy (bfloat16, float16,
      float8_e4m3fn, int8) that must be narrower than the master.
    buffer_dtype: x/B buffer dtype (float32, bfloat16, float16).
    stochastic_rounding: round flush stores into narrower-than-f32 dtypes
      stochastically (needs a bf16/f16 master or a read copy).
    seed: RNG seed of stochastic rounding, an int in [0, 2^31).
    sr_rng: the per-element hash of stochastic rounding, one of SR_RNGS
      (`element_bits`); no effect without stochastic rounding.
  """
  checkpoint_dtype: Any = "float32"
  read_dtype: Any = None
  buffer_dtype: Any = "bfloat16"
  stochastic_rounding: bool = False
  seed: int = 0
  sr_rng: str = "threefry"

  def __post_init__(self):
    ck = _dtype_name("checkpoint_dtype", self.checkpoint_dtype,
                     CHECKPOINT_DTYPES)
    rd = _dtype_name("read_dtype", self.read_dtype, READ_DTYPES,
                     optional=True)
    bf = _dtype_name("buffer_dtype", self.buffer_dtype, BUFFER_DTYPES)
    object.__setattr__(self, "checkpoint_dtype", ck)
    object.__setattr__(self, "read_dtype", rd)
    object.__setattr__(self, "buffer_dtype", bf)
    if rd is not None and jnp.dtype(rd).itemsize >= jnp.dtype(ck).itemsize:
      raise ValueError(
          f"read_dtype ({rd}) must be narrower than checkpoint_dtype ({ck}): "
          f"a read copy only pays off if it is read with fewer bytes than "
          f"the master.")
    if not isinstance(self.stochastic_rounding, (bool, np.bool_)):
      raise TypeError(f"stochastic_rounding must be a bool, got "
                      f"{self.stochastic_rounding!r}.")
    object.__setattr__(self, "stochastic_rounding",
                       bool(self.stochastic_rounding))
    if self.stochastic_rounding and ck == "float32" and rd is None:
      raise ValueError(
          "stochastic_rounding=True needs a store narrower than float32 (a "
          "bfloat16/float16 checkpoint_dtype or a read_dtype); with a "
          "float32 master and no read copy nothing is rounded.")
    if (isinstance(self.seed, (bool, np.bool_))
        or not isinstance(self.seed, (int, np.integer))
        or not 0 <= self.seed < 2**31):
      raise ValueError(f"seed must be an int in [0, 2**31), got "
                       f"{self.seed!r}.")
    object.__setattr__(self, "seed", int(self.seed))
    if self.sr_rng not in SR_RNGS:
      raise ValueError(f"sr_rng must be one of {SR_RNGS}, got "
                       f"{self.sr_rng!r}.")

  # ------------------------------------------------------------- helpers
  @classmethod
  def preset(cls, name: str) -> "PrecisionPolicy":
    """A named policy (see the module docstring table); a stochastic
    preset may name its hash after a colon, e.g. "f16+sr:hash32"."""
    if not isinstance(name, str):
      raise TypeError(f"name must be a preset name (a str, one of "
                      f"{sorted(_PRESETS)}), got {name!r}.")
    base, colon, rng = name.partition(":")
    if base not in _PRESETS or colon and (
        rng not in SR_RNGS or not _PRESETS[base].get("stochastic_rounding")):
      raise ValueError(
          f"name must be one of {sorted(_PRESETS)}, a stochastic one "
          f"optionally followed by ':<sr_rng>' (one of {SR_RNGS}), got "
          f"{name!r}.")
    return cls(**_PRESETS[base], **(dict(sr_rng=rng) if rng else {}))

  @staticmethod
  def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)

  def replace(self, **kwargs) -> "PrecisionPolicy":
    return dataclasses.replace(self, **kwargs)

  @property
  def quantized(self) -> bool:
    """Whether the read copy is 8-bit with per-row scales."""
    return self.read_dtype in QUANTIZED_DTYPES

  @property
  def plain(self) -> bool:
    """No read copy and no stochastic rounding (a ReplayState of the five
    base fields only)."""
    return self.read_dtype is None and not self.stochastic_rounding

  @property
  def rounding(self) -> str:
    """How flush stores round: "rn" (nearest), "sr" (stochastic, threefry
    bits) or "sr:<sr_rng>" (another hash)."""
    if not self.stochastic_rounding:
      return "rn"
    return "sr" if self.sr_rng == "threefry" else f"sr:{self.sr_rng}"

  @property
  def name(self) -> str:
    """A short label, e.g. 'f32+int8+sr' (also for non-preset policies)."""
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
             "float8_e4m3fn": "fp8", "int8": "int8"}
    s = short[self.checkpoint_dtype]
    if self.read_dtype is not None:
      s += "+" + short[self.read_dtype]
    return s + ("" if self.rounding == "rn" else "+" + self.rounding)


def resolve_policy(policy, checkpoint_dtype: str, buffer_dtype: str,
                   read_dtype: str | None, has_step: bool,
                   build: str) -> PrecisionPolicy:
  """The policy of a replay state's step: `policy` checked against the
  state's stored dtype names and its stochastic-rounding counters
  (has_step), or (None) the round-to-nearest policy of those dtypes.
  build: how to build a matching state, named in the errors."""
  if policy is None:
    return PrecisionPolicy(checkpoint_dtype=checkpoint_dtype,
                           read_dtype=read_dtype, buffer_dtype=buffer_dtype)
  if not isinstance(policy, PrecisionPolicy):
    raise TypeError(f"policy must be a PrecisionPolicy or None, got "
                    f"{type(policy).__name__}.")
  for what, mine, theirs in (
      ("checkpoint dtype", checkpoint_dtype, policy.checkpoint_dtype),
      ("buffer dtype", buffer_dtype, policy.buffer_dtype),
      ("read copy dtype", read_dtype, policy.read_dtype)):
    if mine != theirs:
      raise ValueError(
          f"rstate does not match policy {policy.name!r}: its {what} is "
          f"{mine} but the policy's is {theirs}; build the state with "
          f"{build}.")
  if policy.stochastic_rounding and not has_step:
    raise ValueError(
        f"policy {policy.name!r} rounds stochastically, which needs "
        f"rstate.row_id and rstate.step ([batch] int32); build the state "
        f"with {build}.")
  return policy


# ------------------------------------------------------------------ RNG
def row_keys(seed: int, layer, row_id, step, site: int):
  """[batch, 2] uint32: the threefry key data k_r of each row (see
  `random_bits`), k_r = fold_in(fold_in(fold_in(fold_in(key(seed), layer),
  site), row_id[r]), step[r])."""
  base = jax.random.key(seed, impl="threefry2x32")
  base = jax.random.fold_in(jax.random.fold_in(base, layer), site)

  def row(r, s):
    k = jax.random.fold_in(jax.random.fold_in(base, r), s)
    return jax.random.key_data(k)

  return jax.vmap(row)(jnp.asarray(row_id, jnp.int32),
                       jnp.asarray(step, jnp.int32))


def random_bits(seed: int, layer, row_id, step, shape, site: int,
                rng: str = "threefry"):
  """uint32 random bits [batch, *shape] for the stores of one step.

  Row r's bits are hash(k_r, element index) with the key
  k_r = fold_in(fold_in(fold_in(fold_in(key(seed), layer), site),
  row_id[r]), step[r]) (`row_keys`): a pure function of (seed, layer, site,
  row id, step, element index), independent of the batch composition and of
  jax's `jax_threefry_partitionable` flag. The hash is `rng`: "threefry"
  (jax's threefry2x32 of the element indices) or "hash32" (`hash32_bits`).
  `element_bits` computes the bits of any element from k_r alone (what a
  kernel does).

  Args:
    seed: policy seed (int).
    layer: layer index (int or int32 scalar, may be traced).
    row_id: [batch] int32 row identities.
    step: [batch] int32 step numbers.
    shape: per-row shape, e.g. (nheads, headdim, dstate).
    site: a store-site tag (SITE_*).
    rng: one of SR_RNGS.
  """
  _check_rng(rng)
  size = int(np.prod(shape))
  counter = jnp.arange(size, dtype=jnp.uint32)
  keys = row_keys(seed, layer, row_id, step, site)
  if rng == "hash32":
    bits = hash32_bits(keys[:, :1], keys[:, 1:], counter[None])
  else:
    bits = jax.vmap(lambda k: _threefry_2x32(k, counter))(keys)
  return bits.reshape((bits.shape[0],) + tuple(shape))


def _check_rng(rng):
  if rng not in SR_RNGS:
    raise ValueError(f"rng must be one of {SR_RNGS}, got {rng!r}.")


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32_hash(key0, key1, x0, x1):
  """The Threefry-2x32 block function (20 rounds), in plain uint32 jnp ops
  (adds, shifts, xors: they lower in Pallas kernels, unlike the threefry
  primitive). Same values as jax's threefry2x32 primitive.

  Args:
    key0, key1: uint32 key words (scalars or arrays broadcasting with x).
    x0, x1: uint32 counter words.

  Returns:
    (y0, y1) uint32.
  """
  u32 = jnp.uint32
  key0, key1 = jnp.asarray(key0, u32), jnp.asarray(key1, u32)
  ks = (key0, key1, key0 ^ key1 ^ np.uint32(0x1BD11BDA))
  x = [jnp.asarray(x0, u32) + ks[0], jnp.asarray(x1, u32) + ks[1]]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x[0] = x[0] + x[1]
      x[1] = (x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r))
      x[1] = x[0] ^ x[1]
    x[0] = x[0] + ks[(i + 1) % 3]
    x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x[0], x[1]


def _lowbias32(x):
  """A bijective 32-bit integer mixer (two xorshift-multiply rounds; the
  "lowbias32" constants of C. Wellons' hash-prospector)."""
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def hash32_bits(key0, key1, index):
  """The "hash32" random bits of flat element indices `index` under the row
  key (key0, key1): lowbias32(lowbias32(index + key0) ^ key1), all uint32.

  About 20 integer operations per element, against about 120 for the
  threefry stream (20 rounds, and half of each 64-bit block discarded):
  what makes a stochastically rounded flush cheap enough on a GPU. For a
  fixed key it is a bijection of the index (no two elements of a row share
  their bits); rows, steps and sites differ through their threefry-derived
  keys (`row_keys`). Its uniformity and independence are checked
  statistically in tests/test_precision_sr.py.
  """
  u32 = jnp.uint32
  x = jnp.asarray(index, u32) + jnp.asarray(key0, u32)
  return _lowbias32(_lowbias32(x) ^ jnp.asarray(key1, u32))


def element_bits(key0, key1, index, size: int, rng: str = "threefry"):
  """random_bits of the elements `index` (uint32 flat indices into a row of
  `size` elements) of the row with key data (key0, key1) (`row_keys`),
  for the hash `rng` (one of SR_RNGS).

  "hash32" hashes each index alone (`hash32_bits`). For "threefry",
  jax's threefry_2x32(k, arange(size)) hashes the counter pairs
  (i, i + half), half = ceil(size / 2) (a pad 0 past the end for odd
  sizes), and returns word 0 of pair i at index i and word 1 at i + half;
  this recomputes that for any subset of the indices (e.g. one kernel
  tile), so it equals `random_bits` element for element.
  """
  _check_rng(rng)
  if rng == "hash32":
    return hash32_bits(key0, key1, index)
  size = int(size)
  half = (size + 1) // 2
  i = jnp.asarray(index, jnp.uint32)
  lo = i < np.uint32(half)
  x0 = jnp.where(lo, i, i - np.uint32(half))
  x1 = jnp.where(lo, i + np.uint32(half), i)
  if size % 2:  # the padded counter past the end is 0
    x1 = jnp.where(x1 == np.uint32(size), np.uint32(0), x1)
  y0, y1 = threefry2x32_hash(key0, key1, x0, x1)
  return jnp.where(lo, y0, y1)


# ------------------------------------------------------------ rounding
def stochastic_round(x, dtype, bits):
  """Stochastically rounds f32 values to a float dtype (bf16/f16/fp8 e4m3).

  Every finite x within the target's finite range becomes one of its two
  representable neighbours, the larger magnitude with probability equal to
  the dropped fraction of an ulp (so E[result] = x). Non-finite values and
  magnitudes beyond the target's largest finite value use round to nearest.

  Args:
    x: float array (computed in f32).
    dtype: bfloat16, float16 or float8_e4m3fn.
    bits: uint32 array of x's shape (uniform random bits).
  """
  dt = jnp.dtype(dtype)
  if dt.name not in ("bfloat16", "float16", "float8_e4m3fn"):
    raise ValueError(f"dtype must be bfloat16, float16 or float8_e4m3fn, "
                     f"got {dt.name}.")
  xf = jnp.asarray(x).astype(F32)
  bits = jnp.asarray(bits, jnp.uint32)
  fi = jnp.finfo(dt)
  mant, min_exp = int(fi.nmant), int(fi.minexp)
  drop = 23 - mant
  ax = jnp.abs(xf)
  ab = jax.lax.bitcast_convert_type(ax, jnp.uint32)
  add = bits >> np.uint32(32 - drop)
  mask = np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
  res = jax.lax.bitcast_convert_type((ab + add) & mask, F32)
  if min_exp > -126:  # the target's subnormals are f32 normals: fixed grid
    grid = 2.0 ** (min_exp - mant)
    v = ax * np.float32(1.0 / grid)  # exact (power-of-two scaling)
    fl = jnp.floor(v)
    frac_bits = ((v - fl) * np.float32(2.0**32)).astype(jnp.uint32)
    up = bits > (np.uint32(0xFFFFFFFF) - frac_bits)  # frac + U >= 1
    sub = (fl + up.astype(F32)) * np.float32(grid)
    res = jnp.where(ax < np.float32(2.0**min_exp), sub, res)
  rn = ~jnp.isfinite(ax) | (ax > np.float32(fi.max))
  res = jnp.where(rn, ax, res)
  return jnp.copysign(res, xf).astype(dt)


def round_to(x, dtype, bits=None):
  """x (f32) stored as a float `dtype`: nearest-even, or SR given bits."""
  dt = jnp.dtype(dtype)
  if bits is None or dt == jnp.dtype(F32):
    return jnp.asarray(x).astype(dt)
  return stochastic_round(x, dt, bits)


def quantize(x, dtype, bits=None):
  """8-bit quantization with one f32 scale per row of the last axis.

  For each row (all axes but the last; for a state [b, h, p, n] one scale
  per (row, head, headdim-row), amax over dstate): encode = qmax / amax
  (qmax 448 for float8_e4m3fn, 127 for int8), q = round(x * encode) clipped
  to [-qmax, qmax], scale = 1 / encode; dequantize(q, scale) = q * scale.
  Rows with amax == 0 (or amax so small that encode overflows, < ~1e-36)
  store zeros with scale 1. Rows holding a NaN or inf get scale NaN, so
  their dequantized values are NaN rather than silently finite.

  Args:
    x: [..., n] float array.
    dtype: float8_e4m3fn or int8.
    bits: None (round to nearest even), or uint32 random bits of x's shape
      for stochastic rounding (int8: floor(v + U); fp8: `stochastic_round`).

  Returns:
    (q [..., n] dtype, scale [...] float32).
  """
  dt = jnp.dtype(dtype)
  if dt.name not in QUANTIZED_DTYPES:
    raise ValueError(f"dtype must be one of {QUANTIZED_DTYPES}, got "
                     f"{dt.name}.")
  qmax = np.float32(QMAX[dt.name])
  xf = jnp.asarray(x).astype(F32)
  # NaN counts as inf: XLA's max does not propagate NaN in every reduction
  # (on the CPU, jax 0.10.2, the max over the rows of a [513, 16] array
  # dropped a NaN that the max over the last 8 rows kept), and a NaN row
  # must get scale NaN, not a finite one.
  amax = jnp.max(jnp.where(jnp.isnan(xf), jnp.inf, jnp.abs(xf)), axis=-1)
  finite = jnp.isfinite(amax)
  enc = qmax / jnp.where(amax > 0, amax, 1.0)
  usable = finite & (amax > 0) & jnp.isfinite(enc)
  enc = jnp.where(usable, enc, 1.0)
  v = jnp.where(usable[..., None], xf * enc[..., None], 0.0)
  v = jnp.clip(v, -qmax, qmax)
  if dt.name == "int8":
    if bits is None:
      r = jnp.round(v)
    else:
      u = (jnp.asarray(bits, jnp.uint32) >> np.uint32(8)).astype(F32) * (
          np.float32(2.0**-24))
      r = jnp.floor(v + u)
    q = jnp.clip(r, -qmax, qmax).astype(jnp.int8)
  else:
    q = round_to(v, dt, bits)
  scale = jnp.where(finite, 1.0 / enc, jnp.nan).astype(F32)
  return q, scale


def dequantize(q, scale):
  """q [..., n] (8-bit) * scale [...] -> float32."""
  return q.astype(F32) * scale[..., None]


def store(x, dtype, bits=None):
  """x (f32) in storage `dtype`: (stored, scale [..] f32 or None)."""
  dt = jnp.dtype(dtype)
  if dt.name in QUANTIZED_DTYPES:
    return quantize(x, dt, bits)
  return round_to(x, dt, bits), None


def load(stored, scale=None):
  """The float32 values of a stored array (dequantized if 8-bit)."""
  if scale is None:
    return stored.astype(F32)
  return dequantize(stored, scale)


def quantization_step(dtype) -> float:
  """Worst-case relative rounding error of one nearest store into `dtype`,
  relative to the row amax for 8-bit (0.5 / qmax for int8; 2^-4 per element
  for fp8 normals) or per element for floats (unit roundoff)."""
  dt = jnp.dtype(dtype)
  if dt.name == "int8":
    return 0.5 / QMAX["int8"]
  return float(2.0 ** -(int(jnp.finfo(dt).nmant) + 1))


__all__ = [
    "BUFFER_DTYPES", "CHECKPOINT_DTYPES", "PrecisionPolicy", "QMAX",
    "QUANTIZED_DTYPES", "READ_DTYPES", "SR_RNGS", "dequantize", "load",
    "quantize", "element_bits", "hash32_bits", "quantization_step",
    "random_bits", "round_to",
    "row_keys", "stochastic_round", "store", "threefry2x32_hash",
]
