"""A few GDN decode steps for Nsight Compute (run under `ncu -k
regex:replayssm_gdn`): a Qwen3.5-shaped layer (32 value heads, 16 key
heads, key_dim = value_dim = 128, bf16 q / k / v), one baseline step
(Pallas, `--checkpoint` state), then one replay step per `--configs` entry
(a JSON list of `pallas_kernels.gdn.GDNConfig` fields) with counts
arange(batch) % L (1/L of the rows flush), bf16 rings.

  ncu --clock-control none -k 'regex:replayssm_gdn_(step|replay)' \\
      --section SpeedOfLight ... python benchmarks/scripts/gdn_ncu_profile.py \\
      --configs='[{"ring_weights": false}, {"split_routes": true}]'

(Nsight Compute failed on the ring-weights launch, replayssm_gdn_ring_weights,
on the H200; the pattern above leaves it out.)
"""

import argparse
import json
import os
import sys

# Nsight Compute saves and restores the device memory of a kernel that
# writes its inputs (the steps update their states in place) on every
# replay pass; with JAX's default preallocation that is most of the GPU's
# memory and the replay step's passes outran the part's time limit.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
# pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels.gdn import GDNConfig
from replayssm_jax import gdn
from replayssm_jax.gdn import testing as GT
# pylint: enable=g-import-not-at-top,wrong-import-position


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--checkpoint", choices=("float32", "float16"),
                  default="float32")
  ap.add_argument("--configs", default="[{}]")
  a = ap.parse_args()
  b, hk, hv, K, V, L = a.batch, 16, 32, 128, 128, a.buffer_len
  ck = jnp.dtype(a.checkpoint)
  tok = GT.random_inputs(jax.random.PRNGKey(0), b, hk, hv, K, V,
                         dtype=jnp.bfloat16)
  state = jax.random.normal(jax.random.PRNGKey(1), (b, hv, K, V)).astype(ck)
  step = jax.jit(lambda s: gdn.gdn_step(s, **tok, implementation="pallas"),
                 donate_argnums=0)
  jax.block_until_ready(step(state))
  counts = np.arange(b) % L
  for i, fields in enumerate(json.loads(a.configs)):
    rs, _ = GT.random_gdn_replay_state(
        jax.random.PRNGKey(2 + i), b, hk, hv, K, V, L, counts,
        checkpoint_dtype=ck, buffer_dtype=jnp.bfloat16)
    config = GDNConfig(**fields)
    fr = jax.jit(lambda r, c=config: gdn.gdn_replay_step(
        r, **tok, implementation="pallas", config=c), donate_argnums=0)
    jax.block_until_ready(fr(rs))
    print("replay step", i, fields, flush=True)


if __name__ == "__main__":
  main()
