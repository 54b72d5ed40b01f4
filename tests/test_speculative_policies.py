"""Speculative verify / commit of a ReplayState under precision policies:
a read copy is read by verify and restored by commit, stochastic rounding is
bit-reproducible across batches, the f32 master stays exact under random
acceptance, and policy errors are clear.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import precision as prec
from replayssm_jax import testing
from tests.speculative_common import (B, TOL, assert_copy_restored,
                                      baseline_window, np_bits, policy_setup,
                                      random_window, verify_commit,
                                      verify_commit_policy)


# ------------------------------------------------------ precision policies
@pytest.mark.parametrize("name", ["f32+int8", "f16+fp8", "f16+fp8+sr:hash32"])
def test_verify_with_a_read_copy_reads_the_copy_and_restores_it(name):
  """Rows that need no early flush read only the copy: their outputs equal
  a plain state's whose checkpoint is the dequantized copy, and stay finite
  with the master poisoned (NaN). Early-flushing rows fold the master (as
  the plain verify does, within the master dtype's tolerance), read the
  window out from it, and store the copy re-quantized from the stored
  master (bit for bit; with stochastic rounding, with the bits of the
  row's step at the read-copy site). Commit advances the SR step by the
  accepted tokens."""
  L, T = 8, 3
  counts = [0, L - 1, L - T, 2]  # rows 1 and 2 flush early
  pol, params, st, _ = policy_setup(L, 31, counts, name)
  win = random_window(77, T)
  flush = np.array(counts) + T >= L
  n = np.array([1, T, 2, 2], np.int32)
  poisoned = st.replace(checkpoint=jnp.where(
      jnp.asarray(flush)[:, None, None, None], st.checkpoint,
      jnp.nan).astype(st.checkpoint.dtype))
  y, pend, comm = verify_commit_policy(poisoned, win, params, n, T=T,
                                        policy=pol)
  y = np.asarray(y)
  assert np.all(np.isfinite(y)), "a non-flushing row read the master"
  # Non-flushing rows: exactly the plain verify from the copy.
  plain_copy = rs.ReplayState(
      checkpoint=prec.load(st.read_copy, st.read_scale), x_buf=st.x_buf,
      b_buf=st.b_buf, dt_buf=st.dt_buf, count=st.count)
  y_c, _, _ = verify_commit(plain_copy, win, params, n, T=T)
  testing.assert_close(y[~flush], np.asarray(y_c)[~flush], TOL,
                       "non-flushing rows: the plain verify from the copy")
  for field in ("checkpoint", "read_copy", "read_scale"):
    np.testing.assert_array_equal(
        np_bits(getattr(pend, field))[~flush],
        np_bits(getattr(poisoned, field))[~flush],
        err_msg=f"{name}: a non-flushing row's {field} was written")
  # Flushing rows: the plain verify's fold and readout of the master.
  plain = rs.ReplayState(checkpoint=st.checkpoint, x_buf=st.x_buf,
                         b_buf=st.b_buf, dt_buf=st.dt_buf, count=st.count)
  y_m, pend_m, _ = verify_commit(plain, win, params, n, T=T)
  master_tol = testing.tolerance(pol.checkpoint_dtype)
  testing.assert_close(y[flush], np.asarray(y_m)[flush], master_tol,
                       "flushing rows: the verify from the folded master")
  if not pol.stochastic_rounding:
    testing.assert_close(pend.checkpoint[flush], pend_m.checkpoint[flush],
                         master_tol, "flushed master")
  assert_copy_restored(st, pend, pol, flush)
  np.testing.assert_array_equal(comm.count, np.where(flush, 0, counts) + n)
  if pol.stochastic_rounding:
    np.testing.assert_array_equal(pend.step, st.step)
    np.testing.assert_array_equal(comm.step, np.asarray(st.step) + n)
    np.testing.assert_array_equal(comm.row_id, st.row_id)
    rn, _ = prec.store(pend.checkpoint.astype(jnp.float32), pol.read_dtype)
    assert not np.array_equal(np_bits(rn)[flush],
                              np_bits(pend.read_copy)[flush])  # teeth


def test_stochastic_verify_is_bit_reproducible_across_batches():
  """A row's early-flush stores and outputs are the same bits alone and in
  a batch (keys: seed, layer, row id, step; never the batch index)."""
  L, T = 8, 4
  pol, params, st, _ = policy_setup(L, 5, [L - 1, 2, L - 2, 6],
                                     "f16+fp8+sr")
  win = random_window(9, T)
  n = np.array([2, 4, 1, 3], np.int32)
  y, pend, comm = verify_commit_policy(st, win, params, n, T=T, policy=pol)
  for r in (0, 2):
    one = jax.tree.map(lambda a, r=r: a[r:r + 1], st)
    y1, p1, c1 = verify_commit_policy(
        one, jax.tree.map(lambda a, r=r: a[r:r + 1], win), params,
        n[r:r + 1], T=T, policy=pol)
    np.testing.assert_array_equal(np_bits(y1[0]), np_bits(y[r]))
    for field in ("checkpoint", "read_copy", "read_scale"):
      np.testing.assert_array_equal(np_bits(getattr(p1, field)[0]),
                                    np_bits(getattr(pend, field)[r]),
                                    err_msg=f"row {r} {field}")
    np.testing.assert_array_equal(c1.step[0], comm.step[r])


def test_random_acceptance_with_a_read_copy_keeps_the_f32_master_exact():
  """f32 master + int8 copy over 12 windows of random acceptance: the
  master and buffers (materialized) equal a fresh f32 baseline run over the
  accepted tokens; accepted outputs are within the int8 copy's tolerance
  of it; the copy is the re-quantized master of every row's last flush."""
  L, T, windows = 8, 3, 12
  rng = np.random.default_rng(1)
  pol, params, st, full = policy_setup(L, 13, [0, 3, 5, 7], "f32+int8")
  tol8 = testing.tolerance("int8")
  for w in range(windows):
    win = random_window(2000 + w, T)
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    y_base, states = baseline_window(full, win, params)
    y, _, st = verify_commit_policy(st, win, params, n, T=T, policy=pol)
    for r in range(B):
      testing.assert_close(y[r, :n[r]], y_base[r, :n[r]], tol8,
                           f"window {w} row {r}")
    full = jnp.stack([states[k - 1, r] for r, k in enumerate(n)])
    testing.assert_close(rs.materialize(st, params["A"]), full, TOL,
                         f"state after window {w}")
    copy, scale = prec.store(st.checkpoint, "int8")
    np.testing.assert_array_equal(np_bits(st.read_copy), np_bits(copy))
    np.testing.assert_array_equal(np_bits(st.read_scale), np_bits(scale))


def test_verify_policy_errors():
  L, T = 8, 2
  pol, params, st, _ = policy_setup(L, 3, [0, 1, 2, 3], "f32+int8")
  win = random_window(4, T)
  kw = dict(**win, **params, dt_softplus=True)
  with pytest.raises(ValueError, match="rstate does not match policy "
                     "'f32\\+bf16'"):
    rs.replay_verify(st, **kw, policy=prec.PrecisionPolicy.preset("f32+bf16"))
  with pytest.raises(TypeError, match="layer must be"):
    rs.replay_verify(st, **kw, policy=pol, layer=1.5)
