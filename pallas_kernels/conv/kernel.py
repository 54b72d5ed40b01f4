"""Pallas (Triton backend) kernels: one decode step of the causal depthwise
conv on a ring-buffer conv state, its output written as channel pieces
(`causal_conv1d_step`), and the conv over a speculative window of T inputs
from that state, which it leaves unchanged (`causal_conv1d_window`).

XLA runs this step (`conv.causal_conv1d_update_ring`, then Mamba-2's slices
of the output into x, B and C, which a kernel operand needs materialized)
as three small fusions: the ring write as a select over the whole state
and the two slices, each recomputing its part of the conv. Here one launch
reads the ring and the new input once, writes the new input into each
row's oldest slot only (masked stores: a third of the state's bytes), and
writes each output piece as its own array. The input is read in place
from a wider array at a column offset (Mamba-2's in_proj output), so XLA
need not copy it out either. The state is updated in place
(`input_output_aliases`).

A program handles `block_rows` rows x `block_channels` channels (powers of
two; the channel block divides every piece, so a block lies in one piece).
The taps are summed in float32 in the reference's order (newest tap first,
then oldest to newest), so results match it to float32 rounding (Triton may
contract a multiply-add).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _check_pow2

F32 = jnp.float32
_MIN_CHANNELS = 16  # smallest channel block the kernel takes


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """Tuning of the conv decode-step kernel (`pallas_kernels.conv`).

  Attributes:
    block_rows: rows per program (at most; the largest power of two <= it
      that divides the batch).
    block_channels: channels per program (at most; the largest power of
      two <= it that divides every output piece, >= 16).
    num_warps: Triton launch parameter.

  Defaults not swept (their timing: benchmarks/VARIANTS.md).
  """
  block_rows: int = 16
  block_channels: int = 256
  num_warps: int = 4

  def __post_init__(self):
    _check_pow2("block_rows", self.block_rows)
    _check_pow2("block_channels", self.block_channels)
    _check_pow2("num_warps", self.num_warps)
    if self.block_channels < 16:
      raise ValueError(f"block_channels must be >= 16, got "
                       f"{self.block_channels}.")


def block_channels(sizes, config: ConvConfig) -> int:
  """Channels per program: the largest power of two <= config's that
  divides every piece."""
  return min(tu.pow2_divisor(n, config.block_channels) for n in sizes)


def shape_problem(sizes, kernel_size: int,
                  config: ConvConfig) -> str | None:
  """Why the kernel cannot take these shapes, or None."""
  if kernel_size < 2:
    return (f"kernel_size = {kernel_size} leaves no ring (the kernel needs "
            f">= 2); use implementation='reference'.")
  bc = block_channels(sizes, config)
  if bc < _MIN_CHANNELS:
    return (f"the pieces' channel counts {tuple(sizes)} have no common "
            f"power-of-two divisor >= {_MIN_CHANNELS} (the kernel's channel "
            f"block); use implementation='reference'.")
  return None


def _ordered_ring(state_ref, slot, rows, cols, k1):
  """The ring's k1 inputs of a block, oldest first (each row's oldest in
  its slot `slot`), as selects over the k1 loaded slots."""
  ring = [state_ref[rows, j, cols] for j in range(k1)]
  ordered = []
  for age in range(k1):
    at = (slot + age) % k1
    v = ring[0]
    for j in range(1, k1):
      v = jnp.where((at == j)[:, None], ring[j], v)
    ordered.append(v)
  return ordered


def _bias_act(y, bias_ref, cols, silu):
  """The conv block y [rows, channels] (f32) plus the bias's columns (if
  any), then SiLU (if on): the two kernels' epilogue."""
  if bias_ref is not None:
    y = y + bias_ref[cols].astype(F32)[None, :]
  return y * jax.nn.sigmoid(y) if silu else y


def _store_pieces(out_refs, piece_blocks, c, block_channels, index, y):
  """y (a block of channel block c) into the output piece holding it, at
  out_ref[index + (its columns,)]."""
  first = 0
  for out_ref, n in zip(out_refs, piece_blocks):
    @pl.when((c >= first) & (c < first + n))
    def _store(out_ref=out_ref, first=first):
      out_ref[(*index, pl.ds((c - first) * block_channels,
                             block_channels))] = y.astype(out_ref.dtype)
    first += n


def _kernel(x_ref, state_ref, slot_ref, w_ref, *refs, k1, has_bias, silu,
            block_rows, block_channels, piece_blocks, x_offset):
  bias_ref = refs[0] if has_bias else None
  out_refs = refs[1:-1] if has_bias else refs[:-1]
  state_out = refs[-1]
  i, c = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(i * block_rows, block_rows)
  cols = pl.ds(c * block_channels, block_channels)
  x = x_ref[rows, pl.ds(x_offset + c * block_channels, block_channels)]
  slot = slot_ref[rows]  # [R] each row's oldest slot
  w = [w_ref[cols, j].astype(F32) for j in range(k1 + 1)]  # taps, [Cb]
  y = x.astype(F32) * w[k1][None, :]
  # oldest first, as the reference sums
  for age, v in enumerate(_ordered_ring(state_ref, slot, rows, cols, k1)):
    y = y + v.astype(F32) * w[age][None, :]
  y = _bias_act(y, bias_ref, cols, silu)
  _store_pieces(out_refs, piece_blocks, c, block_channels, (rows,), y)
  for j in range(k1):  # the new input over each row's oldest slot only
    plgpu.store(state_out.at[rows, jnp.int32(j), cols],
                x.astype(state_out.dtype), mask=(slot == j)[:, None])


@functools.partial(jax.jit, static_argnames=("activation", "split",
                                             "x_offset", "config",
                                             "interpret"))
def causal_conv1d_step(x, conv_state, start, weight, bias=None,
                       activation: str | None = "silu", split=None,
                       x_offset: int = 0, *,
                       config: ConvConfig = ConvConfig(),
                       interpret: bool = False):
  """Same signature and results as the reference
  (`conv.causal_conv1d_step_reference`), plus a tuning config."""
  b = x.shape[0]
  sizes, grid, operands, kw = _launch(x, conv_state, start, weight, bias,
                                      activation, split, x_offset, config)
  out_shape = tuple(jax.ShapeDtypeStruct((b, n), x.dtype) for n in sizes) + (
      jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),)
  *pieces, new_state = pl.pallas_call(
      functools.partial(_kernel, **kw),
      grid=grid,
      out_shape=out_shape,
      input_output_aliases={1: len(sizes)},
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
      interpret=interpret,
      name="replayssm_conv_step",
  )(*operands)
  slot = operands[2]  # each row's oldest slot, now the new input's
  return tuple(pieces), new_state, (slot + 1) % kw["k1"]


def _launch(x, conv_state, start, weight, bias, activation, split, x_offset,
            config):
  """(piece sizes, grid, operands, kernel keywords) of either kernel: the
  shapes checked, the blocks chosen, the ring's oldest slots."""
  b, dim = x.shape[0], conv_state.shape[-1]
  k = weight.shape[1]
  sizes = (dim,) if split is None else tuple(split)
  problem = shape_problem(sizes, k, config)
  if problem is not None:
    raise NotImplementedError(problem)
  bc = block_channels(sizes, config)
  br = tu.pow2_divisor(b, config.block_rows)
  slot = start.astype(jnp.int32) % (k - 1)
  operands = [x, conv_state, slot, weight] + ([bias] if bias is not None
                                               else [])
  kw = dict(k1=k - 1, has_bias=bias is not None,
            silu=activation in ("silu", "swish"), block_rows=br,
            block_channels=bc, piece_blocks=tuple(n // bc for n in sizes),
            x_offset=x_offset)
  return sizes, (b // br, dim // bc), operands, kw


def _window_kernel(x_ref, state_ref, slot_ref, w_ref, *refs, k1, window,
                   has_bias, silu, block_rows, block_channels, piece_blocks,
                   x_offset):
  """The window's T outputs of a [block_rows, block_channels] block: the
  ring read once, oldest first, then the window's inputs, each tap summed
  in float32 in `causal_conv1d`'s order (oldest tap first)."""
  bias_ref = refs[0] if has_bias else None
  out_refs = refs[1:] if has_bias else refs
  i, c = pl.program_id(0), pl.program_id(1)
  rows = pl.ds(i * block_rows, block_rows)
  cols = pl.ds(c * block_channels, block_channels)
  # The inputs oldest first: the ring's k1, then the window's T.
  src = [v.astype(F32) for v in _ordered_ring(state_ref, slot_ref[rows],
                                              rows, cols, k1)]
  src += [x_ref[rows, t, pl.ds(x_offset + c * block_channels,
                               block_channels)].astype(F32)
          for t in range(window)]
  w = [w_ref[cols, j].astype(F32)[None, :] for j in range(k1 + 1)]
  for t in range(window):
    y = src[t] * w[0]
    for j in range(1, k1 + 1):
      y = y + src[t + j] * w[j]
    y = _bias_act(y, bias_ref, cols, silu)
    _store_pieces(out_refs, piece_blocks, c, block_channels, (rows, t), y)


@functools.partial(jax.jit, static_argnames=("activation", "split",
                                             "x_offset", "config",
                                             "interpret"))
def causal_conv1d_window(x, conv_state, start, weight, bias=None,
                         activation: str | None = "silu", split=None,
                         x_offset: int = 0, *,
                         config: ConvConfig = ConvConfig(),
                         interpret: bool = False):
  """Same signature and results as the reference
  (`conv.causal_conv1d_window_reference`), plus a tuning config (the step
  kernel's: the same blocks). XLA runs the reference as a concatenate of
  the ordered ring and the window, the taps, and slices of the output
  into x, B and C; here one launch reads the ring and the window once and
  writes the pieces."""
  b, window = x.shape[:2]
  sizes, grid, operands, kw = _launch(x, conv_state, start, weight, bias,
                                      activation, split, x_offset, config)
  return tuple(pl.pallas_call(
      functools.partial(_window_kernel, window=window, **kw),
      grid=grid,
      out_shape=tuple(jax.ShapeDtypeStruct((b, window, n), x.dtype)
                      for n in sizes),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps),
      interpret=interpret,
      name="replayssm_conv_window",
  )(*operands))
