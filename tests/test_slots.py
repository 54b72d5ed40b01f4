"""Ops and the model's decode step through a slot per row
(`replayssm_jax.slots`): token row i reads and writes state row rows[i] of
a state with more rows than tokens (Mamba-2, decode attention, Gated
DeltaNet). Each implementation with `rows` equals
itself on the gathered rows (outputs and the stepped rows within the
per-dtype tolerance), leaves every other state row bit for bit (free rows
poisoned with NaN / inf), and gives padding rows (a slot outside the
state, or a repeat under jit) NaN outputs and no writes. The Pallas kernels
run in interpret mode on the CPU."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import gdn, models, ops, slots, testing
from replayssm_jax.gdn import testing as gdn_testing
from replayssm_jax.precision import PrecisionPolicy
from replayssm_jax.state import ReplayState
from pallas_kernels import GDNConfig, ReplayConfig
from tests.serving_common import CFG, build_model, poison_rows

CAP, H, P, N, G, L = 7, 4, 16, 16, 2, 4
ROWS = np.array([5, 1, CAP, 2, 6], np.int32)  # CAP: a padding row
LIVE = ROWS < CAP
IMPLS = ("reference", "pallas")


def gathered(tree):
  """The rows ROWS of every leaf (padding rows read row 0)."""
  return jax.tree.map(lambda x: x[np.where(LIVE, ROWS, 0)], tree)


def check_rows(y, new, y_ref, new_ref, before, tol, what):
  """y / new (a step through ROWS) against y_ref / new_ref (the same op on
  the gathered rows); `before`: the state before the step."""
  y = np.asarray(y, np.float32)
  assert np.isnan(y[~LIVE]).all(), f"{what}: padding rows must be NaN"
  testing.assert_close(y[LIVE], np.asarray(y_ref, np.float32)[LIVE], tol,
                       f"{what} y")
  untouched = np.setdiff1d(np.arange(CAP), ROWS[LIVE])
  for a, b, r, name in zip(jax.tree.leaves(new), jax.tree.leaves(before),
                           jax.tree.leaves(new_ref),
                           range(len(jax.tree.leaves(new)))):
    a, b, r = np.asarray(a), np.asarray(b), np.asarray(r)
    assert a[untouched].tobytes() == b[untouched].tobytes(), (
        f"{what}: leaf {name} changed a row outside rows")
    got, want = a[ROWS[LIVE]], r[LIVE]
    if np.issubdtype(got.dtype, np.floating) or got.dtype.kind == "V":
      got = got.astype(np.float32)
      want = want.astype(np.float32)
      finite = np.isfinite(want)  # stale buffer slots stay poisoned
      assert np.array_equal(finite, np.isfinite(got)), f"{what} leaf {name}"
      testing.assert_close(np.where(finite, got, 0), np.where(finite, want, 0),
                           tol, f"{what} leaf {name}")
    else:
      np.testing.assert_array_equal(got, want, f"{what} leaf {name}")


def check_op(op, state, kw, impl, what):
  """op through ROWS against op on the gathered rows (`check_rows`), at
  the tolerance of the state's stored dtypes."""
  out, new = op(state, **kw, rows=ROWS, implementation=impl)
  ref, new_ref = op(gathered(state), **kw, implementation=impl)
  stored = [getattr(state, "checkpoint", state),
            getattr(state, "read_copy", None)]
  check_rows(out, new, ref, new_ref, state,
             testing.tolerance(*(x.dtype for x in stored if x is not None)),
             what)


def step_inputs(seed, dtype=jnp.float32):
  inp = testing.random_step_inputs(jax.random.PRNGKey(seed), len(ROWS), H,
                                   P, N, G, dtype)
  return dict(inp, **testing.random_params(jax.random.PRNGKey(seed + 1), H),
              dt_softplus=True)


@pytest.mark.parametrize("impl", IMPLS)
def test_selective_state_update_through_rows(impl):
  state = jax.random.normal(jax.random.PRNGKey(0), (CAP, H, P, N))
  state = poison_rows(state, 3)  # a free row
  check_op(ops.selective_state_update, state, step_inputs(1), impl, impl)


def ragged_replay_state(policy=None, seed=2):
  """A ReplayState of CAP rows with counts 0 .. L-1 (rows 1 and 6 about to
  flush), stale slots poisoned, row 3 poisoned whole."""
  counts = np.array([0, L - 1, 1, 2, 2, 0, L - 1], np.int32)
  A = testing.random_params(jax.random.PRNGKey(seed), H)["A"]
  rs, _ = testing.random_replay_state(jax.random.PRNGKey(seed), CAP, H, P,
                                      N, G, L, counts, A)
  if policy is not None:  # the same history, stored per the policy
    sr = dict(row_id=jnp.arange(CAP, dtype=jnp.int32) + 11,
              step=jnp.full((CAP,), 5, jnp.int32))
    full = ReplayState.from_ssm_state(
        rs.checkpoint, G, L, policy=policy,
        **(sr if policy.stochastic_rounding else {}))
    rs = full.replace(x_buf=rs.x_buf.astype(full.x_buf.dtype),
                      b_buf=rs.b_buf.astype(full.b_buf.dtype),
                      dt_buf=rs.dt_buf, count=rs.count)
  return poison_rows(rs, 3)


@pytest.mark.parametrize("impl", IMPLS + ("pallas/rows_flush_grid",))
@pytest.mark.parametrize("preset", (None, "f32+bf16", "f16+fp8+sr"))
def test_replay_state_update_through_rows(impl, preset):
  """Ragged counters with flushing rows, plain and with a read copy (and
  stochastic rounding keyed by the state row's id and step); the kernels'
  flush on its persistent grid (the default) and on the output route's."""
  policy = None if preset is None else PrecisionPolicy.preset(preset)
  rs = ragged_replay_state(policy)
  kw = dict(step_inputs(3), policy=policy)
  if impl == "pallas/rows_flush_grid":
    impl, kw["config"] = "pallas", ReplayConfig(flush_grid="rows")
  check_op(ops.replay_state_update, rs, kw, impl, f"{impl} {preset}")


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_attention_through_rows(impl):
  keys = jax.random.split(jax.random.PRNGKey(4), 3)
  kc, vc = (jax.random.normal(k, (CAP, 2, 32, 16)) for k in keys[:2])
  kc = poison_rows(kc, 3)
  q = jax.random.normal(keys[2], (len(ROWS), 4, 16))
  lengths = jnp.array([5, 32, 9, 1, 17], jnp.int32)
  out = ops.decode_attention(q, kc, vc, lengths, rows=ROWS,
                             implementation=impl)
  ref = ops.decode_attention(q, *gathered((kc, vc)), lengths,
                             implementation=impl)
  out = np.asarray(out)
  assert np.isnan(out[~LIVE]).all()
  testing.assert_close(out[LIVE], np.asarray(ref)[LIVE],
                       testing.tolerance(jnp.float32), impl)


GDN = dict(num_k_heads=2, num_v_heads=4, key_dim=16, value_dim=16)


def gdn_inputs(seed):
  return gdn_testing.random_inputs(jax.random.PRNGKey(seed), len(ROWS),
                                   GDN["num_k_heads"], GDN["num_v_heads"],
                                   GDN["key_dim"], GDN["value_dim"])


@pytest.mark.parametrize("impl", IMPLS)
def test_gdn_step_through_rows(impl):
  state = jax.random.normal(jax.random.PRNGKey(11), (
      CAP, GDN["num_v_heads"], GDN["key_dim"], GDN["value_dim"]))
  state = poison_rows(state, 3)
  check_op(gdn.gdn_step, state, gdn_inputs(12), impl, impl)


@pytest.mark.parametrize("impl", IMPLS + ("pallas/split_routes",
                                          "pallas/ring_weights"))
@pytest.mark.parametrize("preset", (None, "f32+bf16", "f16+fp8+sr"))
def test_gdn_replay_step_through_rows(impl, preset):
  """Ragged counters with flushing rows (stale ring slots poisoned), plain
  and with read copies and stochastic rounding; the kernels in one launch,
  in two (split routes) and after the ring-weights launch."""
  counts = np.array([0, L - 1, 1, 2, 2, 0, L - 1], np.int32)
  rs, _ = gdn_testing.random_gdn_replay_state(
      jax.random.PRNGKey(13), CAP, buffer_len=L, counts=counts, **GDN)
  policy = None
  if preset is not None:  # the same history, stored per the policy
    policy = PrecisionPolicy.preset(preset)
    sr = dict(row_id=jnp.arange(CAP, dtype=jnp.int32) + 11,
              step=jnp.full((CAP,), 5, jnp.int32))
    full = gdn.gdn_replay_state_from(
        rs.checkpoint, L, num_k_heads=GDN["num_k_heads"], policy=policy,
        **(sr if policy.stochastic_rounding else {}))
    rs = full.replace(d_buf=rs.d_buf.astype(full.d_buf.dtype),
                      k_buf=rs.k_buf.astype(full.k_buf.dtype),
                      g_buf=rs.g_buf, count=rs.count)
  rs = poison_rows(rs, 3)
  kw = dict(gdn_inputs(14), policy=policy)
  if impl.startswith("pallas/"):
    impl, field = impl.split("/")
    kw["config"] = GDNConfig(**{field: True})
  check_op(gdn.gdn_replay_step, rs, kw, impl, f"{impl} {preset}")


def test_repeated_slots():
  """Concrete: refused, naming rows. Under jit: the repeat is a padding
  row (NaN output), the first keeps the slot."""
  state = jax.random.normal(jax.random.PRNGKey(5), (CAP, H, P, N))
  kw = step_inputs(6)
  rows = np.array([5, 1, 0, 1, 6], np.int32)
  with pytest.raises(ValueError, match="rows must name each state row"):
    ops.selective_state_update(state, **kw, rows=rows)
  y, new = jax.jit(lambda r: ops.selective_state_update(
      state, **kw, rows=r, implementation="reference"))(rows)
  assert np.isnan(np.asarray(y)[3]).all() and np.isfinite(
      np.asarray(y)[[0, 1, 2, 4]]).all()
  _, one = ops.selective_state_update(
      state[rows[:2]], **jax.tree.map(lambda x: x[:2] if getattr(
          x, "ndim", 0) and x.shape[0] == len(rows) else x, kw),
      implementation="reference")
  testing.assert_close(np.asarray(new)[1], np.asarray(one)[1],
                       testing.tolerance(jnp.float32), "the first row of 1")
  assert slots.effective(rows, CAP).tolist() == [5, 1, 0, -1, 6]


def test_rows_errors():
  rs = ragged_replay_state()
  kw = step_inputs(7)
  with pytest.raises(ValueError, match="rows"):
    ops.replay_state_update(rs, **kw, rows=np.zeros((3,), np.int32))
  with pytest.raises(NotImplementedError, match="fused_launch"):
    ops.replay_state_update(rs, **kw, rows=ROWS, implementation="pallas",
                            config=ReplayConfig(fused_launch=True))


@pytest.mark.parametrize("ssm_mode", ("replay", "baseline"))
@pytest.mark.parametrize("impl", ("reference", "pallas"))
def test_decode_step_through_rows(ssm_mode, impl):
  """The serving tests' hybrid (Mamba-2, attention, Gated DeltaNet on
  gathered rows, MLP): decode_step through rows == on the gathered rows;
  a padding row's logits NaN; free rows (one poisoned) untouched."""
  cfg = CFG if impl == "reference" else dataclasses.replace(
      CFG, head_dim=16, d_state=16, attn_head_dim=16, gdn_k_dim=16,
      gdn_v_dim=16)  # shapes the kernels take
  model = build_model(8, 9, cfg)
  st = model.init_state(CAP, 32, ssm_mode=ssm_mode, buffer_len=L)
  prompts = jax.random.randint(jax.random.PRNGKey(10), (CAP, 6), 0,
                               cfg.vocab_size, jnp.int32)
  lens = jnp.array([6, 3, 5, 6, 2, 4, 6])
  logits, st = models.prefill(model, prompts, lens, st)
  for _ in range(2):  # ragged replay counters
    logits, st = models.decode_step(
        model, jnp.argmax(logits, -1).astype(jnp.int32), st, impl)
  st = st.replace(layers=poison_rows(st.layers, 3))
  tok = jnp.argmax(logits, -1).astype(jnp.int32)[np.where(LIVE, ROWS, 0)]
  copy = jax.tree.map(jnp.copy, st)
  lg, new = models.decode_step(model, tok, copy, impl, rows=ROWS)
  lg_ref, new_ref = models.decode_step(model, tok, gathered(st), impl)
  check_rows(lg, new, lg_ref, new_ref, st, testing.tolerance(jnp.float32),
             f"{ssm_mode} {impl}")
