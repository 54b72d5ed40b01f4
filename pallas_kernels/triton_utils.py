"""Triton helpers shared by the Pallas kernels: device queries, the
register-cap name, tile loads and readouts, the window weights' suffix sums,
the output's D / gate, and the read copy's stores in Triton-lowerable ops.

(dt processing is `replayssm_jax.reference.process_dt`, shared as is.)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

from replayssm_jax import precision as P

F32 = jnp.float32


def on_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def compute_capability():
  """(major, minor) of the GPU, or None off-GPU or when unknown."""
  if not on_gpu():
    return None
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    major, minor = (int(v) for v in str(cc).split(".")[:2])
  except ValueError:
    return None  # unknown: let the Triton compiler decide
  return major, minor

def core_count(default: int = 132) -> int:
  """Streaming multiprocessors of the first device (default where it does
  not say: off-GPU, the H200's)."""
  return getattr(jax.devices()[0], "core_count", default)


def pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n (a block size that
  tiles n)."""
  p = 1
  while p * 2 <= cap and n % (p * 2) == 0:
    p *= 2
  return p

# A per-kernel register cap (PTX `.maxnreg`): Pallas' Triton CompilerParams
# has no field for it, but Triton reads a `ttg.maxnreg` attribute on the
# module it compiles. `capped_name` tags a pallas_call's name with the cap
# and installs (once) a wrapper of Pallas' Triton module lowering that sets
# the attribute on the modules so named. It wraps a private jax function:
# where jax lacks it, `register_caps_supported()` is False, the default
# launches stay uncapped and an explicit cap is refused by name.
_CAP_SUFFIX = re.compile(r"__maxnreg(\d+)$")
_cap_hook_error = None
_cap_hook_installed = False


def install_register_cap_hook() -> bool:
  """Wraps Pallas' Triton lowering so that `capped_name`'s caps reach
  Triton (idempotent); False where this jax has no such hook. A tool that
  wraps the same lowering itself (benchmarks/scripts/triton_offline.py)
  calls this first, so that its wrapper sees the attribute."""
  global _cap_hook_error, _cap_hook_installed
  if _cap_hook_installed or _cap_hook_error is not None:
    return _cap_hook_error is None
  try:
    from jax._src.lib.mlir import ir  # pylint: disable=g-import-not-at-top
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    original = lowering.lower_jaxpr_to_triton_module
  except Exception as e:  # pylint: disable=broad-except  # pragma: no cover
    _cap_hook_error = repr(e)
    return False
  _cap_hook_installed = True
  if getattr(original, "replayssm_register_cap", False):
    return True

  def lower(*args, **kwargs):
    result = original(*args, **kwargs)
    op = result.module.operation
    if "sym_name" in op.attributes:
      cap = _CAP_SUFFIX.search(ir.StringAttr(op.attributes["sym_name"]).value)
      if cap:
        with result.module.context:
          op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(
              ir.IntegerType.get_signless(32), int(cap.group(1)))
    return result

  lower.replayssm_register_cap = True
  lowering.lower_jaxpr_to_triton_module = lower
  return True


def register_caps_supported() -> bool:
  """Whether this jax lets `capped_name` cap a kernel's registers."""
  return install_register_cap_hook()


def capped_name(name: str, max_registers: int | None) -> str:
  """A pallas_call name that makes Triton cap the kernel at max_registers
  registers per thread (None: no cap, the name unchanged; ptxas then
  rematerializes or spills instead of exceeding the cap)."""
  if max_registers is None:
    return name
  if not install_register_cap_hook():  # pragma: no cover
    raise NotImplementedError(
        f"a register cap ({max_registers}) needs the Pallas Triton lowering "
        f"hook, which this jax version does not have ({_cap_hook_error}); "
        "leave the max_registers fields None.")
  return f"{name}__maxnreg{max_registers}"

def load_tile_blocks(ref, tile, chunk, when=None, rows=None):
  """ref[tile] ([block_p, N]) as a list of [block_p, chunk] column blocks
  (chunk None: one block), each loaded on its own (evict-first: a state
  tile is read once). A narrower block spans fewer lanes of a warp along
  N, so a reduction over N after `readouts` sums the blocks takes fewer
  cross-lane shuffle rounds. when: None, or a scalar bool: the blocks are
  loaded only where it holds (masked loads, no traffic otherwise), zeros
  elsewhere; rows: block_p then."""
  nstate = ref.shape[-1]
  chunk = min(chunk or nstate, nstate)
  mask = other = None
  if when is not None:
    mask = jnp.broadcast_to(when, (rows, chunk))
    # (an int 0 does not cast to fp8 in the Triton lowering; 0.0 does)
    other = 0 if jnp.issubdtype(ref.dtype, jnp.integer) else 0.0
  return [plgpu.load(ref.at[(*tile, pl.ds(k * chunk, chunk))],
                     mask=mask, other=other, eviction_policy="evict_first")
          for k in range(nstate // chunk)]


def fma(a, b, c, asm: bool):
  """a * b + c in f32 (broadcast to one shape). asm: one PTX fma.rn.f32 per
  element (`plgpu.elementwise_inline_asm`), for a Triton that emits the
  multiply and the add as two instructions (XLA's bundled one on the H200
  leaves most such pairs unfused under Nsight Compute); otherwise (and in
  interpret mode, which cannot run PTX) the plain product and sum, rounded
  twice."""
  a, b, c = jnp.broadcast_arrays(a.astype(F32), b.astype(F32),
                                 c.astype(F32))
  if not asm:
    return a * b + c
  (out,) = plgpu.elementwise_inline_asm(
      "fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=f,f,f,f",
      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
  return out


def readouts(blocks, vectors, fma_asm=False):
  """sum_n S[:, n] v[n] ([block_p] f32) of the tile S given as column
  blocks (`load_tile_blocks`), for each v in vectors: callables taking the
  block's column slice and returning v there ([chunk], any float dtype).
  The products are summed over the blocks elementwise (by `fma` with
  fma_asm), then reduced once per vector."""
  chunk = blocks[0].shape[-1]
  out = []
  for v in vectors:
    acc = None
    for k, blk in enumerate(blocks):
      vk = v(pl.ds(k * chunk, chunk)).astype(F32)[None, :]
      acc = (blk.astype(F32) * vk if acc is None
             else fma(blk, vk, acc, fma_asm))
    out.append(jnp.sum(acc, axis=1))
  return out


def suffix_sums(d, j):
  """sum_{i>j} d_i ([L, ...] f32) along axis 0 of a window d [L, ...] (j:
  arange(L)), as an [L, L] masked sum (faster in the replay routes than
  `reference.window_weights`' cumsum: benchmarks/VARIANTS.md)."""
  after = j[:, None] < j[None, :]  # [j, i]: i > j
  for _ in range(d.ndim - 1):
    after = after[..., None]
  return jnp.sum(jnp.where(after, d[None], 0.0), axis=1)


def finish_output(y, x, D, z):
  """y + D x, then * silu(z); all f32. x, z: [P]; D scalar or None."""
  if D is not None:
    y = y + D.astype(F32) * x
  if z is not None:
    zf = z.astype(F32)
    y = y * (zf * jax.nn.sigmoid(zf))
  return y


def resolve_block_p(block_p, headdim: int) -> int:
  """block_p (None: all of headdim) capped at headdim; it must divide it."""
  bp = headdim if block_p is None else min(block_p, headdim)
  if headdim % bp:
    raise NotImplementedError(
        f"block_p ({bp}) must divide headdim ({headdim}).")
  return bp


# ------------------------------------------------- stores of a read copy
# `precision.quantize` / `round_to` restated in ops that the Pallas Triton
# backend lowers (it has no round primitive, and its max reduction ignores
# NaN). Equal to them bit for bit (tests/test_replay_kernel_precision.py).


def round_half_even(v):
  """jnp.round (ties to even) of f32 values with |v| < 2^22, from floor."""
  f = jnp.floor(v)
  d = v - f  # exact
  odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0.0
  up = (d > 0.5) | ((d == 0.5) & odd)
  return f + jnp.where(up, 1.0, 0.0)


def quantize_rows(xf, dtype, bits=None):
  """`precision.quantize` of an f32 tile [rows, n] (one scale per row).

  Returns:
    (q [rows, n] in dtype (float8_e4m3fn or int8), scale [rows] f32).
  """
  dt = jnp.dtype(dtype)
  qmax = np.float32(P.QMAX[dt.name])
  # A row with a NaN or inf has amax inf (the reference's amax is not finite).
  # One reduction per row (not a second one counting the non-finite elements,
  # which costs the flush ~12%), an integer max of the magnitudes' bits (their
  # order is the floats'; a NaN's bits exceed inf's, which Triton's float max
  # would drop): a mask and an integer max per element.
  mag = lax.bitcast_convert_type(xf, jnp.int32) & np.int32(0x7FFFFFFF)
  amax_bits = jnp.max(mag, axis=-1)
  amax = jnp.where(amax_bits >= np.int32(0x7F800000), jnp.inf,
                   lax.bitcast_convert_type(amax_bits, F32))
  finite = jnp.isfinite(amax)
  enc = qmax / jnp.where(amax > 0, amax, 1.0)
  usable = finite & (amax > 0) & jnp.isfinite(enc)
  enc = jnp.where(usable, enc, 1.0)
  v = jnp.where(usable[:, None], xf * enc[:, None], 0.0)
  # |v| <= qmax (1 + 2^-23) (|x| <= amax, two roundings), so the reference's
  # clip of v to qmax changes nothing that rounding to nearest leaves: the
  # int8 result is clipped after rounding, and an fp8 value that close to
  # 448 rounds to 448. Stochastic fp8 rounding needs the clip.
  if dt.name == "int8":
    if bits is None:
      r = round_half_even(v)
    else:
      u = (bits >> np.uint32(8)).astype(F32) * np.float32(2.0**-24)
      r = jnp.floor(v + u)
    q = jnp.minimum(jnp.maximum(r, -qmax), qmax).astype(jnp.int8)
  elif bits is None:
    q = v.astype(dt)
  else:
    q = P.round_to(jnp.minimum(jnp.maximum(v, -qmax), qmax), dt, bits)
  scale = jnp.where(finite, 1.0 / enc, jnp.nan).astype(F32)
  return q, scale


def precision_problem(rstate, policy=None) -> str | None:
  """Why the replay kernels (Mamba-2 and Gated DeltaNet) cannot run this
  state's precision policy, or None.

  Supported: every read copy (bfloat16, float16, float8_e4m3fn with scales,
  int8 with scales; fp8 on sm_89+: Triton's fp8e4nv), stochastic rounding of
  the flush stores (needs rstate.row_id and rstate.step, which key the
  random bits), and row_id/step counters (advanced like the reference's).
  Interpret mode (off-GPU) runs fp8 anywhere.
  """
  read_copy = getattr(rstate, "read_copy", None)
  if read_copy is not None:
    name = jnp.dtype(read_copy.dtype).name
    if name not in P.READ_DTYPES:
      return (f"rstate.read_copy has dtype {name}; the kernels store read "
              f"copies in ({', '.join(P.READ_DTYPES)}); use "
              f"implementation='reference'.")
    cc = compute_capability()
    if name == "float8_e4m3fn" and cc is not None and cc < (8, 9):
      return (f"rstate.read_copy is float8_e4m3fn, which Triton converts "
              f"only on compute capability >= 8.9 (this GPU: {cc[0]}."
              f"{cc[1]}); use a bfloat16/float16/int8 read_dtype or "
              f"implementation='reference'.")
  if (getattr(policy, "stochastic_rounding", False)
      and getattr(rstate, "step", None) is None):
    return ("policy.stochastic_rounding needs rstate.row_id and rstate.step "
            "(they key the random bits); build the state with the policy "
            "(e.g. ReplayState.create(..., policy=policy)).")
  return None
