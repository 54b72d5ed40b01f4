"""replayssm_jax.models.shard_layout: the shard-major Mamba layout computes
the same function as Hugging Face's, and a state regrouped into it
continues the same decode. (On a mesh: tests/test_sharding.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from replayssm_jax import sharding as SH
from replayssm_jax.models import shard_layout as SL
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.generate import generate
from replayssm_jax.models.model import HybridLM, decode_step, prefill


def _model(groups):
  cfg = ModelConfig(vocab_size=64, d_model=32, pattern="M*M-", ssm_heads=8,
                    head_dim=4, d_state=8, n_groups=groups, num_heads=4,
                    num_kv_heads=4, attn_head_dim=8, intermediate_size=32,
                    chunk_size=8)
  return HybridLM(cfg, rngs=nnx.Rngs(groups))


# (n_groups, shards): one group copied per shard, groups split with the
# shards, a shared group copied per shard of two.
@pytest.mark.parametrize("groups,t", [(1, 2), (4, 2), (2, 4)])
@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_same_function(groups, t, ssm_mode):
  model = _model(groups)
  laid = SL.to_shard_layout(model, t)
  assert laid.config.mamba_shards == t and model.config.mamba_shards == 1
  assert laid.config.bc_groups == max(groups, t)
  tok = jax.random.randint(jax.random.PRNGKey(1), (3, 6), 1, 64)
  ln = jnp.array([6, 4, 2], jnp.int32)
  kw = dict(ssm_mode=ssm_mode, buffer_len=4)
  want, _ = generate(model, tok, ln, 6, **kw)
  got, _ = generate(laid, tok, ln, 6, **kw)
  np.testing.assert_array_equal(got, want)
  # A state of the original model, prefilled and one step in, regrouped:
  # the laid-out model decodes on from it exactly as the original does.
  logits, state = prefill(model, tok, ln, model.init_state(3, 16, **kw))
  tok1 = jnp.argmax(logits, -1).astype(jnp.int32)
  # (copies: decode_step donates its state, and the regrouped state shares
  # the leaves it does not regroup)
  laid_state = jax.tree.map(jnp.copy,
                            SL.to_shard_state(state, model.config, t))
  want1, want_state = decode_step(model, tok1, state)
  got1, got_state = decode_step(laid, tok1, laid_state)
  np.testing.assert_array_equal(got1, want1)
  want_state = SL.to_shard_state(want_state, model.config, t)
  jax.tree.map(np.testing.assert_array_equal, got_state, want_state)


def test_layout_rules_and_errors():
  model = _model(2)
  assert SL.layout_shards(model.config, 4) == 4
  assert SL.layout_shards(model.config, 3) == 1  # 3 does not divide 8
  assert SL.layout_shards(model.config.replace(n_groups=4), 8) == 8
  laid = SL.to_shard_layout(model, 4)
  mesh = type("Mesh", (), dict(shape={"data": 1, "model": 4},
                               axis_names=SH.AXES))()
  specs = SH.param_specs(laid, mesh)
  mamba = ("blocks", 0, "mixer")
  assert specs[mamba + ("in_proj", "kernel")] == P(None, "model")
  assert specs[mamba + ("conv_weight",)] == P("model", None)
  assert specs[mamba + ("conv_bias",)] == P("model")
  assert specs[mamba + ("A_log",)] == P("model")
  state = SH.state_specs(laid.init_state(4, 8, buffer_len=4), mesh,
                         config=laid.config).layers[0]
  assert state.conv == P(None, None, "model")
  assert state.ssm.b_buf == P(None, None, "model")
  with pytest.raises(ValueError, match="already"):
    SL.to_shard_layout(laid, 2)
  with pytest.raises(ValueError, match="mamba_shards"):
    SL.to_shard_layout(model, 3)
