"""Speculative sampling of the hybrid LM (replayssm_jax.models.speculative).

* `accept` makes the same decisions as its materialized form (the full
  [batch, T, vocab] distribution) with the same rng;
* speculative sampling reproduces the target's distribution (chi-square on
  a 4-token vocabulary, draft-model and deterministic drafts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

from replayssm_jax.models import (DraftModelProposer, Proposal, Proposer,
                                  speculative_generate)
from replayssm_jax.models.generate import sampling_probs, sampling_settings
from tests.model_spec_common import (  # noqa: F401  (fixtures)
    SMALL_VOCAB, full_logits, small_models)
from tests.test_models import random_tokens


SAMPLES = 4000


@jax.tree_util.register_pytree_node_class
class HalfRandomProposer(Proposer):
  """Test proposer: the first half of the rows use a DraftModelProposer
  (sampled drafts, q = the draft's distribution); the second half propose
  0 to T-1 uniformly random tokens as a deterministic proposal (q one-hot
  at the drafts, as for n-gram drafts)."""

  def __init__(self, inner):
    self.inner = inner

  def tree_flatten(self):
    return (self.inner,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)

  def validate(self, target, **kw):
    self.inner.validate(target, **kw)

  def init(self, prompt_tokens, prompt_lengths, **kw):
    return self.inner.init(prompt_tokens, prompt_lengths, **kw)

  def propose(self, pstate, ctx, window, rng, sampling):
    prop, pstate = self.inner.propose(pstate, ctx, window, rng, sampling)
    b = ctx.last.shape[0]
    k1, k2 = jax.random.split(jax.random.fold_in(rng, 1))
    drafts = jax.random.randint(k1, (b, window - 1), 0, SMALL_VOCAB)
    nd = jax.random.randint(k2, (b,), 0, window)
    rand = (jnp.arange(b) >= b // 2)[:, None]
    drafts = jnp.where(rand, drafts, prop.drafts)
    q = jnp.where(rand[..., None], jax.nn.one_hot(drafts, SMALL_VOCAB),
                  prop.q)
    return Proposal(drafts, jnp.where(rand[:, 0], nd, prop.num_drafts),
                    q), pstate

  def update(self, pstate, ctx, window_tokens, num_accepted, active):
    return self.inner.update(pstate, ctx, window_tokens, num_accepted,
                             active)


def _chi_square(counts, probs, n):
  """(statistic, 1 - 1e-4 quantile) of a goodness-of-fit test; cells with
  expected count < 5 are pooled into one."""
  expected = probs * n
  big = expected >= 5
  obs, exp = counts[big], expected[big]
  if expected[~big].sum() > 0:
    obs = np.append(obs, counts[~big].sum())
    exp = np.append(exp, expected[~big].sum())
  chi2 = float(((obs - exp) ** 2 / exp).sum())
  return chi2, float(scipy_stats.chi2.ppf(1 - 1e-4, len(exp) - 1))


def _accept_materialized(logits, drafts, num_drafts, q, sampling, rng):
  """`accept` as first written: both acceptances computed, the target's
  distribution p materialized over [batch, T, vocab] (the reference of the
  leaner `accept`)."""
  b, t, vocab = logits.shape
  t1 = t - 1
  valid = jnp.arange(t1)[None, :] < num_drafts[:, None]
  rows = jnp.arange(b)
  accepted = lambda ok: jnp.sum(jnp.cumprod(ok.astype(jnp.int32), 1), 1)
  top = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  a_greedy = accepted((drafts == top[:, :t1]) & valid)
  p = sampling_probs(logits, *sampling)
  k_u, k_s = jax.random.split(rng)
  qf = jax.nn.one_hot(drafts, vocab) if q is None else q
  pd = jnp.take_along_axis(p[:, :t1], drafts[..., None], -1)[..., 0]
  qd = jnp.take_along_axis(qf, drafts[..., None], -1)[..., 0]
  u = jax.random.uniform(k_u, (b, t1), jnp.float32)
  a_samp = accepted((u * qd < pd) & valid)
  p_a = p[rows, a_samp]
  resid = jnp.maximum(p_a - qf[rows, jnp.minimum(a_samp, t1 - 1)], 0.0)
  z = jnp.sum(resid, axis=-1, keepdims=True)
  rejected = (a_samp < num_drafts)[:, None] & (z > 0)
  dist = jnp.where(rejected, resid / jnp.where(z > 0, z, 1.0), p_a)
  next_samp = jax.random.categorical(k_s, jnp.log(dist), axis=-1)
  greedy = sampling[0]
  return (jnp.where(greedy, a_greedy, a_samp),
          jnp.where(greedy, top[rows, a_greedy], next_samp))


@pytest.mark.parametrize("temperature,top_k,top_p,with_q", [
    (0.0, None, None, False),  # greedy
    (0.8, None, None, True),
    (1.5, None, None, False),  # one-hot drafts (q None)
    (1.0, 5, None, True),
    (1.0, None, 0.7, True),
])
def test_accept_equals_materialized_reference(temperature, top_k, top_p,
                                              with_q):
  """The leaner `accept` (no [batch, T, vocab] distribution) makes the
  same decisions as the materialized form, row for row, with the same rng:
  512 rows of random logits, drafts biased towards the target's likely
  tokens (so several accepted counts occur), ragged num_drafts with 0 and
  T-1."""
  from replayssm_jax.models.speculative import accept  # pylint: disable=g-import-not-at-top
  b, t, vocab = 512, 4, 32
  k = jax.random.split(jax.random.PRNGKey(11), 5)
  logits = 2.0 * jax.random.normal(k[0], (b, t, vocab))
  likely = jnp.argmax(logits[:, :t - 1] + jax.random.gumbel(
      k[1], (b, t - 1, vocab)), axis=-1).astype(jnp.int32)
  drafts = jnp.where(jax.random.uniform(k[2], (b, t - 1)) < 0.8, likely,
                     jax.random.randint(k[3], (b, t - 1), 0, vocab))
  num_drafts = jnp.arange(b, dtype=jnp.int32) % t  # 0 .. T-1
  q = (jax.nn.softmax(jax.random.normal(k[4], (b, t - 1, vocab)), -1)
       if with_q else None)
  sampling = sampling_settings(temperature, top_k, top_p, None,
                               jax.random.PRNGKey(5))
  rng = jax.random.PRNGKey(7)
  a, nxt = jax.jit(accept)(logits, drafts, num_drafts, q, sampling, rng)
  a_ref, nxt_ref = jax.jit(_accept_materialized)(logits, drafts, num_drafts,
                                                 q, sampling, rng)
  np.testing.assert_array_equal(a, a_ref)
  np.testing.assert_array_equal(nxt, nxt_ref)
  assert a.dtype == nxt.dtype == jnp.int32
  # Several accepted counts occur (with one-hot q at temperature 1.5 a
  # draft is accepted with probability p(d) only, so T-1 may not).
  assert len(np.unique(np.asarray(a))) >= t - 1
  assert np.all(np.asarray(a) <= np.asarray(num_drafts))


def test_sampling_matches_target_distribution(small_models):
  """Three tokens sampled with window 3 from a 4-token vocabulary, 4000
  rows (independent samples; 2000 with draft-model drafts, 2000 with random
  deterministic drafts), two sampling settings: the empirical joint
  distribution of the 64 outcomes vs the exact target distribution
  (products of the target's conditionals after temperature / top-k / top-p,
  from full forward passes). Chi-square goodness of fit at significance
  1e-4 per (setting, proposer): with a random seed the test would fail by
  chance with probability <= 4e-4 in all (the seeds are fixed, so it is
  deterministic). Both acceptance branches are exercised (acceptance
  length strictly between 1 and the window for each proposer)."""
  target, draft_model = small_models
  v, plen, new, window = SMALL_VOCAB, 5, 3, 3
  proposer = HalfRandomProposer(DraftModelProposer(draft_model))
  prompt = random_tokens(50, (1, plen), v)
  seqs = np.array([[a, b] for a in range(v) for b in range(v)], np.int32)
  full = full_logits(*nnx.split(target), jnp.concatenate(
      [jnp.tile(prompt, (len(seqs), 1)), jnp.asarray(seqs)], 1))
  half = SAMPLES // 2
  for si, setting in enumerate([dict(temperature=1.0),
                                dict(temperature=0.8, top_k=3, top_p=0.9)]):
    sampling = sampling_settings(setting["temperature"],
                                 setting.get("top_k"), setting.get("top_p"),
                                 None, jax.random.PRNGKey(0))
    p = np.asarray(sampling_probs(full, *sampling), np.float64)
    exact = np.einsum("a,ab,abc->abc", p[0, plen - 1], p[::v, plen],
                      p[:, plen + 1].reshape(v, v, v)).ravel()
    out, n, stats = speculative_generate(
        target, proposer, jnp.tile(prompt, (SAMPLES, 1)),
        jnp.full((SAMPLES,), plen, jnp.int32), new, window,
        rng=jax.random.PRNGKey(7 + si), **setting)
    np.testing.assert_array_equal(n, new)
    o = np.asarray(out)
    idx = (o[:, 0] * v + o[:, 1]) * v + o[:, 2]
    acc = np.asarray(stats.accepted_drafts)
    steps = np.asarray(stats.verify_steps)
    for name, rows in (("draft", slice(0, half)), ("random", slice(half,
                                                                   None))):
      counts = np.bincount(idx[rows], minlength=v ** 3)
      assert counts[exact == 0].sum() == 0, (setting, name, "impossible")
      chi2, limit = _chi_square(counts, exact, half)
      assert chi2 < limit, (setting, name, chi2, limit)
      mean_len = (acc[rows] + steps[rows]).sum() / steps[rows].sum()
      assert 1.0 < mean_len < window, (setting, name, mean_len)
