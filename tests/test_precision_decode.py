"""Replay decode under a precision policy: bit reproducibility of
stochastic rounding across runs and batches, the dual-precision invariants
(master and read copy), the quantization error of an int8 read copy, and
the stored baseline state as contrast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import harness
from tests.precision_common import (B, COUNTS, EPS32, G, H, L, N, NSTEPS, PD,
                                    assert_same_bits, make_params, make_state,
                                    make_steps, raw_bits, run_replay,
                                    token_at)


_store = jax.jit(P.store, static_argnums=(1,))
_step = jax.jit(rs.replay_state_update,
                static_argnames=("dt_softplus", "policy", "layer",
                                 "implementation"),
                compiler_options=harness.FAST_COMPILE)


# ---------------------------------------------------------- reproducibility
@pytest.mark.parametrize("name", ["f16+fp8+sr", "f32+int8+sr",
                                  "f16+fp8+sr:hash32"])
def test_sr_decode_is_bit_reproducible_across_runs_and_batches(name):
  """A row decodes to identical bits alone (batch 1) and embedded at index
  3 of a batch of 5 (other rows: other ids, steps and inputs); two runs give
  the same bits; another seed gives other bits."""
  pol = P.PrecisionPolicy.preset(name).replace(seed=11)
  params = make_params()
  big_steps = make_steps(seed=4, batch=5)
  big = make_state(pol, batch=5, seed=6, counts=(0, 2, L - 1, 1, 3),
               row_id=jnp.asarray([40, 41, 42, 7, 43], jnp.int32),
               step=jnp.asarray([0, 5, 9, 100, 2], jnp.int32))
  alone = jax.tree.map(lambda a: a[3:4], big)
  alone_steps = jax.tree.map(lambda a: a[:, 3:4], big_steps)
  fin_big, out_big = run_replay(big, big_steps, params, policy=pol, layer=3)
  fin_1, out_1 = run_replay(alone, alone_steps, params, policy=pol, layer=3)
  _, out_again = run_replay(big, big_steps, params, policy=pol, layer=3)
  for key in out_big:
    assert_same_bits(out_big[key][:, 3:4], out_1[key], f"{name} {key}: batch")
    assert_same_bits(out_big[key], out_again[key], f"{name} {key}: rerun")
  np.testing.assert_array_equal(fin_big.step, big.step + NSTEPS)
  # Teeth: the stores really are stochastic (they differ from nearest).
  t = int(np.argmax(np.any(np.asarray(out_big["count"]) == 0, axis=1)))
  flushed = np.asarray(out_big["count"][t]) == 0
  master = out_big["checkpoint"][t].astype(jnp.float32)
  copy_rn, _ = _store(master, pol.read_dtype)
  assert not np.array_equal(raw_bits(copy_rn)[flushed],
                            raw_bits(out_big["read_copy"][t])[flushed])


# ---------------------------------------------------------- dual precision
@pytest.mark.parametrize("name", ["f32+int8", "f32+bf16", "f16+fp8+sr"])
def test_dual_precision_master_and_copy_invariants(name):
  """Non-flush steps leave master and copy bit-identical; after every flush
  the copy is the re-quantized stored master; a plain state whose
  checkpoint is the dequantized copy gives bit-identical non-flush
  outputs (so they are computed from the copy)."""
  pol = P.PrecisionPolicy.preset(name)
  params, steps = make_params(), make_steps()
  st = make_state(pol)
  _, out = run_replay(st, steps, params, policy=pol)
  out = jax.tree.map(np.asarray, out)
  c0 = np.asarray(COUNTS)
  prev = jax.tree.map(np.asarray, dict(
      checkpoint=st.checkpoint, read_copy=st.read_copy,
      read_scale=st.read_scale))
  for t in range(NSTEPS):
    flush = (c0 + t) % L == L - 1
    for key in ("checkpoint", "read_copy", "read_scale"):
      if key not in out:
        continue
      assert_same_bits(out[key][t][~flush], prev[key][~flush],
                 f"{key} of non-flush rows, step {t}")
      prev[key] = out[key][t]
    if not pol.stochastic_rounding:
      copy, scale = _store(out["checkpoint"][t].astype(np.float32),
                           pol.read_dtype)
      assert_same_bits(out["read_copy"][t], copy, f"copy == q(master), step {t}")
      if scale is not None:
        assert_same_bits(out["read_scale"][t], scale, f"scale, step {t}")
    else:  # SR: the copy is a neighbour-rounding of the master
      master = out["checkpoint"][t].astype(np.float32)
      deq = out["read_copy"][t].astype(np.float32) * out["read_scale"][t][
          ..., None]
      s = out["read_scale"][t][..., None]
      # fp8 SR: within one fp8 ulp (2^-3 relative, 2^-9 scale subnormal).
      assert np.all(np.abs(deq - master) <= 2**-3 * np.abs(master)
                    + 2**-9 * s + 4 * EPS32 * np.abs(master).max())

  # One step: non-flush outputs == those of a plain state holding the copy.
  tok = token_at(steps, 0)
  y, _ = _step(st, **harness.step_kwargs(tok, params, True), policy=pol)
  plain = rs.ReplayState(checkpoint=P.load(st.read_copy, st.read_scale),
                         x_buf=st.x_buf, b_buf=st.b_buf, dt_buf=st.dt_buf,
                         count=st.count)
  y_plain, _ = _step(plain, **harness.step_kwargs(tok, params, True))
  non_flush = c0 != L - 1
  assert_same_bits(y[non_flush], y_plain[non_flush], "y from the read copy")


@pytest.mark.parametrize("name", ["f32+int8", "f32+fp8"])
def test_non_flush_steps_never_read_the_master(name):
  """Poisoning the master with NaN: non-flush rows' outputs stay finite
  (and their master stays as it was), a flushing row's output is NaN."""
  pol = P.PrecisionPolicy.preset(name)
  params, steps = make_params(), make_steps()
  st = make_state(pol)
  bad = st.replace(checkpoint=jnp.full_like(st.checkpoint, jnp.nan))
  y, new = _step(bad, **harness.step_kwargs(token_at(steps, 0), params, True),
                 policy=pol)
  flush = np.asarray(COUNTS) == L - 1
  assert flush.any() and (~flush).any()
  assert np.all(np.isfinite(np.asarray(y[~flush])))
  assert np.all(np.isnan(np.asarray(y[flush])))
  # The flushed row's poisoned master poisons its copy too (never laundered).
  assert np.all(np.isnan(np.asarray(P.load(new.read_copy, new.read_scale)
                                    [flush])))


@pytest.mark.parametrize("name", ["f32", "bf16", "f16"])
def test_plain_policy_equals_the_policy_free_path_bit_for_bit(name):
  """A plain policy builds the same state as `from_ssm_state` without one
  and decodes it bit for bit as the policy-free replay step."""
  pol = P.PrecisionPolicy.preset(name).replace(buffer_dtype="float16")
  params, steps = make_params(), make_steps()
  s0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N))
  plain = rs.ReplayState.from_ssm_state(
      s0, G, L, checkpoint_dtype=pol.checkpoint_dtype,
      buffer_dtype=jnp.float16)
  plain = plain.replace(count=jnp.asarray(COUNTS, jnp.int32))
  with_policy = make_state(pol)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(with_policy)):
    assert_same_bits(a, b, "constructed state")
  fin_policy, out_policy = run_replay(with_policy, steps, params, policy=pol)
  fin_plain, out_plain = harness.replay_scan(plain, steps, params,
                                           dt_softplus=True)
  assert_same_bits(out_policy["y"], out_plain, f"{name} y")
  for a, b in zip(jax.tree.leaves(fin_policy), jax.tree.leaves(fin_plain)):
    assert_same_bits(a, b, f"{name} final state")
  assert jax.tree.structure(fin_policy) == jax.tree.structure(fin_plain)


def test_int8_read_copy_error_is_bounded_by_the_quantization_step():
  """f32 master + int8 copy vs f32: the master (folded from master + buffer
  only) is bit-identical; the copy errs by <= scale/2 per element, so a
  non-flush output errs by <= decay * sum_n |C_n| * scale/2 * |silu(z)|
  (decay <= 1) plus f32 noise (f32 tolerance of the table)."""
  f32, q8 = P.PrecisionPolicy.preset("f32"), P.PrecisionPolicy.preset(
      "f32+int8")
  params, steps = make_params(), make_steps()
  _, out_32 = run_replay(make_state(f32), steps, params, policy=f32)
  st8 = make_state(q8)
  _, out_8 = run_replay(st8, steps, params, policy=q8)
  assert_same_bits(out_8["checkpoint"], out_32["checkpoint"], "master")
  master = out_8["checkpoint"]
  deq = P.load(out_8["read_copy"], out_8["read_scale"])
  s = out_8["read_scale"][..., None]
  assert np.all(np.abs(np.asarray(deq - master))
                <= 0.5 * np.asarray(s) + 4 * EPS32 * np.asarray(
                    jnp.max(jnp.abs(master), -1, keepdims=True)))
  # Output bound at step t uses the copy held before step t.
  scales = jnp.concatenate([st8.read_scale[None], out_8["read_scale"][:-1]])
  csum = jnp.sum(jnp.abs(steps["C"]), axis=-1)  # [T, b, g]
  csum = jnp.repeat(csum, H // G, axis=-1)[..., None]  # [T, b, h, 1]
  gate = jnp.abs(jax.nn.silu(steps["z"]))
  bound = (0.5 * scales * (1 + 8 * EPS32) + 4 * EPS32) * csum * gate
  tol = testing.TOLERANCES["float32"]
  scale_y = jnp.max(jnp.abs(out_32["y"]))
  err = jnp.abs(out_8["y"] - out_32["y"])
  assert bool(jnp.all(err <= bound + tol.atol * scale_y)), float(
      jnp.max(err - bound))
  assert float(jnp.max(err)) > 0  # teeth: the copy is really read


# ------------------------------------------------------- baseline contrast
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_stored_baseline_rn_equals_the_plain_baseline(dtype):
  params, steps = make_params(), make_steps()
  s = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N)).astype(dtype)
  kw = harness.step_kwargs(token_at(steps, 0), params, True)
  y, new, scale = rs.selective_state_update_stored(s, **kw)
  y_ref, new_ref = rs.selective_state_update(s, **kw,
                                             implementation="reference")
  assert scale is None
  assert_same_bits(y, y_ref, "y")
  assert_same_bits(new, new_ref, "state")


def test_stored_baseline_int8_and_sr():
  params, steps = make_params(), make_steps()
  kw = harness.step_kwargs(token_at(steps, 0), params, True)
  s = jax.random.normal(jax.random.PRNGKey(3), (B, H, PD, N))
  q, scale = P.quantize(s, "int8")
  y, q2, scale2 = rs.selective_state_update_stored(q, **kw, state_scale=scale)
  _, exact = rs.selective_state_update(P.dequantize(q, scale), **kw)
  q_ref, s_ref = P.quantize(exact, "int8")
  assert_same_bits(q2, q_ref, "int8 baseline store")
  assert_same_bits(scale2, s_ref, "int8 baseline scale")
  rid, stp = jnp.arange(B, dtype=jnp.int32), jnp.full((B,), 4, jnp.int32)
  sb = s.astype(jnp.float16)
  a = rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                       seed=3, row_id=rid, step=stp)[1]
  b = rs.selective_state_update_stored(sb[::-1], **{
      k: (v[::-1] if k in ("x", "dt", "B", "C", "z") else v)
      for k, v in kw.items()}, stochastic_rounding=True, seed=3,
                                       row_id=rid[::-1], step=stp)[1]
  assert_same_bits(a, b[::-1], "SR baseline independent of row order")
  h = rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                       seed=3, row_id=rid, step=stp,
                                       sr_rng="hash32")[1]
  _, new = rs.selective_state_update(sb.astype(jnp.float32), **kw)
  assert_same_bits(h, P.round_to(new, jnp.float16, P.random_bits(
      3, 0, rid, stp, sb.shape[1:], P.SITE_BASELINE, "hash32")),
             "SR baseline with the hash32 bits")
  assert not np.array_equal(raw_bits(h), raw_bits(a))
  _, exact = rs.selective_state_update(sb, **kw)
  lo_hi = [np.nextafter(np.asarray(exact, np.float16), d) for d in
           (np.float16(-np.inf), np.float16(np.inf))]
  a = np.asarray(a)
  ok = (a == np.asarray(exact.astype(jnp.float16))) | (a == lo_hi[0]) | (
      a == lo_hi[1])
  assert ok.all()
  with pytest.raises(ValueError, match=r"row_id \(\[batch\] int32\) is "
                     r"required"):
    rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True)
  with pytest.raises(ValueError, match=r"sr_rng must be one of"):
    rs.selective_state_update_stored(sb, **kw, stochastic_rounding=True,
                                     row_id=rid, step=stp, sr_rng="x")
  with pytest.raises(ValueError, match=r"state_scale .* is required"):
    rs.selective_state_update_stored(q, **kw)
