"""Pallas Mosaic GPU kernels: the baseline Mamba-2 step and the replay flush.

Mosaic GPU moves tiles with TMA and pipelines the grid's sequential axis
(`max_concurrent_steps` tiles in flight per CTA). The baseline step is
registered as implementation "pallas_mosaic_gpu" beside the Triton one;
`implementation=None` keeps the Triton kernel, because this entry
(`plgpu.kernel`) has no input/output aliasing, so the new state goes to a
fresh buffer that XLA copies wherever it cannot alternate two buffers
(H200: benchmarks/kernel_tuning/mosaic_gpu_kernels_h200.md). `flush` is the replay flush
route (`ReplayConfig(flush_route="mosaic_gpu")`, the default for plain f32
checkpoints at large batch on Hopper): it updates the checkpoint in place
through a ref in `pl.run_state` (the mesh discharge aliases a written
input ref to its output). `pallas_call` for Mosaic GPU has no lowering
rule on jax 0.11.2 (an AssertionError in pallas_call's GPU lowering),
hence the default entry.

Design: a small XLA pre-pass turns the per-(row, head) scalars into [P]
vectors (decay = exp(A dt') and dt' x), because a Mosaic GPU program
reads its operands as TMA-copied tiles, not as scalars. One grid step per
(row, head): read the [P, N] state tile, s = s * decay + (dt' x) B^T,
y0 = s C, write the tile back in place (input/output aliasing). D x and the
silu(z) gate are applied to y0 by XLA after the call. Extra traffic of the
pre/post passes per (row, head): 3 [P] f32 vectors written and read
(~1.5 KB against the 16-32 KB state tile's read + write).

Shapes on the GPU: headdim a multiple of 64 (one warpgroup's WGMMA row
tile) and dstate * itemsize(state) a multiple of 128 bytes (the swizzle);
the kernel says so otherwise. Interpret mode (off-GPU) runs any shape, so
CPU tests exercise the same kernel body; only the register layouts of the
loads (which interpret mode cannot express) differ.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import triton_utils as tu
from replayssm_jax.reference import process_dt

F32 = jnp.float32
_SWIZZLE = 128  # bytes
_TMA_MAX_ELEMS = 256  # elements per dimension of one TMA copy


@dataclasses.dataclass(frozen=True)
class MosaicSSUConfig:
  """Tuning of the Mosaic GPU kernels (baseline step, replay flush).

  Attributes:
    heads_per_program: heads one CTA processes one after the other (the
      sequential grid axis, pipelined); must divide nheads. None: the
      largest divisor of nheads <= 8.
    max_concurrent_steps: tiles in flight per CTA (TMA pipeline depth).
    entry: "kernel" (`plgpu.kernel` + `plgpu.emit_pipeline`, the entry
      jax recommends; GPU only; no input/output aliasing, so the baseline
      step writes its new state to a fresh buffer), "pallas_call" (grid
      pipelined by pallas_call; also runs in interpret mode; deprecated
      for Mosaic GPU since jax 0.10, and its lowering fails with an
      AssertionError on the H200 with jax 0.11.2), or None: "kernel" on
      the GPU, "pallas_call" in interpret mode.
  """
  heads_per_program: int | None = None
  max_concurrent_steps: int = 2
  entry: str | None = None

  def __post_init__(self):
    if self.entry not in (None, "pallas_call", "kernel"):
      raise ValueError(f"MosaicSSUConfig.entry must be None, 'pallas_call' "
                       f"or 'kernel', got {self.entry!r}.")
    for name in ("heads_per_program", "max_concurrent_steps"):
      v = getattr(self, name)
      if v is None and name == "heads_per_program":
        continue
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MosaicSSUConfig.{name} must be an int >= 1, got "
                         f"{v!r}.")

  def resolve_heads_per_program(self, nheads: int) -> int:
    if self.heads_per_program is None:
      return max(k for k in range(1, 9) if nheads % k == 0)
    if nheads % self.heads_per_program:
      raise NotImplementedError(
          f"MosaicSSUConfig.heads_per_program = {self.heads_per_program} "
          f"does not divide nheads = {nheads}.")
    return self.heads_per_program

  def resolve_entry(self, interpret: bool) -> str:
    if self.entry is None:
      return "pallas_call" if interpret else "kernel"
    if interpret and self.entry == "kernel":
      raise NotImplementedError(
          "MosaicSSUConfig(entry='kernel') runs on the GPU only: interpret "
          "mode cannot run its pipeline's async copies; use entry="
          "'pallas_call' off-GPU.")
    return self.entry


def shape_problem(ssm_state, on_gpu: bool = True) -> str | None:
  """Why the GPU kernel cannot take this state, or None (interpret mode,
  on_gpu=False, takes any shape)."""
  _, _, headdim, dstate = ssm_state.shape
  if not on_gpu:
    return None
  if headdim % 64:
    return (f"headdim = {headdim} is not a multiple of 64 (the Mosaic GPU "
            f"kernel's WGMMA row tile); use implementation='pallas' or "
            f"'reference'.")
  row_bytes = dstate * jnp.dtype(ssm_state.dtype).itemsize
  if row_bytes % _SWIZZLE or dstate % 8:
    return (f"dstate = {dstate} x {jnp.dtype(ssm_state.dtype).name} is "
            f"{row_bytes} bytes per state row, not a multiple of "
            f"{_SWIZZLE} (the Mosaic GPU kernel's swizzle); use "
            f"implementation='pallas' or 'reference'.")
  return None


def counts_fit_tma(count) -> bool:
  """Whether the persistent flush can copy the [batch] counters to SMEM:
  TMA moves whole 128-byte granules."""
  return (count.shape[0] * jnp.dtype(count.dtype).itemsize) % 128 == 0


def _tile_transforms(dtype, swizzle=_SWIZZLE):
  """SMEM tiling + swizzle of a [P, N] tile, as WGMMA-layout loads need (a
  WGMMA operand's K steps are swizzle bytes wide)."""
  cols = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(swizzle))


def _loader(interpret):
  """load(ref, layout): a register-layout load on the GPU; interpret mode
  has no rule for plgpu.load (layouts only exist on the GPU): a plain
  read there."""
  def load(ref, layout):
    return ref[...] if interpret else plgpu.load(ref, (), layout=layout)
  return load


def _broadcast(v, shape, axis):
  return jax.lax.broadcast_in_dim(v, shape, (axis,))


def _ssu_kernel(s_ref, dec_ref, dtx_ref, b_ref, c_ref, y_ref, so_ref, *,
                interpret):
  # so_ref aliases s_ref in HBM; each has its own SMEM tile.
  load, tile = _loader(interpret), plgpu.Layout.WGMMA
  row, col = tile.reduce(1), tile.reduce(0)
  shape = s_ref.shape
  s = load(s_ref, tile).astype(F32)
  dec = _broadcast(load(dec_ref, row), shape, 0)
  dtx = _broadcast(load(dtx_ref, row), shape, 0)
  bv = _broadcast(load(b_ref, col).astype(F32), shape, 1)
  cv = _broadcast(load(c_ref, col).astype(F32), shape, 1)
  s = s * dec + dtx * bv
  y_ref[...] = jnp.sum(s * cv, axis=1)
  so_ref[...] = s.astype(so_ref.dtype)


def _launch(kernel, operands, in_kinds, out_kinds, out_shape, *, name,
            state, ngroups, config, interpret, aliases=None):
  """Runs kernel over the grid (batch, nheads / hpp, hpp): CTA (i, j)
  streams heads j*hpp + k, k = 0..hpp-1 (the sequential axis), with
  max_concurrent_steps tiles in flight. Operand kinds: "tile" a [P, N]
  state tile of the head, "vec" its [P] vector, "grp" its group's [N]
  vector."""
  batch, nheads, headdim, dstate = state.shape
  hpg = nheads // ngroups
  hpp = config.resolve_heads_per_program(nheads)
  entry = config.resolve_entry(interpret)
  sq = pl.Squeezed()
  maps = dict(
      tile=lambda i, j, k: (i, j * hpp + k, 0, 0),
      vec=lambda i, j, k: (i, j * hpp + k, 0),
      grp=lambda i, j, k: (i, (j * hpp + k) // hpg, 0))
  kernel = functools.partial(kernel, interpret=interpret)

  def specs(bind):
    """(input specs, output specs); bind(map) -> the entry's index map."""
    def spec(kind):
      if kind == "tile":
        return plgpu.BlockSpec(
            (sq, sq, headdim, dstate), bind(maps["tile"]),
            **({} if interpret else dict(
                transforms=_tile_transforms(state.dtype))))
      size = headdim if kind == "vec" else dstate
      return pl.BlockSpec((sq, sq, size), bind(maps[kind]))
    return [spec(k) for k in in_kinds], [spec(k) for k in out_kinds]

  if entry == "kernel":  # plgpu.kernel + emit_pipeline (GPU only)
    def body(*refs):
      i, j = jax.lax.axis_index("row"), jax.lax.axis_index("block")
      ins, outs = specs(lambda m: lambda k: m(i, j, k))
      plgpu.emit_pipeline(
          lambda _, *tiles: kernel(*tiles), grid=(hpp,), in_specs=ins,
          out_specs=outs,
          max_concurrent_steps=config.max_concurrent_steps)(*refs)

    return plgpu.kernel(
        body, out_type=out_shape, grid=(batch, nheads // hpp),
        grid_names=("row", "block"))(*operands)
  ins, outs = specs(lambda m: m)  # pl.pallas_call: also interpret mode
  return pl.pallas_call(
      kernel, grid=(batch, nheads // hpp, hpp), in_specs=ins,
      out_specs=outs, out_shape=out_shape,
      input_output_aliases=aliases or {},
      compiler_params=plgpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "sequential"),
          max_concurrent_steps=config.max_concurrent_steps),
      interpret=interpret, name=name,
  )(*operands)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "config",
                                             "interpret"))
def selective_state_update(ssm_state, x, dt, A, B, C, D=None, z=None,
                           dt_bias=None, dt_softplus=False, *,
                           config: MosaicSSUConfig = MosaicSSUConfig(),
                           interpret: bool = False):
  """Same signature and results as the reference, plus a tuning config."""
  d = process_dt(dt, dt_bias, dt_softplus)  # [batch, nheads] f32
  decay = jnp.broadcast_to(jnp.exp(A.astype(F32) * d)[..., None],
                           x.shape).astype(F32)
  dtx = d[..., None] * x.astype(F32)  # [batch, nheads, headdim]
  y0, new_state = _launch(
      _ssu_kernel, (ssm_state, decay, dtx, B, C),
      ("tile", "vec", "vec", "grp", "grp"), ("vec", "tile"),
      [jax.ShapeDtypeStruct(x.shape, F32),
       jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype)],
      name="replayssm_mosaic_selective_state_update", state=ssm_state, ngroups=B.shape[1], config=config,
      interpret=interpret, aliases={0: 1})
  y = tu.finish_output(y0, x.astype(F32),
                           None if D is None else D[:, None], z)
  return y.astype(x.dtype), new_state
