"""The hybrid LM and its functional prefill / decode entry points.

  model = HybridLM(config, rngs=nnx.Rngs(0))
  logits = model(tokens)                              # [b, T, vocab] f32
  state = model.init_state(batch, max_len, ssm_mode="replay")
  last_logits, state = prefill(model, tokens, lengths, state)
  logits, state = decode_step(model, token, state)    # [b, vocab] f32

`prefill` and `decode_step` are jit-compiled once per shape (the model is
split into graphdef + params, the graphdef being a static argument) and
donate the decode state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax import ops
from replayssm_jax import slots
from replayssm_jax import precision as P
from replayssm_jax.models import states as S
from replayssm_jax.models.config import ModelConfig
from replayssm_jax.models.blocks import Block
from replayssm_jax.models.layers import Embedding, Linear, RMSNorm
from replayssm_jax.state import ReplayState

F32 = jnp.float32

# Number of times each jitted entry point was traced (tests assert on it).
TRACE_COUNTS = {"prefill": 0, "decode_step": 0, "generate": 0,
                "generate_from_state": 0, "verify": 0, "commit": 0,
                "speculative_generate": 0}


class HybridLM(nnx.Module):
  """Embedding -> blocks from `config.pattern` -> RMSNorm -> LM head."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a ModelConfig, got "
                      f"{type(config).__name__}.")
    self.config = config.validate()
    self.embeddings = Embedding(config, rngs=rngs)
    self.blocks = nnx.List([Block(kind, config, rngs=rngs)
                            for kind in config.block_kinds])
    self.norm_f = RMSNorm(config.d_model, config)
    if not config.tie_embeddings:
      self.lm_head = Linear(config.d_model, config.vocab_size, config,
                            rngs=rngs)

  def mamba_indices(self) -> tuple[int | None, ...]:
    """Per block: its index among the recurrent (Mamba-2 and Gated
    DeltaNet) blocks (0, 1, ... in pattern order; keys the stochastic
    rounding of its state), None for others."""
    out, m = [], 0
    for kind in self.config.block_kinds:
      rec = kind in ("mamba", "gdn", "kda")
      out.append(m if rec else None)
      m += rec
    return tuple(out)

  def logits(self, h):
    """h [..., d] -> [..., vocab] float32."""
    return self.head(self.norm_f(h))

  def head(self, hn):
    """The LM head on the final norm's output hn [..., d] -> [..., vocab]
    float32."""
    if self.config.tie_embeddings:
      logits = self.embeddings.attend(hn)
    else:
      logits = self.lm_head(hn).astype(F32)
    if self.config.logits_scaling != 1.0:  # Granite 4.0's logits_scaling
      logits = logits / self.config.logits_scaling
    return logits

  def forward(self, tokens, lengths=None, state: S.ModelState | None = None,
              resume: bool = False, kv_len: int | None = None):
    """Runs a right-padded sequence. tokens [b, T] int, lengths [b].

    resume: each row continues `state` (at its position) instead of
    starting empty (`chunked_prefill.prefill_from_state`); kv_len: with
    resume, a static bound on every row's KV entries after the chunk (the
    attention reads no further; None: the whole cache).

    Returns (hidden [b, T, d] float32 before the final norm, new state or
    None).
    """
    b, t = tokens.shape
    if lengths is None:
      lengths = jnp.full((b,), t, jnp.int32)
    x = self.embeddings(tokens)
    new_layers = []
    for i, (block, layer) in enumerate(zip(self.blocks,
                                           self.mamba_indices())):
      s = None if state is None else state.layers[i]
      x, s = block(x, s, lengths=lengths, layer=layer, resume=resume,
                   kv_len=kv_len)
      new_layers.append(s)
    if state is None:
      return x, None
    positions = lengths.astype(jnp.int32)
    if resume:
      positions = state.positions + positions
    return x, S.ModelState(layers=tuple(new_layers), positions=positions)

  def __call__(self, tokens):
    """Full-sequence logits [b, T, vocab] float32 (no decode state)."""
    _check_tokens("tokens", tokens, 2, "[batch, seqlen]", self.config)
    x, _ = self.forward(tokens)
    return self.logits(x)

  def step(self, token, state: S.ModelState, implementation=None,
           rows=None):
    """One decode token per row: token [b] -> (logits [b, vocab], state).

    The blocks as in `forward`, with each residual add and the next norm
    as one `ops.add_rms_norm` (`implementation` picks it, the mixers' ops
    and the attention's), so that XLA does not run them as two fusions per
    block, the second recomputing the sum.

    rows: optional [b] int32, a state row (slot) per token row of a state
    with any number of rows (a serving pool's; `replayssm_jax.slots`: a
    slot outside [0, state.batch) is a padding row with NaN logits, a
    repeated slot is refused, or under jit a padding row): only those
    state rows step, the others stay as they are."""
    if rows is not None:
      rows = slots.effective(rows, state.batch)
    bad = invalid_rows(token, state, self.config.vocab_size, rows=rows)
    x = self.embeddings(token).astype(F32)  # [b, d] residual stream
    y, new_layers = None, []
    for block, s, layer in zip(self.blocks, state.layers,
                               self.mamba_indices()):
      with jax.named_scope(block.kind):
        x, h = self.add_norm(x, y, block.norm, implementation)
        y, s = block.mix(h, s, implementation=implementation, layer=layer,
                         rows=rows)
      new_layers.append(s)
    with jax.named_scope("lm_head"):
      _, h = self.add_norm(x, y, self.norm_f, implementation)
      logits = self.head(h)
    if rows is None:
      return mark_invalid(logits, S.ModelState(
          layers=tuple(new_layers), positions=state.positions + 1), bad)
    pos = slots.gather(state.positions, rows)
    pos = jnp.where(bad, -1, pos + 1).astype(jnp.int32)
    logits = jnp.where(bad[:, None], jnp.nan, logits)
    return logits, S.ModelState(layers=tuple(new_layers),
                                positions=slots.scatter(state.positions,
                                                        pos, rows))

  @staticmethod
  def add_norm(x, y, norm, implementation):
    """(x + y, norm(x + y)) in float32 / norm's dtype; (x, norm(x))
    before the first block."""
    if y is None:
      return x, norm(x)
    return ops.add_rms_norm(x, y, norm.weight[...], eps=norm.eps,
                            out_dtype=norm.dtype,
                            implementation=implementation)

  def init_state(self, batch: int, max_len: int, ssm_mode: str = "replay",
                 buffer_len: int = 16, checkpoint_dtype=None,
                 buffer_dtype=None, kv_dtype=None, conv_dtype=None, *,
                 precision: P.PrecisionPolicy | None = None,
                 row_ids=None) -> S.ModelState:
    """An empty decode state.

    Args:
      batch: rows.
      max_len: KV-cache length (prompt + generated tokens) of attention
        layers.
      ssm_mode: "replay" (ReplayState checkpoint + buffer; Gated DeltaNet
        layers: GDNReplayState) or "baseline" (full SSM state).
      buffer_len: L of the replay buffer (replay mode only).
      checkpoint_dtype: the replay checkpoint / baseline SSM state dtype
        (default float32, or the policy's).
      buffer_dtype: x/B buffer dtype (default: config.dtype, lossless since
        the buffered inputs are activations of that dtype; or the policy's).
      kv_dtype: KV-cache dtype (default config.dtype).
      conv_dtype: conv-state dtype (default config.dtype).
      precision: None (the dtypes above, round to nearest), or a
        `PrecisionPolicy` for the SSM states of the Mamba-2 and Gated
        DeltaNet layers. Replay mode: each layer's replay state is built with the policy (master
        checkpoint, buffers, read copy, stochastic-rounding counters);
        prefill stores the checkpoint (and read copy) per the policy and
        every decode step passes the policy and the layer's Mamba index
        (0, 1, ... in pattern order) to `replay_state_update`. Baseline
        mode: the full state is stored every step in the policy's narrowest
        dtype (`states.baseline_storage_dtype`: read_dtype, else
        checkpoint_dtype) with the policy's rounding, the "round every
        step" contrast. checkpoint_dtype / buffer_dtype, if given, must
        agree with the policy.
      row_ids: [batch] int, stable identities of the rows' sequences
        (default arange(batch)); only with a policy that rounds
        stochastically, whose random bits they key: a sequence's rounding
        bits do not depend on its batch or slot (its states agree across
        batch sizes to the matmuls' rounding, not bit for bit: see
        `replayssm_jax.precision`).
    """
    cfg = self.config
    batch, max_len, buffer_len = (
        V.positive_int(name, v) for name, v in (
            ("batch", batch), ("max_len", max_len),
            ("buffer_len", buffer_len)))
    if ssm_mode not in S.SSM_MODES:
      raise ValueError(f"ssm_mode must be one of {S.SSM_MODES}, got "
                       f"{ssm_mode!r}.")
    row_ids = _check_precision_args(precision, ssm_mode, batch,
                                    checkpoint_dtype, buffer_dtype, row_ids)
    checkpoint_dtype = F32 if checkpoint_dtype is None else checkpoint_dtype
    buffer_dtype = cfg.jnp_dtype if buffer_dtype is None else buffer_dtype
    kv_dtype = cfg.jnp_dtype if kv_dtype is None else kv_dtype
    conv_dtype = cfg.jnp_dtype if conv_dtype is None else conv_dtype
    for name, v in (("checkpoint_dtype", checkpoint_dtype),
                    ("buffer_dtype", buffer_dtype), ("kv_dtype", kv_dtype),
                    ("conv_dtype", conv_dtype)):
      V.check_dtype_arg(name, v)
    layers = []
    for kind in cfg.block_kinds:
      if kind == "mamba":
        layers.append(S.init_mamba_state(cfg, batch, ssm_mode, buffer_len,
                                         checkpoint_dtype, buffer_dtype,
                                         conv_dtype, precision, row_ids))
      elif kind in ("gdn", "kda"):
        layers.append(S.init_gdn_state(cfg, batch, ssm_mode, buffer_len,
                                       checkpoint_dtype, buffer_dtype,
                                       conv_dtype, precision, row_ids, kind))
      elif kind == "attention":
        layers.append(S.init_attention_state(cfg, batch, max_len, kv_dtype))
      else:
        layers.append(None)
    return S.ModelState(layers=tuple(layers),
                        positions=jnp.zeros((batch,), jnp.int32))


def _check_precision_args(precision, ssm_mode, batch, checkpoint_dtype,
                          buffer_dtype, row_ids):
  """Checks init_state's precision / dtype / row_ids arguments together;
  returns row_ids as [batch] int32 (or None)."""
  if precision is None:
    if row_ids is not None:
      raise ValueError("row_ids is only used with a precision policy that "
                       "rounds stochastically (precision=PrecisionPolicy("
                       "..., stochastic_rounding=True)); got precision=None.")
    return None
  if not isinstance(precision, P.PrecisionPolicy):
    raise TypeError(f"precision must be a replayssm_jax.PrecisionPolicy or "
                    f"None, got {type(precision).__name__} "
                    f"({precision!r}); e.g. "
                    f"PrecisionPolicy.preset('f32+bf16').")
  own = {"checkpoint_dtype": (S.baseline_storage_dtype(precision)
                              if ssm_mode == "baseline"
                              else precision.checkpoint_dtype)}
  if ssm_mode == "replay":
    own["buffer_dtype"] = precision.buffer_dtype
  for name, given in (("checkpoint_dtype", checkpoint_dtype),
                      ("buffer_dtype", buffer_dtype)):
    if given is None or name not in own:
      continue
    try:
      same = jnp.dtype(given).name == own[name]
    except TypeError:
      same = False
    if not same:
      V.check_dtype_arg(name, given)
      raise ValueError(
          f"{name} ({jnp.dtype(given).name}) contradicts precision "
          f"{precision.name!r}, whose {ssm_mode} {name} is {own[name]}; "
          f"give one or the other.")
  if not precision.stochastic_rounding:
    if row_ids is not None:
      raise ValueError(f"row_ids is only used with stochastic rounding; "
                       f"precision {precision.name!r} rounds to nearest.")
    return None
  if row_ids is None:
    return jnp.arange(batch, dtype=jnp.int32)
  V.check_integer("row_ids", row_ids)
  V.check_shape("row_ids", row_ids, (batch,), "[batch]")
  return jnp.asarray(row_ids, jnp.int32)


# ------------------------------------------------------------ validation
def invalid_rows(tokens, state: S.ModelState, vocab_size: int,
                 window: int = 1, rows=None):
  """[batch] bool: the rows a step over `window` tokens per row (tokens
  [batch] or [batch, window]) cannot run correctly, values the host cannot
  check under jit: a token id outside [0, vocab_size), a KV cache without
  room for the window, or a row already invalid (position < 0); with rows
  (effective slots of the state's rows per token row), also a padding
  row."""
  def per_row(x):
    return x if rows is None else slots.gather(x, rows)

  bad = _out_of_vocab(tokens.reshape(tokens.shape[0], -1), vocab_size)
  bad = bad | (per_row(state.positions) < 0)
  if rows is not None:
    bad = bad | (rows < 0)
  for s in state.layers:
    if isinstance(s, S.AttentionState):
      bad = bad | (per_row(s.length) + window > s.max_len)
  return bad


def _out_of_vocab(tokens, vocab_size: int, where=True):
  """[batch] bool: some token id of the row (tokens [batch, T], the
  positions `where` selects) lies outside [0, vocab_size)."""
  return jnp.any(where & ((tokens < 0) | (tokens >= vocab_size)), axis=1)


def mark_invalid(logits, state: S.ModelState, bad):
  """The traced-value policy (`replayssm_jax._validation`): rows `bad`
  get NaN logits and position -1, which keeps every later output of the
  row NaN."""
  logits = jnp.where(bad.reshape((-1,) + (1,) * (logits.ndim - 1)),
                     jnp.nan, logits)
  return logits, state.replace(positions=jnp.where(
      bad, -1, state.positions).astype(jnp.int32))


def _check_tokens(name, tokens, ndim, layout, cfg):
  V.check_integer(name, tokens)
  V.check_ndim(name, tokens, ndim, layout)
  if V.is_concrete(tokens) and tokens.size:
    t = np.asarray(tokens)
    if t.min() < 0 or t.max() >= cfg.vocab_size:
      raise ValueError(f"{name} must lie in [0, vocab_size) = [0, "
                       f"{cfg.vocab_size}), got values in [{t.min()}, "
                       f"{t.max()}].")


def _check_state(state, batch, cfg):
  if not isinstance(state, S.ModelState):
    raise TypeError(f"state must be a ModelState (from model.init_state), "
                    f"got {type(state).__name__}.")
  if len(state.layers) != cfg.n_layers:
    raise ValueError(f"state has {len(state.layers)} layers, the model "
                     f"{cfg.n_layers}.")
  if state.batch != batch:
    raise ValueError(f"state batch ({state.batch}) != input batch "
                     f"({batch}).")
  for i, (kind, s) in enumerate(zip(cfg.block_kinds, state.layers)):
    _check_layer_state(i, kind, s, cfg)


_LAYER_STATES = {"mamba": S.MambaState, "attention": S.AttentionState,
                 "mlp": type(None), "moe": type(None), "gdn": S.GDNState,
                 "kda": S.GDNState}


def _check_layer_state(i, kind, s, cfg):
  """state.layers[i] is the state of the model's layer i (kind and
  sizes), as `init_state` builds it: a clear error otherwise (a state of
  another model, layers out of order)."""
  want = _LAYER_STATES[kind]
  where = f"state.layers[{i}]"
  if not isinstance(s, want):
    raise ValueError(f"{where} is of type {type(s).__name__}, but the "
                     f"model's layer {i} is a {kind} block (expects "
                     f"{want.__name__}); was the state built by this "
                     f"model's init_state?")

  def expect(what, got, expected):
    if tuple(got) != tuple(expected):
      raise ValueError(f"{where}.{what} has sizes {tuple(got)}, the model's "
                       f"{kind} layer {i} expects {tuple(expected)}; was the "
                       f"state built by this model's init_state?")

  if kind == "mamba":
    expect("conv [kernel - 1, conv_dim]", s.conv.shape[1:],
           (cfg.conv_kernel - 1, cfg.conv_dim))
    ssm = s.ssm
    heads = (cfg.ssm_heads, cfg.head_dim, cfg.d_state)
    if isinstance(ssm, ReplayState):
      expect("ssm.checkpoint [nheads, headdim, dstate]",
             ssm.checkpoint.shape[1:], heads)
      expect("ssm.b_buf ngroups", ssm.b_buf.shape[2:3], (cfg.bc_groups,))
    else:
      arr = ssm.state if isinstance(ssm, S.StoredSSMState) else ssm
      expect("ssm [nheads, headdim, dstate]", arr.shape[1:], heads)
  elif kind in ("gdn", "kda"):
    expect("conv [kernel - 1, gdn_conv_dim]", s.conv.shape[1:],
           (cfg.conv_kernel - 1, cfg.gdn_conv_dim))
    heads = (cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim)
    arr = (s.ssm.checkpoint if s.is_replay else s.ssm.state
           if isinstance(s.ssm, S.StoredSSMState) else s.ssm)
    expect("ssm [HV, K, V]", arr.shape[1:], heads)
  elif kind == "attention":
    expect("k [num_kv_heads, attn_head_dim]",
           (s.k.shape[1], s.k.shape[3]), (cfg.num_kv_heads, cfg.attn_head_dim))


def check_prefill_inputs(model, tokens, lengths, state):
  cfg = model.config
  _check_tokens("tokens", tokens, 2, "[batch, seqlen]", cfg)
  b, t = tokens.shape
  V.check_integer("lengths", lengths)
  V.check_shape("lengths", lengths, (b,), "[batch]")
  if V.is_concrete(lengths):
    ln = np.asarray(lengths)
    if (ln < 1).any() or (ln > t).any():
      raise ValueError(f"lengths must lie in [1, seqlen] = [1, {t}], got "
                       f"{ln.tolist()}.")
  _check_state(state, b, cfg)
  if state.max_len is not None and t > state.max_len:
    raise ValueError(f"prompt seqlen {t} exceeds the state's max_len "
                     f"{state.max_len}.")


# ------------------------------------------------------- jitted entries
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(4,))
def _prefill_jit(graphdef, params, tokens, lengths, state):
  TRACE_COUNTS["prefill"] += 1
  model = nnx.merge(graphdef, params)
  return prefill_fn(model, tokens, lengths, state)


def prefill_fn(model, tokens, lengths, state):
  """Traceable prefill: (logits at each row's last prompt token [b, vocab]
  float32, decode state)."""
  t = tokens.shape[1]
  lengths = lengths.astype(jnp.int32)
  # Under jit: prompt lengths outside [1, seqlen] or token ids outside the
  # vocabulary within a row's prompt make the row invalid.
  real = jnp.arange(t)[None, :] < lengths[:, None]
  bad = ((lengths < 1) | (lengths > t)
         | _out_of_vocab(tokens, model.config.vocab_size, real))
  x, state = model.forward(tokens, lengths, state)
  last = jnp.take_along_axis(x, jnp.clip(lengths - 1, 0, t - 1)[
      :, None, None], axis=1)[:, 0]  # [b, d]
  return mark_invalid(model.logits(last), state, bad)


def _decode_body(graphdef, params, token, state, implementation, rows=None):
  TRACE_COUNTS["decode_step"] += 1
  model = nnx.merge(graphdef, params)
  return model.step(token, state, implementation, rows)


# Kept apart so that a test can jit the body the same way under
# chex.assert_max_traces (tests/test_models.py::test_decode_compiles_once).
DECODE_JIT_OPTIONS = dict(static_argnums=(0, 4), donate_argnums=(3,))
_decode_jit = jax.jit(_decode_body, **DECODE_JIT_OPTIONS)


def prefill(model: HybridLM, tokens, lengths, state: S.ModelState):
  """Runs the right-padded prompts and fills the decode state.

  Mamba layers use the chunked SSD scan (padded positions have dt' = 0 and
  x = 0, so they never touch the SSM state; the conv state is gathered at
  each row's true end); Gated DeltaNet layers the chunked delta-rule
  prefill (padded positions masked out); replay-mode states become
  checkpoint = final state with an empty buffer. Attention layers fill their KV cache. The
  given `state` (from `init_state`; donated) only fixes the storage layout:
  prefill starts every row from an empty state.

  Args:
    model: the HybridLM.
    tokens: [batch, seqlen] int token ids, right-padded.
    lengths: [batch] int, 1 <= lengths <= seqlen.
    state: a ModelState from `model.init_state`.

  Returns:
    (logits [batch, vocab] float32 of each row's last prompt token,
     new ModelState with positions = lengths).
  """
  check_prefill_inputs(model, tokens, lengths, state)
  graphdef, params = nnx.split(model)
  logits, state = _prefill_jit(graphdef, params, jnp.asarray(tokens),
                               jnp.asarray(lengths, jnp.int32), state)
  V.raise_if_invalid(state.positions < 0, "prefill")
  return logits, state


def decode_step(model: HybridLM, token, state: S.ModelState,
                implementation: str | None = None, rows=None):
  """One decode step of every row: token [batch] int -> (logits [batch,
  vocab] float32, new state). The state is donated.

  `implementation` is passed to the dispatcher of the step's kernel ops
  (the SSM decode op and `ops.decode_attention`): None picks the fastest
  of each, "reference" / "pallas" names one for both.

  rows: optional [batch] int32, the state row (slot) of each token row: the
  state may then have any number of rows (a serving pool's) and only those
  rows step (`HybridLM.step`; the Mamba-2 and attention kernels read and
  write them in place).
  """
  _check_tokens("token", token, 1, "[batch]", model.config)
  if rows is None:
    _check_state(state, token.shape[0], model.config)
  else:
    _check_state(state, state.batch, model.config)
    slots.check_rows(rows, token.shape[0], state.batch)
  if state.max_len is not None and V.is_concrete(state.positions):
    pos = np.asarray(state.positions)
    if (pos >= state.max_len).any():
      rows = np.nonzero(pos >= state.max_len)[0].tolist()
      raise ValueError(f"KV cache full: rows {rows} are at position >= "
                       f"max_len {state.max_len}; create the state with a "
                       f"larger max_len.")
  graphdef, params = nnx.split(model)
  logits, state = _decode_jit(graphdef, params, jnp.asarray(token), state,
                              implementation,
                              None if rows is None else jnp.asarray(rows))
  V.raise_if_invalid(state.positions < 0, "decode_step")
  return logits, state
