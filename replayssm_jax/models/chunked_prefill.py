"""Chunked prefill continued from a decode state.

  logits, state = prefill(model, tokens[:, :n], lengths_a, state)
  logits, state = prefill_from_state(model, more_tokens, lengths_b, state)

`prefill_from_state` appends a right-padded chunk of tokens to every row of
a decode state in one parallel pass, the row's position counting on from
`state.positions`: prefill(A + B) equals prefill(A) then
prefill_from_state(B), the last token's logits and every state leaf up to
the summation order (tests/test_chunked_prefill.py). Per block kind:

  Mamba-2          the chunked SSD scan with the row's state as its initial
                   state (a replay state materialized: checkpoint advanced
                   over its buffered tokens; a stored baseline state
                   loaded) and the conv window as the conv's history.
  Gated DeltaNet,  the chunked delta-rule prefill with `initial_state` and
  KDA              the conv window as history.
  attention        (plain, gated and MLA, which share `attention_block.Attention`'s
                   cache) queries at positions length .. length + T - 1
                   attend to the cached entries and causally within the
                   chunk; the chunk's keys / values are written at those
                   positions.
  MLP, MoE         per position, no state.

The new state is laid out as `prefill` lays it out: replay states with an
empty buffer and the checkpoint = the state after the chunk, stored per
the precision policy (stochastic rounding keyed by the row's step, the
state's own step + the chunk's length, which is what a prefill of the
whole prompt uses); baseline states the full state; conv windows oldest
first. Padded positions (t >= lengths[r]) are selected away, never
multiplied by zero: a pad holding inf or NaN reaches no output or state
(a pad writes no KV-cache entry either). A replay state with a pending
speculative window (from `verify`) is refused: commit it first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S

# Number of times the jitted entry was traced (tests assert on it).
TRACE_COUNTS = {"prefill_from_state": 0}


def check_inputs(model, tokens, lengths, state):
  """The host-side checks of `prefill_from_state` (shapes, dtypes, and the
  values of concrete arguments); errors name the argument."""
  cfg = model.config
  M._check_tokens("tokens", tokens, 2, "[batch, seqlen]", cfg)
  b, t = tokens.shape
  V.check_integer("lengths", lengths)
  V.check_shape("lengths", lengths, (b,), "[batch]")
  M._check_state(state, b, cfg)
  for i, s in enumerate(state.layers):
    ssm = getattr(s, "ssm", None)
    if getattr(ssm, "pending_window", None) is not None:
      raise ValueError(
          f"state.layers[{i}].ssm holds a speculative window pending (from "
          f"verify); commit it (models.commit) before continuing a prefill "
          f"from it.")
  if not V.is_concrete(lengths):
    return
  ln = np.asarray(lengths)
  if (ln < 1).any() or (ln > t).any():
    raise ValueError(f"lengths must lie in [1, seqlen] = [1, {t}], got "
                     f"{ln.tolist()}.")
  if state.max_len is not None and V.is_concrete(state.positions):
    end = np.asarray(state.positions) + ln
    full = np.nonzero(end > state.max_len)[0].tolist()
    if full:
      raise ValueError(
          f"lengths: rows {full} would end at positions "
          f"{end[full].tolist()}, past the state's max_len "
          f"{state.max_len} (the KV cache); create the state with a larger "
          f"max_len.")


def prefill_from_state_fn(model, tokens, lengths, state: S.ModelState,
                          kv_len: int | None = None):
  """Traceable `prefill_from_state`: (logits at each row's last new token
  [b, vocab] float32, the continued state); kv_len (static) as there."""
  t = tokens.shape[1]
  lengths = lengths.astype(jnp.int32)
  # Under jit (the traced-value policy, `replayssm_jax._validation`): a
  # length outside [1, seqlen], a token id outside the vocabulary within a
  # row's chunk, a row already invalid or a KV cache without room for the
  # chunk (or more entries than kv_len) make the row invalid (NaN logits,
  # position -1).
  real = jnp.arange(t)[None, :] < lengths[:, None]
  bad = ((lengths < 1) | (lengths > t) | (state.positions < 0)
         | M._out_of_vocab(tokens, model.config.vocab_size, real))
  for s in state.layers:
    if isinstance(s, S.AttentionState):
      bad = bad | (s.length + lengths > s.max_len)
      if kv_len is not None:
        bad = bad | (s.length + lengths > kv_len)
  x, new = model.forward(tokens, lengths, state, resume=True, kv_len=kv_len)
  last = jnp.take_along_axis(x, jnp.clip(lengths - 1, 0, t - 1)[
      :, None, None], axis=1)[:, 0]  # [b, d]
  return M.mark_invalid(model.logits(last), new, bad)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(4,))
def _prefill_from_state_jit(graphdef, params, tokens, lengths, state,
                            kv_len):
  TRACE_COUNTS["prefill_from_state"] += 1
  model = nnx.merge(graphdef, params)
  return prefill_from_state_fn(model, tokens, lengths, state, kv_len)


def prefill_from_state(model: M.HybridLM, tokens, lengths,
                       state: S.ModelState, kv_len: int | None = None):
  """Continues every row of `state` over a right-padded chunk of tokens.

  Row r's tokens[r, :lengths[r]] follow the state's state.positions[r]
  tokens, in one parallel pass per layer (see the module docstring); the
  result equals `prefill` of the row's whole prompt up to the summation
  order. Compiled once per shape (pad the chunk to a few fixed widths to
  bound the compiles); the state is donated, as by `prefill` and
  `decode_step`.

  Args:
    model: the HybridLM.
    tokens: [batch, seqlen] int token ids, right-padded.
    lengths: [batch] int, 1 <= lengths <= seqlen, and positions + lengths
      <= the state's max_len when it has attention layers.
    state: a ModelState of this model (from `prefill`, `decode_step`, a
      pool or prefix cache, ...), committed (no pending verify window);
      rows may sit at different positions and points of their replay
      buffers.
    kv_len: optional int, a bound on every row's positions + lengths
      known on the host: the attention layers read their caches' first
      kv_len entries only (in blocks; default: all max_len), and a row
      past it is invalid (NaN logits, position -1). One compile per value.

  Returns:
    (logits [batch, vocab] float32 of each row's last new token, the state
     with positions + lengths).
  """
  check_inputs(model, tokens, lengths, state)
  graphdef, params = nnx.split(model)
  logits, state = _prefill_from_state_jit(
      graphdef, params, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32),
      state, None if kv_len is None else V.positive_int("kv_len", kv_len))
  V.raise_if_invalid(state.positions < 0, "prefill_from_state")
  return logits, state
