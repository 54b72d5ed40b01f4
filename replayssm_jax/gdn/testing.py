"""Helpers shared by the GDN tests (and kernel checks): fresh random inputs
(never zeros) and a ragged `GDNReplayState` with its known full state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.gdn import reference as R
from replayssm_jax.gdn.state import GDNReplayState


def random_inputs(key, batch: int, num_k_heads: int, num_v_heads: int,
                  key_dim: int, value_dim: int, T: int | None = None,
                  dtype=jnp.float32):
  """q, k, v (standard normal) and g, beta from `gdn_gates` of random
  projections (decays exp(g) spread over (0, 1), beta over (0, 1)), for one
  token ([batch, ...]) or a sequence ([batch, T, ...])."""
  ks = jax.random.split(key, 7)
  lead = (batch,) if T is None else (batch, T)
  q = jax.random.normal(ks[0], lead + (num_k_heads, key_dim), jnp.float32)
  k = jax.random.normal(ks[1], lead + (num_k_heads, key_dim), jnp.float32)
  v = jax.random.normal(ks[2], lead + (num_v_heads, value_dim), jnp.float32)
  a = jax.random.normal(ks[3], lead + (num_v_heads,), jnp.float32)
  b = jax.random.normal(ks[4], lead + (num_v_heads,), jnp.float32)
  A_log = jax.random.uniform(ks[5], (num_v_heads,), jnp.float32, -2.0, 1.0)
  dt_bias = jax.random.normal(ks[6], (num_v_heads,), jnp.float32) * 0.5
  g, beta = R.gdn_gates(a, b, A_log, dt_bias)
  out = dict(q=q, k=k, v=v)
  out = {n: x.astype(dtype) for n, x in out.items()}
  return dict(out, g=g, beta=beta)


def fill_stale_slots(rstate: GDNReplayState, d=jnp.nan, k=jnp.inf,
                     g=jnp.nan) -> GDNReplayState:
  """rstate with every ring slot at or past its row's count set to d / k /
  g (poison by default: an implementation that reads a stale slot, or
  weighs it by zero instead of selecting it away, gives non-finite
  outputs)."""
  stale = (jnp.arange(rstate.buffer_len)[None, :]
           >= jnp.asarray(rstate.count)[:, None])
  s4 = stale[..., None, None]
  return rstate.replace(
      d_buf=jnp.where(s4, d, rstate.d_buf).astype(rstate.d_buf.dtype),
      k_buf=jnp.where(s4, k, rstate.k_buf).astype(rstate.k_buf.dtype),
      g_buf=jnp.where(stale[..., None], g, rstate.g_buf).astype(jnp.float32))


def random_gdn_replay_state(key, batch: int, num_k_heads: int,
                            num_v_heads: int, key_dim: int, value_dim: int,
                            buffer_len: int, counts,
                            checkpoint_dtype=jnp.float32,
                            buffer_dtype=jnp.float32):
  """A GDNReplayState with counts[r] random buffered tokens in row r
  (normalised keys, log-decays in [-1, -0.05]) and stale slots poisoned.

  Returns (rstate, full_state): full_state [batch, HV, K, V] f32 is the
  checkpoint advanced over each row's buffered tokens one at a time (S <-
  exp(g_j) S + k_j d_j^T), independent of `gdn_materialize`.
  """
  counts = np.asarray(counts, np.int32)
  if counts.shape != (batch,):
    raise ValueError(f"counts must have shape ({batch},), got {counts.shape}")
  kc, kd, kk, kg = jax.random.split(key, 4)
  L = buffer_len
  ck = jax.random.normal(kc, (batch, num_v_heads, key_dim, value_dim),
                         jnp.float32).astype(checkpoint_dtype)
  d = jax.random.normal(kd, (batch, L, num_v_heads, value_dim)) * 0.5
  k = R.l2norm(jax.random.normal(kk, (batch, L, num_k_heads, key_dim)))
  g = -jax.random.uniform(kg, (batch, L, num_v_heads), jnp.float32, 0.05,
                          1.0)
  rstate = fill_stale_slots(GDNReplayState(
      checkpoint=ck, d_buf=d.astype(buffer_dtype),
      k_buf=k.astype(buffer_dtype), g_buf=g, count=jnp.asarray(counts)))
  state = ck.astype(jnp.float32)
  rep = num_v_heads // num_k_heads
  for j in range(L):
    kj = jnp.repeat(rstate.k_buf[:, j].astype(jnp.float32), rep, axis=1)
    dj = rstate.d_buf[:, j].astype(jnp.float32)
    nxt = (state * jnp.exp(rstate.g_buf[:, j])[..., None, None]
           + kj[..., :, None] * dj[..., None, :])
    state = jnp.where((j < counts)[:, None, None, None], nxt, state)
  return rstate, state


def ragged_counts(batch: int, buffer_len: int) -> tuple[int, ...]:
  """Distinct per-row counts in [0, L): 0, L-1 (flushes at once), L//2,
  then a spread."""
  L = buffer_len
  base = [0, L - 1, L // 2] + [(5 * r + 1) % L for r in range(3, batch)]
  return tuple(int(c) for c in base[:batch])
