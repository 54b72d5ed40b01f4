"""Speculative decoding of the hybrid LM (replayssm_jax.models.speculative).

* `verify` logits == stepping `decode_step` over the window; `commit(n)`
  == the state after n steps (replay and baseline modes);
* property test: random acceptance over many windows (ragged rows, 1 and T
  accepted included); after each commit the state equals a fresh prefill of
  the accepted stream and every verified position's logits equal a full
  forward over it;
* greedy `speculative_generate` == greedy `generate` token for token, for
  both SSM modes and both proposers, and with scripted drafts forcing 0
  accepted, all accepted, partial and no drafts (stats checked against a
  simulation of the script), eos handling, one compilation per shape;
* `accept` makes the same decisions as its materialized form (the full
  [batch, T, vocab] distribution) with the same rng;
* speculative sampling reproduces the target's distribution (chi-square on
  a 4-token vocabulary, draft-model and deterministic drafts);
* bad inputs raise clear errors.

The tiny config of tests/test_models.py; f32; ragged prompts throughout.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as scipy_stats

from replayssm_jax import materialize, testing
from replayssm_jax.models import (DraftModelProposer, MambaState,
                                  NgramProposer, PendingState, Proposal,
                                  ProposalContext, Proposer, commit,
                                  decode_step, prefill, speculative_generate,
                                  verify)
from replayssm_jax.models import model as M
from replayssm_jax.models.generate import (generate, sampling_probs,
                                           sampling_settings)
from replayssm_jax.models.states import AttentionState, kv_cache_len
from tests.test_models import make_model, random_tokens

TOL = testing.TOLERANCES["float32"]
B, P = 3, 8
LENGTHS = (8, 3, 6)
VOCAB = 64


@pytest.fixture(scope="module")
def model():
  return make_model(0)


@pytest.fixture(scope="module")
def draft():
  """A smaller, unrelated hybrid (Mamba + attention + MLP) draft."""
  return make_model(1, d_model=16, pattern="M*-", intermediate_size=24)


def _mamba_A(model):
  return {i: -jnp.exp(blk.mixer.A_log[...].astype(jnp.float32))
          for i, blk in enumerate(model.blocks) if blk.kind == "mamba"}


# -------------------------------------------------------- verify / commit
T_VERIFY, WINDOWS, L_VERIFY = 4, 7, 6  # L: replay buffer_len
WIDTH = P + WINDOWS * T_VERIFY  # KV room of the verify tests


def _assert_states_close(actual, expected, model, what):
  """Committed states agree: positions, conv, materialized SSM state, KV
  cache up to each row's length."""
  np.testing.assert_array_equal(actual.positions, expected.positions,
                                err_msg=what)
  A = _mamba_A(model)
  for i, (sa, se) in enumerate(zip(actual.layers, expected.layers)):
    if isinstance(sa, MambaState):
      # The same inputs, whatever slot each ring holds them in.
      testing.assert_close(sa.ordered_conv(), se.ordered_conv(), TOL,
                           f"{what}: conv layer {i}")
      mat = lambda s: (materialize(s, A[i]) if not isinstance(s, jax.Array)
                       else s)
      testing.assert_close(mat(sa.ssm), mat(se.ssm), TOL,
                           f"{what}: SSM state layer {i}")
    elif isinstance(sa, AttentionState):
      np.testing.assert_array_equal(sa.length, se.length, err_msg=what)
      for r, n in enumerate(np.asarray(se.length)):
        testing.assert_close(sa.k[r, :, :n], se.k[r, :, :n], TOL,
                             f"{what}: keys layer {i} row {r}")
        testing.assert_close(sa.v[r, :, :n], se.v[r, :, :n], TOL,
                             f"{what}: values layer {i} row {r}")


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_verify_equals_stepwise_decode(model, ssm_mode):
  """Window logits == decode_step logits of the same tokens; committing n
  (1, T and in between, per row) == the state after n decode steps."""
  T = T_VERIFY
  prompts = random_tokens(20, (B, P))
  cont = random_tokens(21, (B, T))
  state = model.init_state(B, WIDTH, ssm_mode=ssm_mode, buffer_len=L_VERIFY)
  _, state = prefill(model, prompts, jnp.asarray(LENGTHS), state)
  logits, pending = verify(model, cont, _copy(state))  # both donate
  step_logits, steps = [], []
  for s in range(T):
    lg, state = decode_step(model, cont[:, s], state)
    step_logits.append(lg)
    steps.append(_copy(state))
  assert isinstance(pending, PendingState) and pending.window == T
  assert logits.shape == (B, T, VOCAB) and logits.dtype == jnp.float32
  testing.assert_close(logits, jnp.stack(step_logits, 1), TOL,
                       f"{ssm_mode} verify logits")
  n = np.array([1, T, 2])
  expected = jax.tree.map(lambda *a: jnp.stack(a)[n - 1, np.arange(B)],
                          *steps)
  _assert_states_close(commit(pending, jnp.asarray(n, jnp.int32)), expected,
                       model, f"{ssm_mode} commit {n}")


@functools.partial(jax.jit, static_argnums=(0,))
def _full_logits(graphdef, params, tokens):
  return nnx.merge(graphdef, params)(tokens)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_random_acceptance_equals_fresh_run_on_accepted_prefix(model,
                                                               ssm_mode):
  """Property test: 7 windows of T = 4 with random per-row acceptance
  (rounds forcing 1 and T for every row; buffer_len 6 so that replay rows
  flush early often). After every commit the state equals a fresh prefill
  of the accepted stream (SSM state materialized), and every verified
  window position that was accepted (the first one included: what the
  committed state predicts next) has the logits of a full forward pass
  over the accepted stream."""
  T, windows, L, width = T_VERIFY, WINDOWS, L_VERIFY, WIDTH
  rng = np.random.default_rng(1)
  lengths = np.array(LENGTHS)
  prompts = np.asarray(random_tokens(30, (B, P)))
  stream = [list(prompts[r, :n]) for r, n in enumerate(lengths)]
  state = model.init_state(B, width, ssm_mode=ssm_mode, buffer_len=L)
  _, state = prefill(model, jnp.asarray(prompts), jnp.asarray(lengths), state)
  checks = []  # (row, stream position of the token consumed, logits)
  for w in range(windows):
    win = np.asarray(random_tokens(100 + w, (B, T)))
    n = rng.integers(1, T + 1, size=B).astype(np.int32)
    if w % 3 == 0:
      n[:] = 1 if w % 2 else T
    logits, pending = verify(model, jnp.asarray(win), state)
    state = commit(pending, jnp.asarray(n))
    for r in range(B):  # logits[r, s]: after window token s (accepted)
      checks += [(r, len(stream[r]) + s, logits[r, s]) for s in range(n[r])]
      stream[r] += list(win[r, :n[r]])
    padded = np.zeros((B, width), np.int32)
    for r in range(B):
      padded[r, :len(stream[r])] = stream[r]
    fresh = model.init_state(B, width, ssm_mode=ssm_mode, buffer_len=L)
    _, fresh = prefill(model, jnp.asarray(padded),
                       jnp.asarray([len(s) for s in stream]), fresh)
    _assert_states_close(state, fresh, model, f"after window {w}")
  full = _full_logits(*nnx.split(model), jnp.asarray(padded))
  for r, pos, lg in checks:
    testing.assert_close(lg, full[r, pos], TOL,
                         f"row {r} logits after stream position {pos}")


# ------------------------------------------------------ decode loop: greedy
MAX_NEW, WINDOW, BUFFER_LEN = 24, 4, 8


@pytest.fixture(scope="module")
def prompts():
  return random_tokens(40, (B, P)), jnp.asarray(LENGTHS, jnp.int32)


@pytest.fixture(scope="module")
def reference(model, prompts):
  """Non-speculative greedy tokens."""
  out, n = generate(model, *prompts, MAX_NEW, buffer_len=BUFFER_LEN)
  assert np.all(np.asarray(n) == MAX_NEW)
  return np.asarray(out)


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_greedy_equals_generate(model, draft, prompts, reference, ssm_mode,
                                kind):
  proposer = (DraftModelProposer(draft) if kind == "draft"
              else NgramProposer(n=2))
  out, n, stats, state = speculative_generate(
      model, proposer, *prompts, MAX_NEW, WINDOW, ssm_mode=ssm_mode,
      buffer_len=BUFFER_LEN, return_state=True)
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(n, MAX_NEW)
  # The final state holds everything but each row's last token.
  np.testing.assert_array_equal(state.positions,
                                np.array(LENGTHS) + MAX_NEW - 1)
  # The KV cache holds prompt + new tokens + window, rounded up so the
  # attention kernel tiles it (an untiled length sent verify to XLA).
  assert state.max_len == kv_cache_len(P + MAX_NEW + WINDOW)
  assert state.max_len % 64 == 0
  steps = np.asarray(stats.verify_steps)
  acc = np.asarray(stats.accepted_drafts)
  # Every verify step emits accepted drafts + 1 tokens (capped at the end).
  assert np.all(acc + steps >= MAX_NEW - 1)
  assert np.all(acc + steps <= MAX_NEW - 1 + WINDOW - 1)
  assert int(stats.iterations) == steps.max()
  np.testing.assert_allclose(float(stats.mean_accepted_length),
                             (acc + steps).sum() / steps.sum(), rtol=1e-6)
  # Compiled once per shape and sampling mode: sampling (not greedy) with
  # top-k and top-p on compiles once, then new prompts, lengths, sampling
  # values, eos and rng reuse it.
  before = M.TRACE_COUNTS["speculative_generate"]
  traces = []
  for seed in (1, 2, 3):
    out, n, _ = speculative_generate(
        model, proposer, random_tokens(seed, (B, P)),
        jnp.asarray([seed, P, 2], jnp.int32), MAX_NEW, WINDOW,
        ssm_mode=ssm_mode, buffer_len=BUFFER_LEN, temperature=0.5 * seed,
        top_k=seed + 1, top_p=0.9, rng=jax.random.PRNGKey(seed),
        eos_id=seed)
    assert np.all((np.asarray(n) >= 1) & (np.asarray(n) <= MAX_NEW))
    traces.append(M.TRACE_COUNTS["speculative_generate"] - before)
  assert traces == [1, 1, 1]


@pytest.mark.parametrize("ssm_mode,kind", [("replay", "draft"),
                                           ("baseline", "ngram")])
def test_compaction_keeps_output_and_state(model, draft, ssm_mode, kind):
  """A compacting loop (the batch of 5 halved to 3, 2, 1 as rows finish:
  ragged prompts, an eos that stops some rows early) gives the tokens,
  counts and stats of the plain loop, and final states that continue
  decoding alike (logits of 3 more steps; positions). Slots past each
  row's history are scratch (verify writes every row's window there), so
  the states are compared by what they decode, not leaf by leaf."""
  from replayssm_jax.models.speculative import compaction_sizes  # pylint: disable=g-import-not-at-top
  assert compaction_sizes(5, 3) == (5, 3, 2, 1)
  assert compaction_sizes(256, 2) == (256, 128, 64)
  assert compaction_sizes(1, 2) == (1,)
  proposer = (DraftModelProposer(draft) if kind == "draft"
              else NgramProposer(n=2))
  prompts = random_tokens(41, (5, P))
  lengths = jnp.asarray([8, 3, 6, 5, 8], jnp.int32)
  runs = [speculative_generate(model, proposer, prompts, lengths, MAX_NEW,
                               WINDOW, ssm_mode=ssm_mode,
                               buffer_len=BUFFER_LEN, eos_id=5,
                               return_state=True, compaction=c)
          for c in (0, 3)]
  (out, n, stats, state), (out_c, n_c, stats_c, state_c) = runs
  np.testing.assert_array_equal(out_c, out)
  np.testing.assert_array_equal(n_c, n)
  assert len(set(np.asarray(stats.verify_steps).tolist())) > 1  # ragged
  for f in ("verify_steps", "accepted_drafts", "iterations",
            "mean_accepted_length"):
    np.testing.assert_array_equal(getattr(stats_c, f), getattr(stats, f))
  np.testing.assert_array_equal(state_c.positions, state.positions)
  last = jnp.asarray(out)[jnp.arange(5), jnp.asarray(n) - 1]
  for _ in range(3):
    lg, state = decode_step(model, last, state)
    lg_c, state_c = decode_step(model, last, state_c)
    np.testing.assert_array_equal(lg_c, lg)
    last = jnp.argmax(lg, -1).astype(jnp.int32)
  # Without return_state, the same tokens.
  out_n, _, _ = speculative_generate(model, proposer, prompts, lengths,
                                     MAX_NEW, WINDOW, ssm_mode=ssm_mode,
                                     buffer_len=BUFFER_LEN, eos_id=5,
                                     compaction=1)
  np.testing.assert_array_equal(out_n, out)
  for bad in (-1, 1.5, True):
    with pytest.raises(ValueError, match="compaction"):
      speculative_generate(model, proposer, prompts, lengths, MAX_NEW,
                           WINDOW, compaction=bad)


@pytest.mark.parametrize("setting", [dict(temperature=0.0),
                                     dict(temperature=0.8),
                                     dict(temperature=0.8, top_p=0.9)])
def test_decode_loops_hold_no_conditional(model, setting):
  """With `SamplingSettings` (greedy and the filters static) neither the
  plain nor the speculative loop lowers to a conditional (an XLA GPU
  conditional outside a CUDA graph syncs the host every iteration), and
  the speculative loop's acceptance traces one form."""
  from tests.test_models import G  # pylint: disable=g-import-not-at-top
  SP = importlib.import_module("replayssm_jax.models.speculative")
  sampling = sampling_settings(setting["temperature"], None,
                               setting.get("top_p"), None,
                               jax.random.PRNGKey(0))
  assert sampling.greedy == (setting["temperature"] == 0)
  tokens, lengths = random_tokens(3, (B, P)), jnp.asarray(LENGTHS, jnp.int32)
  graphdef, params = nnx.split(model)
  eos, rng = jnp.int32(-1), jax.random.PRNGKey(1)
  state = model.init_state(B, kv_cache_len(P + 8 + WINDOW),
                           buffer_len=BUFFER_LEN)
  plain = G._generate_jit.lower(graphdef, params, tokens, lengths, state, 8,  # pylint: disable=protected-access
                                None, sampling, eos, rng).as_text()
  spec = SP._spec_jit.lower(  # pylint: disable=protected-access
      graphdef, params, tokens, lengths, state, 8, WINDOW, None, "replay",
      BUFFER_LEN, NgramProposer(n=2), sampling, eos, rng, 1,
      False).as_text()
  for text in (plain, spec):
    assert "stablehlo.while" in text
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
  # A traced greedy flag (a plain tuple) keeps the conditional.
  traced = (jnp.asarray(False),) + tuple(sampling)[1:]
  text = G._generate_jit.lower(graphdef, params, tokens, lengths, state, 8,  # pylint: disable=protected-access
                               None, traced, eos, rng).as_text()
  assert "stablehlo.case" in text


@jax.tree_util.register_pytree_node_class
class ScriptedProposer(Proposer):
  """Test proposer: at iteration i row r proposes schedule[i, r] = (nd, k):
  nd drafts, the first k of them the target's true greedy continuation
  (from `reference`), the rest wrong tokens; never past the reference.
  Hence exactly min(nd, k, tokens left) drafts are accepted (greedy)."""

  def __init__(self, reference, schedule):
    self.reference = jnp.asarray(reference, jnp.int32)  # [b, max_new]
    self.schedule = jnp.asarray(schedule, jnp.int32)  # [iters, b, 2]

  def tree_flatten(self):
    return (self.reference, self.schedule), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)

  def init(self, prompt_tokens, prompt_lengths, **unused):
    return ()

  def propose(self, pstate, ctx, window, rng, sampling):
    t1 = window - 1
    it = jnp.minimum(ctx.iteration, self.schedule.shape[0] - 1)
    nd, k = self.schedule[it, :, 0], self.schedule[it, :, 1]
    j = jnp.arange(t1)[None, :]
    idx = jnp.clip(ctx.num_generated[:, None] + j, 0,
                   self.reference.shape[1] - 1)
    right = jnp.take_along_axis(self.reference, idx, axis=1)
    wrong = (right + 1 + j) % VOCAB
    nd = jnp.minimum(nd, self.reference.shape[1] - ctx.num_generated)
    return Proposal(jnp.where(j < k[:, None], right, wrong), nd, None), pstate


def _simulate(schedule, max_new, window):
  """(iterations, verify steps [b], accepted drafts [b]) the script implies."""
  b = schedule.shape[1]
  gen, steps, acc = np.ones(b, int), np.zeros(b, int), np.zeros(b, int)
  it = 0
  while (gen < max_new).any():
    for r in np.nonzero(gen < max_new)[0]:
      nd, k = schedule[min(it, len(schedule) - 1), r]
      a = min(nd, k, window - 1, max_new - gen[r])
      acc[r] += a
      steps[r] += 1
      gen[r] += min(a + 1, max_new - gen[r])
    it += 1
  return it, steps, acc


def _schedule(seed, iters=MAX_NEW):
  """Forced rounds first (no drafts, all wrong, all right, ragged counts),
  then random (nd, k) per row."""
  rng = np.random.default_rng(seed)
  t1 = WINDOW - 1
  sched = np.stack([rng.integers(0, t1 + 1, (iters, B)),
                    rng.integers(0, t1 + 1, (iters, B))], axis=-1)
  sched[0] = [0, 0]  # no drafts
  sched[1] = [t1, 0]  # every draft wrong: 0 accepted
  sched[2] = [t1, t1]  # all accepted (bonus token)
  sched[3] = [[1, 1], [2, 1], [0, 3]]  # ragged
  return sched


@pytest.mark.parametrize("ssm_mode", ["replay", "baseline"])
def test_forced_acceptance_patterns(model, prompts, reference, ssm_mode):
  """Scripted drafts: 0 accepted, all accepted, partial, no drafts, ragged
  draft counts; output == generate, stats == the script's simulation; with
  an eos == generate with that eos."""
  sched = _schedule(ssm_mode == "baseline")
  out, n, stats = speculative_generate(
      model, ScriptedProposer(reference, sched), *prompts, MAX_NEW, WINDOW,
      ssm_mode=ssm_mode, buffer_len=BUFFER_LEN)
  np.testing.assert_array_equal(out, reference)
  np.testing.assert_array_equal(n, MAX_NEW)
  it, steps, acc = _simulate(sched, MAX_NEW, WINDOW)
  assert int(stats.iterations) == it
  np.testing.assert_array_equal(stats.verify_steps, steps)
  np.testing.assert_array_equal(stats.accepted_drafts, acc)
  # eos: the token row 0 emits at step 9 (no recompilation: eos is traced).
  eos = int(reference[0, 9])
  ref_eos, n_eos = generate(model, *prompts, MAX_NEW, buffer_len=BUFFER_LEN,
                            eos_id=eos)
  before = M.TRACE_COUNTS["speculative_generate"]
  out, n, _ = speculative_generate(
      model, ScriptedProposer(reference, sched), *prompts, MAX_NEW, WINDOW,
      ssm_mode=ssm_mode, buffer_len=BUFFER_LEN, eos_id=eos)
  assert M.TRACE_COUNTS["speculative_generate"] == before
  np.testing.assert_array_equal(out, ref_eos)
  np.testing.assert_array_equal(n, n_eos)
  assert int(n[0]) <= 10


def test_ngram_proposer_lookup():
  """Longest suffix first, most recent earlier occurrence, continuation
  limited to the known history, nothing when nothing matches."""
  hist = np.zeros((5, 10), np.int32)
  rows = [[5, 6, 7, 8, 5, 6],  # [5 6] at 0 -> 7 8 5
          [1, 2, 3, 4],  # no repeat -> nothing
          [1, 2, 9, 1, 2, 8, 1, 2],  # most recent [1 2] at 3 -> 8 1 2
          [4, 9, 3, 7, 3],  # no [7 3]; [3] at 2 -> 7 3 (2 known)
          [1, 2, 1, 2]]  # [1 2] at 0 -> 1 2 (2 known)
  for r, h in enumerate(rows):
    hist[r, :len(h)] = h
  ln = jnp.asarray([len(h) for h in rows], jnp.int32)
  ctx = ProposalContext(history=jnp.asarray(hist), length=ln,
                        last=jnp.asarray(hist)[jnp.arange(5), ln - 1],
                        num_generated=jnp.ones(5, jnp.int32),
                        active=jnp.ones(5, bool), iteration=jnp.int32(0))
  prop, _ = NgramProposer(n=2).propose((), ctx, 4, None, None)
  np.testing.assert_array_equal(prop.num_drafts, [3, 0, 3, 2, 2])
  assert prop.q is None
  d = np.asarray(prop.drafts)
  np.testing.assert_array_equal(d[0], [7, 8, 5])
  np.testing.assert_array_equal(d[2], [8, 1, 2])
  np.testing.assert_array_equal(d[3, :2], [7, 3])
  np.testing.assert_array_equal(d[4, :2], [1, 2])
  prop, _ = NgramProposer(n=2, min_n=2).propose((), ctx, 4, None, None)
  np.testing.assert_array_equal(prop.num_drafts, [3, 0, 3, 0, 2])


# ---------------------------------------------------- decode loop: sampling
SMALL_VOCAB = 4
SAMPLES = 4000


@pytest.fixture(scope="module")
def small_models():
  """A target and a draft over a 4-token vocabulary."""
  return (make_model(5, vocab_size=SMALL_VOCAB),
          make_model(6, vocab_size=SMALL_VOCAB, d_model=16, pattern="M*"))


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
  full = _full_logits(*nnx.split(target), jnp.concatenate(
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


# ------------------------------------------------------------ bad inputs
def test_bad_inputs_raise_clear_errors(model, draft, prompts, small_models):
  """Every check runs before compiling (no jit below)."""
  toks, lengths = prompts
  ngram = NgramProposer()
  run = functools.partial(speculative_generate, model, ngram, toks, lengths,
                          4)
  with pytest.raises(ValueError, match="window must be a positive int"):
    run(0)
  with pytest.raises(ValueError, match=r"buffer_len \(4\) must exceed window "
                     r"\(4\)"):
    run(4, buffer_len=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    speculative_generate(model, ngram, toks, lengths, 0, 2)
  with pytest.raises(TypeError, match="proposer must be a Proposer"):
    speculative_generate(model, draft, toks, lengths, 4, 2)
  with pytest.raises(TypeError, match="target must be a HybridLM"):
    speculative_generate(ngram, ngram, toks, lengths, 4, 2)
  with pytest.raises(ValueError, match="rng"):
    run(2, temperature=1.0)
  with pytest.raises(ValueError, match="eos_id"):
    run(2, eos_id=VOCAB)
  with pytest.raises(ValueError, match="ssm_mode"):
    run(2, ssm_mode="fast")
  with pytest.raises(ValueError, match="lengths"):
    speculative_generate(model, ngram, toks, jnp.array([0, 1, 1]), 4, 2)
  with pytest.raises(ValueError, match=r"vocab_size \(4\) must equal"):
    speculative_generate(model, DraftModelProposer(small_models[1]), toks,
                         lengths, 4, 2)
  with pytest.raises(ValueError, match=r"draft model's replay buffer_len "
                     r"\(3\) must exceed the window \(3\)"):
    speculative_generate(model, DraftModelProposer(draft, buffer_len=3),
                         toks, lengths, 4, 3)
  with pytest.raises(TypeError, match="draft_model must be a HybridLM"):
    DraftModelProposer(ngram)
  with pytest.raises(ValueError, match="n must be a positive int"):
    NgramProposer(n=0)
  with pytest.raises(ValueError, match=r"min_n \(3\) must be <= n \(2\)"):
    NgramProposer(n=2, min_n=3)
  # verify / commit (a state as prefill leaves it, built by hand)
  state = model.init_state(B, P + 2, buffer_len=4)
  state = state.replace(
      positions=lengths,
      layers=tuple(s.replace(length=lengths) if isinstance(s, AttentionState)
                   else s for s in state.layers))
  with pytest.raises(ValueError, match=r"buffer_len \(4, layer 0\) must "
                     r"exceed the window T \(4\)"):
    verify(model, toks[:, :4], state)
  with pytest.raises(ValueError, match=r"no room for a window of T = 3 "
                     r"tokens: rows \[0\] hold \[8\]"):
    verify(model, toks[:, :3], state)
  with pytest.raises(ValueError, match="vocab_size"):
    verify(model, toks[:, :2] + VOCAB, state)
  with pytest.raises(TypeError, match="tokens"):
    verify(model, jnp.ones((B, 2)), state)
  with pytest.raises(ValueError, match="batch"):
    verify(model, toks[:2, :2], state)
  with pytest.raises(ValueError, match="T >= 1"):
    verify(model, toks[:, :0], state)
  with pytest.raises(TypeError, match="model must be a HybridLM"):
    verify(ngram, toks[:, :2], state)
  pending = PendingState(state=state, window_conv_inputs=(), snapshots=(),
                         window=2)
  with pytest.raises(ValueError, match=r"num_accepted must lie in \[1, T\] "
                     r"= \[1, 2\] for every row; rows \[1\] hold \[0\]"):
    commit(pending, jnp.asarray([1, 0, 2], jnp.int32))
  with pytest.raises(ValueError, match=r"rows \[2\] hold \[3\]"):
    commit(pending, jnp.asarray([1, 1, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"num_accepted must have shape"):
    commit(pending, jnp.ones((2,), jnp.int32))
  with pytest.raises(TypeError, match="num_accepted must have an integer"):
    commit(pending, jnp.ones((B,)))
  with pytest.raises(TypeError, match="pending must be a PendingState"):
    commit(state, jnp.ones((B,), jnp.int32))
