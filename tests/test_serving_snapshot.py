"""Save and restore of a serving engine mid-run (`Engine.save` /
`Engine.restore`, `serving.snapshot`): a new engine restored from a
snapshot gives every request, queued or running, greedy or sampled, the
tokens the saved engine goes on to give it, bit for bit, and streams what
is left; in both SSM modes, under a read-copy precision policy, with
speculative decoding, with overlap on and off. Mismatched settings, a busy
engine and unsavable request ids are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from replayssm_jax import models, serving  # noqa: E402
from replayssm_jax.precision import PrecisionPolicy  # noqa: E402
from tests.serving_common import build_model, prompt  # noqa: E402

MAX_LEN, L = 48, 4


@pytest.fixture(scope="module")
def model():
  return build_model(5, 11)


def requests():
  return [serving.Request(i, prompt(110 + i, 3 + 2 * i), 5 + 3 * (i % 3),
                          eos_id=(9, 17) if i == 4 else None,
                          temperature=0.9 if i % 2 else 0.0, seed=i)
          for i in range(6)]


def engine(model, **kw):
  return serving.Engine(model, 3, MAX_LEN, steps_per_dispatch=2,
                        buffer_len=L, **kw)


CASES = {
    "replay": dict(),
    "baseline": dict(ssm_mode="baseline"),
    "replay_no_overlap": dict(overlap=False),
    "replay_f32_fp8": dict(precision=PrecisionPolicy.preset("f32+fp8")),
    "speculative": dict(speculative=serving.Speculation(
        models.NgramProposer(n=2), window=3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_restored_engine_resumes_exactly(model, tmp_path, case):
  kw = CASES[case]
  saved = engine(model, **kw)
  for r in requests():
    saved.submit(r)
  before = {}
  stream = lambda log: lambda rid, toks: log.setdefault(rid, []).extend(toks)
  saved.dispatch(stream(before))
  saved.dispatch(stream(before))
  saved.save(tmp_path / "snap", stream(before))
  assert saved.queue and any(r is not None for r in saved.slots)
  after_saved, after_restored = {}, {}
  want = saved.run(stream(after_saved))

  restored = engine(model, **kw)
  restored.restore(tmp_path / "snap")
  got = restored.run(stream(after_restored))
  assert got == want
  assert after_restored == after_saved
  for rid, toks in want.items():  # streamed before + after = the result
    assert before.get(rid, []) + after_saved.get(rid, []) == toks
  assert restored.stats.tokens == saved.stats.tokens
  assert not restored.busy


def test_snapshot_refusals(model, tmp_path):
  eng = engine(model)
  eng.submit(serving.Request("a", prompt(120, 4), 6))
  eng.dispatch()
  eng.save(tmp_path / "s")
  with pytest.raises(ValueError, match="exists"):
    eng.save(tmp_path / "s")
  with pytest.raises(ValueError, match="steps_per_dispatch"):
    serving.Engine(model, 3, MAX_LEN, steps_per_dispatch=3,
                   buffer_len=L).restore(tmp_path / "s")
  with pytest.raises(ValueError, match="new engine"):
    eng.restore(tmp_path / "s")  # this one has run
  with pytest.raises(ValueError, match="no decode-state checkpoint"):
    engine(model).restore(tmp_path / "missing")
  other = engine(model)
  other.submit(serving.Request(("a", 1), prompt(121, 4), 3))
  with pytest.raises(ValueError, match="str or int"):
    other.save(tmp_path / "t")
  restored = engine(model)
  restored.restore(tmp_path / "s")
  assert np.asarray(restored.pool.active).any()
