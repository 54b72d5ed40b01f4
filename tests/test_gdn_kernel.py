"""The GDN Pallas kernels (`pallas_kernels.gdn`, implementation "pallas"
of the GDN ops; interpret mode on CPU) against the references: the
baseline step (state updated in place) and the replay step (ragged
counters, flush rows, GQA, poisoned stale slots, precision policies, the
traced-value policy; with and without its ring-weights launch,
`GDNConfig.ring_weights`, in one launch or two, `GDNConfig.split_routes`,
its flush fold by rank-1 updates or tensor-core products,
`GDNConfig.flush_fold`)
and the configs and inputs they refuse."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import gdn as kg
from pallas_kernels.gdn.ring_weights import gdn_ring_weights
from replayssm_jax import PrecisionPolicy
from replayssm_jax import dispatch
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import replay as RR
from replayssm_jax.gdn import testing as GT
from replayssm_jax.gdn.reference import prepare_qk
from replayssm_jax.reference import heads_from_groups

B, L = 4, 4
F32 = testing.TOLERANCES["float32"]


def _inputs(seed, hk, hv, K, Vd, dtype=jnp.float32, T=None):
  return GT.random_inputs(jax.random.PRNGKey(seed), B, hk, hv, K, Vd, T=T,
                          dtype=dtype)


# (state dtype, input dtype, (HK, HV, K, V), config): GQA (HV = 2 HK and
# 4 HK), value blocks below value_dim, every state dtype.
STEP_CASES = [
    ("float32", "float32", (1, 2, 16, 16), kg.GDNConfig()),
    ("float32", "bfloat16", (2, 4, 8, 16), kg.GDNConfig(block_v=4)),
    ("bfloat16", "float32", (1, 4, 16, 8), kg.GDNConfig(num_warps=2)),
    ("float16", "bfloat16", (2, 2, 8, 8), kg.GDNConfig(block_v=2)),
    ("float32", "bfloat16", (2, 4, 8, 16),
     kg.GDNConfig(block_v=8, heads_per_program=2)),  # heads in a loop
    ("float16", "float32", (1, 4, 8, 8), kg.GDNConfig(heads_per_program=4)),
]


@pytest.mark.parametrize("state_dtype,dtype,dims,config", STEP_CASES,
                         ids=str)
def test_step_kernel_matches_reference(state_dtype, dtype, dims, config):
  hk, hv, K, Vd = dims
  tok = _inputs(1, hk, hv, K, Vd, jnp.dtype(dtype))
  state = jax.random.normal(jax.random.PRNGKey(2), (B, hv, K, Vd)).astype(
      state_dtype)
  before = np.asarray(state)
  o_ref, s_ref = gdn.gdn_step(state, **tok, implementation="reference")
  o, s = gdn.gdn_step(state, **tok, implementation="pallas", config=config)
  assert o.dtype == o_ref.dtype and s.dtype == s_ref.dtype
  tol = testing.tolerance(state_dtype, dtype)
  testing.assert_close(o, o_ref, tol, "o")
  testing.assert_close(s, s_ref, testing.tolerance(state_dtype), "state")
  np.testing.assert_array_equal(np.asarray(state), before)  # not mutated


def test_step_kernel_options():
  """use_qk_l2norm=False and an explicit scale reach the kernel."""
  tok = _inputs(3, 1, 2, 8, 8)
  state = jax.random.normal(jax.random.PRNGKey(4), (B, 2, 8, 8))
  kw = dict(use_qk_l2norm=False, scale=0.25)
  o_ref, s_ref = gdn.gdn_step(state, **tok, **kw, implementation="reference")
  o, s = gdn.gdn_step(state, **tok, **kw, implementation="pallas")
  testing.assert_close(o, o_ref, F32, "o")
  testing.assert_close(s, s_ref, F32, "state")


def test_step_kernel_donated_state():
  """The state argument donated to a jitted step (aliased to the kernel's
  state output): outputs still equal the reference's, over two steps."""
  tok = _inputs(5, 2, 4, 8, 8)
  state = jax.random.normal(jax.random.PRNGKey(6), (B, 4, 8, 8))
  expected = gdn.gdn_step(state, **tok, implementation="reference")
  expected = (expected[0],) + gdn.gdn_step(expected[1], **tok,
                                           implementation="reference")
  step = jax.jit(lambda s, t: gdn.gdn_step(s, **t, implementation="pallas"),
                 donate_argnums=0)
  o1, s1 = step(jnp.array(state, copy=True), tok)
  o2, s2 = step(s1, tok)
  testing.assert_close(o1, expected[0], F32, "o (step 1)")
  testing.assert_close(o2, expected[1], F32, "o (step 2)")
  testing.assert_close(s2, expected[2], F32, "state")


# ------------------------------------------------------------ replay step
def _rstate(seed, hk, hv, K, Vd, counts, ck_dtype=jnp.float32,
            buf_dtype=jnp.float32):
  rstate, _ = GT.random_gdn_replay_state(
      jax.random.PRNGKey(seed), B, hk, hv, K, Vd, L, counts,
      checkpoint_dtype=ck_dtype, buffer_dtype=buf_dtype)
  return rstate


def _check_replay(new, new_ref, old, o, o_ref, tol, ck_tol=None):
  """Outputs, counters, the live ring slots, the flushed checkpoints;
  non-flush rows' checkpoints keep their bits."""
  testing.assert_close(o, o_ref, tol, "o")
  np.testing.assert_array_equal(np.asarray(new.count),
                                np.asarray(new_ref.count))
  c = np.asarray(new_ref.count)
  for r in (r for r in range(B) if c[r]):
    for name in ("d_buf", "k_buf", "g_buf"):
      testing.assert_close(getattr(new, name)[r, :c[r]],
                           getattr(new_ref, name)[r, :c[r]], tol,
                           f"{name} row {r}")
  flush = np.asarray(old.count) == L - 1
  ck, ck_ref = np.asarray(new.checkpoint), np.asarray(new_ref.checkpoint)
  testing.assert_close(ck[flush], ck_ref[flush], ck_tol or tol,
                       "flushed checkpoint")
  np.testing.assert_array_equal(ck[~flush], np.asarray(old.checkpoint)[~flush])


REPLAY_CASES = [
    ("float32", "float32", (1, 2, 16, 16), kg.GDNConfig()),
    ("float32", "bfloat16", (2, 4, 8, 16), kg.GDNConfig(block_v=4)),
    ("bfloat16", "bfloat16", (1, 4, 16, 8), kg.GDNConfig(block_v=8)),
    ("float16", "float32", (2, 2, 8, 8), kg.GDNConfig(block_v=2)),
]


def _two_steps(ck_dtype, buf_dtype, dims, config, dtype=jnp.float32):
  """Ragged counters (0, L-1 = flush, L//2, ...), stale slots poisoned
  with NaN / inf (GT.random_gdn_replay_state), inputs of `dtype`; then a
  second step from the kernel's own state (rows that just flushed start
  over, others flush now)."""
  hk, hv, K, Vd = dims
  r = _rstate(7, hk, hv, K, Vd, GT.ragged_counts(B, L), jnp.dtype(ck_dtype),
              jnp.dtype(buf_dtype))
  tol = testing.tolerance(ck_dtype, buf_dtype, dtype)
  for seed in (8, 9):
    tok = _inputs(seed, hk, hv, K, Vd, dtype)
    o_ref, new_ref = gdn.gdn_replay_step(r, **tok, implementation="reference")
    o, new = gdn.gdn_replay_step(r, **tok, implementation="pallas",
                                 config=config)
    _check_replay(new, new_ref, r, o, o_ref, tol,
                  testing.tolerance(ck_dtype))
    r = GT.fill_stale_slots(new)  # poison the next step's stale slots


@pytest.mark.parametrize("ck_dtype,buf_dtype,dims,config", REPLAY_CASES,
                         ids=str)
def test_replay_kernel_matches_reference(ck_dtype, buf_dtype, dims, config):
  """GQA, value blocks, every checkpoint dtype (_two_steps)."""
  _two_steps(ck_dtype, buf_dtype, dims, config)


# The ring-weights launch: f32 and f16 checkpoints, f32 and bf16 inputs
# and rings, GQA (2 and 4 value heads per key head), value blocks and
# whole rows.
RING_WEIGHTS_CASES = [
    ("float32", "bfloat16", (2, 4, 8, 16), 4),
    ("float32", "float32", (1, 2, 16, 16), None),
    ("float16", "float32", (2, 2, 8, 8), 2),
    ("float16", "bfloat16", (1, 4, 16, 8), 8),
]


@pytest.mark.parametrize("ck_dtype,buf_dtype,dims,block_v",
                         RING_WEIGHTS_CASES, ids=str)
def test_replay_kernel_ring_weights_matches_reference(ck_dtype, buf_dtype,
                                                      dims, block_v):
  _two_steps(ck_dtype, buf_dtype, dims,
             kg.GDNConfig(block_v=block_v, ring_weights=True),
             jnp.dtype(buf_dtype))


@pytest.mark.parametrize("ck_dtype,buf_dtype,dims,block_v",
                         RING_WEIGHTS_CASES[:2], ids=str)
@pytest.mark.parametrize("ring_weights,heads_per_program",
                         [(False, None), (True, None), (True, 2)])
def test_replay_kernel_split_routes_matches_reference(
    ck_dtype, buf_dtype, dims, block_v, ring_weights, heads_per_program):
  """The output and flush routes in two launches (the flush launch stores
  into the output launch's o; both read the same counters), the output
  launch's programs stepping through one or two value heads."""
  _two_steps(ck_dtype, buf_dtype, dims,
             kg.GDNConfig(block_v=block_v, ring_weights=ring_weights,
                          split_routes=True,
                          heads_per_program=heads_per_program),
             jnp.dtype(buf_dtype))


@pytest.mark.parametrize("ck_dtype,buf_dtype,config", [
    ("float32", "bfloat16", kg.GDNConfig(flush_fold="dot", block_v=8)),
    ("float32", "bfloat16", kg.GDNConfig(flush_fold="rank1")),
    ("float32", "float32", kg.GDNConfig(flush_fold="dot",
                                        ring_weights=True)),
    ("float16", "bfloat16", kg.GDNConfig(flush_fold="dot",
                                         split_routes=True)),
], ids=str)
def test_replay_kernel_dot_fold_matches_reference(ck_dtype, buf_dtype,
                                                  config):
  """The flush fold as tensor-core products (bf16 pieces on a bf16 d
  ring, TF32 x3 on an f32 one; exact f32 in interpret mode) at a 16-slot
  ring: flush rows' outputs and checkpoints equal the reference's, stale
  slots poisoned, the other rows' checkpoints untouched."""
  hk, hv, K, Vd, L16 = 1, 2, 16, 16, 16
  counts = (L16 - 1, 3, L16 - 1, 0)  # two flush rows
  r, _ = GT.random_gdn_replay_state(
      jax.random.PRNGKey(40), B, hk, hv, K, Vd, L16, counts,
      checkpoint_dtype=jnp.dtype(ck_dtype), buffer_dtype=jnp.dtype(buf_dtype))
  tok = _inputs(41, hk, hv, K, Vd)
  o_ref, new_ref = gdn.gdn_replay_step(r, **tok, implementation="reference")
  o, new = gdn.gdn_replay_step(r, **tok, implementation="pallas",
                               config=config)
  tol = testing.tolerance(ck_dtype, buf_dtype)
  testing.assert_close(o, o_ref, tol, "o")
  flush = np.asarray(counts) == L16 - 1
  testing.assert_close(np.asarray(new.checkpoint)[flush],
                       np.asarray(new_ref.checkpoint)[flush],
                       testing.tolerance(ck_dtype), "flushed checkpoint")
  np.testing.assert_array_equal(np.asarray(new.checkpoint)[~flush],
                                np.asarray(r.checkpoint)[~flush])


@pytest.mark.parametrize("buffer_len,default", [(16, "dot"), (4, "rank1")])
def test_default_flush_fold(buffer_len, default):
  """flush_fold=None folds by tensor-core products where the ring and the
  keys reach 16 slots, by rank-1 updates below: the same bits as the
  explicit choice."""
  counts = (buffer_len - 1, 1, buffer_len - 1, 0)
  r, _ = GT.random_gdn_replay_state(jax.random.PRNGKey(44), B, 1, 2, 16, 16,
                                    buffer_len, counts)
  tok = _inputs(45, 1, 2, 16, 16)
  got = gdn.gdn_replay_step(r, **tok, implementation="pallas")
  want = gdn.gdn_replay_step(r, **tok, implementation="pallas",
                             config=kg.GDNConfig(flush_fold=default))
  chex.assert_trees_all_equal(got, want)


def test_dot_fold_refusals():
  """flush_fold="dot" needs 16-slot rings and keys (Triton dot tiles) and
  belongs to the replay step: refused by name elsewhere."""
  with pytest.raises(ValueError, match="flush_fold must be"):
    kg.GDNConfig(flush_fold="tensor")
  dot = kg.GDNConfig(flush_fold="dot")
  r = _rstate(42, 1, 2, 16, 16, GT.ragged_counts(B, L))  # L = 4 slots
  tok = _inputs(43, 1, 2, 16, 16)
  with pytest.raises(NotImplementedError, match="buffer_len and key_dim "
                     ">= 16 .* got 4 and 16"):
    gdn.gdn_replay_step(r, **tok, implementation="pallas", config=dot)
  with pytest.raises(NotImplementedError, match="flush_fold applies to the "
                     "replay step kernel only"):
    gdn.gdn_step(jnp.ones((B, 2, 16, 16)), **tok, implementation="pallas",
                 config=dot)


def test_ring_weights_kernel():
  """The weights of the live slots equal the reference's pieces (w_j
  (k_j . k), w_j (k_j . q), exp(G), k . q, and the factors that normalise
  the token's q and k); stale slots (NaN / inf) give zeros, finite, on
  every row."""
  counts = GT.ragged_counts(B, L)
  r = _rstate(30, 2, 4, 16, 8, counts, buf_dtype=jnp.bfloat16)
  tok = _inputs(31, 2, 4, 16, 8, jnp.bfloat16)
  w, s = gdn_ring_weights(r.k_buf, r.g_buf, r.count, tok["q"], tok["k"],
                          tok["g"], interpret=True)
  assert w.shape == (B, 4, 2, L) and s.shape == (B, 4, 4)
  assert np.isfinite(np.asarray(w)).all() and np.isfinite(np.asarray(s)).all()
  qn, kn = prepare_qk(tok["q"], tok["k"], True, None)
  qh, kh = (heads_from_groups(x, 4, axis=1) for x in (qn, kn))
  _, k_h, g_h, live = RR.history(r.d_buf, r.k_buf, r.g_buf, r.count)
  H = jnp.cumsum(g_h, axis=1)
  G = H[:, -1] + tok["g"]
  ww = jnp.where(live[..., None], jnp.exp(G[:, None] - H), 0.0)
  expect = jnp.stack([jnp.swapaxes(ww * RR.window_dots(k_h, x), 1, 2)
                      for x in (kh, qh)], axis=2)  # [b, HV, 2, L]
  testing.assert_close(w, expect, F32, "weights")
  stale = ~np.asarray(live)[:, None, None, :]
  np.testing.assert_array_equal(np.asarray(w)[np.broadcast_to(stale, w.shape)],
                                0.0)
  testing.assert_close(s[..., 0], jnp.exp(G), F32, "exp(G)")
  testing.assert_close(s[..., 1], jnp.sum(kh * qh, axis=-1), F32, "k . q")
  for i, x, xn in ((2, tok["q"], qh), (3, tok["k"], kh)):
    raw = heads_from_groups(x.astype(jnp.float32), 4, axis=1)
    testing.assert_close(raw * s[..., i, None], xn, F32, f"factor {i}")


@pytest.mark.parametrize("split_routes", [False, True])
def test_replay_kernel_donated_state(split_routes):
  """The replay state donated to a jitted step (checkpoint and rings
  aliased to the kernel's outputs): L steps (every row flushes once) equal
  the reference's."""
  r = _rstate(21, 1, 2, 8, 8, GT.ragged_counts(B, L))
  r_ref = r
  config = kg.GDNConfig(split_routes=split_routes)
  step = jax.jit(lambda r, t: gdn.gdn_replay_step(
      r, **t, implementation="pallas", config=config), donate_argnums=0)
  r = jax.tree.map(lambda x: jnp.array(x, copy=True), r)
  for seed in range(L):
    tok = _inputs(40 + seed, 1, 2, 8, 8)
    o_ref, r_ref = gdn.gdn_replay_step(r_ref, **tok,
                                       implementation="reference")
    o, r = step(r, tok)
    testing.assert_close(o, o_ref, F32, f"o (step {seed})")
  testing.assert_close(gdn.gdn_materialize(r), gdn.gdn_materialize(r_ref),
                       F32, "state")


def test_replay_kernel_buffer_length_one():
  """L = 1: every row flushes every step (the baseline step stored in the
  checkpoint dtype)."""
  rstate, _ = GT.random_gdn_replay_state(jax.random.PRNGKey(10), B, 1, 2, 8,
                                         8, 1, (0,) * B)
  tok = _inputs(11, 1, 2, 8, 8)
  o_ref, new_ref = gdn.gdn_replay_step(rstate, **tok,
                                       implementation="reference")
  o, new = gdn.gdn_replay_step(rstate, **tok, implementation="pallas")
  testing.assert_close(o, o_ref, F32, "o")
  testing.assert_close(new.checkpoint, new_ref.checkpoint, F32, "checkpoint")


# The replay step's launch forms: one launch, the ring-weights launch
# first, the two routes in two launches (whole rows in both; value tiles
# in the output launch, whole rows in the flush launch where a state needs
# them; the output launch's programs stepping through two heads).
LAUNCHES = [kg.GDNConfig(ring_weights=False),
            kg.GDNConfig(ring_weights=True),
            kg.GDNConfig(ring_weights=False, split_routes=True),
            kg.GDNConfig(ring_weights=True, split_routes=True, block_v=4),
            kg.GDNConfig(ring_weights=False, split_routes=True,
                         heads_per_program=2)]


@pytest.mark.parametrize("config", LAUNCHES, ids=str)
@pytest.mark.parametrize("name", ["f32+bf16", "f32+int8", "f16+fp8+sr",
                                  "bf16+sr"])
def test_replay_kernel_precision_policies(name, config):
  """Read copies (output-route rows read only the copy: a NaN master
  never reaches their outputs), 8-bit copies with scales, stochastic
  rounding of the flush stores (the reference's bits; the fold's f32 sums
  may differ by an ulp, so a stored element may round the other way)."""
  policy = PrecisionPolicy.preset(name).replace(buffer_dtype="float32")
  r = _rstate(12, 1, 2, 8, 8, GT.ragged_counts(B, L),
              jnp.dtype(policy.checkpoint_dtype)).with_policy(policy)
  tok = _inputs(13, 1, 2, 8, 8)
  o_ref, new_ref = gdn.gdn_replay_step(r, **tok, policy=policy,
                                       implementation="reference")
  o, new = gdn.gdn_replay_step(r, **tok, policy=policy,
                               implementation="pallas", config=config)
  dtypes = [policy.checkpoint_dtype] + (
      [policy.read_dtype] if policy.read_dtype else [])
  tol = testing.tolerance(*dtypes)
  _check_replay(new, new_ref, r, o, o_ref, tol)
  flush = np.asarray(r.count) == L - 1
  if policy.read_dtype is not None:
    testing.assert_close(P_load(new)[flush], P_load(new_ref)[flush], tol,
                         "flushed read copy")
    np.testing.assert_array_equal(np.asarray(new.read_copy)[~flush],
                                  np.asarray(r.read_copy)[~flush])
    nan_master = jnp.where(jnp.asarray(flush)[:, None, None, None],
                           r.checkpoint, jnp.nan).astype(r.checkpoint.dtype)
    o_nan, _ = gdn.gdn_replay_step(r.replace(checkpoint=nan_master), **tok,
                                   policy=policy, implementation="pallas",
                                   config=config)
    np.testing.assert_array_equal(np.asarray(o_nan), np.asarray(o))
  if policy.stochastic_rounding:
    np.testing.assert_array_equal(np.asarray(new.step),
                                  np.asarray(new_ref.step))


def P_load(rstate):
  from replayssm_jax import precision as P  # pylint: disable=g-import-not-at-top
  return np.asarray(P.load(rstate.read_copy, rstate.read_scale))


@pytest.mark.parametrize("config", LAUNCHES, ids=str)
def test_replay_kernel_out_of_range_counters(config):
  """Under jit a counter outside [0, L) gives NaN outputs, keeps the
  count and writes nothing (the kernel called directly: the op raises
  on concrete bad counters)."""
  r = _rstate(14, 1, 2, 8, 8, (1, L - 1, 0, 2))
  r = r.replace(count=jnp.array([L, L - 1, -1, 2], jnp.int32))
  tok = _inputs(15, 1, 2, 8, 8)
  o, new = kg.gdn_replay_step(r, **tok, config=config, interpret=True)
  o = np.asarray(o)
  assert np.isnan(o[[0, 2]]).all() and np.isfinite(o[[1, 3]]).all()
  np.testing.assert_array_equal(np.asarray(new.count), [L, 0, -1, 3])
  for name in ("checkpoint", "d_buf", "k_buf", "g_buf"):
    np.testing.assert_array_equal(np.asarray(getattr(new, name))[[0, 2]],
                                  np.asarray(getattr(r, name))[[0, 2]])


# ----------------------------------------------------------- refusals
def test_kernels_refuse_by_name():
  tok = _inputs(16, 1, 2, 8, 6)
  state = jax.random.normal(jax.random.PRNGKey(17), (B, 2, 8, 6))
  with pytest.raises(NotImplementedError, match="value_dim = 6 is not a "
                     "power of two"):
    gdn.gdn_step(state, **tok, implementation="pallas")
  gdn.gdn_step(state, **tok)  # implementation=None: the reference
  with pytest.raises(ValueError, match="block_v must be a power of two"):
    kg.GDNConfig(block_v=3)
  with pytest.raises(ValueError,
                     match="flush_num_warps must be a power of two"):
    kg.GDNConfig(flush_num_warps=6)
  with pytest.raises(ValueError, match="num_stages must be"):
    kg.GDNConfig(num_stages=0)
  tok = _inputs(18, 1, 2, 8, 8)
  r = _rstate(19, 1, 2, 8, 8, GT.ragged_counts(B, L))
  r3 = GT.random_gdn_replay_state(jax.random.PRNGKey(19), B, 1, 2, 8, 8, 3,
                                  (0, 1, 2, 0))[0]
  with pytest.raises(NotImplementedError, match="buffer_len = 3"):
    gdn.gdn_replay_step(r3, **tok, implementation="pallas")
  policy = PrecisionPolicy.preset("f32+bf16").replace(buffer_dtype="float32")
  with pytest.raises(NotImplementedError, match="block_v=4 does not apply"):
    gdn.gdn_replay_step(r.with_policy(policy), **tok, policy=policy,
                        implementation="pallas",
                        config=kg.GDNConfig(block_v=4, ring_weights=True))
  # ring_weights: the replay step's and the verify's option, refused by
  # the baseline step; split_routes: the replay step's only.
  with pytest.raises(ValueError, match="ring_weights must be None or a bool"):
    kg.GDNConfig(ring_weights=1)
  rw = kg.GDNConfig(ring_weights=True)
  with pytest.raises(NotImplementedError, match="ring_weights applies to "
                     "the replay step and verify kernels only .* baseline "
                     "step"):
    gdn.gdn_step(state[..., :4, :4], **_inputs(18, 1, 2, 4, 4),
                 implementation="pallas", config=rw)
  win = _inputs(22, 1, 2, 8, 8, T=2)
  with pytest.raises(NotImplementedError, match="split_routes applies to "
                     "the replay step kernel only .* verify kernels"):
    gdn.gdn_replay_verify(r, **win, implementation="pallas",
                          config=kg.GDNConfig(split_routes=True))
  with pytest.raises(ValueError, match="split_routes must be None or a bool"):
    kg.GDNConfig(split_routes="yes")
  with pytest.raises(NotImplementedError, match="split_routes applies to "
                     "the replay step kernel only .* baseline step"):
    gdn.gdn_step(state[..., :4, :4], **_inputs(18, 1, 2, 4, 4),
                 implementation="pallas",
                 config=kg.GDNConfig(split_routes=True))
  with pytest.raises(NotImplementedError, match="heads_per_program=2 "
                     "applies to the baseline step and to the output launch "
                     "of split routes"):
    gdn.gdn_replay_step(r, **tok, implementation="pallas",
                        config=kg.GDNConfig(heads_per_program=2))
  with pytest.raises(NotImplementedError, match="heads_per_program \\(4\\) "
                     "must divide the value heads \\(2\\)"):
    gdn.gdn_replay_step(r, **tok, implementation="pallas",
                        config=kg.GDNConfig(heads_per_program=4,
                                            split_routes=True))
  with pytest.raises(ValueError, match="heads_per_program must be a power"):
    kg.GDNConfig(heads_per_program=3)


def test_fp8_copy_refused_below_sm89(monkeypatch):
  from pallas_kernels import triton_utils  # pylint: disable=g-import-not-at-top
  policy = PrecisionPolicy.preset("f32+fp8").replace(buffer_dtype="float32")
  r = _rstate(20, 1, 2, 8, 8, GT.ragged_counts(B, L)).with_policy(policy)
  assert kg.replay_problem(r, policy) is None
  monkeypatch.setattr(triton_utils, "compute_capability", lambda: (8, 0))
  assert "compute capability >= 8.9" in kg.replay_problem(r, policy)


def test_registered_with_the_dispatcher():
  """Implementation "pallas" of gdn_step / gdn_replay_step, preferred on a
  GPU only (implementation=None runs the reference here)."""
  for op in ("gdn_step", "gdn_replay_step"):
    assert dispatch.implementations(op)[0] == "pallas"
    assert any(o == op for o, _ in pk.IMPLEMENTATIONS)
    impl = dispatch._REGISTRY[op]["pallas"]  # pylint: disable=protected-access
    assert impl.preferred() == pk.on_gpu()
