"""A few decode steps for Nsight Compute (run under `ncu -k regex:...`).

Nemotron-H 8B Mamba layer at batch 256 (`--batch`), L 16, bf16 inputs:
one baseline step, then two replay steps whose counters are `--counts`:
"natural" (row % L: 1/L of the rows flush), "flush"
(every row folds: the full-batch flush step of the amortized figure) or
"nonflush" (no row folds). `--policy` (e.g. f16+fp8) gives the replay
state a precision policy's master and read copy
(`replayssm_jax.precision`); `--dtype` then only sets the baseline's.
`--config` is a JSON object of `pallas_kernels.ReplayConfig` fields for the
replay steps, e.g. '{"flush_grid": "rows"}' (default: the defaults).

  ncu --clock-control none -k regex:replayssm_replay_flush -c 2 \
      --section SpeedOfLight ... python benchmarks/scripts/ncu_profile.py \
      --counts flush
"""

import argparse
import json

import jax
import jax.numpy as jnp

import pallas_kernels as pk
import replayssm_jax as R
from replayssm_jax import precision
from replayssm_jax import testing as T
from replayssm_jax.state import ReplayState


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--counts", choices=("natural", "flush", "nonflush"),
                  default="natural")
  ap.add_argument("--dtype", choices=("float16", "float32", "bfloat16"),
                  default="float16", help="checkpoint / baseline state")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--policy", default=None,
                  help="a PrecisionPolicy preset for the replay state")
  ap.add_argument("--config", default="{}",
                  help="JSON ReplayConfig fields for the replay steps")
  a = ap.parse_args()
  pol = (None if a.policy is None
         else precision.PrecisionPolicy.preset(a.policy))
  b, H, P, N, G, L = a.batch, 128, 64, 128, 8, 16
  dt = jnp.dtype(a.dtype)
  prm = T.random_params(jax.random.PRNGKey(0), H)
  inp = T.random_step_inputs(jax.random.PRNGKey(1), b, H, P, N, G,
                             jnp.bfloat16, with_z=False)
  kk = jax.random.split(jax.random.PRNGKey(2), 5)
  counts = dict(natural=jnp.arange(b) % L, flush=jnp.full((b,), L - 1),
                nonflush=jnp.full((b,), (L - 2) // 2))[a.counts]
  S = jax.random.normal(kk[4], (b, H, P, N)).astype(dt)
  rs = ReplayState(
      checkpoint=jax.random.normal(kk[0], (b, H, P, N)).astype(
          dt if pol is None else pol.checkpoint_dtype),
      x_buf=jax.random.normal(kk[1], (b, L, H, P)).astype(jnp.bfloat16),
      b_buf=jax.random.normal(kk[2], (b, L, G, N)).astype(jnp.bfloat16),
      dt_buf=jax.random.uniform(kk[3], (b, L, H), jnp.float32, 0.01, 0.2),
      count=counts.astype(jnp.int32))
  if pol is not None and pol.read_dtype is not None:
    copy, scale = precision.store(rs.checkpoint.astype(jnp.float32),
                                  pol.read_dtype)
    rs = rs.replace(read_copy=copy, read_scale=scale)
  kw = dict(**inp, **prm, dt_softplus=True, implementation="pallas")
  fb = jax.jit(lambda s: R.selective_state_update(s, **kw),
               donate_argnums=0)
  config = pk.ReplayConfig(**json.loads(a.config))
  fr = jax.jit(lambda r: R.replay_state_update(r, **kw, policy=pol,
                                               config=config),
               donate_argnums=0)
  _, S = fb(S)
  jax.block_until_ready(S)
  for _ in range(2):
    # The same counters each time (a flush resets them), so both steps
    # take the route asked for.
    _, out = fr(rs)
    jax.block_until_ready(out)
    rs = out.replace(count=counts.astype(jnp.int32))
  print("done", a.counts, a.dtype, a.policy, config)


if __name__ == "__main__":
  main()
