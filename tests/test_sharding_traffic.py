"""replayssm_jax.sharding_traffic: the per-device model against hand
formulas, and (on 8 forced host devices, in a subprocess as in
tests/test_sharding.py) against the sharded arrays and the compiled HLO."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import sharding as SH
from replayssm_jax import sharding_traffic as ST
from replayssm_jax import traffic as T
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.model import HybridLM
from replayssm_jax.precision import PrecisionPolicy

MULTI = jax.device_count() >= 8
TINY = dict(vocab_size=64, d_model=32, pattern="M*-", ssm_heads=8,
            head_dim=4, d_state=8, n_groups=1, num_heads=8, num_kv_heads=8,
            attn_head_dim=4, intermediate_size=32, chunk_size=8,
            gdn_num_k_heads=4, gdn_num_v_heads=8, gdn_k_dim=4, gdn_v_dim=4)


def _cfg(**kw):
  return ModelConfig(**{**TINY, **kw})


# --------------------------------------------------------------- formulas
# (mesh, n_groups) -> the Mamba heads, stored B/C groups and conv channels
# one device holds (H 8, d_inner 32, N 8). shard_model lays the Mamba
# layers out in shard-major blocks when m divides H, and m and G one the
# other: then max(G, m) groups are stored (a copy per shard of a shared
# group) and the conv's d_inner + 2 max(G, m) N channels split too.
MAMBA_LOCAL = {((1, 1), 1): (8, 1, 48), ((2, 4), 1): (2, 1, 24),
               ((1, 8), 1): (1, 1, 20), ((4, 2), 1): (4, 1, 32),
               ((3, 3), 1): (8, 1, 48), ((1, 1), 2): (8, 2, 64),
               ((2, 4), 2): (2, 1, 24), ((1, 8), 2): (1, 1, 20),
               ((4, 2), 2): (4, 1, 32), ((3, 3), 2): (8, 2, 64)}


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
@pytest.mark.parametrize("mesh,groups", sorted(MAMBA_LOCAL))
def test_state_bytes_by_hand(ssm_mode, mesh, groups):
  d, m = mesh
  cfg, b, L, S = _cfg(pattern="M*-GK", n_groups=groups), 8, 4, 16
  got = ST.state_bytes_per_device(cfg, d, m, b, ssm_mode=ssm_mode,
                                  buffer_len=L, max_len=S)
  b_l = b // d if b % d == 0 else b
  h, g, conv_l = MAMBA_LOCAL[mesh, groups]
  hk = 8 // m if m > 1 and 8 % m == 0 else 8
  # GDN: HV 8, HK 4 split when m divides both.
  hv, hkk = (8 // m, 4 // m) if m in (2, 4) else (8, 4)
  P, N, K = cfg.head_dim, cfg.d_state, cfg.gdn_k_dim
  ssm = b_l * h * P * N * 4
  delta = 2 * b_l * hv * K * K * 4  # GDN and KDA
  if ssm_mode == "replay":  # f32 model: buffers in f32
    ssm += b_l * L * (h * P * 4 + h * 4 + g * N * 4) + 4 * b_l
    delta += b_l * L * (hv * K * 4 + hkk * K * 4 + hv * 4) + 4 * b_l  # GDN
    # KDA: a key per value head, a [HV, K] decay sum.
    delta += b_l * L * (hv * K * 4 + hv * K * 4) + b_l * hv * K * 4 + 4 * b_l
  conv = (b_l * (cfg.conv_kernel - 1) * (conv_l + 2 * cfg.gdn_conv_dim) * 4
          + 4 * b_l)
  kv = 2 * b_l * hk * S * cfg.attn_head_dim * 4 + 4 * b_l
  assert got == dict(mamba=ssm, delta=delta, conv=conv, attention=kv,
                     other=4 * b_l, total=ssm + delta + conv + kv + 4 * b_l)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_state_bytes_match_init_state_on_one_device(ssm_mode):
  cfg = _cfg(pattern="M*M-GK")
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  st = model.init_state(3, 16, ssm_mode=ssm_mode, buffer_len=4)
  want = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st))
  got = ST.state_bytes_per_device(cfg, 1, 1, 3, ssm_mode=ssm_mode,
                                  buffer_len=4, max_len=16)
  assert got["total"] == want


def test_ssm_traffic_uses_the_shard():
  cfg, b, L = _cfg(), 8, 4
  for d, m in ((1, 1), (2, 4), (1, 8)):
    dims = T.LayerDims(nheads=8 // m, headdim=4, dstate=8, ngroups=1)
    want_b = T.baseline_step_bytes(dims, b // d, "float32", "float32")
    want_r = T.replay_amortized_bytes(dims, b // d, L, "float32", "float32",
                                      "float32")
    assert ST.ssm_traffic_per_device(cfg, d, m, b, ssm_mode="baseline",
                                     buffer_len=L) == want_b
    assert ST.ssm_traffic_per_device(cfg, d, m, b, buffer_len=L) == want_r


def test_collectives_by_hand():
  cfg, b = _cfg(pattern="M*-M-"), 8
  for d, m in ((1, 8), (2, 4)):
    cost = ST.decode_step_cost(cfg, d, m, b)
    b_l = b // d
    # 2 Mamba out_proj + 1 o_proj + 2 MLP down psums of [b_l, d_model] f32.
    assert cost.psum_bytes == 5 * b_l * cfg.d_model * 4
    ar = [c for c in cost.collectives if c.op == "all-reduce"]
    assert {c.shape for c in ar} == {(b_l, cfg.d_model)}
    assert all(c.wire_bytes == 2 * (m - 1) / m * c.bytes for c in ar)
    (lg,) = [c for c in cost.collectives if c.where == "logits"]
    assert lg.bytes == b_l * cfg.vocab_size * 4 == cost.head_bytes
  # Nothing divides: no collective; one model shard: none either.
  odd = _cfg(ssm_heads=6, num_heads=6, num_kv_heads=6,
             intermediate_size=30, vocab_size=66)
  assert ST.decode_step_cost(odd, 1, 4, 8).collectives == ()
  assert ST.decode_step_cost(cfg, 8, 1, 8).collectives == ()
  # A tied, vocab-split table adds the lookup's all-reduce; bf16 halves.
  tied = ST.decode_step_cost(_cfg(tie_embeddings=True, dtype="bfloat16"),
                             1, 4, 8, gather_logits=False)
  assert tied.head_bytes == 8 * 32 * 2
  assert tied.psum_bytes == 3 * 8 * 32 * 2
  # MoE: only with expert parallelism.
  moe = _cfg(pattern="ME", n_routed_experts=8, moe_intermediate_size=16)
  assert ST.decode_step_cost(moe, 1, 4, 8).psum_bytes == 8 * 32 * 4
  assert ST.decode_step_cost(moe, 1, 4, 8,
                             expert_parallel=True).psum_bytes == 2 * 8 * 32 * 4


def test_parse_collectives():
  text = """
  %all-reduce.2 = f32[4,32]{1,0} all-reduce(%x), channel_id=18
  %t = (f32[4,1,16]{2,1,0}, bf16[4,1,16]{2,1,0}) all-to-all(%a, %b)
  %ags = (f32[2,3]{1,0}, f32[4,3]{1,0}) all-gather-start(%y), dimensions={0}
  %agd = f32[4,3]{1,0} all-gather-done(%ags)
  ROOT %cp = s32[8]{0} collective-permute(%z), source_target_pairs={{0,1}}
  %add = f32[4,32]{1,0} add(%all-reduce.2, %all-reduce.2)
  """
  got = [(c.op, c.shape, c.dtype, c.bytes)
         for c in ST.parse_collectives(text)]
  assert got == [("all-reduce", (4, 32), "f32", 4 * 32 * 4),
                 ("all-to-all", (4, 1, 16), "f32", 64 * 4),
                 ("all-to-all", (4, 1, 16), "bf16", 64 * 2),
                 ("all-gather", (4, 3), "f32", 12 * 4),
                 ("collective-permute", (8,), "s32", 8 * 4)]


def test_argument_errors():
  with pytest.raises(ValueError, match="ssm_mode"):
    ST.state_bytes_per_device(_cfg(), 1, 1, 2, ssm_mode="x")
  with pytest.raises(ValueError, match="model"):
    ST.decode_step_cost(_cfg(), 1, 0, 2)
  with pytest.raises(ValueError, match="batch"):
    ST.decode_step_cost(_cfg(), 1, 1, True)
  with pytest.raises(TypeError, match="expert_parallel"):
    ST.decode_step_cost(_cfg(), 1, 1, 2, expert_parallel=1)
  with pytest.raises(TypeError, match="fn"):
    ST.compiled_collectives(3)
  with pytest.raises(TypeError, match="hlo_text"):
    ST.parse_collectives(None)


# ----------------------------------------------------------- 8 devices
@pytest.mark.skipif(MULTI, reason="the subprocess itself")
def test_meshes():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root,
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       f"{__file__}::test_compiled_step"], cwd=root, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=600).stdout
  assert "2 passed" in out, out[-3000:]


@pytest.mark.skipif(not MULTI, reason="runs on 8 host devices")
@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_compiled_step(ssm_mode):
  cfg = _cfg(pattern="M*-GK")
  model = HybridLM(cfg, rngs=nnx.Rngs(0))
  b = 8
  for d, m in ((1, 8), (2, 4)):
    mesh = SH.make_mesh(d, m)
    gd, params = nnx.split(SH.shard_model(model, mesh))
    st = SH.shard_state(model.init_state(b, 16, ssm_mode=ssm_mode,
                                         buffer_len=4), mesh, config=cfg)
    tok = SH.shard_batch(jnp.zeros((b,), jnp.int32), mesh)
    cost = ST.decode_step_cost(cfg, d, m, b, ssm_mode=ssm_mode,
                               buffer_len=4, max_len=16)
    # (a) the state on each device, leaf by leaf.
    for dev in range(8):
      held = sum(x.addressable_shards[dev].data.nbytes
                 for x in jax.tree.leaves(st))
      assert held == cost.state_bytes["total"], (d, m, dev)
    # (c) the compiled step's residual-stream all-reduces.
    got = ST.compiled_collectives(
        lambda p, t, s: nnx.merge(gd, p).step(t, s), params, tok, st)
    b_l = b // d
    resid = [c for c in got if c.op == "all-reduce"
             and c.shape == (b_l, cfg.d_model)]
    assert sum(c.bytes for c in resid) == cost.psum_bytes, (d, m, got)
    # The other all-reduces are the small ones the model leaves out (the
    # gated norm's group sums, the SSM op's contraction over split heads).
    rest = [c for c in got if c.op == "all-reduce" and c not in resid]
    assert all(np.prod(c.shape) < b_l * cfg.d_model for c in rest), rest
    # The logits stay vocab-split: no gather in the step itself.
    assert not any(c.op == "all-gather" and c.shape[-1] == cfg.vocab_size
                   for c in got)


def test_kernel_routes_per_tensor_parallel_degree():
  # Nemotron-H 8B's Mamba heads (128 x 64, N 128, 8 groups) at batch 256:
  # an 8-bit read copy takes the split route at >= 256 x 128 (row, head)
  # pairs per device, i.e. on one device only; the fused launch runs below
  # 4 pairs per SM (528): at batch 8 on 2 devices and up.
  cfg = _cfg(ssm_heads=128, head_dim=64, d_state=128, n_groups=8)
  fp8 = PrecisionPolicy.preset("f32+fp8")
  got = {m: ST.kernel_routes(cfg, 1, m, 256, policy=fp8) for m in (1, 2, 8)}
  assert [got[m]["pairs"] for m in (1, 2, 8)] == [32768, 16384, 4096]
  assert [got[m]["output_route"] for m in (1, 2, 8)] == ["split", "triton",
                                                         "triton"]
  assert not any(r["fused_launch"] for r in got.values())
  small = {m: ST.kernel_routes(cfg, 1, m, 8) for m in (1, 2)}
  assert not small[1]["fused_launch"] and small[2]["fused_launch"]
  assert small[1]["output_route"] == "triton"
  # A plain f32 checkpoint flushes on Mosaic GPU from 128 rows per device.
  assert ST.kernel_routes(cfg, 1, 4, 256)["flush_route"] == "mosaic_gpu"
  assert ST.kernel_routes(cfg, 4, 1, 256)["flush_route"] == "triton"
