"""Shared layout of the model configs (`configs/<model>.py`).

Every model config is an ml_collections ConfigDict with:
  model:  the `replayssm_jax.models.ModelConfig` fields as plain values
          (build it with `ModelConfig(**config.model.to_dict())`; the library
          itself never imports ml_collections);
  bench:  the settings of experiments/decode_bench.py.
The ":smoke" variant swaps in the tiny model and a few decode steps.
"""

import ml_collections

from configs import _args

# The tiny hybrid of tests/test_models.py (CPU-sized).
TINY_MODEL = dict(vocab_size=64, d_model=32, pattern="M-M*-M", ssm_heads=4,
                  head_dim=8, d_state=8, n_groups=2, conv_kernel=4,
                  chunk_size=8, num_heads=4, num_kv_heads=2, attn_head_dim=8,
                  rope_theta=10000.0, intermediate_size=48,
                  mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
                  dtype="float32", param_dtype="float32")


def make_config(model: dict, arg: str | None, *, batches: tuple[int, ...],
                prompt_len: int, new_tokens: int,
                buffer_lens: tuple[int, ...] = (8, 16, 32),
                split_batches: tuple[int, ...] = ()
                ) -> ml_collections.ConfigDict:
  """The config of one model; arg "smoke" shrinks it for CPU tests."""
  _args.check_arg(arg)
  smoke = arg == "smoke"
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.model = ml_collections.ConfigDict(dict(TINY_MODEL if smoke
                                                else model))
  b = config.bench = ml_collections.ConfigDict()
  b.batches = (2,) if smoke else batches
  b.prompt_len = 8 if smoke else prompt_len
  b.new_tokens = 16 if smoke else new_tokens
  b.ssm_modes = ("baseline", "replay")
  b.buffer_lens = (4,) if smoke else buffer_lens  # replay runs, one per L
  # Batches at which the step is also timed part by part (Mamba mixers,
  # their SSM op alone, attention, MLP, embedding + LM head).
  b.split_batches = (2,) if smoke else split_batches
  # Replay checkpoint / baseline state dtype; buffers and KV cache default
  # to the model dtype ("" = default).
  b.checkpoint_dtype = "float32"
  # `PrecisionPolicy` presets also timed in replay mode at every L (e.g.
  # ("f32+bf16",): an f32 master checkpoint whose non-flush steps read a
  # bf16 copy), against the same baseline (plain checkpoint_dtype state).
  b.replay_policies = ()
  b.buffer_dtype = ""
  b.kv_dtype = ""
  # Prefill this many rows at a time (0: the whole batch at once).
  b.prefill_rows = 0
  b.repeats = 1 if smoke else 3  # timed runs after the warm-up
  # "" = dispatcher default (fastest supported kernel).
  b.implementation = "reference" if smoke else ""
  return config
