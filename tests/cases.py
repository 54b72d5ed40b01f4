"""The shared case lists of the test-suite (reused by the kernel tests).

Every parametrized test draws its cases from here so that a kernel test can
run exactly the same shapes/options as the reference tests, e.g.

  from tests import cases, harness

  @pytest.mark.parametrize("case", cases.REPLAY_CASES, ids=cases.case_id)
  def test_my_kernel(case):
    run = harness.run_decode(case, implementation="my_kernel")
    ...

Dims are kept small (CI is a 2-core CPU machine); dtypes are stored by name
so that cases are hashable and their ids readable.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Dims:
  """Layer geometry: grouped heads (ngroups < nheads) by default."""
  batch: int = 4
  nheads: int = 8
  headdim: int = 8
  dstate: int = 16
  ngroups: int = 2

  @property
  def id(self) -> str:
    return (f"b{self.batch}h{self.nheads}p{self.headdim}n{self.dstate}"
            f"g{self.ngroups}")


DIMS = Dims()
# Odd sizes: 3 rows, 3 groups of 2 heads, headdim 12, dstate 8.
ODD_DIMS = Dims(batch=3, nheads=6, headdim=12, dstate=8, ngroups=3)
# One group shared by every head (the Mamba-2 default at TP>1).
ONE_GROUP_DIMS = Dims(batch=3, nheads=4, headdim=16, dstate=8, ngroups=1)

DECODE_STEPS = 98  # 3 * 32 + 2
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def ragged_counts(batch: int, buffer_len: int) -> tuple[int, ...]:
  """Distinct per-row starting counts in [0, L): 0, L-1 (flushes at the first
  step), L//2, L//3, then a spread."""
  L = buffer_len
  base = [0, L - 1, L // 2, L // 3]
  base += [(7 * r + 1) % L for r in range(4, batch)]
  return tuple(int(c) for c in base[:batch])


@dataclasses.dataclass(frozen=True)
class ReplayCase:
  """A multi-step decode from a ragged ReplayState vs the baseline.

  Attributes:
    buffer_len: L.
    dims: geometry.
    with_D, with_z, with_dt_bias, dt_softplus: optional parts of the step.
    checkpoint_dtype, buffer_dtype: ReplayState storage dtypes.
    input_dtype: dtype of x, dt, B, C, z (the activation dtype).
    seed: PRNG seed of every random input of the case.
  """
  buffer_len: int
  dims: Dims = DIMS
  with_D: bool = True
  with_z: bool = True
  with_dt_bias: bool = True
  dt_softplus: bool = True
  checkpoint_dtype: str = "float32"
  buffer_dtype: str = "float32"
  input_dtype: str = "float32"
  seed: int = 0

  @property
  def counts(self) -> tuple[int, ...]:
    return ragged_counts(self.dims.batch, self.buffer_len)

  @property
  def nsteps(self) -> int:
    """At least 3L + 2 steps, so every row flushes at least 3 times. Cases
    share one step count (that of L = 32) so that their random inputs have
    equal shapes and reuse compiled ops."""
    return max(3 * self.buffer_len + 2, DECODE_STEPS)

  @property
  def dtypes(self) -> tuple[str, ...]:
    return (self.checkpoint_dtype, self.buffer_dtype, self.input_dtype)

  @property
  def id(self) -> str:
    opts = "".join(c for c, on in (("D", self.with_D), ("z", self.with_z),
                                   ("b", self.with_dt_bias),
                                   ("s", self.dt_softplus)) if on) or "bare"
    dt = (f"ck{_SHORT[self.checkpoint_dtype]}-buf{_SHORT[self.buffer_dtype]}"
          f"-in{_SHORT[self.input_dtype]}")
    return f"L{self.buffer_len}-{self.dims.id}-{opts}-{dt}"


def _replay_cases() -> list[ReplayCase]:
  out = []
  # Every required L, all options on, f32 everywhere.
  for L in (1, 2, 3, 4, 8, 16, 32):
    out.append(ReplayCase(L, seed=L))
  # No optional part at all (no D, z, dt_bias, softplus; dt already > 0).
  for L in (1, 3, 8):
    out.append(ReplayCase(L, with_D=False, with_z=False, with_dt_bias=False,
                          dt_softplus=False, seed=100 + L))
  # Mixed options.
  out.append(ReplayCase(2, with_z=False, with_dt_bias=False, seed=201))
  out.append(ReplayCase(8, with_D=False, dt_softplus=False, seed=202))
  out.append(ReplayCase(16, with_D=False, with_z=False, seed=203))
  # Other geometries.
  out.append(ReplayCase(5, dims=ODD_DIMS, seed=301))
  out.append(ReplayCase(4, dims=ONE_GROUP_DIMS, with_z=False, seed=302))
  # Low-precision storage (vLLM default: bf16 buffers, f32 checkpoint).
  for L in (4, 16):
    out.append(ReplayCase(L, buffer_dtype="bfloat16", seed=400 + L))
    out.append(ReplayCase(L, checkpoint_dtype="bfloat16",
                          buffer_dtype="bfloat16", seed=410 + L))
    out.append(ReplayCase(L, checkpoint_dtype="float16",
                          buffer_dtype="float16", seed=420 + L))
  out.append(ReplayCase(1, checkpoint_dtype="bfloat16",
                        buffer_dtype="bfloat16", seed=431))
  out.append(ReplayCase(8, checkpoint_dtype="float16", buffer_dtype="float32",
                        seed=432))
  # bf16 activations end to end.
  out.append(ReplayCase(8, buffer_dtype="bfloat16", input_dtype="bfloat16",
                        seed=441))
  return out


REPLAY_CASES: list[ReplayCase] = _replay_cases()
REQUIRED_BUFFER_LENS = (1, 2, 3, 4, 8, 16, 32)


@dataclasses.dataclass(frozen=True)
class SsdCase:
  """One chunked-SSD prefill vs the token-by-token baseline."""
  seqlen: int
  chunk_size: int
  dims: Dims = DIMS
  with_D: bool = True
  with_z: bool = True
  with_dt_bias: bool = True
  dt_softplus: bool = True
  initial_state: bool = True
  seed: int = 0

  @property
  def id(self) -> str:
    opts = "".join(c for c, on in (("D", self.with_D), ("z", self.with_z),
                                   ("b", self.with_dt_bias),
                                   ("s", self.dt_softplus),
                                   ("i", self.initial_state)) if on) or "bare"
    return f"T{self.seqlen}-Q{self.chunk_size}-{self.dims.id}-{opts}"


SSD_CASES: list[SsdCase] = [
    SsdCase(1, 4, seed=1),  # a single token in a padded chunk
    SsdCase(7, 4, seed=2),
    SsdCase(37, 8, seed=3),
    SsdCase(50, 16, seed=4),
    SsdCase(48, 16, seed=5),  # an exact multiple
    SsdCase(20, 32, seed=6),  # chunk longer than the sequence
    SsdCase(13, 1, seed=7),  # one token per chunk
    SsdCase(29, 8, with_D=False, with_z=False, with_dt_bias=False,
            dt_softplus=False, initial_state=False, seed=8),
    SsdCase(23, 4, dims=ODD_DIMS, seed=9),
    SsdCase(19, 8, dims=ONE_GROUP_DIMS, with_z=False, seed=10),
]

# (seqlen, split point, chunk_size): a sequence cut in two, state carried.
SSD_SPLITS = [(45, 19, 8), (32, 16, 8), (17, 1, 4), (24, 23, 16)]

# Chunked prefill, then replay decode: (prefill len, chunk, L, buffer dtype).
PREFILL_DECODE_CASES = [
    (21, 8, 1, "float32"),
    (21, 8, 4, "float32"),
    (16, 4, 8, "float32"),
    (13, 16, 16, "float32"),
    (21, 8, 8, "bfloat16"),
]


@dataclasses.dataclass(frozen=True)
class ConvCase:
  """Causal depthwise conv: prefill vs decode steps vs numpy."""
  seqlen: int
  kernel_size: int
  batch: int = 3
  dim: int = 24
  with_bias: bool = True
  activation: str | None = "silu"
  initial_state: bool = True
  dtype: str = "float32"
  seed: int = 0

  @property
  def id(self) -> str:
    return (f"T{self.seqlen}-k{self.kernel_size}-d{self.dim}-"
            f"{'bias' if self.with_bias else 'nobias'}-{self.activation}-"
            f"{'init' if self.initial_state else 'noinit'}-"
            f"{_SHORT[self.dtype]}")


CONV_CASES: list[ConvCase] = [
    ConvCase(17, 4, seed=1),
    ConvCase(9, 2, seed=2),
    ConvCase(11, 3, with_bias=False, activation=None, seed=3),
    ConvCase(2, 4, seed=4),  # shorter than the conv window
    ConvCase(1, 4, initial_state=False, seed=5),
    ConvCase(13, 4, with_bias=False, initial_state=False, seed=6),
    ConvCase(8, 1, seed=7),  # no history at all
    ConvCase(10, 4, dtype="bfloat16", seed=8),
]

# (seqlen, split point, kernel_size): conv state carried across the split.
CONV_SPLITS = [(17, 6, 4), (9, 1, 4), (12, 11, 3), (10, 2, 4)]


def case_id(case) -> str:
  """pytest id of a case."""
  return case.id


__all__ = [
    "ConvCase", "CONV_CASES", "CONV_SPLITS", "DIMS", "Dims", "ODD_DIMS",
    "ONE_GROUP_DIMS", "PREFILL_DECODE_CASES", "REPLAY_CASES",
    "REQUIRED_BUFFER_LENS", "ReplayCase", "SSD_CASES", "SSD_SPLITS",
    "SsdCase", "case_id", "ragged_counts",
]
