"""Gated DeltaNet speculative verify timed on one GPU at the Qwen3.5-shaped
layer of gdn_kernel_bench.py (32 value heads, 16 key heads, key_dim =
value_dim = 128; window inputs bfloat16, g and beta float32, rings
bfloat16): one verify + commit iteration per step.

  python benchmarks/scripts/gdn_verify_bench.py --out=gdn_verify_bench.json \
      [--batches=256,64] [--window=4] [--buffer_len=16] \
      [--precisions=f32,f16,f16+fp8] [--configs='[{}, {"block_v": 64}]'] \
      [--no_xla] [--no_snapshot] [--budget_s=1e9] [--small]

Variants per batch B (each iteration: verify a T-token window, then commit
1 + (row mod T) tokens, a mean of (T + 1) / 2, 2.5 at T = 4, so rows
reach their fold (count + T >= L) at different iterations, as in
decoding):
  verify_pallas    gdn_replay_verify(implementation="pallas") +
                   gdn_replay_commit, per --precisions preset and
                   --configs entry (GDNConfig fields of the verify kernels:
                   block_v, num_warps, num_stages, ring_weights; {} =
                   their defaults).
  verify_xla       the same through the pure-JAX reference, f32.
  snapshot         the snapshot-per-draft baseline: gdn_baseline_verify
                   (reference: no kernel; T f32 states written) +
                   gdn_baseline_commit, f32.

Method, checks and rotation as gdn_kernel_bench.py (its Bench): each
variant's first iteration is checked against the reference on the same
inputs (output, and the committed state materialized); stale ring slots
are poisoned. `state_gb_s` = one read of the state (master, or read copy)
per iteration / time: the floor a verify cannot go below, for comparison
with the readout and step kernels. Writes --out (JSON, rewritten after
every record). `--small`: tiny shapes in interpret mode, a CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gdn_kernel_bench as KB  # pylint: disable=g-bad-import-order
from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax.gdn import testing as GT

F32, BF16 = KB.F32, KB.BF16
# gdn_kernel_bench's helpers: rows split into rotating states, a GDNConfig
# from its fields, the jitted gdn_materialize.
# pylint: disable=protected-access
_split, _config, _materialize = KB._split, KB._config, KB._materialize
# pylint: enable=protected-access


def _accepted(batch, window):
  return jnp.asarray(1 + np.arange(batch) % window, jnp.int32)


def window_inputs(bench, batch, n, window):
  """n independent random windows of `batch` rows, [batch, T, ...]."""
  d = bench.d
  t = GT.random_inputs(bench.next_key(), n * batch, d["hk"], d["hv"],
                       d["k"], d["v"], T=window, dtype=BF16)
  return tuple(_split(t, n, batch))


def replay(bench, batch, impl, pname, config=None):
  a, d = bench.a, bench.d
  policy = PrecisionPolicy.preset(pname)
  ck = jnp.dtype(policy.checkpoint_dtype)
  read = jnp.dtype(policy.read_dtype or ck)
  n_acc = _accepted(batch, a.window)
  cfg = _config(config) if impl == "pallas" else None

  def iteration(s, t, impl=impl, cfg=cfg):
    o, pend = gdn.gdn_replay_verify(s, **t, policy=policy,
                                    implementation=impl, config=cfg)
    return o, gdn.gdn_replay_commit(pend, n_acc)

  ref = jax.jit(lambda s, t: iteration(s, t, "reference", None))
  state_bytes = batch * d["hv"] * d["k"] * d["v"] * read.itemsize
  R = bench.rotation(state_bytes)
  # Counts below L - T: the first iteration's rows fold nothing; later
  # ones fold as their histories fill.
  counts = np.tile(np.arange(batch) % (a.buffer_len - a.window), R)
  rs, _ = GT.random_gdn_replay_state(
      bench.next_key(), R * batch, d["hk"], d["hv"], d["k"], d["v"],
      a.buffer_len, counts, checkpoint_dtype=ck, buffer_dtype=BF16)
  if not policy.plain:
    rs = rs.with_policy(policy)
  states = _split(rs, R, batch)
  del rs
  res = bench.loop(iteration, states, window_inputs(bench, batch, R,
                                                    a.window),
                   ref, _materialize, [("iteration", None)], 1)
  res = res["iteration"]
  us = res.pop("us")
  kw = dict(config=config) if config else {}
  variant = "verify_xla" if impl == "reference" else "verify_pallas"
  return [dict(batch=batch, variant=variant, precision=pname,
               window=a.window, buffer_len=a.buffer_len,
               us_per_iteration=us, state_gb_s=state_bytes / us / 1e3,
               **kw, **res)]


def snapshot(bench, batch):
  a, d = bench.a, bench.d
  n_acc = _accepted(batch, a.window)

  def iteration(s, t):
    o, snaps = gdn.gdn_baseline_verify(s, **t, implementation="reference")
    return o, gdn.gdn_baseline_commit(snaps, n_acc)

  state_bytes = batch * d["hv"] * d["k"] * d["v"] * 4
  R = bench.rotation(state_bytes)
  full = jax.random.normal(bench.next_key(), (R * batch, d["hv"], d["k"],
                                              d["v"]), F32)
  states = _split(full, R, batch)
  del full
  res = bench.loop(iteration, states, window_inputs(bench, batch, R,
                                                    a.window),
                   jax.jit(iteration), lambda s: s, [("iteration", None)],
                   1)["iteration"]
  us = res.pop("us")
  return [dict(batch=batch, variant="snapshot", precision="f32",
               window=a.window, us_per_iteration=us,
               state_gb_s=state_bytes / us / 1e3, **res)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default="gdn_verify_bench.json")
  ap.add_argument("--batches", default=None, help="default 256,64")
  ap.add_argument("--window", type=int, default=4)
  ap.add_argument("--buffer_len", type=int, default=None, help="default 16")
  ap.add_argument("--precisions", default="f32,f16,f16+fp8")
  ap.add_argument("--configs", default="[{}]",
                  help="JSON list of GDNConfig fields for verify_pallas")
  ap.add_argument("--no_xla", action="store_true")
  ap.add_argument("--no_snapshot", action="store_true")
  KB.add_timing_flags(ap)
  ap.add_argument("--budget_s", type=float, default=1e9)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  small = a.small
  a.batches = a.batches or ("2" if small else "256,64")
  a.buffer_len = a.buffer_len or (8 if small else 16)
  a.repeats = a.repeats or (3 if small else 20)
  if small:
    a.max_rotation, a.target_ms = 2, 1.0
  dims = (dict(hk=1, hv=2, k=16, v=16) if small
          else dict(hk=16, hv=32, k=128, v=128))
  commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=KB.ROOT,
                          capture_output=True, text=True,
                          check=False).stdout.strip() or None
  bench = KB.Bench(a, dims)
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit,
             command=" ".join([sys.executable] + sys.argv),
             shapes=dict(num_v_heads=dims["hv"], num_k_heads=dims["hk"],
                         key_dim=dims["k"], value_dim=dims["v"]),
             records=[])
  configs = json.loads(a.configs)
  start = time.time()

  def save(r):
    if "error" not in r["records"][-1]:  # run_jobs printed the error
      print(f"    {r['records'][-1]}", flush=True)
    with open(a.out, "w") as fh:
      json.dump(r, fh, indent=1)

  for batch in (int(b) for b in a.batches.split(",")):
    if time.time() - start > a.budget_s:
      res["budget_stop"] = batch
      break
    jobs = [(f"verify_pallas {p} {cf or ''}", replay, ("pallas", p, cf))
            for cf in configs for p in a.precisions.split(",")]
    if not a.no_xla:
      jobs.append(("verify_xla f32", replay, ("reference", "f32")))
    if not a.no_snapshot:
      jobs.append(("snapshot f32", snapshot, ()))
    KB.run_jobs(bench, batch, jobs, res, start, save)
  print(f"done in {time.time() - start:.0f}s: {a.out}", flush=True)


if __name__ == "__main__":
  main()
