"""What one iteration of each decode loop launches: a census of XLA's
optimized HLO for `generate` (plain decoding) and `speculative_generate`
(replay and snapshot-baseline target states).

At batch 1 the replay spec-decoding loop is host-bound (the device waits
on the host 4.02 ms per iteration against 1.93 in the baseline loop, CUDA
graphs off; benchmarks/speculative_decoding/specdec_h200.json,
profile_kernels_batch1). This script runs
each loop once at a small size with XLA's dump on, finds the loop's
`while` in the dumped module after optimizations, and counts the
instructions of one run of its body (recursing into nested whiles and
calls, and into a conditional's largest branch: one branch runs; fusions
and custom calls count once: each is a launch) by opcode,
with the custom-call targets and the nested control flow listed (a
conditional or a while inside the body makes the host read a predicate
back every iteration).

  PYTHONPATH=. python benchmarks/scripts/spec_hlo_census.py \
      --config=configs/specdec_bench.py --out /tmp/census   # (GPU)
  PYTHONPATH=. python benchmarks/scripts/spec_hlo_census.py \
      --config=configs/specdec_bench.py:smoke --out /tmp/census  # (CPU)

`--loops spec_replay` (a comma-separated subset of plain, spec_replay,
spec_baseline) compiles fewer loops.
"""

import collections
import glob
import json
import os
import re
import tempfile

_DUMP = tempfile.mkdtemp(prefix="spec_hlo_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={_DUMP} --xla_dump_hlo_as_text")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from ml_collections import config_flags

from experiments.decode_bench import build_model
from replayssm_jax.models import ModelConfig, generate, speculative_generate

_CONFIG = config_flags.DEFINE_config_file("config", None, "specdec config")
_OUT = flags.DEFINE_string("out", None, "where census.json goes")
_BATCH = flags.DEFINE_integer("batch", 1, "batch")
_NEW = flags.DEFINE_integer("new_tokens", 8, "tokens per row")
_LOOPS = flags.DEFINE_list("loops", ["plain", "spec_replay", "spec_baseline"],
                           "which loops to census")

# Not launches: data plumbing that XLA resolves at compile time.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast",
         "after-all", "partition-id", "replica-id"}
_COMP_RE = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*?) ([a-z\-]+)\(")


def parse(text):
  """{computation: [(opcode, line)]} of an HLO module's text."""
  comps, cur, entry = {}, None, None
  for line in text.splitlines():
    m = _COMP_RE.match(line)
    if m and "=" not in line.split("{")[0].split("(")[0]:
      cur = m.group(2)
      comps[cur] = []
      if m.group(1):
        entry = cur
      continue
    if line.strip() == "}":
      cur = None
      continue
    if cur is not None:
      mi = _INSTR_RE.match(line)
      if mi:
        comps[cur].append((mi.group(4), line))
  return comps, entry


def _called(line, key):
  m = re.search(key + r"=\{?%?([\w.\-, %]+)\}?", line)
  if not m:
    return []
  return [c.strip().lstrip("%") for c in m.group(1).split(",")]


def census(comps, comp, counts, targets, control, depth=0):
  """Adds the launches of one run of computation `comp` to counts (by
  opcode) and targets (custom calls); a conditional adds its largest
  branch only (one branch runs), a nested while its body once."""
  for op, line in comps.get(comp, []):
    if op in _FREE:
      continue
    if op == "while":
      control.append(f"{'  ' * depth}while (nested)")
      for body in _called(line, "body"):
        census(comps, body, counts, targets, control, depth + 1)
      continue
    if op == "conditional":
      branches = _called(line, "branch_computations") or (
          _called(line, "true_computation") + _called(line,
                                                      "false_computation"))
      runs = []
      for br in branches:
        run = (collections.Counter(), collections.Counter(), [])
        census(comps, br, *run, depth=depth + 1)
        runs.append(run)
      control.append(f"{'  ' * depth}conditional, launches per branch "
                     f"{[sum(r[0].values()) for r in runs]}")
      if runs:
        big = max(runs, key=lambda r: sum(r[0].values()))
        counts.update(big[0])
        targets.update(big[1])
        control.extend(big[2])
      continue
    if op == "call":
      for c in _called(line, "to_apply"):
        census(comps, c, counts, targets, control, depth)
      continue
    counts[op] += 1
    if op == "custom-call":
      m = re.search(r'custom_call_target="([^"]+)"', line)
      targets[m.group(1) if m else "?"] += 1


def loop_census(module_text):
  comps, entry = parse(module_text)
  whiles = [l for op, l in comps[entry] if op == "while"]
  if not whiles:
    return None
  # The decode loop: the while whose body holds the most instructions.
  body = max((_called(l, "body")[0] for l in whiles),
             key=lambda c: len(comps.get(c, [])))
  counts, targets, control = (collections.Counter(), collections.Counter(),
                              [])
  census(comps, body, counts, targets, control)
  return dict(launch_ops=sum(counts.values()), by_opcode=dict(counts),
              custom_calls=dict(targets), control_flow=control)


def newest_module(pattern, seen):
  files = [f for f in glob.glob(os.path.join(_DUMP, pattern))
           if f not in seen and "after_optimizations.txt" in f]
  return max(files, key=os.path.getsize) if files else None


def main(_):
  config = _CONFIG.value
  b = config.bench
  cfg = ModelConfig(**config.model.to_dict())
  model = build_model(cfg, config.seed)
  batch, n_new = _BATCH.value, _NEW.value
  prompts = jax.random.randint(jax.random.PRNGKey(0), (batch, b.prompt_len),
                               0, cfg.vocab_size, jnp.int32)
  lengths = jnp.full((batch,), b.prompt_len, jnp.int32)
  kw = dict(buffer_len=b.buffer_len, checkpoint_dtype=b.checkpoint_dtype)
  from experiments.specdec_bench import OracleProposer  # pylint: disable=g-import-not-at-top
  seen = set(glob.glob(os.path.join(_DUMP, "*")))
  # The proposer's "reference" tokens only set which drafts it proposes
  # (what the loop launches does not depend on them): random ones.
  ref = jax.random.randint(jax.random.PRNGKey(1), (batch, n_new), 0,
                           cfg.vocab_size, jnp.int32)
  proposer = OracleProposer(ref, b.accept_prob, cfg.vocab_size)
  runs = [(name, mode) for name, mode in (
      ("plain", None), ("spec_replay", "replay"),
      ("spec_baseline", "baseline")) if name in _LOOPS.value]
  result = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                config=dict(pattern=cfg.pattern, batch=batch,
                            window=max(b.windows), buffer_len=b.buffer_len,
                            checkpoint_dtype=b.checkpoint_dtype), loops={})
  for name, mode in runs:
    if mode is None:
      jax.block_until_ready(generate(model, prompts, lengths, n_new,
                                     ssm_mode="replay", **kw))
      pattern = "*generate_jit*"
    else:
      jax.block_until_ready(speculative_generate(
          model, proposer, prompts, lengths, n_new, max(b.windows),
          ssm_mode=mode, **kw))
      pattern = "*spec_jit*"
    path = newest_module(pattern, seen)
    seen = set(glob.glob(os.path.join(_DUMP, "*")))
    if path is None:
      result["loops"][name] = dict(error=f"no dumped module {pattern}")
      continue
    with open(path) as f:
      res = loop_census(f.read())
    result["loops"][name] = dict(res or {}, module=os.path.basename(path))
    print(name, json.dumps({k: v for k, v in (res or {}).items()
                            if k != "by_opcode"}), flush=True)
    print("  by opcode:", json.dumps((res or {}).get("by_opcode")),
          flush=True)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "census.json"), "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
