"""Tuning of the GDN kernels and the checks that refuse what they cannot
run (by name, so the dispatcher falls back to the reference or says why).

The step kernels' defaults (baseline and replay step) were chosen on an
H200 at a Qwen3.5-shaped layer (benchmarks/kernel_tuning/gdn_kernels.md;
the current figures: benchmarks/README.md, "Gated DeltaNet kernels"):
[128, 64] state tiles with 4 warps, smaller tiles only when the grid would
otherwise hold fewer than 256 programs (batch 1), and whole
rows with 4 warps where a read copy needs them; the baseline step
pipelined over 3 stages for an f32 state and 2 for a 16-bit one (1 for the
other kernels); the replay step's ring weights formed once per row and
value head in a first launch (`ring_weights.py`) when the state has no
read copy and the grid has at least RING_WEIGHTS_MIN_ROWS rows x value
heads (timed at batch 64 and 256; a read copy's step was slower with it,
and at smaller batches the second launch is untimed); and a state with a
read copy stepped in two launches from the same size (`split_routes`:
whole rows only where it flushes, the copy read in [128, 64] tiles); and
the replay step's flush fold by tensor-core products (`flush_fold`). The
verify kernels' defaults were timed on an H100 at batch 256 (and 64):
[128, 32] tiles with 4 warps (2 for a 16-bit checkpoint), whole rows with
8, their window coefficients from a first launch.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import triton_utils as tu
from pallas_kernels.config_base import _check_pow2, _check_registers

# The longest window the verify kernel takes (it unrolls the forward
# substitution in registers).
MAX_VERIFY_WINDOW = 8


@dataclasses.dataclass(frozen=True)
class GDNConfig:
  """Launch fields of the GDN kernels (`pallas_kernels.gdn`).

  Attributes:
    block_v: value columns per program (the state tile is [key_dim,
      block_v]); None: `default_block_v`. A replay state with a read copy
      or stochastic rounding needs whole rows (block_v = value_dim: the
      copy's scales and the random bits' element indices span a row) where
      it flushes: in the replay step's one launch, or in the flush launch
      of split routes, whose output launch takes block_v; in the verify's
      fold launch, whose window launch takes block_v (None: whole rows
      there too, the timed default).
    num_warps: Triton warps per program; None: `default_num_warps`.
    flush_num_warps: the flush launch's warps under split routes (replay
      step only; None: as num_warps). Compiled offline for sm_90a at the
      Qwen3.5 layer with an fp8 read copy, the whole-row flush program
      spills at 4 warps (255 registers) and not at 8 (176-199); untimed,
      so None stays the default.
    max_registers: replay step only, a register cap per thread (PTX
      .maxnreg, `triton_utils.capped_name`) of its launch (of both launches
      under split routes); None: no cap. Offline for sm_90a the one-launch
      program with the tensor-core flush fold holds 166 registers (f16
      checkpoint: 174) against 128 with the rank-1 fold, one block of 4
      warps per SM fewer; capped at 128 it spills 72-92 B. Untimed.
    num_stages: Triton pipelining stages; None: `default_num_stages`.
    ring_weights: replay step only. None: `default_ring_weights`. True: a
      first launch (`ring_weights.gdn_ring_weights`, one program per row
      and key head) forms the scalar weights of each (row, value head)
      over its ring slots -- the coefficients of the live d_j in the
      correction and in the output, the checkpoint's decay and the
      token's k . q -- and the step's value-block programs read them,
      streaming only the checkpoint tile and the d ring instead of each
      reducing the key ring against q and k and forming the decays again.
      Every precision policy the step takes. The verify kernels: the
      window's coefficients (normalisation factors, the key ring and the
      window's keys against each other, decays) formed once per key head
      and row by a first launch (`verify_weights.gdn_verify_weights`)
      instead of in every value-block program; None: on (it took the
      window program from 147 barriers to 47, `triton_offline.py --op
      gdn_verify`, and made the verify faster at every launch shape timed:
      benchmarks/kernel_tuning/gdn_kernels.md, "The speculative
      verify"). Refused by the baseline step. False: no first launch.
    split_routes: replay step only. None: `default_split_routes`. True:
      the output route (rows with count < L-1) and the flush route (count
      == L-1) in two launches, the programs of the other route's rows
      exiting at once, so each compiled program holds one route's code
      and registers; a state that needs whole rows (a read copy,
      stochastic rounding) needs them in the flush launch only, and the
      output launch reads value tiles (`GDNPlan.output_block_v`). False:
      both routes in one launch.
    heads_per_program: the baseline step and split routes' output launch
      (None: 1). Value heads each of its programs steps through in a loop
      (a divisor of the value heads), so that with num_stages > 1 the
      next head's tile loads while the program works on this one.
    flush_fold: replay step only, how a flush row folds its L - 1 ring
      slots into the checkpoint tile. "rank1": exact f32 rank-1 updates in
      a loop over the slots. "dot": tensor-core products of the key
      window [L, key_dim] and the d window [L, block_v]
      (`replay.fold.fold_product`: bf16 pieces with f32 accumulation
      where the d ring is bf16, three pieces for an f32 checkpoint and two
      for a 16-bit one, else TF32 x3); needs buffer_len and key_dim >= 16
      (Triton dot tiles). None: "dot" where those reach 16, else "rank1"
      (the flush step faster at batch 64 and 256, the staggered step no
      slower: benchmarks/kernel_tuning/gdn_kernels.md, "The flush
      fold").
  """
  block_v: int | None = None
  num_warps: int | None = None
  flush_num_warps: int | None = None
  max_registers: int | None = None
  num_stages: int | None = None
  ring_weights: bool | None = None
  split_routes: bool | None = None
  heads_per_program: int | None = None
  flush_fold: str | None = None

  def __post_init__(self):
    for name in ("block_v", "num_warps", "flush_num_warps",
                 "heads_per_program"):
      if getattr(self, name) is not None:
        _check_pow2(name, getattr(self, name))
    _check_registers("max_registers", self.max_registers)
    if self.num_stages is not None and (
        not isinstance(self.num_stages, int) or self.num_stages < 1):
      raise ValueError(f"num_stages must be None or an int >= 1, got "
                       f"{self.num_stages!r}.")
    for name in ("ring_weights", "split_routes"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be None or a bool, got {value!r}.")
    if self.flush_fold not in (None, "rank1", "dot"):
      raise ValueError(f"flush_fold must be None, 'rank1' or 'dot', got "
                       f"{self.flush_fold!r}.")


@dataclasses.dataclass(frozen=True)
class GDNPlan:
  """A GDNConfig resolved for one call."""
  block_v: int
  num_warps: int
  num_stages: int
  ring_weights: bool = False
  split_routes: bool = False
  # The output launch's value columns under split_routes, or the verify
  # window launch's (value tiles where only the flush or fold launch needs
  # whole rows); 0: block_v. Its warps (0: num_warps).
  output_block_v: int = 0
  output_num_warps: int = 0
  # The flush launch's warps under split routes (0: num_warps).
  flush_num_warps: int = 0
  # The replay step's register cap (None: none).
  max_registers: int | None = None
  # Value heads per program: the baseline step's, or the output launch's
  # under split_routes.
  heads_per_program: int = 1
  # The replay step's flush fold: "rank1", "dot" or None (the kernel's
  # default by buffer_len and key_dim: GDNConfig.flush_fold).
  flush_fold: str | None = None

  def launch(self, route: str) -> tuple[int, int]:
    """(block_v, num_warps) of one launch: "output" (the split replay
    step's output launch, the verify's window launch: output_block_v /
    output_num_warps where set), "flush" (the split replay step's flush
    launch: flush_num_warps where set), else the plan's own."""
    if route == "output":
      return (self.output_block_v or self.block_v,
              self.output_num_warps or self.num_warps)
    if route == "flush":
      return self.block_v, self.flush_num_warps or self.num_warps
    return self.block_v, self.num_warps


# Tile elements ([key_dim, block_v]) of the step kernels' default and of
# the verify kernels' ([128, 32], the fastest of the verify's sweep at
# batch 256: benchmarks/kernel_tuning/gdn_kernels.md, "The speculative
# verify"); the step tile is halved, down to MIN_TILE, while the grid has
# fewer than MIN_PROGRAMS programs.
STEP_TILE, VERIFY_TILE, MIN_TILE = 8192, 4096, 2048
MIN_PROGRAMS = 256
# Rows x value heads from which the replay step forms its ring weights in a
# first launch by default (batch 64 at 32 value heads).
RING_WEIGHTS_MIN_ROWS = 2048


def default_block_v(key_dim: int, value_dim: int, rows: int | None = None,
                    kernel: str = "step") -> int:
  """Value columns per program. kernel "step": tiles of STEP_TILE elements
  (block_v 64 at key_dim 128), halved while rows * (value_dim // block_v)
  programs (rows: batch x value heads) are fewer than MIN_PROGRAMS, down to
  MIN_TILE elements; "verify": VERIFY_TILE elements."""
  tile = STEP_TILE if kernel == "step" else VERIFY_TILE
  bv = max(1, min(value_dim, tile // key_dim))
  if kernel == "step" and rows is not None:
    floor = max(1, min(value_dim, MIN_TILE // key_dim))
    while bv > floor and rows * (value_dim // bv) < MIN_PROGRAMS:
      bv //= 2
  return bv


def default_num_warps(key_dim: int, block_v: int, kernel: str = "step",
                      state_dtype=None) -> int:
  """4 warps for the step kernels (the fastest or tied at every tile the
  launch sweep timed, whole rows included: benchmarks/kernel_tuning/
  gdn_kernels.md, "Launch defaults"); the verify kernels: up to 4096 tile
  elements 4 warps, or 2 for a 16-bit checkpoint (state_dtype: faster at
  batch 64 and 256, where an f32 checkpoint was slower with them), 8 above
  (whole rows, where 2 warps were several times slower; both: "The
  speculative verify")."""
  if kernel == "step":
    return 4
  if key_dim * block_v > 4096:
    return 8
  narrow = state_dtype is not None and jnp.dtype(state_dtype).itemsize == 2
  return 2 if narrow else 4


def default_num_stages(kernel: str = "step", state_dtype=None) -> int:
  """The baseline step: 3 stages for an f32 state, 2 for a 16-bit one
  (timed at batch 64 and 256: benchmarks/kernel_tuning/gdn_kernels.md,
  "Ring weights and pipelining stages"); 1 otherwise."""
  if kernel != "step" or state_dtype is None:
    return 1
  return 3 if jnp.dtype(state_dtype).itemsize >= 4 else 2


def default_ring_weights(whole_rows: bool, rows: int | None) -> bool:
  """The replay step's ring-weights launch: on for a state without read
  copy or stochastic rounding (whole_rows False) over at least
  RING_WEIGHTS_MIN_ROWS rows x value heads."""
  return (not whole_rows and rows is not None
          and rows >= RING_WEIGHTS_MIN_ROWS)


def default_split_routes(read_copy: bool, rows: int | None) -> bool:
  """The replay step's routes in two launches for a state with a read copy
  over at least RING_WEIGHTS_MIN_ROWS rows x value heads (its output
  launch then reads the copy in value tiles; faster with an fp8 copy at
  batch 64 and 256); one launch otherwise (a state without a copy was
  slower split at batch 64; both: benchmarks/kernel_tuning/gdn_kernels.md,
  "Split routes")."""
  return read_copy and rows is not None and rows >= RING_WEIGHTS_MIN_ROWS


def pow2_problem(**sizes) -> str | None:
  """Why a shape is refused (Triton blocks are powers of two), or None."""
  for name, v in sizes.items():
    if v < 1 or v & (v - 1):
      return (f"{name} = {v} is not a power of two (Triton block shapes "
              f"must be); use implementation='reference'.")
  return None


def plan(config: GDNConfig | None, key_dim: int, value_dim: int,
         whole_rows: bool = False, rows: int | None = None,
         kernel: str = "step", state_dtype=None,
         read_copy: bool = False, num_v_heads: int | None = None) -> GDNPlan:
  """The plan of config for a [.., key_dim, value_dim] state; whole_rows:
  the call needs block_v = value_dim where it flushes (refused by name
  otherwise; under split_routes config.block_v is the output launch's);
  rows:
  batch x value heads (the grid's programs per value block); kernel:
  "replay" (the replay step: every field), "step" (the baseline step:
  refuses ring_weights=True by name) or "verify" (refuses split_routes=True
  by name); state_dtype: the
  baseline step's state dtype (its default stages) or the verify's
  checkpoint dtype (its default warps); read_copy: the replay
  state has a read copy (its default split_routes); num_v_heads: the value
  heads, which heads_per_program must divide."""
  if kernel not in ("step", "replay", "verify"):
    raise ValueError(f"kernel must be 'step', 'replay' or 'verify', got "
                     f"{kernel!r}.")
  config = config or GDNConfig()
  if config.ring_weights and kernel == "step":
    raise NotImplementedError(
        "GDNConfig.ring_weights applies to the replay step and verify "
        "kernels only (gdn_replay_step, gdn_replay_verify), not to the "
        "baseline step; leave it False.")
  if config.flush_fold == "dot" and kernel != "replay":
    raise NotImplementedError(
        "GDNConfig.flush_fold applies to the replay step kernel only "
        "(gdn_replay_step); leave it None.")
  if config.split_routes and kernel != "replay":
    which = "baseline step" if kernel == "step" else "verify kernels"
    raise NotImplementedError(
        f"GDNConfig.split_routes applies to the replay step kernel only "
        f"(gdn_replay_step), not to the {which}; leave it False.")
  tile_kernel = "verify" if kernel == "verify" else "step"
  split = (config.split_routes if config.split_routes is not None
           else kernel == "replay" and default_split_routes(read_copy, rows))
  if config.max_registers is not None and kernel != "replay":
    raise NotImplementedError(
        "GDNConfig.max_registers applies to the replay step kernel only "
        "(gdn_replay_step); leave it None.")
  if config.flush_num_warps and not split:
    raise NotImplementedError(
        f"GDNConfig.flush_num_warps={config.flush_num_warps} applies to the "
        f"flush launch of split routes only (replay step, "
        f"split_routes=True); leave it None.")
  hpp = config.heads_per_program or 1
  if hpp > 1 and kernel != "step" and not split:
    raise NotImplementedError(
        f"GDNConfig.heads_per_program={hpp} applies to the baseline step "
        f"and to the output launch of split routes only; set "
        f"split_routes=True (replay step) or leave it None.")
  if num_v_heads is not None and num_v_heads % hpp:
    raise NotImplementedError(
        f"GDNConfig.heads_per_program ({hpp}) must divide the value heads "
        f"({num_v_heads}).")
  out_bv = 0
  # Only the flush (or the verify's fold) stores whole rows: block_v is
  # then the output (window) launch's, which reads value tiles (the
  # verify's window launch: whole rows by default, tiles untimed).
  if split and whole_rows:
    out_bv = (default_block_v(key_dim, value_dim, rows, tile_kernel)
              if config.block_v is None else min(config.block_v, value_dim))
    config = dataclasses.replace(config, block_v=None)
  elif kernel == "verify" and whole_rows and config.block_v is not None:
    out_bv = min(config.block_v, value_dim)
    config = dataclasses.replace(config, block_v=None)
  if config.block_v is None:
    bv = (value_dim if whole_rows
          else default_block_v(key_dim, value_dim, rows, tile_kernel))
  else:
    bv = min(config.block_v, value_dim)
  for b in (bv, out_bv or bv):
    if value_dim % b:
      raise NotImplementedError(
          f"GDNConfig.block_v ({b}) must divide value_dim ({value_dim}).")
  if whole_rows and bv != value_dim:
    raise NotImplementedError(
        f"GDNConfig.block_v={config.block_v} does not apply: a replay "
        f"state with a read copy or stochastic rounding stores whole "
        f"checkpoint rows (block_v = value_dim = {value_dim}); leave "
        f"block_v None, or split the routes (split_routes=True: block_v "
        f"is then the output launch's).")
  warps = config.num_warps or default_num_warps(key_dim, bv, tile_kernel,
                                                 state_dtype)
  # The output (window) launch beside whole-row stores reads value tiles of
  # a read copy: the rule without the checkpoint dtype (timed at 4 warps).
  out_warps = out_bv and (config.num_warps
                          or default_num_warps(key_dim, out_bv, tile_kernel))
  stages = config.num_stages or default_num_stages(kernel, state_dtype)
  ring = config.ring_weights
  if ring is None:  # the verify kernels: always (GDNConfig's docstring)
    ring = kernel == "verify" or (kernel == "replay"
                                  and default_ring_weights(whole_rows, rows))
  return GDNPlan(block_v=bv, num_warps=warps, num_stages=stages,
                 ring_weights=ring, split_routes=split,
                 output_block_v=out_bv, output_num_warps=out_warps,
                 flush_num_warps=config.flush_num_warps or 0,
                 max_registers=config.max_registers,
                 heads_per_program=hpp, flush_fold=config.flush_fold)


def step_problem(state, **_) -> str | None:
  """`Implementation.supports` of the baseline step kernel."""
  return pow2_problem(key_dim=state.shape[2], value_dim=state.shape[3])


def replay_problem(rstate, policy=None, **_) -> str | None:
  """`Implementation.supports` of the replay step kernel."""
  return (tu.precision_problem(rstate, policy)
          or pow2_problem(key_dim=rstate.checkpoint.shape[2],
                          value_dim=rstate.checkpoint.shape[3],
                          buffer_len=rstate.d_buf.shape[1]))


def verify_problem(rstate, q, policy=None, **_) -> str | None:
  """`Implementation.supports` of the verify kernels (q: [batch, T, ...])."""
  T = q.shape[1]
  if T > MAX_VERIFY_WINDOW:
    return (f"the window length T = {T} exceeds {MAX_VERIFY_WINDOW} (the "
            f"verify kernel unrolls the forward substitution in "
            f"registers); use implementation='reference'.")
  return replay_problem(rstate, policy)
