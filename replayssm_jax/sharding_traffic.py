"""Per-device memory, HBM traffic and communication of one sharded decode
step (the placement rules of `replayssm_jax.sharding`).

  cost = decode_step_cost(cfg, data=2, model=4, batch=64, ssm_mode="replay",
                          buffer_len=16)
  cost.state_bytes["total"], cost.ssm_traffic_bytes, cost.psum_bytes
  compiled_collectives(step_fn, params, token, state)   # what XLA emitted
  kernel_routes(cfg, 1, 4, 256, policy=PrecisionPolicy.preset("f32+fp8"))

With b = the global batch, d / m the "data" / "model" axis sizes:
  b_l = b / d when d divides b, else b (the batch is replicated);
  a Mamba layer in the layout `sharding.shard_model` gives it
  (`models.shard_layout`: shard-major blocks when m divides H, and m and G
  one the other): heads H_l = H / m, stored B/C groups G_l = max(G, m) / m
  and conv channels conv_dim_l = conv_dim / m (conv_dim with max(G, m)
  groups); else H, G and conv_dim;
  a GDN / KDA layer's value / key heads HV_l = HV / m, HK_l = HK / m when
  m divides both, else HV, HK;
  an attention layer's KV heads Hk / m when m divides num_kv_heads (multi-
  head latent attention alike: its cache holds decompressed heads).

State bytes per device (per layer, summed over layers):
  Mamba baseline   b_l*H_l*P*N*s (+ the conv ring b_l*(k-1)*conv_dim_l*c
                   and its int32 start b_l*4);
  Mamba replay     checkpoint b_l*H_l*P*N*s + x_buf b_l*L*H_l*P*u
                   + dt_buf b_l*L*H_l*4 + b_buf b_l*L*G_l*N*u + count
                   b_l*4 (+ the conv ring as above);
  GDN / KDA        ("delta") baseline b_l*HV_l*K*V*s; replay checkpoint
                   b_l*HV_l*K*V*s + d ring b_l*L*HV_l*V*u + k ring
                   b_l*L*HK_l*K*u + count b_l*4 + the log-decay ring
                   b_l*L*HV_l*4 (GDN), or (KDA: keys per value head) k ring
                   b_l*L*HV_l*K*u and decay sum b_l*HV_l*K*4
                   (+ the conv ring b_l*(k-1)*gdn_conv_dim*c);
  attention        k and v 2*b_l*Hk_l*S*D*kv + length b_l*4;
  positions        b_l*4.
  (s, u, c, kv: the checkpoint, buffer, conv and KV itemsizes.)

SSM traffic per device: `replayssm_jax.traffic` on the shard (H_l heads,
G_l groups, b_l rows): `baseline_step_bytes` or `replay_amortized_bytes`,
times the Mamba layers (the GDN / KDA ops' traffic is not modeled).

Collectives implied by the rules (per step, per device; `bytes` is the size
of the op's result buffer on one device, the figure XLA's HLO shows;
`wire_bytes` what a ring moves per device: 2(m-1)/m of it for an
all-reduce, (m-1)/m for an all-gather):
  * an all-reduce (psum over "model") of the residual stream [b_l, d_model]
    in the activation dtype (config.dtype) after every row-parallel
    projection: Mamba / GDN / KDA out_proj when its heads split, attention
    o_proj when its KV heads split, MLP down_proj when intermediate_size
    splits,
    MoE experts with expert_parallel (and a split relu2 shared expert's
    shared_down, one more);
  * the LM head: vocab-parallel logits [b_l, V/m]; a caller that needs the
    whole row gathers [b_l, V] float32 ("logits all-gather", counted apart:
    a greedy argmax only reduces b_l (value, index) pairs); a tied table
    split over the vocabulary also costs one all-reduce [b_l, d_model] for
    the embedding lookup.
Not modeled (XLA adds them around the split SSM op and the MoE dispatch;
small next to the psums at realistic sizes): the gated norm's group
reduction when its groups span shards (an all-reduce [b_l, G]; with the
ops per shard under `jax.set_mesh`, an all-gather of its [b_l, d_inner]
input instead), the KV-cache write's gather of the new token, and the
MoE's routing gathers / all-to-alls. With expert_parallel the model counts
one [b_l, d_model] psum per MoE layer, but XLA compiles the capacity
dispatch's combine as a psum of the routed copies (on 8 host devices,
b 8, top-2 of 8 experts: [16, 32] at 1x8, [2, 8, 32] at 2x4, 2x and 4x
the counted bytes) plus collective-permutes and all-to-alls of the routing
(`compiled_collectives` lists them): the expert-parallel MoE's
communication is measured, not modeled.

Pure Python except `compiled_collectives` (which compiles with jax).
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp

from replayssm_jax import traffic as T
from replayssm_jax.models import shard_layout as SL
from replayssm_jax.per_shard import gdn_heads, mamba_heads, splits

_I32 = 4
SSM_MODES = ("baseline", "replay")


def _pos(name, v):
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ValueError(f"{name} must be a positive int, got {v!r}.")
  return v


def _itemsize(dtype, name):
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError as e:
    raise TypeError(f"{name} must be a dtype, got {dtype!r}.") from e


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of a decode step.

  op: "all-reduce", "all-gather", "reduce-scatter", "collective-permute" or
    "all-to-all"; where: the layer / part it belongs to ("" when parsed);
  shape, dtype: its result on one device; bytes: that result's size;
  count: how many such ops per step (layers of the kind)."""
  op: str
  shape: tuple
  dtype: str
  bytes: int
  where: str = ""
  count: int = 1
  wire_bytes: float | None = None

  def asdict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DecodeCost:
  """Per device, one decode step (see `decode_step_cost`)."""
  data: int
  model: int
  batch: int
  local_batch: int
  ssm_mode: str
  state_bytes: dict  # {"mamba", "delta", "conv", "attention", "other",
  #                      "total"}
  ssm_traffic_bytes: float
  collectives: tuple  # of Collective
  psum_bytes: int  # the residual-stream all-reduces of the layers
  head_bytes: int  # the LM head's lookup all-reduce + logits all-gather

  def asdict(self) -> dict:
    d = dataclasses.asdict(self)
    d["collectives"] = [c.asdict() for c in self.collectives]
    return d


def local_sizes(cfg, data: int, model: int, batch: int) -> dict:
  """Rows, Mamba heads / groups, GDN value / key heads and KV heads held
  by one device."""
  d, m, b = _pos("data", data), _pos("model", model), _pos("batch", batch)
  if cfg.mamba_shards == 1:  # the layout shard_model gives it
    cfg = cfg.replace(mamba_shards=SL.layout_shards(cfg, m))
  h, g = cfg.ssm_heads, cfg.bc_groups
  mamba = mamba_heads(h, g, m)
  blocks = m > 1 and cfg.mamba_shards > 1 and cfg.mamba_shards % m == 0
  gdn = gdn_heads(cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, m)
  hk = cfg.num_kv_heads
  return dict(batch=b // d if splits(b, d) else b,
              ssm_heads=h // m if mamba else h,
              ssm_groups=g // m if mamba and g > 1 else g,
              conv_dim=cfg.conv_dim // m if blocks else cfg.conv_dim,
              gdn_v_heads=cfg.gdn_num_v_heads // (m if gdn else 1),
              gdn_k_heads=cfg.gdn_num_k_heads // (m if gdn else 1),
              kv_heads=hk // m if splits(hk, m) else hk)


def state_bytes_per_device(cfg, data: int, model: int, batch: int, *,
                           ssm_mode: str = "replay", buffer_len: int = 16,
                           max_len: int = 128, checkpoint_dtype="float32",
                           buffer_dtype=None, kv_dtype=None,
                           conv_dtype=None) -> dict:
  """Decode-state bytes on one device (dtypes default as in
  `HybridLM.init_state`: buffers, KV and conv in config.dtype).

  Returns {"mamba": Mamba SSM states, "delta": GDN / KDA states, "conv":
  conv rings, "attention": KV caches, "other": positions, "total"}."""
  if ssm_mode not in SSM_MODES:
    raise ValueError(f"ssm_mode must be one of {SSM_MODES}, got "
                     f"{ssm_mode!r}.")
  _pos("buffer_len", buffer_len)
  _pos("max_len", max_len)
  loc = local_sizes(cfg, data, model, batch)
  b, h = loc["batch"], loc["ssm_heads"]
  s = _itemsize(checkpoint_dtype, "checkpoint_dtype")
  u = _itemsize(buffer_dtype or cfg.dtype, "buffer_dtype")
  kv = _itemsize(kv_dtype or cfg.dtype, "kv_dtype")
  c = _itemsize(conv_dtype or cfg.dtype, "conv_dtype")
  P, N, G, L = cfg.head_dim, cfg.d_state, loc["ssm_groups"], buffer_len
  K, Vd = cfg.gdn_k_dim, cfg.gdn_v_dim
  out = dict(mamba=0, delta=0, conv=0, attention=0, other=b * _I32)
  for kind in cfg.block_kinds:
    if kind == "mamba":
      ssm = b * h * P * N * s
      if ssm_mode == "replay":
        ssm += (b * L * h * P * u + b * L * h * 4 + b * L * G * N * u
                + b * _I32)
      out["mamba"] += ssm
      out["conv"] += (b * (cfg.conv_kernel - 1) * loc["conv_dim"] * c
                      + b * _I32)
    elif kind in ("gdn", "kda"):
      hv = loc["gdn_v_heads"]
      hk = loc["gdn_k_heads"] if kind == "gdn" else hv  # KDA: k per v head
      ssm = b * hv * K * Vd * s
      if ssm_mode == "replay":  # d, k rings; g ring (GDN) / sum (KDA)
        ssm += (b * L * hv * Vd * u + b * L * hk * K * u + b * _I32
                + (b * L * hv * 4 if kind == "gdn" else b * hv * K * 4))
      out["delta"] += ssm
      out["conv"] += b * (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * c
    elif kind == "attention":
      out["attention"] += (2 * b * loc["kv_heads"] * max_len
                           * cfg.attn_head_dim * kv + b * _I32)
  out["total"] = sum(out.values())
  return out


def ssm_traffic_per_device(cfg, data: int, model: int, batch: int, *,
                           ssm_mode: str = "replay", buffer_len: int = 16,
                           checkpoint_dtype="float32", buffer_dtype=None,
                           act_dtype=None) -> float:
  """HBM bytes of the SSM op of every Mamba layer on one device (replay:
  amortized over the L-step cycle)."""
  if ssm_mode not in SSM_MODES:
    raise ValueError(f"ssm_mode must be one of {SSM_MODES}, got "
                     f"{ssm_mode!r}.")
  loc = local_sizes(cfg, data, model, batch)
  dims = T.LayerDims(nheads=loc["ssm_heads"], headdim=cfg.head_dim,
                     dstate=cfg.d_state, ngroups=loc["ssm_groups"])
  act = act_dtype or cfg.dtype
  if ssm_mode == "baseline":
    per = T.baseline_step_bytes(dims, loc["batch"], checkpoint_dtype, act)
  else:
    per = T.replay_amortized_bytes(dims, loc["batch"], buffer_len,
                                   checkpoint_dtype, buffer_dtype or cfg.dtype,
                                   act)
  return per * sum(k == "mamba" for k in cfg.block_kinds)


def _ring(op, nbytes, m):
  if m <= 1:
    return 0.0
  return nbytes * (2 if op == "all-reduce" else 1) * (m - 1) / m


def layer_collectives(cfg, data: int, model: int, batch: int, *,
                      expert_parallel: bool = False,
                      gather_logits: bool = True) -> list[Collective]:
  """The collectives the rules imply for one decode step on one device (one
  entry per kind of layer, `count` = its layers; see the module
  docstring)."""
  m = _pos("model", model)
  loc = local_sizes(cfg, data, model, batch)
  b, dm = loc["batch"], cfg.d_model
  a = jnp.dtype(cfg.dtype)
  nbytes = b * dm * a.itemsize
  kinds = cfg.block_kinds
  row_parallel = dict(
      mamba=loc["ssm_heads"] < cfg.ssm_heads,
      gdn=gdn_heads(cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, m),
      kda=gdn_heads(cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, m),
      attention=splits(cfg.num_kv_heads, m),
      mlp=splits(cfg.intermediate_size, m),
      moe=expert_parallel and splits(cfg.n_routed_experts, m))
  out = []
  for kind, split in row_parallel.items():
    n = sum(k == kind for k in kinds)
    shared = cfg.moe_shared_expert_intermediate_size
    if kind == "moe" and n and shared > 0 and splits(shared, m) and (
            cfg.moe_activation == "relu2"):
      out.append(Collective("all-reduce", (b, dm), a.name, nbytes,
                            "moe shared_down", n, _ring("all-reduce",
                                                        nbytes, m)))
    if n and split:
      out.append(Collective("all-reduce", (b, dm), a.name, nbytes,
                            f"{kind} row-parallel out", n,
                            _ring("all-reduce", nbytes, m)))
  if splits(cfg.vocab_size, m):
    if cfg.tie_embeddings:
      out.append(Collective("all-reduce", (b, dm), a.name, nbytes,
                            "embedding lookup", 1,
                            _ring("all-reduce", nbytes, m)))
    if gather_logits:
      lb = b * cfg.vocab_size * 4
      out.append(Collective("all-gather", (b, cfg.vocab_size), "float32", lb,
                            "logits", 1, _ring("all-gather", lb, m)))
  return out


def decode_step_cost(cfg, data: int, model: int, batch: int, *,
                     ssm_mode: str = "replay", buffer_len: int = 16,
                     max_len: int = 128, checkpoint_dtype="float32",
                     buffer_dtype=None, kv_dtype=None, act_dtype=None,
                     expert_parallel: bool = False,
                     gather_logits: bool = True) -> DecodeCost:
  """State bytes, SSM traffic and collectives per device of one step."""
  if not isinstance(expert_parallel, bool):
    raise TypeError(f"expert_parallel must be a bool, got "
                    f"{expert_parallel!r}.")
  state = state_bytes_per_device(
      cfg, data, model, batch, ssm_mode=ssm_mode, buffer_len=buffer_len,
      max_len=max_len, checkpoint_dtype=checkpoint_dtype,
      buffer_dtype=buffer_dtype, kv_dtype=kv_dtype)
  ssm = ssm_traffic_per_device(
      cfg, data, model, batch, ssm_mode=ssm_mode, buffer_len=buffer_len,
      checkpoint_dtype=checkpoint_dtype, buffer_dtype=buffer_dtype,
      act_dtype=act_dtype)
  coll = tuple(layer_collectives(cfg, data, model, batch,
                                 expert_parallel=expert_parallel,
                                 gather_logits=gather_logits))
  layer = [c for c in coll if c.where not in ("logits", "embedding lookup")]
  return DecodeCost(
      data=data, model=model, batch=batch,
      local_batch=local_sizes(cfg, data, model, batch)["batch"],
      ssm_mode=ssm_mode, state_bytes=state, ssm_traffic_bytes=ssm,
      collectives=coll, psum_bytes=sum(c.bytes * c.count for c in layer),
      head_bytes=sum(c.bytes * c.count for c in coll if c not in layer))


# ----------------------------------------------------------- kernel routes
def kernel_routes(cfg, data: int, model: int, batch: int, *,
                  buffer_len: int = 16, policy=None) -> dict:
  """The routes the Mamba replay kernel's launch defaults
  (`pallas_kernels.replay.config`) pick for one device's shard of a decode
  step (b_l rows x H_l heads, `local_sizes`) on a Hopper GPU: whether the
  one fused launch runs (few (row, head) pairs), the output route
  ("split" for an 8-bit read copy at enough pairs, else "triton") and the
  flush route. Tensor parallelism divides the pairs by m, so a route that
  a batch takes on one device may change on m of them.

  policy: the state's `PrecisionPolicy` (None: f32 checkpoint, bf16
  buffers)."""
  from pallas_kernels.replay import config as RC  # the kernels' defaults
  from replayssm_jax.state import ReplayState
  loc = local_sizes(cfg, data, model, batch)
  b, h = loc["batch"], loc["ssm_heads"]
  kw = (dict(policy=policy) if policy is not None else
        dict(checkpoint_dtype=jnp.float32, buffer_dtype=jnp.bfloat16))
  rstate = jax.eval_shape(lambda: ReplayState.create(
      b, h, cfg.head_dim, cfg.d_state, loc["ssm_groups"], buffer_len, **kw))
  output = RC.default_output_route(rstate)
  plain = policy is None or policy.plain
  return dict(local_batch=b, local_heads=h, pairs=b * h,
              fused_launch=RC.default_fused_launch(b, h),
              output_route=output,
              flush_route=RC.default_flush_route(rstate, plain, output,
                                                 False, (9, 0)))


# --------------------------------------------------------- compiled HLO
COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter",
                  "collective-permute", "all-to-all")
_HLO_DTYPES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, f16=2, bf16=2, s32=4,
                   u32=4, f32=4, s64=8, u64=8, f64=8, c64=8, c128=16,
                   f8e4m3fn=1, f8e5m2=1, f8e4m3=1, f8e5m2fnuz=1,
                   f8e4m3fnuz=1, s4=1, u4=1)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+("
                    + "|".join(COLLECTIVE_OPS) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def parse_collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text (async pairs
  counted once, at their -start), one entry per result array (a
  combined or tuple-shaped op gives several; an async start's tuple holds
  its operand and result, whose last element is kept)."""
  if not isinstance(hlo_text, str):
    raise TypeError(f"hlo_text must be a str, got "
                    f"{type(hlo_text).__name__}.")
  out = []
  for line in hlo_text.splitlines():
    mt = _INSTR.match(line)
    if not mt:
      continue
    types, op, start = mt.groups()
    arrays = [(dt, tuple(int(x) for x in dims.split(",") if x))
              for dt, dims in _ARRAY.findall(types) if dt in _HLO_DTYPES]
    if start and op != "collective-permute" and len(arrays) > 1:
      arrays = arrays[len(arrays) // 2:]  # (operands..., results...)
    elif start:
      arrays = arrays[1:2] or arrays
    for dt, shape in arrays:
      out.append(Collective(op, shape, dt,
                            math.prod(shape) * _HLO_DTYPES[dt]))
  return out


def compiled_collectives(fn, *args, **jit_kw) -> list[Collective]:
  """The collectives XLA compiles `jax.jit(fn, **jit_kw)` into for `args`
  (their shardings pick the partitioning): `parse_collectives` of
  `jax.jit(fn).lower(*args).compile().as_text()`. An op inside a loop body
  appears once (per iteration)."""
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {type(fn).__name__}.")
  text = jax.jit(fn, **jit_kw).lower(*args).compile().as_text()
  return parse_collectives(text)
