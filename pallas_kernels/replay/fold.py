"""The flush fold, shared by the replay step's flush route and the verify
kernels' early flush: rank-1 updates or tensor-core products, the fold
mode's default, and the persistent grid that shares out the folding rows'
items."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import triton_utils as tu

F32 = jnp.float32


def rank1_fold(st, a, token, n, *, unroll=False, suffix0=0.0):
  """st + sum_j s_j x_j B_j^T over tokens j = n-1, ..., 0 (newest first) by
  exact f32 rank-1 updates, s_j = d_j exp(a (suffix0 + sum_{i>j} d_i)).

  token(j) -> (d_j f32 scalar, x_j [block_p] f32, B_j [N] f32). Each weight
  comes from a running scalar suffix sum of the scalar d_j, so the loop
  holds no vector reduction (no cross-thread shuffles or barriers): its
  body is one FMA per tile element. unroll: a Python loop (Triton's scan
  lowering refuses unroll), else a fori_loop (the kernels' form)."""
  def body(i, carry):
    st, suffix = carry
    d, x, b = token(n - 1 - i)
    w = d * jnp.exp(a * suffix)
    return st + (w * x)[:, None] * b[None, :], suffix + d

  carry = (st, jnp.asarray(suffix0, F32))
  if unroll:
    for i in range(n):
      carry = body(i, carry)
  else:
    carry = lax.fori_loop(0, n, body, carry)
  return carry[0]


def fold_product(x_win, s, b_win, fold_dot, acc):
  """acc + sum_j s_j x_j B_j^T by tensor-core products -> [block_p, N] f32.

  x_win [L, block_p], b_win [L, N] in their stored dtypes, s [L] f32, acc
  [block_p, N] f32 (the decayed checkpoint tile). fold_dot: a lax
  precision (`dot_precision`): the f32 dot of s x and B at that
  precision; or "bf16xK": B must be bf16 (exact in bf16), and X = s x
  (f32) is split into K bf16 pieces (`split_dot`). The split is on the x
  side, [L, block_p], not on the weighted B, [L, N]: half the elements to
  split and one shared-memory copy of B instead of K.

  Each dot's product is added to acc as it comes (acc + d_3 + d_2 + d_1),
  which Triton's combine pass turns into the dots' accumulator operand: the
  decayed tile is the accumulator, not a second tile beside the dots' sum
  (no spills at 255 registers per thread on the H200:
  benchmarks/profiles/ncu_flush_x_split_f16_b256_L16_h200.txt).
  """
  dims = (((0,), (0,)), ((), ()))
  xs = s[:, None] * x_win.astype(F32)  # [L, block_p]
  if not isinstance(fold_dot, str):
    return acc + lax.dot_general(xs, b_win.astype(F32), dims,
                                 precision=fold_dot,
                                 preferred_element_type=F32)
  return split_dot(xs, b_win, dims, int(fold_dot.removeprefix("bf16x")), acc)


def split_dot(a, b, dims, pieces: int, acc):
  """acc + a . b (lax.dot_general dimension numbers `dims`) in f32, for an
  f32 `a` and a bf16 `b`: a is split into `pieces` bf16 pieces a = a_1 +
  ... + a_K, each dotted with b in bf16 with f32 accumulation (products of
  bf16 values are exact in f32), smallest piece first, each product added
  as it comes (Triton's combine pass turns that into the dots' accumulator
  operand).

  The first piece is a's top 16 bits (truncated: a shift and a mask, no
  float conversion; the remainder a - a_1 is exact), the others the
  remainder rounded to bf16: two pieces carry about 16 mantissa bits
  (relative error <= 2^-15), three all 24 of f32."""
  bits = lax.bitcast_convert_type(a, jnp.uint32)
  split = [lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16),
                                    jnp.bfloat16)]
  rest = a - lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), F32)
  for _ in range(pieces - 1):
    piece = rest.astype(jnp.bfloat16)
    split.append(piece)
    rest = rest - piece.astype(F32)
  for piece in reversed(split):
    acc = acc + lax.dot_general(piece, b, dims, preferred_element_type=F32)
  return acc


def default_fold_mode(buffer_len: int, block_p: int, b_dtypes, ck_dtype,
                      fused: bool = False) -> str:
  """The fold mode of flush_fold=None: where buffer_len and block_p >= 16
  (Triton dot tiles), the bf16 split if every folded B (b_dtypes: the
  buffer's, the current token's) is bf16: "dot_bf16x2" for a 16-bit
  checkpoint (whose store rounds far above the two pieces' ~2^-15),
  "dot_bf16x3" for an f32 one unless the flush is `fused` with the output
  route ("dot_tf32x3" there); else "dot_tf32x3"; below the tiles "rank1".
  H200 figures: benchmarks/kernel_tuning/flush_route_h200.json, kernel_tuning/batch1_fold_forms_h200.md."""
  if min(buffer_len, block_p) < 16:
    return "rank1"
  pieces = 2 if jnp.dtype(ck_dtype).itemsize <= 2 else 3
  bf16_b = all(jnp.dtype(d) == jnp.bfloat16 for d in b_dtypes)
  if bf16_b and not (fused and pieces == 3):
    return f"dot_bf16x{pieces}"
  return "dot_tf32x3"


def fold_dot(mode, buffer_len: int, block_p: int, interpret: bool, *,
              field: str, tile: str, b_dtypes, ck_dtype,
              fused: bool = False):
  """The dot form of a fold mode (None: rank-1 updates; a lax precision;
  or "bf16x2" / "bf16x3", see `fold_product`); mode None:
  `default_fold_mode`. A dot mode below the Triton dot tiles is refused,
  naming `field` and `tile`, and a bf16 mode unless every folded B is bf16.
  XLA:CPU has no TF32 algorithms, so interpret mode runs "dot_tf32x3" in
  exact f32 (the kernel code is otherwise the same)."""
  if mode is None:
    mode = default_fold_mode(buffer_len, block_p, b_dtypes, ck_dtype, fused)
  if mode == "rank1":
    return None
  if min(buffer_len, block_p) < 16:
    raise NotImplementedError(
        f"{field}={mode!r} needs buffer_len and {tile} >= 16 (Triton dot "
        f"tiles), got {buffer_len} and {block_p}.")
  if mode.startswith("dot_bf16"):
    if not all(jnp.dtype(d) == jnp.bfloat16 for d in b_dtypes):
      raise NotImplementedError(
          f"{field}={mode!r} needs bf16 B (exact in its bf16 dots), got B "
          f"dtype(s) {sorted({str(jnp.dtype(d)) for d in b_dtypes})}; use "
          "'dot_tf32x3'.")
    return mode.removeprefix("dot_")
  return dot_precision(mode, interpret)


def dot_precision(mode: str, interpret: bool):
  """lax precision of "dot_f32" / "dot_tf32x3" (XLA:CPU has no TF32
  algorithms: exact f32 in interpret mode)."""
  if interpret or mode == "dot_f32":
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
  return lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def default_flush_programs(interpret: bool,
                            core_count: int | None = None) -> int:
  """4 programs per SM (one wave at the fold's register footprint); 8 in
  interpret mode."""
  if interpret:
    return 8
  return 4 * (core_count or tu.core_count())


def flush_programs(interpret: bool, warps: int, max_registers,
                    core_count: int | None = None):
  """Persistent flush programs: as many per SM as the register file holds
  at the cap (at most 4), 4 per SM uncapped (2 warps x 255 registers)."""
  if interpret or max_registers is None:
    return default_flush_programs(interpret, core_count)
  per_sm = max(1, min(4, 65536 // (32 * warps * max_registers)))
  return per_sm * (core_count or tu.core_count())


def persistent_items(pid, active, item, *, num_programs, nheads, nblk,
                     nrows=None):
  """Runs program `pid`'s share of the (active row, head, headdim block)
  work items of a persistent grid of num_programs programs: items w = pid,
  pid + num_programs, ...; item w belongs to the r-th active row, r = w //
  (nheads * nblk), whose index is the number of rows whose inclusive active
  count is <= r. Calls item(b, h, pblk) for each.

  active: [batch] bool (padded rows False); nrows: the row index is
  clamped below it."""
  flags = active.astype(jnp.int32)
  ranks = jnp.cumsum(flags)  # inclusive
  per_row = nheads * nblk
  total = jnp.sum(flags) * per_row  # (no ranks[-1]: Triton cannot slice)
  mine = jnp.maximum(total - pid + num_programs - 1, 0) // num_programs

  def body(i, carry):
    w = pid + i * num_programs
    r, rem = w // per_row, w % per_row
    # (A lax.cond skipping this search when every row is active is slower:
    # benchmarks/VARIANTS.md.)
    b = jnp.sum((ranks <= r).astype(jnp.int32))
    if nrows is not None:
      b = jnp.minimum(b, nrows - 1)
    item(b, rem // nblk, rem % nblk)
    return carry

  lax.fori_loop(0, mine, body, 0)
