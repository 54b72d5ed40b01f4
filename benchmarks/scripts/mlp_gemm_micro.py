"""The dense SwiGLU MLP's GEMMs alone at a model's shape (default the
Qwen3.5-4B text MLP: d_model 2560, intermediate 9216, bfloat16), per row
count (decode batch x tokens per row): does XLA run the gate and up
projections as fast as one GEMM of the same size?

  separate  gate and up as two [d, f] weights, two jnp.dot calls on the
            same input (XLA may merge them into one GEMM over the
            concatenated weights)
  packed    one [d, 2f] weight, one jnp.dot, its output split in two (the
            same GEMM as the models' `replayssm_jax.models.mlp.MLP`, whose
            gate_up kernel is [d, 2, f])

Both then silu(gate) * up and the [f, d] down projection. Each form is
checked against an f32 reference of the same weights (max |err| / max
|ref|), timed as the median over jitted loops of --layers MLPs with
distinct weights applied in turn (x <- x + mlp(x); 0.14 GB of weights per
layer at the default shape, past the L2), per MLP, and split by kernel
(`replayssm_jax.profiling.op_times`: a GEMM kernel's name says whether XLA
chose cuBLAS (nvjet / sm90_xmma) or a Triton GEMM fusion). Run it with and
without XLA_FLAGS=--xla_gpu_enable_triton_gemm=false to see what cuBLAS
alone does (`bash benchmarks/scripts/run_h200.sh mlp_gemm`).

  PYTHONPATH=. python benchmarks/scripts/mlp_gemm_micro.py \\
      --rows=256,1024 --out=mlp_gemm_micro.json
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from loop_timing import doubling_time  # pylint: disable=g-bad-import-order
from replayssm_jax import profiling

F32, BF16 = jnp.float32, jnp.bfloat16


def mlp(x, w, form):
  """One SwiGLU MLP in the models' arithmetic (bf16 dots, bf16 out)."""
  if form == "separate":
    g = jnp.dot(x, w["gate"])
    u = jnp.dot(x, w["up"])
  else:
    g, u = jnp.split(jnp.dot(x, w["gate_up"]), 2, axis=-1)
  return jnp.dot(jax.nn.silu(g) * u, w["down"])


def mlp_f32(x, w, form):
  w = jax.tree.map(lambda a: a.astype(F32), w)
  return mlp(x.astype(F32), w, form)


def weights(key, d, f, layers, form):
  out = []
  for kk in jax.random.split(key, layers):
    kg, ku, kd = jax.random.split(kk, 3)
    g = (jax.random.normal(kg, (d, f), F32) * d ** -0.5).astype(BF16)
    u = (jax.random.normal(ku, (d, f), F32) * d ** -0.5).astype(BF16)
    dn = (jax.random.normal(kd, (f, d), F32) * f ** -0.5).astype(BF16)
    out.append(dict(gate=g, up=u, down=dn) if form == "separate"
               else dict(gate_up=jnp.concatenate([g, u], 1), down=dn))
  return out


def loop(form, n):
  @jax.jit
  def run(x, ws):
    def body(_, x):
      for w in ws:
        x = x + mlp(x, w, form)
      return x
    return jax.lax.fori_loop(0, n, body, x)
  return run


def timed(form, x, ws, min_ms, repeats):
  """(µs per MLP, loop steps): `loop_timing.doubling_time` of `loop`."""
  s, n = doubling_time(lambda n: functools.partial(loop(form, n), x, ws),
                       min_ms=min_ms, repeats=repeats, n_min=2, n_max=1024)
  return s / len(ws) * 1e6, n


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", default="256,1024")
  ap.add_argument("--d_model", type=int, default=2560)
  ap.add_argument("--intermediate", type=int, default=9216)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--forms", default="separate,packed")
  ap.add_argument("--min_ms", type=float, default=20.0)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--small", action="store_true",
                  help="toy shapes, no op split: a CPU check")
  ap.add_argument("--out", default="mlp_gemm_micro.json")
  a = ap.parse_args()
  if a.small:
    a.d_model, a.intermediate, a.layers, a.repeats = 32, 64, 2, 2
    a.min_ms = 1.0
  d, f = a.d_model, a.intermediate
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
  res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             commit=commit, command=" ".join(sys.argv),
             xla_flags=os.environ.get("XLA_FLAGS", ""), d_model=d,
             intermediate=f, layers=a.layers, records=[])
  t0 = time.time()
  for rows in (int(r) for r in a.rows.split(",")):
    x = (jax.random.normal(jax.random.PRNGKey(rows), (rows, d), F32)
         ).astype(BF16)
    for form in a.forms.split(","):
      ws = weights(jax.random.PRNGKey(1), d, f, a.layers, form)
      ref = mlp_f32(x, ws[0], form)
      err = float(jnp.max(jnp.abs(mlp(x, ws[0], form).astype(F32) - ref))
                  / jnp.max(jnp.abs(ref)))
      us, n = timed(form, x, ws, a.min_ms, a.repeats)
      rec = dict(rows=rows, form=form, rel_error=err, us_per_mlp=us,
                 loop_steps=n, tflop_s=2 * rows * 3 * d * f / us / 1e6,
                 weight_gb_s=3 * d * f * 2 / us / 1e3)
      if not a.small:
        split = profiling.op_times(loop(form, n), x, ws, iters=2, top=12)
        per = n * a.layers  # MLPs per call
        rec["ops"] = [dict(kernel=o["kernel"], category=o["category"],
                           us_per_mlp=o["ms"] * 1e3 / per,
                           launches_per_mlp=o["events_per_call"] / per)
                      for o in split["top"]]
      res["records"].append(rec)
      res["elapsed_s"] = time.time() - t0
      print(json.dumps({k: v for k, v in rec.items() if k != "ops"}),
            flush=True)
      for o in rec.get("ops", [])[:6]:
        print("   ", o, flush=True)
      with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
      del ws


if __name__ == "__main__":
  main()
