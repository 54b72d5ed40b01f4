"""replayssm_jax.sharding: the PartitionSpec rules, and decoding on 8 host
devices against one.

The device count must be set before jax starts, so `test_meshes` runs this
module's multi-device checks in subprocesses (one per ssm_mode, side by
side) with XLA_FLAGS=--xla_force_host_platform_device_count=8; in the
normal run (one CPU device) they skip, and the rule tests run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from replayssm_jax import serving
from replayssm_jax import sharding as SH
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.generate import generate
from replayssm_jax.models import model as M
from replayssm_jax.models import shard_layout as SL
from replayssm_jax.models.model import HybridLM, prefill
from replayssm_jax.models.proposers import NgramProposer
from replayssm_jax.models.speculative import speculative_generate
from replayssm_jax.precision import PrecisionPolicy

MULTI = jax.device_count() >= 8
only_multi = pytest.mark.skipif(not MULTI, reason="runs on 8 host devices")
MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))
TINY = dict(vocab_size=64, d_model=32, pattern="M*-EG", ssm_heads=8,
            head_dim=4, d_state=8, n_groups=1, num_heads=8, num_kv_heads=8,
            attn_head_dim=4, intermediate_size=32, n_routed_experts=8,
            moe_intermediate_size=16, chunk_size=8, gdn_num_k_heads=8,
            gdn_num_v_heads=16, gdn_k_dim=4, gdn_v_dim=4, gdn_chunk_size=8)
GDN = ("blocks", 4, "mixer")


def _model(**overrides):
  return HybridLM(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))


class _Mesh:
  """The rules read only mesh.shape and axis names: a stand-in of any
  size for the one-device process."""

  def __init__(self, data, model):
    self.shape = {"data": data, "model": model}
    self.axis_names = SH.AXES


# ------------------------------------------------------------------ rules
def test_param_rules():
  model = _model()
  specs = SH.param_specs(model, _Mesh(1, 4), expert_parallel=True)
  mamba = ("blocks", 0, "mixer")
  assert specs[mamba + ("A_log",)] == P("model")
  assert specs[mamba + ("dt_bias",)] == P("model")
  assert specs[mamba + ("out_proj", "kernel")] == P("model", None)
  assert specs[mamba + ("in_proj", "kernel")] == P()  # fused layout
  assert specs[mamba + ("conv_weight",)] == P()
  assert specs[mamba + ("norm", "weight")] == P()  # 1 group over 4 shards
  att = ("blocks", 1, "mixer")
  assert specs[att + ("k_proj", "kernel")] == P(None, "model")
  assert specs[att + ("o_proj", "kernel")] == P("model", None)
  assert specs[("blocks", 2, "mixer", "up_proj", "kernel")] == P(None,
                                                                 "model")
  assert specs[("blocks", 2, "mixer", "down_proj", "kernel")] == P("model",
                                                                   None)
  assert specs[("blocks", 3, "mixer", "up")] == P("model")
  assert specs[("blocks", 3, "mixer", "router")] == P()
  assert specs[("lm_head", "kernel")] == P(None, "model")
  assert specs[("embeddings", "weight")] == P()
  assert specs[("blocks", 0, "norm", "weight")] == P()
  assert specs[GDN + ("A_log",)] == P("model")
  assert specs[GDN + ("dt_bias",)] == P("model")
  assert specs[GDN + ("out_proj", "kernel")] == P("model", None)
  swiglu = SH.param_specs(_model(pattern="-", mlp_activation="swiglu"),
                          _Mesh(1, 4))  # [d, 2, f]: shards of f
  assert swiglu[("blocks", 0, "mixer", "gate_up")] == P(None, None, "model")
  assert SH.param_specs(_model(pattern="-", mlp_activation="swiglu",
                               intermediate_size=30), _Mesh(1, 4))[
                                   ("blocks", 0, "mixer", "gate_up")] == P()
  kda = _model(pattern="K")
  kspecs = SH.param_specs(kda, _Mesh(1, 4))
  mixer = ("blocks", 0, "mixer")
  assert kspecs[mixer + ("A_log",)] == kspecs[mixer + ("dt_bias",)] == P(
      "model")
  assert kspecs[mixer + ("f_b_proj", "kernel")] == P(None, "model")
  assert kspecs[mixer + ("out_proj", "kernel")] == P("model", None)
  assert kspecs[mixer + ("in_proj", "kernel")] == P()
  mla = SH.param_specs(_model(pattern="*", attn_head_dim=16, **MLA),
                       _Mesh(1, 4))
  assert mla[mixer + ("q_proj", "kernel")] == P(None, "model")
  assert mla[mixer + ("kv_b_proj", "kernel")] == P(None, "model")
  assert mla[mixer + ("kv_a_proj", "kernel")] == P()  # the shared latent
  assert mla[mixer + ("o_proj", "kernel")] == P("model", None)
  for name in (("in_proj", "kernel"), ("conv_weight",), ("norm_weight",)):
    assert specs[GDN + name] == P()  # fused layouts; the norm is per V
  # Experts replicated by default; norm groups split when they divide.
  assert SH.param_spec(model, ("blocks", 3, "mixer", "up"), 4) == P()
  grouped = _model(n_groups=4)
  assert SH.param_spec(grouped, mamba + ("norm", "weight"),
                       4) == P("model")


def test_param_rules_replicate_what_does_not_divide():
  model = _model(ssm_heads=6, num_kv_heads=2, intermediate_size=30,
                 n_routed_experts=6, vocab_size=66, tie_embeddings=True,
                 gdn_num_k_heads=2)  # HV = 16 divides, HK = 2 does not
  for path in (("blocks", 0, "mixer", "A_log"),
               ("blocks", 0, "mixer", "out_proj", "kernel"),
               ("blocks", 1, "mixer", "q_proj", "kernel"),
               ("blocks", 2, "mixer", "down_proj", "kernel"),
               ("blocks", 3, "mixer", "up"),
               ("embeddings", "weight"), GDN + ("A_log",),
               GDN + ("dt_bias",), GDN + ("out_proj", "kernel")):
    assert SH.param_spec(model, path, 4, expert_parallel=True) == P()
  # One model shard: nothing split.
  assert SH.param_spec(_model(), ("lm_head", "kernel"), 1) == P()


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_state_rules(ssm_mode):
  model = _model()
  state = model.init_state(4, 16, ssm_mode=ssm_mode, buffer_len=4)
  specs = SH.state_specs(state, _Mesh(2, 4))
  mamba, att = specs.layers[0], specs.layers[1]
  if ssm_mode == "replay":
    assert mamba.ssm.checkpoint == P("data", "model")
    assert mamba.ssm.x_buf == P("data", None, "model")
    assert mamba.ssm.dt_buf == P("data", None, "model")
    assert mamba.ssm.b_buf == P("data")
    assert mamba.ssm.count == P("data")
  else:
    assert mamba.ssm == P("data", "model")
  assert mamba.conv == P("data") and mamba.conv_start == P("data")
  assert att.k == P("data", "model") and att.length == P("data")
  assert specs.layers[2] is None and specs.positions == P("data")
  for config in (None, model.config):
    g = SH.state_specs(state, _Mesh(2, 4), config=config).layers[4]
    assert g.conv == P("data")
    if ssm_mode == "replay":
      assert g.ssm.checkpoint == P("data", "model")
      assert g.ssm.d_buf == g.ssm.k_buf == g.ssm.g_buf == P("data", None,
                                                            "model")
      assert g.ssm.count == P("data")
    else:  # a bare array splits its heads only with the config
      assert g.ssm == (P("data") if config is None else P("data", "model"))
  # HK = 2 on 4 model shards: the GDN state splits the batch only.
  narrow = _model(gdn_num_k_heads=2)
  g = SH.state_specs(narrow.init_state(4, 16, ssm_mode=ssm_mode,
                                       buffer_len=4), _Mesh(2, 4),
                     config=narrow.config).layers[4]
  leaves = jax.tree.leaves(g, is_leaf=lambda x: isinstance(x, P))
  assert leaves and all(s == P("data") for s in leaves)
  # A batch of 3 on 2 data shards and 8 heads on 3 model shards: replicated.
  odd = SH.state_specs(model.init_state(3, 16, ssm_mode=ssm_mode),
                       _Mesh(2, 3))
  leaves = jax.tree.leaves(odd, is_leaf=lambda x: isinstance(x, P))
  assert leaves and all(s == P() for s in leaves)


def test_read_copy_rules():
  model = _model(pattern="GM")
  for preset, h in (("f32+int8", "model"), ("f32+int8+sr", None)):
    # Stochastic rounding keeps the heads whole (keyed by row position).
    state = model.init_state(4, 16, buffer_len=4,
                             precision=PrecisionPolicy.preset(preset))
    specs = SH.state_specs(state, _Mesh(2, 4), config=model.config)
    want = P("data", h) if h else P("data")
    for r in (specs.layers[0].ssm, specs.layers[1].ssm):
      assert r.read_copy == r.read_scale == r.checkpoint == want
  assert specs.layers[0].ssm.row_id == specs.layers[1].ssm.step == P("data")


def test_one_device_mesh_and_no_mutation():
  model = _model(pattern="M*")
  mesh = SH.make_mesh(1, 1)
  before = jax.tree.map(np.asarray, nnx.state(model))
  sharded = SH.shard_model(model, mesh)
  assert sharded is not model
  state = model.init_state(2, 16)
  placed = SH.shard_state(state, mesh, config=model.config)
  assert placed is not state and placed.layers[0].ssm.checkpoint.sharding.mesh
  jax.tree.map(np.testing.assert_array_equal, before,
               jax.tree.map(np.asarray, nnx.state(model)))
  tok = jnp.array([[1, 2, 3], [4, 5, 0]])
  ln = jnp.array([3, 2])
  want, _ = prefill(model, tok, ln, model.init_state(2, 16))
  got, _ = prefill(sharded, tok, ln, placed)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_argument_errors():
  with pytest.raises(ValueError, match="model"):
    SH.make_mesh(1, 0)
  with pytest.raises(ValueError, match="devices"):
    SH.make_mesh(1, jax.device_count() + 1)
  with pytest.raises(TypeError, match="state"):
    SH.shard_state({}, SH.make_mesh(1, 1))
  with pytest.raises(TypeError, match="pool must be a serving.Pool"):
    SH.shard_pool(_model(pattern="M").init_state(2, 8), SH.make_mesh(1, 1))
  with pytest.raises(TypeError, match="expert_parallel"):
    SH.shard_model(_model(pattern="M"), SH.make_mesh(1, 1),
                   expert_parallel=1)


# ----------------------------------------------------------- 8 devices
@pytest.mark.skipif(MULTI, reason="the subprocess itself")
def test_meshes():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       f"{__file__}::{name}"], cwd=root, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
           for name in ("test_multi_device[replay]",
                        "test_multi_device[baseline]",
                        "test_kernels_per_shard",
                        "test_engine_on_a_mesh")]
  for p in procs:
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out[-3000:]
    assert "1 passed" in out, out[-3000:]


def _prompts():
  tok = jax.random.randint(jax.random.PRNGKey(1), (8, 6), 1, 64)
  return tok, jnp.array([6, 5, 4, 6, 3, 6, 2, 1], jnp.int32)


@only_multi
@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_multi_device(ssm_mode):
  # Both MLP forms: the packed SwiGLU kernel's shards of f hold gate and up.
  model = _model(mlp_activation="swiglu" if ssm_mode == "replay" else "relu2")
  tok, ln = _prompts()
  want_tokens, want_n = generate(model, tok, ln, 4, ssm_mode=ssm_mode,
                                 buffer_len=4)
  want_logits, _ = prefill(model, tok, ln, model.init_state(
      8, 16, ssm_mode=ssm_mode, buffer_len=4))
  # Replay on every mesh; the baseline state (a plain array per layer, the
  # replay checkpoint's layout) on an expert-parallel and a data-only one.
  for data, m in MESHES if ssm_mode == "replay" else MESHES[1::2]:
    mesh = SH.make_mesh(data, m)
    sharded = SH.shard_model(model, mesh, expert_parallel=data == 2)
    stok, sln = SH.shard_batch(tok, mesh), SH.shard_batch(ln, mesh)
    got, n = generate(sharded, stok, sln, 4, ssm_mode=ssm_mode,
                      buffer_len=4)
    np.testing.assert_array_equal(got, want_tokens, err_msg=f"{mesh.shape}")
    np.testing.assert_array_equal(n, want_n)
    state = SH.shard_state(model.init_state(8, 16, ssm_mode=ssm_mode,
                                            buffer_len=4), mesh,
                           config=model.config)
    logits, state = prefill(sharded, stok, sln, state)
    # 1e-5 relative to the logits' scale (a near-zero logit moves by the
    # split reductions' summation order).
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5,
                               atol=1e-5 * np.abs(want_logits).max(),
                               err_msg=f"{mesh.shape}")
    ckpt = state.layers[0].ssm
    ckpt = ckpt.checkpoint if ssm_mode == "replay" else ckpt
    assert len(ckpt.sharding.device_set) == 8
    g = state.layers[4].ssm
    g = g.checkpoint if ssm_mode == "replay" else g
    spec = tuple(g.sharding.spec) + (None, None)
    assert spec[1] == ("model" if m > 1 else None), g.sharding.spec
  if ssm_mode == "replay":  # one speculative case, on a 2x4 mesh
    proposer = NgramProposer(n=2)
    want, want_n, _ = speculative_generate(model, proposer, tok, ln, 4, 3,
                                           buffer_len=4)
    mesh = SH.make_mesh(2, 4)
    got, n, _ = speculative_generate(
        SH.shard_model(model, mesh), proposer, SH.shard_batch(tok, mesh),
        SH.shard_batch(ln, mesh), 4, 3, buffer_len=4)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(got, want_tokens)


MLA = dict(mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
           mla_qk_rope_head_dim=8, mla_v_head_dim=16, rope_theta=None)
# The kernels' shapes (power-of-two channel blocks of >= 16); n_groups 2:
# Mamba heads split with their groups at model 2, replicated at model 4.
KERNEL = dict(TINY, head_dim=16, d_state=16, n_groups=2,
              attn_head_dim=16, gdn_k_dim=16, gdn_v_dim=16)


@only_multi
def test_kernels_per_shard():
  """Under jax.set_mesh every dispatched op runs per shard (a
  shard_map in the compiled step), the Pallas kernels (interpret mode)
  included: tokens equal the single-device reference's."""
  model = _model(**KERNEL)
  tok, ln = _prompts()
  proposer = NgramProposer(n=2)
  # Each mode on one mesh (the read-copy check below runs replay's kernels
  # on the other; test_multi_device runs the reference ops on every mesh).
  for ssm_mode, (data, m) in (("replay", (2, 4)), ("baseline", (4, 2))):
    want, want_n = generate(model, tok, ln, 4, ssm_mode=ssm_mode,
                            buffer_len=4)
    want_spec, _, _ = speculative_generate(model, proposer, tok, ln, 6, 2,
                                           ssm_mode=ssm_mode, buffer_len=4)
    mesh = SH.make_mesh(data, m)
    sharded = SH.shard_model(model, mesh)
    stok, sln = SH.shard_batch(tok, mesh), SH.shard_batch(ln, mesh)
    with jax.set_mesh(mesh):
      got, n = generate(sharded, stok, sln, 4, ssm_mode=ssm_mode,
                        buffer_len=4, implementation="pallas")
      # (the GDN snapshot verify has no kernel: its reference runs per
      # shard)
      spec, _, _ = speculative_generate(
          sharded, proposer, stok, sln, 6, 2, ssm_mode=ssm_mode,
          buffer_len=4,
          implementation="pallas" if ssm_mode == "replay" else None)
    where = f"{ssm_mode} {mesh.shape}"
    np.testing.assert_array_equal(got, want, err_msg=where)
    np.testing.assert_array_equal(n, want_n, err_msg=where)
    np.testing.assert_array_equal(spec, want_spec, err_msg=where)
  # Precision policies: a read copy (heads split) and stochastic rounding
  # (heads kept whole), tokens and every state leaf as the kernels' on one
  # device.
  for preset in ("f32+int8", "f16+fp8+sr"):
    kw = dict(buffer_len=4, return_state=True, implementation="pallas",
              precision=PrecisionPolicy.preset(preset))
    want, _, want_state = generate(model, tok, ln, 5, **kw)
    with jax.set_mesh(mesh):
      got, _, state = generate(sharded, stok, sln, 5, **kw)
    np.testing.assert_array_equal(got, want, err_msg=preset)
    t = sharded.config.mamba_shards  # the sharded model's Mamba layout
    want_state = SL.to_shard_state(want_state, model.config, t)
    # The split matmuls around the ops sum in another order (~1e-7), which
    # may move an 8-bit / f16 store across a rounding boundary: a few
    # elements per 10^4 differ by one level. Rounding keyed wrongly (or a
    # different rounding) would move about half of them.
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want_state)):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      off = np.abs(a - b) > 1e-5 * max(np.abs(b).max(), 1e-30)
      assert off.mean() < 0.01, (preset, a.shape, off.mean())
  state = SH.shard_state(model.init_state(8, 16, buffer_len=4), mesh,
                         config=model.config)
  # Kimi Linear's blocks (reference ops, heads split): KDA, and multi-head
  # latent attention for '*'; speculative decoding from KDA replay states
  # (its verify's KDAWindow laid out per shard).
  kda_model = _model(**dict(KERNEL, pattern="M*GK", **MLA))
  want, _ = generate(kda_model, tok, ln, 4, buffer_len=4)
  want_spec, _, _ = speculative_generate(kda_model, proposer, tok, ln, 6, 2,
                                         buffer_len=4)
  with jax.set_mesh(mesh):
    kda_sharded = SH.shard_model(kda_model, mesh)
    got, _ = generate(kda_sharded, stok, sln, 4, buffer_len=4)
    spec, _, _ = speculative_generate(kda_sharded, proposer, stok, sln, 6, 2,
                                      buffer_len=4)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(spec, want_spec)
  graphdef, params = nnx.split(sharded)
  with jax.set_mesh(mesh):
    text = M._decode_jit.lower(graphdef, params, stok[:, 0], state,
                               "pallas").as_text()
  # At least the Mamba conv, SSM and gated norm, the attention and the GDN
  # step.
  assert text.count("sdy.manual_computation") >= 5, text[:2000]


@only_multi
def test_engine_on_a_mesh():
  """The continuous-batching engine on a 4x2 mesh (its pool placed, the
  kernels per shard), plain and speculative: each request's tokens are
  the single-device engine's."""
  model = _model(**KERNEL)
  mesh = SH.make_mesh(4, 2)
  sharded = SH.shard_model(model, mesh)
  tok, ln = _prompts()
  reqs = [(i, np.asarray(tok[i, :int(ln[i])]), 3 + i) for i in range(6)]
  for spec in (None, serving.Speculation(NgramProposer(n=2), window=2)):
    outs = []
    for m, mesh_ in ((model, None), (sharded, mesh)):
      eng = serving.Engine(m, 4, 32, steps_per_dispatch=3, buffer_len=4,
                           implementation="pallas", speculative=spec,
                           mesh=mesh_)
      for rid, p, n in reqs:  # 6 requests through 4 slots
        eng.submit(serving.Request(rid, p, max_new_tokens=n))
      outs.append(eng.run())
    assert outs[0] == outs[1], spec
    ckpt = eng.pool.state.layers[0].ssm.checkpoint
    assert ckpt.sharding.spec == P("data", "model"), ckpt.sharding
