"""Config fields can be set from the command line (`--config.a.b=...`):
ml_collections refuses an override of a field whose value is None unless
the field is a typed placeholder."""

import importlib
import os

import pytest

ml_collections = pytest.importorskip("ml_collections")
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# None with a meaning no command line would change: a model without rotary
# embeddings (NemotronH).
FIXED_NONE = {"model.rope_theta"}


def _parse(argv):
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=fv,
                                  sys_argv=argv)
  fv(argv)
  return fv.config


def _untyped_nones(c, prefix=""):
  for k in c.keys():
    v = c._fields[k]  # pylint: disable=protected-access
    if isinstance(v, ml_collections.FieldReference):
      continue  # a placeholder carries its type
    if isinstance(v, ml_collections.ConfigDict):
      yield from _untyped_nones(v, f"{prefix}{k}.")
    elif v is None:
      yield prefix + k


def test_no_config_field_is_an_untyped_none():
  names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py") and not f.startswith("_"))
  checked = 0
  for name in names:
    mod = importlib.import_module(f"configs.{name}")
    if not hasattr(mod, "get_config"):
      continue
    config = mod.get_config()
    if not isinstance(config, ml_collections.ConfigDict):
      continue
    checked += 1
    bad = sorted(set(_untyped_nones(config)) - FIXED_NONE)
    assert not bad, (name, bad)
  assert checked > 10


def test_text_study_slice_flags_parse():
  """The overrides benchmarks/scripts/text_precision.sh gives each study
  slice parse on every real model's config (fields that default to None
  there), as do the generation and state-error preset lists."""
  for name in ("mamba2_s20m", "gdn_s300m"):
    config = _parse([
        "study", f"--config=configs/precision_text.py:{name}",
        "--config.stages=('scores','generation',)",
        "--config.policies=('f32', 'f32+bf16')",
        "--config.baseline_policies=('f32', 'f32+bf16')",
        "--config.generation.policies=('f32',)",
        "--config.generation.buffer_lens=(8, 32)",
        "--config.state_error.policies=('f32+bf16',)",
        "--config.shared_dir=runs/precision_text/x/shared"])
    assert config.baseline_policies == ("f32", "f32+bf16")
    assert config.stages == ("scores", "generation")
    assert config.generation.policies == ("f32",)
    assert config.generation.buffer_lens == (8, 32)
    assert config.state_error.policies == ("f32+bf16",)
    assert config.shared_dir == "runs/precision_text/x/shared"
  default = _parse(["study", "--config=configs/precision_text.py:mamba2_s20m"])
  assert default.baseline_policies is None
  assert default.generation.policies is None
