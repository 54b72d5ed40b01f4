r"""ReplaySSM vs baseline decode: output/state deviation and traffic model.

Run (from the repository root, CPU, about a minute):

  python -m experiments.replay_demo --config=configs/replay_demo.py \
      --workdir=runs/replay_demo

Smoke variant (a few seconds; used by tests/test_experiments.py):

  python -m experiments.replay_demo --config=configs/replay_demo.py:smoke \
      --workdir=runs/replay_demo_smoke

Any field can be overridden, e.g. `--config.steps=512` or
`--config.implementation=pallas`.
"""

import ml_collections

from configs import _args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The demo configuration; `arg="smoke"` shrinks it for tests."""
  _args.check_arg(arg)
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Decode experiment: small but realistic Mamba-2 layer shapes.
  config.batch = 8
  config.nheads = 16
  config.headdim = 32
  config.dstate = 64
  config.ngroups = 2
  config.steps = 256  # decode steps per run (one jax.lax.scan under jit)
  config.has_z = False  # Mamba-2 mixers gate in the RMSNorm, not the step
  # Activations are float32 so that storage dtypes are the only rounding.
  config.act_dtype = "float32"
  config.checkpoint_dtype = "float32"
  config.buffer_dtypes = ("float32", "bfloat16")
  config.buffer_lens = (1, 4, 8, 16, 32)
  # Rows start at staggered counts (row r at r % L, with a random history),
  # so that some rows flush at every step, as in serving.
  config.stagger = True
  # Baselines that *store* the state in a lower precision, for context: how
  # far does a bf16 state drift compared with bf16 replay buffers?
  config.baseline_state_dtypes = ("float32", "bfloat16")
  # "" = dispatcher default (fastest supported); "reference" keeps CPU fast.
  config.implementation = "reference"

  # Traffic model at a production shape (Nemotron-H 8B Mamba layer, TP=1).
  config.traffic = ml_collections.ConfigDict()
  config.traffic.nheads = 128
  config.traffic.headdim = 64
  config.traffic.dstate = 128
  config.traffic.ngroups = 8
  config.traffic.batch = 256
  config.traffic.checkpoint_dtypes = ("float32", "float16")
  config.traffic.buffer_dtype = "bfloat16"
  config.traffic.act_dtype = "bfloat16"
  config.traffic.buffer_lens = (1, 2, 4, 8, 16, 32, 64)
  config.traffic.max_len = 64

  if arg == "smoke":
    config.batch = 3
    config.nheads = 4
    config.headdim = 8
    config.dstate = 16
    config.ngroups = 2
    config.steps = 24
    config.buffer_lens = (1, 4)
    config.baseline_state_dtypes = ("bfloat16",)
    config.traffic.buffer_lens = (1, 4, 16)
  return config
