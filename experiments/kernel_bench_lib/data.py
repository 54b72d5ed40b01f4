"""Fresh random inputs and states for the kernel benchmark (never zeros)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax
from replayssm_jax import testing
from replayssm_jax import traffic


# ------------------------------------------------------------ random data
# Fresh random inputs and states (never zeros), with the distributions of
# `replayssm_jax.testing`: DeviceGen draws them with jitted jax.random on the
# device (fast for GiB-sized state sets); HostGen with numpy, used on the CPU
# backend, where the host *is* the device and numpy needs none of the
# per-shape XLA compilations that dominate small CPU runs.
def _raw_inputs(key, batch, dims, dtype, has_z, seqlen=None):
  return testing.random_step_inputs(
      key, batch, dims.nheads, dims.headdim, dims.dstate, dims.ngroups,
      dtype, dt_softplus=True, with_z=has_z, seqlen=seqlen)


def _raw_state(key, batch, dims, dtype):
  return jax.random.normal(
      key, (batch, dims.nheads, dims.headdim, dims.dstate),
      jnp.float32).astype(dtype)


def _raw_rstate(key, counts, junk, batch, dims, buffer_len, checkpoint_dtype,
                buffer_dtype):
  """A random ReplayState with the given counters ([batch] int32).

  Where `junk` (a traced bool) is true, buffer slots past each row's count
  hold large values, so that a kernel reading stale slots fails its check
  (as in `testing.random_replay_state`).
  """
  H, P, N, G, L = (dims.nheads, dims.headdim, dims.dstate, dims.ngroups,
                   buffer_len)
  kc, kx, kb, kd = jax.random.split(key, 4)
  checkpoint = jax.random.normal(kc, (batch, H, P, N), jnp.float32)
  x_buf = jax.random.normal(kx, (batch, L, H, P), jnp.float32)
  b_buf = jax.random.normal(kb, (batch, L, G, N), jnp.float32)
  dt_buf = jax.random.uniform(kd, (batch, L, H), jnp.float32, 0.01, 0.5)
  return _assemble_rstate(counts, junk, checkpoint.astype(checkpoint_dtype),
                          x_buf, b_buf, dt_buf, buffer_dtype)


def _assemble_rstate(counts, junk, checkpoint, x_buf, b_buf, dt_buf,
                     buffer_dtype, xp=jnp):
  L = x_buf.shape[1]
  stale = (xp.arange(L)[None, :] >= counts[:, None]) & junk  # [b, L]
  x_buf = xp.where(stale[..., None, None], 1e4, x_buf)
  b_buf = xp.where(stale[..., None, None], -1e4, b_buf)
  dt_buf = xp.where(stale[..., None], 50.0, dt_buf)
  return replayssm_jax.ReplayState(
      checkpoint=checkpoint, x_buf=x_buf.astype(buffer_dtype),
      b_buf=b_buf.astype(buffer_dtype), dt_buf=dt_buf.astype(xp.float32),
      count=counts.astype(xp.int32))


_gen_inputs = jax.jit(_raw_inputs, static_argnums=(1, 2, 3, 4, 5))
_gen_state = jax.jit(_raw_state, static_argnums=(1, 2, 3))
_gen_rstate = jax.jit(_raw_rstate, static_argnums=(3, 4, 5, 6, 7))


class DeviceGen:
  """Random data drawn on the device (jitted jax.random, "rbg" keys)."""

  def __init__(self, seed: int, dims: traffic.LayerDims):
    self.dims = dims
    self.key = jax.random.key(seed, impl="rbg")
    self.counter = 0

  def _key(self):
    self.counter += 1
    return jax.random.fold_in(self.key, self.counter)

  def inputs(self, batch, dtype, has_z, seqlen=None):
    """Leaves [batch, ...], or [seqlen, batch, ...] with seqlen."""
    inp = _gen_inputs(self._key(), batch, self.dims, dtype, has_z, seqlen)
    if seqlen is None:
      return inp
    return jax.tree.map(lambda v: jnp.swapaxes(v, 0, 1), inp)

  def state(self, batch, dtype):
    return _gen_state(self._key(), batch, self.dims, dtype)

  def rstate(self, counts, junk, buffer_len, checkpoint_dtype,
             buffer_dtype):
    counts = jnp.asarray(np.asarray(counts, np.int32))
    return _gen_rstate(self._key(), counts, junk, counts.shape[0],
                       self.dims, buffer_len, checkpoint_dtype, buffer_dtype)


class HostGen:
  """numpy twin of DeviceGen (same distributions)."""

  def __init__(self, seed: int, dims: traffic.LayerDims):
    self.dims = dims
    self.rng = np.random.default_rng(seed)

  @staticmethod
  def _put(a, dtype):
    # ml_dtypes casts on the host, so the transfer needs no compiled convert.
    return jnp.asarray(np.asarray(a, np.float32).astype(dtype))

  def inputs(self, batch, dtype, has_z, seqlen=None):
    d, r = self.dims, self.rng
    lead = (batch,) if seqlen is None else (seqlen, batch)
    H, P, N, G = d.nheads, d.headdim, d.dstate, d.ngroups
    out = dict(x=r.standard_normal(lead + (H, P)),
               dt=r.standard_normal(lead + (H,)) * 0.5 - 0.5,
               B=r.standard_normal(lead + (G, N)),
               C=r.standard_normal(lead + (G, N)) / np.sqrt(N),
               z=r.standard_normal(lead + (H, P)) if has_z else None)
    return {k: None if v is None else self._put(v, dtype)
            for k, v in out.items()}

  def state(self, batch, dtype):
    d = self.dims
    shape = (batch, d.nheads, d.headdim, d.dstate)
    return self._put(self.rng.standard_normal(shape, np.float32), dtype)

  def rstate(self, counts, junk, buffer_len, checkpoint_dtype,
             buffer_dtype):
    d, r, L = self.dims, self.rng, buffer_len
    counts = np.asarray(counts, np.int32)
    b = counts.shape[0]
    rs = _assemble_rstate(
        counts, junk, self.state(b, checkpoint_dtype),
        r.standard_normal((b, L, d.nheads, d.headdim), np.float32),
        r.standard_normal((b, L, d.ngroups, d.dstate), np.float32),
        r.uniform(0.01, 0.5, (b, L, d.nheads)), buffer_dtype, xp=np)
    return jax.tree.map(jnp.asarray, rs)
