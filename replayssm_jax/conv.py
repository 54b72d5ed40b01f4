"""Causal depthwise conv1d (Mamba-2's short convolution) and its decode step.

Weight layout is [dim, kernel_size] (the Hugging Face `conv1d.weight`
[dim, 1, k] with the middle axis dropped); the last tap multiplies the
current token. The rolling conv state holds the last `kernel_size - 1`
inputs, time-major: [batch, kernel_size - 1, dim] (oldest first), or as
a ring buffer with a per-row start slot (`causal_conv1d_update_ring`,
`conv_ring_ordered`), which a decode step updates in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.reference import F32

_ACTIVATIONS = (None, "silu", "swish")


def _activate(y, activation):
  return jax.nn.silu(y) if activation in ("silu", "swish") else y


def _check_conv_params(weight, bias, dim, activation):
  V.check_floating("weight", weight)
  V.check_ndim("weight", weight, 2, "[dim, kernel_size]")
  if weight.shape[0] != dim:
    raise ValueError(f"weight must have shape [dim, kernel_size] with dim = "
                     f"{dim}, got {tuple(weight.shape)}.")
  if weight.shape[1] < 1:
    raise ValueError(f"weight must have shape [dim, kernel_size] with "
                     f"kernel_size >= 1, got {tuple(weight.shape)}.")
  if bias is not None:
    V.check_floating("bias", bias)
    V.check_shape("bias", bias, (dim,), "[dim]")
  if activation not in _ACTIVATIONS:
    raise ValueError(f"activation must be one of {_ACTIVATIONS}, got "
                     f"{activation!r}.")
  return weight.shape[1]


def causal_conv1d(x, weight, bias=None, initial_state=None,
                  activation: str | None = "silu"):
  """Causal depthwise conv over a sequence (prefill).

  Args:
    x: [batch, seqlen, dim].
    weight: [dim, kernel_size].
    bias: optional [dim].
    initial_state: optional [batch, kernel_size - 1, dim] inputs preceding
      x (zeros if None), e.g. a conv state carried over from an earlier chunk.
    activation: "silu" (Mamba-2) or None.

  Returns:
    (y [batch, seqlen, dim] in x.dtype, final conv state
     [batch, kernel_size - 1, dim] in x.dtype (initial_state's dtype if
     given)).
  """
  V.check_floating("x", x)
  V.check_ndim("x", x, 3, "[batch, seqlen, dim]")
  b, l, dim = x.shape
  k = _check_conv_params(weight, bias, dim, activation)
  state_dtype = x.dtype
  if initial_state is None:
    initial_state = jnp.zeros((b, k - 1, dim), x.dtype)
  else:
    V.check_floating("initial_state", initial_state)
    V.check_shape("initial_state", initial_state, (b, k - 1, dim),
                  "[batch, kernel_size - 1, dim]")
    state_dtype = initial_state.dtype
  xp = jnp.concatenate([initial_state.astype(F32), x.astype(F32)], axis=1)
  w = weight.astype(F32)
  y = sum(xp[:, i:i + l] * w[:, i] for i in range(k))
  if bias is not None:
    y = y + bias.astype(F32)
  y = _activate(y, activation)
  final_state = xp[:, xp.shape[1] - (k - 1):].astype(state_dtype)
  return y.astype(x.dtype), final_state


def check_step_args(x, conv_state, weight, bias, activation):
  """Validates a decode step's arguments -> (batch, kernel_size)."""
  V.check_floating("x", x)
  V.check_ndim("x", x, 2, "[batch, dim]")
  b, dim = x.shape
  k = _check_conv_params(weight, bias, dim, activation)
  V.check_floating("conv_state", conv_state)
  V.check_shape("conv_state", conv_state, (b, k - 1, dim),
                "[batch, kernel_size - 1, dim]")
  return b, k


def causal_conv1d_update(x, conv_state, weight, bias=None,
                         activation: str | None = "silu"):
  """One decode step of the causal conv.

  Args:
    x: [batch, dim] the new token's pre-conv input.
    conv_state: [batch, kernel_size - 1, dim] the previous inputs.
    weight, bias, activation: as in `causal_conv1d`.

  Returns:
    (y [batch, dim] in x.dtype, new conv state (same shape and dtype)).
  """
  b, k = check_step_args(x, conv_state, weight, bias, activation)
  # Tap by tap in float32 (as causal_conv1d): one elementwise fusion, with
  # no materialized [b, k, dim] window (which XLA runs as a separate
  # concatenate fusion).
  w = weight.astype(F32)
  y = x.astype(F32) * w[:, k - 1]
  for i in range(k - 1):
    y = y + conv_state[:, i].astype(F32) * w[:, i]
  if bias is not None:
    y = y + bias.astype(F32)
  y = _activate(y, activation)
  new_state = jnp.concatenate(
      [conv_state, x.astype(conv_state.dtype)[:, None]], axis=1)[:, 1:]
  return y.astype(x.dtype), new_state


def conv_state_after(x, lengths, history, dtype=None):
  """The conv state after each row's first lengths[r] inputs of a
  right-padded sequence (a prefill's conv state).

  Args:
    x: [batch, T, dim] pre-conv inputs (positions >= lengths[r] are
      padding: never read, so they may hold anything).
    lengths: [batch] int in [0, T].
    history: [batch, kernel_size - 1, dim] the inputs before x, oldest
      first: a continued prefill's conv window, zeros for an empty row.
    dtype: the state's dtype (default history's).

  Returns:
    [batch, kernel_size - 1, dim]: the kernel_size - 1 inputs of
    concat(history, x) before position lengths[r] of x, oldest first.
  """
  dtype = history.dtype if dtype is None else dtype
  k1 = history.shape[1]
  xp = jnp.concatenate([history.astype(dtype), x.astype(dtype)], axis=1)
  idx = lengths.astype(jnp.int32)[:, None] + jnp.arange(k1)[None, :]
  return jnp.take_along_axis(xp, idx[..., None], axis=1)


def conv_ring_ordered(conv_state, start):
  """A ring-buffer conv state laid out oldest first.

  Args:
    conv_state: [batch, kernel_size - 1, dim] ring buffer (see
      `causal_conv1d_update_ring`).
    start: [batch] int slot of each row's oldest input (taken modulo
      kernel_size - 1).

  Returns:
    [batch, kernel_size - 1, dim]: the same inputs oldest first, the layout
    `causal_conv1d` and `causal_conv1d_update` use.
  """
  V.check_ndim("conv_state", conv_state, 3, "[batch, kernel_size - 1, dim]")
  check_start(start, conv_state.shape[0])
  b, k1, _ = conv_state.shape
  if k1 == 0:
    return conv_state
  idx = (start.astype(jnp.int32)[:, None] + jnp.arange(k1)[None, :]) % k1
  return jnp.take_along_axis(conv_state, idx[..., None], axis=1)


def check_start(start, batch):
  if not jnp.issubdtype(jnp.asarray(start).dtype, jnp.integer):
    raise TypeError(f"start must be an integer [batch] array (the slot of "
                    f"each row's oldest input), got dtype "
                    f"{jnp.asarray(start).dtype}.")
  V.check_shape("start", start, (batch,), "[batch]")


def causal_conv1d_update_ring(x, conv_state, start, weight, bias=None,
                              activation: str | None = "silu"):
  """One decode step of the causal conv on a ring-buffer conv state.

  The conv state holds the last `kernel_size - 1` inputs in a ring: row
  r's oldest input sits in slot start[r], the next in start[r] + 1 (modulo
  kernel_size - 1), and so on. The step writes the new input over the
  oldest one (XLA updates the buffer in place) and
  moves `start` on by one, instead of shifting the whole window as
  `causal_conv1d_update` does (a new [batch, k-1, dim] array each step,
  which a decode loop then copies into its carry). The outputs equal
  `causal_conv1d_update`'s on `conv_ring_ordered(conv_state, start)` bit
  for bit (same taps, same f32 sum order).

  Args:
    x: [batch, dim] the new token's pre-conv input.
    conv_state: [batch, kernel_size - 1, dim] the ring of previous inputs.
    start: [batch] int slot of each row's oldest input (taken modulo
      kernel_size - 1; zeros for a state laid out oldest first).
    weight, bias, activation: as in `causal_conv1d`.

  Returns:
    (y [batch, dim] in x.dtype, new conv state (same shape and dtype), new
     start [batch] int32).
  """
  b, k = check_step_args(x, conv_state, weight, bias, activation)
  check_start(start, b)
  k1 = k - 1
  w = weight.astype(F32)
  y = x.astype(F32) * w[:, k1]
  if k1 == 0:
    new_state, new_start = conv_state, jnp.zeros((b,), jnp.int32)
  else:
    s = start.astype(jnp.int32) % k1
    for age in range(k1):  # oldest first, as causal_conv1d_update sums
      slot = ((s + age) % k1)[:, None]
      v = conv_state[:, 0]
      for j in range(1, k1):  # a select chain: one elementwise fusion
        v = jnp.where(slot == j, conv_state[:, j], v)
      y = y + v.astype(F32) * w[:, age]
    # The slot is written by an elementwise select, which XLA updates in
    # place (no copy of the state per step). Chosen on the H200 over a
    # shifting window and a scatter: benchmarks/decode_step/conv_state_ring_hybrid_1b_b256_h200.json.
    new_state = jnp.where(jnp.arange(k1)[None, :, None] == s[:, None, None],
                          x.astype(conv_state.dtype)[:, None], conv_state)
    new_start = (s + 1) % k1
  if bias is not None:
    y = y + bias.astype(F32)
  y = _activate(y, activation)
  return y.astype(x.dtype), new_state, new_start


def check_split(split, dim: int) -> tuple[int, ...]:
  """`split` (channel counts summing to dim, or None for one piece) ->
  the counts."""
  if split is None:
    return (dim,)
  sizes = tuple(split)
  if (not sizes or any(not isinstance(n, int) or n < 1 for n in sizes)
      or sum(sizes) != dim):
    raise ValueError(f"split must be positive ints summing to dim = {dim} "
                     f"(the channel counts of the pieces, e.g. Mamba-2's "
                     f"(d_inner, ngroups * dstate, ngroups * dstate)), got "
                     f"{split!r}.")
  return sizes


def causal_conv1d_step_reference(x, conv_state, start, weight, bias=None,
                                 activation: str | None = "silu",
                                 split=None, x_offset: int = 0):
  """`causal_conv1d_update_ring` with its output cut into channel pieces.

  Args:
    x: [batch, width]: the conv's input is columns x_offset .. x_offset +
      dim - 1.
    conv_state, start, weight, bias, activation: as in
      `causal_conv1d_update_ring`.
    split: channel counts of the output pieces (summing to dim), or None.
    x_offset: the first column of the conv's input in x.

  Returns:
    (tuple of y pieces [batch, n] in x.dtype, new conv state, new start).
  """
  dim = conv_state.shape[-1]
  sizes = check_split(split, dim)
  y, new_state, new_start = causal_conv1d_update_ring(
      x[:, x_offset:x_offset + dim], conv_state, start, weight, bias,
      activation)
  cuts = np.cumsum(sizes)[:-1].tolist()
  return tuple(jnp.split(y, cuts, axis=-1)), new_state, new_start


def causal_conv1d_window_reference(x, conv_state, start, weight, bias=None,
                                   activation: str | None = "silu",
                                   split=None, x_offset: int = 0):
  """The causal conv over a window of T new inputs per row from a
  ring-buffer conv state, which is left as it is (a speculative verify:
  the accepted prefix rolls the state forward at commit), the output cut
  into channel pieces.

  Args:
    x: [batch, T, width]: the conv's input is columns x_offset .. x_offset
      + dim - 1.
    conv_state, start, weight, bias, activation: as in
      `causal_conv1d_update_ring`.
    split: channel counts of the output pieces (summing to dim), or None.
    x_offset: the first column of the conv's input in x.

  Returns:
    tuple of y pieces [batch, T, n] in x.dtype: `causal_conv1d` of the
    window after `conv_ring_ordered(conv_state, start)`.
  """
  dim = conv_state.shape[-1]
  sizes = check_split(split, dim)
  y, _ = causal_conv1d(x[..., x_offset:x_offset + dim], weight, bias,
                       initial_state=conv_ring_ordered(conv_state, start),
                       activation=activation)
  cuts = np.cumsum(sizes)[:-1].tolist()
  return tuple(jnp.split(y, cuts, axis=-1))
