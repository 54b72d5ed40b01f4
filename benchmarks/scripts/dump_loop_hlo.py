"""Dumps XLA's optimized HLO of specdec_bench's decode loops (GPU
diagnostic): `generate` (plain decoding) and `speculative_generate` (replay
mode) at hybrid_1b, batch 256, window 4, exactly as
`specdec_profile.loop_splits` calls them, so that the fusion names of a
`profile_kernels` trace (e.g. `loop_multiply_fusion.12`) can be looked up.

  XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text \
      --xla_dump_hlo_module_re=.*(generate|spec).*" \
      PYTHONPATH=. python benchmarks/scripts/dump_loop_hlo.py
"""

import jax
import jax.numpy as jnp

from configs import hybrid_1b
from experiments.decode_bench import build_model
from experiments.specdec_bench import FlatOracleProposer
from replayssm_jax.models import ModelConfig, generate, speculative_generate


def main():
  cfg = ModelConfig(**hybrid_1b.get_config().model.to_dict())
  model = build_model(cfg, 0)
  b, t, n_new = 256, 4, 128
  prompts = jax.random.randint(jax.random.PRNGKey(1), (b, 128), 0,
                               cfg.vocab_size, jnp.int32)
  lengths = jnp.full((b,), 128, jnp.int32)
  kw = dict(buffer_len=16, checkpoint_dtype="float32", temperature=1000.0,
            rng=jax.random.PRNGKey(8))
  jax.block_until_ready(generate(model, prompts, lengths, n_new,
                                 ssm_mode="replay", **kw)[0])
  proposer = FlatOracleProposer(0.7, cfg.vocab_size)
  out = speculative_generate(model, proposer, prompts, lengths, n_new, t,
                             ssm_mode="replay", **kw)
  print("iterations", int(out[2].iterations), flush=True)


if __name__ == "__main__":
  main()
