"""The MoE block: the gather, capacity and sorted (ragged_dot) dispatches
against the dense reference,
the router's rules, and the 'E' block in forward / prefill / decode /
verify."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import models
from replayssm_jax.models import moe as MOE
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.testing import tolerance

TOL = tolerance(jnp.float32)
DISPATCHES = ("capacity", "sorted", "gather")


def _cfg(**kw):
  base = dict(vocab_size=64, d_model=32, pattern="E", n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=24,
              moe_shared_expert_intermediate_size=16)
  base.update(kw)
  return ModelConfig(**base)


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL.rtol,
                             atol=TOL.atol)


@pytest.mark.parametrize("kw,shape", [
    (dict(), (3, 5)),                                      # prefill-like
    (dict(), (4,)),                                        # a decode step
    (dict(n_group=4, topk_group=2, routed_scaling_factor=2.5), (2, 7)),
    (dict(moe_latent_size=12), (2, 3)),
    (dict(norm_topk_prob=False, moe_router_bias=False), (1, 9)),
    (dict(moe_router="softmax_topk", moe_router_bias=False,
          moe_activation="swiglu", num_experts_per_tok=3), (2, 6)),
    (dict(moe_shared_expert_intermediate_size=0, num_experts_per_tok=8),
     (2, 4)),
])
def test_grouped_dispatch_matches_reference(kw, shape):
  cfg = _cfg(**kw)
  m = MOE.MoE(cfg, rngs=nnx.Rngs(1))
  h = jax.random.normal(jax.random.PRNGKey(2), shape + (cfg.d_model,))
  y = jax.jit(lambda h: m(h))(h)
  assert y.shape == h.shape
  _close(y, MOE.moe_reference(m, h))
  h2 = h.reshape(-1, cfg.d_model)
  w, idx = m.routing(h2)
  x = m.fc1_latent(h2) if cfg.moe_latent_size else h2
  for dispatch in DISPATCHES:
    _close(MOE.routed_experts(x, w, idx, m.up[...], m.down[...],
                              cfg.moe_activation, dispatch),
           MOE.routed_experts_reference(x, w, idx, m.up[...], m.down[...],
                                        cfg.moe_activation))


def test_empty_experts_and_ties():
  """All tokens pick the same experts (every other expert has 0 tokens), and
  tied scores: both dispatches agree and route the same way."""
  n, d, e = 6, 16, 8
  x = jax.random.normal(jax.random.PRNGKey(0), (n, d))
  up = jax.random.normal(jax.random.PRNGKey(1), (e, d, 10))
  down = jax.random.normal(jax.random.PRNGKey(2), (e, 10, d))
  logits = jnp.zeros((n, e))  # all scores tie
  w, idx = MOE.route(logits, top_k=2, bias=None)
  assert (np.asarray(idx) == [[0, 1]] * n).all()  # ties: lowest index
  np.testing.assert_allclose(np.asarray(w), 0.5, rtol=1e-6)
  for f in ("relu2", "swiglu"):
    u = up if f == "relu2" else jnp.concatenate([up, up[..., ::-1]], -1)
    for dispatch in DISPATCHES:
      _close(MOE.routed_experts(x, w, idx, u, down, f, dispatch),
             MOE.routed_experts_reference(x, w, idx, u, down, f))
  # One expert only for every token, the others receive none.
  idx1 = jnp.full((n, 1), 5, jnp.int32)
  w1 = jnp.ones((n, 1))
  for dispatch in DISPATCHES:
    _close(MOE.routed_experts(x, w1, idx1, up, down, "relu2", dispatch),
           MOE.routed_experts_reference(x, w1, idx1, up, down, "relu2"))
    # No token at all.
    z = MOE.routed_experts(x[:0], w1[:0], idx1[:0], up, down, "relu2",
                           dispatch)
    assert z.shape == (0, d)


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
def test_capacity_dispatch_fits_and_overflows(activation):
  """Capacity slots below n: a capacity that holds the largest group runs
  one round of the batched einsum, smaller ones more rounds (down to one
  slot per expert); all equal the reference. Slots no token filled are
  never read back: NaN weights at the experts no token picked do not reach
  the output."""
  n, d, e, k, f = 64, 16, 8, 2, 12
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  x = jax.random.normal(keys[0], (n, d))
  up = jax.random.normal(keys[1], (e, d, 2 * f if activation == "swiglu"
                                   else f)) * d ** -0.5
  down = jax.random.normal(keys[2], (e, f, d)) * f ** -0.5
  # Experts 0..5 only: experts 6 and 7 receive no token.
  w, idx = MOE.route(jax.random.normal(keys[3], (n, e)).at[:, 6:].set(-9.0),
                     top_k=k, bias=None)
  sizes = np.bincount(np.asarray(idx).ravel(), minlength=e)
  assert sizes[6:].sum() == 0 and sizes.max() < n
  ref = MOE.routed_experts_reference(x, w, idx, up, down, activation)
  fit = int(sizes.max())
  u, dn = up.at[6:].set(jnp.nan), down.at[6:].set(jnp.nan)
  for cap in (fit, fit - 1, 7, 1):
    y = jax.jit(lambda x, w, idx, cap=cap: MOE.routed_experts_capacity(
        x, w, idx, u, dn, activation, capacity=cap))(x, w, idx)
    assert np.isfinite(np.asarray(y)).all()
    _close(y, ref)


def test_expert_capacity():
  assert MOE.expert_capacity(256, 6, 128) == 32  # 2 x mean 12, + 8
  assert MOE.expert_capacity(64, 6, 128) == 16
  assert MOE.expert_capacity(4, 6, 128) == 4  # n slots cannot overflow


def test_grouped_topk_rule():
  """Grouped top-k keeps the topk_group groups with the best top-2 sums:
  the single best expert sits in a losing group and is not picked."""
  bias = jnp.zeros((8,))
  # Groups of 2: {0,1} {2,3} {4,5} {6,7}; logits whose sigmoids are p.
  p = jnp.array([[0.95, 0.01, 0.6, 0.6, 0.5, 0.5, 0.1, 0.1]])
  w, idx = MOE.route(jnp.log(p / (1 - p)), top_k=2, bias=bias, n_group=4,
                     topk_group=1, norm_topk_prob=False)
  assert sorted(np.asarray(idx)[0].tolist()) == [2, 3]
  np.testing.assert_allclose(np.asarray(w), [[0.6, 0.6]], rtol=1e-5)
  # The correction bias changes the choice, not the weights.
  bias = jnp.zeros((8,)).at[0].set(1.0)
  w, idx = MOE.route(jnp.log(p / (1 - p)), top_k=2, bias=bias, n_group=4,
                     topk_group=1, norm_topk_prob=False,
                     routed_scaling_factor=2.0)
  assert sorted(np.asarray(idx)[0].tolist()) == [0, 1]
  np.testing.assert_allclose(np.asarray(w)[0], [1.9, 0.02], rtol=1e-5)


def _hybrid_cfg(**kw):
  base = dict(vocab_size=64, d_model=32, pattern="ME*E", ssm_heads=4,
              head_dim=8, d_state=8, chunk_size=4, num_heads=4,
              num_kv_heads=2, attn_head_dim=8, rope_theta=None,
              n_routed_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
              n_group=2, topk_group=1, moe_latent_size=12)
  base.update(kw)
  return ModelConfig(**base)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_moe_blocks_prefill_decode_verify(ssm_mode):
  """Prefill + decode steps and a verify window reproduce the full forward's
  logits (per-token routing: position t depends on positions <= t only)."""
  cfg = _hybrid_cfg()
  model = models.HybridLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 9), 0, 64)
  full = model(tokens)
  p = 5
  state = model.init_state(2, 16, ssm_mode=ssm_mode, buffer_len=4)
  logits, state = models.prefill(model, tokens[:, :p],
                                 jnp.full((2,), p, jnp.int32), state)
  tol = dict(rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits, full[:, p - 1], **tol)
  logits, state2 = models.decode_step(model, tokens[:, p], state)
  np.testing.assert_allclose(logits, full[:, p], **tol)
  win, _ = models.verify(model, tokens[:, p + 1:], state2)
  np.testing.assert_allclose(win, full[:, p + 1:], **tol)
