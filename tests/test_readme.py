"""README.md is executable documentation.

Every ```python block of README.md runs, in order, in one namespace (as a
reader pasting them into one session would); a failure names the block's
first line in README.md. Shell blocks are not run, but every
`python -m experiments.<name>` they (or the prose) name must exist, and
every `configs/<file>.py` and `benchmarks/...` path they cite must be in
the tree.
"""

from __future__ import annotations

import os
import re
import traceback

import matplotlib
import pytest

matplotlib.use("Agg")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")

_FENCE = re.compile(r"^```(\w*)\s*$")


def code_blocks(path: str) -> list[tuple[str, int, str]]:
  """(language, line number of the block's first code line, source) of
  every fenced block of a markdown file."""
  blocks, lang, start, lines = [], None, 0, []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, start=1):
      m = _FENCE.match(line.rstrip("\n"))
      if lang is None:
        if m:
          lang, start, lines = m.group(1), i + 1, []
      elif line.rstrip() == "```":
        blocks.append((lang, start, "".join(lines)))
        lang = None
      else:
        lines.append(line)
  if lang is not None:
    raise AssertionError(f"{path}:{start - 1}: unclosed code fence.")
  return blocks


def run_blocks(blocks, filename: str, namespace: dict) -> None:
  """Executes each block in `namespace`; on failure raises an
  AssertionError naming the file and the block's first line."""
  for start, source in blocks:
    # Line numbers of the traceback are those of the file.
    code = compile("\n" * (start - 1) + source, filename, "exec")
    try:
      exec(code, namespace)  # pylint: disable=exec-used
    except Exception as e:  # pylint: disable=broad-except
      raise AssertionError(
          f"{filename}: the block starting at line {start} failed: "
          f"{type(e).__name__}: {e}\n{traceback.format_exc()}") from e


def test_readme_python_blocks_run(tmp_path, monkeypatch):
  blocks = [(start, src) for lang, start, src in code_blocks(README)
            if lang == "python"]
  assert len(blocks) >= 8, "README.md lost its Python examples"
  monkeypatch.chdir(tmp_path)  # anything an example writes stays here
  run_blocks(blocks, README, {"__name__": "__readme__"})


def _readme_text() -> str:
  with open(README, encoding="utf-8") as f:
    return f.read()


def test_readme_names_existing_experiments_and_files():
  text = _readme_text()
  names = set(re.findall(r"python -m experiments\.(\w+)", text))
  assert {"replay_demo", "kernel_bench"} <= names
  for name in sorted(names):
    assert os.path.isfile(os.path.join(ROOT, "experiments", f"{name}.py")), (
        f"README.md runs experiments.{name}, which does not exist")
  for path in sorted(set(re.findall(r"configs/\w+\.py", text))):
    assert os.path.isfile(os.path.join(ROOT, path)), path
  links = re.findall(r"\]\(((?:benchmarks|notebooks|tests)/[^)#]+)\)", text)
  cited = set(links) | set(re.findall(r"`((?:tests|notebooks)/[\w./]+)`",
                                      text))
  for path in sorted(cited):
    assert os.path.exists(os.path.join(ROOT, path)), (
        f"README.md cites {path}, which is not in the tree")


def test_readme_has_no_unknown_fence_language():
  langs = {lang for lang, _, _ in code_blocks(README)}
  assert langs <= {"python", "bash", ""}, langs


@pytest.mark.parametrize("bad", ["```python\nx = 1\n", "```\nok\n```\n"])
def test_code_blocks_parser(tmp_path, bad):
  p = tmp_path / "x.md"
  p.write_text(bad)
  if bad.count("```") % 2:
    with pytest.raises(AssertionError, match="unclosed"):
      code_blocks(str(p))
  else:
    assert code_blocks(str(p)) == [("", 2, "ok\n")]


def test_failure_names_the_line(tmp_path):
  p = tmp_path / "x.md"
  p.write_text("text\n```python\nx = 1\n```\n\n```python\n1 / 0\n```\n")
  blocks = [(s, src) for lang, s, src in code_blocks(str(p))]
  with pytest.raises(AssertionError, match="line 7 failed: ZeroDivision"):
    run_blocks(blocks, str(p), {})
