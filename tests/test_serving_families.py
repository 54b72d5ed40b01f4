"""The serving engine on every model family the loaders take: each tiny
transformers checkpoint of tests/fixtures/hf (Mamba-2 hybrids with dense
or MoE MLPs and latent experts, Gated DeltaNet with gated attention,
Kimi Delta Attention with MLA) served from a pool in replay mode gives
transformers' greedy tokens; a request admitted into a slot poisoned with
NaN / inf / garbage gets `generate`'s tokens; speculative serving (n-gram
drafts) gives the same tokens for the families whose verify differs (MoE
routers, delta-rule layers, Kimi Delta Attention's gate bound), in replay
mode and, for Kimi Delta Attention, in baseline mode too."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replayssm_jax import models, serving
from replayssm_jax.models import hf
from tests.hf_common import fixture_dir
from tests.serving_common import greedy_tokens, poison

# Every case but the legacy config (the same checkpoint as nemotron_h).
FAMILIES = ("bamba", "granite_hybrid_dense", "granite_hybrid_moe",
            "kimi_linear", "nemotron_h", "nemotron_h_moe",
            "nemotron_h_moe_latent", "qwen3_5", "qwen3_5_moe", "qwen3_next")
SPECULATIVE = ("granite_hybrid_moe", "kimi_linear", "nemotron_h_moe_latent",
               "qwen3_5_moe", "qwen3_next")
L = 4


def load(name):
  d = fixture_dir(name)
  model = hf.from_pretrained(d)
  expected = np.load(os.path.join(d, "expected.npz"))
  return model, expected["input_ids"].astype(np.int32), expected["greedy"]


def serve(model, prompts, n, spec=None):
  """The prompts' first two through a 3-slot engine, then the third
  admitted into the free slot after it was poisoned -> {index: tokens}."""
  eng = serving.Engine(model, 3, 32, steps_per_dispatch=3, buffer_len=L,
                       speculative=spec)
  for i in range(2):
    eng.submit(serving.Request(i, prompts[i], n[i]))
  eng.dispatch()
  assert eng.slots[2] is None
  eng.pool = poison(eng.pool, 2)
  eng.submit(serving.Request(2, prompts[2], n[2]))
  return eng.run()


@pytest.mark.parametrize("name", FAMILIES)
def test_engine_gives_transformers_greedy_tokens(name):
  model, ids, greedy = load(name)
  prompts = [ids[0], ids[1], ids[0, :5]]
  want = {0: greedy[0].tolist(), 1: greedy[1].tolist(),
          2: greedy_tokens(model, prompts[2], 6, buffer_len=L)}
  assert serve(model, prompts, (8, 8, 6)) == want
  if name in SPECULATIVE:
    spec = serving.Speculation(models.NgramProposer(n=2), window=3)
    assert serve(model, prompts, (8, 8, 6), spec) == want


def test_kimi_delta_attention_speculates_from_baseline_states():
  """KDA layers verify from baseline states too (one snapshot per window
  position): speculative serving in baseline mode gives transformers'
  greedy tokens."""
  model, ids, greedy = load("kimi_linear")
  spec = serving.Speculation(models.NgramProposer(n=2), window=3)
  eng = serving.Engine(model, 2, 32, ssm_mode="baseline", speculative=spec)
  for i in range(2):
    eng.submit(serving.Request(i, ids[i], 8))
  assert eng.run() == {i: greedy[i].tolist() for i in range(2)}
