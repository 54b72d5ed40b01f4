"""Batched sampling: prefill + a jit-compiled `lax.while_loop` decode.

As in the Flax gemma sampler, the NNX model is split once into graphdef +
params; the jitted function (graphdef static) merges them inside, so
`generate` compiles once per shape and sampling mode (greedy or not, which
filters are on: `SamplingSettings`; the values of temperature, top_k, top_p
and eos_id are traced) and never retraces the model. The decode state is
created outside and donated.

`generate_from_state` runs the same loop from a given decode state and
each row's pending token (e.g. a state restored by
`models.checkpointing.restore_state`), with generate's per-token keys: a
resumed run reproduces the uninterrupted one.
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

F32 = jnp.float32


def check_sampling(temperature, top_k, top_p) -> None:
  if not temperature >= 0:
    raise ValueError(f"temperature must be >= 0 (0: greedy), got "
                     f"{temperature!r}.")
  if top_k is not None:
    V.positive_int("top_k", top_k)
  if top_p is not None and not 0 < top_p <= 1:
    raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}.")


@jax.tree_util.register_pytree_node_class
class SamplingSettings:
  """Sampling settings of a decode loop, unpacked as the tuple (greedy,
  temperature, top_k, top_p) that `sample_logits` / `sampling_probs` /
  `filter_logits` take.

  greedy (a Python bool) and which filters are on (top_k / top_p None when
  off) are static: a jitted loop compiles once per combination and holds no
  conditional on them (an XLA GPU conditional outside a CUDA graph reads its
  predicate on the host, a sync in every iteration of a decode loop; the
  speculative loop also ran both acceptances per iteration before). The
  values of temperature, top_k and top_p are traced: changing them does not
  recompile.
  """

  def __init__(self, greedy: bool, temperature, top_k=None, top_p=None):
    self.greedy = bool(greedy)
    self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

  def __iter__(self):
    return iter((self.greedy, self.temperature, self.top_k, self.top_p))

  def __getitem__(self, i):
    return tuple(self)[i]

  def __repr__(self):
    return (f"SamplingSettings(greedy={self.greedy}, temperature="
            f"{self.temperature}, top_k={self.top_k}, top_p={self.top_p})")

  def tree_flatten(self):
    return (self.temperature, self.top_k, self.top_p), (self.greedy,)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], *children)


def sampling_settings(temperature, top_k, top_p, greedy, rng):
  """Validated `SamplingSettings`: greedy None means temperature == 0; rng
  is required when sampling; top_k / top_p None leave that filter off."""
  check_sampling(temperature, top_k, top_p)
  greedy = (temperature == 0) if greedy is None else bool(greedy)
  if not greedy and temperature <= 0:
    raise ValueError(f"temperature must be > 0 when sampling, got "
                     f"{temperature!r}.")
  if not greedy and rng is None:
    raise ValueError("rng is required when sampling (temperature > 0).")
  return SamplingSettings(
      greedy, _scalar(temperature, np.float32),
      None if top_k is None else _scalar(top_k, np.int32),
      None if top_p is None else _scalar(top_p, np.float32))


def _scalar(x, dtype):
  """x as a 0-d value of dtype: a NumPy scalar for a host number (no
  device op: the jitted call that takes it transfers it), else a jax array
  (a traced or device value)."""
  if isinstance(x, (int, float, np.number)) and not isinstance(x, bool):
    return dtype(x)
  return jnp.asarray(x, dtype)


def seed0_key() -> np.ndarray:
  """`jax.random.PRNGKey(0)` of the current PRNG implementation, on the
  host: no device op per call (a jitted call that takes it transfers
  it)."""
  return _seed0_key(jax.config.jax_default_prng_impl)


@functools.cache
def _seed0_key(impl: str) -> np.ndarray:  # impl: the cache key
  key = np.asarray(jax.random.PRNGKey(0))
  key.flags.writeable = False
  return key


def is_static_flag(flag) -> bool:
  """A Python / NumPy bool (a `SamplingSettings` flag), not a traced one."""
  return isinstance(flag, (bool, np.bool_))


def filter_logits(logits, greedy, temperature, top_k, top_p):
  """The logits that sampling draws from: [..., vocab] f32 -> [..., vocab].

  logits / temperature (1 when greedy), restricted to the top_k (int32; 0
  or None: off) most likely tokens, then to the smallest set of mass >=
  top_p (float; 1 or None: off); excluded tokens are -inf. Settings of a
  `SamplingSettings` (greedy static) sort the vocabulary only if top_k or
  top_p is given; with a traced greedy, a `lax.cond` skips the sort when
  both are off.
  """
  vocab = logits.shape[-1]
  scaled = logits.astype(F32) / (
      (1.0 if greedy else temperature) if is_static_flag(greedy)
      else jnp.where(greedy, 1.0, temperature))
  if top_k is None and top_p is None:
    return scaled
  top_k = jnp.int32(0) if top_k is None else top_k
  top_p = jnp.float32(1.0) if top_p is None else top_p

  def truncate(scaled):
    srt = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take(srt, k - 1, axis=-1)[..., None]  # [..., 1]
    probs = jax.nn.softmax(jnp.where(srt < kth, -jnp.inf, srt), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (>= 1 token).
    n_keep = jnp.sum(jnp.cumsum(probs, axis=-1) - probs < top_p, axis=-1,
                     keepdims=True)
    thresh = jnp.maximum(jnp.take_along_axis(srt, n_keep - 1, axis=-1), kth)
    return jnp.where(scaled < thresh, -jnp.inf, scaled)

  if is_static_flag(greedy):  # SamplingSettings: a filter given is on
    return truncate(scaled)
  # The vocabulary sort is the costly part of the filters: skip it when
  # neither top-k nor top-p is on.
  return jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate, lambda s: s,
                      scaled)


def sampling_probs(logits, greedy, temperature, top_k, top_p):
  """The distribution `sample_logits` draws from: [..., vocab] f32.

  Greedy: one-hot at the argmax; otherwise softmax of `filter_logits`.
  """
  def one_hot():
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1],
                          dtype=F32)

  def soft():
    return jax.nn.softmax(filter_logits(logits, greedy, temperature, top_k,
                                        top_p), axis=-1)

  if is_static_flag(greedy):
    return one_hot() if greedy else soft()
  return jax.lax.cond(greedy, one_hot, soft)


def sample_logits(logits, rng, greedy, temperature, top_k, top_p):
  """logits [b, vocab] f32 -> tokens [b] int32.

  greedy picks the argmax; otherwise `filter_logits` (temperature, top_k,
  top_p) is sampled. A static greedy (`SamplingSettings`) traces one form;
  a traced one a `lax.cond` (under vmap both branches run, same results).
  """
  def argmax():
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample():
    masked = filter_logits(logits, greedy, temperature, top_k, top_p)
    return jax.random.categorical(rng, masked, axis=-1).astype(jnp.int32)

  if is_static_flag(greedy):
    return argmax() if greedy else sample()
  # Greedy decoding skips the sampling work (filtering, Gumbel noise).
  return jax.lax.cond(greedy, argmax, sample)


def eos_tuple(eos_id, vocab_size: int, name: str = "eos_id"):
  """eos_id (None, an int, or a sequence of ints in [0, vocab_size)) as a
  tuple of distinct ints (empty: no eos); errors name `name`."""
  ids = (() if eos_id is None else (eos_id,) if np.ndim(eos_id) == 0
         else tuple(eos_id))

  def as_int(i):  # a Python / NumPy int or a concrete integer scalar
    if isinstance(i, (bool, np.bool_)):
      return None
    if isinstance(i, (int, np.integer)):
      return int(i)
    if (hasattr(i, "dtype") and np.ndim(i) == 0 and V.is_concrete(i)
        and np.issubdtype(i.dtype, np.integer)):
      return int(i)
    return None

  out = [as_int(i) for i in ids]
  if any(i is None or not 0 <= i < vocab_size for i in out):
    raise ValueError(f"{name} must be None, an int or a sequence of ints "
                     f"in [0, vocab_size) = [0, {vocab_size}), got "
                     f"{eos_id!r}.")
  return tuple(dict.fromkeys(out))


def eos_array(eos_id, vocab_size: int):
  """eos_id (as `eos_tuple` takes it) as the [E] int32 array the decode
  loops trace (-1: no eos; E >= 1, so changing the ids' values does not
  recompile, their number does)."""
  return jnp.asarray(list(eos_tuple(eos_id, vocab_size)) or [-1], jnp.int32)


def is_eos(tokens, eos):
  """tokens (any shape) against the eos ids eos [E] (-1: none) -> bool."""
  return jnp.any((eos >= 0) & (tokens[..., None] == eos), axis=-1)


def eos_pad(eos):
  """What a stopped row's later slots hold: the first eos id, 0 without."""
  return jnp.maximum(eos[0], 0)


def check_prompts_and_eos(model: M.HybridLM, prompt_tokens,
                          eos_id) -> tuple[int, int]:
  """Checks the prompt array's rank and eos_id's range -> (batch, P)."""
  eos_array(eos_id, model.config.vocab_size)
  V.check_array("prompt_tokens", prompt_tokens)
  V.check_ndim("prompt_tokens", prompt_tokens, 2, "[batch, seqlen]")
  return prompt_tokens.shape


def _not_finished(max_new_tokens):
  """The decode loops' condition: tokens left and a row not done."""
  def cond(carry):
    i, _, _, _, done, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)
  return cond


def _sample_token(logits, rng, i, out, done, n, sampling, eos_id, pad):
  """One token per row from logits, recorded at column i of out: rows
  already done get pad; a row emitting one of the eos ids (eos_id [E]) is
  done from then on -> (tok, rng, out, done, n)."""
  rng, sub = jax.random.split(rng)
  tok = sample_logits(logits, sub, *sampling)
  tok = jnp.where(done, pad, tok)
  out = out.at[:, i].set(tok)
  n = n + (~done).astype(jnp.int32)
  return tok, rng, out, done | is_eos(tok, eos_id), n


def _generate_body(graphdef, params, tokens, lengths, state, max_new_tokens,
                   implementation, sampling, eos_id, rng):
  M.TRACE_COUNTS["generate"] += 1
  model = nnx.merge(graphdef, params)
  b = tokens.shape[0]
  logits, state = M.prefill_fn(model, tokens, lengths, state)
  pad = eos_pad(eos_id)

  def body(carry):
    i, logits, state, out, done, n, rng = carry
    tok, rng, out, done, n = _sample_token(logits, rng, i, out, done, n,
                                           sampling, eos_id, pad)
    logits, state = model.step(tok, state, implementation)
    return i + 1, logits, state, out, done, n, rng

  out = jnp.full((b, max_new_tokens), pad, jnp.int32)
  # Rows the prefill found invalid (the traced-value policy) never run:
  # tokens -1, length 0.
  invalid = state.positions < 0
  carry = (jnp.int32(0), logits, state, out, invalid,
           jnp.zeros((b,), jnp.int32), rng)
  _, _, state, out, _, n, _ = jax.lax.while_loop(
      _not_finished(max_new_tokens), body, carry)
  return jnp.where(invalid[:, None], -1, out), n, state


# As model.DECODE_JIT_OPTIONS: a test jits the body under chex.
GENERATE_JIT_OPTIONS = dict(static_argnums=(0, 5, 6), donate_argnums=(4,))
_generate_jit = jax.jit(_generate_body, **GENERATE_JIT_OPTIONS)


def generate(model: M.HybridLM, prompt_tokens, prompt_lengths,
             max_new_tokens: int, *, ssm_mode: str = "replay",
             buffer_len: int = 16, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             greedy: bool | None = None, rng=None, eos_id=None,
             implementation: str | None = None, return_state: bool = False,
             **state_kwargs):
  """Samples `max_new_tokens` per row after right-padded prompts.

  Args:
    model: the HybridLM.
    prompt_tokens: [batch, T] int, right-padded.
    prompt_lengths: [batch] int in [1, T].
    max_new_tokens: tokens to generate per row (static).
    ssm_mode, buffer_len: decode state of the Mamba-2 and Gated DeltaNet
      layers ("replay" or "baseline"); further `init_state` keywords (checkpoint_dtype,
      buffer_dtype, kv_dtype, precision, row_ids) go through
      **state_kwargs.
    temperature, top_k, top_p: sampling; temperature 0 (default) is greedy.
      Their values are traced: changing them does not recompile; switching
      between greedy and sampling, or a filter on or off, does once.
    greedy: force greedy (True) or sampling (False); default temperature==0.
    rng: PRNG key (required when sampling).
    eos_id: a row stops after emitting it (an int, or a sequence of ints:
      after any of them); its later slots hold the (first) eos id.
    implementation: implementation of the SSM decode op and the decode
      attention (dispatcher name, see `decode_step`).
    return_state: also return the final decode state.

  Returns:
    (tokens [batch, max_new_tokens] int32, lengths [batch] int32: tokens
     generated per row, eos included) [, final ModelState]. A row whose
     prompt the prefill found invalid under jit (a length or token id out
     of range) generates nothing: tokens -1, length 0.
  """
  max_new_tokens = V.positive_int("max_new_tokens", max_new_tokens)
  sampling = sampling_settings(temperature, top_k, top_p, greedy, rng)
  b, t = check_prompts_and_eos(model, prompt_tokens, eos_id)
  state = model.init_state(b, S.kv_cache_len(t + max_new_tokens),
                           ssm_mode=ssm_mode,
                           buffer_len=buffer_len, **state_kwargs)
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  M.check_prefill_inputs(model, prompt_tokens, lengths, state)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, params = nnx.split(model)
  out, n, state = _generate_jit(graphdef, params, jnp.asarray(prompt_tokens),
                                lengths, state, max_new_tokens,
                                implementation, sampling,
                                eos_array(eos_id, model.config.vocab_size),
                                rng)
  V.raise_if_invalid(state.positions < 0, "generate")
  return (out, n, state) if return_state else (out, n)


def _resume_body(graphdef, params, last_tokens, state, max_new_tokens,
                 implementation, sampling, eos_id, rng, start_step):
  M.TRACE_COUNTS["generate_from_state"] += 1
  model = nnx.merge(graphdef, params)
  b = last_tokens.shape[0]
  pad = eos_pad(eos_id)
  # generate's loop splits its key once per token: the key carried into
  # iteration start_step of that loop.
  rng = jax.lax.fori_loop(0, start_step,
                          lambda _, r: jax.random.split(r)[0], rng)

  def body(carry):
    i, tok, state, out, done, n, rng = carry
    logits, state = model.step(tok, state, implementation)
    tok, rng, out, done, n = _sample_token(logits, rng, i, out, done, n,
                                           sampling, eos_id, pad)
    return i + 1, tok, state, out, done, n, rng

  out = jnp.full((b, max_new_tokens), pad, jnp.int32)
  invalid = state.positions < 0
  # A row whose last token is an eos id has stopped: generate pads it with
  # the first eos id from there on.
  done = invalid | is_eos(last_tokens, eos_id)
  carry = (jnp.int32(0), last_tokens, state, out, done,
           jnp.zeros((b,), jnp.int32), rng)
  _, _, state, out, _, n, _ = jax.lax.while_loop(
      _not_finished(max_new_tokens), body, carry)
  return jnp.where(invalid[:, None], -1, out), n, state


# The state is not donated: the caller's state (e.g. a restored one that
# is resumed more than once) stays alive.
_resume_jit = jax.jit(_resume_body, static_argnums=(0, 4, 5))


def generate_from_state(model: M.HybridLM, state: S.ModelState, last_tokens,
                        max_new_tokens: int, *, start_step: int = 0,
                        temperature: float = 0.0, top_k: int | None = None,
                        top_p: float | None = None,
                        greedy: bool | None = None, rng=None,
                        eos_id=None, implementation: str | None = None):
  """Continues a generation from a decode state (e.g. a restored one).

  `state` holds every token of each row up to, not including, its
  `last_tokens` (the token sampled last, not yet decoded). Each of the
  `max_new_tokens` iterations decodes the pending token and samples the
  next one, so that the returned state again holds everything but the
  last returned token: `(state, tokens[:, -1], start_step +
  max_new_tokens)` is the next resume point, and resumed runs chain
  without decoding a token twice.

  Resuming a `generate` run: after its first n1 tokens t_1..t_n1, the
  state of `prefill` followed by `decode_step` of t_1..t_{n1-1} (or the
  state a previous `generate_from_state` returned), last_tokens t_n1 and
  start_step=n1 give exactly the tokens n1.. of the uninterrupted
  `generate(..., max_new_tokens=n1 + n2)` with the same rng and settings,
  greedy or sampled: `generate` splits its key once per token, and the
  resumed loop first advances `rng` by start_step splits (a traced count:
  no recompilation per start_step). `generate` itself is unchanged (its
  returned state has also decoded its last token).

  Args:
    model: the HybridLM.
    state: a ModelState (not donated: it stays alive, unchanged).
    last_tokens: [batch] int, each row's pending token. A row whose
      pending token is an eos id has stopped: it yields the (first) eos id
      (length 0) and, as in `generate`, its state keeps decoding it.
    max_new_tokens: tokens to sample per row (static).
    start_step: tokens the run sampled before last_tokens' successor, i.e.
      the index of the first returned token in the uninterrupted run
      (keys the sampling; no effect when greedy).
    temperature, top_k, top_p, greedy, rng, eos_id, implementation: as in
      `generate` (rng: the base key of the uninterrupted run).

  Returns:
    (tokens [batch, max_new_tokens] int32, lengths [batch] int32 tokens
     generated per row, eos included, the ModelState holding last_tokens
     and tokens[:, :-1]). The loop stops early once every row has emitted
     eos_id (the state then holds the tokens before the stopping one).
  """
  max_new_tokens = V.positive_int("max_new_tokens", max_new_tokens)
  if isinstance(start_step, bool) or not isinstance(
      start_step, (int, np.integer)) or start_step < 0:
    raise ValueError(f"start_step must be an int >= 0, got "
                     f"{start_step!r}.")
  sampling = sampling_settings(temperature, top_k, top_p, greedy, rng)
  eos_array(eos_id, model.config.vocab_size)
  # pylint: disable=protected-access
  M._check_tokens("last_tokens", last_tokens, 1, "[batch]", model.config)
  M._check_state(state, last_tokens.shape[0], model.config)
  # pylint: enable=protected-access
  if state.max_len is not None and V.is_concrete(state.positions):
    pos = np.asarray(state.positions)
    full = pos + max_new_tokens > state.max_len
    if full.any():
      raise ValueError(
          f"max_new_tokens {max_new_tokens} exceeds the KV cache: rows "
          f"{np.nonzero(full)[0].tolist()} at positions "
          f"{pos[full].tolist()} would pass max_len {state.max_len}.")
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, params = nnx.split(model)
  out, n, state = _resume_jit(graphdef, params,
                              jnp.asarray(last_tokens, jnp.int32), state,
                              max_new_tokens, implementation, sampling,
                              eos_array(eos_id, model.config.vocab_size),
                              rng, jnp.int32(start_step))
  V.raise_if_invalid(state.positions < 0, "generate_from_state")
  return out, n, state
