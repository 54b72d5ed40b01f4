"""Forms of the one-query decode attention, checked and timed (GPU diagnostic).

The model's decode step attends one query per row to its KV cache
([batch, max_len, kv_heads, head_dim], per-row lengths). This times forms of
that product at hybrid_1b's shapes (16 query / 4 KV heads of 128, bf16
cache) over rotating caches (more bytes than the L2), each checked against
the float32 form the model used before (`f32`, the reference):

  f32      q, k, v converted to float32, both products in float32
  bf16_qk  q.k^T on the bf16 operands with float32 accumulation (exact: a
           product of two bf16 values is exact in float32), p.v in float32
  bf16     both products on bf16 operands, p rounded to bf16 (as flash
           attention kernels do), float32 accumulation

each in two cache layouts: [batch, max_len, kv_heads, head_dim] (`bskd`, the
model's before session 23) and head-major [batch, kv_heads, max_len,
head_dim] (`bksd`, the model's since).

It also lists the copies (>= 1 MiB) in the optimized HLO of
experiments/decode_bench.py's decode loop on the given config.

  PYTHONPATH=. python benchmarks/scripts/attend_micro.py --out $OUT/am.json
"""

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


def attend(form, layout, q, k, v, mask):
  """q [b, Hq, D] (one query), k/v [b, S, Hk, D] (layout "bskd") or
  [b, Hk, S, D] ("bksd"), mask [b, S] -> [b, Hq*D]."""
  b, hq, d = q.shape
  hk = k.shape[2 if layout == "bskd" else 1]
  qg = q.reshape(b, hk, hq // hk, d)
  if form == "f32":
    s = jnp.einsum(f"bkrd,{layout}->bkrs", qg.astype(F32), k.astype(F32))
  else:
    s = jnp.einsum(f"bkrd,{layout}->bkrs", qg, k, preferred_element_type=F32)
  s = jnp.where(mask[:, None, None], s * d ** -0.5, -1e30)
  p = jax.nn.softmax(s, axis=-1)
  if form == "bf16":
    o = jnp.einsum(f"bkrs,{layout}->bkrd", p.astype(v.dtype), v,
                   preferred_element_type=F32)
  else:
    o = jnp.einsum(f"bkrs,{layout}->bkrd", p, v.astype(F32))
  return o.reshape(b, hq * d).astype(q.dtype)


def timed(fn, sets, iters):
  out = [fn(*s) for s in sets]  # compile + warm
  jax.block_until_ready(out)
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = [fn(*s) for s in sets]
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / len(sets))
  return 1e6 * statistics.median(ts)


def copies(config_path: str, batch: int) -> dict:
  """mode -> the copies of >= 1 MiB in the decode loop's optimized HLO."""
  from decode_step_profile import load_model_config
  from experiments.decode_bench import build_model, decode_loop
  from specdec_profile import big_copies
  model = build_model(load_model_config(config_path), 0)
  graphdef, params = nnx.split(model)
  out = {}
  for mode in ("baseline", "replay"):
    st = jax.eval_shape(lambda m=mode: model.init_state(
        batch, 384, ssm_mode=m, buffer_len=16, checkpoint_dtype=F32))
    tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
    hlo = decode_loop.lower(graphdef, params, tok, st, 8, None).compile(
        ).as_text()
    out[mode] = big_copies(hlo, min_bytes=2**20)
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--max_len", type=int, default=384)
  ap.add_argument("--sets", type=int, default=6)
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--config", default="configs/hybrid_1b.py")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  b, S, hq, hk, d = a.batch, a.max_len, 16, 4, 128
  keys = jax.random.split(jax.random.PRNGKey(0), 4 * a.sets)
  sets = []
  for i in range(a.sets):
    q = jax.random.normal(keys[4 * i], (b, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[4 * i + 1], (b, S, hk, d), jnp.bfloat16)
    v = jax.random.normal(keys[4 * i + 2], (b, S, hk, d), jnp.bfloat16)
    lengths = jax.random.randint(keys[4 * i + 3], (b,), S // 2, S + 1)
    mask = jnp.arange(S)[None] < lengths[:, None]
    sets.append((q, k, v, mask))
  res = dict(command=" ".join(["python"] + sys.argv),
             date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                 timespec="seconds"),
             device=jax.devices()[0].device_kind, jax=jax.__version__,
             shapes=dict(batch=b, max_len=S, q_heads=hq, kv_heads=hk,
                         head_dim=d), cache_mib=2 * b * S * hk * d * 2 / 2**20,
             forms={})
  ref = jax.jit(lambda *x: attend("f32", "bskd", *x).astype(F32))(*sets[0])
  hm_sets = [(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), m)
             for q, k, v, m in sets]
  for layout, data in (("bskd", sets), ("bksd", hm_sets)):
    for form in ("f32", "bf16_qk", "bf16"):
      fn = jax.jit(lambda *x, f=form, lay=layout: attend(f, lay, *x))
      err = float(jnp.max(jnp.abs(fn(*data[0]).astype(F32) - ref)) /
                  jnp.max(jnp.abs(ref)))
      us = timed(fn, data, a.iters)
      name = f"{form}/{layout}"
      res["forms"][name] = dict(us=us, max_err_rel_to_max=err,
                                tb_per_s=res["cache_mib"] * 2**20 / us / 1e6)
      print(f"{name:14s} {us:8.1f} us  {res['forms'][name]['tb_per_s']:.2f} "
            f"TB/s  err {err:.2e}", flush=True)
  res["decode_loop_copies"] = copies(a.config, b)
  for mode, rows in res["decode_loop_copies"].items():
    print(f"== copies >= 1 MiB in the {mode} decode loop: {len(rows)}")
    for r in rows:
      print("  ", r)
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
