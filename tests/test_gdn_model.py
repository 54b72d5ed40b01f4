"""Gated DeltaNet blocks ('G') in the hybrid LM, random weights: prefill +
decode steps == the full forward (replay and baseline states, right-padded
prompts, flushes), verify / commit == stepping, speculative greedy decoding
== generate, stale replay-buffer slots never read, and the state checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import models
from replayssm_jax import precision as P
from replayssm_jax import testing
from replayssm_jax.models.config import ModelConfig

CFG = ModelConfig(
    vocab_size=64, d_model=32, pattern="G-*EG-", conv_kernel=4,
    gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_dim=8, gdn_v_dim=8,
    gdn_chunk_size=4, num_heads=4, num_kv_heads=2, attn_head_dim=16,
    rotary_dim=4, attn_qk_norm=True, attn_output_gate=True,
    intermediate_size=48, mlp_activation="swiglu", n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True,
    moe_router="softmax", moe_router_bias=False, moe_activation="swiglu")
MODES = ("replay", "baseline")
TOL = dict(atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def model():
  return models.HybridLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def toks():
  return jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, 64)


@pytest.fixture(scope="module")
def full(model, toks):
  return np.asarray(model(toks))


def test_gdn_solve_reaches_the_chunked_prefill(toks, full):
  """ModelConfig.gdn_solve="inverse" (the chunk systems' inverses from
  matrix products): the default's logits within TOL."""
  cfg = dataclasses.replace(CFG, gdn_solve="inverse")
  inv = models.HybridLM(cfg, rngs=nnx.Rngs(0))  # the fixture's weights
  np.testing.assert_allclose(np.asarray(inv(toks)), full, **TOL)


def test_scan_precision_reaches_the_chunked_prefill(toks, full):
  """ModelConfig.scan_precision sets the GDN prefill's products: three
  bf16 passes give the default's logits within TOL (a CPU computes f32
  either way; a GPU's error: benchmarks/scripts/prefill_scan_cost.py)."""
  cfg = dataclasses.replace(CFG, scan_precision="BF16_BF16_F32_X3")
  x3 = models.HybridLM(cfg, rngs=nnx.Rngs(0))  # the fixture's weights
  np.testing.assert_allclose(np.asarray(x3(toks)), full, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_prefill_then_steps_equal_full_forward(model, toks, full, mode):
  """Prompts of 6 and 2 tokens (right-padded; 2 < conv_kernel - 1), then
  each row decodes its own continuation; buffer_len 3 flushes the replay
  state twice."""
  lengths = np.array([6, 2])
  state = model.init_state(2, 16, ssm_mode=mode, buffer_len=3)
  last, state = models.prefill(model, toks[:, :6], jnp.asarray(lengths),
                               state)
  got = [np.asarray(last)]
  for j in range(6):
    tok = toks[jnp.arange(2), jnp.asarray(lengths + j)]
    lg, state = models.decode_step(model, tok, state)
    got.append(np.asarray(lg))
  got = np.stack(got, 1)  # [2, 7, vocab]
  for r in range(2):
    want = full[r, lengths[r] - 1:lengths[r] + 6]
    np.testing.assert_allclose(got[r], want, **TOL)


def test_modes_agree_on_a_long_decode(model):
  """Replay (L = 4) and baseline decode the same greedy tokens."""
  prompt = jnp.arange(10).reshape(2, 5) % 64
  outs = [np.asarray(models.generate(model, prompt, jnp.array([5, 3]), 10,
                                     ssm_mode=m, buffer_len=4)[0])
          for m in MODES]
  np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("mode", MODES)
def test_verify_commit_equal_stepping(model, toks, full, mode):
  """A window of 3 tokens: its logits are the decode steps'; committing 1
  (row 0) and 3 (row 1) tokens then decoding continues as stepping."""
  state = model.init_state(2, 32, ssm_mode=mode, buffer_len=4)
  _, state = models.prefill(model, toks[:, :5], jnp.full((2,), 5), state)
  logits, pending = models.verify(model, toks[:, 5:8], state)
  np.testing.assert_allclose(np.asarray(logits), full[:, 5:8], **TOL)
  n = np.array([1, 3])
  state = models.commit(pending, jnp.asarray(n))
  for j in range(3):
    lg, state = models.decode_step(
        model, toks[jnp.arange(2), jnp.asarray(5 + n + j)], state)
    for r in range(2):
      np.testing.assert_allclose(np.asarray(lg)[r], full[r, 5 + n[r] + j],
                                 **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_speculative_greedy_equals_generate(model, mode):
  """With a different draft model (rejections happen), the model as its
  own draft (all accepted) and n-gram drafts."""
  prompt = (jnp.arange(12).reshape(2, 6) * 7) % 64
  lengths = jnp.array([6, 4])
  want = np.asarray(models.generate(model, prompt, lengths, 9,
                                    ssm_mode=mode, buffer_len=5)[0])
  draft = models.HybridLM(CFG, rngs=nnx.Rngs(5))
  for proposer in (models.DraftModelProposer(draft),
                   models.DraftModelProposer(model), models.NgramProposer(2)):
    out = models.speculative_generate(model, proposer, prompt, lengths, 9,
                                      3, ssm_mode=mode, buffer_len=5)[0]
    np.testing.assert_array_equal(np.asarray(out), want)


def test_stale_replay_slots_are_never_read(model, toks):
  """NaN in the replay buffers' unused slots (count 0 after prefill)
  changes no logit of the following steps."""
  state = model.init_state(2, 16, ssm_mode="replay", buffer_len=4)
  _, state = models.prefill(model, toks[:, :5], jnp.full((2,), 5), state)

  def poison(s):
    if not isinstance(s, models.GDNState):
      return s
    r = s.ssm
    return s.replace(ssm=r.replace(
        d_buf=jnp.full_like(r.d_buf, jnp.nan),
        k_buf=jnp.full_like(r.k_buf, jnp.nan),
        g_buf=jnp.full_like(r.g_buf, jnp.nan)))

  bad = jax.tree.map(lambda a: jnp.array(a, copy=True), state)  # donated
  bad = bad.replace(layers=tuple(poison(s) for s in bad.layers))
  for t in range(5, 9):
    want, state = models.decode_step(model, toks[:, t], state)
    got, bad = models.decode_step(model, toks[:, t], bad)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_state_of_another_model_is_refused(model, toks):
  for other, match in ((CFG.replace(pattern="*-GEG-"), r"layers\[0\]"),
                       (CFG.replace(gdn_v_dim=16), "gdn layer 0")):
    state = models.HybridLM(other, rngs=nnx.Rngs(0)).init_state(2, 16)
    with pytest.raises(ValueError, match=match):
      models.prefill(model, toks[:, :4], jnp.full((2,), 4), state)
  with pytest.raises(ValueError, match="buffer_len"):
    models.verify(model, toks[:, :4], model.init_state(2, 16, buffer_len=4))


@pytest.mark.parametrize("mode,preset", [
    ("replay", "f32+bf16"), ("replay", "bf16+sr"), ("baseline", "bf16")])
def test_precision_policies(model, toks, full, mode, preset):
  """Prefill, decode steps and a verify / commit under a policy stay close
  to the float32 forward; stochastic rounding repeats bit for bit."""
  policy = P.PrecisionPolicy.preset(preset)
  runs = []
  for _ in range(2 if policy.stochastic_rounding else 1):
    state = model.init_state(2, 32, ssm_mode=mode, buffer_len=3,
                             precision=policy)
    last, state = models.prefill(model, toks[:, :5], jnp.full((2,), 5),
                                 state)
    got = [np.asarray(last)]
    for t in range(5, 8):
      lg, state = models.decode_step(model, toks[:, t], state)
      got.append(np.asarray(lg))
    lg, pending = models.verify(model, toks[:, 8:10], state)
    state = models.commit(pending, jnp.array([2, 1]))
    got += [np.asarray(lg)[:, 0], np.asarray(lg)[:, 1]]
    runs.append(np.stack(got, 1))
    assert state.precision == policy
    ssm = state.layers[0].ssm
    assert (ssm.checkpoint if mode == "replay" else ssm).dtype == (
        policy.checkpoint_dtype)
  np.testing.assert_allclose(runs[0], full[:, 4:10], atol=5e-2, rtol=5e-2)
  for r in runs[1:]:
    np.testing.assert_array_equal(r, runs[0])


def _decode(model, toks, state, steps=3):
  """Prefill 5 tokens, then `steps` decode steps -> (logits [b, 1 + steps,
  vocab], state)."""
  last, state = models.prefill(model, toks[:, :5], jnp.full((2,), 5), state)
  got = [np.asarray(last)]
  for t in range(5, 5 + steps):
    lg, state = models.decode_step(model, toks[:, t], state)
    got.append(np.asarray(lg))
  return np.stack(got, 1), state


@pytest.mark.parametrize("preset", ["f32+fp8", "f32+int8+sr", "bf16+sr"])
def test_baseline_stored_per_policy(model, toks, full, preset):
  """A baseline state under a policy with an 8-bit read copy or stochastic
  rounding is stored every step as `baseline_storage_dtype` says
  (StoredSSMState: the read copy's dtype with its scales, the rounding
  keyed by row and step): within 2e-2 of the float32 forward's logit
  scale over a prefill and 3 decode steps (observed 3.4e-3 with fp8, 9e-4
  int8+sr, 6e-4 bf16+sr) but not equal to it; stochastic rounding repeats
  bit for bit and counts the tokens; the speculative path refuses it."""
  policy = P.PrecisionPolicy.preset(preset)
  dtype = jnp.dtype(policy.read_dtype or policy.checkpoint_dtype)
  runs = []
  for _ in range(2 if policy.stochastic_rounding else 1):
    ids = np.array([4, 9]) if policy.stochastic_rounding else None
    state = model.init_state(2, 32, ssm_mode="baseline", precision=policy,
                             row_ids=ids)
    logits, state = _decode(model, toks, state)
    runs.append(logits)
  err = testing.max_rel_error(runs[0], full[:, 4:8])
  assert 0 < err < 2e-2, err
  for r in runs[1:]:
    np.testing.assert_array_equal(r, runs[0])
  assert state.precision == policy
  ssm = state.layers[0].ssm
  assert isinstance(ssm, models.StoredSSMState) and ssm.dtype == dtype
  if dtype.name in P.QUANTIZED_DTYPES:
    assert ssm.scale.shape == ssm.state.shape[:3]  # per (row, head, key)
  else:
    assert ssm.scale is None
  if policy.stochastic_rounding:
    np.testing.assert_array_equal(ssm.step, [8, 8])
    np.testing.assert_array_equal(ssm.row_id, [4, 9])
  with pytest.raises(ValueError, match="baseline state"):
    models.verify(model, toks[:, 8:10], state)


def test_stored_baseline_steps_slots_in_place(model, toks):
  """A stored baseline pool stepped through slots (`rows`, here the two
  rows swapped) gives each slot what the batch step gives that row."""
  policy = P.PrecisionPolicy.preset("f32+int8+sr")
  pool = model.init_state(2, 32, ssm_mode="baseline", precision=policy,
                          row_ids=np.array([0, 1]))
  _, pool = models.prefill(model, toks[:, :5], jnp.full((2,), 5), pool)
  want, batch = model.step(toks[:, 5], pool)
  got, slots = model.step(toks[::-1, 5], pool, rows=jnp.array([1, 0]))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[::-1])
  for a, b in zip(jax.tree.leaves(slots.layers[0].ssm),
                  jax.tree.leaves(batch.layers[0].ssm)):
    np.testing.assert_array_equal(a, b)
  assert not np.array_equal(batch.layers[0].ssm.state,
                            pool.layers[0].ssm.state)


@pytest.mark.parametrize("field,value,match", [
    ("gdn_num_k_heads", 3, "gdn_num_k_heads"),
    ("gdn_k_dim", 0, "gdn_k_dim"),
    ("attn_output_gate", 1, "attn_output_gate"),
    ("moe_router", "softmax_all", "moe_router"),
    ("gdn_solve", "cholesky", "gdn_solve"),
])
def test_bad_gdn_fields_name_the_field(field, value, match):
  with pytest.raises((ValueError, TypeError), match=match):
    CFG.replace(**{field: value})
