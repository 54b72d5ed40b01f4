"""Verify / commit of a speculative window for the hybrid LM.

  logits, pending = verify(model, window_tokens, state)   # [b, T, vocab]
  state = commit(pending, num_accepted)                   # [b] in [1, T]

`verify` runs a window of T tokens per row (the last sampled token and T-1
drafts) through every block in one parallel pass per layer, from the
committed decode state:
  * Mamba-2: in_proj over the window, causal conv from the conv state, SSM
    outputs from `replayssm_jax.replay_verify` (replay mode: checkpoint +
    buffer, no per-token state) or `baseline_verify` (baseline mode: one
    full SSM state snapshot per window position);
  * Gated DeltaNet: the same from its conv state, the delta-rule outputs from
    `replayssm_jax.gdn.gdn_replay_verify` (replay mode) or
    `gdn_baseline_verify` (baseline mode: one state snapshot per position);
  * Kimi Delta Attention: as Gated DeltaNet (`kda.kda_replay_verify`,
    whose `kda.KDAWindow` rides in the snapshots slot, or
    `kda.kda_baseline_verify`);
  * attention: the T new keys/values go to positions length .. length+T-1
    of the KV cache and each query attends to the cache prefix plus the
    window up to itself;
  * MLP: position-wise.
`commit` makes the first num_accepted window tokens of each row history:
the replay SSM state by a counter move (`replay_commit`; Gated DeltaNet:
`gdn_replay_commit`; Kimi Delta Attention: `kda_replay_commit`, which
refolds rows whose accepted tokens left its gate bound), the baseline one
by picking a snapshot (`baseline_commit` / `gdn_baseline_commit`), the conv
state by taking the last conv_kernel - 1 inputs of (committed window ++
accepted inputs), the KV cache by setting length (rejected entries are
overwritten later) and positions by += num_accepted.

`verify_fn` / `commit_fn` are the traceable bodies (no input checks) that the
decode loop and `DraftModelProposer` call inside their jits.
"""

# pylint: disable=protected-access  (model.py's input checks are shared)

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _validation as V
from replayssm_jax import gdn, kda
from replayssm_jax.models import model as M
from replayssm_jax.models import states as S
from replayssm_jax.models.layers import check_speculative_precision
from replayssm_jax.speculative import baseline_commit, replay_commit
from replayssm_jax.state import ReplayState

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
      the window (Mamba and Gated DeltaNet layers, conv-state dtype) or None.
    snapshots: per layer, [batch, T, H, P, N] SSM state after each window
      position (baseline-mode Mamba layers; Gated DeltaNet and Kimi Delta
      Attention: [batch, T, HV, K, V]), the `kda.KDAWindow` of a replay
      Kimi Delta Attention layer, or None.
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
    if block.kind in ("mamba", "gdn", "kda"):
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
  layers, recurrent = [], 0
  for s, win, snap in zip(pending.state.layers, pending.window_conv_inputs,
                          pending.snapshots):
    if isinstance(s, (S.MambaState, S.GDNState)):
      layer = recurrent  # the block's index among the recurrent ones
      recurrent += 1
      k1 = s.conv.shape[1]
      # [b, k-1+T, conv_dim], oldest first
      cat = jnp.concatenate([s.ordered_conv(), win], axis=1)
      idx = moved[:, None] + jnp.arange(k1)[None, :]  # [b, k-1]
      conv = jnp.take_along_axis(cat, idx[..., None], axis=1)
      if isinstance(s, S.GDNState):
        ssm = _gdn_commit(s, snap, n, active, layer)
      elif isinstance(s.ssm, ReplayState):
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


def _gdn_commit(s, data, n, active, layer):
  """A Gated DeltaNet or Kimi Delta Attention layer's committed state (s the
  layer's pending GDNState): a replay state's counter moved by n
  (`gdn_replay_commit`; `kda_replay_commit` with the verify's KDAWindow
  `data`, which refolds rows whose accepted tokens left its gate bound),
  or the baseline snapshot after n window tokens (`gdn_baseline_commit`,
  `data` the snapshots); inactive rows keep their committed history."""
  ssm = s.ssm
  if isinstance(ssm, (gdn.GDNReplayState, kda.KDAReplayState)):
    n_ok = n if active is None else jnp.where(active, n, 1)
    if isinstance(ssm, kda.KDAReplayState):
      new = kda.kda_replay_commit(ssm, data, n_ok, policy=s.precision,
                                  layer=layer)
      fields = ("checkpoint", "read_copy", "read_scale", "g_sum", "count",
                "step")
    else:
      new = gdn.gdn_replay_commit(ssm, n_ok)
      fields = ("count", "step")
    if active is not None:
      new = new.replace(**{f: _rows(active, getattr(new, f), getattr(ssm, f))
                           for f in fields if getattr(new, f) is not None})
    return new
  new = gdn.gdn_baseline_commit(data, n)
  if active is not None:
    new = jnp.where(active[:, None, None, None], new, ssm)
  return new


def _rows(active, new, old):
  """new where active (per row, any trailing dims), else old."""
  return jnp.where(active.reshape(active.shape + (1,) * (new.ndim - 1)),
                   new, old)


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
  (`check_speculative_precision`).
  Refused by name, before anything is traced."""
  for i, s in enumerate(state.layers):
    if isinstance(s, (S.MambaState, S.GDNState)):
      check_speculative_precision(s, what)
    if isinstance(s, S.GDNState) and s.is_replay:
      if s.ssm.d_buf.shape[1] <= t:
        raise ValueError(
            f"{what}: the replay buffer_len ({s.ssm.d_buf.shape[1]}, layer "
            f"{i}) must exceed the window T ({t}); create the state with "
            f"buffer_len > T.")
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
