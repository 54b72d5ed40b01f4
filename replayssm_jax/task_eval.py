"""Evaluation of a model on task batches: masked cross-entropy / accuracy
sums, full-forward and decode-mode (prefill + teacher-forced `decode_step`)
logits and metrics. See `replayssm_jax.tasks` for the batch format.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

F32 = jnp.float32
Batch = dict  # {"inputs", "targets", "mask"} -> np.ndarray


# ---------------------------------------------------------------- metrics
def masked_sums(logits, targets, mask) -> dict:
  """Sums over the scored positions (traceable): cross-entropy `loss_sum`,
  `correct` greedy predictions and `count` (all float32 scalars)."""
  logits = logits.astype(F32)
  scored = mask.astype(F32) > 0
  logz = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32),
                            axis=-1)[..., 0]
  correct = jnp.argmax(logits, axis=-1) == targets
  # Selected, not multiplied: an unscored position's inf / NaN logits stay
  # out of the sums.
  return dict(loss_sum=jnp.sum(jnp.where(scored, logz - tgt, 0.0)),
              correct=jnp.sum((correct & scored).astype(F32)),
              count=jnp.sum(scored.astype(F32)))


def masked_loss(logits, targets, mask):
  """Mean cross-entropy over the scored positions (traceable)."""
  s = masked_sums(logits, targets, mask)
  return s["loss_sum"] / jnp.maximum(s["count"], 1.0)


def finalize(sums: dict) -> dict:
  """Sums -> metrics: loss (mean CE, nats), accuracy (greedy), perplexity,
  bits_per_token and num_targets."""
  n = float(sums["count"])
  if n <= 0:
    raise ValueError("no scored positions (the mask is all zero).")
  loss = float(sums["loss_sum"]) / n
  return dict(loss=loss, accuracy=float(sums["correct"]) / n,
              perplexity=math.exp(min(loss, 700.0)),
              bits_per_token=loss / math.log(2), num_targets=int(n))


def aggregate(sums_iter) -> dict:
  """`finalize` of the key-wise total of an iterable of sums dicts."""
  total = None
  for s in sums_iter:
    s = {k: float(v) for k, v in s.items()}
    total = s if total is None else {k: total[k] + s[k] for k in total}
  return finalize(total)


def _check_batch(model, batch) -> tuple:
  if not isinstance(batch, dict) or not {"inputs", "targets",
                                         "mask"} <= set(batch):
    raise ValueError("batch must be a dict with 'inputs', 'targets' and "
                     "'mask' (from a task's batch()).")
  inputs = np.asarray(batch["inputs"])
  targets = np.asarray(batch["targets"])
  mask = np.asarray(batch["mask"])
  if inputs.ndim != 2 or targets.shape != inputs.shape or (
      mask.shape != inputs.shape):
    raise ValueError(f"batch inputs/targets/mask must share one [batch, "
                     f"seq_len] shape, got {inputs.shape}, {targets.shape}, "
                     f"{mask.shape}.")
  for name, a in (("inputs", inputs), ("targets", targets)):
    if not np.issubdtype(a.dtype, np.integer):
      raise TypeError(f"batch {name} must be integer token ids, got "
                      f"{a.dtype}.")
    if a.size and (a.min() < 0 or a.max() >= model.config.vocab_size):
      raise ValueError(f"batch {name} must lie in [0, vocab_size = "
                       f"{model.config.vocab_size}), got [{a.min()}, "
                       f"{a.max()}].")
  return (jnp.asarray(inputs, jnp.int32), jnp.asarray(targets, jnp.int32),
          jnp.asarray(mask, F32))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_logits_jit(graphdef, params, inputs):
  return nnx.merge(graphdef, params)(inputs)


def forward_logits(model, inputs):
  """`model(inputs)` jit-compiled (once per model structure and shape):
  [b, T] int -> logits [b, T, vocab] float32."""
  inputs = np.asarray(inputs)
  from replayssm_jax.models import model as M  # pylint: disable=g-import-not-at-top
  M._check_tokens("inputs", inputs, 2, "[batch, seqlen]", model.config)  # pylint: disable=protected-access
  graphdef, params = nnx.split(model)
  return _forward_logits_jit(graphdef, params, jnp.asarray(inputs, jnp.int32))


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_sums_jit(graphdef, params, inputs, targets, mask):
  model = nnx.merge(graphdef, params)
  return masked_sums(model(inputs), targets, mask)


def forward_sums(model, batch: Batch) -> dict:
  """`masked_sums` of the full-sequence forward of one batch."""
  inputs, targets, mask = _check_batch(model, batch)
  graphdef, params = nnx.split(model)
  return _forward_sums_jit(graphdef, params, inputs, targets, mask)


def forward_metrics(model, batch: Batch) -> dict:
  """Full-forward metrics (`finalize`) of one batch."""
  return finalize(forward_sums(model, batch))


# ------------------------------------------------------------ decode mode
@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _decode_logits_jit(graphdef, params, inputs, state, prefill_len,
                       implementation):
  model = nnx.merge(graphdef, params)
  b = inputs.shape[0]
  lengths = jnp.full((b,), prefill_len, jnp.int32)
  x, state = model.forward(inputs[:, :prefill_len], lengths, state)
  first = model.logits(x)  # [b, prefill_len, vocab]

  def body(st, tok):
    logits, st = model.step(tok, st, implementation)
    return st, logits

  _, rest = jax.lax.scan(body, state, inputs[:, prefill_len:].T)
  return jnp.concatenate([first, jnp.swapaxes(rest, 0, 1)], axis=1)


def decode_logits(model, inputs, ssm_mode: str = "replay",
                  buffer_len: int = 16, *, prefill_len: int = 1,
                  implementation: str | None = None, **state_kwargs):
  """Logits of every input position [b, T, vocab] float32, in decode mode.

  The first `prefill_len` tokens go through `prefill` (chunked SSD; the
  logits of all of them are returned), the remaining T - prefill_len
  through `decode_step` one at a time, teacher-forced (the given inputs,
  not the model's predictions), in one jit-compiled `lax.scan`. In f32 the
  result equals `model(inputs)` up to association order.

  Args:
    model: a HybridLM.
    inputs: [batch, T] int token ids.
    ssm_mode: "replay" or "baseline" decode state of the Mamba layers.
    buffer_len: replay buffer length L.
    prefill_len: tokens run by prefill, 1 <= prefill_len <= T.
    implementation: SSM decode op implementation (dispatcher name).
    **state_kwargs: more `model.init_state` keywords (checkpoint_dtype,
      buffer_dtype, kv_dtype, conv_dtype, precision, row_ids).
  """
  inputs = np.asarray(inputs)
  if inputs.ndim != 2:
    raise ValueError(f"inputs must be [batch, seq_len], got shape "
                     f"{inputs.shape}.")
  b, t = inputs.shape
  if (isinstance(prefill_len, bool) or not isinstance(prefill_len, int)
      or not 1 <= prefill_len <= t):
    raise ValueError(f"prefill_len must be an int in [1, seq_len = {t}], "
                     f"got {prefill_len!r}.")
  state = model.init_state(b, t, ssm_mode=ssm_mode, buffer_len=buffer_len,
                           **state_kwargs)
  from replayssm_jax.models import model as M  # pylint: disable=g-import-not-at-top
  M.check_prefill_inputs(model, inputs[:, :prefill_len],
                         np.full((b,), prefill_len, np.int32), state)
  graphdef, params = nnx.split(model)
  return _decode_logits_jit(graphdef, params, jnp.asarray(inputs, jnp.int32),
                            state, prefill_len, implementation)


def decode_sums(model, batch: Batch, ssm_mode: str = "replay",
                buffer_len: int = 16, *, prefill_len: int = 1,
                implementation: str | None = None, **state_kwargs) -> dict:
  """`masked_sums` of `decode_logits` for one batch."""
  inputs, targets, mask = _check_batch(model, batch)
  logits = decode_logits(model, inputs, ssm_mode, buffer_len,
                         prefill_len=prefill_len,
                         implementation=implementation, **state_kwargs)
  return _sums_jit(logits, targets, mask)


_sums_jit = jax.jit(masked_sums)


def decode_metrics(model, batch: Batch, ssm_mode: str = "replay",
                   buffer_len: int = 16, *, prefill_len: int = 1,
                   implementation: str | None = None,
                   **state_kwargs) -> dict:
  """Decode-mode metrics (`finalize`) of one batch: loss, accuracy,
  perplexity, ... at the batch's scored positions."""
  return finalize(decode_sums(model, batch, ssm_mode, buffer_len,
                              prefill_len=prefill_len,
                              implementation=implementation, **state_kwargs))


def decode_accuracy(model, batch: Batch, ssm_mode: str = "replay",
                    buffer_len: int = 16, *, prefill_len: int = 1,
                    implementation: str | None = None,
                    **state_kwargs) -> float:
  """Greedy accuracy at the scored positions (MQAR: the queries) when the
  model runs in decode mode (prefill `prefill_len` tokens, then
  teacher-forced `decode_step`s); `**state_kwargs` go to `init_state`."""
  return decode_metrics(model, batch, ssm_mode, buffer_len,
                        prefill_len=prefill_len,
                        implementation=implementation,
                        **state_kwargs)["accuracy"]
