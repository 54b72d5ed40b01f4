r"""Byte-level hybrid LMs trained on the real-text corpus (TextTask).

Build the corpus once (experiments/build_corpus.py, configs/corpus.py),
then train one <family>_<size>, family in {mamba2, gdn}, size in {s20m,
s60m, s160m, s300m}, e.g. on a GPU:

  python -m experiments.build_corpus --config=configs/corpus.py \
      --workdir=runs/corpus
  python -m experiments.train --config=configs/train_text.py:mamba2_s20m \
      --workdir=runs/train_text/mamba2_s20m

Smoke runs (CPU, about a minute; `--config.task.corpus_dir` must name a
built corpus, e.g. the corpus smoke run's):

  python -m experiments.build_corpus --config=configs/corpus.py:smoke \
      --workdir=runs/corpus_smoke
  python -m experiments.train --config=configs/train_text.py:smoke \
      --config.task.corpus_dir=runs/corpus_smoke --workdir=runs/train_text/smoke

Both families repeat the unit "M-M-M*-" (three recurrent blocks, three
MLPs, one attention block), the recurrent blocks Mamba-2 ('M': 2 d_model /
64 heads of 64, state 64) or Gated DeltaNet ('G': d_model / 128 key heads,
twice as many value heads, heads of 128); bf16 compute, f32 parameters.
Parameters (counted from the configs, vocab 256):

  size    d_model  units  mamba2   gdn
  s20m        384      3  17.7 M   19.9 M
  s60m        640      4  64.5 M   73.4 M
  s160m      1024      4  164.2 M  187.8 M
  s300m      1280      4  255.8 M  293.2 M

Each size trains for `train.num_steps` x `train.batch_size` x
`task.seq_len` tokens (the token budget, `train.token_budget` below).
"""

import ml_collections

from configs import _decode_bench

FAMILIES = ("mamba2", "gdn")
UNIT = "M-M-M*-"
# (d_model, units, num_steps, peak learning rate)
_SIZES = dict(s20m=(384, 3, 20_000, 2e-3), s60m=(640, 4, 20_000, 1e-3),
              s160m=(1024, 4, 30_000, 6e-4), s300m=(1280, 4, 40_000, 4e-4))
SEQ_LEN, BATCH = 1024, 32


def model(family: str, d: int, units: int) -> dict:
  """The ModelConfig fields of one family at width d."""
  m = dict(vocab_size=256, d_model=d, pattern=UNIT * units, ssm_heads=2 * d // 64,
           head_dim=64, d_state=64, n_groups=1, conv_kernel=4, chunk_size=64,
           num_heads=d // 64, num_kv_heads=max(1, d // 256), attn_head_dim=64,
           rope_theta=10000.0, intermediate_size=3 * d,
           mlp_activation="relu2", norm_eps=1e-5, tie_embeddings=False,
           dtype="bfloat16", param_dtype="float32")
  if family == "gdn":
    m.update(pattern=m["pattern"].replace("M", "G"),
             gdn_num_k_heads=d // 128, gdn_num_v_heads=2 * d // 128,
             gdn_k_dim=128, gdn_v_dim=128, gdn_chunk_size=64)
  return m


def _train(num_steps: int, batch_size: int, lr: float) -> dict:
  return dict(batch_size=batch_size, num_steps=num_steps, learning_rate=lr,
              warmup_steps=min(1000, num_steps // 10), end_lr_fraction=0.1,
              weight_decay=0.1, b1=0.9, b2=0.95, grad_clip=1.0,
              log_every=100, eval_every=2000, eval_batches=16,
              eval_batch_size=32, checkpoint_every=5000,
              decode_eval_batches=1, decode_buffer_len=16)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """`arg`: "<family>_<size>" (default "mamba2_s20m"), "smoke" or
  "gdn_smoke"."""
  arg = arg or "mamba2_s20m"
  config = ml_collections.ConfigDict()
  config.name = arg
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
                 decode_buffer_len=4)
  else:
    family, _, size = arg.partition("_")
    if family not in FAMILIES or size not in _SIZES:
      raise ValueError(f"config arg must be 'smoke', 'gdn_smoke' or "
                       f"'<family>_<size>' with family in {FAMILIES} and "
                       f"size in {tuple(_SIZES)}, got {arg!r}.")
    d, units, steps, lr = _SIZES[size]
    config.model = model(family, d, units)
    config.task = dict(name="text", corpus_dir="runs/corpus",
                       seq_len=SEQ_LEN, vocab_size=256, seed=0,
                       corpus_sha256="")
    train = _train(steps, BATCH, lr)
  train["token_budget"] = (train["num_steps"] * train["batch_size"]
                           * config.task["seq_len"])
  config.train = train
  return config
