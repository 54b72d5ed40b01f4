"""Every project module imports on its own, and the imports form no cycle.

The import graph is read from the source with `ast`: module-level and
function-level `import` statements, `importlib.import_module("<literal>")`
calls and the dispatcher's kernel packages (`replayssm_jax.dispatch.PLUGINS`,
which it imports on first use). An edge goes to the imported module, or to
the package whose attribute a `from package import name` takes.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("replayssm_jax", "pallas_kernels", "experiments", "configs")
DISPATCHER = "replayssm_jax.dispatch"


def _modules() -> dict[str, str]:
  """Module name -> file of every module of the project's packages."""
  found = {}
  for pkg in PACKAGES:
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and
                           os.path.exists(os.path.join(dirpath, d,
                                                       "__init__.py")))
      rel = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
      for f in sorted(filenames):
        if not f.endswith(".py"):
          continue
        name = rel if f == "__init__.py" else f"{rel}.{f[:-3]}"
        found[name] = os.path.join(dirpath, f)
  return found


MODULES = _modules()


def _target(name: str) -> str | None:
  """The project module that importing `name` (a module or a package
  attribute) names, or None outside the project."""
  while name and name not in MODULES:
    name = name.rpartition(".")[0]
  return name or None


def _plugins(tree: ast.Module) -> tuple[str, ...]:
  for node in tree.body:
    if (isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "PLUGINS"
                for t in node.targets)):
      return tuple(ast.literal_eval(node.value))
  raise AssertionError(f"{DISPATCHER} defines no PLUGINS tuple")


def _imports(module: str, path: str) -> set[str]:
  """Project modules that `module` imports, anywhere in its source."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  package = module if path.endswith("__init__.py") else module.rpartition(
      ".")[0]
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        parent = ".".join(parts[:len(parts) - node.level + 1])
        base = f"{parent}.{base}" if base else parent
      names += [f"{base}.{a.name}" for a in node.names]
    elif (isinstance(node, ast.Call) and node.args
          and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)
          and getattr(node.func, "attr", getattr(node.func, "id", None))
          in ("import_module", "__import__")):
      names.append(node.args[0].value)
  if module == DISPATCHER:
    names += list(_plugins(tree))
  return {t for t in map(_target, names) if t is not None and t != module}


def _graph() -> dict[str, set[str]]:
  return {m: _imports(m, p) for m, p in MODULES.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle (as a path back to its start), or None."""
  state = {}  # module -> "open" while on the DFS stack, "done" after.
  stack = []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        return stack[stack.index(n):] + [n]
      if n not in state:
        found = visit(n)
        if found:
          return found
    stack.pop()
    state[m] = "done"
    return None

  for m in sorted(graph):
    if m not in state:
      found = visit(m)
      if found:
        return found
  return None


def test_module_discovery():
  for name in ("replayssm_jax.ops", "replayssm_jax.dispatch",
               "replayssm_jax.models.model", "pallas_kernels",
               "experiments.common", "configs.tiny"):
    assert name in MODULES
  assert _target("replayssm_jax.precision.PrecisionPolicy") == (
      "replayssm_jax.precision")
  assert _target("jax.numpy") is None


def test_no_import_cycles():
  graph = _graph()
  assert "pallas_kernels" in graph[DISPATCHER]  # the plugin edge is seen
  assert not graph["replayssm_jax.registry"]  # kernels may import it alone
  cycle = _cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernel_packages_do_not_import_the_dispatcher():
  """The kernel packages (and everything they import) stay below the
  dispatcher: they export a table that it reads."""
  graph = _graph()
  with open(MODULES[DISPATCHER], encoding="utf-8") as f:
    plugins = _plugins(ast.parse(f.read()))
  for plugin in plugins:
    seen, todo = set(), [plugin]
    while todo:
      m = todo.pop()
      if m not in seen:
        seen.add(m)
        todo += graph[m]
    above = sorted(m for m in seen if m in (
        DISPATCHER, "replayssm_jax.ops", "replayssm_jax.speculative"))
    assert not above, (
        f"{plugin} reaches {above}: kernel packages import the modules "
        f"below the dispatcher (e.g. the verify references from "
        f"replayssm_jax.verify_reference, not replayssm_jax.speculative)")


# Imports each module named on the command line after dropping every
# project module from sys.modules (so each import runs the project's code
# afresh, as in a new interpreter); prints {module: error} as JSON.
_IMPORT_EACH = f"""
import importlib, json, sys, traceback
packages = {PACKAGES!r}
errors = {{}}
for name in sys.argv[1:]:
  for m in [m for m in sys.modules if m.split(".")[0] in packages]:
    del sys.modules[m]
  try:
    importlib.import_module(name)
  except BaseException:  # pylint: disable=broad-except
    errors[name] = traceback.format_exc(limit=-3)
print(json.dumps(errors))
"""


def test_every_module_imports_alone():
  """One fresh interpreter per top-level package (run side by side); each
  imports its package's modules one at a time from a clean project."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  procs = {}
  for pkg in PACKAGES:
    names = [m for m in MODULES if m.split(".")[0] == pkg]
    procs[pkg] = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_EACH, *names], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  errors = {}
  for pkg, proc in procs.items():
    out, err = proc.communicate(timeout=300)
    if proc.returncode != 0:
      pytest.fail(f"importing {pkg}'s modules crashed:\n{err[-3000:]}")
    errors.update(json.loads(out.strip().splitlines()[-1]))
  assert not errors, "\n".join(f"{m}:\n{e}" for m, e in errors.items())
