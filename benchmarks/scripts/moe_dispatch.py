"""The routed-expert dispatches of `replayssm_jax.models.moe` at Nemotron 3
Nano's MoE shapes (128 experts of 2688 -> 1856 -> 2688, relu2, top 6,
sigmoid router with correction bias, bf16 weights): correctness against the
dense reference and time per layer, per number of tokens.

  python benchmarks/scripts/moe_dispatch.py --out=moe_dispatch.json \
      [--tokens=1,64,256,1024] [--router_bias_std=0] [--small]

Per token count n (a decode step of batch n, or batch n / T verify windows
of T tokens): the router picks experts for random hidden states (its
correction bias random with std --router_bias_std: 0 balances the load
as a trained bias aims to, larger values send most tokens to a few
experts); each dispatch ("gather", "capacity", "sorted") is checked
against `routed_experts_reference` (relative error of the output, max
|error| / max |reference|) and timed as one jitted `lax.scan` over LAYERS
layers, each with its own weights (rotated past the L2 cache) and its
own random input, median of CALLS calls after a warm-up, in µs per layer.
Each record also gives the first layer's largest expert group and the
capacity dispatch's slots per expert.
"gather" is skipped where its gathered weights would exceed GATHER_MAX_GB.
`--small` shrinks the shapes to run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
LAYERS, CALLS, GATHER_MAX_GB = 6, 7, 12.0


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="moe_dispatch.json")
  ap.add_argument("--tokens", default="1,64,256,1024")
  ap.add_argument("--router_bias_std", type=float, default=0.0)
  ap.add_argument("--small", action="store_true")
  a = ap.parse_args()
  sys.path.insert(0, ROOT)
  from replayssm_jax.models import moe as MOE  # pylint: disable=g-import-not-at-top
  from replayssm_jax.testing import max_rel_error  # pylint: disable=g-import-not-at-top
  e, k, d, f = (8, 2, 64, 48) if a.small else (128, 6, 2688, 1856)
  dt = jnp.bfloat16
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  up = (jax.random.normal(keys[0], (LAYERS, e, d, f), dt) * d ** -0.5)
  down = (jax.random.normal(keys[1], (LAYERS, e, f, d), dt) * f ** -0.5)
  router = jax.random.normal(keys[2], (LAYERS, d, e), jnp.float32) * d ** -.5
  bias = jax.random.normal(keys[3], (LAYERS, e),
                           jnp.float32) * a.router_bias_std
  jax.block_until_ready((up, down))
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             date=time.strftime("%Y-%m-%d"),
             shapes=dict(experts=e, top_k=k, d=d, inter=f, layers=LAYERS,
                         weight_dtype="bfloat16",
                         router_bias_std=a.router_bias_std), records=[])

  weights = (up, down, router, bias)

  # The weights are jit arguments (as closed-over constants they would be
  # compiled into the program).
  def layer(x, wts, i, dispatch):
    up, down, router, bias = wts
    w, idx = MOE.route(x.astype(jnp.float32) @ router[i], top_k=k,
                       bias=bias[i], routed_scaling_factor=2.5)
    if dispatch == "experts":
      return idx
    if dispatch == "reference":
      return MOE.routed_experts_reference(x, w, idx, up[i], down[i], "relu2")
    return MOE.routed_experts(x, w, idx, up[i], down[i], "relu2", dispatch)

  def stack(dispatch):
    def run(xs, wts):
      def body(_, xi):
        return None, layer(xi[0], wts, xi[1], dispatch)
      return jax.lax.scan(body, None, (xs, jnp.arange(LAYERS)))[1]
    return jax.jit(run)

  first = jax.jit(layer, static_argnums=(2, 3))
  for n in map(int, a.tokens.split(",")):
    xs = jax.random.normal(jax.random.fold_in(keys[4], n), (LAYERS, n, d),
                           dt)
    x = xs[0]
    ref = first(x, weights, 0, "reference")
    load = int(np.bincount(np.asarray(first(x, weights, 0, "experts")).ravel(),
                           minlength=e).max())
    for dispatch in ("gather", "capacity", "sorted"):
      gathered_gb = n * k * 2 * d * f * 2 / 1e9
      if dispatch == "gather" and gathered_gb > GATHER_MAX_GB:
        continue
      err = max_rel_error(first(x, weights, 0, dispatch), ref)
      fn = stack(dispatch)
      jax.block_until_ready(fn(xs, weights))
      times = []
      for _ in range(CALLS):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(xs, weights))
        times.append((time.perf_counter() - t0) / LAYERS * 1e6)
      rec = dict(tokens=n, dispatch=dispatch, rel_error=err,
                 largest_group=load,
                 capacity=min(MOE.expert_capacity(n, k, e), n),
                 us_per_layer=float(np.median(times)), times_us=times)
      print(rec, flush=True)
      res["records"].append(rec)
      with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
  main()
