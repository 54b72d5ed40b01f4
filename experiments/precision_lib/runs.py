"""The decode configurations of the precision study.

A `Run` is one way to hold the recurrent layers' decode state:

  replay    ssm_mode="replay" with `init_state(precision=policy)` at buffer
            length L (buffers config.buffer_dtype, SR seed config.sr_seed);
  baseline  ssm_mode="baseline" with the full state stored every step in a
            policy's storage dtype (`states.baseline_storage_dtype`: the
            read copy's dtype, else the master's) and rounding: the "round
            every step" contrast. One run per distinct (dtype, rounding);
            (float32, rn) is the f32 reference itself.
"""

from __future__ import annotations

import dataclasses
import gc

import jax

from replayssm_jax import precision as P
from replayssm_jax.models import states as S
from replayssm_jax.precision import PrecisionPolicy

SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16",
         "float8_e4m3fn": "fp8", "int8": "int8"}


@dataclasses.dataclass(frozen=True)
class Run:
  """One decode configuration (see the module docstring)."""
  kind: str  # "replay" | "baseline"
  label: str  # the preset (replay) or "<dtype>+<rounding>" (baseline)
  policy_name: str  # the preset the run comes from
  policy: PrecisionPolicy
  L: int | None = None  # replay buffer length
  storage_dtype: str | None = None  # baseline storage
  rounding: str | None = None

  @property
  def ssm_mode(self) -> str:
    return "replay" if self.kind == "replay" else "baseline"

  @property
  def buffer_len(self) -> int:
    return self.L or 1


def make_policy(name: str, config) -> PrecisionPolicy:
  """Preset `name` with config.buffer_dtype and config.sr_seed."""
  return PrecisionPolicy.preset(name).replace(
      buffer_dtype=config.buffer_dtype, seed=config.sr_seed)


def baseline_key(policy: PrecisionPolicy) -> tuple[str, str]:
  """(storage dtype, rounding) of the every-step baseline of `policy`;
  rounding "rn", "sr", or "sr:<sr_rng>" for a non-default hash."""
  dtype = S.baseline_storage_dtype(policy)
  return dtype, "rn" if dtype == "float32" else policy.rounding


def baseline_label(key: tuple[str, str]) -> str:
  return f"{SHORT[key[0]]}+{key[1]}"


def replay_runs(config, names, buffer_lens) -> list[Run]:
  """A replay run per preset x L."""
  out = []
  for name in names:
    policy = make_policy(name, config)
    out += [Run("replay", name, name, policy, int(L)) for L in buffer_lens]
  return out


def baseline_runs(config, names) -> list[Run]:
  """Every-step baseline runs of the presets `names`, one per distinct
  (dtype, rounding) other than the f32 reference. A float dtype rounded to
  nearest runs as the plain policy of that dtype."""
  runs, done = [], {("float32", "rn")}
  for name in names:
    policy = make_policy(name, config)
    key = baseline_key(policy)
    if key in done:
      continue
    done.add(key)
    if key[0] not in P.QUANTIZED_DTYPES and key[1] == "rn":
      policy = PrecisionPolicy(checkpoint_dtype=key[0]).replace(
          buffer_dtype=config.buffer_dtype, seed=config.sr_seed)
    runs.append(Run("baseline", baseline_label(key), name, policy, None,
                    key[0], key[1]))
  return runs


def baseline_policies(config) -> tuple:
  """The presets whose every-step baselines run (config.baseline_policies;
  None: config.policies)."""
  names = config.get("baseline_policies")
  return tuple(config.policies if names is None else names)


def table_policies(config) -> tuple:
  """The report's rows: the replay presets, then any baseline-only ones."""
  extra = [n for n in baseline_policies(config) if n not in config.policies]
  return tuple(config.policies) + tuple(dict.fromkeys(extra))


def sub_runs(config, part) -> list[Run]:
  """The runs of a study part (config.generation / config.state_error):
  its `policies` (None: config.policies) x its `buffer_lens` (None:
  config.buffer_lens), then the every-step baselines of config's
  baseline presets when its `baselines` is set."""
  names = part.get("policies")
  names = tuple(config.policies if names is None else names)
  lens = part.get("buffer_lens")
  lens = tuple(config.buffer_lens if lens is None else lens)
  runs = replay_runs(config, names, lens)
  if part.get("baselines", True) and config.baseline_contrast:
    runs += baseline_runs(config, baseline_policies(config))
  return runs


def score_runs(config) -> list[Run]:
  """The scores' runs, in the order a slice stopped by its time limit
  should meet them: the replay runs at the generations' L (the L every
  other stage and the cross-model table read), the every-step baselines,
  then the replay runs at the other L."""
  lens = tuple(int(L) for L in config.buffer_lens)
  first = config.get("generation", {}).get("buffer_lens") or lens
  first = [L for L in lens if L in set(int(L) for L in first)]
  rest = [L for L in lens if L not in first]
  return (sub_runs(config, dict(buffer_lens=first))
          + replay_runs(config, config.policies, rest))


IDENTITY = ("kind", "model", "label", "L", "mode", "run_kind", "block")


def identity(record) -> tuple[str, ...]:
  """What tells one study record from another: a merge of slices and a
  resumed run keep one record per identity."""
  return tuple(str(record.get(k)) for k in IDENTITY)


class ResumableWriter:
  """A metrics writer that starts from the records of an earlier run of
  the same study (config.resume): it writes them first; `done(record)` is
  the earlier record of that identity (None if none), and `write` of such
  a record returns the earlier one instead of writing it again. The study
  skips a run whose record is done, and a stage's reference when every run
  of the stage is."""

  def __init__(self, writer, previous=()):
    self.writer = writer
    self.previous = {identity(r): r for r in previous}
    for r in self.previous.values():
      writer.write(r)

  def done(self, record) -> dict | None:
    return self.previous.get(identity(record))

  def write(self, record=None, **fields) -> dict:
    rec = dict(record or {}, **fields)
    return self.done(rec) or self.writer.write(rec)


def release_compiled() -> None:
  """Drops jax's compiled programs between runs. Each decode configuration
  compiles programs of its own (a static policy), used by that run only;
  kept, the programs of a few hundred runs exhausted the CPU backend's
  memory mappings (LLVM "Cannot allocate memory", then a crash, at the
  default vm.max_map_count of 65530)."""
  jax.clear_caches()
  gc.collect()
