"""Shared set-up of the speculative-decoding tests of the hybrid LM: the
tiny config of tests/test_models.py, f32, ragged prompts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from replayssm_jax import testing
from tests.test_models import make_model, random_tokens

TOL = testing.TOLERANCES["float32"]
B, P = 3, 8
LENGTHS = (8, 3, 6)
VOCAB = 64
MAX_NEW, WINDOW, BUFFER_LEN = 24, 4, 8  # the decode-loop tests
SMALL_VOCAB = 4


@pytest.fixture(scope="module")
def model():
  return make_model(0)


@pytest.fixture(scope="module")
def draft():
  """A smaller, unrelated hybrid (Mamba + attention + MLP) draft."""
  return make_model(1, d_model=16, pattern="M*-", intermediate_size=24)


@pytest.fixture(scope="module")
def prompts():
  return random_tokens(40, (B, P)), jnp.asarray(LENGTHS, jnp.int32)


@pytest.fixture(scope="module")
def small_models():
  """A target and a draft over a 4-token vocabulary."""
  return (make_model(5, vocab_size=SMALL_VOCAB),
          make_model(6, vocab_size=SMALL_VOCAB, d_model=16, pattern="M*"))


@functools.partial(jax.jit, static_argnums=(0,))
def full_logits(graphdef, params, tokens):
  """The full forward of the model split into (graphdef, params)."""
  return nnx.merge(graphdef, params)(tokens)
