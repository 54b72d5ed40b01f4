"""Kimi Linear checkpoints: `from_pretrained` against transformers' outputs
(tests/fixtures/hf/kimi_linear: config.json, model.safetensors and
expected.npz with the prompt tokens, transformers' float32 logits and greedy
tokens), right-padded prompts, the published / runtime tensor names and
config forms, speculative verify windows from baseline and replay states,
and the refusals of what is not implemented."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from replayssm_jax import kda
from replayssm_jax import models
from replayssm_jax import testing
from replayssm_jax.models import hf, hf_kimi, hf_tensors
from replayssm_jax.models.states import full_ssm_state
from tests.hf_common import FIXTURES, fixture_dir

FIXTURE = os.path.join(FIXTURES, "kimi_linear")
F32_TOL = testing.tolerance(jnp.float32)


def read_config():
  with open(os.path.join(FIXTURE, "config.json")) as f:
    return json.load(f)


@pytest.fixture(scope="module")
def loaded():
  fixture_dir("kimi_linear")
  return (hf.from_pretrained(FIXTURE),
          dict(np.load(os.path.join(FIXTURE, "expected.npz"))))


def rel_err(a, b):
  return np.abs(np.asarray(a) - b).max() / np.abs(b).max()


def test_full_forward_logits_equal_transformers(loaded):
  model, exp = loaded
  assert model.config.pattern == "K-*EKE"
  logits = np.asarray(model(jnp.asarray(exp["input_ids"])))
  assert logits.shape == exp["logits"].shape
  assert rel_err(logits, exp["logits"]) <= 1e-4


@pytest.mark.parametrize("ssm_mode,buffer_len", [("replay", 3),
                                                 ("replay", 16),
                                                 ("baseline", 4)])
def test_greedy_generate_equals_transformers(loaded, ssm_mode, buffer_len):
  """Prefill, then decode steps (replay buffer_len 3: flushes on the way;
  16: gates below its bound -80/15 flush rows early)."""
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  out, n = models.generate(model, jnp.asarray(ids),
                           jnp.full((ids.shape[0],), ids.shape[1]),
                           want.shape[1], ssm_mode=ssm_mode,
                           buffer_len=buffer_len)
  np.testing.assert_array_equal(np.asarray(out), want)
  np.testing.assert_array_equal(np.asarray(n), want.shape[1])


def test_decode_logits_follow_transformers_and_state_kinds(loaded):
  """Each replay decode step's logits equal the greedy step's logits of
  transformers; the KDA layers hold KDAReplayStates."""
  model, exp = loaded
  ids, greedy, want = exp["input_ids"], exp["greedy"], exp["greedy_logits"]
  b, t = ids.shape
  state = model.init_state(b, 32, ssm_mode="replay", buffer_len=4,
                           buffer_dtype=jnp.float32)
  kinds = [type(s.ssm).__name__ for s in state.layers
           if isinstance(s, models.GDNState)]
  assert kinds == ["KDAReplayState"] * 2
  assert state.layers[0].ssm.gate_lower_bound == kda.safe_gate_lower_bound(4)
  logits, state = models.prefill(model, jnp.asarray(ids),
                                 jnp.full((b,), t), state)
  for i in range(greedy.shape[1]):
    assert rel_err(logits, want[:, i]) <= 1e-4, f"step {i}"
    logits, state = models.decode_step(model, jnp.asarray(greedy[:, i]),
                                       state)


def test_right_padded_prompts_match_their_own_full_forward(loaded):
  """Row 1's prompt cut to 5 tokens (right padding): prefill and one decode
  step give the logits of the unpadded sequences (transformers' causal
  logits, then one full forward)."""
  model, exp = loaded
  ids = exp["input_ids"]
  lengths = np.array([8, 5])
  state = model.init_state(2, 16, ssm_mode="replay", buffer_len=3)
  last, state = models.prefill(model, jnp.asarray(ids), jnp.asarray(lengths),
                               state)
  for r, n in enumerate(lengths):
    assert rel_err(last[r], exp["logits"][r, n - 1]) <= 1e-4, f"row {r}"
  nxt = np.asarray(jnp.argmax(last, -1))
  logits, _ = models.decode_step(model, jnp.asarray(nxt), state)
  seq = np.concatenate([ids, ids[:, :1]], 1)  # row 1 past 6: causal filler
  seq[np.arange(2), lengths] = nxt
  full = np.asarray(model(jnp.asarray(seq)))
  for r, n in enumerate(lengths):
    assert rel_err(logits[r], full[r, n]) <= 1e-4, f"decode row {r}"


def runtime_names(tensors):
  """The fixture's tensors under transformers' runtime names (mlp.*,
  forget_gate.*, one conv1d, stacked experts)."""
  out = {}
  for name, arr in tensors.items():
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for n in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
      name = name.replace(f".self_attn.{n}", f".self_attn.forget_gate.{n}")
    out[name] = arr
  for i in (0, 2):
    p = f"model.layers.{i}.self_attn."
    out[p + "conv1d.weight"] = np.concatenate(
        [out.pop(p + f"{c}_conv1d.weight") for c in "qkv"], 0)
  for i in (1, 2):
    p = f"model.layers.{i}.mlp.experts."
    w = {k: np.stack([out.pop(f"{p}{e}.{k}.weight") for e in range(4)])
         for k in ("w1", "w2", "w3")}
    out[p + "gate_up_proj"] = np.concatenate([w["w1"], w["w3"]], 1)
    out[p + "down_proj"] = w["w2"]
  return out


def test_runtime_tensor_names_load_the_same_model(loaded):
  model, exp = loaded
  tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
  cfg = model.config
  other = hf_tensors.load_tensors(
      cfg, hf_kimi.pack_tensors(cfg, runtime_names(tensors)),
      hf_kimi.tensor_map(cfg))
  ids = jnp.asarray(exp["input_ids"])
  np.testing.assert_array_equal(np.asarray(other(ids)),
                                np.asarray(model(ids)))


def test_published_config_form():
  """linear_attn_config (1-indexed layer lists, head_dim, num_heads,
  short_conv_kernel_size) and first_k_dense_replace give the same config."""
  want, _ = hf.config_from_hf(read_config())
  c = read_config()
  for k in ("layer_types", "mlp_layer_types", "linear_head_dim",
            "linear_num_heads", "linear_conv_kernel_dim"):
    c.pop(k)
  c["linear_attn_config"] = dict(full_attn_layers=[2], kda_layers=[1, 3],
                                 head_dim=8, num_heads=2,
                                 short_conv_kernel_size=4)
  c["first_k_dense_replace"] = 1
  got, arch = hf.config_from_hf(c)
  assert arch == "KimiLinearForCausalLM" and got == want
  assert want.attention_multiplier == pytest.approx(12 ** -0.5)
  assert want.attn_head_dim == 12 and want.mla_kv_lora_rank == 16
  assert want.n_group == 2 and want.routed_scaling_factor == 2.446
  c.pop("architectures")
  assert hf.config_from_hf(c)[1] == "KimiLinearForCausalLM"


@pytest.mark.parametrize("key,value,match", [
    ("q_lora_rank", 8, "q_lora_rank"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("layer_types", ["linear_attention"] * 2, "layer_types"),
    ("mlp_layer_types", ["dense", "moe", "dense"], "mlp_layer_types"),
])
def test_unsupported_configs_are_refused(key, value, match):
  c = read_config()
  c[key] = value
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(c)


def test_missing_and_misshapen_tensors_are_named(loaded):
  model, _ = loaded
  cfg = model.config
  tensors = load_file(os.path.join(FIXTURE, "model.safetensors"))
  t = dict(tensors)
  del t["model.layers.1.self_attn.kv_b_proj.weight"]
  with pytest.raises(ValueError, match="kv_b_proj"):
    hf_tensors.load_tensors(cfg, hf_kimi.pack_tensors(cfg, t),
                            hf_kimi.tensor_map(cfg))
  t = dict(tensors)
  del t["model.layers.0.self_attn.g_a_proj.weight"]
  with pytest.raises(ValueError, match="g_a_proj"):
    hf_tensors.load_tensors(cfg, hf_kimi.pack_tensors(cfg, t),
                            hf_kimi.tensor_map(cfg))
  t = dict(tensors)
  t["model.layers.2.self_attn.dt_bias"] = np.zeros((15,), np.float32)
  with pytest.raises(ValueError, match="dt_bias"):
    hf_tensors.load_tensors(cfg, hf_kimi.pack_tensors(cfg, t),
                            hf_kimi.tensor_map(cfg))


@pytest.mark.parametrize("ssm_mode,buffer_len", [("baseline", None),
                                                 ("replay", 4),
                                                 ("replay", 16)])
def test_verify_window_equals_decode_steps(loaded, ssm_mode, buffer_len):
  """A KDA model's verify window: logits == stepping decode_step over the
  window, and commit after n tokens == the KDA layers' states (replay:
  materialized; buffer_len 4: early flushes; 16: gates below its bound
  -80/15, whose rows commit by a refold), the conv states and the KV
  lengths n decode steps reach."""
  model, exp = loaded
  ids, greedy = jnp.asarray(exp["input_ids"]), exp["greedy"]
  kw = {} if buffer_len is None else dict(buffer_len=buffer_len)
  state = model.init_state(2, 32, ssm_mode=ssm_mode, **kw)
  _, state = models.prefill(model, ids, jnp.full((2,), ids.shape[1]), state)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the ops donate
  # Two windows in turn, each verified from the state the last commit left.
  for start, n in ((0, 3), (3, 1), (4, 2)):
    window = jnp.asarray(greedy[:, start:start + 3])
    step_state, states, step_logits = copy(state), [], []
    for i in range(3):
      out, step_state = models.decode_step(model, window[:, i], step_state)
      step_logits.append(out)
      states.append(copy(step_state))
    logits, pending = models.verify(model, window, copy(state))
    for i in range(3):
      testing.assert_close(logits[:, i], step_logits[i], F32_TOL,
                           f"logits {i} of the window at {start}")
    got, want = models.commit(pending, jnp.full((2,), n)), states[n - 1]
    np.testing.assert_array_equal(got.positions, want.positions)
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
      where = f"layer {i}, window at {start}, n {n}"
      if isinstance(a, models.GDNState):  # KDA: conv and SSM state
        np.testing.assert_allclose(a.conv, b.conv, rtol=1e-6, atol=1e-6,
                                   err_msg=where)
        testing.assert_close(full_ssm_state(a.ssm), full_ssm_state(b.ssm),
                             F32_TOL, where)
      elif isinstance(a, models.AttentionState):  # entries past length:
        np.testing.assert_array_equal(a.length, b.length)  # rejected ones
    state = got


@pytest.mark.parametrize("ssm_mode", ["baseline", "replay"])
def test_speculative_generate_equals_transformers(loaded, ssm_mode):
  """Speculative decoding of the KDA model (the model as its own draft,
  every draft accepted, and an n-gram proposer) gives transformers' greedy
  tokens, from a baseline state and from a replay state (buffer_len 16:
  windows whose gates leave the bound commit by a refold)."""
  model, exp = loaded
  ids, want = exp["input_ids"], exp["greedy"]
  kw = dict(buffer_len=16) if ssm_mode == "replay" else {}
  for proposer in (models.DraftModelProposer(model),
                   models.NgramProposer(n=2)):
    out, n, stats = models.speculative_generate(
        model, proposer, jnp.asarray(ids), jnp.full((2,), ids.shape[1]),
        want.shape[1], 3, ssm_mode=ssm_mode, **kw)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(n), want.shape[1])
    if isinstance(proposer, models.DraftModelProposer):  # drafts = target
      assert float(stats.mean_accepted_length) > 2.0


def _follow_transformers(model, exp, state, tol):
  """Prefill the fixture's prompts into `state`, then decode its greedy
  tokens; each step's logits within `tol` of transformers' (relative to
  their scale) -> the final state."""
  ids, greedy, want = exp["input_ids"], exp["greedy"], exp["greedy_logits"]
  logits, state = models.prefill(model, jnp.asarray(ids), jnp.full((2,), 8),
                                 state)
  for i in range(greedy.shape[1]):
    assert rel_err(logits, want[:, i]) <= tol, f"step {i}"
    logits, state = models.decode_step(model, jnp.asarray(greedy[:, i]),
                                       state)
  return state


def test_replay_under_a_precision_policy_stays_close(loaded):
  """A bf16 read copy and bf16 rings (PrecisionPolicy "f32+bf16"): every
  decode step's logits stay within bf16 rounding of transformers'."""
  from replayssm_jax import PrecisionPolicy  # pylint: disable=g-import-not-at-top
  model, exp = loaded
  state = model.init_state(2, 32, ssm_mode="replay", buffer_len=4,
                           precision=PrecisionPolicy.preset("f32+bf16"))
  r = state.layers[0].ssm
  assert r.read_copy.dtype == jnp.bfloat16 and r.k_buf.dtype == jnp.bfloat16
  _follow_transformers(model, exp, state, 1e-2)


def test_baseline_stored_per_policy_stays_close(loaded):
  """A baseline state stored every step in int8 with stochastic rounding
  (PrecisionPolicy "f32+int8+sr": `states.StoredSSMState`, per-row scales):
  every decode step's logits within 5e-2 of transformers' logit scale
  (observed up to 1.9e-2: each store errs by up to a 254th of its row's
  largest entry), the steps counted."""
  from replayssm_jax import PrecisionPolicy  # pylint: disable=g-import-not-at-top
  model, exp = loaded
  state = model.init_state(2, 32, ssm_mode="baseline",
                           precision=PrecisionPolicy.preset("f32+int8+sr"),
                           row_ids=np.array([0, 1]))
  ssm = _follow_transformers(model, exp, state, 5e-2).layers[0].ssm
  assert isinstance(ssm, models.StoredSSMState) and ssm.dtype == jnp.int8
  np.testing.assert_array_equal(ssm.step, 8 + exp["greedy"].shape[1])
