"""Forms of the decode attention (one query or a verify window per row),
checked and timed (GPU).

The model's decode step attends one query per row to the valid entries of
its head-major KV cache ([batch, kv_heads, max_len, head_dim], per-row
lengths). This times, at hybrid_1b's shapes (16 query / 4 KV heads of 128,
bf16 cache; --q_heads / --kv_heads for others) over rotating caches (more
bytes than the L2):

  xla_f32     q, k, v converted to float32, both products in float32 over
              the whole cache, masked (XLA's plain form)
  reference   `ops.decode_attention(implementation="reference")` (XLA, the
              whole cache, masked)
  pallas:<v>  `ops.decode_attention(implementation="pallas")` with the
              AttentionConfig variant v (VARIANTS; --variants picks): reads
              only each row's valid entries

each with ragged lengths (uniform in [max_len / 2, max_len], as in a decode
loop's cache) and with every row full. `--window T` times a speculative
verify window of T queries per row instead (query t sees lengths + t
entries). Each form is checked against the op's reference on float32
copies of the inputs; `tb_per_s` counts the bytes of the entries the
row's last query sees (k and v, read once).

The [batch, max_len, kv_heads, head_dim] cache layout and bf16 products
against the head-major layout: benchmarks/decode_step/attention_cache_layouts_b256_h200.json.

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

import pallas_kernels as pk
from replayssm_jax import ops

F32 = jnp.float32

VARIANTS = {
    "default": pk.AttentionConfig(),  # 2 stages
    "s1": pk.AttentionConfig(num_stages=1),
    "s3": pk.AttentionConfig(num_stages=3),
    "w8": pk.AttentionConfig(num_warps=8),
    "b128w8": pk.AttentionConfig(block_s=128, num_warps=8),
    "b32": pk.AttentionConfig(block_s=32),
    "split128": pk.AttentionConfig(split_s=128),
    "split64": pk.AttentionConfig(split_s=64),
    "b32split64": pk.AttentionConfig(block_s=32, split_s=64),
}


def xla_f32(q, k, v, lengths):
  """The decode-step and verify-window attention in float32 by XLA
  (head-major cache; q [b, Hq, D] or a window [b, T, Hq, D])."""
  qw = q if q.ndim == 4 else q[:, None]
  b, t, hq, d = qw.shape
  hk, s = k.shape[1], k.shape[2]
  qg = qw.reshape(b, t, hk, hq // hk, d)
  sc = jnp.einsum("btkrd,bksd->bkrts", qg.astype(F32), k.astype(F32))
  limit = lengths[:, None] + jnp.arange(t)[None]  # [b, T]
  mask = jnp.arange(s)[None, None] < limit[:, :, None]
  sc = jnp.where(mask[:, None, None], sc * d ** -0.5, -1e30)
  p = jax.nn.softmax(sc, axis=-1)
  o = jnp.einsum("bkrts,bksd->btkrd", p, v.astype(F32))
  o = o.reshape(b, t, hq, d).astype(q.dtype)
  return o if q.ndim == 4 else o[:, 0]


def form_fn(name):
  if name == "xla_f32":
    return jax.jit(xla_f32)
  if name == "reference":
    return jax.jit(lambda *a: ops.decode_attention(
        *a, implementation="reference"))
  config = VARIANTS[name.split(":", 1)[1]]
  return jax.jit(lambda *a: ops.decode_attention(
      *a, implementation="pallas", config=config))


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
  ap.add_argument("--q_heads", type=int, default=16)
  ap.add_argument("--kv_heads", type=int, default=4)
  ap.add_argument("--head_dim", type=int, default=128)
  ap.add_argument("--window", type=int, default=0,
                  help="T > 0: a verify window of T queries per row")
  ap.add_argument("--sets", type=int, default=6)
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--config", default="configs/hybrid_1b.py")
  ap.add_argument("--copies", action="store_true",
                  help="also list the decode loop's HLO copies of >= 1 MiB")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()
  b, S, hq, hk, d = a.batch, a.max_len, a.q_heads, a.kv_heads, a.head_dim
  keys = jax.random.split(jax.random.PRNGKey(0), 4 * a.sets)
  sets = []
  t = max(a.window, 1)  # the first query sees lengths, the last + t - 1
  qshape = (b, a.window, hq, d) if a.window else (b, hq, d)
  for i in range(a.sets):
    q = jax.random.normal(keys[4 * i], qshape, jnp.bfloat16)
    k = jax.random.normal(keys[4 * i + 1], (b, hk, S, d), jnp.bfloat16)
    v = jax.random.normal(keys[4 * i + 2], (b, hk, S, d), jnp.bfloat16)
    lengths = jax.random.randint(keys[4 * i + 3], (b,), S // 2, S - t + 2)
    sets.append((q, k, v, lengths.astype(jnp.int32)))
  regimes = {"ragged": sets,
             "full": [(q, k, v, jnp.full((b,), S - t + 1, jnp.int32))
                      for q, k, v, _ in sets]}
  res = dict(command=" ".join(["python"] + sys.argv),
             date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                 timespec="seconds"),
             device=jax.devices()[0].device_kind, jax=jax.__version__,
             shapes=dict(batch=b, max_len=S, q_heads=hq, kv_heads=hk,
                         head_dim=d, window=a.window),
             cache_mib=2 * b * S * hk * d * 2 / 2**20,
             variants={n: repr(VARIANTS[n]) for n in a.variants.split(",")},
             forms={})
  names = ["xla_f32", "reference"] + [f"pallas:{n}"
                                      for n in a.variants.split(",")]
  for regime, data in regimes.items():
    q, k, v, n = data[0]
    ref = ops.decode_attention(q.astype(F32), k.astype(F32), v.astype(F32),
                               n, implementation="reference")
    valid_bytes = [2 * hk * d * 2 * float(jnp.sum(s[3] + t - 1))
                   for s in data]
    for name in names:
      fn = form_fn(name)
      try:
        err = float(jnp.max(jnp.abs(fn(*data[0]).astype(F32) - ref)) /
                    jnp.max(jnp.abs(ref)))
        us = timed(fn, data, a.iters)
      except Exception as e:  # pylint: disable=broad-except
        res["forms"][f"{name}/{regime}"] = dict(error=repr(e)[:2000])
        print(f"{name}/{regime}: FAILED {e!r}"[:400], flush=True)
        continue
      tb = statistics.mean(valid_bytes) / us / 1e6
      res["forms"][f"{name}/{regime}"] = dict(
          us=us, max_err_rel_to_max=err, tb_per_s=tb)
      print(f"{name + '/' + regime:24s} {us:8.1f} us  {tb:.2f} TB/s  "
            f"err {err:.2e}", flush=True)
  if a.copies:
    res["decode_loop_copies"] = copies(a.config, b)
    for mode, rows in res["decode_loop_copies"].items():
      print(f"== copies >= 1 MiB in the {mode} decode loop: {len(rows)}")
      for r in rows:
        print("  ", r)
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
