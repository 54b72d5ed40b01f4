r"""Shapes of the public state-spaces/mamba2-130m (pure Mamba-2, random
weights unless loaded with `replayssm_jax.models.from_pretrained`).

d_model 768, 24 Mamba-2 layers, expand 2 (d_inner 1536 = 24 heads x 64),
d_state 128, n_groups 1, conv 4, vocab 50280 (the HF Mamba2ForCausalLM port
pads it to 50288: a loaded checkpoint's config.json wins), tied embeddings.

Run (one GPU):

  python -m experiments.decode_bench --config=configs/mamba2_130m.py \
      --workdir=runs/decode_bench_mamba2_130m

Smoke variant (CPU): --config=configs/mamba2_130m.py:smoke
"""

import ml_collections

from configs import _decode_bench

MODEL = dict(vocab_size=50280, d_model=768, pattern="M" * 24, ssm_heads=24,
             head_dim=64, d_state=128, n_groups=1, conv_kernel=4,
             chunk_size=256, norm_eps=1e-5, tie_embeddings=True,
             dtype="bfloat16", param_dtype="bfloat16")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return _decode_bench.make_config(MODEL, arg, batches=(64,), prompt_len=512,
                                   new_tokens=512)
