r"""A mid-size Nemotron-H-style hybrid (~0.85B parameters, random weights)
that fits comfortably on one H200 with a large decode batch.

25 blocks (11 Mamba-2, 3 attention, 11 MLP), d_model 2048; Mamba 64 heads x
64, d_state 128, n_groups 8; GQA 16 / 4 heads of 128 with RoPE; relu2 MLP
8192; bf16.

Run (one GPU):

  python -m experiments.decode_bench --config=configs/hybrid_1b.py \
      --workdir=runs/decode_bench_hybrid_1b

Smoke variant (CPU): --config=configs/hybrid_1b.py:smoke
"""

import ml_collections

from configs import _decode_bench

MODEL = dict(vocab_size=32768, d_model=2048,
             pattern="M-M-M*-M-M-M*-M-M-M*-M-M-", ssm_heads=64, head_dim=64,
             d_state=128, n_groups=8, conv_kernel=4, chunk_size=256,
             num_heads=16, num_kv_heads=4, attn_head_dim=128,
             rope_theta=10000.0, intermediate_size=8192,
             mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
             dtype="bfloat16", param_dtype="bfloat16")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return _decode_bench.make_config(MODEL, arg, batches=(1, 64, 256, 512),
                                   prompt_len=256, new_tokens=128,
                                   split_batches=(256,))
