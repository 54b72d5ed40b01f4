r"""The decode-precision study on the real-text models of
configs/train_text.py (experiments/precision_accuracy.py).

Per model: decode-mode validation perplexity (1024 bytes, 1023 decode
steps) of every precision preset x L in {8, 16, 32} and of the every-step
baselines against the f32 baseline-mode model, with the 1% criterion, and
the next-token distributions' KL / total-variation distance to it;
greedy and sampled generations of 2048 tokens from 32 prompts against the
f32 baseline's (first divergence, token agreement: a prompt that leaves the
reference at a near-tie moves it by 1/32, so the reference's top-2 logit
margin where a greedy row leaves it is recorded;
`--config.generation.new_tokens=16384` for longer ones); the state of the
first and last recurrent layers along a 4096-token decode against a
float64 recurrence. One model per run:

  python -m experiments.precision_accuracy \
      --config=configs/precision_text.py:mamba2_s20m \
      --workdir=runs/precision_text/mamba2_s20m

(`:all` lists the eight models.) `:<family>_<size>@f32`: the same trained
model computing in float32 instead of its bf16 (model_overrides): scores
at L 16 and greedy generations of the f32 control and the 16-bit-master
presets with their every-step baselines: whether those presets' greedy
agreement is limited by the state's precision or by near-ties that bf16
activations decide (the f32 replay decode, the same math summed in another
order, is the control). The stages run apart with
`--config.stages="('scores',)"` etc. and the presets in slices with
`--config.policies=...` (benchmarks/scripts/run_h200.sh text_study splits
them over processes); `--config.merge_workdirs="('a','b')"` writes the
combined report of such runs.

`:fixture`: the committed real-text fixture models
(tests/fixtures/text_models, both families) on the committed corpus
excerpt (tests/fixtures/text_corpus), a few presets and short decodes; CPU,
under a minute; run by tests/test_precision_text.py. `:fixture_full`: the
same models under every preset, L in {8, 16, 32}, every baseline, 512-token
generations and a 1024-step state decode (CPU, a quarter of an hour;
benchmarks/text_precision/fixture_cpu).
"""

import ml_collections

from configs import precision_accuracy as base
from configs import train_text

FIXTURES = "tests/fixtures/text_models"
FIXTURE_CORPUS = "tests/fixtures/text_corpus"


# The f32 control and the presets with a 16-bit master (the greedy target's).
GREEDY_TARGET_PRESETS = ("f32", "bf16", "f16", "bf16+sr", "f16+sr",
                         "f16+fp8", "f16+fp8+sr")


def text_model(name: str, eval_seq_len: int = 1024, workdir: str = "",
               corpus_dir: str = "", model_overrides=None) -> dict:
  """A config.models entry of configs/train_text.py:<name> ("<name>@f32":
  the same model computing in float32)."""
  m = base.entry(name, eval_seq_len, "train_text")
  m.update(corpus_dir=corpus_dir, model_overrides=model_overrides or {})
  if workdir:
    m["workdir"] = workdir
  return m


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """arg: "<family>_<size>", "<family>_<size>@f32", "all", "fixture" or
  "fixture_full"."""
  arg = arg or "mamba2_s20m"
  names = [f"{f}_{s}" for f in train_text.FAMILIES for s in train_text.SIZES]
  name, at, variant = arg.partition("@")
  if (name not in names + ["all", "fixture", "fixture_full"]
      or at and (name not in names or variant != "f32")):
    raise ValueError(f"config arg must be 'all', 'fixture', 'fixture_full' "
                     f"or one of {names}, optionally followed by '@f32', "
                     f"got {arg!r}.")
  config = base.get_config()
  config.models = [text_model(n) for n in (names if arg == "all"
                                           else [arg])]
  config.buffer_lens = (8, 16, 32)
  config.eval_batches = 2
  config.eval_batch_size = 32
  config.generation.update(num_prompts=32, prompt_len=64, new_tokens=2048,
                           buffer_lens=(16,))
  config.state_error = base.state_error_config(steps=4096)
  if variant:
    config.models = [text_model(arg, model_overrides={"dtype": "float32"})]
    config.policies = GREEDY_TARGET_PRESETS
    config.stages = ("scores", "generation")
    config.buffer_lens = (16,)
    config.generation.modes = ("greedy",)
  if arg == "fixture_full":
    config.models = [text_model(n, 256, f"{FIXTURES}/{n}", FIXTURE_CORPUS)
                     for n in ("fixture", "gdn_fixture")]
    config.eval_batches = 1
    config.eval_batch_size = 16
    config.generation.update(num_prompts=4, prompt_len=32, new_tokens=512)
    config.state_error.update(steps=1024, rows=2)
  if arg == "fixture":
    config.models = [text_model(n, 128, f"{FIXTURES}/{n}", FIXTURE_CORPUS)
                     for n in ("fixture", "gdn_fixture")]
    config.policies = ("f32", "f32+bf16")
    config.baseline_policies = ("bf16", "f32+int8+sr")
    config.buffer_lens = (8,)
    config.eval_batches = 1
    config.eval_batch_size = 8
    config.generation.update(num_prompts=2, prompt_len=16, new_tokens=48,
                             modes=("greedy",), policies=("f32",),
                             buffer_lens=(8,), baselines=False)
    config.state_error.update(steps=96, rows=2, layers=(0,),
                              policies=("f32+bf16",), buffer_lens=(8,))
  return config
