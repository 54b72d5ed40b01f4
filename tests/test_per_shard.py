"""replayssm_jax.per_shard: the specs each dispatched op runs under on a
("data", "model") mesh, and when ops run per shard at all. (Running them
on 8 devices against one: tests/test_sharding.py::test_kernels_per_shard.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from replayssm_jax import ops, per_shard
from replayssm_jax import sharding as SH
from replayssm_jax.gdn.state import init_gdn_replay_state
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.model import HybridLM
from replayssm_jax.state import ReplayState

B, H, HD, N, L = 4, 8, 4, 8, 4


def sp(*axes):
  """P(*axes) as the rules write it (trailing Nones dropped)."""
  axes = list(axes)
  while axes and axes[-1] is None:
    axes.pop()
  return P(*axes)


def _mamba_args(ngroups, window=None):
  t = () if window is None else (window,)
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  return dict(
      rstate=ReplayState.create(B, H, HD, N, ngroups, L),
      x=jax.random.normal(k[0], (B,) + t + (H, HD)),
      dt=jax.random.normal(k[1], (B,) + t + (H,)), A=-jnp.ones(H),
      B=jax.random.normal(k[2], (B,) + t + (ngroups, N)),
      C=jax.random.normal(k[3], (B,) + t + (ngroups, N)), D=jnp.ones(H),
      z=None, dt_bias=jnp.zeros(H), dt_softplus=True)


@pytest.mark.parametrize("ngroups,m,heads,groups", [
    (1, 4, "model", None),      # one group: replicated beside split heads
    (2, 2, "model", "model"),   # groups split with their heads
    (2, 4, None, None),         # a shard's heads would span groups
    (8, 8, "model", "model")])
def test_mamba_rule(ngroups, m, heads, groups):
  assert per_shard.mamba_heads(H, ngroups, m) == (heads is not None)
  args = _mamba_args(ngroups)
  specs, out = per_shard.RULES["replay_state_update"](args, 2, m)
  assert specs["x"] == sp("data", heads)
  assert specs["dt"] == sp("data", heads)
  assert specs["A"] == sp(heads)
  assert specs["B"] == sp("data", groups)
  rs = specs["rstate"]
  assert rs.checkpoint == sp("data", heads)
  assert rs.x_buf == sp("data", None, heads)
  assert rs.b_buf == sp("data", None, groups)
  assert rs.count == sp("data")
  assert rs.read_copy is None
  y, new = out(jax.eval_shape(lambda: ops.replay_state_update(**args)))
  assert y == sp("data", heads)
  assert new.checkpoint == rs.checkpoint
  # The sharding rules place the state where the op reads it.
  cfg = ModelConfig(vocab_size=16, d_model=16, pattern="M", ssm_heads=H,
                    head_dim=HD, d_state=N, n_groups=ngroups)
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  mesh = type("Mesh", (), dict(shape={"data": 2, "model": m},
                               axis_names=SH.AXES))()
  placed = SH.state_specs(model.init_state(B, 8, buffer_len=L), mesh,
                          config=cfg).layers[0].ssm
  assert placed.checkpoint == rs.checkpoint
  assert placed.b_buf == rs.b_buf
  assert SH.param_specs(model, mesh)[("blocks", 0, "mixer", "A_log")] == (
      sp(heads))


def test_verify_rule_keeps_the_pending_window():
  args = _mamba_args(1, window=2)
  args.pop("rstate")
  args["rstate"] = ReplayState.create(B, H, HD, N, 1, L)
  specs, out = per_shard.RULES["replay_verify"](args, 4, 2)
  assert specs["x"] == P("data", None, "model")
  y, pending = out(jax.eval_shape(lambda: ops.replay_verify(**args)))
  assert y == P("data", None, "model")
  assert pending.pending_window == 2
  assert pending.x_buf == P("data", None, "model")


def test_gdn_attention_and_rows_only_rules():
  hv, hk, kd, vd = 8, 4, 4, 4
  st = init_gdn_replay_state(B, num_v_heads=hv, num_k_heads=hk, key_dim=kd,
                             value_dim=vd, buffer_len=L)
  args = dict(rstate=st, q=jnp.ones((B, hk, kd)), k=jnp.ones((B, hk, kd)),
              v=jnp.ones((B, hv, vd)), g=jnp.ones((B, hv)),
              beta=jnp.ones((B, hv)))
  specs, _ = per_shard.RULES["gdn_replay_step"](args, 2, 4)
  assert specs["q"] == P("data", "model")
  assert specs["rstate"].k_buf == P("data", None, "model")
  assert specs["rstate"].g_buf == P("data", None, "model")
  specs, _ = per_shard.RULES["gdn_replay_step"](args, 2, 8)  # HK 4 of 8
  assert specs["q"] == P("data") and specs["rstate"].checkpoint == P("data")
  att = dict(q=jnp.ones((B, 2, 8, 4)), k_cache=jnp.ones((B, 4, 16, 4)),
             v_cache=jnp.ones((B, 4, 16, 4)), lengths=jnp.ones(B, jnp.int32))
  specs, out = per_shard.RULES["decode_attention"](att, 1, 4)
  assert specs["q"] == P(None, None, "model")  # batch 4 over data 1
  assert specs["k_cache"] == P(None, "model")
  assert out(att["q"]) == P(None, None, "model")
  conv = dict(x=jnp.ones((B, 24)), conv_state=jnp.ones((B, 3, 16)),
              start=jnp.zeros(B, jnp.int32), weight=jnp.ones((16, 4)))
  specs, out = per_shard.RULES["causal_conv1d_step"](conv, 4, 2)
  assert set(specs) == {"x", "conv_state", "start"}  # the weight replicated
  assert specs["conv_state"] == P("data")
  assert out((conv["x"], conv["conv_state"])) == (P("data"), P("data"))


def test_kda_replay_verify_rule_lays_out_its_window():
  """kda_replay_verify's third output (the KDAWindow) splits as the
  window's tokens: rows over "data", value heads over "model"."""
  from replayssm_jax import kda  # pylint: disable=g-import-not-at-top
  hv, hk, kd, vd, t = 8, 4, 4, 4, 2
  st = kda.init_kda_replay_state(B, num_v_heads=hv, key_dim=kd,
                                 value_dim=vd, buffer_len=L)
  args = dict(rstate=st, q=jnp.ones((B, t, hk, kd)),
              k=jnp.ones((B, t, hk, kd)), v=jnp.ones((B, t, hv, vd)),
              g=-jnp.ones((B, t, hv, kd)), beta=jnp.ones((B, t, hv)))
  specs, out = per_shard.RULES["kda_replay_verify"](args, 2, 4)
  assert specs["g"] == P("data", None, "model")
  assert specs["rstate"].g_sum == P("data", "model")
  o, pending, window = out(jax.eval_shape(
      lambda: kda.verify.kda_replay_verify_reference(**args)))
  assert o == P("data", None, "model")
  assert pending.k_buf == P("data", None, "model")
  assert window.k == window.G == window.d == P("data", None, "model")
  assert window.stored == P("data")


def test_ops_run_per_shard_only_on_a_context_mesh():
  assert per_shard.active_mesh() is None
  with jax.set_mesh(SH.make_mesh(1, 1)):  # one device: run as written
    assert per_shard.active_mesh() is None
  calls = []
  assert per_shard.call("no_such_op", lambda **a: calls.append(a) or 1,
                        dict(x=1)) == 1 and calls == [dict(x=1)]


@pytest.mark.parametrize("m,split", [(2, True), (4, False)])
def test_gated_norm_rule(m, split):
  # 2 groups of 16 channels: split over 2 shards, gathered over 4.
  args = dict(y=jnp.ones((B, 32)), z=jnp.ones((B, 80)), weight=jnp.ones(32),
              group_size=16, eps=1e-6, z_offset=0, out_dtype=None)
  specs, out, *local = per_shard.RULES["gated_rms_norm"](args, 2, m)
  assert specs["z"] == P("data")  # the in_proj output, replicated
  if split:
    assert specs["y"] == P("data", "model")
    assert specs["weight"] == P("model")
    assert out(args["y"]) == P("data", "model") and len(local) == 1
  else:
    assert specs["y"] == P("data") and "weight" not in specs
    assert out(args["y"]) == P("data") and not local
  # A gate of its own (the shard-major layout's joined z) splits with y.
  specs, _, *local = per_shard.RULES["gated_rms_norm"](
      dict(args, z=jnp.ones((B, 32))), 2, m)
  assert specs["z"] == specs["y"] and not local
