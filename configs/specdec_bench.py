r"""Speculative decoding benchmark (experiments/specdec_bench.py).

Full run (one GPU; the mid-size hybrid of configs/hybrid_1b.py, random
weights, bf16):

  python -m experiments.specdec_bench --config=configs/specdec_bench.py \
      --workdir=runs/specdec_bench

Smoke run (CPU, about a minute; used by tests/test_experiments.py):

  python -m experiments.specdec_bench --config=configs/specdec_bench.py:smoke \
      --workdir=runs/specdec_bench_smoke

Useful overrides: --config.bench.batches='(256,512)',
--config.bench.windows='(4,)', --config.bench.accept_prob=0.5,
--config.bench.compactions='(0,2)'.
"""

import ml_collections

from configs import _args

from configs import _decode_bench
from configs import hybrid_1b


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration; `arg="smoke"` is a tiny CPU run."""
  config, smoke = _args.bench_config(arg, _decode_bench.TINY_MODEL, hybrid_1b.MODEL)
  b = config.bench = ml_collections.ConfigDict()
  b.batches = (2,) if smoke else (1, 64, 256, 512)
  b.windows = (4,) if smoke else (4, 2, 8)  # T: last token + T-1 drafts
  b.ssm_modes = ("baseline", "replay")
  # Also time plain `generate` with the baseline (full) SSM state.
  b.plain_baseline = True
  # speculative_generate(compaction=...) values to run each mode with (how
  # many times the loop may halve its batch as rows finish; 0: a static
  # batch to the end).
  b.compactions = (0, 1) if smoke else (0, 2)
  b.buffer_len = 8 if smoke else 16  # replay buffer (> every window)
  b.prompt_len = 8 if smoke else 128
  b.new_tokens = 16 if smoke else 128
  # Oracle proposer with a set acceptance probability a per draft (mean
  # accepted length (1 - a^T) / (1 - a) tokens per verify step):
  # "greedy_oracle" (greedy; exact in f32, drifts with a bf16 random-weight
  # target) or "flat_sampling" (sampling at `temperature`, where the target
  # is nearly uniform; see experiments/specdec_bench.py).
  b.proposer = "greedy_oracle" if smoke else "flat_sampling"
  b.temperature = 1000.0
  b.accept_prob = 0.7
  b.checkpoint_dtype = "float32"  # SSM state / replay checkpoint
  # A precision preset (replayssm_jax.precision, e.g. "f32+fp8") for every
  # replay state (plain decoding and replay speculative decoding; the
  # snapshot baseline keeps checkpoint_dtype), or "" for none.
  b.precision = ""
  b.repeats = 1 if smoke else 2  # timed runs after the compile + warm-up
  b.implementation = ""  # "" = dispatcher default (fastest supported)
  return config
