"""Mixture-of-experts MLP block ('E' in the layer pattern).

  y = fc2(routed(fc1(h))) + shared(h)

Router (`ModelConfig.moe_router`):
  "sigmoid" (NemotronH): scores = sigmoid(h @ W_r) in float32; the choice
    adds `e_score_correction_bias` to the scores; with n_group > 1 only the
    `topk_group` groups of experts whose two best choice scores sum highest
    stay eligible; the top `num_experts_per_tok` experts by choice score are
    picked and weighted by their plain scores, divided by their sum (+1e-20)
    when `norm_topk_prob`, times `routed_scaling_factor`.
  "softmax_topk" (Granite MoE): the top-k router logits, softmaxed over the
    k picked (then `norm_topk_prob` / `routed_scaling_factor` as above).
  "softmax" (Qwen3-Next): the softmax over all E logits, the top k of it
    picked and weighted by their probabilities (then `norm_topk_prob` /
    `routed_scaling_factor` as above).

Routed experts: "relu2" (NemotronH: down(relu(up(x))^2)) or "swiglu"
(down(silu(g) * u), [g, u] = up(x) with the gate in the first half, as
Granite's fused input_linear). fc1 / fc2 are the latent projections
d -> moe_latent_size -> d (Nemotron 3), identities when the size is None.
The shared expert is a dense MLP of width moe_shared_expert_intermediate_size
(0: none) with the experts' activation; with `moe_shared_expert_gate`
(Qwen3-Next) its output is multiplied by sigmoid(h @ shared_gate), a
[d, 1] weight, per token.

`routed_experts` dispatches by sorting the (token, expert) pairs by expert
and running the expert matmuls as `jax.lax.ragged_dot` over the groups (each
token meets only its k experts), or, for at most E pairs (a decode step of
a few rows), by gathering each pair's expert weights;
`routed_experts_reference` runs every
expert on every token and keeps the routed outputs (tests). Routing is per
token, so every position's output depends on that position only: prefill
[b, T, d], a decode step [b, d] and a verify window [b, T, d] all take the
same call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax.models.config import (MOE_ACTIVATIONS, MOE_ROUTERS,
                                         ModelConfig)

F32 = jnp.float32


def _normal(rngs, shape, std, dtype):
  return (std * jax.random.normal(rngs.params(), shape, F32)).astype(dtype)


def activate(u, activation: str):
  """relu2: relu(u)^2; swiglu: silu(gate) * up with u = [gate, up]."""
  if activation == "relu2":
    return jnp.square(jax.nn.relu(u))
  if activation == "swiglu":
    g, v = jnp.split(u, 2, axis=-1)
    return jax.nn.silu(g) * v
  raise ValueError(f"MoE activation must be one of {MOE_ACTIVATIONS}, got "
                   f"{activation!r}.")


def route(logits, *, top_k: int, router: str = "sigmoid", bias=None,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          routed_scaling_factor: float = 1.0):
  """Router logits [n, E] float32 -> (weights [n, k] float32, experts [n, k]
  int32). See the module docstring for the two router kinds."""
  n, e = logits.shape
  logits = logits.astype(F32)
  if router == "softmax_topk":
    top, idx = jax.lax.top_k(logits, top_k)
    w = jax.nn.softmax(top, axis=-1)
  elif router == "softmax":
    w, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
  elif router == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(F32)
    if n_group > 1:
      per = e // n_group
      grouped = choice.reshape(n, n_group, per)
      group_scores = jax.lax.top_k(grouped, min(2, per))[0].sum(-1)
      _, gidx = jax.lax.top_k(group_scores, topk_group)  # [n, topk_group]
      keep = jnp.zeros((n, n_group), bool).at[
          jnp.arange(n)[:, None], gidx].set(True)
      keep = jnp.repeat(keep, per, axis=1)  # [n, E]
      choice = jnp.where(keep, choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, idx, axis=1)
  else:
    raise ValueError(f"MoE router must be one of {MOE_ROUTERS}, got "
                     f"{router!r}.")
  if norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return w * routed_scaling_factor, idx.astype(jnp.int32)


def routed_experts(x, weights, experts, up, down, activation: str,
                   dispatch: str = "auto"):
  """The routed experts' weighted sum per token: x [n, d_in]; weights,
  experts [n, k]; up [E, d_in, F] (F = 2 * inter for swiglu), down
  [E, inter, d_in] -> [n, d_in] in x's dtype.

  dispatch: "sorted" (`routed_experts_sorted`), "gather" (each (token,
  expert) pair gathers its expert's weights: reads only the picked experts,
  for a few tokens as in a decode step) or "auto": "gather" when n * k <= E
  (the gathered weights are then no larger than all experts'), else
  "sorted". Shapes are static, so the choice is made at trace time.
  """
  n, k = experts.shape
  if dispatch == "auto":
    dispatch = "gather" if n * k <= up.shape[0] else "sorted"
  if dispatch == "sorted":
    return routed_experts_sorted(x, weights, experts, up, down, activation)
  if dispatch != "gather":
    raise ValueError(f"dispatch must be 'auto', 'sorted' or 'gather', got "
                     f"{dispatch!r}.")
  flat = experts.reshape(-1)
  xs = jnp.repeat(x, k, axis=0)  # [n*k, d_in], pair p = token p // k
  hid = jnp.einsum("pd,pdf->pf", xs, jnp.take(up, flat, axis=0).astype(
      x.dtype), preferred_element_type=F32)
  hid = activate(hid, activation).astype(x.dtype)
  out = jnp.einsum("pf,pfd->pd", hid, jnp.take(down, flat, axis=0).astype(
      x.dtype), preferred_element_type=F32)
  out = out * weights.reshape(-1)[:, None]
  return out.reshape(n, k, out.shape[-1]).sum(1).astype(x.dtype)


def routed_experts_sorted(x, weights, experts, up, down, activation: str):
  """Grouped dispatch. x [n, d_in]; weights, experts [n, k]; up [E, d_in, F]
  (F = 2 * inter for swiglu), down [E, inter, d_in] -> [n, d_in] in x's
  dtype (accumulated in float32).

  The n * k (token, expert) pairs are sorted by expert (stable: an
  expert's tokens keep their order); `jax.lax.ragged_dot` multiplies each
  expert's contiguous rows by its weights (an expert no token picked is a
  group of size 0); the weighted outputs are added back to their tokens.
  """
  n, k = experts.shape
  num_experts = up.shape[0]
  flat = experts.reshape(-1)  # [n*k]
  order = jnp.argsort(flat, stable=True)
  tok = order // k
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  xs = jnp.take(x, tok, axis=0)  # [n*k, d_in]
  hid = jax.lax.ragged_dot(xs, up.astype(x.dtype), sizes,
                           preferred_element_type=F32)
  hid = activate(hid, activation).astype(x.dtype)
  out = jax.lax.ragged_dot(hid, down.astype(x.dtype), sizes,
                           preferred_element_type=F32)
  out = out * jnp.take(weights.reshape(-1), order)[:, None]
  return jnp.zeros((n, x.shape[-1]), F32).at[tok].add(out).astype(x.dtype)


def routed_experts_reference(x, weights, experts, up, down, activation: str):
  """Dense reference of `routed_experts`: every expert on every token
  ([E, n, ...]), each token keeping the outputs of its picked experts
  (selected with `where`), weighted."""
  num_experts = up.shape[0]
  hid = jnp.einsum("nd,edf->enf", x.astype(F32), up.astype(F32))
  out = jnp.einsum("enf,efd->end", activate(hid, activation),
                   down.astype(F32))  # [E, n, d_in]
  onehot = experts[..., None] == jnp.arange(num_experts)  # [n, k, E]
  w = jnp.sum(jnp.where(onehot, weights[..., None], 0.0), axis=1)  # [n, E]
  picked = jnp.any(onehot, axis=1).T[..., None]  # [E, n, 1]
  y = jnp.sum(jnp.where(picked, w.T[..., None] * out, 0.0), axis=0)
  return y.astype(x.dtype)


class _Linear(nnx.Module):
  """y = x @ kernel ([in, out], as layers.Linear)."""

  def __init__(self, d_in, d_out, cfg: ModelConfig, *, rngs):
    self.dtype = cfg.jnp_dtype
    self.kernel = nnx.Param(_normal(rngs, (d_in, d_out), d_in ** -0.5,
                                    cfg.jnp_param_dtype))

  def __call__(self, x):
    return jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


class MoE(nnx.Module):
  """The MoE block's mixer: h [..., d] -> [..., d] (stateless)."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.cfg = cfg
    d, e = cfg.d_model, cfg.n_routed_experts
    d_in = cfg.moe_latent_size or d
    inter = cfg.moe_intermediate_size
    width = 2 * inter if cfg.moe_activation == "swiglu" else inter
    pdt = cfg.jnp_param_dtype
    # The router runs in float32 (its weight and correction bias stay
    # float32 whatever param_dtype, as in transformers' NemotronH).
    self.router = nnx.Param(_normal(rngs, (d, e), d ** -0.5, F32))  # [d, E]
    if cfg.moe_router_bias:
      self.router_bias = nnx.Param(_normal(rngs, (e,), 0.1, F32))
    self.up = nnx.Param(_normal(rngs, (e, d_in, width), d_in ** -0.5, pdt))
    self.down = nnx.Param(_normal(rngs, (e, inter, d_in), inter ** -0.5,
                                  pdt))
    if cfg.moe_latent_size:
      self.fc1_latent = _Linear(d, d_in, cfg, rngs=rngs)
      self.fc2_latent = _Linear(d_in, d, cfg, rngs=rngs)
    s = cfg.moe_shared_expert_intermediate_size
    if s:
      self.shared_up = _Linear(
          d, 2 * s if cfg.moe_activation == "swiglu" else s, cfg, rngs=rngs)
      self.shared_down = _Linear(s, d, cfg, rngs=rngs)
      if cfg.moe_shared_expert_gate:
        self.shared_gate = nnx.Param(_normal(rngs, (d, 1), d ** -0.5,
                                             cfg.jnp_param_dtype))

  def routing(self, h2):
    """h2 [n, d] -> (weights [n, k] float32, experts [n, k] int32)."""
    c = self.cfg
    logits = jnp.dot(h2.astype(F32), self.router[...].astype(F32))
    return route(logits, top_k=c.num_experts_per_tok, router=c.moe_router,
                 bias=self.router_bias[...] if c.moe_router_bias else None,
                 n_group=c.n_group, topk_group=c.topk_group,
                 norm_topk_prob=c.norm_topk_prob,
                 routed_scaling_factor=c.routed_scaling_factor)

  def __call__(self, h, reference: bool = False):
    """h [..., d] -> [..., d] in config.dtype; `reference`: the dense
    reference dispatch (tests)."""
    c = self.cfg
    lead = h.shape[:-1]
    h2 = h.reshape(-1, h.shape[-1]).astype(c.jnp_dtype)
    weights, experts = self.routing(h2)
    x = self.fc1_latent(h2) if c.moe_latent_size else h2
    fn = routed_experts_reference if reference else routed_experts
    y = fn(x, weights, experts, self.up[...], self.down[...],
           c.moe_activation)
    if c.moe_latent_size:
      y = self.fc2_latent(y)
    if c.moe_shared_expert_intermediate_size:
      shared = self.shared_down(
          activate(self.shared_up(h2), c.moe_activation)).astype(F32)
      if c.moe_shared_expert_gate:
        shared = shared * jax.nn.sigmoid(jnp.dot(
            h2.astype(F32), self.shared_gate[...].astype(F32)))
      y = y.astype(F32) + shared
    return y.astype(c.jnp_dtype).reshape(lead + (c.d_model,))


def moe_reference(module: MoE, h):
  """The MoE block with the dense reference dispatch."""
  return module(h, reference=True)
