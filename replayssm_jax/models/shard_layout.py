"""The shard-major Mamba layout for tensor parallelism
(`ModelConfig.mamba_shards`).

A Mamba-2 in_proj computes [z | x | B | C | dt] (Hugging Face's columns):
a contiguous split of that axis over t devices does not follow the heads.
`to_shard_layout(model, t)` returns the same function with its Mamba
in_proj columns (and the conv's [x | B | C] channels) regrouped into t
blocks, block i = [z_i | x_i | B_i | C_i | dt_i] for heads i H/t .. (i+1)
H/t - 1 and their B/C groups: the G/t groups of those heads when t divides
G, else (G divides t) a copy of their one group, as vLLM's tensor-parallel
Mamba does; so each device's share of the weight is one block, and its
projection, conv and SSM step need no communication. `to_shard_state`
regroups a decode state's conv windows and B buffers to match.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.models import states as S
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.state import ReplayState


def layout_shards(cfg: ModelConfig, m: int) -> int:
  """The mamba_shards a model gets on m "model" devices: m when its Mamba
  heads split over them with their groups (m divides ssm_heads, and m and
  n_groups one the other), else 1 (no Mamba layer: 1)."""
  if "M" not in cfg.pattern or m <= 1 or cfg.ssm_heads % m:
    return 1
  g = cfg.n_groups
  return m if not (g % m and m % g) else 1


def _groups(cfg: ModelConfig, t: int) -> np.ndarray:
  """The original B/C group of each stored group, shard-major."""
  g = cfg.n_groups
  if g % t == 0:
    return np.arange(g)
  return np.arange(t) * g // t  # shard i: a copy of group i G / t


def _conv_index(cfg: ModelConfig, t: int) -> np.ndarray:
  """Original [x | B | C] channel of each shard-major conv channel."""
  d, n, g = cfg.d_inner, cfg.d_state, cfg.n_groups
  groups = _groups(cfg, t).reshape(t, -1)
  out = []
  for i in range(t):
    out.append(np.arange(i * d // t, (i + 1) * d // t))
    for base in (d, d + g * n):  # B, then C
      out.extend(base + k * n + np.arange(n) for k in groups[i])
  return np.concatenate(out)


def _in_proj_index(cfg: ModelConfig, t: int) -> np.ndarray:
  """Original in_proj column of each shard-major column."""
  d, h = cfg.d_inner, cfg.ssm_heads
  conv = _conv_index(cfg, t).reshape(t, -1)
  out = []
  for i in range(t):
    out.append(np.arange(i * d // t, (i + 1) * d // t))  # z_i
    out.append(d + conv[i])  # x_i, B_i, C_i
    out.append(d + cfg.conv_dim + np.arange(i * h // t, (i + 1) * h // t))
  return np.concatenate(out)


def _check(cfg: ModelConfig, t: int) -> ModelConfig:
  if not isinstance(cfg, ModelConfig):
    raise TypeError(f"config must be a ModelConfig, got "
                    f"{type(cfg).__name__}.")
  if cfg.mamba_shards != 1:
    raise ValueError(f"the model is laid out for mamba_shards = "
                     f"{cfg.mamba_shards} already.")
  return cfg.replace(mamba_shards=t).validate()


def to_shard_layout(model, t: int):
  """A copy of the HybridLM `model` (Hugging Face's layout) with
  config.mamba_shards = t and its Mamba in_proj / conv regrouped (see the
  module docstring); the same outputs. The given model is not modified."""
  from replayssm_jax.models.model import HybridLM  # the model imports this
  cfg = _check(model.config, t)
  cols = jnp.asarray(_in_proj_index(model.config, t))
  chans = jnp.asarray(_conv_index(model.config, t))
  new = {"in_proj": (cols, 1), "conv_weight": (chans, 0),
         "conv_bias": (chans, 0)}
  _, state = nnx.split(model)
  flat = []
  for path, v in nnx.to_flat_state(state):
    kind = (cfg.block_kinds[path[1]] if path[0] == "blocks" else None)
    key = path[3] if len(path) > 3 and path[2] == "mixer" else None
    x = v.get_value()
    if kind == "mamba" and key in new:
      idx, axis = new[key]
      x = jnp.take(x, idx, axis=axis)
    flat.append((path, v.replace(x)))
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def to_shard_state(state: S.ModelState, config: ModelConfig, t: int):
  """A decode state of a model with `config` (Hugging Face's layout) in the
  layout of `to_shard_layout(model, t)`: its Mamba conv windows and replay
  B buffers regrouped (the rest shared, not copied)."""
  _check(config, t)
  chans = jnp.asarray(_conv_index(config, t))
  groups = jnp.asarray(_groups(config, t))
  layers = []
  for s in state.layers:
    if isinstance(s, S.MambaState):
      ssm = s.ssm
      if isinstance(ssm, ReplayState):
        ssm = ssm.replace(b_buf=jnp.take(ssm.b_buf, groups, axis=2))
      s = s.replace(conv=jnp.take(s.conv, chans, axis=2), ssm=ssm)
    layers.append(s)
  return state.replace(layers=tuple(layers))

