"""Poisoned stale slots and verify-window causality on the GPU kernels, at
the sizes where the default routes differ from the CPU tests' (the Mosaic
flush of a plain f32 checkpoint at batch >= 128, the split output route of
an 8-bit read copy at >= 256 x 128 (row, head) pairs), plus the step and
verify times of two source trees side by side.

  python benchmarks/scripts/poisoned_inputs_gpu.py --out=result.json \
      [--time_trees=old_tree,new_tree]

Correctness (this tree): every stale buffer slot poisoned (x NaN, B inf, dt
NaN, as `testing.random_replay_state`) against the same state with zeros
there; the kernels' outputs must be finite and equal the reference's, the
poisoned run bit-identical to the clean one. Causality: NaN in x, B or dt
at window position 2 leaves positions 0-1 bit-identical.

Timing (--time_trees): each tree's `replay_state_update` and
`replay_verify` (T 4) at batch 256, L 16, hybrid_1b's layer shape, in a
subprocess per tree; medians of 200 steps after 20 warm-up steps, over 6
state copies (> the 60 MB L2) in rotation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

B, H, P, N, G, L, T = 256, 64, 64, 128, 8, 16, 4
if os.environ.get("POISON_SMALL"):  # a CPU smoke run (interpret mode)
  B, H, P, N, G = 10, 4, 16, 16, 2


def _case(name, checkpoint_dtype, policy, seed):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import replayssm_jax as rs
  from replayssm_jax import precision as prec
  from replayssm_jax import testing
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  counts = np.array([(7 * r + 3) % L for r in range(B)])
  counts[::5] = L - 1  # flush rows
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"],
      checkpoint_dtype=checkpoint_dtype, buffer_dtype=jnp.bfloat16)
  if policy is not None:
    pol = prec.PrecisionPolicy.preset(policy)
    rstate = rstate.with_policy(pol)
  clean = testing.fill_stale_slots(rstate, 0.0)
  tok = testing.random_step_inputs(jax.random.fold_in(key, 2), B, H, P, N, G,
                                   jnp.bfloat16)
  win = testing.random_step_inputs(jax.random.fold_in(key, 3), B, H, P, N, G,
                                   jnp.bfloat16, seqlen=T)
  return name, params, rstate, clean, tok, win, rs, np


def check():
  import jax
  import jax.numpy as jnp
  from replayssm_jax import testing
  results = []
  for name, ck, pol, seed in (("f32", jnp.float32, None, 0),
                              ("f16", jnp.float16, None, 1),
                              ("f16+fp8", None, "f16+fp8", 2),
                              ("f32+fp8", None, "f32+fp8", 3)):
    if pol is not None:
      ck = jnp.float16 if name.startswith("f16") else jnp.float32
    name, params, poisoned, clean, tok, win, rs, np = _case(name, ck, pol,
                                                            seed)
    kw = dict(**params, dt_softplus=True)
    for op in ("step", "verify"):
      def run(state, inputs, impl):
        if op == "step":
          f = jax.jit(lambda s: rs.replay_state_update(
              s, **inputs, **kw, implementation=impl))
        else:
          f = jax.jit(lambda s: rs.replay_verify(
              s, **inputs, **kw, implementation=impl))
        return np.asarray(f(state)[0], np.float32)
      inputs = tok if op == "step" else win
      y_ref = run(clean, inputs, "reference")
      y_clean = run(clean, inputs, "pallas")
      y = run(poisoned, inputs, "pallas")
      rec = dict(case=name, op=op, finite=bool(np.isfinite(y).all()),
                 bit_identical_to_clean=bool(
                     (y.view(np.uint32) == y_clean.view(np.uint32)).all()))
      try:
        testing.assert_close(y, y_ref, testing.tolerance("bfloat16", ck),
                             f"{name} {op}")
        rec["matches_reference"] = True
      except AssertionError as e:
        rec["matches_reference"] = False
        rec["error"] = str(e)[:300]
      if op == "verify":
        for field in ("x", "B", "dt"):
          bad = dict(win, **{field: win[field].at[:, 2].set(jnp.nan)})
          yb = run(clean, bad, "pallas")
          rec[f"causal_{field}"] = bool(
              (yb[:, :2].view(np.uint32) == y_clean[:, :2].view(
                  np.uint32)).all() and np.isnan(yb[:, 2]).any())
      rec["pass"] = all(v for k, v in rec.items()
                        if k not in ("case", "op", "error"))
      print(rec, flush=True)
      results.append(rec)
  return results


def time_tree():
  """Run inside a tree (cwd): prints a JSON line of medians in µs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import replayssm_jax as rs
  from replayssm_jax import testing
  out = {}
  for name, ck in (("f32", jnp.float32), ("f16", jnp.float16)):
    key = jax.random.PRNGKey(0)
    params = testing.random_params(key, H)
    counts = np.array([(7 * r + 3) % L for r in range(B)])
    states = [testing.random_replay_state(
        jax.random.fold_in(key, i), B, H, P, N, G, L, counts, params["A"],
        checkpoint_dtype=ck, buffer_dtype=jnp.bfloat16)[0] for i in range(6)]
    tok = testing.random_step_inputs(key, B, H, P, N, G, jnp.bfloat16)
    win = testing.random_step_inputs(key, B, H, P, N, G, jnp.bfloat16,
                                     seqlen=T)
    kw = dict(**params, dt_softplus=True)
    ops = dict(
        step=jax.jit(lambda s: rs.replay_state_update(s, **tok, **kw),
                     donate_argnums=0),
        verify=jax.jit(lambda s: rs.replay_verify(s, **win, **kw)[1],
                       donate_argnums=0))
    for op, f in ops.items():
      sts = [jax.tree.map(jnp.copy, s) for s in states]

      def again(r):  # the next call's state
        if op == "step":
          return r[1]
        # The verify's pending state drops its window (count unchanged)
        # to be verified again.
        return (r.replace(pending_window=None)
                if hasattr(r, "pending_window") else r)

      for i in range(20):  # warm-up
        sts[i % 6] = again(f(sts[i % 6]))
      jax.block_until_ready(sts)
      times = []
      for _ in range(7):  # calls dispatched back to back, blocked at the end
        t0 = time.perf_counter()
        for i in range(60):
          sts[i % 6] = again(f(sts[i % 6]))
        jax.block_until_ready(sts)
        times.append((time.perf_counter() - t0) / 60 * 1e6)
      out[f"{name}_{op}_us"] = float(np.median(times))
  print("TIMES " + json.dumps(out), flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="poisoned_inputs_gpu.json")
  ap.add_argument("--time_trees", default="")
  ap.add_argument("--mode", default="check", choices=("check", "time"))
  a = ap.parse_args()
  if a.mode == "time":
    time_tree()
    return
  import jax
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             checks=check(), times={})
  for tree in filter(None, a.time_trees.split(",")):
    p = subprocess.run([sys.executable, os.path.abspath(__file__),
                        "--mode=time"], cwd=tree, capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=tree),
                       check=False)
    line = [x for x in p.stdout.splitlines() if x.startswith("TIMES ")]
    res["times"][tree] = (json.loads(line[0][6:]) if line
                          else {"error": p.stderr[-2000:]})
    print(tree, res["times"][tree], flush=True)
  res["all_pass"] = all(r["pass"] for r in res["checks"])
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)
  print("ALL PASS" if res["all_pass"] else "SOME FAILED")


if __name__ == "__main__":
  main()
