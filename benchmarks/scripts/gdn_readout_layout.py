"""The GDN state readouts alone, S^T k and S^T q, in the two layouts a
[key_dim, value_dim] state per (row, value head) can have: does the axis
the readout reduces over decide how close a Triton program gets to a
plain read of the state?

  kv  the state [batch, HV, K, V] (the models' and flash-linear-attention's
      layout, the project's): a program's tile [K, block_v] is reduced over
      its rows, across the program's warps (shared memory and barriers).
  vk  the transposed state [batch, HV, V, K]: the tile [block_v, K] is
      reduced along its contiguous rows, within each warp (shuffles only),
      as the Mamba-2 output route reduces its [headdim, dstate] tiles.

Each program loads its tile, q and k of its key head (f32, normalised
beforehand) and writes both readouts; XLA's einsum of each layout and a
plain read of the bytes (XLA's sum of their uint32 view) are timed beside
them. Every form is checked against the f32 einsum first (max |err| / max
|ref|), then timed as the median of (t(2n) - t(n)) / n over jitted loops
(the state, 268-1074 MB, is larger than the L2).

  PYTHONPATH=. python benchmarks/scripts/gdn_readout_layout.py \\
      --batches=256,64 --out=gdn_readout_layout.json
"""

import argparse
import functools
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from loop_timing import doubling_time  # pylint: disable=g-bad-import-order

F32 = jnp.float32
HV, HK, K, V = 32, 16, 128, 128


def _kernel(s_ref, q_ref, k_ref, o_ref, *, layout):
  s = s_ref[...].astype(F32)
  q, k = q_ref[...], k_ref[...]
  if layout == "kv":  # s [K, bv]
    o_ref[0, :] = jnp.sum(s * k[:, None], axis=0)
    o_ref[1, :] = jnp.sum(s * q[:, None], axis=0)
  else:  # s [bv, K]
    o_ref[0, :] = jnp.sum(s * k[None, :], axis=1)
    o_ref[1, :] = jnp.sum(s * q[None, :], axis=1)


@functools.partial(jax.jit, static_argnames=("layout", "block_v", "warps",
                                             "interpret"))
def pallas_readouts(S, q, k, *, layout, block_v, warps, interpret=False):
  """[batch, HV, 2, V] f32: (S^T k, S^T q) per value head, S in `layout`."""
  batch = S.shape[0]
  per_key = HV // HK
  if layout == "kv":
    tile = pl.BlockSpec((None, None, K, block_v),
                        lambda v, h, b: (b, h, 0, v))
  else:
    tile = pl.BlockSpec((None, None, block_v, K),
                        lambda v, h, b: (b, h, v, 0))
  vec = pl.BlockSpec((None, None, K), lambda v, h, b: (b, h // per_key, 0))
  return pl.pallas_call(
      functools.partial(_kernel, layout=layout),
      grid=(V // block_v, HV, batch),
      in_specs=[tile, vec, vec],
      out_specs=pl.BlockSpec((None, None, 2, block_v),
                             lambda v, h, b: (b, h, 0, v)),
      out_shape=jax.ShapeDtypeStruct((batch, HV, 2, V), F32),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret,
  )(S, q, k)


def xla_readouts(S, q, k, *, layout):
  qh, kh = (jnp.repeat(x, HV // HK, axis=1) for x in (q, k))
  spec = "bhkv,bhk->bhv" if layout == "kv" else "bhvk,bhk->bhv"
  Sf = S.astype(F32)
  hi = jax.lax.Precision.HIGHEST
  return jnp.stack([jnp.einsum(spec, Sf, kh, precision=hi),
                    jnp.einsum(spec, Sf, qh, precision=hi)], axis=2)


def plain_read(S):
  return jnp.sum(jax.lax.bitcast_convert_type(
      S.reshape(S.shape[0], -1, 4 // S.dtype.itemsize) if S.dtype.itemsize < 4
      else S, jnp.uint32))


def _time(fn, args, min_ms=20.0, repeats=7):
  """(µs per call, n) of fn(*args) (`loop_timing.doubling_time` over
  jitted loops of n calls)."""

  def loop(n):
    # The operands are the jitted loop's parameters (closed over, they
    # would be constants, and XLA folded the plain read's reduction of
    # them away), tied to the loop's carry by an optimization barrier so
    # that the call is not hoisted out of the loop either.
    def run(*a):
      def body(_, acc):
        acc, ops = jax.lax.optimization_barrier((acc, a))
        return acc + jnp.ravel(fn(*ops))[0].astype(F32)
      return jax.lax.fori_loop(0, n, body, F32(0))
    return functools.partial(jax.jit(run), *args)

  s, n = doubling_time(loop, min_ms=min_ms, repeats=repeats)
  return s * 1e6, n


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batches", default="256,64")
  ap.add_argument("--dtypes", default="float32,float16")
  ap.add_argument("--configs", default="64:4,128:4,128:8,32:2",
                  help="block_v:warps pairs")
  ap.add_argument("--small", action="store_true",
                  help="batch 2, interpret mode: the CPU check only")
  ap.add_argument("--out", default="gdn_readout_layout.json")
  a = ap.parse_args()
  interpret = a.small
  batches = [2] if a.small else [int(b) for b in a.batches.split(",")]
  configs = [tuple(int(x) for x in c.split(":")) for c in a.configs.split(",")]
  records = []
  t0 = time.time()
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
  except OSError:
    commit = ""
  meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
              date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              commit=commit, command=" ".join(sys.argv),
              shapes=dict(num_v_heads=HV, num_k_heads=HK, key_dim=K,
                          value_dim=V), records=records)

  def save():  # after every record: a run cut by its time limit keeps them
    meta["elapsed_s"] = time.time() - t0
    with open(a.out, "w") as f:
      json.dump(meta, f, indent=1)

  for batch in batches:
    for dt in a.dtypes.split(","):
      key = jax.random.PRNGKey(batch)
      ks = jax.random.split(key, 3)
      S_kv = jax.random.normal(ks[0], (batch, HV, K, V), F32).astype(dt)
      S_vk = jnp.swapaxes(S_kv, 2, 3)
      q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (
          jax.random.normal(kk, (batch, HK, K), F32) for kk in ks[1:]))
      ref = xla_readouts(S_kv, q, k, layout="kv")
      scale = float(jnp.max(jnp.abs(ref)))
      mb = S_kv.size * S_kv.dtype.itemsize / 1e6
      forms = [("plain_read", None, None, plain_read, (S_kv,))]
      for lay, S in (("kv", S_kv), ("vk", S_vk)):
        forms.append((f"xla_{lay}", None, None,
                      functools.partial(xla_readouts, layout=lay), (S, q, k)))
        for bv, w in configs:
          forms.append((f"pallas_{lay}", bv, w, functools.partial(
              pallas_readouts, layout=lay, block_v=bv, warps=w,
              interpret=interpret), (S, q, k)))
      for name, bv, w, fn, args in forms:
        rec = dict(batch=batch, dtype=dt, form=name, block_v=bv, warps=w,
                   state_mb=mb)
        try:
          out = fn(*args)
          if name != "plain_read":
            rec["rel_error"] = float(jnp.max(jnp.abs(out - ref))) / scale
          if not a.small:
            us, n = _time(fn, args)
            rec.update(us=us, loop_n=n, gb_s=mb * 1e-3 / (us * 1e-6))
        except Exception as e:  # pylint: disable=broad-except
          rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
        save()


if __name__ == "__main__":
  main()
