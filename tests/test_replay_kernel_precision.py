"""The replay step's Pallas kernels on states with a precision policy (read
copies, stochastic rounding; interpret mode on CPU) against the reference,
the kernels' 8-bit stores against `precision.quantize`, and the launch
form each batch size gets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import cases as C
from tests import harness
from tests.kernel_harness import DIMS
from tests.kernel_harness import np_bits as _np_bits

# Every read dtype with an f32 master, an f16 master with an fp8 copy, and
# stochastic rounding (int8 copy; f16 master + fp8 copy: both stores, with
# each per-element hash), each with another tuning config. (SR of a master
# without a copy, "bf16+sr", is the f16+fp8+sr master path without the
# copy; it is lowered in test_kernel_lowering.py.)
POLICY_CASES = [
    ("f32+bf16", pk.ReplayConfig()),
    ("f32+f16", pk.ReplayConfig(block_p=4, heads_per_program=2)),
    ("f32+fp8", pk.ReplayConfig(flush_grid="rows", heads_per_program=2)),
    ("f32+int8", pk.ReplayConfig(block_p=8, flush_grid="persistent")),
    ("f16+fp8", pk.ReplayConfig(heads_per_program=2, flush_fold="rank1")),
    ("f32+int8+sr", pk.ReplayConfig(flush_grid="rows", heads_per_program=2)),
    ("f16+fp8+sr", pk.ReplayConfig(block_p=8)),
    ("f16+fp8+sr:hash32", pk.ReplayConfig()),
    ("f16+fp8", pk.ReplayConfig(max_registers=64, flush_num_warps=2)),
    # The readout kernel, then the (group, row) window kernel.
    ("f16+fp8", pk.ReplayConfig(output_route="split")),
    ("f32+int8", pk.ReplayConfig(output_route="split", block_p=8,
                                 flush_grid="rows")),
    ("f32+bf16", pk.ReplayConfig(output_route="split")),
]

POLICY_L = 4
POLICY_STEPS = 2 * POLICY_L + 1  # every row flushes twice
POLICY_LAYER = 3


def _policy_state(policy, seed):
  """A ragged state of `policy` (random master, buffers and junk in stale
  slots; rows 1 and 4 flush at the first step), its read copy stored from
  the master and, with stochastic rounding, random row ids and steps."""
  d = DIMS
  counts = np.array(C.ragged_counts(d.batch, POLICY_L))
  counts[4] = POLICY_L - 1
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, d.nheads)
  rstate, _ = testing.random_replay_state(
      jax.random.fold_in(key, 1), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, POLICY_L, counts, params["A"],
      checkpoint_dtype=policy.checkpoint_dtype,
      buffer_dtype=policy.buffer_dtype)
  rstate = harness.with_policy_fields(rstate, policy, [17, 3, 40, 8, 25],
                                      [5, 0, 12, 7, 30])
  steps = harness.time_major(testing.random_step_inputs(
      jax.random.fold_in(key, 2), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, seqlen=POLICY_STEPS))
  return params, rstate, steps


@functools.partial(jax.jit, static_argnames=("policy", "config"),
                   compiler_options=harness.FAST_COMPILE)
def _policy_decode(rstate, steps, params, *, policy, config):
  """POLICY_STEPS decode steps of the kernel and of the reference.

  Per step: the kernel runs on its state, where (the state having a read
  copy) the master of every non-flush row is replaced by NaN: a read of it
  would show in y, and its bits show that it was not written (the carried
  state keeps the true master). The reference runs on the kernel's true
  state ("forced": one-step errors) and on its own state ("free": the whole
  decode).
  """
  L = POLICY_L

  def body(carry, tok):
    ks, rs_free = carry
    kw = dict(**harness.step_kwargs(tok, params, True), policy=policy,
              layer=POLICY_LAYER)
    flush = (ks.count == L - 1)[:, None, None, None]
    poisoned = ks
    if ks.read_copy is not None:
      poisoned = ks.replace(checkpoint=jnp.where(
          flush, ks.checkpoint, jnp.nan).astype(ks.checkpoint.dtype))
    y_k, k_out = rs.replay_state_update(poisoned, **kw,
                                        implementation="pallas",
                                        config=config)
    y_f, f_out = rs.replay_state_update(ks, **kw, implementation="reference")
    y_r, rs_free = rs.replay_state_update(rs_free, **kw,
                                          implementation="reference")
    out = dict(y_k=y_k, y_f=y_f, y_r=y_r, k_in=poisoned, k_out=k_out,
               f_out=f_out)
    ks = k_out.replace(checkpoint=jnp.where(flush, k_out.checkpoint,
                                            ks.checkpoint))
    return (ks, rs_free), out

  (ks, rs_free), out = jax.lax.scan(body, (rstate, rstate), steps)
  return ks, rs_free, out


_store = jax.jit(P.store, static_argnums=(1,))
_random_bits = jax.jit(P.random_bits, static_argnums=(0, 4, 5, 6))


@pytest.mark.parametrize("name,config", POLICY_CASES,
                         ids=[n for n, _ in POLICY_CASES])
def test_replay_kernel_read_copy_decode(name, config):
  """Kernel vs reference over 2L+1 steps with ragged counters (flush and
  non-flush rows in every step):

  * each step from the same state: y within f32 tolerance (with a copy,
    non-flush rows read the same copy, computed without the master, which
    is NaN for them); non-flush rows' master, read copy and scales
    bit-identical
    (never written); flush rows' master within the master dtype's
    tolerance and their copy exactly `precision.store` of the kernel's
    stored master (with stochastic rounding: with the reference's random
    bits); counters, row ids and steps equal;
  * free-running: y within the tolerance of the policy's lowest storage
    dtype (testing.TOLERANCES).
  """
  pol = P.PrecisionPolicy.preset(name)
  params, rstate, steps = _policy_state(pol, seed=91)
  before = jax.tree.map(np.asarray, rstate)
  ks, rs_free, out = _policy_decode(rstate, steps, params, policy=pol,
                                    config=config)
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, rstate), before)  # no mutation
  out = jax.tree.map(np.asarray, out)
  shape = rstate.checkpoint.shape[1:]
  f32 = testing.TOLERANCES["float32"]
  master_tol = testing.tolerance(pol.checkpoint_dtype)
  flush_rows = 0
  for t in range(POLICY_STEPS):
    kin, kout, fout = (jax.tree.map(lambda v, t=t: v[t], out[k])
                       for k in ("k_in", "k_out", "f_out"))
    flush = kin.count == POLICY_L - 1
    assert flush.any() and (~flush).any(), f"step {t}: not ragged"
    flush_rows += int(flush.sum())
    testing.assert_close(out["y_k"][t], out["y_f"][t], f32, f"y, step {t}")
    for field in ("checkpoint", "read_copy", "read_scale"):
      new, old = getattr(kout, field), getattr(kin, field)
      assert (new is None) == (old is None), field
      if old is not None:
        np.testing.assert_array_equal(
            _np_bits(new[~flush]), _np_bits(old[~flush]),
            err_msg=f"{name}: a non-flush row's {field} was written, step "
            f"{t}")
    master = kout.checkpoint.astype(np.float32)
    testing.assert_close(master[flush],
                         fout.checkpoint[flush].astype(np.float32),
                         master_tol, f"flushed master, step {t}")
    if pol.read_dtype is not None:
      bits = None
      if pol.stochastic_rounding:
        bits = _random_bits(pol.seed, POLICY_LAYER, kin.row_id, kin.step,
                            shape, P.SITE_READ_COPY, pol.sr_rng)
      copy, scale = _store(master, pol.read_dtype, bits)
      np.testing.assert_array_equal(
          _np_bits(kout.read_copy[flush]), _np_bits(copy)[flush],
          err_msg=f"{name}: copy != store(master), step {t}")
      if scale is not None:
        np.testing.assert_array_equal(
            _np_bits(kout.read_scale[flush]), _np_bits(scale)[flush],
            err_msg=f"{name}: scale != store(master), step {t}")
      if pol.stochastic_rounding:  # teeth: it really rounds stochastically
        rn, _ = _store(master, pol.read_dtype, None)
        assert not np.array_equal(_np_bits(rn)[flush],
                                  _np_bits(copy)[flush])
    for field in ("count", "row_id", "step"):
      a, b = getattr(kout, field), getattr(fout, field)
      assert (a is None) == (b is None), field
      if a is not None:
        np.testing.assert_array_equal(a, b, err_msg=f"{field}, step {t}")
  assert flush_rows >= 2 * DIMS.batch  # every row flushed at least twice
  tol = testing.tolerance(pol.checkpoint_dtype, pol.read_dtype,
                          pol.buffer_dtype)
  testing.assert_close(out["y_k"], out["y_r"], tol, f"{name} free-running y")
  final = [s.checkpoint if s.read_copy is None
           else P.load(s.read_copy, s.read_scale) for s in (ks, rs_free)]
  testing.assert_close(final[0], final[1], tol,
                       f"{name} free-running final copy")


def test_kernel_quantize_rows_matches_precision_quantize():
  """The kernels' 8-bit store (Triton-lowerable ops) equals
  precision.quantize bit for bit, nearest and stochastic, on random rows
  and on the edge rows: zero, tiny (encode overflows), huge, NaN, inf,
  -inf, and int8 ties (x.5 after scaling)."""
  from pallas_kernels import triton_utils as common  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(13)
  n = 16
  # 512 random rows: each row's amax element lands within an ulp or two of
  # qmax after scaling, above it in some rows (the kernel does not clip
  # round-to-nearest values there, the reference does).
  x = jax.random.normal(key, (512, n)) * jnp.exp(
      jax.random.normal(jax.random.fold_in(key, 1), (512, 1)) * 3)
  ties = (jnp.arange(n, dtype=jnp.float32) - 7.5) * 127 / 8.5  # k + 0.5
  edge = jnp.stack([
      jnp.zeros(n), jnp.full(n, 1e-39), jnp.full(n, -3e38),
      x[0].at[3].set(jnp.nan), x[1].at[0].set(jnp.inf),
      x[2].at[5].set(-jnp.inf), ties.at[0].set(8.5 * 127 / 8.5),
      jnp.linspace(-1, 1, n) * 1e-30])
  x = jnp.concatenate([x, edge])
  bits = jax.random.bits(jax.random.fold_in(key, 2), x.shape, jnp.uint32)
  for dtype in P.QUANTIZED_DTYPES:
    for b in (None, bits):
      q, scale = common.quantize_rows(x, dtype, b)
      q_ref, scale_ref = P.quantize(x, dtype, b)
      what = f"{dtype} {'SR' if b is not None else 'RN'}"
      np.testing.assert_array_equal(_np_bits(q), _np_bits(q_ref),
                                    err_msg=what)
      np.testing.assert_array_equal(_np_bits(scale), _np_bits(scale_ref),
                                    err_msg=what)
  v = jnp.concatenate([jnp.arange(-130, 131) * 0.5,
                       jax.random.uniform(key, (512,), minval=-127,
                                          maxval=127)])
  np.testing.assert_array_equal(common.round_half_even(v), jnp.round(v))


def test_replay_kernel_precision_refusals(monkeypatch):
  """What the kernels refuse says why: the fused launch with a precision
  policy; an fp8 copy on a GPU
  below sm_89 (no Triton fp8 conversions); stochastic rounding without
  row_id/step (only reachable past the op's own check)."""
  pol = P.PrecisionPolicy.preset("f32+fp8")
  params, rstate, steps = _policy_state(pol, seed=93)
  kw = dict(**harness.step_kwargs(jax.tree.map(lambda a: a[0], steps),
                                  params, True), policy=pol)
  with pytest.raises(NotImplementedError,
                     match=r"fused_launch=True does not support a read copy"):
    rs.replay_state_update(rstate, **kw, implementation="pallas",
                           config=pk.ReplayConfig(fused_launch=True))
  monkeypatch.setattr(pk.triton_utils, "compute_capability", lambda: (8, 0))
  with pytest.raises(NotImplementedError,
                     match=r"rstate.read_copy is float8_e4m3fn.*8\.0"):
    rs.replay_state_update(rstate, **kw, implementation="pallas")
  int8 = P.PrecisionPolicy.preset("f32+int8")
  _, r8, _ = _policy_state(int8, seed=94)
  assert pk._replay_supports(rstate=r8, policy=int8) is None  # sm_80: ok
  monkeypatch.setattr(pk.triton_utils, "compute_capability", lambda: (9, 0))
  assert pk._replay_supports(rstate=rstate, policy=pol) is None
  sr = P.PrecisionPolicy.preset("f32+fp8+sr")
  why = pk._replay_supports(rstate=rstate, policy=sr)
  assert "rstate.row_id and rstate.step" in why, why


@pytest.mark.parametrize("ckpt", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("batch,fused", [(1, True), (66, False)])
def test_default_fused_launch_by_batch(batch, fused, ckpt):
  """ReplayConfig(fused_launch=None) launches both routes as one kernel
  at small batch (8 heads: batch * 8 < 4 * 132) and as two above; the one
  launch folds on the output route's programs on an f32 checkpoint
  (flush_grid=None -> "rows"), on persistent flush programs otherwise."""
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  assert replay_kernel.default_fused_launch(batch, 8) == fused
  h, p, n, g, L = 8, 16, 16, 2, 16
  sds = jax.ShapeDtypeStruct
  rstate = rs.ReplayState(
      checkpoint=sds((batch, h, p, n), ckpt),
      x_buf=sds((batch, L, h, p), jnp.bfloat16),
      b_buf=sds((batch, L, g, n), jnp.bfloat16),
      dt_buf=sds((batch, L, h), jnp.float32),
      count=sds((batch,), jnp.int32))
  jaxpr = str(jax.make_jaxpr(
      lambda r, x, dt, A, B, C: replay_kernel.replay_state_update(
          r, x, dt, A, B, C, interpret=True))(
              rstate, sds((batch, h, p), jnp.bfloat16),
              sds((batch, h), jnp.bfloat16), sds((h,), jnp.float32),
              sds((batch, g, n), jnp.bfloat16),
              sds((batch, g, n), jnp.bfloat16)))
  assert ("replayssm_replay_fused_routes" in jaxpr) == fused
  assert ("replayssm_replay_output_route" in jaxpr) == (not fused)
  rows = fused and ckpt == jnp.float32
  assert ("replayssm_replay_fused_routes_rows" in jaxpr) == rows
  # Separate launches: the output route and the flush route's kernel.
  assert ("replayssm_replay_flush_route" in jaxpr) == (not fused)
