"""Speculative verify kernel: VerifyConfig variants, checked and split.

The per-kernel split of a spec-decoding iteration (`run_h200.sh
profile_kernels`, session 7) put the verify window kernel at 0.45 ms per
layer for hybrid_1b's Mamba layers at batch 256, T 4, where the replay
step's output route reads the same checkpoint in 0.14 ms. This script
times `pallas_kernels.VerifyConfig` variants on those shapes: each is first
checked against `replay_verify_reference` (outputs and committed state,
per-dtype tolerance), then a jitted loop of `--steps` verify + commit
iterations (2 accepted per row: rows fold when their window stops
fitting, as in decoding) is traced with `replayssm_jax.profiling.op_times`
and each kernel's time per iteration is reported, with the loop's wall
time. Run it with XLA's CUDA graphs off so the trace splits the loop:

  XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. \\
      python benchmarks/scripts/verify_sweep.py --out $OUT/verify_sweep.json

`--policy` (a precision preset, e.g. f32+fp8) gives the state a read copy
(stored from its master; row ids and steps with stochastic rounding) and
runs every variant under it, checked against the reference under the same
policy: the form that times `VerifyConfig.copy_readout`.

`--tiny` runs small shapes in interpret mode (a CPU check of the script).
`--check_only` runs each variant once (its check against the reference)
and times nothing: the form to run under Nsight Compute
(`run_h200.sh ncu_verify`).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from replayssm_jax import precision as prec
from replayssm_jax import profiling
from replayssm_jax import speculative as spec
from replayssm_jax import testing
import variant_loop  # benchmarks/scripts (the script's own folder)

# name -> VerifyConfig keyword arguments (None: the XLA reference op).
# Sessions 7-10 (benchmarks/verify_sweep_h200.json): B.C precomputed by
# XLA reductions at block_p 32 with the readouts over 32-column blocks
# (the default) fastest; the B.C einsums ("bc", a GEMM fusion), block_p
# 16 / 64, 2 and 8 warps, the readout dots, XLA's readout and
# whole-dstate reductions slower; the window outputs as small dots and the
# recurrent window form (both since removed) slower; session 29: the
# positions as a tile axis (removed) slower; session 31: every term but the
# readouts by XLA reductions ("terms_reduce", now the default, so
# "default" and the unnamed fields below run it) faster.
VARIANTS = {
    "default": {},
    "bp64": dict(block_p=64),
    "bp16": dict(block_p=16),
    "w2": dict(num_warps=2),
    "bp64_w8": dict(block_p=64, num_warps=8),
    "none": dict(precompute="none"),
    "none_bp64": dict(precompute="none", block_p=64),
    "terms": dict(precompute="terms"),
    "terms_bp64": dict(precompute="terms", block_p=64),
    "terms_bp16": dict(precompute="terms", block_p=16),
    "dot": dict(readout="dot_tf32x3"),
    "dot_f32": dict(readout="dot_f32"),
    "dot_bp64": dict(readout="dot_tf32x3", block_p=64),
    "terms_dot": dict(precompute="terms", readout="dot_tf32x3"),
    "xla": dict(readout="xla"),
    "xla_bp64": dict(readout="xla", block_p=64),
    "xla_w2": dict(readout="xla", num_warps=2),
    "xla_terms": dict(precompute="terms", readout="xla"),
    "whole": dict(readout_chunk=None),
    "chunk16": dict(readout_chunk=16),
    "chunk64": dict(readout_chunk=64),
    "chunk16_bp64": dict(readout_chunk=16, block_p=64),
    "chunk16_terms": dict(readout_chunk=16, precompute="terms"),
    "bc_einsum": dict(precompute="bc"),
    # The early flush as exact f32 rank-1 updates with scalar weights
    # (session 12), at 2 and 4 warps.
    "fold_rank1": dict(fold="rank1"),
    "fold_rank1_w4": dict(fold="rank1", fold_num_warps=4),
    # The early flush's dot as bf16 dots of x with the weighted B in 3
    # bf16 pieces (session 13), at 2 and 4 warps.
    "fold_bf16x3": dict(fold="dot_bf16x3"),
    "fold_bf16x3_w4": dict(fold="dot_bf16x3", fold_num_warps=4),
    # The early-flush fold at 4 warps (its warps before session 11) with
    # its registers capped (as the replay flush since session 15), and
    # uncapped.
    "fold_w4": dict(fold_num_warps=4),
    "fold_w4c128": dict(fold_num_warps=4, fold_max_registers=128),
    # A read-copy state's window readout as one branch per program on the
    # row's fold instead of two masked loads (with --policy; session 28).
    "copy_branch": dict(copy_readout="branch"),
    # The window kernel's registers capped (session 29).
    "cap64": dict(max_registers=64),
    "cap80": dict(max_registers=80),
    "cap96": dict(max_registers=96),
    # One warp per program (half the default's instructions per tile
    # offline, 255 registers uncapped), capped, and at block_p 16: 0.35-0.42
    # ms against 0.264 (session 30, sweep 19).
    "w1": dict(num_warps=1),
    "w1_cap168": dict(num_warps=1, max_registers=168),
    "terms_w1": dict(precompute="terms", num_warps=1),
    "w1_bp16": dict(num_warps=1, block_p=16),
    # Session 31 (sweep 20): the terms by XLA reductions ("terms_reduce",
    # now the default) against the B.C products by XLA reductions (the
    # default before); C converted to f32 by XLA (since removed) was slower.
    "bc_reduce": dict(precompute="bc_reduce"),
    "terms_reduce_cap80": dict(max_registers=80),
    # Session 32: the readouts' column blocks accumulated by PTX
    # multiply-adds (XLA's Triton leaves most mul + add pairs unfused), at
    # the default 32 columns and at 16 / 64 (with fused accumulation a
    # narrower block costs fewer instructions per position).
    "fma": dict(readout_fma=True),
    "fma_chunk16": dict(readout_fma=True, readout_chunk=16),
    "fma_chunk64": dict(readout_fma=True, readout_chunk=64),
    # Session 33 (sweep 22): fma 0.218 ms against 0.224 without (now the
    # default, so "default" and the unnamed fields run it; "nofma" is the
    # default before), fma_chunk16 0.235; the readouts as bf16 dots of the
    # f32 tile split in pieces (since removed) 0.250-0.438.
    "nofma": dict(readout_fma=False),
    "reference": None,  # the XLA reference op (implementation="reference")
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--nheads", type=int, default=64)
  ap.add_argument("--headdim", type=int, default=64)
  ap.add_argument("--dstate", type=int, default=128)
  ap.add_argument("--ngroups", type=int, default=8)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--window", type=int, default=4)
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--out", default="verify_sweep.json")
  ap.add_argument("--policy", default="",
                  help="precision preset of the state (default: none)")
  ap.add_argument("--tiny", action="store_true", help="CPU check")
  ap.add_argument("--check_only", action="store_true",
                  help="one checked call per variant, no timing (for ncu)")
  a = ap.parse_args()
  unknown = set(a.variants.split(",")) - set(VARIANTS)
  if unknown:
    ap.error(f"--variants: unknown {sorted(unknown)}; known: "
             f"{', '.join(VARIANTS)}")
  if a.tiny:
    a.batch, a.nheads, a.headdim, a.dstate, a.ngroups = 3, 4, 16, 16, 2
    a.steps = 2
  b, h, p, n, g, L, T = (a.batch, a.nheads, a.headdim, a.dstate, a.ngroups,
                         a.buffer_len, a.window)
  key = jax.random.PRNGKey(0)
  params = testing.random_params(key, h)
  counts = np.arange(b) % (L - T + 1)  # ragged histories, some fold
  policy = (prec.PrecisionPolicy.preset(a.policy).replace(
      buffer_dtype="bfloat16") if a.policy else None)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(1), b, h, p, n, g, L, counts, params["A"],
      checkpoint_dtype=policy.checkpoint_dtype if policy else jnp.float32,
      buffer_dtype=jnp.bfloat16)
  if policy is not None and policy.read_dtype is not None:
    rstate = rstate.replace(**dict(zip(
        ("read_copy", "read_scale"),
        prec.store(rstate.checkpoint.astype(jnp.float32),
                   policy.read_dtype))))
  if policy is not None and policy.stochastic_rounding:
    rstate = rstate.replace(row_id=jnp.arange(b, dtype=jnp.int32),
                            step=jnp.asarray(counts, jnp.int32))
  win = testing.random_step_inputs(jax.random.PRNGKey(2), b, h, p, n, g,
                                   jnp.bfloat16, with_z=False, seqlen=T)
  del win["z"]
  accepted = jnp.full((b,), 2, jnp.int32)
  kw = dict(A=params["A"], D=params["D"], dt_bias=params["dt_bias"],
            dt_softplus=True, policy=policy)
  want_y, want_st = spec.replay_verify_reference(rstate, **win, **kw)
  want_st = spec.replay_commit(want_st, accepted, T)
  tol = testing.tolerance(jnp.bfloat16)
  res = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             shape=dict(batch=b, nheads=h, headdim=p, dstate=n, ngroups=g,
                        buffer_len=L, window=T,
                        checkpoint=str(rstate.checkpoint.dtype),
                        policy=a.policy or None,
                        buffers="bfloat16", act="bfloat16"),
             steps=a.steps, date=time.strftime("%Y-%m-%d"), variants={})

  def measure(name, r, config, impl):
    y, st = spec.replay_verify(rstate, **win, **kw, implementation=impl,
                               config=config)
    st = spec.replay_commit(st, accepted, T)
    r["max_rel_err_y"] = testing.max_rel_error(y, want_y)
    r["max_rel_err_checkpoint"] = testing.max_rel_error(
        st.checkpoint, want_st.checkpoint)
    testing.assert_close(y, want_y, tol, f"{name} y")
    testing.assert_close(st.checkpoint, want_st.checkpoint, tol,
                         f"{name} checkpoint")
    r["check"] = "PASS"
    if a.check_only:
      return

    @jax.jit
    def loop(rs, win):
      def body(_, rs):
        _, rs = spec.replay_verify(rs, **win, **kw, implementation=impl,
                                   config=config)
        return spec.replay_commit(rs, accepted, T)
      return jax.lax.fori_loop(0, a.steps, body, rs)

    t = profiling.op_times(loop, rstate, win, iters=3)
    r["loop_wall_ms_per_iter"] = t["wall_ms"] / a.steps
    r["device_ms_per_iter"] = t["device_ms"] / a.steps
    kernels = {}
    for o in t["top"]:
      if o["category"] == "pallas":
        kernels.setdefault(o["kernel"], 0.0)
        kernels[o["kernel"]] += o["ms"] / a.steps
    r["pallas_ms_per_iter"] = kernels
    r["top"] = [dict(o, ms=o["ms"] / a.steps) for o in t["top"][:8]]

  variant_loop.run(a.variants.split(","), VARIANTS, pk.VerifyConfig, measure, res,
                   a.out)

if __name__ == "__main__":
  main()
