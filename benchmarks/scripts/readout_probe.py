"""How fast can a kernel read an 8-bit state out, y0 = S C, alone?

The f16 + fp8 output route (the readout plus the window terms and the
appends) takes ~102 µs at batch 256 for ~300 MB, ~72% of the copy
bandwidth; the f16 checkpoint's route runs at ~90%. This probe times the
bare readout of the Nemotron-H 8B layer's state (batch 256, 128 heads,
headdim 64, dstate 128, 8 groups) in a state dtype, by

* `pallas_kernels.mosaic_gpu.readout` (TMA-pipelined: `heads_per_program`
  heads per CTA, `max_concurrent_steps` tiles in flight), per config;
* a minimal Triton kernel (one [64, 128] tile per program, no window,
  no counter): the Triton route's floor at its launch shape.

Each is checked against an f32 einsum (per-dtype tolerance), then a jitted
loop of `--steps` readouts is traced (`replayssm_jax.profiling.op_times`,
XLA's CUDA graphs off) and the kernel's device time per call recorded.

  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. \\
      python benchmarks/scripts/readout_probe.py --out $OUT/readout.json

`--tiny` runs small shapes in interpret mode (a CPU check of the script).
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import mosaic_gpu
from replayssm_jax import profiling
from replayssm_jax import testing

F32 = jnp.float32


def _triton_readout_kernel(s_ref, c_ref, y_ref, *, per_group):
  h, b = pl.program_id(0), pl.program_id(1)
  s = s_ref[b, h].astype(F32)  # [P, N]
  c = c_ref[b, h // per_group].astype(F32)  # [N]
  y_ref[b, h] = jnp.sum(s * c[None, :], axis=1)


def triton_readout(state, C, *, num_warps=2, interpret=False):
  batch, nheads, headdim, _ = state.shape
  return pl.pallas_call(
      functools.partial(_triton_readout_kernel,
                        per_group=nheads // C.shape[1]),
      grid=(nheads, batch),
      out_shape=jax.ShapeDtypeStruct((batch, nheads, headdim), F32),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps),
      interpret=interpret, name="probe_triton_readout")(state, C)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dtypes", default="float8_e4m3fn,float16")
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--mosaic", default="1x2,2x2,4x2,8x2,8x3,8x4,16x3,16x4",
                  help="heads_per_program x max_concurrent_steps")
  ap.add_argument("--out", default="readout_probe.json")
  ap.add_argument("--tiny", action="store_true", help="CPU check")
  a = ap.parse_args()
  b, h, p, n, g = 256, 128, 64, 128, 8
  interpret = a.tiny
  if a.tiny:
    b, h, p, n, g, a.steps = 2, 16, 64, 128, 2, 2
  res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             shape=dict(batch=b, nheads=h, headdim=p, dstate=n, ngroups=g),
             steps=a.steps, runs={})
  kc, ks = jax.random.split(jax.random.PRNGKey(0))
  C = jax.random.normal(kc, (b, g, n), jnp.bfloat16)
  variants = {"triton_w2": functools.partial(triton_readout, num_warps=2),
              "triton_w4": functools.partial(triton_readout, num_warps=4)}
  for spec in a.mosaic.split(","):
    hpp, mcs = map(int, spec.split("x"))
    variants[f"mosaic_{spec}"] = functools.partial(
        mosaic_gpu.readout, config=mosaic_gpu.MosaicSSUConfig(
            heads_per_program=hpp, max_concurrent_steps=mcs))
  for dname in a.dtypes.split(","):
    dtype = jnp.dtype(dname)
    state = (4 * jax.random.normal(ks, (b, h, p, n), F32)).astype(dtype)
    want = jnp.einsum("bhpn,bhn->bhp", state.astype(F32),
                      jnp.repeat(C.astype(F32), h // g, axis=1),
                      precision=jax.lax.Precision.HIGHEST)
    for name, fn in variants.items():
      r = dict(dtype=dname)
      try:
        f = functools.partial(fn, interpret=interpret)
        got = jax.jit(f)(state, C)
        r["max_rel_err"] = testing.max_rel_error(got, want)
        testing.assert_close(got, want, testing.tolerance(F32), name)

        @jax.jit
        def loop(s, c):
          def body(_, acc):
            return acc + f(s, c)[0, 0, 0]
          return jax.lax.fori_loop(0, a.steps, body, jnp.float32(0))

        t = profiling.op_times(loop, state, C, iters=3)
        # On the GPU the readout is the loop's longest op by far.
        r["top"] = [dict(kernel=o["kernel"], us=1e3 * o["ms"] / a.steps)
                    for o in t["top"][:3]]
        r["us_per_call"] = r["top"][0]["us"]
        r["gbps"] = state.nbytes / (r["us_per_call"] * 1e-6) / 1e9
      except Exception as e:  # pylint: disable=broad-except
        r["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
      res["runs"][f"{dname}:{name}"] = r
      print(dname, name, r, flush=True)
  with open(a.out, "w") as fh:
    json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
