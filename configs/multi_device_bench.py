r"""Multi-device decode benchmark (experiments/multi_device_bench.py).

Full run (one host with 8 accelerators; the mid-size hybrid of
configs/hybrid_1b.py, random weights, bf16):

  python -m experiments.multi_device_bench \
      --config=configs/multi_device_bench.py --workdir=runs/multi_device_bench

Smoke run (CPU, 8 forced host devices, about a minute; used by
tests/test_experiments_multi_device.py):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  python -m experiments.multi_device_bench \
      --config=configs/multi_device_bench.py:smoke \
      --workdir=runs/multi_device_bench_smoke

Mesh shapes that need more devices than there are are skipped (logged).
"""

import ml_collections

from configs import _args
from configs import hybrid_1b

# Heads, KV heads, MLP units and vocabulary all divide 8 (every rule splits).
SMOKE_MODEL = dict(vocab_size=64, d_model=32, pattern="M*-M", ssm_heads=8,
                   head_dim=4, d_state=8, n_groups=1, conv_kernel=4,
                   chunk_size=8, num_heads=8, num_kv_heads=8,
                   attn_head_dim=4, rope_theta=10000.0, intermediate_size=32,
                   mlp_activation="relu2", norm_eps=1e-5,
                   tie_embeddings=False, dtype="float32",
                   param_dtype="float32")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration; `arg="smoke"` is a tiny CPU run."""
  config, smoke = _args.bench_config(arg, SMOKE_MODEL, hybrid_1b.MODEL)
  b = config.bench = ml_collections.ConfigDict()
  # (data, model) mesh shapes, in order.
  b.meshes = (((2, 4), (8, 1)) if smoke else
              ((1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8),
               (2, 4), (4, 2), (8, 1)))
  b.global_batches = (8,) if smoke else (64, 256)
  b.ssm_modes = ("baseline", "replay")
  b.buffer_len = 8 if smoke else 16  # > spec_window
  b.prompt_len = 8 if smoke else 128
  b.new_tokens = 8 if smoke else 128  # decode steps per timed call
  b.checkpoint_dtype = "float32"
  b.expert_parallel = False
  # One speculative_generate run per mesh and ssm_mode (NgramProposer) at
  # the first global batch; 0 new tokens: none.
  b.spec_window = 4
  b.spec_new_tokens = 8 if smoke else 128
  b.repeats = 2 if smoke else 5  # timed calls after the warm-up (median)
  b.implementation = "reference" if smoke else ""  # "": dispatcher default
  # Run the dispatched ops (the Pallas kernels) per shard under
  # jax.set_mesh (replayssm_jax.per_shard); False: XLA partitions them.
  b.per_shard = True
  return config
