"""Helpers shared by the test-suite, kernel checks and experiments.

* `TOLERANCES`: the per-dtype comparison table (with the reason for each row).
* `random_params` / `random_step_inputs`: fresh random Mamba-2 decode inputs
  (never zeros) with realistic ranges (decays in (0, 1), small positive dt').
* `random_replay_state`: a ReplayState with ragged per-row counters and a
  random history, plus the full state that a baseline decode over the same
  history would hold (computed token by token with the baseline step, so it
  does not depend on `materialize`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import reference
from replayssm_jax.state import ReplayState


@dataclasses.dataclass(frozen=True)
class Tolerance:
  rtol: float
  atol: float
  why: str


# Keyed by the *lowest* storage precision involved in a comparison (buffer
# dtype for replay-vs-baseline, checkpoint dtype where the state is stored
# low). Errors are measured relative to max|reference| (see assert_close).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(
        1e-5, 1e-5,
        "f32 storage, f32 accumulation: only the association order differs "
        "(one weighted sum and one exp of a sum instead of w sequential "
        "updates); observed ~1e-6 relative over 3L steps."),
    "float16": Tolerance(
        4e-3, 4e-3,
        "f16 storage rounds each stored element once (unit roundoff 4.9e-4); "
        "the replay path reads buffered x/B rounded while the baseline uses "
        "them exactly, and sums up to L such terms, so errors of a few "
        "roundoffs relative to the output scale are expected; they do not "
        "accumulate across flushes beyond one rounding per stored value."),
    "bfloat16": Tolerance(
        3e-2, 3e-2,
        "bf16 keeps 8 mantissa bits (unit roundoff 3.9e-3); same argument as "
        "f16 with a 8x larger roundoff."),
    # 8-bit read copies (precision.PrecisionPolicy.read_dtype). For two
    # implementations of the same policy (kernel vs reference): they fold
    # the master in different f32 orders, so a master element on a rounding
    # boundary can land on neighbouring 8-bit codes and later outputs read
    # the two copies. Errors do not accumulate: every flush re-stores the
    # copy from the master, which only carries f32 (or f16) rounding.
    "int8": Tolerance(
        1e-2, 1e-2,
        "int8 copy: one code step is the row amax / 127 (7.9e-3 of the "
        "row's largest element); a flipped code moves an output (a sum over "
        "dstate of such products) by less than that relative to its "
        "scale."),
    "float8_e4m3fn": Tolerance(
        6.25e-2, 6.25e-2,
        "fp8 e4m3 copy: 3 mantissa bits (unit roundoff 2^-4 = 6.25e-2); a "
        "flipped code is one fp8 ulp (<= 2^-3) of one element, which moves "
        "an output (a sum over dstate of random-sign products) by about "
        "2^-3 / sqrt(dstate) of its scale, < 2^-4 from dstate 16 on."),
}


def tolerance(*dtypes) -> Tolerance:
  """The tolerance of the lowest precision among `dtypes`."""
  order = ["float8_e4m3fn", "int8", "bfloat16", "float16", "float32"]
  names = {jnp.dtype(d).name for d in dtypes}
  for name in order:
    if name in names:
      return TOLERANCES[name]
  return TOLERANCES["float32"]


def max_rel_error(actual, expected) -> float:
  """max |actual - expected| / max |expected| (inf if actual has NaN)."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  e = np.asarray(jnp.asarray(expected, jnp.float32))
  if not np.all(np.isfinite(a)):
    return float("inf")
  scale = max(float(np.max(np.abs(e))), 1e-30)
  return float(np.max(np.abs(a - e)) / scale)


def assert_close(actual, expected, tol: Tolerance, what: str = "") -> None:
  """Element-wise |a - e| <= atol * max|e| + rtol * |e|, NaN fails."""
  a = np.asarray(jnp.asarray(actual, jnp.float32))
  e = np.asarray(jnp.asarray(expected, jnp.float32))
  if a.shape != e.shape:
    raise AssertionError(f"{what}: shape {a.shape} != expected {e.shape}")
  if not np.all(np.isfinite(a)):
    raise AssertionError(f"{what}: non-finite values in result")
  scale = max(float(np.max(np.abs(e))), 1e-30)
  err = np.abs(a - e)
  bound = tol.atol * scale + tol.rtol * np.abs(e)
  if not np.all(err <= bound):
    i = np.unravel_index(np.argmax(err - bound), err.shape)
    raise AssertionError(
        f"{what}: max rel error {float(np.max(err)) / scale:.3e} exceeds "
        f"rtol={tol.rtol} atol={tol.atol} (worst at {i}: got {a[i]}, "
        f"expected {e[i]}).")


def random_params(key, nheads: int, *, with_D=True, with_dt_bias=True):
  """A [-4, -0.5] per head, D ~ N(0, 1), dt_bias ~ N(-1, 0.5)."""
  ka, kd, kb = jax.random.split(key, 3)
  A = -jnp.exp(jax.random.uniform(ka, (nheads,), jnp.float32,
                                  np.log(0.5), np.log(4.0)))
  D = jax.random.normal(kd, (nheads,), jnp.float32) if with_D else None
  dt_bias = (jax.random.normal(kb, (nheads,), jnp.float32) * 0.5 - 1.0
             if with_dt_bias else None)
  return dict(A=A, D=D, dt_bias=dt_bias)


def random_step_inputs(key, batch: int, nheads: int, headdim: int,
                       dstate: int, ngroups: int, dtype=jnp.float32, *,
                       dt_softplus: bool = True, with_z: bool = True,
                       seqlen: int | None = None):
  """x, dt, B, C, z for one decode token ([batch, ...]) or a sequence.

  With seqlen given, each array gets a [batch, seqlen, ...] layout.
  dt is raw (N(0, 0.5) - 0.5) when dt_softplus, else already positive
  (U[0.01, 0.5]) so that A * dt' is a decay either way.
  """
  kx, kdt, kb, kc, kz = jax.random.split(key, 5)
  lead = (batch,) if seqlen is None else (batch, seqlen)
  x = jax.random.normal(kx, lead + (nheads, headdim), jnp.float32)
  if dt_softplus:
    dt = jax.random.normal(kdt, lead + (nheads,), jnp.float32) * 0.5 - 0.5
  else:
    dt = jax.random.uniform(kdt, lead + (nheads,), jnp.float32, 0.01, 0.5)
  B = jax.random.normal(kb, lead + (ngroups, dstate), jnp.float32)
  C = jax.random.normal(kc, lead + (ngroups, dstate), jnp.float32)
  C = C / np.sqrt(dstate)
  z = (jax.random.normal(kz, lead + (nheads, headdim), jnp.float32)
       if with_z else None)
  out = dict(x=x, dt=dt, B=B, C=C, z=z)
  return {k: (None if v is None else v.astype(dtype)) for k, v in out.items()}


def random_replay_state(key, batch: int, nheads: int, headdim: int,
                        dstate: int, ngroups: int, buffer_len: int, counts,
                        A, checkpoint_dtype=jnp.float32,
                        buffer_dtype=jnp.float32):
  """A ReplayState with `counts[r]` random buffered tokens in row r.

  Returns:
    (rstate, full_state): full_state [batch, nheads, headdim, dstate] f32 is
    the checkpoint advanced over each row's buffered tokens one token at a
    time with the *baseline* step (rows stop after their own count).
    Buffer slots past a row's count are poisoned (x NaN, B inf, dt NaN),
    as a rejected draft or a reused slot can leave them: an implementation
    that reads them, or weighs them by zero instead of selecting them away
    (0 * inf = NaN), gives non-finite outputs.
  """
  counts = np.asarray(counts, np.int32)
  if counts.shape != (batch,):
    raise ValueError(f"counts must have shape ({batch},), got {counts.shape}")
  kc, kx, kb, kd = jax.random.split(key, 4)
  checkpoint = jax.random.normal(kc, (batch, nheads, headdim, dstate),
                                 jnp.float32).astype(checkpoint_dtype)
  L = buffer_len
  x_buf = jax.random.normal(kx, (batch, L, nheads, headdim), jnp.float32)
  b_buf = jax.random.normal(kb, (batch, L, ngroups, dstate), jnp.float32)
  dt_buf = jax.random.uniform(kd, (batch, L, nheads), jnp.float32, 0.01, 0.5)
  rstate = fill_stale_slots(
      ReplayState(checkpoint=checkpoint, x_buf=x_buf.astype(buffer_dtype),
                  b_buf=b_buf.astype(buffer_dtype), dt_buf=dt_buf,
                  count=jnp.asarray(counts)), jnp.nan, b=jnp.inf)

  # Baseline over the history: one token at a time, rows masked past count.
  state = checkpoint.astype(jnp.float32)
  zero_c = jnp.zeros((batch, ngroups, dstate), jnp.float32)
  for j in range(L):
    _, nxt = reference.selective_state_update(
        state, rstate.x_buf[:, j].astype(jnp.float32), rstate.dt_buf[:, j],
        A, rstate.b_buf[:, j].astype(jnp.float32), zero_c)
    live = (j < counts)[:, None, None, None]
    state = jnp.where(live, nxt, state)
  return rstate, state


def fill_stale_slots(rstate: ReplayState, x, b=None, dt=None) -> ReplayState:
  """rstate with every buffer slot at or past its row's count set to x in
  the x buffer, b (default x) in the B buffer and dt (default x) in the dt
  buffer, each in its buffer's dtype: poison (NaN, inf) or zeros."""
  stale = (jnp.arange(rstate.buffer_len)[None, :]
           >= jnp.asarray(rstate.count)[:, None])  # [batch, L]
  s4 = stale[..., None, None]
  b = x if b is None else b
  dt = x if dt is None else dt
  return rstate.replace(
      x_buf=jnp.where(s4, x, rstate.x_buf).astype(rstate.x_buf.dtype),
      b_buf=jnp.where(s4, b, rstate.b_buf).astype(rstate.b_buf.dtype),
      dt_buf=jnp.where(stale[..., None], dt, rstate.dt_buf).astype(
          rstate.dt_buf.dtype))
