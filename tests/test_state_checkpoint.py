"""Saving, restoring and resuming a decode state (models.checkpointing,
models.generate_from_state).

A tiny hybrid model (Mamba-2, attention, MLP and, where its baseline state
allows the policy, Gated DeltaNet blocks) with random weights; ragged
right-padded prompts; generate N1 + N2 tokens uninterrupted, then the
state after N1 - 1 of them (prefill + decode steps), save it, restore it
onto a fresh template and resume for the rest.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("orbax.checkpoint")

from replayssm_jax import PrecisionPolicy  # pylint: disable=g-import-not-at-top
from replayssm_jax.models import (HybridLM, ModelConfig, commit, generate,
                                  generate_from_state, prefill,
                                  restore_state, save_state, verify)
from replayssm_jax.models import checkpointing
from replayssm_jax.models.states import kv_cache_len

CFG = dict(vocab_size=64, d_model=32, ssm_heads=4, head_dim=8, d_state=8,
           n_groups=2, conv_kernel=4, chunk_size=8, num_heads=4,
           num_kv_heads=2, attn_head_dim=8, intermediate_size=48,
           gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_dim=8, gdn_v_dim=8,
           gdn_chunk_size=8)
B, T, L = 3, 8, 4
LENGTHS = (8, 3, 6)
# Resume after N1 tokens for N2 more. Both generate_from_state calls below
# (the first N1 - 1 decode steps, then the resumed run) take K tokens: one
# compilation.
N1, N2 = 7, 5
K = N1 - 1
assert K == N2 + 1
MAX_LEN = kv_cache_len(T + N1 + N2)  # generate's own cache length
PROMPTS = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 64, jnp.int32)

_MODELS = {}


def model_for(pattern):
  if pattern not in _MODELS:
    cfg = ModelConfig(pattern=pattern, **CFG)
    graphdef = nnx.graphdef(nnx.eval_shape(
        lambda: HybridLM(cfg, rngs=nnx.Rngs(0))))
    params = jax.jit(lambda: nnx.state(HybridLM(cfg, rngs=nnx.Rngs(0))))()
    _MODELS[pattern] = nnx.merge(graphdef, params)
  return _MODELS[pattern]


def state_kwargs(preset):
  return {} if preset is None else dict(
      precision=PrecisionPolicy.preset(preset))


def assert_bits_equal(a, b):
  """Same leaf paths; each leaf of the same dtype, shape and bits."""
  la = jax.tree_util.tree_leaves_with_path(a)
  lb = jax.tree_util.tree_leaves_with_path(b)
  assert [p for p, _ in la] == [p for p, _ in lb]
  for (p, x), (_, y) in zip(la, lb):
    where = jax.tree_util.keystr(p)
    assert x.dtype == y.dtype, where
    assert x.shape == y.shape, where
    xb, yb = np.asarray(x), np.asarray(y)
    if xb.dtype != np.bool_:
      xb, yb = xb.view(np.uint8), yb.view(np.uint8)
    np.testing.assert_array_equal(xb, yb, err_msg=where)


CASES = [(mode, preset) for mode in ("replay", "baseline")
         for preset in (None, "f16", "f32+bf16", "f32+fp8", "f32+int8",
                        "f32+int8+sr")]


def save_restore_resume(model, tmp_path, sampling, eos_id=None, **kw):
  """generate N1 + N2 tokens; prefill and decode N1 - 1 of them; save,
  restore and resume -> (uninterrupted tokens, state and generate_from_state
  outputs after N1 - 1 tokens, restored state, resumed outputs)."""
  lengths = jnp.asarray(LENGTHS, jnp.int32)
  ref, _, ref_state = generate(model, PROMPTS, lengths, N1 + N2,
                               return_state=True, **sampling, **kw)
  ref = np.asarray(ref)
  state = model.init_state(B, MAX_LEN, **kw)
  _, state = prefill(model, PROMPTS, lengths, state)
  # Decode t_1..t_{N1-1}: the state holding them, and t_2..t_N1.
  head, _, state = generate_from_state(model, state, ref[:, 0], K,
                                       start_step=1, **sampling)
  np.testing.assert_array_equal(np.asarray(head), ref[:, 1:N1])
  np.testing.assert_array_equal(np.asarray(state.positions),
                                np.array(LENGTHS) + N1 - 1)
  path = tmp_path / "state"
  info = save_state(path, state)
  assert json.loads((path / checkpointing.TREE_FILE).read_text()) == info
  template = model.init_state(B, MAX_LEN, **kw)
  restored = restore_state(path, template)
  for x in jax.tree.leaves((state, template)):
    assert not x.is_deleted()  # nothing passed in was donated
  out = generate_from_state(model, restored, ref[:, N1 - 1], K,
                            start_step=N1, eos_id=eos_id, **sampling)
  return ref, ref_state, state, restored, out


@pytest.mark.parametrize("ssm_mode,preset", CASES)
def test_save_restore_resume_bit_exact(tmp_path, ssm_mode, preset):
  sampled = ssm_mode == "replay" and preset == "f32+int8+sr"
  sampling = (dict(temperature=1.0, rng=jax.random.PRNGKey(7)) if sampled
              else {})
  model = model_for("M*-G")
  ref, ref_state, state, restored, (out, n, final) = save_restore_resume(
      model, tmp_path, sampling, ssm_mode=ssm_mode, buffer_len=L,
      **state_kwargs(preset))
  assert_bits_equal(restored, state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  assert restored.precision == state.precision
  if ssm_mode == "replay":  # mid-buffer: replay counters not at 0
    counts = np.asarray(state.layers[0].ssm.count)
    assert (counts > 0).all(), counts
  # The resumed run's first N2 tokens are the uninterrupted run's tokens
  # N1.., and its state (holding all N1 + N2) is the uninterrupted run's
  # final state.
  np.testing.assert_array_equal(np.asarray(out)[:, :N2], ref[:, N1:])
  np.testing.assert_array_equal(np.asarray(n), np.full(B, K))
  assert_bits_equal(final, ref_state)
  assert not any(x.is_deleted() for x in jax.tree.leaves(restored))


def test_resume_after_eos(tmp_path):
  """A row whose pending token is eos_id stays stopped (eos_id, length 0);
  the other rows go on as before until they emit it."""
  sampling = dict(temperature=1.0, rng=jax.random.PRNGKey(7))
  model = model_for("M*-G")
  ref = np.asarray(generate(model, PROMPTS, jnp.asarray(LENGTHS), N1 + N2,
                            buffer_len=L, **sampling,
                            **state_kwargs("f32+int8+sr"))[0])
  eos = int(ref[1, N1 - 1])
  _, _, _, _, (out, n, _) = save_restore_resume(
      model, tmp_path, sampling, eos_id=eos, ssm_mode="replay",
      buffer_len=L, **state_kwargs("f32+int8+sr"))
  out, n = np.asarray(out), np.asarray(n)
  assert (out[1] == eos).all() and n[1] == 0
  for r in (0, 2):
    if ref[r, N1 - 1] != eos:
      stop = list(ref[r, N1:]).index(eos) + 1 if eos in ref[r, N1:] else K
      assert n[r] == min(stop, K)
      np.testing.assert_array_equal(out[r, :min(stop, N2)],
                                    ref[r, N1:N1 + min(stop, N2)])


def test_ragged_counters_resume(tmp_path):
  """Replay counters ragged across rows (a speculative commit of 3, 1 and 2
  window tokens): the restored state resumes exactly as the original."""
  model = model_for("M*-G")
  kw = dict(buffer_len=L, **state_kwargs("f32+int8+sr"))
  state = model.init_state(B, MAX_LEN, **kw)
  _, state = prefill(model, PROMPTS, jnp.asarray(LENGTHS), state)
  _, pending = verify(model, PROMPTS[:, ::-1][:, :3], state)
  state = commit(pending, jnp.array([3, 1, 2]))
  counts = np.asarray(state.layers[0].ssm.count)
  assert len(set(counts.tolist())) == B, counts
  save_state(tmp_path / "ragged", state)
  restored = restore_state(tmp_path / "ragged",
                           model.init_state(B, MAX_LEN, **kw))
  assert_bits_equal(restored, state)
  sampling = dict(temperature=1.0, rng=jax.random.PRNGKey(7))
  last = PROMPTS[:, 0]
  want = generate_from_state(model, state, last, K, start_step=4,
                             **sampling)
  got = generate_from_state(model, restored, last, K, start_step=4,
                            **sampling)
  assert_bits_equal(got, want)


def test_generate_from_state_refusals():
  model = model_for("M*-G")
  state = model.init_state(B, 16, buffer_len=L)
  last = jnp.zeros((B,), jnp.int32)
  with pytest.raises(ValueError, match="max_new_tokens.*max_len"):
    generate_from_state(model, state, last, 17)
  with pytest.raises(ValueError, match="start_step"):
    generate_from_state(model, state, last, 2, start_step=-1)
  with pytest.raises(ValueError, match="last_tokens"):
    generate_from_state(model, state, last[:, None], 2)


# ------------------------------------------------------------ refusals
def small_state(**kwargs):
  model = model_for("M*-G")
  args = dict(batch=B, max_len=16, buffer_len=L)
  return model.init_state(**{**args, **kwargs})


@pytest.fixture(name="saved")
def fixture_saved(tmp_path):
  path = tmp_path / "saved"
  save_state(path, small_state(precision=PrecisionPolicy.preset("f32+fp8")))
  return path


def test_refuses_wrong_shape(saved):
  template = small_state(batch=2,
                         precision=PrecisionPolicy.preset("f32+fp8"))
  with pytest.raises(ValueError, match=r"\.layers\[0\]\.conv.*shape"):
    restore_state(saved, template)


def test_refuses_wrong_dtype(saved):
  template = small_state(precision=PrecisionPolicy.preset("f32+int8"))
  with pytest.raises(ValueError,
                     match=r"\.layers\[0\]\.ssm\.read_copy.*dtype"):
    restore_state(saved, template)


def test_refuses_wrong_structure(saved):
  with pytest.raises(ValueError, match=r"structure.*\.layers\[0\]\.ssm"):
    restore_state(saved, small_state(ssm_mode="baseline"))
  with pytest.raises(ValueError, match=r"read_copy"):
    restore_state(saved, small_state(
        precision=PrecisionPolicy.preset("f32")))


def test_refuses_other_static_metadata(saved):
  policy = PrecisionPolicy.preset("f32+fp8").replace(seed=5)
  with pytest.raises(ValueError, match="static metadata"):
    restore_state(saved, small_state(precision=policy))


def test_refuses_missing_or_corrupt_directory(tmp_path, saved):
  template = small_state(precision=PrecisionPolicy.preset("f32+fp8"))
  missing = tmp_path / "nowhere"
  with pytest.raises(ValueError, match=str(missing)):
    restore_state(missing, template)
  (saved / checkpointing.TREE_FILE).write_text("{not json")
  with pytest.raises(ValueError, match=checkpointing.TREE_FILE):
    restore_state(saved, template)
  (saved / checkpointing.TREE_FILE).unlink()
  with pytest.raises(ValueError, match=f"{saved}.*missing"):
    restore_state(saved, template)


def test_refuses_missing_arrays(saved):
  template = small_state(precision=PrecisionPolicy.preset("f32+fp8"))
  arrays = saved / checkpointing.ARRAYS_DIR
  shutil.rmtree(arrays)
  with pytest.raises(ValueError, match=f"corrupt.*{arrays}"):
    restore_state(saved, template)


def test_refuses_to_overwrite(saved):
  state = small_state(precision=PrecisionPolicy.preset("f32+fp8"))
  with pytest.raises(ValueError, match=f"{saved}.*overwrite"):
    save_state(saved, state)
  save_state(saved, state, overwrite=True)
  assert_bits_equal(restore_state(saved, state), state)


def test_special_values_survive(tmp_path):
  """NaN payloads, infinities and -0.0 (stale buffer slots may hold them)
  in every float dtype, and bool / uint32 leaves, round-trip bit for bit
  (the sidecar records the stored unsigned-integer dtypes)."""
  state = small_state(precision=PrecisionPolicy.preset("f32+fp8"))
  stored_dtype = checkpointing._stored_dtype  # pylint: disable=protected-access

  def poison(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return x
    bits = jax.lax.bitcast_convert_type(x, stored_dtype(x.dtype))
    raw = (np.arange(bits.size, dtype=np.uint32) * np.uint32(2654435761))
    return jax.lax.bitcast_convert_type(jnp.asarray(raw.reshape(
        bits.shape).astype(bits.dtype)), x.dtype)
  state = jax.tree.map(poison, state)
  extra = state.replace(layers=state.layers + (
      {"flag": jnp.array([True, False, True]),
       "bits": jnp.array([0, 1, 2**32 - 1], jnp.uint32),
       "half": jnp.array([np.nan, -0.0, np.inf], jnp.float16)},))
  info = save_state(tmp_path / "s", extra)
  stored = {d["dtype"]: d["stored_dtype"] for d in info["leaves"]}
  assert stored["float8_e4m3fn"] == "uint8" and stored["bool"] == "bool"
  assert stored["bfloat16"] == "uint16" and stored["uint32"] == "uint32"
  assert_bits_equal(restore_state(tmp_path / "s", extra), extra)
  assert os.path.isdir(tmp_path / "s" / checkpointing.ARRAYS_DIR)
