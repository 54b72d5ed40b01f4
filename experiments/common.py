"""Helpers shared by the experiment scripts.

* `prepare_workdir`: creates the workdir and writes `config.json`.
* `MetricsWriter`: appends one JSON object per line to `metrics.jsonl`.
* `log_environment`: logs (and returns) jax/jaxlib/flax versions, backend
  and devices.
* `new_figure` / `save_plot`: matplotlib figures on the Agg backend (no
  display needed), saved as PNG.
* `markdown_table`: a small GitHub-markdown table formatter.

Only experiment code imports this module (it may use ml_collections and
matplotlib, which the library `replayssm_jax` must not).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Any, Iterable, Sequence

from absl import logging
import jax
import numpy as np


# -------------------------------------------------------------------- JSON
def to_jsonable(obj: Any) -> Any:
  """Converts configs, dataclasses, numpy/jax scalars and dtypes for JSON."""
  if hasattr(obj, "to_dict") and callable(obj.to_dict):  # ConfigDict
    return to_jsonable(obj.to_dict())
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return to_jsonable(dataclasses.asdict(obj))
  if isinstance(obj, dict):
    return {str(k): to_jsonable(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(v) for v in obj]
  if isinstance(obj, (bool, str)) or obj is None:
    return obj
  if isinstance(obj, (np.bool_,)):
    return bool(obj)
  if isinstance(obj, (int, np.integer)):
    return int(obj)
  if isinstance(obj, (float, np.floating)):
    f = float(obj)
    return f if math.isfinite(f) else str(f)  # JSON has no inf/nan
  if isinstance(obj, np.ndarray) or isinstance(obj, jax.Array):
    return to_jsonable(np.asarray(obj).tolist())
  if isinstance(obj, np.dtype) or (isinstance(obj, type)
                                   and issubclass(obj, np.generic)):
    return np.dtype(obj).name
  return str(obj)


def prepare_workdir(workdir: str, config: Any) -> str:
  """Creates `workdir` and writes `config.json` into it.

  Args:
    workdir: output directory (created if needed).
    config: an ml_collections ConfigDict (`to_dict()`), a dataclass
      (`dataclasses.asdict`) or a plain dict.

  Returns:
    The absolute workdir path.
  """
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(to_jsonable(config), f, indent=2, sort_keys=True)
    f.write("\n")
  logging.info("workdir: %s (config.json written)", workdir)
  return workdir


def start_run(workdir: str, config: Any) -> tuple[str, dict, "MetricsWriter"]:
  """`prepare_workdir`, then the environment logged and written as the
  first line of metrics.jsonl -> (absolute workdir, environment, writer)."""
  workdir = prepare_workdir(workdir, config)
  env = log_environment()
  writer = MetricsWriter(workdir)
  writer.write(kind="environment", **env)
  return workdir, env, writer


class MetricsWriter:
  """Appends one JSON object per line to `<workdir>/<filename>`.

  Each `write` opens, appends and flushes, so the file is complete up to the
  last record even if the run dies. Use `truncate=True` (the default) to
  start a fresh file for a new run.
  """

  def __init__(self, workdir: str, filename: str = "metrics.jsonl", *,
               truncate: bool = True):
    self.path = os.path.join(workdir, filename)
    os.makedirs(workdir, exist_ok=True)
    if truncate:
      open(self.path, "w").close()
    self.count = 0

  def write(self, record: dict | None = None, **fields) -> dict:
    """Appends `record` (and/or keyword fields) as one JSON line."""
    rec = dict(record or {}, **fields)
    line = json.dumps(to_jsonable(rec), sort_keys=False)
    with open(self.path, "a") as f:
      f.write(line + "\n")
      f.flush()
    self.count += 1
    return rec

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def read_metrics(path: str) -> list[dict]:
  """Parses a metrics.jsonl file."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# -------------------------------------------------------------- environment
def log_environment() -> dict:
  """Logs and returns versions, backend and devices (for result files)."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  try:
    import flax  # pylint: disable=g-import-not-at-top
    flax_version = flax.__version__
  except ImportError:
    flax_version = None
  devices = jax.devices()
  env = dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      command_line=" ".join([os.path.basename(sys.executable)] + sys.argv),
      python=platform.python_version(),
      jax=jax.__version__,
      jaxlib=jaxlib.__version__,
      flax=flax_version,
      backend=jax.default_backend(),
      device_kind=devices[0].device_kind,
      devices=[str(d) for d in devices],
      device_count=len(devices),
      xla_flags=os.environ.get("XLA_FLAGS", ""),
  )
  logging.info("jax %s, jaxlib %s, flax %s, python %s", env["jax"],
               env["jaxlib"], env["flax"], env["python"])
  logging.info("backend %s: %d device(s): %s (%s)", env["backend"],
               env["device_count"], ", ".join(env["devices"]),
               env["device_kind"])
  return env


# ------------------------------------------------------------------ plots
def new_figure(nrows: int = 1, ncols: int = 1, *, figsize=(7.0, 4.5),
               **kwargs):
  """A matplotlib (Figure, axes) on the Agg canvas, never a GUI backend."""
  # pylint: disable=g-import-not-at-top
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=figsize, **kwargs)
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False)
  return fig, axes


def save_plot(fig, path: str, *, dpi: int = 120) -> str:
  """Saves `fig` (from `new_figure`, or any matplotlib Figure) as PNG."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  logging.info("wrote %s", path)
  return path


# ------------------------------------------------------------------ tables
def format_value(v: Any, fmt: str | None = None) -> str:
  if v is None:
    return "-"
  if fmt is not None and isinstance(v, (int, float, np.number)):
    return format(v, fmt)
  if isinstance(v, float):
    return f"{v:.4g}"
  return str(v)


def markdown_table(rows: Iterable[dict], columns: Sequence[str],
                   formats: dict[str, str] | None = None,
                   headers: dict[str, str] | None = None) -> str:
  """Renders dict rows as a GitHub-markdown table (missing keys -> '-')."""
  formats = formats or {}
  headers = headers or {}
  head = [headers.get(c, c) for c in columns]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
  for row in rows:
    cells = [format_value(row.get(c), formats.get(c)) for c in columns]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def best_of(make, repeats: int, reduce=min):
  """Times `repeats` calls after one compile + warm-up call.

  Args:
    make: () -> thunk; runs untimed before every call (e.g. to build fresh
      inputs for a thunk that donates them), then thunk() is timed until
      its output is ready.
    repeats: timed calls.

  Returns:
    (output of the last call, best seconds (`reduce` of the timed calls:
     min, or e.g. statistics.median), every timed call's seconds).
  """
  times = []
  for i in range(repeats + 1):
    # Drop the previous call's thunk and output before building the next
    # inputs (device memory: the 8B model's states are ~28 GB each).
    thunk = out = None
    thunk = make()
    t0 = time.perf_counter()
    out = jax.block_until_ready(thunk())
    if i:
      times.append(time.perf_counter() - t0)
  return out, reduce(times), times


def _accelerator_plugins() -> list[str]:
  """Names of the installed jax accelerator plugins (jax_plugins.*,
  jax_cuda*_plugin), without starting a backend."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import pkgutil  # pylint: disable=g-import-not-at-top
  names = [m.name for m in pkgutil.iter_modules()
           if m.name.startswith(("jax_cuda", "jax_rocm"))]
  if importlib.util.find_spec("jax_plugins") is not None:
    import jax_plugins  # pylint: disable=g-import-not-at-top
    names += [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
  return names


def avoid_cpu_lapack_stall(block_kinds) -> None:
  """Runs a CPU-only process on one core when its model has Gated DeltaNet
  / KDA blocks (their chunked form solves triangular systems through
  jaxlib's LAPACK kernels) and no backend has started yet; warns when it
  is too late.

  jaxlib's batched triangular solve (jax 0.10.2) hands its batch to XLA's
  intra-op thread pool and blocks until it is done. When as many solves
  run at once as the pool has threads (XLA runs independent ops
  concurrently; two on a two-core machine), every pool thread waits for
  work that no thread is left to run: a GDN train step stalled for good,
  every thread asleep. A pool of one thread (the process pinned to one
  core before jax starts, which sizes the pool from the affinity) runs
  each batch inline. GPU runs are left alone."""
  if not any(k in ("gdn", "kda") for k in block_kinds):
    return
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else {0}
  if len(cpus) < 2:
    return
  if not xla_bridge.backends_are_initialized():
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not (
        _accelerator_plugins()):
      os.sched_setaffinity(0, {min(cpus)})
      logging.info("Gated DeltaNet on the CPU backend: pinned to one core "
                   "(jaxlib's triangular solve can deadlock its thread "
                   "pool)")
  elif jax.default_backend() == "cpu":
    logging.warning(
        "Gated DeltaNet / KDA blocks on the CPU backend over %d cores: "
        "jaxlib's triangular solve can deadlock XLA's thread pool; run the "
        "process on one core (taskset -c 0).", len(cpus))


def write_summary(workdir: str, text: str) -> str:
  """Writes `text` to workdir/summary.md and returns it."""
  with open(os.path.join(workdir, "summary.md"), "w") as f:
    f.write(text)
  return text


def log_block(text: str) -> None:
  """Logs a multi-line block (tables) line by line."""
  for line in text.splitlines():
    logging.info("%s", line)


def run_app(run, *, default_config: str, default_workdir: str,
            extra_flags: dict[str, tuple[str, str]] | None = None) -> None:
  """The shared absl entry point of the experiment scripts.

  Defines --config (an ml_collections config file, optionally with an arg
  such as ':smoke'), --workdir and the string flags of `extra_flags`
  (name -> (default, help)), then calls run(config, workdir, **extras).
  Flags are defined here, at run time, so that tests can import several
  experiment modules without duplicate-flag errors.
  """
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  config = config_flags.DEFINE_config_file(
      "config", default_config, "Path to a configs/*.py config file "
      "(optionally with ':<arg>', e.g. ':smoke').", lock_config=True)
  workdir = flags.DEFINE_string("workdir", default_workdir,
                                "Output directory (runs/ is ignored by git).")
  extras = {name: flags.DEFINE_string(name, default, help_)
            for name, (default, help_) in (extra_flags or {}).items()}
  # The flags are defined in this module; make them the script's own, so
  # that --help lists them under the script.
  main_module = sys.argv[0]
  for flag in (config, workdir, *extras.values()):
    flags.FLAGS.register_key_flag_for_module(main_module,
                                             flags.FLAGS[flag.name])
  if any(a in ("-h", "-?", "--help", "--helpshort") for a in sys.argv[1:]):
    # absl's own --help exits with status 1; asking for help is no error.
    app.usage(shorthelp=True, writeto_stdout=True, exitcode=0)

  def main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    run(config.value, workdir.value,
        **{name: flag.value for name, flag in extras.items()})

  app.run(main)
