"""Shared pieces of the Pallas kernel tests (interpret mode on CPU, and
lowering for CUDA without a GPU)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax import precision as P
from replayssm_jax import testing
from tests import cases as C
from tests import harness

DIMS = C.Dims(batch=5, nheads=8, headdim=16, dstate=16, ngroups=2)


def step_inputs(seed, dtype="float32", *, with_D=True, with_z=True,
                with_dt_bias=True):
  """(params, one step's token inputs) at DIMS."""
  d = DIMS
  key = jax.random.PRNGKey(seed)
  params = testing.random_params(key, d.nheads, with_D=with_D,
                                 with_dt_bias=with_dt_bias)
  tok = testing.random_step_inputs(jax.random.fold_in(key, 1), d.batch,
                                   d.nheads, d.headdim, d.dstate, d.ngroups,
                                   jnp.dtype(dtype), with_z=with_z)
  return params, tok


def mixed_state(ckpt_dtype, buffer_len, seed, flush_rows=(1,)):
  """(params, token, ragged state at DIMS, counts): rows include both flush
  (count L-1) and non-flush rows."""
  d = DIMS
  counts = np.array(C.ragged_counts(d.batch, buffer_len))
  counts[list(flush_rows)] = buffer_len - 1
  params, tok = step_inputs(seed)
  rstate, _ = testing.random_replay_state(
      jax.random.PRNGKey(seed + 1), d.batch, d.nheads, d.headdim, d.dstate,
      d.ngroups, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.dtype(ckpt_dtype), buffer_dtype=jnp.bfloat16)
  return params, tok, rstate, counts


def lower_for_cuda(fn, *args):
  """Lowers fn for CUDA on this CPU machine (jax.export cross-lowering):
  every pallas_call is lowered to Triton IR by the Pallas Triton backend,
  so an op it cannot lower (interpret mode runs anything) fails here."""
  from jax import export  # pylint: disable=g-import-not-at-top
  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  exp = export.export(jax.jit(fn), platforms=["cuda"],
                      disabled_checks=[triton])(*args)
  text = exp.mlir_module()
  assert "triton" in text  # the kernels were lowered, not skipped
  return text


def lowering_state(batch, buffer_len, policy, dims):
  """(params, token, ragged replay state of `policy` (None: f16 checkpoint)
  with its read copy and SR counters, the policy) at dims (h, p, n, g)."""
  h, p, n, g = dims
  key = jax.random.PRNGKey(5)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  tok = testing.random_step_inputs(key, batch, h, p, n, g, jnp.bfloat16,
                                   with_z=True)
  counts = np.arange(batch) % buffer_len
  pol = None if policy is None else P.PrecisionPolicy.preset(policy)
  rstate, _ = testing.random_replay_state(
      key, batch, h, p, n, g, buffer_len, counts, params["A"],
      checkpoint_dtype=jnp.float16 if pol is None else pol.checkpoint_dtype,
      buffer_dtype=jnp.bfloat16)
  return params, tok, harness.with_policy_fields(
      rstate, pol, np.arange(batch), np.zeros(batch)), pol


def lower_replay(config, params, tok, rstate, pol):
  """The replay step of config lowered for CUDA (MLIR text)."""
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  kw = dict(D=params["D"], dt_bias=params["dt_bias"], dt_softplus=True)
  return lower_for_cuda(
      lambda r, t, layer: replay_kernel.replay_state_update(
          r, t["x"], t["dt"], params["A"], t["B"], t["C"], z=t["z"], **kw,
          policy=pol, layer=layer, config=config),
      rstate, tok, jnp.int32(2))  # a traced layer (a scan over layers)


def launched_warps(text):
  """{kernel name: num_warps} of the Triton custom calls in lowered text."""
  return {name: int(w) for name, w in re.findall(
      r'name = "(replayssm_\w+)", num_stages = \d+ : i32, '
      r'num_warps = (\d+) : i32', text)}


def np_bits(a):
  """Raw bits (numpy view) of a numpy array of 1-, 2- or 4-byte items."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def check_step(rstate, counts, buffer_len, ckpt_dtype, config, **kw):
  """One kernel step of config against the reference on a mixed state:
  y, counters, untouched non-flush checkpoints and stale slots, flushed
  checkpoints, the appended slots."""
  before = jax.tree.map(np.asarray, rstate)
  y_ref, r_ref = rs.replay_state_update(rstate, **kw,
                                        implementation="reference")
  y, r = rs.replay_state_update(rstate, **kw, implementation="pallas",
                                config=config)
  # Inputs are not mutated.
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, rstate), before)
  tol = testing.tolerance("bfloat16", ckpt_dtype)
  testing.assert_close(y, y_ref, tol, "y")
  np.testing.assert_array_equal(r.count, r_ref.count)
  flush = counts == buffer_len - 1
  assert flush.any() and (buffer_len == 1 or (~flush).any())
  # Non-flush rows: checkpoint bit-identical (never written).
  same = ~np.asarray(harness.rows_changed(rstate.checkpoint, r.checkpoint))
  assert same[~flush].all(), "kernel wrote a non-flush row's checkpoint"
  testing.assert_close(np.asarray(r.checkpoint, np.float32)[flush],
                       np.asarray(r_ref.checkpoint, np.float32)[flush], tol,
                       "flushed checkpoint")
  # Buffers: the appended slot of non-flush rows equals the reference's;
  # every other slot is bit-identical to the input, but for the B buffer's
  # last slot, which no row holds history in (count < L) and which the
  # Mosaic tensor-core flush zeroes.
  for name in ("x_buf", "b_buf", "dt_buf"):
    new, ref, old = (np.asarray(getattr(s, name)) for s in (r, r_ref, rstate))
    for row in range(rstate.checkpoint.shape[0]):
      for slot in range(buffer_len):
        if slot == counts[row] and not flush[row]:
          np.testing.assert_array_equal(new[row, slot], ref[row, slot],
                                        err_msg=f"{name} appended slot")
        elif (name == "b_buf" and slot == buffer_len - 1
              and not np.any(new[row, slot])):
          continue
        else:
          np.testing.assert_array_equal(
              harness.bits(new[row, slot]), harness.bits(old[row, slot]),
              err_msg=f"{name}[{row}, {slot}] was written")
  return y, r
