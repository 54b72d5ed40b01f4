"""Exact save and restore of a serving engine mid-run.

  engine.save(path, on_tokens)   # the decode call in flight read first
  engine = Engine(model, <the same arguments>)
  engine.restore(path)           # a new engine; then engine.run()

A snapshot holds the engine's device state, bit for bit (the pool's
decode state, active flags and next tokens; the slots' budgets, eos ids,
temperatures and key streams; the speculative slots and batch key), saved
with `models.checkpointing.save_tree`, and its host state in the
checkpoint's sidecar: the queued requests, the request each slot holds,
the tokens each may still emit, the tokens generated so far and the
statistics. Saving first reads the decode call in flight (an overlapping
engine keeps one) and streams its tokens to `on_tokens`, so the snapshot
lies between dispatches. A restored engine then gives every request the
tokens the saved one would have given it (tested for both SSM modes, a
read-copy precision policy, speculative decoding, overlap on and off).

The engine's settings (capacity, max_len, steps per dispatch, sampling
filters, speculation, decode-state mode) must match the saved ones: a
mismatch is named. A prefix cache is not saved (it holds derived states;
the restored engine's starts empty, which changes no token). Request ids
must be str or int to be saved (the sidecar is JSON).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from replayssm_jax.models import checkpointing as CK
from replayssm_jax.serving.requests import EngineStats, Request

FORMAT = "replayssm_jax.serving.Engine/1"


def settings(engine) -> dict:
  """What a restoring engine must share with the saved one."""
  spec = engine.speculative
  return dict(
      capacity=engine.pool.capacity, max_len=engine.max_len,
      steps_per_dispatch=engine.n, prefill_batch=engine.prefill_batch,
      compact_below=engine.compact_below, top_k=engine.top_k,
      top_p=engine.top_p, max_eos_ids=engine.max_eos_ids,
      speculative=None if spec is None else [
          type(spec.proposer).__name__, spec.window],
      prefix_cache=engine.prefix_cache is not None, **engine._ssm)  # pylint: disable=protected-access


def _check_id(rid):
  if isinstance(rid, bool) or not isinstance(rid, (str, int)):
    raise ValueError(f"Request id {rid!r}: a saved engine's request ids "
                     f"must be str or int (the snapshot's host state is "
                     f"JSON).")
  return rid


def _request_json(r: Request) -> dict:
  return dict(id=_check_id(r.id), prompt=np.asarray(r.prompt).tolist(),
              max_new_tokens=r.max_new_tokens, eos_id=list(r.eos_id),
              temperature=float(r.temperature), seed=r.seed)


def _request(d: dict) -> Request:
  return Request(d["id"], np.asarray(d["prompt"], np.int32),
                 d["max_new_tokens"], eos_id=tuple(d["eos_id"]),
                 temperature=d["temperature"], seed=d["seed"])


def _device_tree(engine) -> dict:
  tree = dict(pool=engine.pool, ctl=engine._ctl)  # pylint: disable=protected-access
  if engine.speculative is not None:
    tree.update(spec=engine._spec_slots, batch_key=engine._batch_key)  # pylint: disable=protected-access
  return tree


def save(engine, path, on_tokens=None, overwrite: bool = False) -> dict:
  """Reads the engine's decode call in flight (its tokens to `on_tokens`),
  then writes the engine to the directory `path` -> the sidecar's
  description."""
  with engine._on_mesh():  # pylint: disable=protected-access
    engine._drain(on_tokens)  # pylint: disable=protected-access
  host = dict(
      settings=settings(engine),
      queue=[_request_json(r) for r in engine.queue],
      slots=[None if r is None else _request_json(r) for r in engine.slots],
      budget=[[rid, n] for rid, n in engine._budget.items()],  # pylint: disable=protected-access
      results=[[_check_id(rid), list(toks)]
               for rid, toks in engine.results.items()],
      stats=dataclasses.asdict(engine.stats))
  return CK.save_tree(path, _device_tree(engine), overwrite=overwrite,
                      fmt=FORMAT, extra=host)


def restore(engine, path) -> None:
  """Loads the snapshot at `path` into `engine`, a new one built with the
  saved engine's arguments (nothing submitted or run)."""
  if engine.busy or engine.results:
    raise ValueError("restore needs a new engine (nothing submitted or "
                     "run): build one with the saved engine's arguments.")
  info = CK.read_description(path, FORMAT)
  host = info.get("extra")
  if not isinstance(host, dict) or "settings" not in host:
    raise ValueError(f"corrupt engine snapshot at path {path!r}: its "
                     f"sidecar holds no host state.")
  mine = settings(engine)
  for key, want in host["settings"].items():
    if mine.get(key) != want:
      raise ValueError(f"the engine's {key} ({mine.get(key)!r}) differs "
                       f"from the saved engine's ({want!r}) at path "
                       f"{path!r}: build the engine with the saved "
                       f"arguments.")
  tree = CK.restore_tree(path, _device_tree(engine), FORMAT)
  engine.pool, engine._ctl = tree["pool"], tree["ctl"]  # pylint: disable=protected-access
  if engine.speculative is not None:
    engine._spec_slots, engine._batch_key = tree["spec"], tree["batch_key"]  # pylint: disable=protected-access
  engine.queue = collections.deque(_request(d) for d in host["queue"])
  engine.slots = [None if d is None else _request(d) for d in host["slots"]]
  engine._budget = {rid: n for rid, n in host["budget"]}  # pylint: disable=protected-access
  engine.results = {rid: list(toks) for rid, toks in host["results"]}
  engine.stats = EngineStats(**host["stats"])
