"""Helpers shared by the KDA tests: fresh random inputs (never zeros) and a
ragged `KDAReplayState` with its known full state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.gdn import reference as GR
from replayssm_jax.kda import reference as R
from replayssm_jax.kda.state import KDAReplayState, check_gate_bound


def random_inputs(key, batch: int, num_k_heads: int, num_v_heads: int,
                  key_dim: int, value_dim: int, T: int | None = None,
                  lower_bound=None, dtype=jnp.float32):
  """q, k, v (standard normal) and g, beta from `kda_gates` of random
  projections (lower_bound None: Kimi Linear's unbounded gate; a float:
  the safe gate, g in [lower_bound, 0]), for one token ([batch, ...]) or a
  sequence ([batch, T, ...])."""
  ks = jax.random.split(key, 7)
  lead = (batch,) if T is None else (batch, T)
  q = jax.random.normal(ks[0], lead + (num_k_heads, key_dim), jnp.float32)
  k = jax.random.normal(ks[1], lead + (num_k_heads, key_dim), jnp.float32)
  v = jax.random.normal(ks[2], lead + (num_v_heads, value_dim), jnp.float32)
  f = jax.random.normal(ks[3], lead + (num_v_heads, key_dim), jnp.float32)
  b = jax.random.normal(ks[4], lead + (num_v_heads,), jnp.float32)
  A_log = jax.random.uniform(ks[5], (num_v_heads,), jnp.float32, -2.0, 1.0)
  dt_bias = jax.random.normal(ks[6], (num_v_heads, key_dim)) * 0.5
  g, beta = R.kda_gates(f, b, A_log, dt_bias, lower_bound)
  out = {n: x.astype(dtype) for n, x in dict(q=q, k=k, v=v).items()}
  return dict(out, g=g, beta=beta)


def fill_stale_slots(rstate: KDAReplayState, d=jnp.nan, k=jnp.inf,
                     g_sum=jnp.nan) -> KDAReplayState:
  """rstate with every ring slot at or past its row's count set to d / k
  (and g_sum of count-0 rows set to g_sum): poison by default."""
  stale = (jnp.arange(rstate.buffer_len)[None, :]
           >= jnp.asarray(rstate.count)[:, None])[..., None, None]
  empty = (jnp.asarray(rstate.count) == 0)[:, None, None]
  return rstate.replace(
      d_buf=jnp.where(stale, d, rstate.d_buf).astype(rstate.d_buf.dtype),
      k_buf=jnp.where(stale, k, rstate.k_buf).astype(rstate.k_buf.dtype),
      g_sum=jnp.where(empty, g_sum, rstate.g_sum).astype(jnp.float32))


def random_kda_replay_state(key, batch: int, num_v_heads: int, key_dim: int,
                            value_dim: int, buffer_len: int, counts,
                            gate_lower_bound=None,
                            checkpoint_dtype=jnp.float32,
                            buffer_dtype=jnp.float32):
  """A KDAReplayState with counts[r] random buffered tokens in row r
  (normalised keys, per-channel log-decays in [max(lb, -1), -0.05], keys
  pre-decayed as the step stores them) and stale slots poisoned.

  Returns (rstate, full_state): full_state [batch, HV, K, V] f32 is the
  checkpoint advanced over each row's buffered tokens one at a time (S <-
  diag(exp(g_j)) S + k_j d_j^T), independent of `kda_materialize`.
  """
  counts = np.asarray(counts, np.int32)
  if counts.shape != (batch,):
    raise ValueError(f"counts must have shape ({batch},), got {counts.shape}")
  L = buffer_len
  lb = check_gate_bound(L, gate_lower_bound, buffer_dtype)
  kc, kd, kk, kg = jax.random.split(key, 4)
  ck = jax.random.normal(kc, (batch, num_v_heads, key_dim, value_dim),
                         jnp.float32).astype(checkpoint_dtype)
  d = jax.random.normal(kd, (batch, L, num_v_heads, value_dim)) * 0.5
  k = GR.l2norm(jax.random.normal(kk, (batch, L, num_v_heads, key_dim)))
  g = -jax.random.uniform(kg, (batch, L, num_v_heads, key_dim), jnp.float32,
                          0.05, min(1.0, -lb))
  G = jnp.cumsum(g, axis=1)
  live = (np.arange(L)[None, :] < counts[:, None])
  last = jnp.asarray(np.maximum(counts - 1, 0))
  g_sum = jnp.where(jnp.asarray(counts > 0)[:, None, None],
                    G[jnp.arange(batch), last], 0.0)
  k_dec = jnp.where(jnp.asarray(live)[..., None, None], k * jnp.exp(-G), 0.0)
  rstate = fill_stale_slots(KDAReplayState(
      checkpoint=ck, d_buf=d.astype(buffer_dtype),
      k_buf=k_dec.astype(buffer_dtype), g_sum=g_sum,
      count=jnp.asarray(counts), gate_lower_bound=lb))
  state = ck.astype(jnp.float32)
  for j in range(L):
    nxt = (state * jnp.exp(g[:, j])[..., None]
           + k[:, j][..., :, None] * d[:, j][..., None, :])
    state = jnp.where((j < counts)[:, None, None, None], nxt, state)
  return rstate, state
