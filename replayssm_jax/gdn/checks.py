"""Static argument checks of the GDN ops (shapes, dtypes, options).

Every error names the argument and says what was expected; the checks
look at shapes and dtypes only, so they run once at trace time.
"""

from __future__ import annotations

import math

import numpy as np

from replayssm_jax import _validation as V
from replayssm_jax.gdn import reference

STATE_LAYOUT = "[batch, num_v_heads, key_dim, value_dim]"


def check_heads(num_v_heads: int, num_k_heads: int, where: str) -> None:
  if num_k_heads < 1 or num_v_heads % num_k_heads != 0:
    raise ValueError(
        f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads "
        f"({num_k_heads}, read from {where}): value head h reads key head "
        f"h // (num_v_heads // num_k_heads).")


def check_options(use_qk_l2norm, scale) -> None:
  if not isinstance(use_qk_l2norm, (bool, np.bool_)):
    raise TypeError(f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}.")
  if scale is not None:
    ok = (not isinstance(scale, (bool, np.bool_))
          and isinstance(scale, (int, float, np.integer, np.floating))
          and math.isfinite(float(scale)) and float(scale) > 0)
    if not ok:
      raise ValueError(f"scale must be None (key_dim ** -0.5) or a finite "
                       f"Python float > 0, got {scale!r}.")


def check_window_fits(buffer_len: int, T: int) -> None:
  """A replay state's verify window of T tokens needs buffer_len > T."""
  if buffer_len <= T:
    raise ValueError(
        f"rstate.buffer_len ({buffer_len}) must exceed the window length T "
        f"({T}): a window is placed behind the committed history and the "
        f"count must stay below buffer_len after any acceptance.")


def check_state(name: str, state, allowed=V.STATE_DTYPES):
  """A full state [batch, HV, K, V]; returns its shape."""
  V.check_floating(name, state, allowed)
  V.check_ndim(name, state, 4, STATE_LAYOUT)
  return tuple(state.shape)


def check_token(batch: int, hv: int, K: int, Vd: int, q, k, v, g, beta,
                hk: int | None = None, window: bool = False,
                per_channel_gate: bool = False) -> tuple:
  """One token ([batch, ...]) or a window ([batch, T, ...]) of inputs, g
  one log-gate per value head or, per_channel_gate (KDA), one per head and
  key channel; returns (T or None, num_k_heads)."""
  lead = "[batch, T, " if window else "[batch, "
  nd = 4 if window else 3
  V.check_floating("q", q)
  V.check_ndim("q", q, nd, lead + "num_k_heads, key_dim]")
  T = q.shape[1] if window else None
  pre = (batch, T) if window else (batch,)
  hk = q.shape[-2] if hk is None else hk
  V.check_shape("q", q, pre + (hk, K), lead + "num_k_heads, key_dim]")
  check_heads(hv, hk, "q")
  V.check_floating("k", k)
  V.check_shape("k", k, pre + (hk, K), lead + "num_k_heads, key_dim]")
  V.check_floating("v", v)
  V.check_shape("v", v, pre + (hv, Vd), lead + "num_v_heads, value_dim]")
  V.check_floating("g", g)
  if per_channel_gate:
    V.check_shape("g", g, pre + (hv, K), lead + "num_v_heads, key_dim]")
  else:
    V.check_shape("g", g, pre + (hv,), lead + "num_v_heads]")
  V.check_floating("beta", beta)
  V.check_shape("beta", beta, pre + (hv,), lead + "num_v_heads]")
  if window and T < 1:
    raise ValueError("q must hold T >= 1 positions, got T = 0.")
  return T, hk


def check_solve(solve) -> str:
  """`solve`: one of reference.SOLVES."""
  if solve not in reference.SOLVES:
    raise ValueError(f"solve must be one of {reference.SOLVES}, got "
                     f"{solve!r}.")
  return solve


def check_sequence(q, k, v, g, beta, initial_state, valid, chunk_size):
  """The inputs of `gdn_chunked_prefill`."""
  V.check_floating("q", q)
  V.check_ndim("q", q, 4, "[batch, T, num_k_heads, key_dim]")
  V.check_floating("v", v)
  V.check_ndim("v", v, 4, "[batch, T, num_v_heads, value_dim]")
  b, _, _, K = q.shape
  hv, Vd = v.shape[2], v.shape[3]
  T, _ = check_token(b, hv, K, Vd, q, k, v, g, beta, window=True)
  V.int_at_least("chunk_size", chunk_size)
  if initial_state is not None:
    check_state("initial_state", initial_state, V.FLOAT_DTYPES)
    V.check_shape("initial_state", initial_state, (b, hv, K, Vd),
                  STATE_LAYOUT)
  if valid is not None:
    V.check_array("valid", valid)
    if np.dtype(valid.dtype) != np.dtype(bool):
      raise TypeError(f"valid must be a bool array [batch, T], got dtype "
                      f"{valid.dtype}.")
    V.check_shape("valid", valid, (b, T), "[batch, T]")
  return T
