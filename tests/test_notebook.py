"""notebooks/quickstart.ipynb runs on CPU, cell by cell.

Without nbformat / nbclient: the file is read as JSON (nbformat 4), and the
source of every code cell is executed, in order, in one namespace, under
matplotlib's Agg backend. The notebook is stored without outputs.
"""

from __future__ import annotations

import json
import os
import traceback

import matplotlib
import pytest

matplotlib.use("Agg")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def _load():
  with open(NOTEBOOK, encoding="utf-8") as f:
    return json.load(f)


def _source(cell) -> str:
  src = cell["source"]
  return src if isinstance(src, str) else "".join(src)


def test_notebook_is_nbformat4_without_outputs():
  nb = _load()
  assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
  assert isinstance(nb["metadata"], dict)
  kinds = [c["cell_type"] for c in nb["cells"]]
  assert set(kinds) <= {"code", "markdown", "raw"}, kinds
  assert kinds.count("code") >= 5
  ids = [c.get("id") for c in nb["cells"]]
  assert len(set(ids)) == len(ids) and all(ids), "cell ids must be unique"
  for i, c in enumerate(nb["cells"]):
    assert isinstance(c["metadata"], dict), i
    if c["cell_type"] == "code":
      assert c["outputs"] == [] and c["execution_count"] is None, (
          f"cell {i} holds outputs: store the notebook cleared")


def test_notebook_code_cells_run(tmp_path, monkeypatch):
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__notebook__"}
  for i, cell in enumerate(_load()["cells"]):
    if cell["cell_type"] != "code":
      continue
    src = _source(cell)
    assert not any(line.lstrip().startswith(("%", "!"))
                   for line in src.splitlines()), (
                       f"cell {i}: IPython magics cannot run here")
    try:
      exec(compile(src, f"{NOTEBOOK}[cell {i}]", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as e:  # pylint: disable=broad-except
      pytest.fail(f"notebook cell {i} failed: {type(e).__name__}: {e}\n"
                  f"{traceback.format_exc()}")
  # The traffic plot was drawn: three curves, one per state precision.
  fig = plt.gcf()
  assert len(fig.axes) == 1 and len(fig.axes[0].get_lines()) >= 3
  plt.close("all")
