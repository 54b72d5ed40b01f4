"""The study's shared results (experiments/precision_lib/shared.py): one
computation for every process sharing a folder, stale locks taken over,
keys that change with every input."""

import os
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

pytest.importorskip("ml_collections")

from configs import precision_accuracy as pa_config  # noqa: E402
from experiments.precision_lib import generation  # noqa: E402
from experiments.precision_lib import shared  # noqa: E402


def _counting(calls, value, delay=0.0):
  def compute():
    calls.append(1)
    time.sleep(delay)
    return {"x": np.asarray(value)}
  return compute


def _count_calls(monkeypatch, module, name):
  """Replaces module.name by a wrapper that counts its calls: (the list
  that grows by one a call, the original function)."""
  calls, real = [], getattr(module, name)

  def counted(*a, **kw):
    calls.append(1)
    return real(*a, **kw)

  monkeypatch.setattr(module, name, counted)
  return calls, real


def test_computed_once_shares_through_the_folder(tmp_path):
  calls = []
  first = shared.computed_once(str(tmp_path), "k", _counting(calls, [1, 2]))
  again = shared.computed_once(str(tmp_path), "k", _counting(calls, [9, 9]))
  assert len(calls) == 1
  np.testing.assert_array_equal(again["x"], first["x"])
  assert sorted(os.listdir(tmp_path)) == ["k.npz"]  # lock and tmp gone
  # No folder: computed each time.
  shared.computed_once("", "k", _counting(calls, [3]))
  shared.computed_once("", "k", _counting(calls, [3]))
  assert len(calls) == 3


def test_dtypes_kept_and_keys_made_only_with_a_folder(tmp_path):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = {"b": np.asarray([1.5, -3.0, 2.0 ** -9], jnp.bfloat16),
       "e": np.asarray([0.5, -448.0], jnp.float8_e4m3fn),
       "h": np.asarray([1.0, 2.0 ** -14], np.float16),
       "i": np.arange(3, dtype=np.int32)}
  made = []

  def key():
    made.append(1)
    return "k"

  shared.computed_once(str(tmp_path), key, lambda: x)
  got = shared.computed_once(str(tmp_path), key, lambda: {})
  assert len(made) == 2 and set(got) == set(x)
  for k, v in x.items():
    assert got[k].dtype == v.dtype, k
    np.testing.assert_array_equal(got[k].astype(np.float32),
                                  v.astype(np.float32))
  shared.computed_once("", key, lambda: x)
  assert len(made) == 2


def test_concurrent_callers_compute_once(tmp_path):
  calls, results = [], []
  compute = _counting(calls, np.arange(5), delay=0.3)
  threads = [threading.Thread(target=lambda: results.append(
      shared.computed_once(str(tmp_path), "k", compute, poll_s=0.05)))
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(calls) == 1 and len(results) == 4
  for r in results:
    np.testing.assert_array_equal(r["x"], np.arange(5))


def test_stale_and_held_locks(tmp_path):
  gone = subprocess.Popen(["true"])
  gone.wait()  # a pid no process holds now
  (tmp_path / "k.lock").write_text(
      '{"host": "%s", "pid": %d}' % (socket.gethostname(), gone.pid))
  calls = []
  out = shared.computed_once(str(tmp_path), "k", _counting(calls, [4]))
  assert len(calls) == 1 and out["x"].tolist() == [4]
  # A lock this (live) process holds: after wait_s the caller computes
  # for itself and leaves the lock and the file alone.
  (tmp_path / "j.lock").write_text(
      '{"host": "%s", "pid": %d}' % (socket.gethostname(), os.getpid()))
  out = shared.computed_once(str(tmp_path), "j", _counting(calls, [5]),
                             wait_s=0.2, poll_s=0.05)
  assert len(calls) == 2 and out["x"].tolist() == [5]
  assert (tmp_path / "j.lock").exists() and not (tmp_path / "j.npz").exists()


def test_keys_change_with_every_input():
  p = np.arange(6).reshape(2, 3)
  k = shared.key("m@f32", "greedy_reference", prompts=p, new_tokens=8)
  assert k.startswith("m_f32-greedy_reference-")
  assert k == shared.key("m@f32", "greedy_reference", new_tokens=8,
                         prompts=p.copy())
  assert k != shared.key("m@f32", "greedy_reference", prompts=p + 1,
                         new_tokens=8)
  assert k != shared.key("m@f32", "greedy_reference", prompts=p,
                         new_tokens=9)
  assert k != shared.key("m", "greedy_reference", prompts=p, new_tokens=8)


def test_reference_run_shared_between_slices(tmp_path, monkeypatch):
  """A second slice loads the reference the first generated; a model
  with other parameters does not."""
  from tests.test_models import make_model, random_tokens  # pylint: disable=g-import-not-at-top
  config = pa_config.get_config("smoke")
  config.shared_dir = str(tmp_path)
  config.generation.new_tokens = 6
  calls, _ = _count_calls(monkeypatch, generation, "generate_run")
  model = make_model(3)
  p = np.asarray(random_tokens(5, (2, 4)))
  first = generation.reference_run("m", model, p, config, "greedy",
                                   with_margins=True)
  again = generation.reference_run("m", model, p, config, "greedy",
                                   with_margins=True)
  assert len(calls) == 1
  for k in ("tokens", "margins"):
    np.testing.assert_array_equal(again[k], first[k])
  assert shared.fingerprint(make_model(4)) != shared.fingerprint(model)
  generation.reference_run("m", make_model(4), p, config, "greedy",
                           with_margins=True)
  assert len(calls) == 2


def test_state_error_capture_shared_between_slices(tmp_path, monkeypatch):
  """The state-error stage's recording: a second slice loads the first's
  (op inputs in their own dtypes, values and the logits check equal to a
  capture of its own); without a folder each call records."""
  from experiments.precision_lib import state_error  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_model, random_tokens  # pylint: disable=g-import-not-at-top
  config = pa_config.get_config("smoke")
  config.shared_dir = str(tmp_path)
  model = make_model(3, dtype="bfloat16")
  tokens = np.asarray(random_tokens(6, (2, 12)))
  blocks = state_error.layer_blocks(model, (0, -1))
  calls, real = _count_calls(monkeypatch, state_error, "capture")
  first = state_error.captured("m", model, tokens, blocks, config)
  again = state_error.captured("m", model, tokens, blocks, config)
  assert len(calls) == 1
  init, rec, _ = real(model, tokens, blocks)
  for got in (first, again):
    for b in blocks:
      assert got[0][b].dtype == init[b].dtype
      np.testing.assert_array_equal(got[0][b], init[b])
      assert set(got[1][b]) == set(rec[b]) == {"x", "dt", "B", "C"}
      for k, v in rec[b].items():
        assert got[1][b][k].dtype == v.dtype == np.dtype("bfloat16"), k
        np.testing.assert_array_equal(got[1][b][k], v)
    # The same ops as the model's decode: equal on this backend, at most
    # one bf16 step of these logits (|logit| < 4) where a backend fuses
    # the two loops apart.
    assert 0.0 <= got[2] <= 2.0 ** -6
  config.state_error.capture_check = False
  assert state_error.captured("m", model, tokens, blocks, config)[2] is None
  config.shared_dir = ""
  state_error.captured("m", model, tokens, blocks, config)
  state_error.captured("m", model, tokens, blocks, config)
  assert len(calls) == 4


def test_score_reference_shared_between_slices(tmp_path, monkeypatch):
  """The scores' reference decode: a second slice loads the first's
  metrics and logits (in their dtype), equal to a decode of its own;
  other validation batches are not served from the file."""
  from experiments import precision_accuracy as pa  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_model, random_tokens  # pylint: disable=g-import-not-at-top
  config = pa_config.get_config("smoke")
  config.shared_dir = str(tmp_path)
  model = make_model(3, dtype="bfloat16")
  toks = np.asarray(random_tokens(7, (2, 9)))
  batches = [dict(inputs=toks[:, :-1], targets=toks[:, 1:],
                  mask=np.ones((2, 8), np.float32))]
  calls, _ = _count_calls(monkeypatch, pa, "decode_eval")
  first = pa.reference_scores("m", model, batches, config)
  again = pa.reference_scores("m", model, batches, config)
  assert len(calls) == 1
  config.shared_dir = ""
  own = pa.reference_scores("m", model, batches, config)
  for got in (first, again):
    assert got[0] == own[0] and got[0]["num_targets"] == 16
    assert got[1][0].dtype == own[1][0].dtype
    np.testing.assert_array_equal(got[1][0], own[1][0])
  config.shared_dir = str(tmp_path)
  other = [dict(batches[0], inputs=(toks[:, :-1] + 1) % 64)]
  pa.reference_scores("m", model, other, config)
  assert len(calls) == 3


def test_state_error_floor_shared_between_slices(tmp_path):
  """The state-error floor (the f32 baseline's own error): computed by one
  slice per block, its lists of floats returned unchanged to every
  slice."""
  from experiments.precision_lib import state_error  # pylint: disable=g-import-not-at-top
  from tests.test_models import make_model, random_tokens  # pylint: disable=g-import-not-at-top
  config = pa_config.get_config("smoke")
  config.shared_dir = str(tmp_path)
  model = make_model(3)
  tokens = np.asarray(random_tokens(6, (2, 12)))
  points = np.asarray([1, 4, 11])
  calls = []

  def compute():
    calls.append(1)
    return {"state_max": [1e-7, 3.0e-7 / 7, 2.5e-7], "out_max": [0.1] * 3}

  args = (model, 0, tokens, points, "float64")
  got = [state_error.floor_stats("m", *args, compute, config)
         for _ in range(2)]
  assert len(calls) == 1
  assert got[0] == got[1] == compute()
  state_error.floor_stats("m", model, 1, tokens, points, "float64", compute,
                          config)
  assert len(calls) == 3  # another block: its own
