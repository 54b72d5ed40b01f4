r"""Task accuracy of trained models decoding under precision policies.

Evaluates models trained by experiments/train.py in decode mode (prefill
one token, then teacher-forced `decode_step`s) with the Mamba decode states
stored per each precision policy x buffer length L, against the f32
baseline decode (full f32 state), with the baseline stored at each policy's
storage dtype (rounded every step) for contrast.

Train the models first (GPU; the SSM-only variants, see configs/train.py,
because attention alone solves MQAR and would hide the SSM state):

  python -m experiments.train --config=configs/train.py:mqar_small_ssm \
      --workdir=runs/train/mqar_small_ssm
  python -m experiments.train --config=configs/train.py:char_small_ssm \
      --workdir=runs/train/char_small_ssm

then

  python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py --workdir=runs/precision_accuracy

`:tiny` / `:medium` / `:large` evaluate the `<task>_<size>_ssm` runs
instead (same workdir layout); `--config.train_missing=True` trains the
missing ones first. The real-text models (configs/train_text.py) have
their own study config, configs/precision_text.py. Smoke variant (CPU,
about a minute;
trains a two-layer pure Mamba-2 model on the char smoke task first; used by
tests/test_precision_accuracy.py):

  python -m experiments.precision_accuracy \
      --config=configs/precision_accuracy.py:smoke \
      --workdir=runs/precision_accuracy_smoke

Fields (override any with --config.<field>=...):
  models: one entry per evaluation: name, workdir (of the training run;
    "" = <workdir>/train/<name>), train_config (the configs/train.py arg
    used when the run is missing and train_missing is True),
    train_config_file ("train" or "train_text": configs/<file>.py),
    eval_seq_len
    (0: the task's own seq_len; longer sequences make more flushes: a row
    flushes floor((eval_seq_len - 1) / L) times), train_overrides (flat
    dict applied to the train config, e.g. {"train.num_steps": 100}),
    model_overrides (ModelConfig fields the trained model loads with,
    among experiments.train.LOAD_MODEL_OVERRIDES, e.g. {"dtype":
    "float32"}: a bf16-trained model computing in f32).
  train_missing: train models whose workdir holds no checkpoint (else such
    a model is an error).
  policies: `PrecisionPolicy.preset` names; buffer_dtype and sr_seed are
    applied to each. buffer_lens: the L values.
  buffer_dtype: x/B buffers. float32 (the models' activation dtype, so the
    buffers are lossless) isolates the state storage.
  baseline_contrast: also decode with the baseline state stored every step
    in each policy's storage dtype (`states.baseline_storage_dtype`) and
    rounding.
  baseline_policies: the presets whose every-step baselines run (None:
    `policies`); e.g. policies=("f32",) with baseline_policies=POLICIES
    runs the baselines without the replay rows of the other presets.
  eval_batches, eval_batch_size: validation batches per model.
  within_points: the accuracy band (percentage points) reported as "within".
  ppl_tolerance: the relative perplexity change reported as "within_ppl".
  agreement_target: the greedy generation agreement the report's targets
    ask of the 16-bit-master presets.
  stages: which of "scores", "generation", "state_error" run.
  generation: long generations per model against the f32 baseline's
    (num_prompts prompts of prompt_len validation tokens, new_tokens each;
    modes "greedy" and / or "sampled" at temperature; policies and
    buffer_lens: None = config's; baselines: the every-step baselines
    too); new_tokens 0: none.
  state_error: the recorded recurrent layers' state against float64 along
    a decode of `steps` tokens (see experiments/precision_lib/
    state_error.py); steps 0: none (the default here).
  merge_workdirs: report the records of these study workdirs together
    instead of evaluating (stages or policy slices run apart).
  resume: keep the records a previous run of the same config left in the
    workdir (one stopped by a time limit) and run only the rest.
"""

import ml_collections

from configs import _args

POLICIES = ("f32", "bf16", "f16", "bf16+sr", "f16+sr", "f32+bf16", "f32+f16",
            "f32+fp8", "f32+int8", "f32+fp8+sr", "f32+int8+sr", "f16+fp8",
            "f16+fp8+sr")


def entry(name: str, eval_seq_len: int = 0, file: str = "train") -> dict:
  """A config.models entry of configs/<file>.py:<name> ("<name>@<variant>":
  another evaluation of the same training run)."""
  train_arg = name.split("@")[0]
  runs = "runs/train" if file == "train" else f"runs/{file}"
  return dict(name=name, workdir=f"{runs}/{train_arg}",
              train_config=train_arg, train_config_file=file,
              eval_seq_len=eval_seq_len, train_overrides={})


def _optional_tuple():
  """None (the default the docstrings name) or a tuple: a typed
  placeholder, so that a command line can set it
  (`--config.generation.policies="('f32',)"`)."""
  return ml_collections.config_dict.placeholder(tuple)


def state_error_config(steps: int, **kw) -> ml_collections.ConfigDict:
  """The state_error stage's fields: a decode of `steps` tokens (source
  "generation": the f32 baseline's greedy continuation of validation
  prompts; "text": validation windows) by `rows` rows, the recurrent
  `layers` recorded (indices among the recurrent blocks), measured at
  `num_points` log-spaced steps against a `reference_dtype` recurrence;
  policies / buffer_lens None = config's; baselines: the every-step
  baselines too; capture_check: compare the recording loop's logits with
  the model's decode."""
  return ml_collections.ConfigDict(dict(dict(
      steps=steps, rows=4, source="generation", layers=(0, -1),
      num_points=24, reference_dtype="float64", policies=_optional_tuple(),
      buffer_lens=(16,), baselines=True, capture_check=True), **kw))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The accuracy study; arg "smoke" (CPU test), "tiny", "medium" or
  "large" (model size; default small)."""
  _args.check_arg(arg, "tiny", "medium", "large")
  size = arg if arg in ("tiny", "medium", "large") else "small"
  config = ml_collections.ConfigDict()
  config.seed = 0
  # MQAR at its trained length (64 tokens, 63 decode steps: 15 / 3 / 0
  # flushes per row at L = 4 / 16 / 64; at L = 64 the outputs come from the
  # prefill checkpoint + buffer alone) and at 1024 tokens (same pairs,
  # queries spread further; 255 / 63 / 15 flushes); char at 1024 tokens.
  config.models = [entry(f"mqar_{size}_ssm"),
                   entry(f"mqar_{size}_ssm@1024", 1024),
                   entry(f"char_{size}_ssm", 1024)]
  config.train_missing = False
  config.policies = POLICIES
  config.buffer_lens = (4, 16, 64)
  config.buffer_dtype = "float32"
  config.sr_seed = 1234
  config.baseline_contrast = True
  config.baseline_policies = _optional_tuple()
  config.eval_batches = 4
  config.eval_batch_size = 32
  config.within_points = 1.0
  config.ppl_tolerance = 0.01
  config.agreement_target = 0.99
  config.stages = ("scores", "generation", "state_error")
  config.merge_workdirs = ()
  config.resume = False
  # A folder where the processes of one study split by presets share the
  # f32 reference's generations and the state-error stage's recording
  # (experiments/precision_lib/shared.py); "" computes them in each
  # process.
  config.shared_dir = ""
  # Long generations per model against the f32 baseline's (see
  # experiments/precision_lib/generation.py); new_tokens 0 skips them.
  config.generation = ml_collections.ConfigDict(dict(
      num_prompts=8, prompt_len=64, new_tokens=2048, temperature=1.0,
      modes=("greedy", "sampled"), policies=_optional_tuple(),
      buffer_lens=_optional_tuple(), baselines=True))
  config.state_error = state_error_config(steps=0)
  if arg == "smoke":
    # Next-character prediction (every position scored) by a two-layer
    # pure Mamba-2 model trained for 200 steps here.
    config.models = [dict(
        name="char_smoke_ssm", workdir="", train_config="char_smoke_ssm",
        eval_seq_len=64,  # 63 decode steps: 15 / 7 flushes at L = 4 / 8
        train_overrides={"train.num_steps": 200, "train.eval_every": 200,
                         "train.log_every": 50, "train.checkpoint_every": 0,
                         "train.decode_eval_batches": 0,
                         "train.warmup_steps": 10})]
    config.train_missing = True
    config.policies = ("f32", "f32+int8+sr")
    config.buffer_lens = (4, 8)
    config.eval_batches = 1
    config.eval_batch_size = 16
    config.generation.update(num_prompts=4, prompt_len=8, new_tokens=24)
  return config
