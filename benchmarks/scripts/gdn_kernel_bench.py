"""Gated DeltaNet decode-step kernels timed on one GPU at a Qwen3.5-shaped
layer (32 value heads, 16 key heads, key_dim = value_dim = 128; q, k, v
bfloat16, g and beta float32): the baseline step (Pallas, XLA reference,
flash-linear-attention's Triton kernel) against the ReplaySSM step.

  python benchmarks/scripts/gdn_kernel_bench.py --out=gdn_kernel_bench.json \
      [--batches=1,64,256,512] [--buffer_lens=8,16,32] \
      [--checkpoints=f32,f16] [--policies=f16+fp8] [--budget_s=1e9] [--small]
      [--configs='[{}, {"ring_weights": true}]']

Variants per batch B:
  baseline_pallas  gdn.gdn_step(implementation="pallas"), state [B, HV, K, V]
                   in each --checkpoints dtype, donated (updated in place).
  baseline_xla     gdn.gdn_step(implementation="reference"), f32 state.
  fla              fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule
                   (torch; f32 initial state, new f32 final state, q/k L2
                   normalised in the kernel), timed as a CUDA graph of many
                   calls; "skipped: <why>" without torch + fla + CUDA.
  replay_pallas    gdn.gdn_replay_step(implementation="pallas") per buffer
                   length L and precision: the --checkpoints presets
                   (PrecisionPolicy.preset "f32", "f16": master only) and
                   the --policies presets ("f16+fp8": f16 master, fp8 e4m3
                   read copy with per-row scales); rings bfloat16.
                   Layouts: "staggered" (counts = arange(B) % L, 1/L of the
                   rows flush each step; timed over whole cycles of L steps
                   in one jitted loop) and "aligned" (every row at count 0:
                   non-flush step; every row at L-1: flush step; the count
                   is reset before each step; amortized = ((L-1) nonflush +
                   flush) / L).

--configs: a JSON list of GDNConfig fields; every Pallas variant is checked
and timed once per config, side by side ({} is the defaults, the speed-ups'
baseline). Replay-only fields (REPLAY_ONLY: ring_weights, the ring weights
formed by a first launch; split_routes, the output and flush routes in two
launches; flush_fold, the flush fold's form) are dropped for the baseline
step, which times
each remaining field set once: `--configs='[{}, {"ring_weights": true}]'`
times the replay step with and without the ring-weights launch against
one baseline.

Method: each variant is jitted as a lax.fori_loop whose body steps R
independent states in turn (each with its own fixed random token inputs,
loop-invariant: no per-step slicing kernels), the states donated, R chosen
so that one rotation moves at least --rotation_mb of modelled traffic
(capped at --max_rotation, which leaves the smallest working sets, batch 1
with a read copy, at about the L2 size). Compile, warm up, calibrate the
loop count to about --target_ms per call, then the median of --repeats
calls, in µs per step. Data are
fresh random (replayssm_jax.gdn.testing), stale ring slots poisoned (NaN /
inf). Before timing, the loop's first step is checked against
implementation="reference" on the same inputs: max |err| / max |ref| of the
output (testing.max_rel_error) and of the new state (gdn_materialize for a
replay state; the same measure, computed on the device). A variant that
fails records its error and the script carries on.

Traffic model (bytes per step, N = HV K V, ck / rd / bf the master, read
copy and ring itemsizes, slot = HV V bf + HK K bf + 4 HV the ring bytes of
one token): baseline 2 N ck per row (read + write; fla 2 N 4); replay row
at count c < L-1 reads the read copy (N rd + 4 HV K scales; the master
without a copy) and c ring slots, writes one slot; a flush row reads the
master and L-1 slots, writes the master (and the copy). Inputs and outputs
are left out. GB/s = model bytes / time; copy_fraction = GB/s over a
measured device copy (x + 1 in place on a --copy_mb array, read + write;
--warmup_s of such copies first, so the GPU's clocks have risen before
anything is timed).
speedup = baseline_pallas µs (same master dtype, same batch) / variant µs.

--budget_s: no batch is started after that many seconds. Writes --out
(JSON: device, versions, commit, command, shapes, copy bandwidth, records;
rewritten after every record) and --out with a .md
suffix (µs per step per batch, speed-ups in parentheses). `--small`: tiny
shapes in Pallas interpret mode, for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

# Set before jax starts: JAX allocates on demand, leaving room for torch.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
sys.path.insert(0, ROOT)
from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax.gdn import testing as GT
from replayssm_jax.testing import max_rel_error
# pylint: enable=g-import-not-at-top,wrong-import-position

F32, BF16 = jnp.float32, jnp.bfloat16
MB = 2**20


def _size(dtype) -> int:
  return jnp.dtype(dtype).itemsize


@jax.jit
def _rel_err(a, e):
  """testing.max_rel_error on the device (inf if a has a non-finite)."""
  a, e = a.astype(F32), e.astype(F32)
  err = jnp.max(jnp.abs(a - e)) / jnp.maximum(jnp.max(jnp.abs(e)), 1e-30)
  return jnp.where(jnp.all(jnp.isfinite(a)), err, jnp.inf)


_materialize = jax.jit(gdn.gdn_materialize)
_ref_step = jax.jit(lambda s, t: gdn.gdn_step(s, **t,
                                              implementation="reference"))
_ref_replay = jax.jit(
    lambda s, t, policy: gdn.gdn_replay_step(s, **t, policy=policy,
                                             implementation="reference"),
    static_argnames="policy")


class Bench:
  """Shapes, timing settings and the baseline times of the speed-ups."""

  def __init__(self, a, dims):
    self.a, self.d = a, dims  # dims: hk, hv, k, v
    self.key = jax.random.PRNGKey(0)
    self.base = {}  # (batch, master dtype name) -> baseline_pallas µs
    self.copy_gbs = None

  def next_key(self):
    self.key, k = jax.random.split(self.key)
    return k

  def rotation(self, step_bytes) -> int:
    return int(min(self.a.max_rotation,
                   max(1, math.ceil(self.a.rotation_mb * MB / step_bytes))))

  def inputs(self, batch, n):
    """n independent random token input sets of `batch` rows."""
    d = self.d
    t = GT.random_inputs(self.next_key(), n * batch, d["hk"], d["hv"],
                         d["k"], d["v"], dtype=BF16)
    return tuple(_split(t, n, batch))

  def timing(self, run, states, inputs, n0, count):
    """(µs per step, states, steps per call) of a compiled, checked loop."""
    R = len(states)
    for _ in range(2):  # warm-up, then the calibration call
      t0 = time.perf_counter()
      states, o = run(states, inputs, n0, count)
      jax.block_until_ready((states, o))
      dt = time.perf_counter() - t0
    n = n0 * max(1, math.ceil(self.a.target_ms * 1e-3 / max(dt, 1e-6)))
    times = []
    for _ in range(self.a.repeats):
      t0 = time.perf_counter()
      states, o = run(states, inputs, n, count)
      jax.block_until_ready((states, o))
      times.append(time.perf_counter() - t0)
    return float(np.median(times)) / (n * R) * 1e6, states, n * R

  def loop(self, step, states, inputs, ref, as_full, layouts, n0):
    """Checks then times `step` over R rotating states for each (label,
    count override or None) of `layouts`: {label: results}."""
    R = len(states)

    def run(sts, inps, n, count):
      def body(_, carry):
        sts, o = list(carry[0]), carry[1]
        for r in range(R):
          s = sts[r] if count is None else sts[r].replace(count=count)
          o, sts[r] = step(s, inps[r])
        return tuple(sts), o
      return lax.fori_loop(0, n, body, (sts, jnp.zeros_like(inps[0]["v"])))

    run = jax.jit(run, donate_argnums=0)
    out, states = {}, tuple(states)
    for label, count in layouts:
      last = states[-1] if count is None else states[-1].replace(count=count)
      o_ref, s_ref = ref(last, inputs[-1])
      states, o = run(states, inputs, 1, count)  # compiles; step 1 checked
      errs = dict(output_rel_error=max_rel_error(o, o_ref),
                  state_rel_error=float(_rel_err(as_full(states[-1]),
                                                 as_full(s_ref))))
      del o_ref, s_ref, last
      us, states, steps = self.timing(run, states, inputs, n0, count)
      out[label] = dict(us=us, steps_per_call=steps, rotation=R, **errs)
      print(f"    {label}: {us:.2f} us/step {errs}", flush=True)
    return out

  def record(self, batch, variant, precision, us, nbytes, ck_name, **kw):
    base = self.base.get((batch, ck_name))
    gbs = nbytes / (us * 1e-6) / 1e9
    return dict(
        batch=batch, variant=variant, precision=precision,
        us_per_step=us, bytes_per_step=int(nbytes), gb_s=gbs,
        copy_fraction=gbs / self.copy_gbs if self.copy_gbs else None,
        speedup=base / us if base else None, **kw)


def _split(tree, n, batch):
  """n pytrees of `batch` rows from one of n * batch rows."""
  return [jax.tree.map(lambda x, i=i: x[i * batch:(i + 1) * batch], tree)
          for i in range(n)]


# ------------------------------------------------------------- variants
# GDNConfig fields of the replay step only (the baseline step refuses them).
REPLAY_ONLY = ("ring_weights", "split_routes", "flush_fold", "flush_num_warps",
               "max_registers")


def baseline_configs(configs):
  """The --configs as the baseline step takes them: replay-only fields
  dropped, each remaining field set once, in order."""
  out = []
  for cf in configs:
    base = {k: v for k, v in cf.items() if k not in REPLAY_ONLY}
    if base not in out:
      out.append(base)
  return out


def _config(config):
  """A GDNConfig from its fields (None: the kernels' defaults)."""
  from pallas_kernels.gdn import GDNConfig  # pylint: disable=g-import-not-at-top
  return GDNConfig(**config) if config else None


def baseline(bench, batch, impl, pname, config=None):
  d, ck = bench.d, jnp.dtype(PrecisionPolicy.preset(pname).checkpoint_dtype)
  nbytes = 2 * batch * d["hv"] * d["k"] * d["v"] * _size(ck)
  R = bench.rotation(nbytes)
  full = jax.random.normal(bench.next_key(), (R * batch, d["hv"], d["k"],
                                              d["v"]), F32).astype(ck)
  states = _split(full, R, batch)
  del full
  cfg = _config(config) if impl == "pallas" else None
  step = lambda s, t: gdn.gdn_step(s, **t, implementation=impl, config=cfg)
  res = bench.loop(step, states, bench.inputs(batch, R), _ref_step,
                   lambda s: s, [("step", None)], 1)["step"]
  variant = "baseline_pallas" if impl == "pallas" else "baseline_xla"
  if impl == "pallas" and not config:
    bench.base[(batch, ck.name)] = res["us"]
  kw = dict(config=config) if config else {}
  return [bench.record(batch, variant, pname, res.pop("us"), nbytes,
                       ck.name, **kw, **res)]


def replay_bytes(d, batch, L, policy, counts):
  """Modelled bytes of one replay step with rows at `counts`."""
  n = d["hv"] * d["k"] * d["v"]
  ck, bf = _size(policy.checkpoint_dtype), _size(policy.buffer_dtype)
  if policy.read_dtype is None:
    read, copy_w = n * ck, 0
  else:
    read = n * _size(policy.read_dtype) + (
        4 * d["hv"] * d["k"] if policy.quantized else 0)
    copy_w = read
  slot = d["hv"] * d["v"] * bf + d["hk"] * d["k"] * bf + 4 * d["hv"]
  c = np.asarray(counts)
  flush = c == L - 1
  nonflush = read + (c + 1) * slot
  per_row = np.where(flush, 2 * n * ck + copy_w + (L - 1) * slot, nonflush)
  assert per_row.shape == (batch,)
  return float(per_row.sum())


def replay(bench, batch, L, pname, config=None):
  d = bench.d
  policy = PrecisionPolicy.preset(pname)
  ck = jnp.dtype(policy.checkpoint_dtype)
  stag = np.arange(batch) % L
  stag_bytes = float(np.mean([replay_bytes(d, batch, L, policy,
                                           (stag + s) % L) for s in range(L)]))
  nf_bytes = replay_bytes(d, batch, L, policy, np.zeros(batch, int))
  fl_bytes = replay_bytes(d, batch, L, policy, np.full(batch, L - 1))
  cfg = _config(config)
  kw = dict(config=config) if config else {}
  step = lambda s, t: gdn.gdn_replay_step(s, **t, policy=policy,
                                          implementation="pallas",
                                          config=cfg)
  ref = lambda s, t: _ref_replay(s, t, policy)
  recs = []
  for layout, counts, nbytes in (("staggered", stag, stag_bytes),
                                 ("aligned", np.full(batch, L - 1),
                                  nf_bytes)):
    if layout not in bench.a.layouts.split(","):
      continue
    R = bench.rotation(nbytes)
    rs, _ = GT.random_gdn_replay_state(
        bench.next_key(), R * batch, d["hk"], d["hv"], d["k"], d["v"], L,
        np.tile(counts, R), checkpoint_dtype=ck, buffer_dtype=BF16)
    if not policy.plain:
      rs = rs.with_policy(policy)
    states = _split(rs, R, batch)
    del rs
    if layout == "staggered":
      res = bench.loop(step, states, bench.inputs(batch, R), ref,
                       _materialize, [("staggered", None)], L)["staggered"]
      recs.append(bench.record(batch, "replay_pallas", pname,
                               res.pop("us"), nbytes, ck.name,
                               buffer_len=L, layout=layout, **kw, **res))
      continue
    res = bench.loop(step, states, bench.inputs(batch, R), ref, _materialize,
                     [("nonflush", jnp.zeros(batch, jnp.int32)),
                      ("flush", jnp.full(batch, L - 1, jnp.int32))], 1)
    nf, fl = res["nonflush"], res["flush"]
    us = ((L - 1) * nf["us"] + fl["us"]) / L
    extra = {f"{k}_{n}": v for k, r in res.items() for n, v in r.items()
             if n != "rotation"}
    recs.append(bench.record(
        batch, "replay_pallas", pname, us, ((L - 1) * nf_bytes + fl_bytes) / L,
        ck.name, buffer_len=L, layout=layout, rotation=nf["rotation"],
        nonflush_bytes=int(nf_bytes), flush_bytes=int(fl_bytes),
        nonflush_gb_s=nf_bytes / nf["us"] / 1e3,
        flush_gb_s=fl_bytes / fl["us"] / 1e3, **kw, **extra))
  return recs


def fla(bench, batch):
  """flash-linear-attention's fused recurrent GDN kernel on torch."""
  try:
    # pylint: disable=g-import-not-at-top
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    why = None if torch.cuda.is_available() else "no CUDA device for torch"
  except Exception as e:  # pylint: disable=broad-except
    why = f"{type(e).__name__}: {e}"[:500]
  if why:
    return [dict(batch=batch, variant="fla", fla=f"skipped: {why}")]
  d = bench.d
  nbytes = 2 * batch * d["hv"] * d["k"] * d["v"] * 4
  R = bench.rotation(nbytes)
  full = jax.random.normal(bench.next_key(), (batch, d["hv"], d["k"],
                                              d["v"]), F32)
  inp = jax.block_until_ready(bench.inputs(batch, 1)[0])
  o_ref, s_ref = jax.block_until_ready(_ref_step(full, inp))
  tt = lambda x: torch.from_dlpack(x).clone()
  q, k, v = (tt(inp[n])[:, None] for n in ("q", "k", "v"))
  g, beta = (tt(inp[n])[:, None] for n in ("g", "beta"))

  def call(h):
    return fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=d["k"] ** -0.5, initial_state=h,
        output_final_state=True, use_qk_l2norm_in_kernel=True)

  h0 = tt(full)
  o, ht = call(h0)
  sr = tt(s_ref)
  s_err = float(((ht - sr).abs().max() / sr.abs().max()).item())
  if not bool(torch.isfinite(ht).all()):
    s_err = float("inf")
  o_err = max_rel_error(o[:, 0].float().cpu().numpy(), o_ref)
  hs = [h0] + [h0 + 0.01 * torch.randn_like(h0) for _ in range(R - 1)]
  del sr, ht, o
  n = R * max(1, min(math.ceil(bench.a.target_ms * 1e-3 / 20e-6 / R),
                     (4096 * MB) // (nbytes // 2) // R))
  start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
  try:  # a CUDA graph of n calls (the kernel compiled by the check above)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
      outs = [call(hs[i % R]) for i in range(n)]  # kept: distinct buffers
    run, how = graph.replay, "cuda_graph"
  except Exception as e:  # pylint: disable=broad-except
    print(f"    fla: no CUDA graph ({type(e).__name__}: {e}); eager loop",
          flush=True)
    outs = None
    run, how = (lambda: [call(hs[i % R]) for i in range(n)]), "eager"
  run()
  times = []
  for _ in range(bench.a.repeats):
    start.record()
    run()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) * 1e3 / n)
  del outs, hs
  us = float(np.median(times))
  print(f"    fla: {us:.2f} us/step ({how})", flush=True)
  return [bench.record(batch, "fla", "f32", us, nbytes, "float32",
                       output_rel_error=o_err, state_rel_error=s_err,
                       rotation=R, steps_per_call=n, timing=how)]


def copy_bandwidth(bench) -> float:
  """GB/s of x + 1 in place on a --copy_mb float32 array (read + write),
  after --warmup_s of the same copies: an idle GPU's clocks take a moment
  to rise, and without it the first variant timed after this one ran up
  to 19% slower than the same kernel later in the run."""
  n = bench.a.copy_mb * MB // 4
  x = jax.random.normal(bench.next_key(), (n,), F32)
  run = jax.jit(lambda xs, _, m, __: (lax.fori_loop(
      0, m, lambda i, ys: tuple(y + 1.0 for y in ys), xs), jnp.zeros(())),
                donate_argnums=0)
  end = time.perf_counter() + bench.a.warmup_s
  xs = (x,)
  while time.perf_counter() < end:
    xs = jax.block_until_ready(run(xs, None, 10, None)[0])
  us = bench.timing(run, xs, None, 1, None)[0]
  return 2 * n * 4 / us / 1e3


# --------------------------------------------------------------- output
def write(res, out):
  with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
  rows, batches = {}, sorted({r["batch"] for r in res["records"]})
  notes = []
  for r in res["records"]:
    if "us_per_step" not in r:
      notes.append(f"- B={r['batch']} {r['variant']}: "
                   f"{r.get('error') or r.get('fla')}")
      continue
    label = f"{r['variant']} {r['precision']}"
    if r["variant"] == "replay_pallas":
      lay = "staggered" if r["layout"] == "staggered" else "aligned-amortized"
      label += f" L={r['buffer_len']} {lay}"
    if r.get("config"):
      label += f" {r['config']}"
    cell = f"{r['us_per_step']:.1f}"
    if r.get("speedup"):
      cell += f" ({r['speedup']:.2f}x)"
    rows.setdefault(label, {})[r["batch"]] = cell
  lines = [
      f"GDN decode step, µs per step (speed-up vs baseline_pallas at the "
      f"same master dtype), {res['device']}, jax {res['jax']}, copy "
      f"bandwidth {res['copy_gb_s'] or 0:.0f} GB/s; shapes {res['shapes']}",
      "", "| variant | " + " | ".join(f"B={b}" for b in batches) + " |",
      "|---|" + "---|" * len(batches)]
  for label, cells in rows.items():
    lines.append(f"| {label} | " + " | ".join(cells.get(b, "-")
                                             for b in batches) + " |")
  with open(os.path.splitext(out)[0] + ".md", "w") as fh:
    fh.write("\n".join(lines + [""] + notes) + "\n")


def add_timing_flags(ap):
  """Bench's timing settings (the module docstring's method)."""
  ap.add_argument("--repeats", type=int, default=None, help="default 20")
  ap.add_argument("--target_ms", type=float, default=3.0)
  ap.add_argument("--rotation_mb", type=float, default=512.0)
  ap.add_argument("--max_rotation", type=int, default=128)


def run_jobs(bench, batch, jobs, res, start, save):
  """Runs each (name, fn, args) of `jobs` at `batch`: its records, or its
  error (recorded, so one variant's failure does not hide the others),
  join res["records"], saved after each."""
  for name, fn, args in jobs:
    print(f"[{time.time() - start:6.0f}s] B={batch} {name}", flush=True)
    try:
      recs = fn(bench, batch, *args)
    except Exception as e:  # pylint: disable=broad-except
      recs = [dict(batch=batch, variant=name,
                   error=f"{type(e).__name__}: {e}"[:2000])]
      print(f"    error: {recs[0]['error'][:300]}", flush=True)
    res["records"] += recs
    res["elapsed_s"] = time.time() - start
    save(res)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="gdn_kernel_bench.json")
  ap.add_argument("--batches", default=None, help="default 1,64,256,512")
  ap.add_argument("--buffer_lens", default=None,
                  help="default 8,16,32; empty: the baselines only")
  ap.add_argument("--checkpoints", default="f32,f16")
  ap.add_argument("--policies", default="f16+fp8")
  add_timing_flags(ap)
  ap.add_argument("--copy_mb", type=int, default=1024)
  ap.add_argument("--warmup_s", type=float, default=None,
                  help="default 3 (0 with --small)")
  ap.add_argument("--no_fla", action="store_true")
  ap.add_argument("--no_xla", action="store_true")
  ap.add_argument("--layouts", default="staggered,aligned")
  ap.add_argument("--configs", default="[{}]",
                  help="JSON list of GDNConfig fields for the Pallas "
                  "variants, each timed; {} is the defaults (the speed-ups' "
                  "baseline), a config a replay state cannot take records "
                  "its error")
  ap.add_argument("--budget_s", type=float, default=1e9)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  small = a.small  # shapes and settings for a CPU run (interpret mode)
  a.batches = a.batches or ("1,2" if small else "1,64,256,512")
  if a.buffer_lens is None:  # "" times no replay step
    a.buffer_lens = "4" if small else "8,16,32"
  a.repeats = a.repeats or (3 if small else 20)
  a.warmup_s = (0.0 if small else 3.0) if a.warmup_s is None else a.warmup_s
  if small:
    a.max_rotation, a.copy_mb, a.target_ms = 2, 4, 1.0
  dims = (dict(hk=1, hv=2, k=16, v=16) if small
          else dict(hk=16, hv=32, k=128, v=128))
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True,
                            check=True).stdout.strip()
  except Exception:  # pylint: disable=broad-except
    commit = None
  bench = Bench(a, dims)
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit,
             command=" ".join([sys.executable] + sys.argv),
             shapes=dict(num_v_heads=dims["hv"], num_k_heads=dims["hk"],
                         key_dim=dims["k"], value_dim=dims["v"],
                         q_k_v="bfloat16", g_beta="float32",
                         rings="bfloat16"),
             copy_gb_s=None, records=[])
  start = time.time()
  try:
    bench.copy_gbs = res["copy_gb_s"] = copy_bandwidth(bench)
  except Exception as e:  # pylint: disable=broad-except
    res["copy_error"] = f"{type(e).__name__}: {e}"[:2000]
  print(f"copy bandwidth {res['copy_gb_s']} GB/s", flush=True)
  write(res, a.out)
  checkpoints = [c for c in a.checkpoints.split(",") if c]
  precisions = checkpoints + [p for p in a.policies.split(",") if p]
  for batch in (int(b) for b in a.batches.split(",")):
    if time.time() - start > a.budget_s:
      print(f"budget: batch {batch} and later not started", flush=True)
      res["budget_stop"] = batch
      break
    configs = json.loads(a.configs)
    jobs = [(f"baseline_pallas {c} {cf or ''}", baseline, ("pallas", c, cf))
            for cf in baseline_configs(configs) for c in checkpoints]
    if not a.no_xla:
      jobs.append(("baseline_xla f32", baseline, ("reference", "f32")))
    if not a.no_fla:
      jobs.append(("fla", fla, ()))
    jobs += [(f"replay_pallas L={L} {p} {cf or ''}", replay, (L, p, cf))
             for L in (int(x) for x in a.buffer_lens.split(",") if x)
             for cf in configs for p in precisions]
    run_jobs(bench, batch, jobs, res, start, lambda r: write(r, a.out))
  write(res, a.out)
  print(f"done in {time.time() - start:.0f}s: {a.out}", flush=True)


if __name__ == "__main__":
  main()
