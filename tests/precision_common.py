"""Shared set-up of the precision-policy tests: shapes, random inputs, a
replay decode under a policy, and bit-level comparison."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax import testing
from tests import harness

B, H, PD, N, G, L = 4, 4, 8, 16, 2, 4
NSTEPS = 2 * L + 2
EPS32 = float(np.finfo(np.float32).eps)
# Rows 0..3 start at counts 0, L-1 (flushes first), L//2, 1.
COUNTS = (0, L - 1, L // 2, 1)


def make_params():
  return testing.random_params(jax.random.PRNGKey(1), H)


def make_steps(seed=2, batch=B, nsteps=NSTEPS):
  return harness.time_major(testing.random_step_inputs(
      jax.random.PRNGKey(seed), batch, H, PD, N, G, seqlen=nsteps))


@functools.partial(jax.jit, static_argnames=("policy",),
                   compiler_options=harness.FAST_COMPILE)
def _wrap(s0, counts, row_id, step, *, policy):
  st = rs.ReplayState.from_ssm_state(s0, G, L, policy=policy, row_id=row_id,
                                     step=step)
  return st.replace(count=counts)


def make_state(policy, batch=B, seed=3, counts=COUNTS, row_id=None, step=None):
  """A state of `policy` from a random full state [batch, H, PD, N], with
  counts (the buffers are empty zeros: the steps fill them)."""
  s0 = jax.random.normal(jax.random.PRNGKey(seed), (batch, H, PD, N))
  if policy.stochastic_rounding:
    row_id = jnp.arange(batch, dtype=jnp.int32) if row_id is None else row_id
    step = jnp.zeros((batch,), jnp.int32) if step is None else step
  return _wrap(s0, jnp.asarray(counts, jnp.int32), row_id, step,
               policy=policy)


def token_at(steps, t):
  return jax.tree.map(lambda a: a[t], steps)


@functools.partial(jax.jit, static_argnames=("policy", "layer"),
                   compiler_options=harness.FAST_COMPILE)
def run_replay(rstate, steps, params, *, policy, layer=0):
  """Replay decode over time-major steps; per-step y and stored fields."""
  def body(st, tok):
    y, st = rs.replay_state_update(
        st, **harness.step_kwargs(tok, params, True), policy=policy,
        layer=layer, implementation="reference")
    out = dict(y=y, checkpoint=st.checkpoint, count=st.count)
    if st.read_copy is not None:
      out["read_copy"] = st.read_copy
    if st.read_scale is not None:
      out["read_scale"] = st.read_scale
    return st, out
  return jax.lax.scan(body, rstate, steps)


def raw_bits(a):
  """Raw bits (numpy view) of a float or int array."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(a, b, what):
  np.testing.assert_array_equal(np.asarray(raw_bits(a)), np.asarray(raw_bits(b)),
                                err_msg=what)
