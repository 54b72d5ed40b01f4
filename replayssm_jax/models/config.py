"""`ModelConfig`: the shapes of a hybrid Mamba-2 / attention / MLP LM.

The layer pattern follows Nemotron-H's `hybrid_override_pattern`: one
character per block, 'M' a Mamba-2 mixer, '*' grouped-query attention, '-' an
MLP, 'E' a mixture-of-experts MLP (replayssm_jax.models.moe), 'G' a Gated
DeltaNet mixer (replayssm_jax.models.gdn_block), 'K' a Kimi Delta Attention
mixer (replayssm_jax.models.kda_block). Every block is pre-norm
residual (x + mixer(norm(x))). A pure Mamba-2 LM (Hugging Face
`Mamba2ForCausalLM`) is the pattern "M" * n_layers.

This module is plain Python (no ml_collections): the `configs/` files build a
`ModelConfig` from plain values.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from replayssm_jax.gdn.reference import SOLVES

PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe",
                 "G": "gdn", "K": "kda"}
MLP_ACTIVATIONS = ("relu2", "swiglu")
MOE_ROUTERS = ("sigmoid", "softmax_topk", "softmax")
MOE_ACTIVATIONS = ("relu2", "swiglu")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a hybrid LM (hashable: usable as a static jit arg).

  Attributes:
    vocab_size: number of token ids.
    d_model: width of the residual stream.
    pattern: one char per block: 'M' Mamba-2, '*' attention, '-' MLP, 'E'
      MoE, 'G' Gated DeltaNet, 'K' Kimi Delta Attention.
    ssm_heads: Mamba-2 heads H (d_inner = ssm_heads * head_dim).
    head_dim: Mamba-2 head dim P.
    d_state: SSM state size N.
    n_groups: B/C groups G (ssm_heads % n_groups == 0); the gated norm's
      groups.
    mamba_shards: the Mamba in_proj / conv channel layout. 1 (default):
      Hugging Face's [z | x | B | C | dt] columns (conv [x | B | C]). t > 1
      (set by `sharding.shard_model` for tensor parallelism over t
      devices): t shard-major blocks, block i [z_i | x_i | B_i | C_i |
      dt_i] holding heads i H/t .. (i+1) H/t - 1 with their B/C groups:
      the G/t groups of those heads when t divides G, else (G divides t)
      a copy of their one group, so `bc_groups` = max(G, t) groups are
      stored (the conv [x_i | B_i | C_i] blocks alike).
    conv_kernel: width of the causal depthwise conv (Mamba-2 and Gated
      DeltaNet mixers).
    chunk_size: SSD chunk length used by prefill.
    scan_precision: precision of the chunked prefill scans' f32 products
      (Mamba-2's `ssd.ssd_chunked_scan` and Gated DeltaNet's
      `gdn.gdn_chunked_prefill`, `precision=`): "highest" (default: true
      f32, which a GPU runs without tensor cores) or a dot algorithm name
      of `jax.lax.DotAlgorithmPreset`, e.g. "BF16_BF16_F32_X3" (three bf16
      passes, about f32's error) or "BF16_BF16_F32" (bf16 inputs, f32
      accumulation, as mixed-precision training runs); the backend must
      support it (a CPU does not TF32).
    num_heads: attention query heads.
    num_kv_heads: attention key/value heads (num_heads % num_kv_heads == 0).
    attn_head_dim: attention head dim.
    rope_theta: RoPE base, or None for no positional encoding (Nemotron-H).
    intermediate_size: MLP hidden width.
    mlp_activation: "relu2" (Nemotron-H squared ReLU, up/down) or "swiglu"
      (gate/up/down).
    norm_eps: RMSNorm epsilon (all norms).
    tie_embeddings: LM head = embedding matrix transposed.
    dtype: activation / matmul dtype name.
    param_dtype: parameter storage dtype name (the Mamba mixers' A_log, D
      and dt_bias stay float32, as in Hugging Face's Mamba2: the SSM ops
      take them in float32).
    n_routed_experts: MoE routed experts E.
    num_experts_per_tok: experts picked per token k.
    moe_intermediate_size: a routed expert's hidden width.
    moe_shared_expert_intermediate_size: the shared expert's hidden width
      (0: no shared expert).
    n_group: expert groups of grouped top-k (E % n_group == 0).
    topk_group: groups kept per token (grouped top-k).
    norm_topk_prob: divide the k routing weights by their sum.
    routed_scaling_factor: multiplies the routing weights.
    moe_router: "sigmoid" (NemotronH), "softmax_topk" (Granite MoE) or
      "softmax" (Qwen3-Next: softmax over all experts, then top-k).
    moe_router_bias: the sigmoid router's e_score_correction_bias.
    moe_latent_size: width of the experts' latent projections (Nemotron 3),
      or None (the experts work at d_model).
    moe_activation: "relu2" (up/down) or "swiglu" (fused gate+up, the gate
      first).
    embedding_multiplier: the token embeddings are multiplied by it
      (Granite 4.0's embedding_multiplier; the tied LM head reads the
      unscaled matrix).
    residual_multiplier: every block's mixer output is multiplied by it
      before the residual add (Granite 4.0's residual_multiplier).
    attention_multiplier: the attention score scale, or None for
      attn_head_dim ** -0.5 (Granite 4.0's attention_multiplier).
    logits_scaling: the logits are divided by it (Granite 4.0's
      logits_scaling).
    rotary_dim: RoPE rotates the first rotary_dim dims of each attention
      head (rotate-half within them) and passes the rest, or None for all
      attn_head_dim dims (Bamba's partial_rotary_factor * head_dim).
    moe_shared_expert_gate: the shared expert's output is multiplied by
      sigmoid(h @ w) with a [d_model, 1] weight w (Qwen3-Next's
      shared_expert_gate).
    attn_qk_norm: RMSNorm over each query and key head (attn_head_dim
      channels, before RoPE), as Qwen3.5 / Qwen3-Next's q_norm / k_norm.
    attn_output_gate: the attention output (before o_proj) is multiplied by
      sigmoid of a second query-shaped projection (Qwen3.5 / Qwen3-Next's
      gated attention; `models.gated_attention`).
    gdn_num_k_heads: Gated DeltaNet query / key heads HK.
    gdn_num_v_heads: Gated DeltaNet value heads HV (HV % HK == 0; value head
      h reads key head h // (HV // HK)).
    gdn_k_dim: Gated DeltaNet key (and query) head dim K.
    gdn_v_dim: Gated DeltaNet value head dim V.
    gdn_chunk_size: chunk length of the Gated DeltaNet prefill.
    gdn_solve: how that prefill solves each chunk's unit-lower-triangular
      system: "substitution" (default, a triangular solve) or "inverse"
      (matrix products only; `gdn.reference.solve_unit_lower`).
      The gdn_* fields size the Kimi Delta Attention ('K') mixers too.
    mla_kv_lora_rank: None, or the latent width of multi-head latent
      attention ('*' blocks become `mla_attention.MLAttention`, Kimi
      Linear's: no RoPE, num_kv_heads == num_heads, attn_head_dim =
      max(mla_qk_nope_head_dim + mla_qk_rope_head_dim, mla_v_head_dim)).
    mla_qk_nope_head_dim: MLA per-head query / key channels from the latent.
    mla_qk_rope_head_dim: MLA query / key channels shared by the heads.
    mla_v_head_dim: MLA value head dim.
  """
  vocab_size: int
  d_model: int
  pattern: str
  ssm_heads: int = 8
  head_dim: int = 64
  d_state: int = 128
  n_groups: int = 1
  mamba_shards: int = 1
  conv_kernel: int = 4
  chunk_size: int = 256
  scan_precision: str = "highest"
  num_heads: int = 8
  num_kv_heads: int = 8
  attn_head_dim: int = 64
  rope_theta: float | None = 10000.0
  intermediate_size: int = 1024
  mlp_activation: str = "relu2"
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Mixture-of-experts blocks ('E'; replayssm_jax.models.moe).
  n_routed_experts: int = 8
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 1024
  moe_shared_expert_intermediate_size: int = 0
  n_group: int = 1
  topk_group: int = 1
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  moe_router: str = "sigmoid"
  moe_router_bias: bool = True
  moe_latent_size: int | None = None
  moe_activation: str = "relu2"
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  attention_multiplier: float | None = None
  logits_scaling: float = 1.0
  rotary_dim: int | None = None
  moe_shared_expert_gate: bool = False
  # Gated attention ('*' blocks of Qwen3.5 / Qwen3-Next).
  attn_qk_norm: bool = False
  attn_output_gate: bool = False
  # Gated DeltaNet blocks ('G'; replayssm_jax.models.gdn_block).
  gdn_num_k_heads: int = 2
  gdn_num_v_heads: int = 4
  gdn_k_dim: int = 128
  gdn_v_dim: int = 128
  gdn_chunk_size: int = 64
  gdn_solve: str = "substitution"
  # Multi-head latent attention ('*' blocks of Kimi Linear).
  mla_kv_lora_rank: int | None = None
  mla_qk_nope_head_dim: int = 128
  mla_qk_rope_head_dim: int = 64
  mla_v_head_dim: int = 128

  def __post_init__(self):
    self.validate()

  # ----------------------------------------------------------- derived
  @property
  def n_layers(self) -> int:
    return len(self.pattern)

  @property
  def block_kinds(self) -> tuple[str, ...]:
    return tuple(PATTERN_CHARS[c] for c in self.pattern)

  @property
  def d_inner(self) -> int:
    return self.ssm_heads * self.head_dim

  @property
  def bc_groups(self) -> int:
    """B/C groups the in_proj / conv / replay buffers hold: n_groups, or
    with `mamba_shards` t > 1 max(n_groups, t) (a copy per shard of a
    group that t shards share)."""
    return max(self.n_groups, self.mamba_shards)

  @property
  def conv_dim(self) -> int:
    """Channels of the conv: x, B and C together."""
    return self.d_inner + 2 * self.bc_groups * self.d_state

  @property
  def in_proj_dim(self) -> int:
    """Output width of the Mamba in_proj: [z, xBC, dt]."""
    return self.d_inner + self.conv_dim + self.ssm_heads

  @property
  def gdn_key_dim(self) -> int:
    """Channels of a Gated DeltaNet mixer's queries (and of its keys)."""
    return self.gdn_num_k_heads * self.gdn_k_dim

  @property
  def gdn_value_dim(self) -> int:
    return self.gdn_num_v_heads * self.gdn_v_dim

  @property
  def gdn_conv_dim(self) -> int:
    """Channels of a Gated DeltaNet conv: q, k and v together."""
    return 2 * self.gdn_key_dim + self.gdn_value_dim

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  # -------------------------------------------------------- validation
  def validate(self) -> "ModelConfig":
    """Raises ValueError/TypeError naming the offending field."""
    def positive(name):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got "
                         f"{v!r}.")

    if not isinstance(self.pattern, str) or not self.pattern:
      raise ValueError(f"ModelConfig.pattern must be a non-empty string of "
                       f"{sorted(PATTERN_CHARS)}, got {self.pattern!r}.")
    bad = sorted(set(self.pattern) - set(PATTERN_CHARS))
    if bad:
      raise ValueError(f"ModelConfig.pattern may only hold 'M' (Mamba-2), "
                       f"'*' (attention), '-' (MLP), 'E' (MoE), 'G' (Gated "
                       f"DeltaNet), 'K' (Kimi Delta Attention); got {bad} in "
                       f"{self.pattern!r}.")
    positive("vocab_size")
    positive("d_model")
    if self.scan_precision != "highest" and self.scan_precision not in (
        jax.lax.DotAlgorithmPreset.__members__):
      raise ValueError(
          f"ModelConfig.scan_precision must be 'highest' or a "
          f"jax.lax.DotAlgorithmPreset name (e.g. 'BF16_BF16_F32_X3'), got "
          f"{self.scan_precision!r}.")
    if "M" in self.pattern:
      for name in ("ssm_heads", "head_dim", "d_state", "n_groups",
                   "conv_kernel", "chunk_size"):
        positive(name)
      if self.ssm_heads % self.n_groups:
        raise ValueError(f"ModelConfig.n_groups ({self.n_groups}) must divide "
                         f"ModelConfig.ssm_heads ({self.ssm_heads}).")
      positive("mamba_shards")
      t, g = self.mamba_shards, self.n_groups
      if self.ssm_heads % t or (g % t and t % g):
        raise ValueError(
            f"ModelConfig.mamba_shards ({t}) must divide ssm_heads "
            f"({self.ssm_heads}), and it and n_groups ({g}) one the other.")
      if self.conv_kernel < 2:
        raise ValueError(f"ModelConfig.conv_kernel must be >= 2, got "
                         f"{self.conv_kernel}.")
    if "*" in self.pattern:
      for name in ("num_heads", "num_kv_heads", "attn_head_dim"):
        positive(name)
      if self.num_heads % self.num_kv_heads:
        raise ValueError(f"ModelConfig.num_kv_heads ({self.num_kv_heads}) "
                         f"must divide ModelConfig.num_heads "
                         f"({self.num_heads}).")
      if self.rope_theta is not None:
        if (isinstance(self.rope_theta, bool)
            or not isinstance(self.rope_theta, (int, float))
            or self.rope_theta <= 0):
          raise ValueError(f"ModelConfig.rope_theta must be a positive "
                           f"number or None, got {self.rope_theta!r}.")
        if self.attn_head_dim % 2:
          raise ValueError(f"ModelConfig.attn_head_dim must be even with "
                           f"RoPE, got {self.attn_head_dim}.")
    if "G" in self.pattern or "K" in self.pattern:
      for name in ("gdn_num_k_heads", "gdn_num_v_heads", "gdn_k_dim",
                   "gdn_v_dim", "gdn_chunk_size", "conv_kernel"):
        positive(name)
      if self.gdn_solve not in SOLVES:
        raise ValueError(f"ModelConfig.gdn_solve must be one of {SOLVES}, "
                         f"got {self.gdn_solve!r}.")
      if self.gdn_num_v_heads % self.gdn_num_k_heads:
        raise ValueError(f"ModelConfig.gdn_num_k_heads "
                         f"({self.gdn_num_k_heads}) must divide "
                         f"ModelConfig.gdn_num_v_heads "
                         f"({self.gdn_num_v_heads}).")
      if self.conv_kernel < 2:
        raise ValueError(f"ModelConfig.conv_kernel must be >= 2, got "
                         f"{self.conv_kernel}.")
    if "*" in self.pattern and self.mla_kv_lora_rank is not None:
      self._validate_mla(positive)
    for name in ("attn_qk_norm", "attn_output_gate", "moe_shared_expert_gate"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"ModelConfig.{name} must be a bool, got "
                        f"{getattr(self, name)!r}.")
    if "-" in self.pattern:
      positive("intermediate_size")
      if self.mlp_activation not in MLP_ACTIVATIONS:
        raise ValueError(f"ModelConfig.mlp_activation must be one of "
                         f"{MLP_ACTIVATIONS}, got {self.mlp_activation!r}.")
    if "E" in self.pattern:
      self._validate_moe(positive)
    if (isinstance(self.norm_eps, bool)
        or not isinstance(self.norm_eps, (int, float)) or self.norm_eps <= 0):
      raise ValueError(f"ModelConfig.norm_eps must be a positive number, got "
                       f"{self.norm_eps!r}.")
    if not isinstance(self.tie_embeddings, bool):
      raise TypeError(f"ModelConfig.tie_embeddings must be a bool, got "
                      f"{self.tie_embeddings!r}.")
    for name in ("dtype", "param_dtype"):
      v = getattr(self, name)
      if v not in DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {DTYPES} (a "
                         f"name), got {v!r}.")
    self._validate_scales()
    return self

  def _validate_mla(self, positive):
    for name in ("mla_kv_lora_rank", "mla_qk_nope_head_dim",
                 "mla_qk_rope_head_dim", "mla_v_head_dim"):
      positive(name)
    qk = self.mla_qk_nope_head_dim + self.mla_qk_rope_head_dim
    width = max(qk, self.mla_v_head_dim)
    for what, ok in (
        (f"attn_head_dim ({self.attn_head_dim}) must be max(mla_qk_nope_"
         f"head_dim + mla_qk_rope_head_dim, mla_v_head_dim) = {width} (the "
         f"KV cache width)", self.attn_head_dim == width),
        (f"num_kv_heads ({self.num_kv_heads}) must equal num_heads "
         f"({self.num_heads})", self.num_kv_heads == self.num_heads),
        (f"rope_theta must be None (got {self.rope_theta!r}): the MLA "
         f"layer applies no RoPE", self.rope_theta is None),
        ("attn_qk_norm and attn_output_gate must be False",
         not (self.attn_qk_norm or self.attn_output_gate))):
      if not ok:
        raise ValueError(f"ModelConfig with mla_kv_lora_rank set: {what}.")

  def _validate_moe(self, positive):
    for name in ("n_routed_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "n_group", "topk_group"):
      positive(name)
    s = self.moe_shared_expert_intermediate_size
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
      raise ValueError(f"ModelConfig.moe_shared_expert_intermediate_size "
                       f"must be an int >= 0, got {s!r}.")
    if self.num_experts_per_tok > self.n_routed_experts:
      raise ValueError(f"ModelConfig.num_experts_per_tok "
                       f"({self.num_experts_per_tok}) must be <= "
                       f"n_routed_experts ({self.n_routed_experts}).")
    if self.n_routed_experts % self.n_group:
      raise ValueError(f"ModelConfig.n_group ({self.n_group}) must divide "
                       f"n_routed_experts ({self.n_routed_experts}).")
    if self.topk_group > self.n_group:
      raise ValueError(f"ModelConfig.topk_group ({self.topk_group}) must be "
                       f"<= n_group ({self.n_group}).")
    if self.moe_router not in MOE_ROUTERS:
      raise ValueError(f"ModelConfig.moe_router must be one of "
                       f"{MOE_ROUTERS}, got {self.moe_router!r}.")
    if self.moe_activation not in MOE_ACTIVATIONS:
      raise ValueError(f"ModelConfig.moe_activation must be one of "
                       f"{MOE_ACTIVATIONS}, got {self.moe_activation!r}.")
    if self.moe_latent_size is not None:
      positive("moe_latent_size")
    for name in ("norm_topk_prob", "moe_router_bias"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"ModelConfig.{name} must be a bool, got "
                        f"{getattr(self, name)!r}.")
    f = self.routed_scaling_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or f <= 0:
      raise ValueError(f"ModelConfig.routed_scaling_factor must be a "
                       f"positive number, got {f!r}.")

  def _validate_scales(self):
    """The multipliers and rotary_dim (Granite 4.0 / Bamba numerics)."""
    def number(name, v):
      if (isinstance(v, bool) or not isinstance(v, (int, float))
          or not math.isfinite(v) or v <= 0):
        raise ValueError(f"ModelConfig.{name} must be a positive finite "
                         f"number, got {v!r}.")

    for name in ("embedding_multiplier", "residual_multiplier",
                 "logits_scaling"):
      number(name, getattr(self, name))
    if self.attention_multiplier is not None:
      number("attention_multiplier", self.attention_multiplier)
    rd = self.rotary_dim
    if rd is not None:
      if (isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2
          or ("*" in self.pattern and rd > self.attn_head_dim)):
        raise ValueError(f"ModelConfig.rotary_dim must be None or an even "
                         f"int in [2, attn_head_dim={self.attn_head_dim}], "
                         f"got {rd!r}.")
