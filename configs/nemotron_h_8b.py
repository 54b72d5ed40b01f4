r"""Shapes of NVIDIA Nemotron-H-8B (nvidia/Nemotron-H-8B-Base-8K), random
weights unless loaded with `replayssm_jax.models.from_pretrained`.

Source: the HF config.json values as reproduced in TensorRT-LLM's
tests (test_modeling_mamba_hybrid.py, MAMBA_HYBRID_CONFIG: hidden 4096,
52-block hybrid_override_pattern below, intermediate 21504, 32 query / 8
KV heads of 128, Mamba 128 heads x 64, d_state 128, n_groups 8, conv 4,
chunk 256, vocab 131072, eps 1e-5, relu2 MLPs, untied embeddings) and the
Megatron-Bridge Nemotron-H docs (same numbers). The HF NemotronH attention
applies no rotary embedding (its config has no rope_theta), hence
rope_theta=None here.

Run (one H200; bf16 weights are ~16 GB):

  python -m experiments.decode_bench --config=configs/nemotron_h_8b.py \
      --workdir=runs/decode_bench_nemotron_h_8b

Smoke variant (CPU): --config=configs/nemotron_h_8b.py:smoke
"""

import ml_collections

from configs import _decode_bench

MODEL = dict(vocab_size=131072, d_model=4096,
             pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
             ssm_heads=128, head_dim=64, d_state=128, n_groups=8,
             conv_kernel=4, chunk_size=256, num_heads=32, num_kv_heads=8,
             attn_head_dim=128, rope_theta=None, intermediate_size=21504,
             mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
             dtype="bfloat16", param_dtype="bfloat16")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return _decode_bench.make_config(MODEL, arg, batches=(64,), prompt_len=1024,
                                   new_tokens=256)
