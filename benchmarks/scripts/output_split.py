"""The replay step per ReplayConfig variant, split by op.

kernel_bench times a whole step; this script says how much of it is each
kernel (output route, flush route) and how much the ops before them (e.g.
the window weights of `ReplayConfig.output_weights`). For each variant, on
the kernel_bench layer (nheads 128, headdim 64, dstate 128, ngroups 8,
bf16 activations and buffers) at one precision policy: every row holds `--fill`
buffered tokens (below L - 1: no row flushes; L - 1: every row does); one
step is checked against the reference (y, per-dtype tolerance), then a
jitted loop of `--steps` steps (each row's counter reset to the fill after
each step, so every step is the same kind) is traced with
`replayssm_jax.profiling.op_times`. Run it with XLA's CUDA graphs off so
the trace splits the loop:

  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. \\
      python benchmarks/scripts/output_split.py --policy f16+fp8 \\
      --variants default,dot,xw,xw_dot --out $OUT/output_split.json

One state set (the fp8 copy at batch 256 is 268 MB, past the 60 MB L2).
`--tiny` runs small shapes in interpret mode (a CPU check of the script).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import precision as prec
from replayssm_jax import profiling
from replayssm_jax import testing
import variant_loop  # benchmarks/scripts (the script's own folder)

# name -> ReplayConfig keyword arguments (None: the XLA reference op).
# Session 35 (H200, f16 + fp8, batch 256, non-flush route kernel; JSONs in
# benchmarks/output_split_h200_session35*.json, where "default" is the
# route forming its own weights, now "off"): default 112.5-114.6 µs, xw
# 111.4 (+ ~15 µs of XLA), xw_cap64 101.8-103.9, xwk_cap64 102.1 (+ 7.3 µs
# weights kernel; the default for 8-bit copies since), dot 150.8, cap64
# 136.4, hp2_pf 145.9, bp32 170.4, fma_c32 143.8.
# Session 36: "default" is the split output route for this state since
# 437dc83 ("triton" the single route with the weights kernel): non-flush
# readout 73.8 + window 22.4 µs against route 102.1 + weights 7.4.
VARIANTS = {
    "default": {},
    "triton": dict(output_route="triton"),
    "off": dict(output_route="triton", output_weights=False),
    "dot": dict(readout="dot"),
    "xw": dict(output_weights=True),
    "xw_dot": dict(output_weights=True, readout="dot"),
    "precompute_bc": dict(precompute_bc=True),
    "bc_dot": dict(precompute_bc=True, readout="dot"),
    # More state bytes in flight per SM: two / four heads' tiles loaded per
    # program before any math, fewer registers (more programs), smaller
    # tiles.
    "hp2_pf": dict(heads_per_program=2, output_prefetch=True),
    "hp4_pf_w4": dict(heads_per_program=4, output_prefetch=True,
                      num_warps=4),
    "xw_hp2_pf": dict(output_weights=True, heads_per_program=2,
                      output_prefetch=True),
    "cap64": dict(max_registers=64),
    "xw_cap64": dict(output_weights=True, max_registers=64),
    "bp32": dict(block_p=32),
    # The window weights by the small Pallas kernel, the route's registers
    # capped.
    "xwk": dict(output_weights="pallas"),
    "xwk_cap64": dict(output_weights="pallas", max_registers=64),
    "xwk_cap56": dict(output_weights="pallas", max_registers=56),
    "xwk_cap48": dict(output_weights="pallas", max_registers=48),
    # The readout's column blocks accumulated by PTX multiply-adds.
    "fma_c32": dict(readout_chunk=32, readout_fma=True),
    "fma_c64": dict(readout_chunk=64, readout_fma=True),
    "xwk_cap64_fma_c32": dict(output_weights="pallas", max_registers=64,
                              readout_chunk=32, readout_fma=True),
    # The weights kernel's launch (replay.WEIGHTS_LAUNCH, set per variant
    # by LAUNCH below) on the Triton route. Session 36 (non-flush
    # / all-rows flush step, weights kernel alone): masked loads 7.3 / 9.0
    # µs, skipping flush rows (the default since) - / 2.2, unmasked 8.1 /
    # -, unmasked skipping 8.5 / -, unmasked at 4 warps 11.5 / -.
    "wk_noskip": dict(output_route="triton"),
    "wk_unmasked": dict(output_route="triton"),
    "wk_unmasked_w4": dict(output_route="triton"),
    # Fewer output programs (the flush step's programs exit at once, 20.7
    # µs for 32768): two heads' tiles per program, at the default's 64
    # registers. Session 36, 4 warps with both tiles loaded first: the
    # route 153.6 µs non-flush (against 102.4), 10.8 in the flush step.
    "xwk_cap64_hp2_pf_w4": dict(output_weights="pallas", max_registers=64,
                                heads_per_program=2, output_prefetch=True,
                                num_warps=4),
    # ... 2 warps, one head after the other (ptxas offline: 100 B spilled).
    "xwk_cap64_hp2": dict(output_weights="pallas", max_registers=64,
                          heads_per_program=2),
    # The flush route at 8 warps, 128 registers (2 programs per SM; ptxas
    # offline: no spills, 1152 SASS instructions against 1440 at 4 warps
    # and 168). Session 36's policies study: flush step 775 against 532 µs.
    "flush_w8": dict(flush_num_warps=8, flush_max_registers=128),
    # The flush route's register cap at 4 warps: 4 programs per SM at 128
    # and below (3 at 168, 5 at 96). ptxas offline on f16 + fp8 with y
    # read out before the stores: 60 / 40 / 8 / 192 B spilled at 168 /
    # 128 / 120 / 96 (16 / 184 / 320 / - with the stores first). Session
    # 36, the flush kernel: 527 / 514 / 470 / - µs, 488 at 112 (120: the
    # default since).
    "flush_c168": dict(flush_max_registers=168),
    "flush_c128": dict(flush_max_registers=128),
    "flush_c112": dict(flush_max_registers=112),
    "flush_c96": dict(flush_max_registers=96),
    # The next item's loads issued ahead at 168 (ptxas offline: 32 B
    # spilled, 3 programs per SM).
    "flush_c168_pf": dict(flush_max_registers=168, flush_prefetch=True),
    # The split output route (output_route="split"): the readout kernel,
    # then the (group, row) window kernel; launches per LAUNCH below.
    "split": dict(output_route="split"),
    "split_noskip": dict(output_route="split"),
    "split_w8": dict(output_route="split"),
    "split_h8": dict(output_route="split"),
    "split_h4": dict(output_route="split"),
    "split_h4_w4": dict(output_route="split"),
    "split_h2": dict(output_route="split"),
    "reference": None,
}
# name -> {module-level launch dict of pallas_kernels.replay: its fields
# for the variant} (the others keep their defaults).
LAUNCH = {
    "wk_noskip": dict(WEIGHTS_LAUNCH=dict(skip_flush=False)),
    "wk_unmasked": dict(WEIGHTS_LAUNCH=dict(unmasked=True)),
    "wk_unmasked_w4": dict(WEIGHTS_LAUNCH=dict(unmasked=True, num_warps=4)),
    "split_noskip": dict(READOUT_LAUNCH=dict(skip=False)),
    "split_w8": dict(WINDOW_LAUNCH=dict(num_warps=8)),
    "split_h8": dict(WINDOW_LAUNCH=dict(heads=8)),
    "split_h4": dict(WINDOW_LAUNCH=dict(heads=4, num_warps=2)),
    "split_h4_w4": dict(WINDOW_LAUNCH=dict(heads=4)),
    "split_h2": dict(WINDOW_LAUNCH=dict(heads=2, num_warps=2)),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--fill", type=int, default=7,
                  help="buffered tokens per row (kernel_bench: (L-2)//2)")
  ap.add_argument("--steps", type=int, default=32)
  ap.add_argument("--policy", default="f16+fp8")
  ap.add_argument("--variants", default="default,dot,xw,xw_dot")
  ap.add_argument("--out", default="output_split.json")
  ap.add_argument("--tiny", action="store_true", help="CPU check")
  a = ap.parse_args()
  unknown = set(a.variants.split(",")) - set(VARIANTS)
  if unknown:
    ap.error(f"--variants: unknown {sorted(unknown)}; known: "
             f"{', '.join(VARIANTS)}")
  b, h, p, n, g = a.batch, 128, 64, 128, 8
  if a.tiny:
    b, h, p, n, g, a.steps = 3, 4, 16, 16, 2, 2
  L = a.buffer_len
  if not 0 <= a.fill <= L - 1:
    ap.error(f"--fill must be in [0, {L - 1}] ({L - 1}: every row flushes "
             f"every step), got {a.fill}.")
  policy = prec.PrecisionPolicy.preset(a.policy) if a.policy else None
  params = testing.random_params(jax.random.PRNGKey(0), h)
  counts = np.full(b, a.fill, np.int32)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(1), b, h, p, n, g, L, counts, params["A"],
      checkpoint_dtype=policy.checkpoint_dtype if policy else jnp.float16,
      buffer_dtype=jnp.bfloat16)
  if policy is not None:
    rstate = rstate.with_policy(policy)
  tok = testing.random_step_inputs(jax.random.PRNGKey(2), b, h, p, n, g,
                                   jnp.bfloat16, with_z=False)
  del tok["z"]
  kw = dict(A=params["A"], D=params["D"], dt_bias=params["dt_bias"],
            dt_softplus=True, policy=policy)
  want_y, _ = rs.replay_state_update(rstate, **tok, **kw,
                                     implementation="reference")
  # The kernel and the reference read the same state (the read copy where
  # there is one): only y's bf16 rounding and the summation order differ.
  tol = testing.tolerance(jnp.bfloat16)
  res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             shape=dict(batch=b, nheads=h, headdim=p, dstate=n, ngroups=g,
                        buffer_len=L, fill=a.fill, policy=a.policy or None,
                        buffers="bfloat16", act="bfloat16"),
             steps=a.steps, variants={})
  c0 = rstate.count

  launch0 = {k: dict(getattr(pk.replay_kernel, k))
             for k in ("WEIGHTS_LAUNCH", "READOUT_LAUNCH", "WINDOW_LAUNCH")}

  def measure(name, r, config, impl):
    for k, v in launch0.items():
      launch = getattr(pk.replay_kernel, k)
      launch.clear()
      launch.update(v, **LAUNCH.get(name, {}).get(k, {}))
      r[k.lower()] = dict(launch)
    jax.clear_caches()  # the launches are read at trace time
    y, _ = rs.replay_state_update(rstate, **tok, **kw, implementation=impl,
                                  config=config)
    r["max_rel_err_y"] = testing.max_rel_error(y, want_y)
    testing.assert_close(y, want_y, tol, f"{name} y")
    r["check"] = "PASS"

    @jax.jit
    def loop(st, tok):
      def body(_, carry):
        st, acc = carry
        y, st = rs.replay_state_update(st, **tok, **kw, implementation=impl,
                                       config=config)
        return st.replace(count=c0), acc + y[0, 0, 0].astype(jnp.float32)
      return jax.lax.fori_loop(0, a.steps, body, (st, jnp.float32(0)))

    t = profiling.op_times(loop, rstate, tok, iters=3)
    r["wall_us_per_step"] = 1e3 * t["wall_ms"] / a.steps
    r["device_us_per_step"] = 1e3 * t["device_ms"] / a.steps
    r["by_category_us"] = {k: 1e3 * v / a.steps
                           for k, v in t["by_category"].items()}
    r["top"] = [dict(o, us=1e3 * o.pop("ms") / a.steps)
                for o in t["top"][:8]]

  variant_loop.run(a.variants.split(","), VARIANTS, pk.ReplayConfig, measure, res,
                   a.out)

if __name__ == "__main__":
  main()
