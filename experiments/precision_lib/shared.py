"""Results that every slice of a split study computes alike (the scores'
reference decode, the f32 reference's generations, the state-error
stage's recording of its stream and its f32 floor), computed once and
shared through a folder.

A study split over processes (benchmarks/scripts/text_precision.sh: each
process a slice of the presets) needs the same reference logits, f32
baseline generations and recorded layer inputs in every slice. With
`config.shared_dir` set, the first process to ask for one takes
`<key>.lock` (its host and pid inside), computes it and writes
`<key>.npz`; the others wait for the file and load it. A lock whose
process is gone (killed by a time limit) is taken over; a process that
has waited `wait_s` computes for itself. The key hashes everything the
result depends on, the model's parameters included (`fingerprint`), so a
retrained model or other prompts never load a stale file.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from typing import Callable

from absl import logging
import jax
import numpy as np
from flax import nnx


def fingerprint(model) -> str:
  """A digest of the model's parameters (nnx.Param): every leaf's path,
  shape and dtype and its first and last 16 values."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(
      nnx.state(model, nnx.Param)):
    flat = leaf.reshape(-1)
    h.update(repr((jax.tree_util.keystr(path), leaf.shape,
                   str(leaf.dtype))).encode())
    h.update(np.asarray(flat[:16]).tobytes())
    h.update(np.asarray(flat[-16:]).tobytes())
  return h.hexdigest()


def key(name: str, what: str, **inputs) -> str:
  """A file name for `what` of model `name`: the inputs (arrays hashed by
  their bytes, others by their repr) in a digest."""
  h = hashlib.sha256()
  for k in sorted(inputs):
    v = inputs[k]
    if isinstance(v, (np.ndarray, jax.Array)):
      v = np.asarray(v)
      h.update(repr((k, v.shape, str(v.dtype))).encode())
      h.update(np.ascontiguousarray(v).tobytes())
    else:
      h.update(repr((k, v)).encode())
  safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
  return f"{safe}-{what}-{h.hexdigest()[:16]}"


def _owner_alive(lock: str) -> bool:
  """Whether the process named in `lock` still runs (on this host; a
  lock of another host counts as alive)."""
  try:
    with open(lock) as f:
      owner = json.load(f)
  except (OSError, ValueError):
    return True  # being written: its owner is alive
  if owner.get("host") != socket.gethostname():
    return True
  try:
    os.kill(int(owner["pid"]), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, KeyError, ValueError):
    return True
  return True


_DTYPES = "__dtypes__"  # the entry naming the arrays stored as float32


def _save(path: str, out: dict) -> None:
  """np.savez of out; arrays of a dtype numpy does not define (bf16, fp8:
  ml_dtypes') as float32 (exact), their dtypes in one more entry."""
  arrays, dtypes = {}, {}
  for k, v in out.items():
    v = np.asarray(v)
    if v.dtype.isbuiltin == 2:  # a user-defined (ml_dtypes) dtype
      dtypes[k], v = v.dtype.name, v.astype(np.float32)
    arrays[k] = v
  np.savez(path, **arrays, **{_DTYPES: np.asarray(json.dumps(dtypes))})


def _load(path: str) -> dict[str, np.ndarray]:
  with np.load(path) as f:
    out = {k: f[k] for k in f.files}
  for k, name in json.loads(str(out.pop(_DTYPES))).items():
    out[k] = out[k].astype(jax.numpy.dtype(name))
  return out


def computed_once(folder: str, key_: str | Callable[[], str],
                  compute: Callable[[], dict[str, np.ndarray]], *,
                  wait_s: float = 900.0,
                  poll_s: float = 0.5) -> dict[str, np.ndarray]:
  """compute() (a dict of arrays), once for every process sharing
  `folder` ("" computes here, shares nothing; a callable key_ is called
  only with a folder). Arrays keep their dtypes through the folder."""
  if not folder:
    return compute()
  key_ = key_() if callable(key_) else key_
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, key_ + ".npz")
  lock = os.path.join(folder, key_ + ".lock")
  deadline = time.monotonic() + wait_s
  while True:
    if os.path.exists(path):
      return _load(path)
    try:
      fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      if not _owner_alive(lock):
        logging.info("%s: its owner is gone, taking it over", lock)
        try:
          os.remove(lock)
        except FileNotFoundError:
          pass
        continue
      if time.monotonic() > deadline:
        logging.info("%s: waited %.0f s, computing here", lock, wait_s)
        return compute()
      time.sleep(poll_s)
      continue
    try:
      with os.fdopen(fd, "w") as f:
        json.dump(dict(host=socket.gethostname(), pid=os.getpid()), f)
      out = compute()
      tmp = f"{path}.{os.getpid()}.tmp.npz"
      _save(tmp, out)
      os.replace(tmp, path)
      return out
    finally:
      try:
        os.remove(lock)
      except FileNotFoundError:
        pass
