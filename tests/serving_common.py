"""The tiny hybrid model the serving tests share: Mamba-2 ('M'), attention
('*'), Gated DeltaNet ('G') and MLP ('-') blocks, random weights with the
norm weights randomized too (so that greedy tokens vary), f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import models

CFG = models.ModelConfig(
    vocab_size=64, d_model=32, pattern="M*G-M", ssm_heads=4, head_dim=8,
    d_state=8, n_groups=2, conv_kernel=4, chunk_size=8, num_heads=4,
    num_kv_heads=2, attn_head_dim=8, intermediate_size=48,
    gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_dim=8, gdn_v_dim=8,
    gdn_chunk_size=4)


def build_model(seed: int, norm_seed: int, cfg=CFG) -> models.HybridLM:
  """A random model of `cfg` whose norm weights are randomized too."""
  m = models.HybridLM(cfg, rngs=nnx.Rngs(seed))
  key = jax.random.PRNGKey(norm_seed)
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(m))):
    if path[-1] == "weight" and path[-2] in ("norm", "norm_f"):
      val = var.get_value()
      var.set_value(val + 0.5 * jax.random.normal(
          jax.random.fold_in(key, i), val.shape, val.dtype))
  return m


def greedy_tokens(model, tokens, n, ssm_mode="replay", buffer_len=4):
  """The n tokens of an independent greedy `generate` of one prompt (the
  reference a served request must match)."""
  out, _ = models.generate(model, jnp.asarray(tokens)[None],
                           jnp.array([len(tokens)]), n, ssm_mode=ssm_mode,
                           buffer_len=buffer_len)
  return [int(t) for t in out[0]]


def prompt(seed, length):
  """[length] random int32 token ids."""
  return jax.random.randint(jax.random.PRNGKey(seed), (length,), 0,
                            CFG.vocab_size, jnp.int32)


def poison_rows(tree, slot):
  """Row `slot` of every leaf of `tree` NaN / inf (floats) or garbage
  (ints, bools)."""
  def bad(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      fill = jnp.where(jnp.arange(x[slot].size).reshape(x[slot].shape) % 2,
                       jnp.inf, jnp.nan).astype(x.dtype)
    elif x.dtype == jnp.bool_:
      fill = jnp.ones_like(x[slot])
    else:
      fill = jnp.full_like(x[slot], 1_000_003)
    return x.at[slot].set(fill)
  return jax.tree.map(bad, tree)


def poison(pool, slot):
  """A pool whose slot `slot` holds garbage state and next token."""
  return pool.replace(state=poison_rows(pool.state, slot),
                      tokens=pool.tokens.at[slot].set(-77))
