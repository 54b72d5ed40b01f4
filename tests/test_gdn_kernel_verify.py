"""The GDN speculative verify kernels (`pallas_kernels.gdn.verify`,
implementation "pallas" of gdn_replay_verify; interpret mode on CPU), the
window's coefficients formed in each program or by a first launch
(`GDNConfig.ring_weights`), against the reference: ragged counters with
early-flushing rows, GQA,
value blocks, bf16 rings, poisoned stale slots and a poisoned last draft,
precision policies, commit after verify, out-of-range counters and the
windows it refuses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn as kg
from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax import precision as P
from replayssm_jax import testing
from replayssm_jax.gdn import testing as GT

B, L = 5, 8
COUNTS = (0, 7, 4, 2, 5)  # T = 3: rows 1 and 4 fold early, row 0 has none
F32 = testing.TOLERANCES["float32"]


def _setup(seed, dims, ck_dtype=jnp.float32, buf_dtype=jnp.float32,
           counts=COUNTS):
  hk, hv, K, Vd = dims
  rstate, _ = GT.random_gdn_replay_state(
      jax.random.PRNGKey(seed), B, hk, hv, K, Vd, L, counts,
      checkpoint_dtype=ck_dtype, buffer_dtype=buf_dtype)
  return rstate


def _window(seed, dims, T, dtype=jnp.float32):
  hk, hv, K, Vd = dims
  return GT.random_inputs(jax.random.PRNGKey(seed), B, hk, hv, K, Vd, T=T,
                          dtype=dtype)


def _check(pending, ref, rstate, o, o_ref, T, tol, ck_tol=None):
  testing.assert_close(o, o_ref, tol, "o")
  np.testing.assert_array_equal(np.asarray(pending.count),
                                np.asarray(ref.count))
  assert pending.pending_window == T
  c = np.asarray(ref.count)
  for r in range(B):  # the live history and the pending window
    for name in ("d_buf", "k_buf", "g_buf"):
      testing.assert_close(getattr(pending, name)[r, :c[r] + T],
                           getattr(ref, name)[r, :c[r] + T], tol,
                           f"{name} row {r}")
  c0 = np.asarray(rstate.count)
  folds = (c0 + T >= L) & (c0 > 0)
  ck = np.asarray(pending.checkpoint)
  testing.assert_close(ck[folds], np.asarray(ref.checkpoint)[folds],
                       ck_tol or tol, "folded checkpoint")
  np.testing.assert_array_equal(ck[~folds],
                                np.asarray(rstate.checkpoint)[~folds])


VERIFY_CASES = [
    (1, "float32", "float32", (1, 2, 16, 16), kg.GDNConfig()),
    (3, "float32", "bfloat16", (2, 4, 8, 16), kg.GDNConfig(block_v=4)),
    (3, "float16", "float32", (1, 2, 16, 8), kg.GDNConfig(block_v=8)),
    (5, "bfloat16", "bfloat16", (2, 2, 8, 8), kg.GDNConfig(block_v=2)),
    # The window's coefficients from the first launch.
    (3, "float32", "bfloat16", (2, 4, 8, 16),
     kg.GDNConfig(block_v=4, ring_weights=True)),
    (5, "float16", "float32", (1, 2, 16, 8), kg.GDNConfig(ring_weights=True)),
]


@pytest.mark.parametrize("T,ck_dtype,buf_dtype,dims,config", VERIFY_CASES,
                         ids=str)
def test_verify_kernel_matches_reference(T, ck_dtype, buf_dtype, dims,
                                         config):
  rstate = _setup(T, dims, jnp.dtype(ck_dtype), jnp.dtype(buf_dtype))
  win = _window(20 + T, dims, T)
  o_ref, ref = gdn.gdn_replay_verify(rstate, **win,
                                     implementation="reference")
  o, pending = gdn.gdn_replay_verify(rstate, **win, implementation="pallas",
                                     config=config)
  tol = testing.tolerance(ck_dtype, buf_dtype)
  _check(pending, ref, rstate, o, o_ref, T, tol, testing.tolerance(ck_dtype))
  # Commit then read the state: equal to the reference's.
  n = jnp.asarray(np.arange(B) % T + 1, jnp.int32)
  testing.assert_close(gdn.gdn_materialize(gdn.gdn_replay_commit(pending, n)),
                       gdn.gdn_materialize(gdn.gdn_replay_commit(ref, n)),
                       tol, "state after commit")


@pytest.mark.parametrize("ring_weights", [False, True])
def test_poisoned_last_draft_reaches_no_earlier_output(ring_weights):
  """Position s depends on positions <= s only: a NaN last draft leaves
  the earlier outputs finite and unchanged."""
  dims, T = (1, 2, 8, 8), 3
  config = kg.GDNConfig(ring_weights=ring_weights)
  rstate = _setup(30, dims)
  win = _window(31, dims, T)
  o, _ = gdn.gdn_replay_verify(rstate, **win, implementation="pallas",
                               config=config)
  bad = dict(win, v=win["v"].at[:, -1].set(jnp.nan),
             k=win["k"].at[:, -1].set(jnp.inf))
  o_bad, _ = gdn.gdn_replay_verify(rstate, **bad, implementation="pallas",
                                   config=config)
  np.testing.assert_array_equal(np.asarray(o_bad[:, :-1]),
                                np.asarray(o[:, :-1]))


@pytest.mark.parametrize("name,config", [
    ("f32+int8", kg.GDNConfig(ring_weights=False, block_v=4)),
    ("f16+fp8+sr", kg.GDNConfig(ring_weights=False)),
    ("bf16+sr", kg.GDNConfig(ring_weights=False, block_v=2)),
    ("f16+fp8+sr", kg.GDNConfig(ring_weights=True, block_v=4))], ids=str)
def test_verify_kernel_precision_policies(name, config):
  """Folding rows store master + copy (stochastically with the
  reference's bits) and read the stored master; the others read the copy
  only (a NaN master never reaches them). The fold stores whole rows; the
  window launch reads value tiles where block_v < value_dim."""
  dims, T = (1, 2, 8, 8), 3
  policy = PrecisionPolicy.preset(name).replace(buffer_dtype="float32")
  rstate = _setup(32, dims, jnp.dtype(policy.checkpoint_dtype)).with_policy(
      policy)
  win = _window(33, dims, T)
  o_ref, ref = gdn.gdn_replay_verify(rstate, **win, policy=policy,
                                     implementation="reference")
  o, pending = gdn.gdn_replay_verify(rstate, **win, policy=policy,
                                     implementation="pallas", config=config)
  dtypes = [policy.checkpoint_dtype] + (
      [policy.read_dtype] if policy.read_dtype else [])
  tol = testing.tolerance(*dtypes)
  _check(pending, ref, rstate, o, o_ref, T, tol)
  c0 = np.asarray(rstate.count)
  folds = (c0 + T >= L) & (c0 > 0)
  if policy.read_dtype is not None:
    load = lambda r: np.asarray(P.load(r.read_copy, r.read_scale))  # noqa: E731
    testing.assert_close(load(pending)[folds], load(ref)[folds], tol,
                         "re-stored read copy")
    np.testing.assert_array_equal(np.asarray(pending.read_copy)[~folds],
                                  np.asarray(rstate.read_copy)[~folds])
    nan_master = jnp.where(jnp.asarray(folds)[:, None, None, None],
                           rstate.checkpoint, jnp.nan).astype(
                               rstate.checkpoint.dtype)
    o_nan, _ = gdn.gdn_replay_verify(rstate.replace(checkpoint=nan_master),
                                     **win, policy=policy,
                                     implementation="pallas", config=config)
    np.testing.assert_array_equal(np.asarray(o_nan), np.asarray(o))


@pytest.mark.parametrize("ring_weights", [False, True])
def test_verify_kernel_out_of_range_counters(ring_weights):
  """Under jit (the kernel called directly) a counter outside [0, L):
  NaN outputs, count kept, nothing written."""
  dims, T = (1, 2, 8, 8), 2
  rstate = _setup(34, dims, counts=(1, 2, 3, 6, 0))
  rstate = rstate.replace(count=jnp.array([L, 2, -1, 6, 0], jnp.int32))
  win = _window(35, dims, T)
  o, pending = kg.gdn_replay_verify(
      rstate, **win, interpret=True,
      config=kg.GDNConfig(ring_weights=ring_weights))
  o = np.asarray(o)
  assert np.isnan(o[[0, 2]]).all() and np.isfinite(o[[1, 3, 4]]).all()
  np.testing.assert_array_equal(np.asarray(pending.count), [L, 2, -1, 0, 0])
  for name in ("checkpoint", "d_buf", "k_buf", "g_buf"):
    np.testing.assert_array_equal(np.asarray(getattr(pending, name))[[0, 2]],
                                  np.asarray(getattr(rstate, name))[[0, 2]])


def test_verify_kernel_refusals():
  dims = (1, 2, 8, 8)
  rstate = GT.random_gdn_replay_state(jax.random.PRNGKey(36), B, 1, 2, 8, 8,
                                      16, (0, 1, 2, 3, 4))[0]
  win = _window(37, dims, 9)
  with pytest.raises(NotImplementedError, match="T = 9 exceeds 8"):
    gdn.gdn_replay_verify(rstate, **win, implementation="pallas")
  assert kg.verify_problem(rstate, win["q"][:, :8]) is None
