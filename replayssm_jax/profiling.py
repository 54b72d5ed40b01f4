"""Per-op device time of a jitted function, from a `jax.profiler` trace.

`op_times(fn, *args)` runs `fn` under `jax.profiler.trace`, reads the trace
back with `jax.profiler.ProfileData` (no TensorBoard needed) and sums the
duration of every event that XLA tagged with the HLO op it ran (`hlo_op`)
on the device planes (`/device:GPU:0`, ...; the host plane on a CPU). It
answers "where does this decode step's time go" by kernel, not by guess:

  t = profiling.op_times(step, params, tok, state, iters=5)
  t["by_category"]  # {"gemm": ms, "pallas": ms, "copy": ms, "other": ms}
  t["top"][:10]     # the 10 longest ops: hlo_op, its longest kernel, ms

On a GPU, XLA runs loops as CUDA graphs ("command buffers") whose
kernels the trace reports as one op named `command_buffer_*`; to split
them, disable command buffers before jax starts:
`XLA_FLAGS=--xla_gpu_enable_command_buffer=` (launches then cost a little
more, so time the step without it). `command_buffer_ms` says how much of
the time such ops hold; `op_times` warns when it is most of it.

Times are per call of `fn` (summed over `iters` calls, divided by iters).
Kernels overlap rarely on one stream, so the sum is close to the call's
device time; `device_ms` is that sum and `wall_ms` the host time around
the traced calls, for comparison. Categories come from the kernel and HLO
names: "pallas" (a Pallas kernel of this project: its name starts with
"replayssm"), "gemm" (cuBLAS / cuBLASLt / CUTLASS / Triton GEMM kernels,
or an HLO dot / convolution), "copy" (HLO copies and memcpy), "other"
(XLA's elementwise and reduction fusions, everything else).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

from absl import logging
import jax
from jax import profiler

_GEMM = re.compile(r"gemm|xmma|nvjet|cutlass|cublas|matmul|wgmma|\bdot\b|"
                   r"^dot|convolution|cudnn", re.IGNORECASE)

_CONTROL = ("while", "conditional", "call")


def category(hlo_op: str, kernel: str) -> str:
  """"pallas", "gemm", "copy" or "other" for one traced op."""
  names = f"{hlo_op} {kernel}"
  if "replayssm" in names:
    return "pallas"
  if _GEMM.search(hlo_op) or _GEMM.search(kernel):
    return "gemm"
  if hlo_op.startswith(("copy", "memcpy")) or "memcpy" in kernel.lower():
    return "copy"
  return "other"


def _events(data):
  """(hlo_op, kernel name, duration ns) of every traced op: the kernels on
  the device planes' stream lines when the trace has device planes (an
  untagged kernel counts under its own name), else the host plane's
  hlo_op-tagged events (a CPU run)."""
  planes = list(data.planes)
  device = [p for p in planes if p.name.startswith("/device:")]
  for plane in device or planes:
    lines = list(plane.lines)
    if device:  # kernels sit on "Stream #..." lines; skip derived lines
      streams = [ln for ln in lines if ln.name.startswith("Stream")]
      lines = streams or lines
    for line in lines:
      for ev in line.events:
        op = dict(ev.stats).get("hlo_op")
        if not device and op and str(op).startswith(_CONTROL):
          continue  # a CPU thunk enclosing its body's ops: counted there
        if op or device:
          yield str(op or ev.name), ev.name, ev.duration_ns


def op_times(fn, *args, iters: int = 5, top: int = 30) -> dict:
  """Traces `iters` calls of `fn(*args)` (after one untimed call) and
  returns the device time per call by op and by category (module
  docstring). `fn`'s arguments must not be donated (it is called several
  times on them)."""
  if iters < 1:
    raise ValueError(f"op_times: iters must be >= 1, got {iters}.")
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with profiler.trace(d):
      t0 = time.perf_counter()
      for _ in range(iters):
        jax.block_until_ready(fn(*args))
      wall = time.perf_counter() - t0
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
      raise RuntimeError(f"op_times: jax.profiler.trace wrote no "
                         f"*.xplane.pb under {d}.")
    data = profiler.ProfileData.from_file(files[0])
    # op -> kernel -> ns: one HLO op can launch several kernels (a cuBLAS
    # GEMM custom call after a memset of its output), so an op is named by
    # its longest kernel and categorized on all of them.
    op_kernels = collections.defaultdict(lambda: collections.defaultdict(float))
    op_events = collections.defaultdict(list)  # op -> every event's ns
    for op, kernel, ns in _events(data):
      op_kernels[op][kernel] += ns
      op_events[op].append(ns)
  by_op = {op: sum(ks.values()) for op, ks in op_kernels.items()}
  kernels = {op: max(ks, key=ks.get) for op, ks in op_kernels.items()}
  per_call = lambda ns: ns / iters / 1e6  # ms
  cats = {op: category(op, " ".join(ks)) for op, ks in op_kernels.items()}
  by_category = collections.defaultdict(float)
  for op, ns in by_op.items():
    by_category[cats[op]] += per_call(ns)
  ranked = sorted(by_op.items(), key=lambda kv: -kv[1])
  graphs = per_call(sum(ns for op, ns in by_op.items()
                        if op.startswith("command_buffer")))
  device_ms = sum(by_category.values())
  if graphs > 0.5 * device_ms:
    logging.warning(
        "op_times: %.0f%% of the device time is in CUDA graphs (command "
        "buffers), not split by kernel; set XLA_FLAGS="
        "--xla_gpu_enable_command_buffer= before jax starts to split them.",
        100 * graphs / device_ms)
  return dict(
      iters=iters,
      wall_ms=1e3 * wall / iters,
      device_ms=device_ms,
      command_buffer_ms=graphs,
      by_category=dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
      top=[dict(hlo_op=op, kernel=kernels[op][:120], category=cats[op],
                ms=per_call(ns), **_spread(op_events[op], iters))
           for op, ns in ranked[:top]])


def _spread(events_ns, iters: int) -> dict:
  """Kernel events per call and their min / median / max duration (µs):
  tells apart an op whose launches all cost the same from one that is
  cheap on most steps (e.g. a flush launch with no row due)."""
  us = sorted(ns / 1e3 for ns in events_ns)
  return dict(events_per_call=len(us) / iters, min_us=us[0],
              median_us=us[len(us) // 2], max_us=us[-1])
