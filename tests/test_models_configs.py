"""The model configs (configs/{tiny,mamba2_130m,hybrid_1b,nemotron_h_8b}.py),
the decode_bench smoke run and its random-weight models."""

import os

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("ml_collections")

from configs import hybrid_1b, mamba2_130m, nemotron_h_8b, tiny  # noqa: E402
from experiments import common  # noqa: E402
from experiments import decode_bench  # noqa: E402
from replayssm_jax.models import ModelConfig  # noqa: E402

MODULES = (tiny, mamba2_130m, hybrid_1b, nemotron_h_8b)


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
def test_model_configs_build(mod):
  full = mod.get_config()
  assert full.to_dict() == mod.get_config("").to_dict()
  cfg = ModelConfig(**full.model.to_dict())
  smoke = ModelConfig(**mod.get_config("smoke").model.to_dict())
  assert smoke.d_model <= 32
  with pytest.raises(ValueError, match="smoke"):
    mod.get_config("bogus")
  assert "python -m experiments.decode_bench" in mod.__doc__
  assert cfg.n_layers >= 6


def test_published_shapes():
  m = ModelConfig(**mamba2_130m.get_config().model.to_dict())
  assert (m.d_model, m.n_layers, m.d_state, m.head_dim, m.d_inner,
          m.n_groups, m.vocab_size, m.conv_kernel, m.tie_embeddings) == (
              768, 24, 128, 64, 2 * 768, 1, 50280, 4, True)
  assert set(m.pattern) == {"M"}
  n = ModelConfig(**nemotron_h_8b.get_config().model.to_dict())
  assert (n.d_model, n.n_layers, n.ssm_heads, n.head_dim, n.d_state,
          n.n_groups, n.num_heads, n.num_kv_heads, n.attn_head_dim,
          n.intermediate_size, n.vocab_size) == (
              4096, 52, 128, 64, 128, 8, 32, 8, 128, 21504, 131072)
  assert (n.pattern.count("M"), n.pattern.count("*"),
          n.pattern.count("-")) == (24, 4, 24)


def test_decode_bench_smoke(tmp_path):
  config = tiny.get_config("smoke")
  config.bench.replay_policies = ("f32+bf16",)
  out = decode_bench.run(config, str(tmp_path / "bench"))
  records = common.read_metrics(os.path.join(out["workdir"],
                                             "metrics.jsonl"))
  assert records[0]["kind"] == "environment"
  decode = [r for r in records if r["kind"] == "decode"]
  assert [(r["ssm_mode"], r["buffer_len"], r["policy"]) for r in decode] == [
      ("baseline", None, ""), ("replay", 4, ""), ("replay", 4, "f32+bf16")]
  for r in decode:
    assert r["tokens_per_s"] > 0 and r["state_bytes"] > 0
  # The dual-precision state holds the bf16 read copy besides the master.
  assert decode[2]["state_bytes"] > decode[1]["state_bytes"]
  # The time split: every part once, the Mamba parts once per state.
  parts = [(r["part"], r["ssm_mode"], r["policy"]) for r in records
           if r["kind"] == "part"]
  assert sorted(parts, key=str) == sorted(
      [(part, mode, pol) for part in ("mamba", "ssm")
       for mode, pol in (("baseline", ""), ("replay", ""),
                         ("replay", "f32+bf16"))]
      + [("attention", None, None), ("mlp", None, None),
         ("embed_head", None, None)], key=str)
  assert all(r["ms_per_step"] > 0 for r in records if r["kind"] == "part")
  with open(os.path.join(out["workdir"], "summary.md")) as f:
    assert "Time split" in f.read()
  assert os.path.getsize(os.path.join(out["workdir"],
                                      "decode_speedup.png")) > 5000


def test_decode_bench_rejects_unknown_policy(tmp_path):
  config = tiny.get_config("smoke")
  config.bench.replay_policies = ("f32+fp4",)
  with pytest.raises(ValueError, match=r"bench.replay_policies: .*f32\+fp4"):
    decode_bench.run(config, str(tmp_path / "bench"))
  assert not (tmp_path / "bench").exists()  # refused before any output


@pytest.mark.parametrize("mode", ["baseline", "replay"])
def test_decode_bench_prefill_rows(mode):
  """Prefilling a few rows at a time (bench.prefill_rows) gives the state
  and first tokens of the whole-batch prefill."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from replayssm_jax.models import HybridLM  # pylint: disable=g-import-not-at-top
  config = tiny.get_config("smoke")
  config.bench.batches = (5,)
  model = HybridLM(ModelConfig(**config.model.to_dict()), rngs=nnx.Rngs(0))
  whole = decode_bench._Setup(model, config, 5).state(mode, 4)
  config.bench.prefill_rows = 2  # chunks of 2, 2, 1 rows
  chunked = decode_bench._Setup(model, config, 5).state(mode, 4)
  assert jax.tree.structure(whole) == jax.tree.structure(chunked)
  # Not bit-exact: XLA:CPU may tile the projections differently per batch
  # size, so f32 sums can round differently.
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked)):
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=1e-5,
                               atol=1e-6)


def test_build_model_initializes_every_parameter():
  """decode_bench.build_model (one compiled initializer per block kind):
  the same parameter tree, shapes and dtypes as HybridLM's own init, every
  leaf a concrete array, the same weights for the same seed, and blocks of
  one kind initialized from their own keys."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from replayssm_jax import models  # pylint: disable=g-import-not-at-top
  cfg = models.ModelConfig(
      vocab_size=64, d_model=32, pattern="M*G-M-", ssm_heads=4, head_dim=8,
      d_state=8, n_groups=2, num_heads=4, num_kv_heads=2, attn_head_dim=8,
      intermediate_size=48, gdn_num_k_heads=2, gdn_num_v_heads=4,
      gdn_k_dim=8, gdn_v_dim=8)
  ref = nnx.state(models.HybridLM(cfg, rngs=nnx.Rngs(0)))
  got = nnx.state(decode_bench.build_model(cfg, 3))
  assert (jax.tree_util.tree_structure(got)
          == jax.tree_util.tree_structure(ref))
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    assert isinstance(b, jax.Array)
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  again = nnx.state(decode_bench.build_model(cfg, 3))
  assert all(bool(jnp.array_equal(a, b)) for a, b in
             zip(jax.tree.leaves(got), jax.tree.leaves(again)))
  kinds = cfg.block_kinds
  first, second = [i for i, k in enumerate(kinds) if k == kinds[0]][:2]
  pure = got.to_pure_dict()["blocks"]
  assert not all(bool(jnp.array_equal(a, b)) for a, b in zip(
      jax.tree.leaves(pure[first]), jax.tree.leaves(pure[second])))
