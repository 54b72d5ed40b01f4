"""Speculative decoding for the hybrid LM: verify a window, commit a prefix.

  logits, pending = verify(model, window_tokens, state)   # [b, T, vocab]
  state = commit(pending, num_accepted)                   # [b] in [1, T]
  tokens, n, stats = speculative_generate(target, proposer, prompts,
                                          lengths, max_new_tokens, window)

`speculative_generate` is the decode loop (one jit-compiled
`lax.while_loop`) with greedy acceptance or standard speculative sampling
(`accept`); drafts come from a `Proposer`: `DraftModelProposer` (a small
HybridLM) or `NgramProposer` (prompt lookup).

This module is the public entry point of speculative decoding; the parts
live in
  verify_commit.py  verify / commit of one window (PendingState, verify_fn,
                    commit_fn);
  proposers.py      the Proposer protocol, NgramProposer,
                    DraftModelProposer, ProposalContext, Proposal;
and are re-exported here.
"""

# pylint: disable=protected-access  (model.py's input checks are shared)

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.models.generate import (check_prompts_and_eos,
                                           eos_array, eos_pad, filter_logits,
                                           is_eos, is_static_flag,
                                           sample_logits, sampling_settings)
from replayssm_jax.models.proposers import (DraftModelProposer,
                                            NgramProposer, Proposal,
                                            ProposalContext, Proposer)
from replayssm_jax.models.verify_commit import (PendingState,
                                                _check_window_room, commit,
                                                commit_fn, verify, verify_fn)

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "PendingState",
    "Proposal",
    "ProposalContext",
    "Proposer",
    "SpecStats",
    "accept",
    "commit",
    "commit_fn",
    "compaction_sizes",
    "speculative_generate",
    "verify",
    "verify_fn",
]

F32 = jnp.float32


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
  pad = eos_pad(eos_id)

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
  done = is_eos(first, eos_id) | (max_new_tokens <= 1) | invalid
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
    at_eos = is_eos(emitted, eos_id) & (j < count[:, None])
    hit = jnp.any(at_eos, axis=1)
    count = jnp.where(hit, jnp.argmax(at_eos, axis=1) + 1, count)
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
                         eos_id=None,
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
    eos_id: a row stops after emitting it (an int, or a sequence of ints:
      after any of them); its later slots hold the (first) eos id.
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
  _check_window_room(state, window, "speculative_generate")
  lengths = jnp.asarray(prompt_lengths, jnp.int32)
  M.check_prefill_inputs(target, prompt_tokens, lengths, state)
  proposer.validate(target, window=window, ssm_mode=ssm_mode,
                    buffer_len=buffer_len)
  rng = jax.random.PRNGKey(0) if rng is None else rng
  graphdef, params = nnx.split(target)
  out, n, stats, state = _spec_jit(
      graphdef, params, jnp.asarray(prompt_tokens, jnp.int32), lengths, state,
      max_new_tokens, window, implementation, ssm_mode, buffer_len, proposer,
      sampling, eos_array(eos_id, target.config.vocab_size), rng, compaction,
      bool(return_state))
  V.raise_if_invalid(out[:, 0] < 0, "speculative_generate")
  return (out, n, stats, state) if return_state else (out, n, stats)
