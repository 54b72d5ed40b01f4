"""The dense MLP block's mixer ("-" in a block pattern).

relu2: down(relu(up(x))^2) (Nemotron-H). swiglu: down(silu(gate(x)) *
up(x)) with gate and up one [d_model, 2, intermediate] kernel `gate_up`
([:, 0] the gate, [:, 1] the up projection), so that they run as one GEMM:
at the Qwen3.5-4B MLP shape XLA ran two separate weights as one Triton GEMM
fusion, 1.44x slower than cuBLAS on the packed weight at 256 rows
(benchmarks/decode_step/qwen3_5_4b_studies.md, "The MLP's GEMMs
alone"). The middle axis keeps the
gate and up columns of a tensor-parallel shard of the intermediate axis
together. Checkpoints' separate gate_proj / up_proj tensors (or a fused
[gate; up] one) load into it (`hf_tensors`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.layers import Linear, _normal


class MLP(nnx.Module):
  """relu2: down(relu(up(x))^2); swiglu: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs):
    self.activation = cfg.mlp_activation
    self.dtype = cfg.jnp_dtype
    d, f = cfg.d_model, cfg.intermediate_size
    if self.activation == "swiglu":  # up drawn before gate
      up, gate = (_normal(rngs, (d, f), d ** -0.5, cfg.jnp_param_dtype)
                  for _ in range(2))
      self.gate_up = nnx.Param(jnp.stack([gate, up], axis=1))  # [d, 2, f]
    else:
      self.up_proj = Linear(d, f, cfg, rngs=rngs)
    self.down_proj = Linear(f, d, cfg, rngs=rngs)

  def __call__(self, h):
    if self.activation == "swiglu":
      gu = jnp.einsum("...d,dgf->...gf", h.astype(self.dtype),
                      self.gate_up[...].astype(self.dtype))
      a = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
    else:
      a = jnp.square(jax.nn.relu(self.up_proj(h)))
    return self.down_proj(a)
