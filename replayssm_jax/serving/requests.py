"""The serving engine's requests and its run statistics.

  Request        one generation request (prompt, budget, eos, sampling).
  check_request  a submitted request checked against an engine's limits ->
                 the engine's own copy.
  EngineStats    what `Engine.run` counts: dispatches, steps, tokens, host
                 and wait time, speculative acceptance.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.models.generate import check_sampling, eos_tuple


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  id: any hashable name (results and streamed tokens are keyed by it).
  prompt: [T] int token ids.
  max_new_tokens: tokens to generate (the first, from the prefill,
    included), >= 1.
  eos_id: the request stops after emitting it: one token id, or several
    (a sequence: it stops at any of them), or None (never).
  temperature: 0 greedy, > 0 sampling.
  seed: the request's PRNG seed (sampling).
  """
  id: object
  prompt: object
  max_new_tokens: int
  eos_id: int | tuple[int, ...] | None = None
  temperature: float = 0.0
  seed: int = 0


@dataclasses.dataclass
class EngineStats:
  """Counters of `Engine.run`: dispatches, decode steps (loop iterations:
  speculative rounds with `speculative`), tokens streamed, requests
  finished (`cancelled`: stopped by `Engine.cancel`), and the wall time split into the host's own work (admission,
  launching, streaming) and its waits for the device's tokens (the
  dispatches' and the prefills' first tokens, read together; `admit_s`:
  the admissions' host time, launching their prefills, which the device
  runs before the next decode call). With
  `speculative`: slot-rounds verified (`verify_rounds`), drafts proposed
  and drafts accepted (before the cut at a budget or an eos). compacted:
  the dispatches that decoded only the running slots' rows
  (`compact_below`)."""
  dispatches: int = 0
  steps: int = 0
  tokens: int = 0
  finished: int = 0
  admissions: int = 0
  wall_s: float = 0.0
  wait_s: float = 0.0
  admit_s: float = 0.0
  cancelled: int = 0
  verify_rounds: int = 0
  drafts: int = 0
  accepted_drafts: int = 0
  compacted: int = 0

  @property
  def acceptance_rate(self) -> float:
    """Accepted drafts over proposed drafts (0 without drafts)."""
    return self.accepted_drafts / max(self.drafts, 1)

  @property
  def mean_accepted_length(self) -> float:
    """Tokens per slot and verify round: accepted drafts + the target's
    own token (before the cut at a budget or an eos)."""
    return (self.accepted_drafts + self.verify_rounds) / max(
        self.verify_rounds, 1)

  @property
  def host_us_per_step(self) -> float:
    """Host time per decode step, waits for the device excluded."""
    return (self.wall_s - self.wait_s) / max(self.steps, 1) * 1e6

  @property
  def wall_us_per_step(self) -> float:
    return self.wall_s / max(self.steps, 1) * 1e6


def eos_ids(eos, vocab_size: int, most: int, name: str) -> tuple[int, ...]:
  """An eos_id (`models.generate.eos_tuple`'s forms) as a tuple of
  distinct ids, at most `most` of them."""
  ids = eos_tuple(eos, vocab_size, name)
  if len(ids) > most:
    raise ValueError(f"{name} holds {len(ids)} token ids; the engine takes "
                     f"at most max_eos_ids = {most}.")
  return ids


def check_request(request, max_len: int, vocab_size: int,
                  max_eos_ids: int) -> Request:
  """Checks a request against an engine's max_len and max_eos_ids and its
  model's vocabulary, errors naming the request and the field -> a copy
  whose prompt is the engine's own int32 array (the caller's is not kept)
  and whose eos_id is a tuple of distinct ids (empty: none)."""
  if not isinstance(request, Request):
    raise TypeError(f"request must be a Request, got "
                    f"{type(request).__name__}.")
  rid = request.id
  prompt = np.array(request.prompt)  # a copy
  if (prompt.ndim != 1 or not 1 <= prompt.shape[0] <= max_len
      or not np.issubdtype(prompt.dtype, np.integer)):
    raise ValueError(f"Request {rid!r}: prompt must be a [T] integer token "
                     f"array with 1 <= T <= max_len ({max_len}), got shape "
                     f"{prompt.shape} of {prompt.dtype}.")
  if prompt.min() < 0 or prompt.max() >= vocab_size:
    raise ValueError(f"Request {rid!r}: prompt tokens must lie in [0, "
                     f"vocab_size) = [0, {vocab_size}), got values in "
                     f"[{prompt.min()}, {prompt.max()}].")
  n = V.positive_int("max_new_tokens", request.max_new_tokens)
  if prompt.shape[0] + n > max_len:
    raise ValueError(
        f"Request {rid!r}: prompt ({prompt.shape[0]} tokens) + "
        f"max_new_tokens ({n}) exceeds the engine's max_len ({max_len}).")
  eos = eos_ids(request.eos_id, vocab_size, max_eos_ids,
                f"Request {rid!r}: eos_id")
  seed = request.seed
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise ValueError(f"Request {rid!r}: seed must be an int, got {seed!r}.")
  check_sampling(request.temperature, None, None)
  return dataclasses.replace(request, prompt=prompt.astype(np.int32),
                             max_new_tokens=n,
                             eos_id=eos,
                             seed=int(seed))
