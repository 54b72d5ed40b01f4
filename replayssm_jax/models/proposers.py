"""Draft proposers for `speculative_generate`.

  Proposer            the protocol (a pytree; init / propose / update).
  NgramProposer       prompt lookup: continue the last n tokens as they went
                      before (stateless, deterministic).
  DraftModelProposer  a small HybridLM drafts autoregressively and commits
                      the accepted prefix as the target does.
  ProposalContext     what the loop passes a proposer each iteration.
  Proposal            the drafts of one window.
"""

# pylint: disable=protected-access

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax.models import model as M
from replayssm_jax.models import parts as PT
from replayssm_jax.models import states as S
from replayssm_jax.models.generate import sample_logits, sampling_probs
from replayssm_jax.models.verify_commit import commit_fn, verify_fn

class ProposalContext(NamedTuple):
  """What the decode loop tells a proposer each iteration (all traced).

  Attributes:
    history: [batch, W] int32 token history per row: the prompt, then the
      generated tokens; entries at or past `length` are meaningless.
    length: [batch] int32 valid history per row (including `last`).
    last: [batch] int32 the last generated token: window position 0, not
      yet processed by the target.
    num_generated: [batch] int32 tokens generated so far (including last).
    active: [batch] bool rows still generating.
    iteration: int32 scalar loop iteration (0-based).
  """
  history: jax.Array
  length: jax.Array
  last: jax.Array
  num_generated: jax.Array
  active: jax.Array
  iteration: jax.Array


class Proposal(NamedTuple):
  """Drafts for one window.

  Attributes:
    drafts: [batch, T-1] int token ids (entries past num_drafts ignored).
    num_drafts: [batch] int in [0, T-1]: valid drafts per row (0: none).
    q: [batch, T-1, vocab] float32 the distribution each draft was drawn
      from (speculative sampling needs it), or None for a deterministic
      proposal (q = one-hot of the drafts).
  """
  drafts: jax.Array
  num_drafts: jax.Array
  q: jax.Array | None


class Proposer:
  """Protocol of draft proposers for `speculative_generate`.

  A proposer is a pytree (register subclasses with
  `jax.tree_util.register_pytree_node_class`): its arrays are leaves, its
  settings static (hashable) aux data, so it can be passed into the jitted
  loop; the loop compiles once per proposer structure and shapes. Its
  per-run state (`pstate`: a pytree whose array leaves all have the batch
  as their leading axis, as a compacting loop gathers its rows) lives in
  the loop carry. All methods but `validate` are traced.
  """

  def validate(self, target: M.HybridLM, *, window: int, ssm_mode: str,
               buffer_len: int) -> None:
    """Raises a clear error if this proposer cannot serve `target` (called
    eagerly, before compiling)."""
    del target, window, ssm_mode, buffer_len

  def init(self, prompt_tokens, prompt_lengths, *, max_len: int,
           window: int, ssm_mode: str, buffer_len: int):
    """The proposer state after the prompts ([batch, P] right-padded,
    [batch]); max_len: KV room the loop needs per row; ssm_mode and
    buffer_len: the target's (defaults for a draft model)."""
    raise NotImplementedError

  def propose(self, pstate, ctx: ProposalContext, window: int, rng,
              sampling) -> tuple[Proposal, Any]:
    """Up to window - 1 drafts per row following ctx.last; `sampling` is the
    loop's `generate.SamplingSettings` (unpacks as the (greedy, temperature,
    top_k, top_p) of `generate.sample_logits`; greedy a Python bool).
    Returns (Proposal, new pstate)."""
    raise NotImplementedError

  def update(self, pstate, ctx: ProposalContext, window_tokens,
             num_accepted, active):
    """After the target's verdict: window_tokens [batch, T] (ctx.last, then
    the drafts as verified), num_accepted [batch] in [1, T] window tokens
    that became history (rows with active False: none). Returns the new
    pstate."""
    del ctx, window_tokens, num_accepted, active
    return pstate


@jax.tree_util.register_pytree_node_class
class NgramProposer(Proposer):
  """Prompt lookup: continue the last n tokens as they went before.

  Each iteration a row's history (prompt + generated) is searched for the
  most recent earlier occurrence of its last `n` tokens; the tokens that
  followed it (at most window - 1, only ones already in the history) are the
  drafts. If there is none, shorter suffixes down to `min_n` are tried; if
  none matches, the row proposes nothing this step. Deterministic (q is
  one-hot), stateless.
  """

  def __init__(self, n: int = 3, min_n: int = 1):
    n, min_n = V.positive_int("n", n), V.positive_int("min_n", min_n)
    if min_n > n:
      raise ValueError(f"min_n ({min_n}) must be <= n ({n}).")
    self.n, self.min_n = n, min_n

  def tree_flatten(self):
    return (), (self.n, self.min_n)

  @classmethod
  def tree_unflatten(cls, aux, children):
    del children
    return cls(*aux)

  def __repr__(self):
    return f"NgramProposer(n={self.n}, min_n={self.min_n})"

  def init(self, prompt_tokens, prompt_lengths, **unused):
    return ()

  def propose(self, pstate, ctx, window, rng, sampling):
    del rng, sampling
    hist, ln = ctx.history, ctx.length
    b, w = hist.shape
    starts = jnp.arange(w)[None, :]  # [1, W] candidate match starts
    best = jnp.full((b,), -1, jnp.int32)  # continuation start, -1: none
    for m in range(self.n, self.min_n - 1, -1):  # longest suffix first
      sidx = jnp.clip(ln[:, None] - m + jnp.arange(m)[None, :], 0, w - 1)
      suffix = jnp.take_along_axis(hist, sidx, axis=1)  # [b, m]
      padded = jnp.pad(hist, ((0, 0), (0, m)))
      match = jnp.ones((b, w), bool)
      for k in range(m):
        match = match & (padded[:, k:k + w] == suffix[:, k:k + 1])
      # An earlier occurrence followed by >= 1 known token.
      match = match & (starts + m < ln[:, None]) & (ln[:, None] >= m)
      i = jnp.max(jnp.where(match, starts, -1), axis=1)
      best = jnp.where((best < 0) & (i >= 0), i + m, best)
    t1 = window - 1
    idx = jnp.clip(best[:, None] + jnp.arange(t1)[None, :], 0, w - 1)
    drafts = jnp.take_along_axis(hist, idx, axis=1)
    nd = jnp.where(best >= 0, jnp.clip(ln - best, 0, t1), 0)
    return Proposal(drafts.astype(jnp.int32), nd.astype(jnp.int32),
                    None), pstate


@jax.tree_util.register_pytree_node_class
class DraftModelProposer(Proposer):
  """A (small) HybridLM drafts window - 1 tokens autoregressively.

  The draft keeps its own ModelState, committed through the same tokens as
  the target. Each iteration it decodes window - 1 steps from (a copy of)
  its committed state, greedy or sampled with the loop's settings (q = its
  sampling distribution); after the verdict it verifies the window itself
  and commits the accepted prefix, so it rolls back exactly as the target
  does (its rejected tokens never enter its state).

  Args:
    draft_model: any HybridLM with the target's vocab_size.
    ssm_mode, buffer_len: the draft's decode state (None: the target's).
    implementation: implementation of the kernel ops (SSM op and decode
      attention) of the draft's steps / verify.
  """

  def __init__(self, draft_model: M.HybridLM, *, ssm_mode: str | None = None,
               buffer_len: int | None = None,
               implementation: str | None = None):
    if not isinstance(draft_model, M.HybridLM):
      raise TypeError(f"draft_model must be a HybridLM, got "
                      f"{type(draft_model).__name__}.")
    if ssm_mode is not None and ssm_mode not in S.SSM_MODES:
      raise ValueError(f"ssm_mode must be None or one of {S.SSM_MODES}, got "
                       f"{ssm_mode!r}.")
    if buffer_len is not None:
      buffer_len = V.positive_int("buffer_len", buffer_len)
    # The graph hashed once and the parameters flat (`parts.flat_parts`):
    # the proposer is an argument of every jitted speculative call.
    graphdef, params = PT.flat_parts(*nnx.split(draft_model))
    self._set(draft_model.config, graphdef, params, ssm_mode, buffer_len,
              implementation)

  def _set(self, config, graphdef, params, ssm_mode, buffer_len,
           implementation):
    self.config, self.graphdef, self.params = config, graphdef, params
    self.ssm_mode, self.buffer_len = ssm_mode, buffer_len
    self.implementation = implementation

  def tree_flatten(self):
    return (self.params,), (self.config, self.graphdef, self.ssm_mode,
                            self.buffer_len, self.implementation)

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)
    config, graphdef, ssm_mode, buffer_len, implementation = aux
    obj._set(config, graphdef, children[0], ssm_mode, buffer_len,
             implementation)
    return obj

  def __repr__(self):
    return (f"DraftModelProposer(pattern={self.config.pattern!r}, "
            f"d_model={self.config.d_model}, ssm_mode={self.ssm_mode!r}, "
            f"buffer_len={self.buffer_len!r})")

  def _model(self):
    return PT.merge(self.graphdef, self.params)

  def _mode(self, ssm_mode, buffer_len):
    return (self.ssm_mode or ssm_mode,
            buffer_len if self.buffer_len is None else self.buffer_len)

  def validate(self, target, *, window, ssm_mode, buffer_len):
    if self.config.vocab_size != target.config.vocab_size:
      raise ValueError(f"the draft model's vocab_size "
                       f"({self.config.vocab_size}) must equal the target's "
                       f"({target.config.vocab_size}).")
    mode, bl = self._mode(ssm_mode, buffer_len)
    if mode == "replay" and "M" in self.config.pattern and bl <= window:
      raise ValueError(f"the draft model's replay buffer_len ({bl}) must "
                       f"exceed the window ({window}).")

  def init(self, prompt_tokens, prompt_lengths, *, max_len, window,
           ssm_mode, buffer_len):
    del window
    model = self._model()
    mode, bl = self._mode(ssm_mode, buffer_len)
    state = model.init_state(prompt_tokens.shape[0], max_len, ssm_mode=mode,
                             buffer_len=bl)
    _, state = M.prefill_fn(model, prompt_tokens, prompt_lengths, state)
    return state

  def propose(self, pstate, ctx, window, rng, sampling):
    b = ctx.last.shape[0]
    t1 = window - 1
    if t1 == 0:
      return Proposal(jnp.zeros((b, 0), jnp.int32), jnp.zeros((b,), jnp.int32),
                      None), pstate
    model = self._model()

    def body(carry, key):
      tok, st = carry
      logits, st = model.step(tok, st, self.implementation)
      q = sampling_probs(logits, *sampling)
      d = sample_logits(logits, key, *sampling)
      return (d, st), (d, q)

    # Scratch steps from the committed state; it is resynced in `update`.
    _, (drafts, q) = jax.lax.scan(body, (ctx.last, pstate),
                                  jax.random.split(rng, t1))
    return Proposal(jnp.swapaxes(drafts, 0, 1), jnp.full((b,), t1, jnp.int32),
                    jnp.swapaxes(q, 0, 1)), pstate

  def update(self, pstate, ctx, window_tokens, num_accepted, active):
    del ctx
    _, pending = verify_fn(self._model(), window_tokens, pstate,
                           self.implementation)
    return commit_fn(pending, num_accepted, active)
