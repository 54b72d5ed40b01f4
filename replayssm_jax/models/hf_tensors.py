"""What the Hugging Face family readers share: config.json numbers
(`json_float`) and HF-named tensors <-> HybridLM parameters.

A tensor map is {HF tensor name: ((parameter path, transform), ...)}: one
HF tensor feeds one parameter or, split by rows, several (a fused
[gate; up] projection). Transforms: "id", "T" (a linear's [out, in] <->
[in, out]), "T3" (stacked experts: the last two axes swapped), "conv"
([C, 1, k] <-> [C, k]), "plus1" (a zero-centred norm's weight w, applied
as 1 + w: stored here as 1 + w in float32), or ("T", lo, hi) (rows lo:hi
of the HF tensor, transposed).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.model import HybridLM


def json_float(v):
  """A number of config.json as read: transformers writes inf as
  {"__float__": "Infinity"}; anything else is returned unchanged."""
  if isinstance(v, dict) and set(v) == {"__float__"}:
    try:
      return float(v["__float__"])
    except (TypeError, ValueError):
      return v
  return v


def to_ours(arr, transform):
  if transform == "T":
    return arr.T
  if transform == "T3":
    return arr.swapaxes(-1, -2)
  if transform == "conv":
    return arr[:, 0, :]
  if transform == "plus1":
    return arr.astype(jnp.float32) + 1.0
  if isinstance(transform, tuple):
    _, lo, hi = transform
    return arr[lo:hi].T
  return arr


def hf_shape(shape, transform, full_rows=None):
  """The HF tensor shape a parameter of `shape` comes from."""
  if transform == "T":
    return (shape[1], shape[0])
  if transform == "T3":
    return tuple(shape[:-2]) + (shape[-1], shape[-2])
  if transform == "conv":
    return (shape[0], 1, shape[1])
  if isinstance(transform, tuple):
    return (full_rows, shape[0])
  return tuple(shape)


def load_tensors(cfg: ModelConfig, tensors: dict[str, Any],
                 tmap: dict[str, tuple]) -> HybridLM:
  """A HybridLM from HF-named tensors under `tmap` (checks names and
  shapes; lists every mismatch)."""
  extra = set(tensors) - set(tmap)
  if cfg.tie_embeddings:
    extra.discard("lm_head.weight")  # Saved by some tied checkpoints.
  missing = sorted(set(tmap) - set(tensors))
  if missing or extra:
    raise ValueError(f"checkpoint tensors do not match the config: missing "
                     f"{missing}; unexpected {sorted(extra)}.")
  abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  by_path = {}
  for name, pieces in tmap.items():
    for path, tr in pieces:
      by_path[path] = (name, tr)
  new_flat, bad = [], []
  for path, var in nnx.to_flat_state(state):
    name, tr = by_path[path]
    src = tensors[name]
    want = var.get_value()
    rows = None
    if isinstance(tr, tuple):  # a fused tensor: check its full shape
      rows = sum(t[2] - t[1] for _, t in tmap[name])
    expected = hf_shape(want.shape, tr, rows)
    if tuple(src.shape) != tuple(expected):
      bad.append(f"{name}: expected {expected}, got {tuple(src.shape)}")
      continue
    arr = to_ours(jnp.asarray(src), tr)
    new_flat.append((path, var.replace(arr.astype(want.dtype))))
  if bad:
    raise ValueError("checkpoint tensors have wrong shapes: " +
                     "; ".join(sorted(set(bad))))
  return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


def export_tensors(model: HybridLM, tmap: dict[str, tuple]
                   ) -> dict[str, np.ndarray]:
  """The model's parameters under the HF names and layouts of `tmap`
  (fused tensors concatenated back), numpy."""
  flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out = {}
  for name, pieces in tmap.items():
    parts = []
    for path, tr in pieces:
      a = np.asarray(flat[path].get_value())
      parts.append(a.T if tr == "T" or isinstance(tr, tuple)
                   else a.swapaxes(-1, -2) if tr == "T3"
                   else a[:, None, :] if tr == "conv"
                   else a - 1 if tr == "plus1" else a)
    out[name] = np.ascontiguousarray(np.concatenate(parts, 0)
                                     if len(parts) > 1 else parts[0])
  return out
