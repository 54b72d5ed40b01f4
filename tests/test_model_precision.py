"""Precision policies in the hybrid LM (`init_state(precision=...)`).

A tiny two-Mamba-layer model (pattern "MM", d_model 32) with random weights;
ragged right-padded prompts (lengths 10, 4, 7), then 40 teacher-forced
decode steps with buffer_len 4 (10 flushes per row, at staggered steps).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import PrecisionPolicy, ReplayState, testing
from replayssm_jax.models import (HybridLM, ModelConfig, commit,
                                  decode_step, generate, prefill,
                                  speculative_generate, verify)
from replayssm_jax.models.speculative import NgramProposer
from replayssm_jax.models.states import StoredSSMState
from tests.test_models import _prefill_then_decode  # pylint: disable=g-bad-import-order

CFG = dict(vocab_size=64, d_model=32, pattern="MM", ssm_heads=4, head_dim=8,
           d_state=8, n_groups=2, conv_kernel=4, chunk_size=8)
B, T, STEPS, L = 3, 10, 40, 4
LENGTHS = (10, 4, 7)
MAX_LEN = T + STEPS


@pytest.fixture(scope="module")
def model():
  cfg = ModelConfig(**CFG)
  graphdef = nnx.graphdef(nnx.eval_shape(
      lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(HybridLM(cfg, rngs=nnx.Rngs(0))))()
  return nnx.merge(graphdef, params)  # one compilation, not op by op


def random_tokens(seed, shape):
  return jax.random.randint(jax.random.PRNGKey(seed), shape, 0, 64,
                            jnp.int32)


PROMPTS = random_tokens(1, (B, T))
CONT = random_tokens(2, (B, STEPS))


_RUNS = {}


def run(model, rows=None, ssm_mode="replay", **state_kwargs):
  """prefill + STEPS teacher-forced decode steps of PROMPTS/CONT (the given
  rows) -> (last prompt logits, decode logits [b, STEPS, vocab], state)
  as numpy; memoized per arguments (tests share runs, and compilations)."""
  key = (id(model), None if rows is None else tuple(rows), ssm_mode,
         repr(sorted((k, np.asarray(v).tolist() if k == "row_ids" else v)
                     for k, v in state_kwargs.items())))
  if key not in _RUNS:
    _RUNS[key] = _run(model, rows, ssm_mode, **state_kwargs)
  return _RUNS[key]


def _run(model, rows, ssm_mode, **state_kwargs):
  rows = np.arange(B) if rows is None else np.asarray(rows)
  state = model.init_state(len(rows), MAX_LEN, ssm_mode=ssm_mode,
                           buffer_len=L, **state_kwargs)
  out = _prefill_then_decode(nnx.split(model), PROMPTS[rows],
                             jnp.asarray(LENGTHS, jnp.int32)[rows],
                             CONT[rows], state)
  return jax.tree.map(np.asarray, out)


def _assert_trees_equal(a, b):
  """Equal leaves (dtype and bits) in the same places; static metadata such
  as MambaState.precision is not compared."""
  la = jax.tree.leaves_with_path(a)
  lb = jax.tree.leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (_, x), (_, y) in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------- layouts
def test_mamba_indices_and_state_layouts():
  cfg = ModelConfig(**{**CFG, "pattern": "M-M*-M", "num_heads": 4,
                       "num_kv_heads": 2, "attn_head_dim": 8,
                       "intermediate_size": 48})
  model = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
  assert model.mamba_indices() == (0, None, 1, None, None, 2)
  pol = PrecisionPolicy.preset("f32+int8+sr")
  st = model.init_state(B, 16, buffer_len=L, precision=pol)
  assert st.precision == pol and st.ssm_mode == "replay"
  r = st.layers[0].ssm
  assert isinstance(r, ReplayState) and r.read_copy.dtype == jnp.int8
  assert r.checkpoint.dtype == jnp.float32 and r.x_buf.dtype == jnp.bfloat16
  assert r.read_scale.shape == (B, 4, 8)
  np.testing.assert_array_equal(r.row_id, np.arange(B))
  np.testing.assert_array_equal(r.step, np.zeros(B))
  # Baseline "round every step": the policy's narrowest dtype.
  st = model.init_state(B, 16, ssm_mode="baseline", precision=pol,
                        row_ids=np.array([7, 1, 4]))
  s = st.layers[0].ssm
  assert st.ssm_mode == "baseline" and isinstance(s, StoredSSMState)
  assert s.state.dtype == jnp.int8 and s.scale.shape == (B, 4, 8)
  np.testing.assert_array_equal(s.row_id, [7, 1, 4])
  st = model.init_state(B, 16, ssm_mode="baseline",
                        precision=PrecisionPolicy.preset("bf16"))
  assert st.layers[0].ssm.dtype == jnp.bfloat16  # a plain array
  assert not isinstance(st.layers[0].ssm, StoredSSMState)
  # The "f32" preset lays out the state like the no-policy bf16 buffers.
  a = model.init_state(B, 16, buffer_len=L,
                       precision=PrecisionPolicy.preset("f32"))
  b = model.init_state(B, 16, buffer_len=L, buffer_dtype=jnp.bfloat16)
  assert (jax.tree.map(lambda x: (x.shape, x.dtype), a.layers[0].ssm)
          == jax.tree.map(lambda x: (x.shape, x.dtype), b.layers[0].ssm))
  assert model.init_state(B, 16).precision is None


# --------------------------------------------------------------- decode
def test_f32_policy_equals_no_policy_bit_for_bit(model):
  """Preset "f32" (f32 master, bf16 buffers, no read copy, no SR) decodes
  exactly as the policy-free state with the same dtypes: logits and final
  states equal bit for bit."""
  with_policy = run(model, precision=PrecisionPolicy.preset("f32"))
  without = run(model, buffer_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(with_policy[0], without[0])
  np.testing.assert_array_equal(with_policy[1], without[1])
  assert with_policy[2].precision == PrecisionPolicy.preset("f32")
  _assert_trees_equal(with_policy[2].layers, without[2].layers)
  np.testing.assert_array_equal(with_policy[2].positions,
                                np.array(LENGTHS) + STEPS)


def test_dual_precision_decodes_close_to_f32(model):
  """f32 master + bf16 read copy (bf16 buffers in both): decode logits are
  within the bfloat16 row of testing.TOLERANCES of the f32 policy's (the
  copy is re-rounded from the exact master at each flush, so its error
  does not accumulate); the master checkpoint itself stays f32-exact:
  in the first Mamba layer (whose inputs never depend on an SSM output) it
  equals the f32 policy's bit for bit, since it is never built from the
  copy; deeper layers see inputs perturbed by the copy's outputs."""
  ref = run(model, precision=PrecisionPolicy.preset("f32"))
  dual = run(model, precision=PrecisionPolicy.preset("f32+bf16"))
  tol = testing.tolerance(jnp.bfloat16)
  testing.assert_close(dual[1], ref[1], tol, "f32+bf16 decode logits")
  np.testing.assert_array_equal(dual[0], ref[0])  # prefill: no copy read
  assert np.abs(dual[1] - ref[1]).max() > 0  # the copy is really read
  np.testing.assert_array_equal(dual[2].layers[0].ssm.checkpoint,
                                ref[2].layers[0].ssm.checkpoint)
  testing.assert_close(dual[2].layers[1].ssm.checkpoint,
                       ref[2].layers[1].ssm.checkpoint, tol,
                       "f32+bf16 layer-1 master")
  for ld in dual[2].layers:
    assert ld.ssm.read_copy.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        ld.ssm.read_copy, ld.ssm.checkpoint.astype(jnp.bfloat16))


def test_stochastic_rounding_reproducible_and_batch_independent(model):
  """f32 master + int8 read copy with SR, rows with ids (5, 9, 2):
  * the same seed reproduces the run bit for bit; another seed differs;
  * the same rows in another order (same batch size) decode bit for bit
    as before: SR bits follow the row id, not the slot;
  * a row beside other rows (the same batch size) decodes bit for bit as
    before, while the same row under another row id differs far more
    (other random bits).
  A row alone (batch 1) is not compared bit for bit: XLA:CPU matmuls of
  another batch size may associate differently (~3e-7 relative), and such
  a difference can flip an int8 rounding decision now and then."""
  ids = np.array([5, 9, 2])
  pol = PrecisionPolicy.preset("f32+int8+sr").replace(seed=11)
  a = run(model, precision=pol, row_ids=ids)
  again = _run(model, None, "replay", precision=pol, row_ids=ids)
  _assert_trees_equal(a, again)
  other_seed = run(model, precision=pol.replace(seed=12), row_ids=ids)
  assert not np.array_equal(a[1], other_seed[1])
  np.testing.assert_array_equal(a[2].layers[0].ssm.step,
                                np.array(LENGTHS) + STEPS)
  perm = np.array([2, 0, 1])
  permuted = run(model, rows=perm, precision=pol, row_ids=ids[perm])
  np.testing.assert_array_equal(permuted[1], a[1][perm])
  others = np.array([0, 1, 0])  # row 1 beside other companions
  beside = run(model, rows=others, precision=pol, row_ids=np.array([7, 9, 3]))
  np.testing.assert_array_equal(beside[1][1], a[1][1])
  renamed = run(model, rows=others, precision=pol,
                row_ids=np.array([7, 4, 3]))
  f32 = testing.tolerance(jnp.float32)
  assert testing.max_rel_error(renamed[1][1], a[1][1]) > 30 * f32.rtol


def test_baseline_round_every_step_stays_expressible(model):
  """Baseline mode with a policy stores the full state every step (the
  contrast of replay's once-per-L stores): "f32+int8+sr" keeps an int8
  state + scales + SR counters, reproducibly, and stays near the exact
  decode. (A float policy rounded to nearest is the plain array of
  init_state(checkpoint_dtype=...), see test_mamba_indices_and_state_
  layouts.)"""
  pol = PrecisionPolicy.preset("f32+int8+sr")
  c = run(model, ssm_mode="baseline", precision=pol)
  assert np.all(np.isfinite(c[1]))
  s = c[2].layers[1].ssm
  assert isinstance(s, StoredSSMState) and s.state.dtype == jnp.int8
  assert s.scale.dtype == jnp.float32
  np.testing.assert_array_equal(s.step, np.array(LENGTHS) + STEPS)
  _assert_trees_equal(c, _run(model, None, "baseline", precision=pol))
  # Within 0.1 of the logit scale of the exact (f32 policy) decode after
  # 40 int8 stores (observed ~5e-3: each store errs by <= amax / 254 per
  # row, and the state forgets old errors at its decay rate), but not
  # equal to it.
  ref = run(model, precision=PrecisionPolicy.preset("f32"))
  err = testing.max_rel_error(c[1], ref[1])
  assert 0 < err < 0.1, err


def test_generate_carries_the_policy(model):
  """generate(precision=...) decodes under the policy: the returned state
  keeps it (bf16 master with SR counters advanced by every token)."""
  pol = PrecisionPolicy.preset("bf16+sr").replace(seed=3)
  toks, n, st = generate(model, PROMPTS, jnp.asarray(LENGTHS), 6,
                         buffer_len=L, precision=pol, return_state=True)
  assert toks.shape == (B, 6) and np.all(np.asarray(n) == 6)
  assert st.precision == pol
  ssm = st.layers[0].ssm
  assert ssm.checkpoint.dtype == jnp.bfloat16
  # prefill counts the prompt, each of the 6 generated tokens but the last
  # was decoded.
  np.testing.assert_array_equal(ssm.step, np.array(LENGTHS) + 6)


# ----------------------------------------------------------- speculative
def test_speculative_path_refuses_non_plain_baseline_policies(model):
  lengths = jnp.asarray(LENGTHS)
  state = model.init_state(B, MAX_LEN, ssm_mode="baseline", buffer_len=8,
                           precision=PrecisionPolicy.preset("f32+fp8+sr"))
  with pytest.raises(ValueError, match="precision 'f32\\+fp8\\+sr'.* "
                     "baseline state"):
    verify(model, PROMPTS[:, :3], state)
  with pytest.raises(ValueError, match="precision 'bf16\\+sr'"):
    speculative_generate(model, NgramProposer(), PROMPTS, lengths, 8, 3,
                         ssm_mode="baseline", buffer_len=8,
                         precision=PrecisionPolicy.preset("bf16+sr"))


def test_speculative_path_takes_replay_policies(model):
  """Replay states verify and commit under any policy: after the same
  prefill, the window logits are within the policy's lowest storage
  tolerance of the f32 ones (and differ: the copy is read); commit keeps
  the policy and advances the SR steps by the accepted tokens."""
  lengths = jnp.asarray(LENGTHS)
  win = CONT[:, :3]

  def prefilled(pol):
    st = model.init_state(B, MAX_LEN, buffer_len=8, precision=pol)
    return prefill(model, PROMPTS, lengths, st)[1]

  ref, _ = verify(model, win, prefilled(PrecisionPolicy.preset("f32")))
  for name in ("f32+int8", "f16+fp8+sr"):
    pol = PrecisionPolicy.preset(name)
    logits, pending = verify(model, win, prefilled(pol))
    testing.assert_close(logits, ref, testing.tolerance(
        pol.checkpoint_dtype, pol.read_dtype), name)
    assert testing.max_rel_error(logits, ref) > 0, name
    steps = np.asarray(pending.state.layers[0].ssm.step)  # commit donates
    committed = commit(pending, jnp.array([3, 1, 2]))
    assert committed.precision == pol
    ssm = committed.layers[1].ssm
    assert ssm.read_copy.dtype == jnp.dtype(pol.read_dtype)
    if pol.stochastic_rounding:
      np.testing.assert_array_equal(ssm.step, steps + [3, 1, 2])


def test_speculative_generate_with_stochastic_rounding(model):
  """speculative_generate under f32+int8+sr: reproducible token for token;
  its final SR steps count the tokens in the state (positions: prompt +
  generated but the last), as generate's do."""
  pol = PrecisionPolicy.preset("f32+int8+sr").replace(seed=4)
  lengths = jnp.asarray(LENGTHS)
  kw = dict(buffer_len=8, precision=pol, return_state=True)
  a = speculative_generate(model, NgramProposer(), PROMPTS, lengths, 8, 3,
                           **kw)
  b = speculative_generate(model, NgramProposer(), PROMPTS, lengths, 8, 3,
                           **kw)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], 8)
  _, _, g_state = generate(model, PROMPTS, lengths, 8, **kw)
  np.testing.assert_array_equal(a[3].positions, np.array(LENGTHS) + 7)
  for i in (0, 1):
    np.testing.assert_array_equal(a[3].layers[i].ssm.step, a[3].positions)
    np.testing.assert_array_equal(g_state.layers[i].ssm.step,
                                  g_state.positions)
    assert a[3].layers[i].ssm.read_copy.dtype == jnp.int8


def test_speculative_path_keeps_a_plain_policy(model):
  """A plain policy ("bf16": bf16 master and buffers, round to nearest)
  goes through verify + commit and stays attached to the state."""
  pol = PrecisionPolicy.preset("bf16")
  state = model.init_state(B, MAX_LEN, buffer_len=8, precision=pol)
  # From the empty state (no prefill: one compilation less).
  logits, pending = verify(model, PROMPTS[:, 3:6], state)
  assert logits.shape == (B, 3, 64) and np.all(np.isfinite(logits))
  assert pending.state.precision == pol
  committed = commit(pending, jnp.array([3, 1, 2]))
  assert committed.precision == pol
  np.testing.assert_array_equal(committed.positions, [3, 1, 2])
  np.testing.assert_array_equal(committed.layers[0].ssm.count, [3, 1, 2])
  assert committed.layers[0].ssm.checkpoint.dtype == jnp.bfloat16


# ------------------------------------------------------------- bad args
def test_bad_precision_args_raise_clear_errors(model):
  pol = PrecisionPolicy.preset("f32+bf16")
  with pytest.raises(TypeError, match="precision must be a .*PrecisionPolicy"):
    model.init_state(B, 16, precision="f32+bf16")
  with pytest.raises(ValueError, match="checkpoint_dtype \\(bfloat16\\) "
                     "contradicts precision 'f32\\+bf16'"):
    model.init_state(B, 16, checkpoint_dtype=jnp.bfloat16, precision=pol)
  with pytest.raises(ValueError, match="buffer_dtype \\(float32\\) "
                     "contradicts"):
    model.init_state(B, 16, buffer_dtype=jnp.float32, precision=pol)
  # Agreeing dtypes are accepted (baseline: the policy's storage dtype).
  model.init_state(B, 16, checkpoint_dtype=jnp.float32,
                   buffer_dtype=jnp.bfloat16, precision=pol)
  model.init_state(B, 16, ssm_mode="baseline", checkpoint_dtype=jnp.bfloat16,
                   precision=pol)
  with pytest.raises(ValueError, match="checkpoint_dtype \\(float32\\) "
                     "contradicts .* baseline checkpoint_dtype is bfloat16"):
    model.init_state(B, 16, ssm_mode="baseline",
                     checkpoint_dtype=jnp.float32, precision=pol)
  with pytest.raises(ValueError, match="row_ids is only used with"):
    model.init_state(B, 16, row_ids=np.arange(B))
  with pytest.raises(ValueError, match="row_ids is only used with"):
    model.init_state(B, 16, precision=pol, row_ids=np.arange(B))
  sr = PrecisionPolicy.preset("f32+bf16").replace(stochastic_rounding=True)
  with pytest.raises(ValueError, match="row_ids"):
    model.init_state(B, 16, precision=sr, row_ids=np.arange(B + 1))
  with pytest.raises(TypeError, match="row_ids"):
    model.init_state(B, 16, precision=sr, row_ids=np.ones(B, np.float32))
  with pytest.raises(ValueError, match="seed"):
    PrecisionPolicy.preset("bf16+sr").replace(seed=-1)
  # The stored baseline step has only a reference implementation.
  state = model.init_state(B, MAX_LEN, ssm_mode="baseline", precision=sr)
  with pytest.raises(NotImplementedError, match="reference"):
    decode_step(model, PROMPTS[:, 0], state, implementation="pallas")
