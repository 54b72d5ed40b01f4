"""Cost of the chunked prefill scans at served layer shapes (any backend).

XLA's cost analysis (flops, bytes accessed) and the median wall time of
`ssd_chunked_scan` at hybrid_1b's Mamba-2 layer (64 heads of 64, 8 groups
of state 128, chunks of 256) and `gdn.gdn_chunked_prefill` at the Qwen3.5
layer (16 key / 32 value heads of 128, chunks of 64), one row of
--seq_len tokens, random bf16 inputs. --precisions: both scans at each
further precision of their products too (a dot algorithm name, as their
`precision=` takes it), with the outputs' and final state's error against
the default (HIGHEST: true f32) beside the cost. --chunk_sizes and
--gdn_chunk_sizes: each scan at further chunk lengths too, and
--segsum_difference: the Mamba-2 scan with its within-chunk decay sums
formed as differences of one cumulative sum (a_cum_i - a_cum_j, the form
of the GDN prefill and of mamba_ssm's kernels) in place of the default
`ssd._segsum`, each with its error against the default. --gdn_solves:
the GDN prefill with further solves of its chunk systems too ("inverse":
`gdn.reference.solve_unit_lower`). --batch: rows per call (training's
batch, e.g. 32 at 1024 tokens). --backward: time the gradient of a loss
of the outputs and final state with respect to the inputs instead, what
a training step takes through the scans (the errors are then those of
the gradients with respect to the first and third input: x and B /
q and v).
Compare two commits by running it
with PYTHONPATH at each tree in turn (it uses only those two functions):

  PYTHONPATH=. python benchmarks/scripts/prefill_scan_cost.py --out $OUT/x.json
"""

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jax.lax import Precision

from replayssm_jax import gdn, ssd
from replayssm_jax.ssd import ssd_chunked_scan


HIGHEST = Precision.HIGHEST


def rel_err(a, b):
  a, b = (jnp.asarray(x, jnp.float32) for x in (a, b))
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def measure(f, args, repeats):
  """(cost and median time of the jitted f on args, its outputs)."""
  ca = f.lower(*args).compile().cost_analysis()
  ca = ca[0] if isinstance(ca, list) else ca
  out = jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return dict(gflop=ca.get("flops", 0.0) / 1e9,
              gbytes=ca.get("bytes accessed", 0.0) / 1e9,
              ms=statistics.median(times) * 1e3), out


def study(scan, args, precisions, repeats, variants=()):
  """scan(precision, **variant) -> a function of args returning (outputs,
  final state): its record at HIGHEST, at each of `precisions` and each
  (name, variant kwargs) of `variants`, with the outputs' and state's error
  against the default's."""
  rec, want = measure(jax.jit(scan(HIGHEST)), args, repeats)

  def against(fn):
    r, got = measure(jax.jit(fn), args, repeats)
    return dict(r, y_rel_err=rel_err(got[0], want[0]),
                state_rel_err=rel_err(got[1], want[1]))

  rec["precisions"] = {prec: against(scan(prec)) for prec in precisions}
  if variants:
    rec["variants"] = {name: against(scan(HIGHEST, **kw))
                       for name, kw in variants}
  return rec


def _segsum_difference(a):
  """ssd._segsum's [..., Q, Q] from differences of one cumulative sum."""
  q = a.shape[-1]
  c = jnp.cumsum(a, axis=-1)
  return jnp.where(jnp.tril(jnp.ones((q, q), bool)),
                   c[..., :, None] - c[..., None, :], -jnp.inf)


def with_backward(scan):
  """scan(precision, **variant) -> the gradient of sum(y^2) + sum(state^2)
  with respect to the scan's first and third inputs, in their place."""
  def wrapped(prec, **kw):
    f = scan(prec, **kw)

    def loss(*x):
      y, state = f(*x)
      return (jnp.sum(jnp.square(y.astype(jnp.float32)))
              + jnp.sum(jnp.square(state)))
    return jax.grad(loss, argnums=(0, 2))
  return wrapped


def ssd_scan(prec, chunk_size=256, segsum_difference=False):
  def f(*x):
    saved = ssd._segsum  # read when the scan is traced, here
    if segsum_difference:
      ssd._segsum = _segsum_difference
    try:
      return ssd_chunked_scan(*x, chunk_size=chunk_size, dt_softplus=True,
                              precision=prec)
    finally:
      ssd._segsum = saved
  return f


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seq_len", type=int, default=512)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--precisions", default="",
                  help="further precisions of the scans' products, "
                  "comma-separated (e.g. BF16_BF16_F32_X3,TF32_TF32_F32)")
  ap.add_argument("--chunk_sizes", default="",
                  help="further chunk lengths of the Mamba-2 scan (256: "
                  "the default), separated by commas or '+'")
  ap.add_argument("--gdn_chunk_sizes", default="",
                  help="further chunk lengths of the GDN prefill (64: the "
                  "default), separated by commas or '+'")
  ap.add_argument("--segsum_difference", action="store_true")
  ap.add_argument("--gdn_solves", default="",
                  help="further solves of the GDN chunk systems "
                  "(substitution: the default; inverse)")
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--backward", action="store_true")
  ap.add_argument("--out", default="prefill_scan_cost.json")
  a = ap.parse_args()
  ints = lambda v: [int(x) for x in v.replace("+", ",").split(",") if x]
  t, b = a.seq_len, a.batch
  ks = jax.random.split(jax.random.PRNGKey(0), 12)
  bf = jnp.bfloat16
  ssd_args = (jax.random.normal(ks[0], (b, t, 64, 64), bf),
              jax.random.normal(ks[1], (b, t, 64)),
              -jnp.exp(jax.random.normal(ks[2], (64,))),
              jax.random.normal(ks[3], (b, t, 8, 128), bf),
              jax.random.normal(ks[4], (b, t, 8, 128), bf))
  gdn_args = (jax.random.normal(ks[5], (b, t, 16, 128), bf),
              jax.random.normal(ks[6], (b, t, 16, 128), bf),
              jax.random.normal(ks[7], (b, t, 32, 128), bf),
              -jax.nn.softplus(jax.random.normal(ks[8], (b, t, 32))),
              jax.nn.sigmoid(jax.random.normal(ks[9], (b, t, 32))))
  res = dict(backend=jax.default_backend(), jax=jax.__version__,
             seq_len=t, command=" ".join(["prefill_scan_cost.py"] + [
                 f"--seq_len={t}", f"--repeats={a.repeats}",
                 f"--precisions={a.precisions}",
                 f"--chunk_sizes={a.chunk_sizes}",
                 f"--gdn_chunk_sizes={a.gdn_chunk_sizes}",
                 f"--gdn_solves={a.gdn_solves}", f"--batch={b}"]
                 + ["--segsum_difference"] * a.segsum_difference
                 + ["--backward"] * a.backward))
  grad = with_backward if a.backward else (lambda scan: scan)
  precisions = [p for p in a.precisions.split(",") if p]
  ssd_variants = [(f"chunk_size={q}", dict(chunk_size=q))
                  for q in ints(a.chunk_sizes)]
  if a.segsum_difference:
    ssd_variants += [(f"segsum_difference,chunk_size={q}",
                      dict(chunk_size=q, segsum_difference=True))
                     for q in [256] + ints(a.chunk_sizes)]
  res["ssd_chunked_scan"] = study(grad(ssd_scan), ssd_args, precisions,
                                  a.repeats, ssd_variants)
  res["gdn_chunked_prefill"] = study(
      grad(lambda prec, chunk_size=64, solve="substitution": lambda *x: (
          gdn.gdn_chunked_prefill(*x, chunk_size=chunk_size, precision=prec,
                                  solve=solve))),
      gdn_args, precisions, a.repeats,
      [(f"chunk_size={q}", dict(chunk_size=q))
       for q in ints(a.gdn_chunk_sizes)]
      + [(f"solve={v}", dict(solve=v))
         for v in a.gdn_solves.replace("+", ",").split(",") if v])
  print(json.dumps(res))
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
