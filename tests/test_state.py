"""ReplayState as a pytree, jit behaviour (one compile, NaN on bad counts)
and purity (inputs are never mutated)."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import testing
from tests import cases as C
from tests import harness

D = C.DIMS
FIELDS = ("checkpoint", "x_buf", "b_buf", "dt_buf", "count")


def _state_and_step(buffer_len=4, seed=0, counts=None, **kw):
  """(params, ragged rstate, baseline full state, time-major steps)."""
  case = C.ReplayCase(buffer_len, seed=seed, **kw)
  inputs = harness.decode_inputs(case)
  rstate = inputs.rstate
  if counts is not None:
    rstate = rstate.replace(count=jnp.asarray(counts, jnp.int32))
  return inputs.params, rstate, inputs.full_state, inputs.steps


def _token(steps, t):
  return jax.tree.map(lambda a: a[t], steps)


def _kw(tok, params):
  return dict(x=tok["x"], dt=tok["dt"], A=params["A"], B=tok["B"],
              C=tok["C"], D=params["D"], z=tok["z"],
              dt_bias=params["dt_bias"], dt_softplus=True)


@jax.jit
def _step(s, tok, p):
  return rs.replay_state_update(s, **_kw(tok, p))


# -------------------------------------------------------------------- pytree
def test_pytree_flatten_unflatten_roundtrip():
  _, rstate, _, _ = _state_and_step()
  leaves, treedef = jax.tree_util.tree_flatten(rstate)
  assert len(leaves) == len(FIELDS)
  for leaf, name in zip(leaves, FIELDS):
    assert leaf is getattr(rstate, name), name
  back = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(back, rs.ReplayState)
  chex.assert_trees_all_equal(back, rstate)
  assert jax.tree_util.tree_structure(back) == treedef


def test_pytree_jit_in_and_out():
  _, rstate, _, _ = _state_and_step()

  @jax.jit
  def bump(s):
    return s.replace(count=(s.count + 1) % s.buffer_len)

  out = bump(rstate)
  assert isinstance(out, rs.ReplayState)
  np.testing.assert_array_equal(out.count, (rstate.count + 1) % 4)
  chex.assert_trees_all_equal(out.replace(count=rstate.count), rstate)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, rstate)


def test_pytree_tree_map_and_vmap():
  params, rstate, full, steps = _state_and_step()
  half = jax.tree.map(lambda a: a[:2], rstate)
  assert isinstance(half, rs.ReplayState) and half.batch == 2
  half.validate()
  testing.assert_close(rs.materialize(half, params["A"]), full[:2],
                       testing.TOLERANCES["float32"], "sliced state")

  # vmap over a leading axis of two stacked states == two separate calls.
  other = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), rstate)
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), rstate, other)
  tok = _token(steps, 0)
  y, new = jax.jit(jax.vmap(_step, in_axes=(0, None, None)))(stacked, tok,
                                                             params)
  assert isinstance(new, rs.ReplayState) and new.checkpoint.ndim == 5
  for i, s in enumerate((rstate, other)):
    y_i, new_i = _step(s, tok, params)
    testing.assert_close(y[i], y_i, testing.TOLERANCES["float32"], f"y[{i}]")
    chex.assert_trees_all_close(jax.tree.map(lambda a: a[i], new), new_i,
                                rtol=1e-6, atol=1e-6)


def test_replay_state_is_frozen():
  _, rstate, _, _ = _state_and_step()
  with pytest.raises(dataclasses.FrozenInstanceError):
    rstate.count = jnp.zeros_like(rstate.count)
  with pytest.raises(dataclasses.FrozenInstanceError):
    rstate.checkpoint = rstate.checkpoint
  new = rstate.replace(count=(rstate.count + 1) % 4)
  assert new is not rstate
  assert not np.array_equal(new.count, rstate.count)


def test_properties_and_constructors():
  st = rs.ReplayState.create(D.batch, D.nheads, D.headdim, D.dstate,
                             D.ngroups, 8, checkpoint_dtype=jnp.bfloat16,
                             buffer_dtype=jnp.float16)
  assert (st.batch, st.nheads, st.headdim, st.dstate, st.ngroups,
          st.buffer_len) == (D.batch, D.nheads, D.headdim, D.dstate,
                             D.ngroups, 8)
  assert st.checkpoint.dtype == jnp.bfloat16
  assert st.x_buf.dtype == st.b_buf.dtype == jnp.float16
  assert st.dt_buf.dtype == jnp.float32 and st.count.dtype == jnp.int32
  assert st.x_buf.shape == (D.batch, 8, D.nheads, D.headdim)
  assert st.b_buf.shape == (D.batch, 8, D.ngroups, D.dstate)
  assert st.dt_buf.shape == (D.batch, 8, D.nheads)
  st.validate()

  state = harness.random_state(jax.random.PRNGKey(3), D)
  params = testing.random_params(jax.random.PRNGKey(4), D.nheads)
  wrapped = rs.ReplayState.from_ssm_state(state, D.ngroups, 4)
  assert wrapped.checkpoint.dtype == jnp.float32
  assert wrapped.x_buf.dtype == jnp.bfloat16  # the default buffer dtype
  np.testing.assert_array_equal(wrapped.count, np.zeros(D.batch))
  # An empty buffer materializes to the state itself, exactly.
  np.testing.assert_array_equal(rs.materialize(wrapped, params["A"]), state)
  low = rs.ReplayState.from_ssm_state(state, D.ngroups, 4,
                                      checkpoint_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(low.checkpoint,
                                state.astype(jnp.bfloat16))


# ----------------------------------------------------------------------- jit
@pytest.mark.parametrize("buffer_len", [4, 8])
def test_jitted_replay_step_compiles_once(buffer_len):
  """2L+3 steps through one jitted step: counts wrap around (every row
  flushes twice) with a single trace/compile."""
  params, rstate, _, steps = _state_and_step(buffer_len, seed=buffer_len)
  chex.clear_trace_counter()
  traces = []

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(s, tok, p):
    traces.append(1)
    return rs.replay_state_update(s, **_kw(tok, p))

  seen = []
  for t in range(2 * buffer_len + 3):
    y, rstate = step(rstate, _token(steps, t), params)
    seen.append(np.asarray(rstate.count))
    assert np.all(np.isfinite(np.asarray(y)))
  assert len(traces) == 1
  seen = np.stack(seen)
  for r in range(D.batch):  # every value of the counter was visited
    assert set(seen[:, r].tolist()) == set(range(buffer_len))


def test_jitted_baseline_step_and_materialize_compile_once():
  params, rstate, full, steps = _state_and_step(4, seed=9)
  chex.clear_trace_counter()
  traces = []

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(s, st, tok, p):
    traces.append(1)
    y, st = rs.selective_state_update(st, **_kw(tok, p))
    y2, s = rs.replay_state_update(s, **_kw(tok, p))
    return s, st, y, y2, rs.materialize(s, p["A"])

  for t in range(6):
    rstate, full, _, _, _ = step(rstate, full, _token(steps, t), params)
  assert len(traces) == 1


def test_out_of_range_count_under_jit_gives_nan_rows():
  """Values cannot be checked under jit: rows with a count outside [0, L)
  output NaN (and stay NaN), the other rows are unaffected."""
  L = 4
  params, rstate, _, steps = _state_and_step(L, seed=21)
  # (Rows 2 and 3 keep counts within their filled slots: the rest are
  # poisoned.)
  good = rstate.replace(count=jnp.asarray([0, 1, 0, 1], jnp.int32))
  bad = rstate.replace(count=jnp.asarray([-1, L, 0, 1], jnp.int32))
  mat = jax.jit(rs.materialize)

  y_good, _ = _step(good, _token(steps, 0), params)
  y_bad, nxt = _step(bad, _token(steps, 0), params)
  y_bad, nxt = np.asarray(y_bad), nxt
  assert np.all(np.isnan(y_bad[:2])), "out-of-range rows must be NaN"
  assert np.all(np.isfinite(y_bad[2:]))
  np.testing.assert_array_equal(harness.bits(y_bad[2:]),
                                harness.bits(y_good[2:]))
  m = np.asarray(mat(bad, params["A"]))
  assert np.all(np.isnan(m[:2])) and np.all(np.isfinite(m[2:]))
  # The bad rows stay bad on the following steps.
  for t in range(1, 2 * L):
    y_bad, nxt = _step(nxt, _token(steps, t), params)
    y_bad = np.asarray(y_bad)
    assert np.all(np.isnan(y_bad[:2])), f"step {t}"
    assert np.all(np.isfinite(y_bad[2:])), f"step {t}"
  # Eagerly, the same state is rejected up front.
  with pytest.raises(ValueError, match=r"rstate\.count must lie in"):
    rs.replay_state_update(bad, **_kw(_token(steps, 0), params))


# -------------------------------------------------------------------- purity
def _np_copy(tree):
  return jax.tree.map(lambda a: np.array(a, copy=True), tree)


def _assert_unchanged(before, after_tree, what):
  after = jax.tree.map(np.asarray, after_tree)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                          jax.tree.leaves(after)):
    np.testing.assert_array_equal(
        harness.bits(a), harness.bits(b),
        err_msg=f"{what}: input {jax.tree_util.keystr(path)} was mutated")


def test_inputs_are_not_mutated():
  """Every public op leaves its inputs unchanged. They are passed as
  writable numpy arrays (also as the fields of a ReplayState): jax arrays
  are immutable, numpy arrays are what an op could modify in place."""
  params, rstate, full, steps = _state_and_step(4, seed=31,
                                                counts=[0, 3, 2, 1])
  tok = _token(steps, 0)
  seq = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1)[:, :6], steps)
  kx, kw, kb, ki = jax.random.split(jax.random.PRNGKey(5), 4)
  conv = dict(x=jax.random.normal(kx, (3, 7, 10)),
              weight=jax.random.normal(kw, (10, 4)),
              bias=jax.random.normal(kb, (10,)),
              state=jax.random.normal(ki, (3, 3, 10)))
  inputs = dict(params=params, rstate=rstate, full=full, tok=tok, seq=seq,
                conv=conv)
  inputs = jax.tree.map(lambda a: np.array(a, copy=True), inputs)
  assert inputs["rstate"].x_buf.flags.writeable
  before = _np_copy(inputs)
  p, st, t, sq, cv = (inputs["params"], inputs["rstate"], inputs["tok"],
                      inputs["seq"], inputs["conv"])

  rs.selective_state_update(inputs["full"], **_kw(t, p))
  rs.replay_state_update(st, **_kw(t, p))
  _step(st, t, p)
  rs.materialize(st, p["A"])
  rs.ReplayState.from_ssm_state(inputs["full"], D.ngroups, 4)
  rs.ssd_chunked_scan(sq["x"], sq["dt"], p["A"], sq["B"], sq["C"], 4,
                      D=p["D"], z=sq["z"], dt_bias=p["dt_bias"],
                      dt_softplus=True, initial_state=inputs["full"])
  rs.causal_conv1d(cv["x"], cv["weight"], cv["bias"], cv["state"])
  rs.causal_conv1d_update(cv["x"][:, 0], cv["state"], cv["weight"],
                          cv["bias"])
  _assert_unchanged(before, inputs, "after every op")


def test_with_policy_adds_read_copy_and_counters():
  """with_policy keeps checkpoint, buffers and counts and adds the read copy
  (== precision.store of the checkpoint, to nearest) and the SR
  counters."""
  from replayssm_jax import precision as P  # pylint: disable=g-import-not-at-top
  params = testing.random_params(jax.random.PRNGKey(0), 4)
  state, _ = testing.random_replay_state(jax.random.PRNGKey(1), 3, 4, 8, 8, 2,
                                      4, np.array([0, 1, 3]), params["A"])
  out = state.with_policy(P.PrecisionPolicy.preset("f32+int8+sr"))
  for name in ("checkpoint", "x_buf", "b_buf", "dt_buf", "count"):
    np.testing.assert_array_equal(getattr(out, name), getattr(state, name))
  copy, scale = P.store(state.checkpoint.astype(jnp.float32), "int8")
  np.testing.assert_array_equal(out.read_copy, copy)
  np.testing.assert_array_equal(out.read_scale, scale)
  np.testing.assert_array_equal(out.row_id, [0, 1, 2])
  np.testing.assert_array_equal(out.step, [0, 0, 0])
  with pytest.raises(ValueError, match="policy must be a PrecisionPolicy"):
    state.with_policy(None)
