r"""Tiny hybrid LM (the tests' model): decode throughput, baseline vs replay.

Run (CPU, seconds):

  python -m experiments.decode_bench --config=configs/tiny.py \
      --workdir=runs/decode_bench_tiny

Smoke variant (used by tests): --config=configs/tiny.py:smoke
"""

import ml_collections

from configs import _decode_bench


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return _decode_bench.make_config(_decode_bench.TINY_MODEL, arg, batches=(8,),
                                   prompt_len=32, new_tokens=256)
