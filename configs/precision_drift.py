r"""State-precision drift: policy x L vs a float64 reference, long decodes.

Run (GPU: 100k steps, Nemotron-H-like layer dims scaled down):

  python -m experiments.precision_drift --config=configs/precision_drift.py \
      --workdir=runs/precision_drift

Smoke variant (CPU, about a minute; used by tests/test_precision_drift.py):

  python -m experiments.precision_drift \
      --config=configs/precision_drift.py:smoke --workdir=runs/drift_smoke

Any field can be overridden, e.g. `--config.steps=20000`; long-memory
heads (per-step decays 0.9917-0.9992 instead of 0.43-0.93):
`--config.a_scale=0.01`.

The two per-element hashes of stochastic rounding side by side (threefry
vs hash32, long-memory heads, 1 head: a few minutes on a CPU):

  python -m experiments.precision_drift \
      --config=configs/precision_drift.py:sr_rngs --workdir=runs/drift_sr_rngs
"""

import ml_collections

from configs import _args


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The drift configuration; `arg="smoke"` shrinks it for CPU tests."""
  _args.check_arg(arg, "sr_rngs")
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Nemotron-H 8B Mamba layer: nheads 128, headdim 64, dstate 128, ngroups 8;
  # heads (and groups) scaled down by `head_scale` to keep 100k steps cheap.
  config.nheads = 128
  config.headdim = 64
  config.dstate = 128
  config.ngroups = 8
  config.head_scale = 8  # nheads / 8 = 16 heads, ngroups / 8 = 1 group
  # A multiplier: 1 = A in [-4, -0.5] (fast-decaying heads); 0.01 =
  # long-memory heads, where every-step rounding errors can accumulate.
  config.a_scale = 1.0
  config.batch = 8  # rows start at staggered counts (row r at r % L)
  config.steps = 100_000
  config.num_points = 40  # log-spaced measurement points (plus the last step)
  config.with_D = False  # D*x is exact in every run and would dilute errors
  # Activations and buffers in f32 so the state storage is the only
  # low-precision part (buffers round each token once and do not compound).
  config.buffer_dtype = "float32"
  # Reference: float64 state (jax.enable_x64) or float32.
  config.reference_dtype = "float64"
  config.policies = ("f32", "bf16", "f16", "bf16+sr", "f16+sr", "f32+bf16",
                     "f32+f16", "f32+fp8", "f32+int8", "f32+fp8+sr",
                     "f32+int8+sr", "f16+fp8", "f16+fp8+sr")
  config.buffer_lens = (4, 16, 64)
  # Baselines storing the state in these dtypes every step: "rn", "sr" or
  # "sr:<hash>" (precision.SR_RNGS; so can a policy: "f16+sr:hash32").
  config.baseline_dtypes = ("bfloat16", "float16", "float8_e4m3fn", "int8")
  config.baseline_roundings = ("rn", "sr")
  config.sr_seed = 1234
  config.layer = 0

  if arg == "smoke":
    config.nheads = 8
    config.headdim = 8
    config.dstate = 16
    config.ngroups = 2
    config.head_scale = 2
    config.batch = 4
    config.steps = 400
    config.num_points = 8
    config.policies = ("f32", "bf16", "f32+int8")
    config.buffer_lens = (4, 16)
    config.baseline_dtypes = ("bfloat16",)
    config.baseline_roundings = ("rn",)
  if arg == "sr_rngs":
    # The reduced long-memory layer of
    # benchmarks/precision_drift/long_memory_cpu.md, every stochastic preset
    # with each hash.
    config.a_scale = 0.01
    config.head_scale = 128
    config.batch = 4
    config.buffer_lens = (16,)
    config.policies = tuple(f"{p}{rng}" for p in (
        "bf16+sr", "f16+sr", "f32+fp8+sr", "f32+int8+sr", "f16+fp8+sr")
                            for rng in ("", ":hash32"))
    config.baseline_dtypes = ("bfloat16", "float16", "float8_e4m3fn")
    config.baseline_roundings = ("sr", "sr:hash32")
  return config
