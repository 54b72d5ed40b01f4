"""The committed transformers fixtures (tests/fixtures/hf): where they are
and a clear failure when one is missing."""

from __future__ import annotations

import os

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


def fixture_dir(name: str) -> str:
  """The folder of the fixture `name`, asserted to hold its expected.npz."""
  d = os.path.join(FIXTURES, name)
  assert os.path.isfile(os.path.join(d, "expected.npz")), (
      f"{d} is missing: the committed transformers fixtures "
      f"(tests/fixtures/make_hf_fixtures.py writes them).")
  return d
