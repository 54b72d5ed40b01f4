r"""Serving benchmark (experiments/serve_bench.py): continuous batching with
Poisson arrivals, baseline vs replay decode states, plain vs speculative
decoding.

Full run (one GPU; configs/hybrid_1b.py's model, random weights, bf16):

  python -m experiments.serve_bench --config=configs/serve_bench.py \
      --workdir=runs/serve_bench

Smoke run (CPU, about a minute; used by tests/test_experiments.py):

  python -m experiments.serve_bench --config=configs/serve_bench.py:smoke \
      --workdir=runs/serve_bench_smoke

A model of a published shape with random weights instead:
--config.hf_config=configs/nemotron3_nano_30b_a3b.json. Useful overrides:
--config.serve.arrival_rate=200 (requests per second),
--config.serve.capacity=256, --config.serve.steps_per_dispatch=16,
--config.serve.shared_prefixes=4 (a shared-prefix workload, with and
without a prefix cache), --config.serve.speculative_window=0 (no
speculative runs). Speculative decoding at a set acceptance rate (sampling
at a high temperature, where the target is nearly uniform):
--config.serve.proposer=flat_sampling --config.serve.temperature=1000
--config.serve.accept_prob=0.7.
"""

import ml_collections

from configs import _args
from configs import _decode_bench
from configs import hybrid_1b


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The benchmark configuration; `arg="smoke"` is a tiny CPU run."""
  config, smoke = _args.bench_config(arg, _decode_bench.TINY_MODEL, hybrid_1b.MODEL)
  # A transformers config.json (random bf16 weights at its shape) in place
  # of `model`, or "".
  config.hf_config = ""
  s = config.serve = ml_collections.ConfigDict()
  s.ssm_modes = ("baseline", "replay")
  # Which runs per mode: plain decoding, with a prefix cache (needs
  # shared_prefixes), speculative (needs speculative_window).
  s.variants = ("plain", "prefix_cache", "speculative")
  s.buffer_len = 4 if smoke else 16
  s.precision = ""  # a replayssm_jax.precision preset for replay states
  s.capacity = 4 if smoke else 64  # slots (the decode batch)
  s.max_len = 64 if smoke else 1024  # prompt + output tokens per slot
  s.steps_per_dispatch = 4 if smoke else 8
  # Queued prompts of one length bucket prefilled together (1: one by one;
  # a prefix cache admits one by one).
  s.prefill_batch = 2 if smoke else 8
  # Dispatches decode only the running slots' rows when they fit in this
  # fraction of the slots (0: always the whole pool).
  s.compact_below = 0.5
  # Launch each dispatch before reading the previous one's tokens (False:
  # launch, then wait).
  s.overlap = True
  s.num_requests = 12 if smoke else 512
  # Poisson arrivals (requests per second); 0: all arrive at once.
  s.arrival_rate = 0.0 if smoke else 48.0
  # Prompt and output lengths: uniform integers in [min, max].
  s.prompt_len_min, s.prompt_len_max = (4, 16) if smoke else (64, 512)
  s.output_len_min, s.output_len_max = (4, 12) if smoke else (64, 256)
  # Shared-prefix workload: prompts start with one of `shared_prefixes`
  # random prefixes of `shared_prefix_len` tokens (then a random tail of
  # the drawn length); every mode also runs with a prefix cache of
  # `prefix_block`-token blocks. 0: off.
  s.shared_prefixes = 2 if smoke else 0
  s.shared_prefix_len = 8 if smoke else 256
  s.prefix_block = 4 if smoke else 16
  # Speculative decoding inside the engine: every mode also runs with
  # serving.Speculation(proposer, window=speculative_window) (0: off),
  # steps_per_dispatch rounds per dispatch. proposer: "ngram"
  # (NgramProposer(n=ngram_n), prompt lookup in each slot's history) or
  # "flat_sampling" (specdec_bench's FlatOracleProposer: each draft accepted
  # with probability accept_prob when sampling at a high temperature).
  s.speculative_window = 3 if smoke else 4  # < buffer_len (replay)
  s.proposer = "ngram"
  s.ngram_n = 3
  s.accept_prob = 0.7
  s.temperature = 0.0  # 0: greedy; > 0: every request samples
  s.implementation = ""  # "" = dispatcher default
  return config
