"""Property-based tests of the public ops (hypothesis).

Random shapes, dtypes, counts, windows, accepted counts, flush schedules,
poisoned stale slots and NaN/Inf positions; each property states what must
hold: equality with a float64 numpy oracle of the recurrence, finite
outputs for unaffected rows, causality, and clear errors for bad input.
The default profile ("ci", conftest.py) runs a fixed budget of examples;
`pytest tests/test_fuzz.py --hypothesis-profile=long` runs many more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import ssd, testing

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies
given = hyp.given

# Small shape sets: every example reuses compiled ops of a few shapes.
GEOMS = st.sampled_from([(2, 4, 4, 8, 2), (3, 2, 8, 4, 1), (1, 6, 4, 4, 3)])
POISON = st.sampled_from([np.nan, np.inf, -np.inf, 3e38])


def _softplus(v):
  return np.where(v <= 20.0, np.log1p(np.exp(np.minimum(v, 20.0))), v)


def oracle(state, xs, dts, A, Bs, Cs, D, dt_bias):
  """float64 baseline recurrence over tokens [t] (lists of [b, ...]):
  (outputs [t][b, h, p], final state)."""
  s = np.asarray(state, np.float64)
  h = s.shape[1]
  ys = []
  for x, dt, B, C in zip(xs, dts, Bs, Cs):
    d = _softplus(np.asarray(dt, np.float64) + dt_bias)  # [b, h]
    rep = h // B.shape[1]
    bh = np.repeat(np.asarray(B, np.float64), rep, axis=1)
    ch = np.repeat(np.asarray(C, np.float64), rep, axis=1)
    x = np.asarray(x, np.float64)
    s = (s * np.exp(d * A)[..., None, None]
         + (d[..., None] * x)[..., None] * bh[:, :, None, :])
    ys.append(np.einsum("bhpn,bhn->bhp", s, ch) + D[:, None] * x)
  return ys, s


def _params(seed, h):
  p = testing.random_params(jax.random.PRNGKey(seed), h)
  return p, {k: np.asarray(v, np.float64) for k, v in p.items()}


def _poisoned_state(seed, geom, L, counts, poison):
  b, h, p, n, g = geom
  key = jax.random.PRNGKey(seed)
  prm, prm64 = _params(seed, h)
  rstate, full = testing.random_replay_state(key, b, h, p, n, g, L, counts,
                                             prm["A"])
  rstate = testing.fill_stale_slots(rstate, poison)
  return prm, prm64, rstate, np.asarray(full, np.float64)


def _assert_oracle(y, want, what):
  y = np.asarray(y, np.float64)
  assert np.isfinite(y).all(), f"{what}: non-finite"
  testing.assert_close(y, want, testing.TOLERANCES["float32"], what)


@given(geom=GEOMS, L=st.sampled_from([1, 2, 4, 8]), data=st.data(),
       poison=POISON, seed=st.integers(0, 2 ** 16))
def test_decode_steps_equal_the_float64_oracle(geom, L, data, poison, seed):
  """From ragged poisoned counts, `nsteps` decode steps (every flush
  schedule the counts give) equal the float64 recurrence."""
  b, h, p, n, g = geom
  counts = data.draw(st.lists(st.integers(0, L - 1), min_size=b,
                              max_size=b), label="counts")
  nsteps = data.draw(st.integers(1, 2 * L + 1), label="nsteps")
  prm, prm64, rstate, full = _poisoned_state(seed, geom, L, counts, poison)
  steps = testing.random_step_inputs(jax.random.PRNGKey(seed + 1), b, h, p,
                                     n, g, seqlen=nsteps, with_z=False)
  tok = [{k: v[:, t] for k, v in steps.items() if v is not None}
         for t in range(nsteps)]
  want, _ = oracle(full, [t["x"] for t in tok], [t["dt"] for t in tok],
                   prm64["A"], [t["B"] for t in tok], [t["C"] for t in tok],
                   prm64["D"], prm64["dt_bias"])
  for t in range(nsteps):
    y, rstate = rs.replay_state_update(rstate, **tok[t], **prm,
                                       dt_softplus=True)
    _assert_oracle(y, want[t], f"step {t}")


@given(geom=GEOMS, data=st.data(), poison=POISON,
       seed=st.integers(0, 2 ** 16))
def test_verify_and_commit_equal_the_oracle(geom, data, poison, seed):
  """A verify window over poisoned stale slots equals the oracle's steps;
  committing a random acceptance leaves the state of the accepted prefix
  (materialized, and decoding on from it)."""
  b, h, p, n, g = geom
  L = data.draw(st.sampled_from([4, 8]), label="L")
  T = data.draw(st.integers(1, L - 1), label="T")
  counts = data.draw(st.lists(st.integers(0, L - 1), min_size=b,
                              max_size=b), label="counts")
  acc = np.asarray(data.draw(st.lists(st.integers(1, T), min_size=b,
                                      max_size=b), label="accepted"))
  prm, prm64, rstate, full = _poisoned_state(seed, geom, L, counts, poison)
  win = testing.random_step_inputs(jax.random.PRNGKey(seed + 2), b, h, p, n,
                                   g, seqlen=T, with_z=False)
  del win["z"]
  cols = [{k: np.asarray(v[:, t]) for k, v in win.items()} for t in range(T)]
  want, _ = oracle(full, [c["x"] for c in cols], [c["dt"] for c in cols],
                   prm64["A"], [c["B"] for c in cols], [c["C"] for c in cols],
                   prm64["D"], prm64["dt_bias"])
  y, pending = rs.replay_verify(rstate, **win, **prm, dt_softplus=True)
  for t in range(T):
    _assert_oracle(y[:, t], want[t], f"window position {t}")
  committed = rs.replay_commit(pending, jnp.asarray(acc, jnp.int32))
  state = np.asarray(rs.materialize(committed, prm["A"]), np.float64)
  for r in range(b):
    _, s = oracle(full[r:r + 1], *[[c[k][r:r + 1] for c in cols[:acc[r]]]
                                   for k in ("x", "dt")], prm64["A"],
                  [c["B"][r:r + 1] for c in cols[:acc[r]]],
                  [c["C"][r:r + 1] for c in cols[:acc[r]]], prm64["D"],
                  prm64["dt_bias"])
    testing.assert_close(state[r:r + 1], s, testing.TOLERANCES["float32"],
                         f"row {r} after accepting {acc[r]}")


@given(geom=GEOMS, data=st.data(), poison=POISON,
       field=st.sampled_from(["x", "B", "dt"]), seed=st.integers(0, 2 ** 16))
def test_verify_window_causality(geom, data, poison, field, seed):
  """A poisoned window token at position s leaves positions < s
  bit-identical, on every row."""
  b, h, p, n, g = geom
  L, T = 8, data.draw(st.integers(2, 7), label="T")
  s = data.draw(st.integers(1, T - 1), label="position")
  counts = data.draw(st.lists(st.integers(0, L - 1), min_size=b,
                              max_size=b), label="counts")
  prm, _, rstate, _ = _poisoned_state(seed, geom, L, counts, np.nan)
  win = testing.random_step_inputs(jax.random.PRNGKey(seed + 3), b, h, p, n,
                                   g, seqlen=T)
  y0, _ = rs.replay_verify(rstate, **win, **prm, dt_softplus=True)
  bad = dict(win, **{field: win[field].at[:, s].set(poison)})
  y1, _ = rs.replay_verify(rstate, **bad, **prm, dt_softplus=True)
  np.testing.assert_array_equal(np.asarray(y1[:, :s]), np.asarray(y0[:, :s]))
  assert np.isfinite(np.asarray(y1[:, :s])).all()


@given(seqlen=st.integers(2, 24), chunk=st.sampled_from([1, 3, 4, 8]),
       data=st.data(), poison=POISON, field=st.sampled_from(["x", "B", "dt"]),
       seed=st.integers(0, 2 ** 16))
def test_ssd_scan_causality(seqlen, chunk, data, poison, field, seed):
  pos = data.draw(st.integers(1, seqlen - 1), label="position")
  h, p, n, g = 4, 4, 8, 2
  prm, _ = _params(seed, h)
  seq = testing.random_step_inputs(jax.random.PRNGKey(seed), 2, h, p, n, g,
                                   seqlen=seqlen)

  def run(s):
    return np.asarray(ssd.ssd_chunked_scan(
        s["x"], s["dt"], prm["A"], s["B"], s["C"], chunk, prm["D"], s["z"],
        prm["dt_bias"], True)[0])

  y0 = run(seq)
  y1 = run(dict(seq, **{field: seq[field].at[:, pos].set(poison)}))
  np.testing.assert_array_equal(y1[:, :pos], y0[:, :pos])


@given(geom=GEOMS, arg=st.sampled_from(["x", "dt", "B", "C", "z"]),
       axis=st.integers(0, 2), delta=st.sampled_from([-1, 1, 3]))
def test_wrong_shapes_name_the_argument(geom, arg, axis, delta):
  """Any one argument of a decode step with one wrong dimension: a
  ValueError naming that argument."""
  b, h, p, n, g = geom
  prm, _ = _params(0, h)
  rstate = rs.ReplayState.create(b, h, p, n, g, 4)
  tok = testing.random_step_inputs(jax.random.PRNGKey(0), b, h, p, n, g)
  v = tok[arg]
  axis = min(axis, v.ndim - 1)
  shape = list(v.shape)
  shape[axis] = max(1, shape[axis] + delta)
  hyp.assume(tuple(shape) != v.shape)
  bad = dict(tok, **{arg: jnp.ones(shape, v.dtype)})
  with pytest.raises(ValueError, match=rf"\b{arg}\b"):
    rs.replay_state_update(rstate, **bad, **prm, dt_softplus=True)


@given(n=st.one_of(st.integers(-3, 12), st.sampled_from([np.int64(2),
                                                         np.int8(1)])),
       T=st.integers(1, 3))
def test_commit_counts_checked_eagerly_and_marked_under_jit(n, T):
  """An accepted count outside [1, T]: a ValueError eagerly; under jit the
  row's counter becomes -1 (every later output NaN), other rows exact."""
  prm, _ = _params(0, 4)
  rstate = rs.ReplayState.create(2, 4, 4, 8, 2, 4)
  win = testing.random_step_inputs(jax.random.PRNGKey(0), 2, 4, 4, 8, 2,
                                   seqlen=T)
  _, pending = rs.replay_verify(rstate, **win, **prm, dt_softplus=True)
  acc = jnp.asarray([int(n), 1], jnp.int32)
  ok = 1 <= int(n) <= T
  if not ok:
    with pytest.raises(ValueError, match="num_accepted must lie in"):
      rs.replay_commit(pending, acc)
  out = jax.jit(rs.replay_commit)(pending, acc)
  assert int(out.count[0]) == (int(n) if ok else -1)
  assert int(out.count[1]) == 1
