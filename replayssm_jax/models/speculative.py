"""Speculative decoding for the hybrid LM: verify a window, commit a prefix.

  logits, pending = verify(model, window_tokens, state)   # [b, T, vocab]
  state = commit(pending, num_accepted)                   # [b] in [1, T]
  tokens, n, stats = speculative_generate(target, proposer, prompts,
                                          lengths, max_new_tokens, window)

`verify` runs a window of T tokens per row (the last sampled token and T-1
drafts) through every block in one parallel pass per layer, from the
committed decode state:
  * Mamba-2: in_proj over the window, causal conv from the conv state, SSM
    outputs from `replayssm_jax.replay_verify` (replay mode: checkpoint +
    buffer, no per-token state) or `baseline_verify` (baseline mode: one
    full SSM state snapshot per window position, what engines do today);
  * attention: the T new keys/values go to positions length .. length+T-1
    of the KV cache and each query attends to the cache prefix plus the
    window up to itself;
  * MLP: position-wise.
`commit` makes the first num_accepted window tokens of each row history:
the replay SSM state by a counter move (`replay_commit`), the baseline one by
picking a snapshot (`baseline_commit`), the conv state by taking the last
conv_kernel - 1 inputs of (committed window ++ accepted inputs), the KV cache
by setting length (rejected entries are overwritten later) and positions by
+= num_accepted.

`speculative_generate` is the decode loop (one jit-compiled
`lax.while_loop`) with greedy acceptance or standard speculative sampling;
drafts come from a `Proposer`: `DraftModelProposer` (a small HybridLM) or
`NgramProposer` (prompt lookup).
"""

# pylint: disable=protected-access  (model.py's input checks are shared)

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.models.generate import (check_prompts_and_eos,
                                           filter_logits, is_static_flag,
                                           sample_logits, sampling_probs,
                                           sampling_settings)
from replayssm_jax.models.layers import check_speculative_precision
from replayssm_jax.speculative import baseline_commit, replay_commit
from replayssm_jax.state import ReplayState

F32 = jnp.float32


# ------------------------------------------------------------ verify/commit
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingState:
  """The decode state between `verify` and `commit`.

  Attributes:
    state: the committed ModelState with the window written where that costs
      nothing to undo: replay SSM states hold the window's inputs behind the
      committed history (count unchanged; rows that had to flush hold the
      committed history folded into the checkpoint), KV caches hold the
      window's keys/values past `length` (length unchanged); conv states,
      baseline SSM states and positions are the committed ones.
    window_conv_inputs: per layer, [batch, T, conv_dim] pre-conv inputs of
      the window (Mamba layers, conv-state dtype) or None.
    snapshots: per layer, [batch, T, H, P, N] SSM state after each window
      position (baseline-mode Mamba layers) or None.
    window: T (static).
  """
  state: S.ModelState
  window_conv_inputs: tuple
  snapshots: tuple
  window: int = dataclasses.field(metadata=dict(static=True))

  @property
  def batch(self) -> int:
    return self.state.batch


def verify_fn(model: M.HybridLM, tokens, state: S.ModelState,
              implementation: str | None = None):
  """Traceable `verify` (inputs already validated).

  A row whose KV cache cannot take the window (length + T > max_len), with
  a token id out of range, or already invalid gets NaN logits and position
  -1 (`model.mark_invalid`) instead of silently wrong ones.
  """
  t = tokens.shape[1]
  bad = M.invalid_rows(tokens, state, model.config.vocab_size, window=t)
  x = model.embeddings(tokens).astype(jnp.float32)  # [b, T, d] residual
  y, layers, convs, snaps = None, [], [], []
  for block, s, layer in zip(model.blocks, state.layers,
                            model.mamba_indices()):
    # As the decode step: each residual add and the next norm as one op.
    x, h = model.add_norm(x, y, block.norm, implementation)
    y, pend = block.verify(h, s, implementation, layer)
    if block.kind == "mamba":
      ssm, win, snap = pend
      layers.append(s.replace(ssm=ssm))
      convs.append(win)
      snaps.append(snap)
    else:
      layers.append(pend)
      convs.append(None)
      snaps.append(None)
  _, h = model.add_norm(x, y, model.norm_f, implementation)
  logits, committed = M.mark_invalid(
      model.head(h),  # [b, T, vocab] f32
      S.ModelState(layers=tuple(layers), positions=state.positions), bad)
  pending = PendingState(
      state=committed, window_conv_inputs=tuple(convs),
      snapshots=tuple(snaps), window=t)
  return logits, pending


def commit_fn(pending: PendingState, num_accepted, active=None):
  """Traceable `commit`; rows with active False (if given) keep their
  committed state (the window is dropped, num_accepted ignored)."""
  t = pending.window
  n = jnp.asarray(num_accepted, jnp.int32)
  # Tokens that become history: n, or 0 for inactive rows.
  moved = n if active is None else jnp.where(active, n, 0)
  layers = []
  for s, win, snap in zip(pending.state.layers, pending.window_conv_inputs,
                          pending.snapshots):
    if isinstance(s, S.MambaState):
      k1 = s.conv.shape[1]
      # [b, k-1+T, conv_dim], oldest first
      cat = jnp.concatenate([s.ordered_conv(), win], axis=1)
      idx = moved[:, None] + jnp.arange(k1)[None, :]  # [b, k-1]
      conv = jnp.take_along_axis(cat, idx[..., None], axis=1)
      if isinstance(s.ssm, ReplayState):
        ssm = replay_commit(s.ssm, n if active is None
                            else jnp.where(active, n, 1), t)
        if active is not None:  # inactive: the committed history only
          keep = {f: jnp.where(active, getattr(ssm, f), getattr(s.ssm, f))
                  for f in ("count", "step") if getattr(ssm, f) is not None}
          ssm = ssm.replace(**keep)
      else:
        ssm = baseline_commit(snap, n)
        if active is not None:
          ssm = jnp.where(active[:, None, None, None], ssm, s.ssm)
      layers.append(s.with_ordered_conv(conv).replace(ssm=ssm))
    elif isinstance(s, S.AttentionState):
      layers.append(s.replace(length=s.length + moved))
    else:
      layers.append(s)
  # An invalid row (position -1) stays so, as does a row whose accepted
  # count is out of range (under jit).
  pos = pending.state.positions
  out_of_range = (n < 1) | (n > t)
  bad = (pos < 0) | (out_of_range if active is None
                     else active & out_of_range)
  return S.ModelState(layers=tuple(layers),
                      positions=jnp.where(bad, -1, pos + moved))


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(3,))
def _verify_jit(graphdef, params, tokens, state, implementation):
  M.TRACE_COUNTS["verify"] += 1
  return verify_fn(nnx.merge(graphdef, params), tokens, state, implementation)


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _commit_jit(state, window_data, num_accepted, window):
  """Donates the state part only (the window data has no output to reuse
  its buffers)."""
  M.TRACE_COUNTS["commit"] += 1
  return commit_fn(PendingState(state, *window_data, window=window),
                   num_accepted)


def _check_window_room(state: S.ModelState, t: int, what: str) -> None:
  """Replay buffers must exceed T; KV caches need T free slots per row;
  baseline states' precision policies must be plain
  (`check_speculative_precision`)."""
  for i, s in enumerate(state.layers):
    if isinstance(s, S.MambaState):
      check_speculative_precision(s, what)
    if isinstance(s, S.MambaState) and isinstance(s.ssm, ReplayState):
      if s.ssm.buffer_len <= t:
        raise ValueError(
            f"{what}: the replay buffer_len ({s.ssm.buffer_len}, layer {i}) "
            f"must exceed the window T ({t}); create the state with "
            f"buffer_len > T.")
    if isinstance(s, S.AttentionState) and V.is_concrete(s.length):
      ln = np.asarray(s.length)
      bad = ln + t > s.max_len
      if bad.any():
        rows = np.nonzero(bad)[0][:8].tolist()
        raise ValueError(
            f"{what}: the KV cache (max_len {s.max_len}) has no room for a "
            f"window of T = {t} tokens: rows {rows} hold {ln[rows].tolist()} "
            f"tokens (> max_len - T = {s.max_len - t}); create the state "
            f"with a larger max_len.")


def verify(model: M.HybridLM, tokens, state: S.ModelState,
           implementation: str | None = None):
  """Logits of a window of T tokens per row, in one parallel pass.

  Args:
    model: the HybridLM.
    tokens: [batch, T] int window (position 0: the last sampled token, not
      yet in `state`; then the drafts).
    state: the committed ModelState (donated). A replay state takes any
      `init_state(precision=policy)` (read copies and stochastic rounding:
      see `replayssm_jax.replay_verify`); a baseline state plain policies
      only (others raise a ValueError naming `precision`).
    implementation: implementation of the window's kernel ops: the SSM op
      (`replay_verify` in replay mode, `baseline_verify` in baseline mode)
      and `ops.decode_attention`.

  Returns:
    (logits [batch, T, vocab] float32: logits[:, s] predicts the token after
     window position s, equal to stepping `decode_step` over the window;
     PendingState for `commit`).
  """
  if not isinstance(model, M.HybridLM):
    raise TypeError(f"model must be a HybridLM, got {type(model).__name__}.")
  M._check_tokens("tokens", tokens, 2, "[batch, T]", model.config)
  b, t = tokens.shape
  if t < 1:
    raise ValueError("tokens must hold a window of T >= 1 tokens per row, "
                     "got T = 0.")
  M._check_state(state, b, model.config)
  _check_window_room(state, t, "verify")
  graphdef, params = nnx.split(model)
  logits, pending = _verify_jit(graphdef, params,
                                jnp.asarray(tokens, jnp.int32), state,
                                implementation)
  V.raise_if_invalid(pending.state.positions < 0, "verify")
  return logits, pending


def commit(pending: PendingState, num_accepted):
  """Makes the first num_accepted window tokens of each row history.

  Args:
    pending: the PendingState from `verify` (donated).
    num_accepted: [batch] int in [1, T]: accepted tokens per row, counting
      the window's first (already sampled) token.

  Returns:
    The committed ModelState: equal (up to float association order) to the
    state of decoding the accepted tokens one by one. Under jit an
    out-of-range num_accepted makes a replay-mode row NaN from then on
    (`replay_commit`), never silently wrong.
  """
  if not isinstance(pending, PendingState):
    raise TypeError(f"pending must be a PendingState (from verify), got "
                    f"{type(pending).__name__}.")
  V.check_num_accepted(num_accepted, pending.batch, pending.window)
  state = _commit_jit(pending.state, (pending.window_conv_inputs,
                                      pending.snapshots),
                      jnp.asarray(num_accepted, jnp.int32), pending.window)
  V.raise_if_invalid(state.positions < 0, "commit")
  return state


# ---------------------------------------------------------------- proposers
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
    graphdef, params = nnx.split(draft_model)
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
    return nnx.merge(self.graphdef, self.params)

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


# ---------------------------------------------------------------- acceptance
def accept(logits, drafts, num_drafts, q, sampling, rng):
  """Acceptance of one verified window per row.

  Args:
    logits: [batch, T, vocab] target logits of the window.
    drafts: [batch, T-1] draft tokens (window positions 1..T-1).
    num_drafts: [batch] valid drafts per row (the rest are never accepted).
    q: [batch, T-1, vocab] draft distributions or None (one-hot drafts).
    sampling: `generate.SamplingSettings` (or a tuple (greedy, temperature,
      top_k, top_p) of traced values: then both acceptances run).
    rng: PRNG key (unused when greedy).

  Returns:
    (accepted drafts [batch] int32 in [0, num_drafts], next token [batch]
     int32). Greedy: the longest prefix of drafts equal to the target's
    argmax, then the argmax after it (the correction, or the bonus token
    when all are accepted). Sampling: draft d at position s is accepted with
    probability min(1, p_s(d) / q_s(d)) (p: the target's distribution after
    temperature / top-k / top-p, as `generate` samples it); at the first
    rejection the next token is drawn from normalize(max(p_s - q_s, 0)), or
    from p after the last valid draft. The emitted tokens are then
    distributed exactly as sampling the target token by token.
  """
  b, t, vocab = logits.shape
  t1 = t - 1
  valid = jnp.arange(t1)[None, :] < num_drafts[:, None]  # [b, T-1]
  rows = jnp.arange(b)

  def accepted(ok):
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

  def greedy_accept():
    top = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b, T]
    a = accepted((drafts == top[:, :t1]) & valid)
    return a, top[rows, a]

  def sample_accept():
    # p_s = softmax(masked_s) is never materialized over [b, T, vocab]: the
    # acceptance needs p_s(d) (a gather minus the log-normalizer) and the
    # residual needs p at one position per row.
    masked = filter_logits(logits, *sampling)  # [b, T, vocab], -inf = out
    lse = jax.nn.logsumexp(masked, axis=-1)  # [b, T]
    k_u, k_s = jax.random.split(rng)

    def probs_at(s):  # [b] positions -> p_s [b, vocab]
      return jnp.exp(masked[rows, s] - lse[rows, s][:, None])

    if t1:
      qf = jax.nn.one_hot(drafts, vocab, dtype=F32) if q is None else q
      md = jnp.take_along_axis(masked[:, :t1], drafts[..., None], -1)[..., 0]
      pd = jnp.exp(md - lse[:, :t1])
      qd = jnp.take_along_axis(qf, drafts[..., None], -1)[..., 0]
      u = jax.random.uniform(k_u, (b, t1), F32)
      a = accepted((u * qd < pd) & valid)  # u < p/q, q > 0 for a draw
      p_a = probs_at(a)
      resid = jnp.maximum(p_a - qf[rows, jnp.minimum(a, t1 - 1)], 0.0)
      z = jnp.sum(resid, axis=-1, keepdims=True)
      rejected = (a < num_drafts)[:, None] & (z > 0)
      dist = jnp.where(rejected, resid / jnp.where(z > 0, z, 1.0), p_a)
    else:
      a = jnp.zeros((b,), jnp.int32)
      dist = probs_at(a)
    return a, jax.random.categorical(k_s, jnp.log(dist), axis=-1)

  greedy = sampling[0]
  if is_static_flag(greedy):  # SamplingSettings: one form
    a, nxt = greedy_accept() if greedy else sample_accept()
    return a.astype(jnp.int32), nxt.astype(jnp.int32)
  # A traced greedy flag: both forms run and it selects (no lax.cond: an
  # XLA GPU conditional outside a CUDA graph reads its predicate on the
  # host, a sync in every iteration of the decode loop).
  a_greedy, next_greedy = greedy_accept()
  a_samp, next_samp = sample_accept()
  return (jnp.where(greedy, a_greedy, a_samp).astype(jnp.int32),
          jnp.where(greedy, next_greedy, next_samp).astype(jnp.int32))


# ------------------------------------------------------------- decode loop
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecStats:
  """Statistics of a `speculative_generate` run.

  Attributes:
    iterations: int32 scalar, verify steps of the loop (all rows at once).
    verify_steps: [batch] int32 iterations in which the row was active.
    accepted_drafts: [batch] int32 drafts accepted per row.
    mean_accepted_length: float32 scalar, tokens per row per verify step
      (accepted drafts + the target's own token), averaged over active
      (row, step) pairs; before truncation at max_new_tokens / eos.
  """
  iterations: jax.Array
  verify_steps: jax.Array
  accepted_drafts: jax.Array
  mean_accepted_length: jax.Array


def compaction_sizes(batch: int, compaction: int) -> tuple[int, ...]:
  """The loop's batch per phase: batch, then halved (rounded up) up to
  `compaction` times while that shrinks it."""
  sizes = [batch]
  for _ in range(compaction):
    if sizes[-1] == 1:
      break
    sizes.append(-(-sizes[-1] // 2))
  return tuple(sizes)


def _take_rows(tree, idx):
  """Rows idx of every array leaf (all batch-leading)."""
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


def _put_rows(full, part, idx):
  """full with rows idx replaced by part's, leaf by leaf."""
  return jax.tree.map(lambda f, p: f.at[idx].set(p), full, part)


# Carry fields of the decode loop (see `_spec_jit`'s body): the per-row ones
# a compaction gathers, and those of them the results need from every row.
_ROW_FIELDS = (1, 2, 3, 4, 5, 6, 7, 9, 10)
_RESULT_FIELDS = (2, 3, 4, 9, 10)  # hist, hlen, gen, acc, steps
_STATE_FIELD = 6


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9, 14, 15),
                   donate_argnums=(4,))
def _spec_jit(graphdef, params, tokens, lengths, state, max_new_tokens,
              window, implementation, ssm_mode, buffer_len, proposer,
              sampling, eos_id, rng, compaction=0, keep_state=True):
  M.TRACE_COUNTS["speculative_generate"] += 1
  target = nnx.merge(graphdef, params)
  b, p_len = tokens.shape
  t, t1 = window, window - 1
  w = p_len + max_new_tokens  # history width
  max_len = state.max_len if state.max_len is not None else w + t
  rows = jnp.arange(b)
  pad = jnp.maximum(eos_id, 0)  # eos_id < 0: no eos

  logits, state = M.prefill_fn(target, tokens, lengths, state)
  pstate = proposer.init(tokens, lengths, max_len=max_len, window=t,
                         ssm_mode=ssm_mode, buffer_len=buffer_len)
  rng, k0 = jax.random.split(rng)
  first = sample_logits(logits, k0, *sampling)
  cols = jnp.arange(w)[None, :]
  hist = jnp.where(cols < lengths[:, None],
                   jnp.pad(tokens, ((0, 0), (0, max_new_tokens))), 0)
  hist = hist.at[rows, lengths].set(first).astype(jnp.int32)
  invalid = state.positions < 0  # (the traced-value policy) never run
  done = (first == eos_id) | (max_new_tokens <= 1) | invalid
  zeros = jnp.zeros((b,), jnp.int32)
  carry = (jnp.int32(0), first, hist, lengths + 1, zeros + 1, done, state,
           pstate, rng, zeros, zeros)

  def cond(c):
    return (c[0] < max_new_tokens) & ~jnp.all(c[5])

  def body(c):
    (it, last, hist, hlen, gen, done, state, pstate, rng, acc,
     steps) = c
    rows = jnp.arange(last.shape[0])  # this phase's batch
    active = ~done
    rng, k_prop, k_acc = jax.random.split(rng, 3)
    ctx = ProposalContext(history=hist, length=hlen, last=last,
                          num_generated=gen, active=active, iteration=it)
    prop, pstate = proposer.propose(pstate, ctx, t, k_prop, sampling)
    nd = jnp.clip(jnp.asarray(prop.num_drafts, jnp.int32), 0, t1)
    drafts = jnp.where(jnp.arange(t1)[None, :] < nd[:, None],
                       jnp.asarray(prop.drafts, jnp.int32), 0)
    drafts = jnp.clip(drafts, 0, target.config.vocab_size - 1)
    win = jnp.concatenate([last[:, None], drafts], axis=1)  # [b, T]
    logits, pending = verify_fn(target, win, state, implementation)
    a, nxt = accept(logits, drafts, nd, prop.q, sampling, k_acc)
    a = a.astype(jnp.int32)  # (int64 argmaxes with JAX_ENABLE_X64)
    # Emitted this step: the a accepted drafts, then the target's token.
    j = jnp.arange(t)[None, :]
    emitted = jnp.where(j < a[:, None], jnp.roll(win, -1, axis=1),
                        nxt[:, None])
    count = jnp.minimum(a + 1, max_new_tokens - gen)
    is_eos = (emitted == eos_id) & (j < count[:, None])
    hit = jnp.any(is_eos, axis=1)
    count = jnp.where(hit, jnp.argmax(is_eos, axis=1) + 1, count)
    count = jnp.where(active, count, 0).astype(jnp.int32)
    pos = jnp.where(j < count[:, None], hlen[:, None] + j, w)
    hist = hist.at[rows[:, None], pos].set(emitted, mode="drop")
    # History gains last + the emitted tokens but the final one.
    n_commit = jnp.where(active, jnp.minimum(a + 1, count), 1)
    state = commit_fn(pending, n_commit, active)
    pstate = proposer.update(pstate, ctx, win, n_commit, active)
    last = jnp.where(active, emitted[rows, jnp.maximum(count - 1, 0)], last)
    gen = gen + count
    done = done | (gen >= max_new_tokens) | hit
    acc = acc + jnp.where(active, a, 0)
    steps = steps + active.astype(jnp.int32)
    return (it + 1, last, hist, hlen + count, gen, done, state, pstate, rng,
            acc, steps)

  # Phases of halving batch (`compaction`): a phase ends when its active
  # rows fit the next one's batch, which takes them (done rows fill it up)
  # and leaves the finished rows' results (and final states) behind.
  sizes = compaction_sizes(b, compaction)
  fields = _RESULT_FIELDS + ((_STATE_FIELD,) if keep_state else ())
  full, home = None, rows  # home: each carried row's index in the batch
  for k in range(len(sizes)):
    nxt = sizes[k + 1] if k + 1 < len(sizes) else 0

    def phase_cond(c, nxt=nxt):
      go = cond(c)
      return go & (jnp.sum(~c[5]) > nxt) if nxt else go

    carry = jax.lax.while_loop(phase_cond, body, carry)
    if k == 0:
      # The whole batch's state after the first phase: the output when the
      # caller does not want the final state (it aliases the donated input
      # state, which then is neither copied nor left unused).
      first_state = carry[_STATE_FIELD]
    if nxt:
      part = tuple(carry[i] for i in fields)
      full = part if full is None else _put_rows(full, part, home)
      keep = jnp.argsort(carry[5], stable=True)[:nxt]  # active rows first
      home = home[keep]
      carry = tuple(_take_rows(x, keep) if i in _ROW_FIELDS else x
                    for i, x in enumerate(carry))
  if full is not None:
    full = _put_rows(full, tuple(carry[i] for i in fields), home)
    carry = list(carry)
    for i, x in zip(fields, full):
      carry[i] = x
  it, _, hist, hlen, gen, _, state, _, _, acc, steps = carry
  if not keep_state:
    state = first_state  # discarded by speculative_generate
  idx = lengths[:, None] + jnp.arange(max_new_tokens)[None, :]
  out = jnp.take_along_axis(hist, jnp.clip(idx, 0, w - 1), axis=1)
  out = jnp.where(idx < hlen[:, None], out, pad)
  out = jnp.where(invalid[:, None], -1, out).astype(jnp.int32)
  gen = jnp.where(invalid, 0, gen)
  total = jnp.maximum(jnp.sum(steps), 1)
  stats = SpecStats(iterations=it, verify_steps=steps, accepted_drafts=acc,
                    mean_accepted_length=(jnp.sum(acc + steps) /
                                          total).astype(F32))
  return out, gen, stats, state


def speculative_generate(target: M.HybridLM, proposer: Proposer,
                         prompt_tokens, prompt_lengths, max_new_tokens: int,
                         window: int, *, ssm_mode: str = "replay",
                         buffer_len: int = 16, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None,
                         greedy: bool | None = None, rng=None,
                         eos_id: int | None = None,
                         implementation: str | None = None,
                         return_state: bool = False, compaction: int = 0,
                         **state_kwargs):
  """Speculative decoding of `max_new_tokens` per row after the prompts.

  Prefill, then the target's first token is sampled as in `generate`; each
  iteration of one jit-compiled `lax.while_loop` (compiled once per shape,
  proposer structure, static setting and sampling mode, as `generate`; the
  values of the sampling settings and eos_id are traced) then: the
  proposer gives up to window - 1 drafts per row; the target verifies
  [last token, drafts] in one parallel pass (`verify`; rows with fewer
  drafts pad and cannot accept the padding); acceptance (`accept`) emits
  the accepted drafts and one target token; target and proposer commit the
  accepted prefix (rollback of the rest). Rows that are done
  (max_new_tokens reached or eos emitted) keep their state.

  Greedy output equals `generate`'s token for token (up to argmax ties
  under float association order); sampled output is distributed as
  `generate`'s (standard speculative sampling).

  Args:
    target: the HybridLM whose distribution is sampled.
    proposer: a `Proposer` (`DraftModelProposer`, `NgramProposer`, ...).
    prompt_tokens: [batch, P] int, right-padded.
    prompt_lengths: [batch] int in [1, P].
    max_new_tokens: tokens to generate per row (static).
    window: T >= 1 window tokens per verify (T - 1 drafts; static).
    ssm_mode: "replay" or "baseline" (snapshot per window position) target
      state; buffer_len: the replay buffer length (> window); further
      `init_state` keywords (checkpoint_dtype, buffer_dtype, kv_dtype,
      precision and row_ids: see `verify`) via **state_kwargs.
    temperature, top_k, top_p, greedy, rng: sampling, as in `generate`.
    eos_id: a row stops after emitting it; later slots hold eos_id.
    implementation: implementation of the target's kernel ops (SSM op and
      decode attention; dispatcher name).
    return_state: also return the target's final ModelState: it holds the
      prompt and every generated token but each row's last (positions =
      prompt_lengths + num_generated - 1; feed that token to `decode_step`
      to continue).
    compaction: how many times the loop may halve its batch (static; 0:
      never). Rows finish after different numbers of verify steps, and a
      static batch keeps paying for its finished rows until the last one is
      done; with compaction k, once the active rows fit in half the batch
      (rounded up), they move to a loop over that half (their states, the
      proposer state and the bookkeeping gathered; the finished rows'
      results, and with return_state their states, kept aside), up to k
      times. Costs one gather of the active rows' states per halving (the
      full batch's state stays allocated to the end) and one more compiled
      loop body per halving. Greedy output is unchanged;
      sampled output keeps its distribution but draws other random numbers
      (the draws depend on the batch size).

  Returns:
    (tokens [batch, max_new_tokens] int32 (after a row's end: eos_id, or 0
     without eos), num_generated [batch] int32 (eos included), SpecStats
     [, final ModelState]). A row whose prompt the prefill found invalid
     under jit (a length or token id out of range) generates nothing:
     tokens -1, num_generated 0.
  """
  if not isinstance(target, M.HybridLM):
    raise TypeError(f"target must be a HybridLM, got "
                    f"{type(target).__name__}.")
  if not isinstance(proposer, Proposer):
    raise TypeError(f"proposer must be a Proposer (DraftModelProposer, "
                    f"NgramProposer, ...), got {type(proposer).__name__}.")
  max_new_tokens = V.positive_int("max_new_tokens", max_new_tokens)
  window = V.positive_int("window", window)
  if ssm_mode not in S.SSM_MODES:
    raise ValueError(f"ssm_mode must be one of {S.SSM_MODES}, got "
                     f"{ssm_mode!r}.")
  buffer_len = V.positive_int("buffer_len", buffer_len)
  if isinstance(compaction, bool) or not isinstance(
      compaction, int) or compaction < 0:
    raise ValueError(f"compaction must be an int >= 0 (how many times the "
                     f"loop may halve its batch), got {compaction!r}.")
  if ssm_mode == "replay" and buffer_len <= window:
    raise ValueError(f"buffer_len ({buffer_len}) must exceed window "
                     f"({window}) in replay mode: a window is placed behind "
                     f"the committed history in the replay buffer.")
  sampling = sampling_settings(temperature, top_k, top_p, greedy, rng)
  b, p_len = check_prompts_and_eos(target, prompt_tokens, eos_id)
  # Room: verify writes up to position P + max_new_tokens + window - 3.
  max_len = S.kv_cache_len(p_len + max_new_tokens + window)
  state = target.init_state(b, max_len, ssm_mode=ssm_mode,
                            buffer_len=buffer_len, **state_kwargs)
  for s in state.layers:
    if isinstance(s, S.MambaState):
      check_speculative_precision(s, "speculative_generate")
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  M.check_prefill_inputs(target, prompt_tokens, lengths, state)
  proposer.validate(target, window=window, ssm_mode=ssm_mode,
                    buffer_len=buffer_len)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, params = nnx.split(target)
  out, n, stats, state = _spec_jit(
      graphdef, params, jnp.asarray(prompt_tokens, jnp.int32), lengths, state,
      max_new_tokens, window, implementation, ssm_mode, buffer_len, proposer,
      sampling, jnp.int32(-1 if eos_id is None else eos_id), rng, compaction,
      bool(return_state))
  V.raise_if_invalid(out[:, 0] < 0, "speculative_generate")
  return (out, n, stats, state) if return_state else (out, n, stats)
