r"""Byte-level hybrid LMs trained on the real-text corpus (TextTask).

Build the corpus once (experiments/build_corpus.py, configs/corpus.py),
then train one <family>_<size>, family in {mamba2, gdn}, size in {s20m,
s60m, s120m, s300m}, e.g. on a GPU:

  python -m experiments.build_corpus --config=configs/corpus.py \
      --workdir=runs/corpus
  python -m experiments.train --config=configs/train_text.py:mamba2_s20m \
      --workdir=runs/train_text/mamba2_s20m

Runs resume (train.resume): `--config.train.stop_after_s=540` stops a call
after 540 s with its optimizer state saved, and the same command continues
it (benchmarks/scripts/run_h200.sh text_train). `python -m
configs.train_text` prints every size's exact parameter count.

Both families repeat the unit "M-M-M*-" (three recurrent blocks, three
MLPs, one attention block), the recurrent blocks Mamba-2 ('M': 2 d_model /
64 heads of 64, state 64) or Gated DeltaNet ('G': d_model / 128 key heads,
twice as many value heads, heads of 128); bf16 compute, f32 parameters.
Parameters (exact, vocab 256), token budget (steps x batch x 1024):

  size    d_model  units  mamba2       gdn          steps x batch  tokens
  s20m        384      3   17,693,892   19,914,732  2000 x 32      65.5 M
  s60m        640      3   48,455,580   55,109,172  1500 x 32      49.2 M
  s120m      1024      3  123,249,120  140,975,520  1500 x 16      24.6 M
  s300m      1280      4  255,780,000  293,189,856  1500 x 8       12.3 M
  fixture      64      1      184,804      197,752  1500 x 16 x 128 (3.1 M)

The budgets are sized so that one model trains in about ten minutes of
one H200 under a conservative throughput assumption (not a measurement;
benchmarks/scripts/text_precision.sh states it), so that its training and
its study share one device session; they are small for the larger models
(12-65M bytes against the ~20 tokens per parameter of compute-optimal
training): these are models to measure decode-state precision on, not
strong language models.

The mixers' chunked prefill scans (what training runs: Mamba-2's SSD,
Gated DeltaNet's WY form) compute their products in true f32 by default,
which a GPU runs without tensor cores; --config.model.scan_precision=
BF16_BF16_F32_X3 (or BF16_BF16_F32, as mixed-precision training does)
moves them onto tensor cores (benchmarks/scripts/prefill_scan_cost.py
times the scans and their error at each); say so beside any result
trained that way. Gated DeltaNet's chunks solve their triangular systems
by substitution; --config.model.gdn_solve=inverse forms their inverses
from matrix products instead (equal within f32's tolerance,
tests/test_delta_rule_reference.py); say so likewise.

The corpus is pinned (task.corpus_sha256 = CORPUS_SHA256, the corpus that
configs/corpus.py builds from Python 3.11.7's standard library and the
Debian man pages of this project's image; train elsewhere with
--config.task.corpus_sha256=<that corpus's hash>).

Smoke runs (CPU, about a minute; `--config.task.corpus_dir` must name a
built corpus, e.g. the corpus smoke run's): `:smoke` / `:gdn_smoke`. The
real-text test fixtures (about 200K parameters, CPU, a few minutes; copied
to tests/fixtures/text_models/<name>, see the README there):
`:fixture` / `:gdn_fixture`.
"""

import ml_collections

from configs import _decode_bench

FAMILIES = ("mamba2", "gdn")
SIZES = ("s20m", "s60m", "s120m", "s300m")
UNIT = "M-M-M*-"
CORPUS_SHA256 = (
    "78b8fd97fd0730e1866d9e4f13498c95aae44e252a9842d2a923ed7483812727")
# (d_model, units, num_steps, batch_size, peak learning rate)
_SIZES = dict(s20m=(384, 3, 2000, 32, 2e-3), s60m=(640, 3, 1500, 32, 1.2e-3),
              s120m=(1024, 3, 1500, 16, 8e-4),
              s300m=(1280, 4, 1500, 8, 4e-4))
SEQ_LEN = 1024


def model(family: str, d: int, units: int) -> dict:
  """The ModelConfig fields of one family at width d."""
  m = dict(vocab_size=256, d_model=d, pattern=UNIT * units,
           ssm_heads=2 * d // 64, head_dim=64, d_state=64, n_groups=1,
           conv_kernel=4, chunk_size=64, num_heads=d // 64,
           num_kv_heads=max(1, d // 256), attn_head_dim=64,
           rope_theta=10000.0, intermediate_size=3 * d,
           mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
           dtype="bfloat16", param_dtype="float32",
           scan_precision="highest")  # settable from the command line
  if family == "gdn":
    m.update(pattern=m["pattern"].replace("M", "G"),
             gdn_num_k_heads=d // 128, gdn_num_v_heads=2 * d // 128,
             gdn_k_dim=128, gdn_v_dim=128, gdn_chunk_size=64,
             gdn_solve="substitution")  # settable from the command line
  return m


def fixture_model(family: str) -> dict:
  """The test fixture: one unit at d_model 64, f32 compute."""
  m = model(family, 128, 1)
  m.update(d_model=64, ssm_heads=4, head_dim=32, d_state=32, num_heads=2,
           num_kv_heads=1, attn_head_dim=32, intermediate_size=128,
           chunk_size=32, dtype="float32")
  if family == "gdn":
    m.update(gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_dim=32,
             gdn_v_dim=32, gdn_chunk_size=32)
  return m


def _train(num_steps: int, batch_size: int, lr: float) -> dict:
  return dict(batch_size=batch_size, num_steps=num_steps, learning_rate=lr,
              warmup_steps=min(200, num_steps // 10), end_lr_fraction=0.1,
              weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0,
              log_every=50, eval_every=500, eval_batches=8,
              eval_batch_size=32, checkpoint_every=500,
              decode_eval_batches=1, decode_buffer_len=16,
              resume=True, stop_after_s=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: "<family>_<size>" (default "mamba2_s20m"), "smoke",
  "gdn_smoke", "fixture" or "gdn_fixture"."""
  arg = arg or "mamba2_s20m"
  config = ml_collections.ConfigDict()
  config.name = arg
  config.config_file = "configs/train_text.py"
  config.seed = 0
  if arg in ("smoke", "gdn_smoke"):
    m = dict(_decode_bench.TINY_MODEL, vocab_size=256)
    if arg == "gdn_smoke":
      m.update(pattern=m["pattern"].replace("M", "G"), gdn_num_k_heads=1,
               gdn_num_v_heads=2, gdn_k_dim=8, gdn_v_dim=8, gdn_chunk_size=8)
    config.model = m
    config.task = dict(name="text", corpus_dir="runs/corpus_smoke",
                       seq_len=32, vocab_size=256, seed=0, corpus_sha256="")
    train = _train(num_steps=60, batch_size=8, lr=3e-3)
    train.update(warmup_steps=5, log_every=20, eval_every=30,
                 eval_batches=1, eval_batch_size=8, checkpoint_every=0,
                 decode_buffer_len=4, resume=False)
  elif arg in ("fixture", "gdn_fixture"):
    config.model = fixture_model("gdn" if arg == "gdn_fixture" else "mamba2")
    config.task = dict(name="text", corpus_dir="runs/corpus", seq_len=128,
                       vocab_size=256, seed=0, corpus_sha256=CORPUS_SHA256)
    train = _train(num_steps=1500, batch_size=16, lr=3e-3)
    train.update(warmup_steps=100, log_every=50, eval_every=250,
                 eval_batches=4, eval_batch_size=16, checkpoint_every=0,
                 decode_buffer_len=8, resume=False)
  else:
    family, _, size = arg.partition("_")
    if family not in FAMILIES or size not in _SIZES:
      raise ValueError(f"config arg must be 'smoke', 'gdn_smoke', "
                       f"'fixture', 'gdn_fixture' or '<family>_<size>' "
                       f"with family in {FAMILIES} and size in {SIZES}, got "
                       f"{arg!r}.")
    d, units, steps, batch, lr = _SIZES[size]
    config.model = model(family, d, units)
    config.task = dict(name="text", corpus_dir="runs/corpus",
                       seq_len=SEQ_LEN, vocab_size=256, seed=0,
                       corpus_sha256=CORPUS_SHA256)
    train = _train(steps, batch, lr)
  train["token_budget"] = (train["num_steps"] * train["batch_size"]
                           * config.task["seq_len"])
  config.train = train
  return config


def param_counts() -> dict[str, int]:
  """{"<family>_<size>": exact parameter count} (abstract shapes only)."""
  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from flax import nnx
  from replayssm_jax.models import HybridLM, ModelConfig
  out = {}
  for name in [f"{f}_{s}" for f in FAMILIES for s in SIZES] + [
      "fixture", "gdn_fixture"]:
    cfg = ModelConfig(**get_config(name).model.to_dict())
    abstract = nnx.eval_shape(lambda c=cfg: HybridLM(c, rngs=nnx.Rngs(0)))
    out[name] = int(sum(np.prod(x.shape) for x in jax.tree.leaves(
        nnx.split(abstract)[1])))
  return out


if __name__ == "__main__":
  for key, n in param_counts().items():
    c = get_config(key)
    print(f"{key:14s} {n:>13,} parameters, {c.train.token_budget:>12,} "
          f"training tokens ({c.train.num_steps} x {c.train.batch_size} x "
          f"{c.task.seq_len})")
