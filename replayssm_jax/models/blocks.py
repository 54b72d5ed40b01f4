"""`Block`: a pre-norm residual block of the hybrid LM around one mixer.

  Block(kind, cfg)(x, state, lengths)  x + mixer(norm(x)), the mixer's prefill
                                       (x [b, T, d]) or decode step ([b, d])
  Block.mix(h, state)                  the mixer on a normed input (the model
                                       adds the residual, fused with the next
                                       norm)
  Block.verify(h, state)               the mixer on a speculative window

Mixers by kind: "mamba" (`layers.Mamba2Mixer`), "attention"
(`attention_block.Attention`, or `gated_attention.GatedAttention` with q/k
norms or an output gate, `mla_attention.MLAttention` with a latent KV), "mlp"
(`mlp.MLP`), "moe" (`moe.MoE`), "gdn" (`gdn_block.GDNMixer`), "kda"
(`kda_block.KDAMixer`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import slots
from replayssm_jax.models.attention_block import Attention
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.gated_attention import GatedAttention
from replayssm_jax.models.gdn_block import GDNMixer
from replayssm_jax.models.kda_block import KDAMixer
from replayssm_jax.models.layers import Mamba2Mixer, RMSNorm
from replayssm_jax.models.mla_attention import MLAttention
from replayssm_jax.models.mlp import MLP
from replayssm_jax.models.moe import MoE

F32 = jnp.float32


MIXERS = {"mamba": Mamba2Mixer, "attention": Attention, "mlp": MLP,
          "moe": MoE, "gdn": GDNMixer, "kda": KDAMixer}
STATELESS = ("mlp", "moe")  # mixers without a decode state
RECURRENT = ("mamba", "gdn", "kda")  # mixers with a conv + recurrent state


def mixer_class(kind: str, cfg: ModelConfig):
  """The mixer module of a block of `kind` under `cfg` (attention with q/k
  norms or an output gate: `GatedAttention`)."""
  if kind == "attention" and cfg.mla_kv_lora_rank is not None:
    return MLAttention
  if kind == "attention" and (cfg.attn_qk_norm or cfg.attn_output_gate):
    return GatedAttention
  return MIXERS[kind]


class Block(nnx.Module):
  """Pre-norm residual block: x + mixer(norm(x)); residual in float32."""

  def __init__(self, kind: str, cfg: ModelConfig, *, rngs):
    self.kind = kind
    self.norm = RMSNorm(cfg.d_model, cfg)
    self.residual_multiplier = float(cfg.residual_multiplier)
    self.mixer = mixer_class(kind, cfg)(cfg, rngs=rngs)

  def __call__(self, x, state, lengths=None, implementation=None, layer=0,
               resume=False, kv_len=None):
    """x [b, T, d] (with lengths [b]) or [b, d] -> (x', new_state); `layer`:
    a Mamba block's index among the Mamba blocks (keys stochastic
    rounding); resume: a prefill continues each row of `state` (the
    mixers' `prefill(..., resume=True)`; kv_len: the attention's bound on
    the live KV entries, `HybridLM.forward`)."""
    with jax.named_scope(self.kind):  # names the ops in profiles
      y, state = self.mix(self.norm(x), state, lengths, implementation,
                          layer, resume, kv_len=kv_len)
      return x.astype(F32) + y.astype(F32), state

  def mix(self, h, state, lengths=None, implementation=None, layer=0,
          resume=False, rows=None, kv_len=None):
    """The mixer on the normed input h [b, T, d] (prefill, with lengths)
    or [b, d] (a decode step) -> (y, new_state), without the residual;
    y times config.residual_multiplier. rows: a decode step's [b]
    effective slots of a state with any number of rows
    (`replayssm_jax.slots`): Mamba-2, Gated DeltaNet and attention mixers
    step those rows in place (`rows_in_place`), the others on gathered rows
    scattered back."""
    if rows is not None and self.kind not in STATELESS:
      if not self.rows_in_place:
        y, state = slots.on_rows(
            lambda st: self._mix(h, st, None, implementation, layer), state,
            rows)
        return self._scale(y), state
      kw = dict(layer=layer) if self.kind in RECURRENT else {}
      y, state = self.mixer.step(h, state, implementation, rows=rows, **kw)
      return self._scale(y), state
    y, state = self._mix(h, state, lengths, implementation, layer, resume,
                         kv_len)
    return self._scale(y), state

  @property
  def rows_in_place(self) -> bool:
    """Whether a decode step through slots (`mix(rows=)`) steps the pool's
    rows in place (stateless blocks: trivially)."""
    return self.kind in STATELESS or isinstance(
        self.mixer, (Mamba2Mixer, GDNMixer, Attention))

  def _scale(self, y):
    """y * config.residual_multiplier (in y's dtype)."""
    if self.residual_multiplier == 1.0:
      return y
    return y * jnp.asarray(self.residual_multiplier, y.dtype)

  def _mix(self, h, state, lengths=None, implementation=None, layer=0,
           resume=False, kv_len=None):
    """`mix` before the residual multiplier."""
    if self.kind in STATELESS:
      return self.mixer(h), state
    if self.kind == "attention":
      return (self.mixer.prefill(h, lengths, state, resume=resume,
                                 kv_len=kv_len)
              if h.ndim == 3 else self.mixer.step(h, state, implementation))
    if h.ndim == 3:
      return self.mixer.prefill(h, lengths, state, layer, resume=resume)
    return self.mixer.step(h, state, implementation, layer)

  def verify(self, h, state, implementation=None, layer=0):
    """The mixer on a speculative window's normed input h [b, T, d] ->
    (y, the mixer's pending state), without the residual (y times
    config.residual_multiplier, as `mix`); `layer` as in `__call__`."""
    y, state = self._verify(h, state, implementation, layer)
    return self._scale(y), state

  def _verify(self, h, state, implementation=None, layer=0):
    """`verify` before the residual multiplier."""
    if self.kind in STATELESS:
      return self.mixer(h), state
    if self.kind in RECURRENT:
      return self.mixer.verify(h, state, implementation, layer)
    return self.mixer.verify(h, state, implementation)
