"""What the Hugging Face family readers share: config.json numbers
(`json_float`) and HF-named tensors <-> HybridLM parameters.

A tensor map is {HF tensor name: (parameter path, transform)}: each HF
tensor feeds one parameter, and a packed SwiGLU kernel [d, 2, f]
(`mlp.MLP.gate_up`) is fed by two (its gate and up halves) or by one fused
[gate; up] tensor. Transforms: "id", "T" (a linear's [out, in] <->
[in, out]), "T3" (stacked experts: the last two axes swapped), "conv"
([C, 1, k] <-> [C, k]), "plus1" (a zero-centred norm's weight w, applied
as 1 + w: stored here as 1 + w in float32), "gate" / "up" (a linear
[f, d] <-> [:, 0] / [:, 1] of a [d, 2, f] kernel), "gate_up" (a fused
[gate; up] linear [2f, d] <-> [d, 2, f]).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

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


# The half of a packed [d, 2, f] kernel each transform fills.
HALVES = {"gate": 0, "up": 1}


def swiglu_tensors(prefix: str, mx: tuple) -> dict[str, tuple]:
  """A SwiGLU MLP's entries: {prefix}{gate,up,down}_proj.weight onto the
  mixer at `mx` (the halves of its packed gate_up kernel, down_proj)."""
  m = {prefix + f"{n}_proj.weight": (mx + ("gate_up",), n) for n in HALVES}
  m[prefix + "down_proj.weight"] = (mx + ("down_proj", "kernel"), "T")
  return m


def stack_experts(prefix: str, proj: str, by_index: dict) -> np.ndarray:
  """Per-expert tensors {index: [out, in]} of `{prefix}.*.{proj}.weight`
  stacked [E, out, in]; experts 0 .. E-1 must all be present, of one
  shape (a ValueError naming the tensors otherwise)."""
  n = len(by_index)
  if sorted(by_index) != list(range(n)):
    raise ValueError(f"checkpoint tensors: {prefix}.*.{proj}.weight holds "
                     f"experts {sorted(by_index)}, expected 0 .. {n - 1}.")
  shapes = {tuple(a.shape) for a in by_index.values()}
  if len(shapes) != 1:
    raise ValueError(f"checkpoint tensors: {prefix}.*.{proj}.weight have "
                     f"different shapes {sorted(shapes)}.")
  return np.stack([np.asarray(by_index[j]) for j in range(n)])


def stack_gated_experts(experts: dict, out: dict, gate: str, up: str,
                        down: str, shared: str) -> None:
  """SwiGLU experts {prefix: {proj: {index: tensor}}} into `out` as the
  tensor maps name them: the gate and up projections stacked as
  {prefix}.gate_up_proj [E, 2I, d] (each expert's [gate; up] rows), the
  down projection as {prefix}.down_proj [E, d, I], anything unpaired as
  {prefix}.{proj}.weight (left for `load_tensors` to report). Then every
  shared expert's `{shared}.gate_proj.weight` and `up_proj.weight` in `out`
  of one shape, as one {shared}.gate_up_proj.weight [gate; up]."""
  for prefix, projs in experts.items():
    stacked = {p: stack_experts(prefix, p, by_index)
               for p, by_index in projs.items()}
    if gate in stacked and up in stacked:
      if stacked[gate].shape != stacked[up].shape:
        raise ValueError(f"checkpoint tensors: {prefix}.*.{gate} and {up} "
                         f"differ in shape.")
      out[prefix + ".gate_up_proj"] = np.concatenate(
          [stacked.pop(gate), stacked.pop(up)], axis=1)
    if down in stacked:
      out[prefix + ".down_proj"] = stacked.pop(down)
    for p, arr in stacked.items():
      out[f"{prefix}.{p}.weight"] = arr
  for name in [k for k in out if k.endswith(f".{shared}.gate_proj.weight")]:
    other = name.replace(".gate_proj.", ".up_proj.")
    if other in out and np.shape(out[other]) == np.shape(out[name]):
      out[name.replace(".gate_proj.", ".gate_up_proj.")] = np.concatenate(
          [np.asarray(out.pop(name)), np.asarray(out.pop(other))], axis=0)


class _Transform(NamedTuple):
  """One transform's three directions: HF tensor -> parameter (jax),
  parameter -> HF tensor (numpy), parameter shape -> HF shape."""
  to_ours: Callable
  to_hf: Callable
  hf_shape: Callable


def _half(h):
  """The gate (h 0) or up (h 1) half of a [d, 2, f] kernel <-> [f, d]."""
  return _Transform(lambda a: a.T, lambda a: a[:, h, :].T,
                    lambda s: (s[2], s[0]))


_TRANSFORMS = {
    "id": _Transform(lambda a: a, lambda a: a, tuple),
    "T": _Transform(lambda a: a.T, lambda a: a.T, lambda s: (s[1], s[0])),
    "T3": _Transform(lambda a: a.swapaxes(-1, -2),
                     lambda a: a.swapaxes(-1, -2),
                     lambda s: tuple(s[:-2]) + (s[-1], s[-2])),
    "conv": _Transform(lambda a: a[:, 0, :], lambda a: a[:, None, :],
                       lambda s: (s[0], 1, s[1])),
    "plus1": _Transform(lambda a: a.astype(jnp.float32) + 1.0,
                        lambda a: a - 1, tuple),
    "gate_up": _Transform(
        lambda a: a.reshape(2, a.shape[0] // 2, a.shape[1]).transpose(2, 0, 1),
        lambda a: a.transpose(1, 2, 0).reshape(2 * a.shape[2], a.shape[0]),
        lambda s: (2 * s[2], s[0])),
    **{name: _half(h) for name, h in HALVES.items()},
}


def to_ours(arr, transform):
  """An HF tensor as the parameter `transform` feeds (jax)."""
  return _TRANSFORMS[transform].to_ours(arr)


def to_hf(arr, transform):
  """`to_ours` inverted (numpy)."""
  return _TRANSFORMS[transform].to_hf(arr)


def hf_shape(shape, transform):
  """The HF tensor shape a parameter of `shape` comes from."""
  return tuple(_TRANSFORMS[transform].hf_shape(tuple(shape)))


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
  for name, (path, tr) in tmap.items():
    by_path.setdefault(path, []).append((name, tr))
  new_flat, bad = [], []
  for path, var in nnx.to_flat_state(state):
    want = var.get_value()
    parts = {}
    for name, tr in by_path[path]:
      src = tensors[name]
      expected = hf_shape(want.shape, tr)
      if tuple(src.shape) != tuple(expected):
        bad.append(f"{name}: expected {expected}, got {tuple(src.shape)}")
        continue
      parts[tr] = to_ours(jnp.asarray(src), tr)
    if len(parts) < len(by_path[path]):
      continue
    arr = (jnp.stack([parts[h] for h in HALVES], axis=1)
           if set(parts) == set(HALVES) else parts[by_path[path][0][1]])
    new_flat.append((path, var.replace(arr.astype(want.dtype))))
  if bad:
    raise ValueError("checkpoint tensors have wrong shapes: " +
                     "; ".join(sorted(set(bad))))
  return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


def export_tensors(model: HybridLM, tmap: dict[str, tuple]
                   ) -> dict[str, np.ndarray]:
  """The model's parameters under the HF names and layouts of `tmap`
  (a packed gate / up kernel split back where `tmap` names its halves),
  numpy."""
  flat = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out = {}
  for name, (path, tr) in tmap.items():
    a = np.asarray(flat[path].get_value())
    out[name] = np.ascontiguousarray(to_hf(a, tr))
  return out
