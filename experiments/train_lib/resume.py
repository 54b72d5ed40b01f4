"""Resuming an `experiments.train` run from its last saved step.

A run with `train.resume` set saves, beside each parameter checkpoint
(`checkpoints/<step>/`, orbax), its optimizer state and counters:

  train_state/<step>/       the optax state's leaves (orbax, a flat dict
                            "00000" -> array in `jax.tree.leaves` order);
  train_state/<step>.json   step, the run's timing totals so far, leaf
                            count; written last, so it marks a complete
                            save.

Only the newest train state is kept (an AdamW state is twice the
parameters). A later `experiments.train` call on the same workdir with the
same config (the fields in `IGNORED` may differ) restores the parameters
and the optimizer state of the newest step that has both and continues from
there: batches are a pure function of the step index, so the resumed run
sees the data an uninterrupted one would. metrics.jsonl keeps the records
up to that step (later ones, from a call stopped between checkpoints, are
dropped) and grows from there.
"""

from __future__ import annotations

import json
import os
import shutil

from absl import logging
import jax
import jax.numpy as jnp

from experiments import common

TRAIN_STATE_DIR = "train_state"
# Config fields a resumed call may change: when to stop, whether to resume.
IGNORED = ("train.stop_after_s", "train.resume")


def _flat_config(config) -> dict:
  """config.json's fields as {"a.b": value} (JSON values)."""
  out = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f"{prefix}{k}.", v)
    else:
      out[prefix[:-1]] = node

  walk("", common.to_jsonable(config))
  return out


def config_changes(old: dict, config) -> list[str]:
  """The fields (outside IGNORED) in which `config` differs from a
  previous call's config.json contents `old`."""
  a, b = _flat_config(old), _flat_config(config)
  return sorted(k for k in set(a) | set(b)
                if k not in IGNORED and a.get(k) != b.get(k))


def _meta_path(workdir: str, step: int) -> str:
  return os.path.join(workdir, TRAIN_STATE_DIR, f"{step}.json")


def saved_steps(workdir: str) -> list[int]:
  """Steps with a complete train state (its .json written), ascending."""
  root = os.path.join(workdir, TRAIN_STATE_DIR)
  if not os.path.isdir(root):
    return []
  return sorted(int(n[:-5]) for n in os.listdir(root)
                if n.endswith(".json") and n[:-5].isdigit()
                and os.path.isdir(os.path.join(root, n[:-5])))


def save(workdir: str, step: int, opt_state, meta: dict) -> str:
  """Saves the optimizer state of `step` and its counters; removes older
  train states. Returns the state's directory."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  root = os.path.join(os.path.abspath(workdir), TRAIN_STATE_DIR)
  path = os.path.join(root, str(step))
  leaves = jax.tree.leaves(opt_state)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {f"{i:05d}": x for i, x in enumerate(leaves)},
               force=True)
  with open(_meta_path(workdir, step), "w") as f:
    json.dump(dict(meta, step=step, num_leaves=len(leaves)), f, indent=1)
  for old in saved_steps(workdir):
    if old != step:
      os.remove(_meta_path(workdir, old))
      shutil.rmtree(os.path.join(root, str(old)), ignore_errors=True)
  logging.info("train state: %s", path)
  return path


def restore(workdir: str, step: int, opt_state_like) -> tuple[object, dict]:
  """(optimizer state of `step` shaped as `opt_state_like`, its counters).
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with open(_meta_path(workdir, step)) as f:
    meta = json.load(f)
  leaves, treedef = jax.tree.flatten(opt_state_like)
  if meta["num_leaves"] != len(leaves):
    raise ValueError(f"train state of step {step} holds {meta['num_leaves']} "
                     f"optimizer leaves, the optimizer has {len(leaves)}.")
  target = {f"{i:05d}": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                             sharding=x.sharding)
            for i, x in enumerate(leaves)}
  path = os.path.join(os.path.abspath(workdir), TRAIN_STATE_DIR, str(step))
  with ocp.StandardCheckpointer() as ckptr:
    got = ckptr.restore(path, target)
  new = [jnp.asarray(got[f"{i:05d}"]) for i in range(len(leaves))]
  return jax.tree.unflatten(treedef, new), meta


def resume_step(workdir: str, config, param_steps: list[int]) -> int | None:
  """The step a call resumes from, or None for a fresh start.

  None when train.resume is off or the workdir holds no earlier call's
  config.json; a ValueError when that config differs from `config`
  (outside IGNORED): a resumed run must be the same run."""
  if not config.train.get("resume", False):
    return None
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    old = json.load(f)
  changed = config_changes(old, config)
  if changed:
    raise ValueError(
        f"{workdir} holds a run of another config (fields {changed[:8]} "
        f"differ); train.resume continues the same run only. Use a new "
        f"--workdir, or --config.train.resume=False to start over here.")
  n = int(config.train.num_steps)
  if n in param_steps and _finished(workdir, n):
    return n
  steps = sorted(set(saved_steps(workdir)) & set(param_steps))
  return steps[-1] if steps else None


def _finished(workdir: str, num_steps: int) -> bool:
  """Whether metrics.jsonl holds the final record of step num_steps."""
  path = os.path.join(workdir, "metrics.jsonl")
  return os.path.exists(path) and any(
      r.get("kind") == "final" and r.get("step") == num_steps
      for r in common.read_metrics(path))


def trim_metrics(workdir: str, step: int) -> list[dict]:
  """Keeps the records of metrics.jsonl up to `step` (records without a
  step, such as the environment, stay; final / paused records go);
  rewrites the file and returns the kept records."""
  path = os.path.join(workdir, "metrics.jsonl")
  records = common.read_metrics(path) if os.path.exists(path) else []
  kept = [r for r in records if r.get("kind") not in ("final", "paused")
          and r.get("step", 0) <= step]
  with open(path, "w") as f:
    for r in kept:
      f.write(json.dumps(r) + "\n")
  return kept
