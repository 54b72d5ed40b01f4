"""The reference ops of both delta-rule families (Gated DeltaNet, Kimi
Delta Attention; tests/delta_rule_families.py): the decode step against a
float64 loop (grouped and one-per-value-head keys, raw and scaled q), in
a 16-bit state, the chunked prefill against the step, from a zero state
against float64, padded positions holding NaN / inf, and the chunk
systems solved by their inverses (`solve="inverse"`). Each family's
own cases (gates, dispatch, argument checks, transformers' values):
tests/test_gdn_reference.py, tests/test_kda_reference.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import testing
from replayssm_jax.gdn import reference as GR
from tests.delta_rule_families import (B, FAMILIES, HK, HV, K, VD, numpy_loop,
                                       reference_inputs)

TOL = testing.TOLERANCES["float32"]
TOKS = ("q", "k", "v", "g", "beta")
fams = pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)


def _prefill(fam, **kw):
  # Jitted: one compilation per case instead of one per primitive and shape.
  return jax.jit(fam.chunked_prefill, static_argnames=("chunk_size",))(**kw)


@fams
@pytest.mark.parametrize("opts", [dict(), dict(use_qk_l2norm=False,
                                                scale=0.3)],
                         ids=["l2norm", "raw-scaled"])
@pytest.mark.parametrize("hk", [HK, HV], ids=["gqa", "mha"])
def test_step_matches_float64_loop(fam, opts, hk):
  T = 6
  inp, state = reference_inputs(fam, 1, T=T, hk=hk)
  want_o, want_s = numpy_loop(state, **inp, **opts)
  step = jax.jit(fam.step_op, static_argnames=("use_qk_l2norm", "scale"))
  s = state
  for t in range(T):
    o, s = step(s, *(inp[n][:, t] for n in TOKS), **opts)
    assert o.dtype == jnp.float32 and o.shape == (B, HV, VD)
    testing.assert_close(o, want_o[:, t], TOL, f"o at step {t}")
  testing.assert_close(s, want_s, TOL, "state")


@fams
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_step_keeps_the_state_dtype(fam, dtype):
  inp, state = reference_inputs(fam, 2)
  st = state.astype(dtype)
  o, new = fam.step_op(st, **inp)
  assert new.dtype == jnp.dtype(dtype)
  want_o, want_s = numpy_loop(st.astype(jnp.float32),
                              **{n: x[:, None] for n, x in inp.items()})
  testing.assert_close(o, want_o[:, 0], TOL, "o from a low-precision state")
  testing.assert_close(new, want_s, testing.tolerance(dtype), "stored state")


CHUNK_CASES = [(1, 64), (1, 1), (5, 4), (5, 64), (33, 7), (64, 16),
               (64, 64), (100, 16), (100, 7)]


@fams
@pytest.mark.parametrize("T,chunk", CHUNK_CASES,
                         ids=[f"T{t}-Q{c}" for t, c in CHUNK_CASES])
def test_chunked_matches_stepwise(fam, T, chunk):
  inp, state = reference_inputs(fam, 10 + T + chunk, T=T)
  want_o, snaps = jax.jit(fam.step_scan)(state, **inp)
  o, s = _prefill(fam, **inp, chunk_size=chunk, initial_state=state)
  assert o.shape == (B, T, HV, VD) and s.dtype == jnp.float32
  testing.assert_close(o, want_o, TOL, f"T={T} chunk={chunk} o")
  testing.assert_close(s, snaps[:, -1], TOL, f"T={T} chunk={chunk} state")


@fams
@pytest.mark.parametrize("hk", [1, HV], ids=["one-key-head", "mha"])
def test_chunked_from_a_zero_state_matches_float64(fam, hk):
  """No initial state; the float64 loop (not only our own step)."""
  inp, _ = reference_inputs(fam, 30 + hk, T=21, hk=hk)
  o, s = _prefill(fam, **inp, chunk_size=8)
  o64, s64 = numpy_loop(jnp.zeros((B, HV, K, VD)), **inp)
  testing.assert_close(o, o64, TOL, "o vs float64")
  testing.assert_close(s, s64, TOL, "state vs float64")


@fams
def test_padded_positions_never_reach_outputs_or_state(fam):
  T, lengths = 13, np.array([13, 7, 1, 0])
  inp, state = reference_inputs(fam, 40, batch=4, T=T)
  valid = jnp.asarray(np.arange(T)[None, :] < lengths[:, None])
  want_o, snaps = jax.jit(fam.step_scan)(state, **inp)
  poison = dict(q=jnp.nan, k=jnp.inf, v=jnp.nan, g=jnp.nan, beta=jnp.inf)
  bad = {n: jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x,
                      poison[n]) for n, x in inp.items()}
  for chunk in (4, 64):
    o, s = _prefill(fam, **bad, chunk_size=chunk, initial_state=state,
                    valid=valid)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    np.testing.assert_array_equal(
        np.where(valid[..., None, None], 0.0, o), 0.0)
    for r, n in enumerate(lengths):
      if n:
        testing.assert_close(o[r, :n], want_o[r, :n], TOL, f"row {r} o")
        testing.assert_close(s[r], snaps[r, n - 1], TOL, f"row {r} state")
      else:
        testing.assert_close(s[r], state[r], TOL, "empty row keeps its state")


@pytest.mark.parametrize("c", [1, 2, 5, 16, 17, 64, 100])
def test_invert_unit_lower_matches_float64(c):
  """(I + a)^-1 from products alone (blocks of 16 by the nilpotent series,
  larger ones by halves) == numpy's float64 inverse; entries on and above
  the diagonal, NaN here, are never read."""
  a = jax.random.uniform(jax.random.PRNGKey(c), (2, 3, c, c), minval=-1.0,
                         maxval=1.0)
  lower = np.tril(np.asarray(a, np.float64), -1)
  want = np.linalg.inv(lower + np.eye(c))
  a = jnp.where(jnp.tri(c, k=-1, dtype=bool), a, jnp.nan)
  testing.assert_close(GR.invert_unit_lower(a), want, TOL, f"C={c}")


@fams
@pytest.mark.parametrize("T,chunk", [(5, 4), (33, 7), (100, 64)])
def test_inverse_solve_equals_substitution(fam, T, chunk):
  """solve="inverse" (the chunk systems' inverses from matrix products)
  gives substitution's outputs, final state and gradients (what training
  takes through it)."""
  inp, state = reference_inputs(fam, 70 + T, T=T)

  def loss(inp, state, solve):
    o, s = fam.chunked_prefill(**inp, chunk_size=chunk, initial_state=state,
                               solve=solve)
    return jnp.sum(o * o) + jnp.sum(s * s), (o, s)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True),
                 static_argnums=2)
  (gi, gs), (o, s) = grad(inp, state, "substitution")
  (gi2, gs2), (o2, s2) = grad(inp, state, "inverse")
  testing.assert_close(o2, o, TOL, "o")
  testing.assert_close(s2, s, TOL, "state")
  testing.assert_close(gs2, gs, TOL, "d initial_state")
  for n in gi:
    testing.assert_close(gi2[n], gi[n], TOL, f"d {n}")
  with pytest.raises(ValueError, match="solve"):
    fam.chunked_prefill(**inp, solve="cholesky")
