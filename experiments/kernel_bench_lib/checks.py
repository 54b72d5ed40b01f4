"""The kernel benchmark's checks of each implementation against the
reference, on the device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax
from experiments.kernel_bench_lib.steps import (_baseline_step, _replay_step,
                                                _state_dtypes)
from replayssm_jax import testing


# ----------------------------------------------------------------- checks
@jax.jit
def _close_stats(actual, expected, atol, rtol):
  """On-device twin of testing.max_rel_error / assert_close.

  Returns (max |a - e| / max |e| (inf if a is not finite), whether every
  |a - e| <= atol max|e| + rtol |e|). The check runs where the arrays are:
  at batch 256 the states are GiB-sized, and copying them to the host (and
  numpy over them) cost seconds per check.
  """
  a = actual.astype(jnp.float32)
  e = expected.astype(jnp.float32)
  finite = jnp.all(jnp.isfinite(a))
  scale = jnp.maximum(jnp.max(jnp.abs(e)), 1e-30)
  err = jnp.abs(a - e)
  ok = finite & jnp.all(err <= atol * scale + rtol * jnp.abs(e))
  return jnp.where(finite, jnp.max(err) / scale, jnp.inf), ok


def _errors_ok(actual, expected, tol):
  if actual.shape != expected.shape:
    return float("inf"), False
  err, ok = _close_stats(actual, expected, tol.atol, tol.rtol)
  return float(err), bool(ok)


@functools.partial(jax.jit, static_argnums=3)
def _baseline_check_run(state, inp, params, impl):
  """One baseline step of impl and of the reference on the same inputs."""
  return (_baseline_step(state, inp, params, impl),
          _baseline_step(state, inp, params, "reference"))


def check_baseline(impl, gen, *, batch, state_dtype, act_dtype, has_z,
                   params):
  """impl vs reference on one random baseline step (one compilation)."""
  state = gen.state(batch, state_dtype)
  inp = gen.inputs(batch, act_dtype, has_z)
  (y, s), (y_ref, s_ref) = _baseline_check_run(state, inp, params, impl)
  tol = testing.tolerance(state_dtype, act_dtype)
  ey, oky = _errors_ok(y, y_ref, tol)
  es, oks = _errors_ok(s, s_ref, tol)
  return dict(passed=bool(oky and oks), max_err_y=ey, max_err_state=es,
              tolerance=tol.atol)


@functools.partial(jax.jit, static_argnums=3)
def _replay_check_run(rs0, xs, params, impl):
  """L consecutive replay steps of impl (lax.scan) -> outputs, final state."""
  def step(rs, inp):
    y, rs = _replay_step(rs, inp, params, impl)
    return rs, y

  rs, ys = jax.lax.scan(step, rs0, xs)
  return dict(ys=ys, state=replayssm_jax.materialize(rs, params["A"]),
              checkpoint=rs.checkpoint, count=rs.count)


def check_replay(impl, gen, *, batch, buffer_len, checkpoint_dtype,
                 buffer_dtype, act_dtype, has_z, params, cache=None):
  """impl vs reference over one full L-step cycle from ragged counters.

  Row r starts at count (L-1-r) mod L (row 0 flushes first) with junk in
  its stale buffer slots, so within the L steps every row visits every
  fill, flush included. Compares y at every step, the counters exactly, the
  checkpoint and the materialized state at the end. `cache` (a dict) keeps
  the random inputs and the reference's results per shape, so every
  implementation checked at one shape runs on the same fresh inputs and
  the (slow to compile) reference runs once.
  """
  L = buffer_len
  policy, checkpoint_dtype, buffer_dtype, read_dtype = _state_dtypes(
      impl, checkpoint_dtype, buffer_dtype)
  ref_impl = "reference" + (f"@{policy.name}" if policy else "")
  key = (batch, L, checkpoint_dtype.name, ref_impl)
  cache = {} if cache is None else cache
  if key not in cache:
    counts = (L - 1 - np.arange(batch)) % L
    rs0 = gen.rstate(counts, True, L, checkpoint_dtype, buffer_dtype)
    if policy is not None:
      rs0 = rs0.with_policy(policy)
    xs = gen.inputs(batch, act_dtype, has_z, seqlen=L)  # [L, batch, ...]
    ref = _replay_check_run(rs0, xs, params, ref_impl)  # kept on device
    cache.clear()  # one shape at a time: the states may be large
    cache[key] = (rs0, xs, ref)
  rs0, xs, ref = cache[key]
  out = _replay_check_run(rs0, xs, params, impl)
  read = (read_dtype,) if read_dtype else ()
  tol = testing.tolerance(checkpoint_dtype, buffer_dtype, act_dtype, *read)
  ey, oky = _errors_ok(out["ys"], ref["ys"], tol)
  es, oks = _errors_ok(out["state"], ref["state"], tol)
  ec, okc = _errors_ok(out["checkpoint"], ref["checkpoint"], tol)
  counts_ok = bool(jnp.array_equal(out["count"], ref["count"]))
  return dict(passed=bool(oky and oks and okc and counts_ok), max_err_y=ey,
              max_err_state=es, max_err_checkpoint=ec, counts_equal=counts_ok,
              tolerance=tol.atol)
