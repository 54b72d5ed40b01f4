"""Shared set-up of the verify / commit tests on a ReplayState: shapes,
random states and windows, the token-by-token baseline, jitted verify +
commit, and the precision-policy helpers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax import precision as prec
from replayssm_jax import testing
from tests import harness

B, H, P, N, G = 4, 4, 8, 8, 2
TOL = testing.TOLERANCES["float32"]


def replay_setup(L, seed, counts):
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  rstate, full = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"])
  return params, rstate, full


def random_window(seed, T):
  return testing.random_step_inputs(jax.random.PRNGKey(seed), B, H, P, N, G,
                                    seqlen=T)


@functools.partial(jax.jit, compiler_options=harness.FAST_COMPILE)
def baseline_window(state, win, params):
  """Baseline steps over the window: (y [b, T, h, p], states [T, b, ...])."""
  def step(s, tok):
    y, s = rs.selective_state_update(s, **tok, **params, dt_softplus=True,
                                     implementation="reference")
    return s, (y, s)
  _, (ys, states) = jax.lax.scan(step, state, harness.time_major(win))
  return jnp.swapaxes(ys, 0, 1), states


@functools.partial(jax.jit, static_argnames=("T",),
                   compiler_options=harness.FAST_COMPILE)
def verify_commit(rstate, win, params, n, *, T):
  y, pending = rs.replay_verify(rstate, **win, **params, dt_softplus=True)
  return y, pending, rs.replay_commit(pending, n, T)


def policy_setup(L, seed, counts, name):
  """(policy, params, ragged replay state of preset `name` with f32
  buffers: its read copy stored from the master, random row ids and steps
  with stochastic rounding; the f32 full state it stands for)."""
  pol = prec.PrecisionPolicy.preset(name).replace(buffer_dtype="float32",
                                                seed=5)
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, H)
  rstate, full = testing.random_replay_state(
      jax.random.fold_in(key, 1), B, H, P, N, G, L, counts, params["A"],
      checkpoint_dtype=pol.checkpoint_dtype)
  return pol, params, harness.with_policy_fields(
      rstate, pol, [11, 3, 7, 20], [40, 0, 9, 13]), full


@functools.partial(jax.jit, static_argnames=("T", "policy"),
                   compiler_options=harness.FAST_COMPILE)
def verify_commit_policy(rstate, win, params, n, *, T, policy):
  y, pending = rs.replay_verify(rstate, **win, **params, dt_softplus=True,
                                policy=policy, layer=2)
  return y, pending, rs.replay_commit(pending, n, T)


def assert_copy_restored(before, after, pol, rows):
  """after's read copy (and scales) of `rows` == the store of after's
  master, with the bits of before's steps at the read-copy site (SR)."""
  bits = None
  if pol.stochastic_rounding:
    bits = prec.random_bits(pol.seed, 2, before.row_id, before.step,
                            before.checkpoint.shape[1:],
                            prec.SITE_READ_COPY, pol.sr_rng)
  copy, scale = prec.store(after.checkpoint.astype(jnp.float32),
                           pol.read_dtype, bits)
  np.testing.assert_array_equal(np_bits(after.read_copy)[rows],
                                np_bits(copy)[rows])
  if scale is not None:
    np.testing.assert_array_equal(np_bits(after.read_scale)[rows],
                                  np_bits(scale)[rows])


def np_bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
