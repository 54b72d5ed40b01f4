"""Multi-device decoding: a ("data", "model") mesh, the PartitionSpec of
every HybridLM parameter and decode-state leaf, and placement.

  mesh = make_mesh(data=2, model=4)
  model = shard_model(model, mesh)                 # parameters placed
  state = shard_state(model.init_state(8, 128), mesh, config=model.config)
  logits, state = prefill(model, tokens, lengths, state)
  engine = serving.Engine(model, 64, 512, mesh=mesh)  # a placed slot pool

The jitted entry points (`prefill`, `decode_step`, `generate`,
`speculative_generate`) are unchanged: they compile for the inputs'
shardings and XLA's SPMD partitioner inserts the collectives (the psum
after a row-parallel matmul, the gathers where a replicated operand meets a
split one). Any placement gives the single-device result up to the
summation order of the split reductions; the rules below only choose where
the memory and the work go.

"data" splits the batch (every state leaf's leading axis, the prompts);
"model" splits heads / hidden units (tensor parallelism, Megatron-style
column-parallel in, row-parallel out). With m the "model" axis size:

  Mamba-2     heads split when m divides ssm_heads and m and n_groups
              divide one the other: `shard_model` first lays the model out
              in shard-major blocks (`models.shard_layout`: config
              .mamba_shards = m; block i of the in_proj columns [z_i | x_i
              | B_i | C_i | dt_i] holds shard i's heads and their groups,
              a shared group copied into each of its shards, as vLLM
              does), then the in_proj kernel splits its columns P(None,
              "model") and the conv weight / bias their channels
              P("model"), so each shard projects and convolves only its
              own heads; A_log, D, dt_bias [H] P("model"); out_proj
              [d_inner, d] rows P("model", None) (row-parallel); the gated
              norm's weight [d_inner] P("model") only when n_groups % m ==
              0 (each shard then holds whole norm groups), else replicated
              (its input gathered). A model already laid out
              (mamba_shards > 1) keeps its layout; otherwise (heads that do
              not split) everything Mamba is replicated.
  attention   q/k/v column-parallel P(None, "model") and o_proj row-parallel
              when num_kv_heads % m == 0 (the gated attention's [q; gate]
              columns are per head, so they split the same way); q/k norms
              replicated. Multi-head latent attention (num_kv_heads ==
              num_heads): q_proj and the latent up-projection kv_b_proj
              column-parallel (per head), o_proj row-parallel, the latent
              down-projection kv_a_proj and its norm replicated (the
              latent is shared by the heads).
  MLP         up [d, f] P(None, "model"), the packed SwiGLU gate_up
              [d, 2, f] P(None, None, "model") (each shard's columns of f
              hold their gate and up halves), down P("model", None) when
              intermediate_size % m == 0.
  MoE         experts replicated; `expert_parallel=True` splits the expert
              axis of up/down ([E, ...]) over "model" when E % m == 0. A
              relu2 shared expert splits as an MLP; a swiglu one (fused
              [gate|up] columns), the router and the latent projections are
              replicated.
  GDN         value / key heads split when gdn_num_v_heads % m == 0 and
              gdn_num_k_heads % m == 0: A_log, dt_bias [HV] P("model");
              out_proj [HV V, d] rows P("model", None) (row-parallel; its
              input is the value heads' outputs concatenated head-major);
              the gated norm's weight [V] (shared by every head), the fused
              in_proj [d, qkv|z|b|a] and the conv replicated, as Mamba's.
  KDA         as GDN (heads split when both head counts divide): A_log
              [HV] and dt_bias [HV, K] P("model"), the per-head gate
              up-projections f_b_proj [K, HV K] / g_b_proj [V, HV V]
              column-parallel P(None, "model"), out_proj rows P("model",
              None); the fused in_proj, the conv and the norm replicated.
  embeddings  untied: the table replicated (the lookup stays local) and the
              LM head [d, vocab] P(None, "model") (vocab-parallel logits);
              tied: the table [vocab, d] P("model", None) (the head matmul
              dominates; the lookup costs one all-reduce of [b, d]).
  the rest    replicated (norms, biases not listed).

Any dimension the axis size does not divide is replicated (never an error).

State leaves: the batch axis over "data" (when batch % data == 0), and the
head axis over "model" where the layer's parameters split heads: replay
checkpoint / read copy [b, H, P, N] P("data", "model"), x_buf / dt_buf
[b, L, H, ...] P("data", None, "model"), read_scale [b, H, P]
P("data", "model"), b_buf [b, L, G', N] P("data", None, "model") when the
groups split (G' = config.bc_groups, else P("data")), the conv ring [b,
k-1, conv_dim] P("data", None, "model") in the shard-major layout (else
P("data")),
per-row counters P("data") (a replay state under stochastic rounding keeps
its heads whole: its rounding is keyed by the element's index in the
whole row); a baseline state [b, H, P, N] (or
its StoredSSMState) as the checkpoint; KV caches [b, Hk, S, D]
P("data", "model"). A GDN layer whose heads split: checkpoint / read copy /
baseline state [b, HV, K, V] and read_scale [b, HV, K] P("data", "model"),
d_buf [b, L, HV, V] and g_buf [b, L, HV] P("data", None, "model"), k_buf
[b, L, HK, K] P("data", None, "model") (HK split), the conv ring and the
counters P("data"); a KDA layer's likewise (its k_buf [b, L, HV, K] and
per-key-channel decay sum g_sum [b, HV, K] with the heads). Without
`config`, a GDN / KDA replay state splits when its own head counts divide
and a bare baseline array (GDN or KDA) splits the batch only.

Under `jax.set_mesh(mesh)` the dispatched ops (and so the Pallas kernels)
run per shard under `jax.shard_map` with the specs of
`replayssm_jax.per_shard`, which shares the state layouts below; without
it XLA partitions them like any jnp code (a kernel then runs whole).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from replayssm_jax import _validation as V
from replayssm_jax import gdn, kda
from replayssm_jax.models import shard_layout as SL
from replayssm_jax.models import states as S
from replayssm_jax.models.attention_block import Attention
from replayssm_jax.models.mla_attention import MLAttention
from replayssm_jax.per_shard import (AXES, fields_spec, gdn_heads,
                                    gdn_replay_layouts, leaf_spec,
                                    mamba_heads, replay_layouts, splits)
from replayssm_jax.state import ReplayState

REPLICATED = P()


def make_mesh(data: int, model: int, devices=None) -> Mesh:
  """A Mesh of data * model devices with axes ("data", "model").

  devices: a sequence of jax devices (default the first data * model of
  `jax.devices()`)."""
  data = V.positive_int("data", data)
  model = V.positive_int("model", model)
  n = data * model
  devs = list(jax.devices() if devices is None else devices)
  if len(devs) < n:
    raise ValueError(f"devices: a {data}x{model} mesh needs {n} devices, "
                     f"got {len(devs)}.")
  return Mesh(np.array(devs[:n], dtype=object).reshape(data, model), AXES)


def _size(mesh, axis: str) -> int:
  shape = getattr(mesh, "shape", None)
  if not hasattr(shape, "keys"):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got "
                    f"{type(mesh).__name__}.")
  if axis not in shape:
    raise ValueError(f"mesh must have the axes {AXES}, got "
                     f"{tuple(mesh.axis_names)}.")
  return int(mesh.shape[axis])


# ------------------------------------------------------------ parameters
def _mixer_param_spec(cfg, mixer, kind, names, m, expert_parallel):
  """The PartitionSpec of a mixer's parameter at `names` (path below the
  mixer); m: the "model" axis size."""
  col = lambda ok: P(None, "model") if ok else REPLICATED
  row = lambda ok: P("model", None) if ok else REPLICATED
  if kind == "mamba":
    heads = mamba_heads(cfg.ssm_heads, cfg.bc_groups, m)
    blocks = _mamba_blocks(cfg, m)
    if names in (("A_log",), ("D",), ("dt_bias",)):
      return P("model") if heads else REPLICATED
    if names == ("norm", "weight"):
      return P("model") if heads and splits(cfg.n_groups, m) else REPLICATED
    if names == ("out_proj", "kernel"):
      return row(heads)
    if names == ("in_proj", "kernel"):
      return col(blocks)
    if names == ("conv_weight",):
      return row(blocks)
    if names == ("conv_bias",):
      return P("model") if blocks else REPLICATED
    return REPLICATED
  if kind == "attention":
    if not isinstance(mixer, Attention):
      return REPLICATED
    heads = splits(cfg.num_kv_heads, m)
    per_head = (("q_proj", "kernel"), ("kv_b_proj", "kernel")) if isinstance(
        mixer, MLAttention) else (("q_proj", "kernel"), ("k_proj", "kernel"),
                                  ("v_proj", "kernel"))
    if names in per_head:
      return col(heads)
    if names == ("o_proj", "kernel"):
      return row(heads)
    return REPLICATED
  if kind == "mlp":
    f = splits(cfg.intermediate_size, m)
    if names == ("up_proj", "kernel"):
      return col(f)
    if names == ("gate_up",):  # [d, 2, f]: shards of f hold both halves
      return P(None, None, "model") if f else REPLICATED
    if names == ("down_proj", "kernel"):
      return row(f)
    return REPLICATED
  if kind == "moe":
    if names in (("up",), ("down",)):
      return (P("model") if expert_parallel
              and splits(cfg.n_routed_experts, m) else REPLICATED)
    s = cfg.moe_shared_expert_intermediate_size
    shared = cfg.moe_activation == "relu2" and splits(s, m)
    if names == ("shared_up", "kernel"):
      return col(shared)
    if names == ("shared_down", "kernel"):
      return row(shared)
    return REPLICATED
  if kind == "gdn":
    heads = gdn_heads(cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, m)
    if names in (("A_log",), ("dt_bias",)):
      return P("model") if heads else REPLICATED
    if names == ("out_proj", "kernel"):
      return row(heads)
    return REPLICATED  # in_proj, conv (fused layouts), norm_weight [V]
  if kind == "kda":
    heads = gdn_heads(cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, m)
    if names in (("A_log",), ("dt_bias",)):
      return P("model") if heads else REPLICATED
    if names in (("f_b_proj", "kernel"), ("g_b_proj", "kernel")):
      return col(heads)
    if names == ("out_proj", "kernel"):
      return row(heads)
  return REPLICATED  # in_proj, conv, norm


def _mamba_blocks(cfg, m: int) -> bool:
  """Whether the Mamba in_proj / conv split over m shards: laid out in
  shard-major blocks (config.mamba_shards) that m divides."""
  t = cfg.mamba_shards
  return m > 1 and t > 1 and t % m == 0


def param_spec(model, path, mesh_model_size: int,
               expert_parallel: bool = False) -> P:
  """The PartitionSpec of the HybridLM parameter at `path` (a tuple of
  `nnx.state(model)` keys, e.g. ("blocks", 0, "mixer", "out_proj",
  "kernel")) on a "model" axis of size mesh_model_size (the split sizes
  come from model.config)."""
  m = int(mesh_model_size)
  cfg = model.config
  path = tuple(path)
  if path and path[0] == "blocks":
    i = int(path[1])
    if len(path) > 3 and path[2] == "mixer":
      return _mixer_param_spec(cfg, model.blocks[i].mixer,
                               cfg.block_kinds[i],
                               path[3:], m, expert_parallel)
    return REPLICATED  # the block's pre-norm
  if path == ("embeddings", "weight"):
    return (P("model", None) if cfg.tie_embeddings
            and splits(cfg.vocab_size, m) else REPLICATED)
  if path == ("lm_head", "kernel"):
    return P(None, "model") if splits(cfg.vocab_size, m) else REPLICATED
  return REPLICATED


def param_specs(model, mesh: Mesh, *, expert_parallel: bool = False) -> dict:
  """{path: PartitionSpec} for every parameter of `model` (paths as in
  `nnx.to_flat_state(nnx.state(model))`)."""
  m = _size(mesh, "model")
  flat = nnx.to_flat_state(nnx.state(model))
  return {tuple(path): param_spec(model, path, m, expert_parallel)
          for path, _ in flat}


def shard_model(model, mesh: Mesh, *, expert_parallel: bool = False):
  """A copy of `model` (an nnx HybridLM) with every parameter placed on
  `mesh` per `param_specs` (jax.device_put with a NamedSharding). The
  given model is not modified.

  expert_parallel: split the MoE experts over "model" (default replicated).
  """
  if not isinstance(expert_parallel, bool):
    raise TypeError(f"expert_parallel must be a bool, got "
                    f"{expert_parallel!r}.")
  t = SL.layout_shards(model.config, _size(mesh, "model"))
  if model.config.mamba_shards == 1 and t > 1:
    model = SL.to_shard_layout(model, t)
  specs = param_specs(model, mesh, expert_parallel=expert_parallel)
  graphdef, state = nnx.split(model)
  flat = []
  for path, v in nnx.to_flat_state(state):
    x = jax.device_put(v.get_value(),
                       NamedSharding(mesh, specs[tuple(path)]))
    flat.append((path, v.replace(x)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------- states
def _sr(layer_state) -> bool:
  """A replay state under stochastic rounding keeps its heads whole (the
  rounding bits are keyed by the element's index in the whole row:
  `per_shard`)."""
  p = layer_state.precision
  return p is not None and p.stochastic_rounding


def _mamba_state_specs(s: S.MambaState, d, m, heads_groups, blocks):
  """Mamba layer state; heads_groups: (H, G') from the config, or None (a
  replay state's own H and G'; a baseline state splits its heads when they
  divide); blocks: the conv channels split (shard-major layout)."""
  ssm = s.ssm
  if isinstance(ssm, ReplayState):
    hg = heads_groups or (ssm.nheads, ssm.ngroups)
    split = mamba_heads(*hg, m) and not _sr(s)
    ssm_spec = fields_spec(ssm, replay_layouts(split, split and hg[1] > 1),
                           d, m)
  else:
    heads = ("h" if heads_groups is None or mamba_heads(*heads_groups, m)
             else None)
    if isinstance(ssm, S.StoredSSMState):
      ssm_spec = fields_spec(ssm, dict(state=("b", heads),
                                       scale=("b", heads)), d, m)
    else:
      ssm_spec = leaf_spec(ssm, ("b", heads), d, m)
  conv = ("b", None, "h" if blocks else None)
  return fields_spec(s.replace(ssm=None), dict(conv=conv), d, m).replace(
      ssm=ssm_spec)


def _gdn_state_specs(s: S.GDNState, d, m, heads):
  """GDN / KDA layer state: heads split over "model" when `heads` (True /
  False; None: decided from a replay state's own HV / HK, a bare array
  batch only)."""
  ssm = s.ssm
  if isinstance(ssm, (gdn.GDNReplayState, kda.KDAReplayState)):
    if heads is None:
      heads = gdn_heads(ssm.num_v_heads, ssm.k_buf.shape[2], m)
    heads = heads and not _sr(s)
    ssm_spec = fields_spec(ssm, gdn_replay_layouts(heads), d, m)
  else:
    ssm_spec = leaf_spec(ssm, ("b", "h" if heads else None), d, m)
  return fields_spec(s.replace(ssm=None), {}, d, m).replace(ssm=ssm_spec)


def state_specs(state: S.ModelState, mesh: Mesh, *, config=None):
  """A ModelState-shaped pytree of PartitionSpecs for `state` on `mesh`.

  config: the config of the model the state belongs to (see the module
  docstring); without it a replay state's layout is read from its own
  shapes."""
  if not isinstance(state, S.ModelState):
    raise TypeError(f"state must be a ModelState, got "
                    f"{type(state).__name__}.")
  d, m = _size(mesh, "data"), _size(mesh, "model")
  batch_only = lambda t: jax.tree.map(lambda x: leaf_spec(x, ("b",), d, m),
                                      t)
  gdn_split = None if config is None else gdn_heads(
      config.gdn_num_v_heads, config.gdn_num_k_heads, m)
  mamba_hg = None if config is None else (config.ssm_heads,
                                           config.bc_groups)
  blocks = config is not None and _mamba_blocks(config, m)
  layers = []
  for s in state.layers:
    if isinstance(s, S.MambaState):
      layers.append(_mamba_state_specs(s, d, m, mamba_hg, blocks))
    elif isinstance(s, S.AttentionState):
      kv = ("b", "h")
      layers.append(s.replace(k=leaf_spec(s.k, kv, d, m),
                              v=leaf_spec(s.v, kv, d, m),
                              length=leaf_spec(s.length, ("b",), d, m)))
    elif s is None:
      layers.append(None)
    elif isinstance(s, S.GDNState):  # GDN and KDA layers
      layers.append(_gdn_state_specs(s, d, m, gdn_split))
    else:
      layers.append(batch_only(s))
  return state.replace(layers=tuple(layers),
                       positions=leaf_spec(state.positions, ("b",), d, m))


def shard_state(state: S.ModelState, mesh: Mesh, *, config=None):
  """A copy of the decode `state` placed on `mesh` per `state_specs` (the
  given state is not modified; its buffers stay valid).

  config: the config of the model that built `state`. A state of a model
  in Hugging Face's layout (mamba_shards 1) whose Mamba layers
  `shard_model` lays out in shard-major blocks on this mesh is regrouped
  to match (`models.shard_layout.to_shard_state`)."""
  if config is not None and config.mamba_shards == 1:
    t = SL.layout_shards(config, _size(mesh, "model"))
    if t > 1:
      state = SL.to_shard_state(state, config, t)
      config = config.replace(mamba_shards=t)
  specs = jax.tree.leaves(state_specs(state, mesh, config=config),
                          is_leaf=lambda x: isinstance(x, P))
  leaves, treedef = jax.tree.flatten(state)
  return jax.tree.unflatten(treedef, [
      jax.device_put(x, NamedSharding(mesh, spec))
      for x, spec in zip(leaves, specs, strict=True)])


def shard_pool(pool, mesh: Mesh, *, config=None):
  """A copy of a serving `Pool` placed on `mesh`: its ModelState per
  `state_specs` (slots are rows: over "data"), its per-slot arrays over
  "data". The given pool is not modified."""
  if not isinstance(getattr(pool, "state", None), S.ModelState):
    raise TypeError(f"pool must be a serving.Pool, got "
                    f"{type(pool).__name__}.")
  return pool.replace(state=shard_state(pool.state, mesh, config=config),
                      active=shard_batch(pool.active, mesh),
                      tokens=shard_batch(pool.tokens, mesh))


def shard_batch(x, mesh: Mesh):
  """An input array with a leading batch axis (tokens, lengths) split over
  "data" (replicated when the axis size does not divide it)."""
  spec = leaf_spec(x, ("b",), _size(mesh, "data"), _size(mesh, "model"))
  return jax.device_put(x, NamedSharding(mesh, spec))
