"""A prefill continued from a decode state (models.prefill_from_state):
prefill(A + B) == prefill(A) then prefill_from_state(B), for the last
token's logits and every state leaf, at ragged split points (rows at
different positions; splits on and off the SSM chunk size), in replay and
baseline modes, on a model with every block kind; from rows mid-buffer
(after decode steps); under a stochastically rounding precision policy;
with gated and latent (MLA) attention; then greedy decoding == `generate`
of the whole prompt. Pads and stale state entries holding NaN / inf reach
nothing; the entry compiles once per shape; bad arguments are named.

Tiny models (d_model 32), random weights with the norm weights randomized
too (so that greedy tokens vary), fresh random tokens, f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax import gdn, models, testing
from replayssm_jax import precision as P
from replayssm_jax.gdn import testing as gdn_testing
from replayssm_jax.kda import testing as kda_testing
from replayssm_jax.models import chunked_prefill as CP
from replayssm_jax.models import states as S
from tests.serving_common import build_model

ALL = models.ModelConfig(  # every block kind: M * G K - E
    vocab_size=64, d_model=32, pattern="M*GK-E", ssm_heads=4, head_dim=8,
    d_state=8, n_groups=2, conv_kernel=4, chunk_size=4, num_heads=4,
    num_kv_heads=2, attn_head_dim=8, intermediate_size=48,
    gdn_num_k_heads=2, gdn_num_v_heads=4, gdn_k_dim=8, gdn_v_dim=8,
    gdn_chunk_size=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16)
B, T, MAX_LEN, L = 3, 13, 32, 4
LENGTHS = np.array([13, 9, 11])  # whole prompts (right-padded to T)
# Per-row split points: on the chunk size (4, 8, 12), off it, and a last
# chunk of one token.
SPLITS = [np.array([5, 3, 6]), np.array([4, 8, 10]), np.array([12, 1, 7])]
MODES = ("replay", "baseline")
# f32 tolerances: a split prefill sums in another order (the chunk
# boundaries move) and reads back the f32 state; per dtype of the compared
# values. The logits get the project's prefill == forward tolerance
# (tests/test_models.py).
TOL = {"float32": dict(atol=1e-5, rtol=1e-5)}
LOGITS_TOL = dict(atol=2e-5, rtol=2e-5)


def build(cfg, seed=0):
  return build_model(seed, seed + 100, cfg)


@pytest.fixture(scope="module")
def model():
  return build(ALL)


def tokens(seed, shape=(B, T), vocab=64):
  return np.array(jax.random.randint(jax.random.PRNGKey(seed), shape, 0,
                                      vocab, jnp.int32))  # a writable copy


def chunk(toks, start, end, width=T):
  """Row r's toks[r, start[r]:end[r]], right-padded with random ids to
  `width` -> (tokens [b, width], lengths [b])."""
  out = tokens(99, (toks.shape[0], width))
  for r in range(toks.shape[0]):
    out[r, :end[r] - start[r]] = toks[r, start[r]:end[r]]
  return jnp.asarray(out), jnp.asarray(end - start, jnp.int32)


def state(model, mode, **kw):
  return model.init_state(B, MAX_LEN, ssm_mode=mode, buffer_len=L, **kw)


def assert_states_close(got, want, what, tol=TOL["float32"]):
  """Every leaf of two ModelStates; KV caches over each row's entries
  [0, length) only (entries past it are stale by design: a prefill writes
  its pads there, a continued prefill nothing)."""
  np.testing.assert_array_equal(got.positions, want.positions, what)
  for i, (g, w) in enumerate(zip(got.layers, want.layers)):
    if isinstance(w, S.AttentionState):
      np.testing.assert_array_equal(g.length, w.length, f"{what} [{i}]")
      live = (np.arange(w.max_len)[None, :]
              < np.asarray(w.length)[:, None])[:, None, :, None]
      for name in ("k", "v"):
        np.testing.assert_allclose(
            np.where(live, getattr(g, name), 0),
            np.where(live, getattr(w, name), 0), **tol,
            err_msg=f"{what}: layers[{i}].{name}")
      continue
    gl = jax.tree_util.tree_leaves_with_path(g)
    wl = jax.tree_util.tree_leaves_with_path(w)
    assert jax.tree.structure(g) == jax.tree.structure(w), (what, i)
    for (path, a), (_, e) in zip(gl, wl):
      where = f"{what}: layers[{i}]{jax.tree_util.keystr(path)}"
      assert a.dtype == e.dtype, where
      if jnp.issubdtype(e.dtype, jnp.floating):
        np.testing.assert_allclose(np.asarray(a, np.float32),
                                   np.asarray(e, np.float32), **tol,
                                   err_msg=where)
      else:
        np.testing.assert_array_equal(a, e, where)


def whole_and_split(model, mode, toks, split, **kw):
  """(logits, state) of one prefill of the whole prompts and of a prefill
  of toks[:, :split] continued over the rest."""
  lw, whole = models.prefill(model, jnp.asarray(toks), jnp.asarray(LENGTHS),
                             state(model, mode, **kw))
  _, part = models.prefill(model, jnp.asarray(toks), jnp.asarray(split),
                           state(model, mode, **kw))
  lc, cont = models.prefill_from_state(model, *chunk(toks, split, LENGTHS),
                                       part)
  return (lw, whole), (lc, cont)


@pytest.mark.parametrize("mode", MODES)
def test_split_prefill_equals_whole_and_decodes_as_generate(model, mode):
  """Three ragged split sets: logits and every state leaf as the whole
  prefill (replay states: empty buffer, count 0, checkpoint = the state);
  then greedy decoding from the continued state == `generate`."""
  toks = tokens(1)
  for split in SPLITS:
    (lw, whole), (lc, cont) = whole_and_split(model, mode, toks, split)
    what = f"{mode} split {split.tolist()}"
    np.testing.assert_allclose(lc, lw, **LOGITS_TOL, err_msg=what)
    assert_states_close(cont, whole, what)
  if mode == "replay":
    np.testing.assert_array_equal(cont.layers[0].ssm.count, 0)
  n = 6
  want, _ = models.generate(model, jnp.asarray(toks), jnp.asarray(LENGTHS),
                            n, ssm_mode=mode, buffer_len=L)
  first = jnp.argmax(lc, -1).astype(jnp.int32)
  rest, _, _ = models.generate_from_state(model, cont, first, n - 1)
  got = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], 1)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", MODES)
def test_continues_rows_mid_buffer(model, mode):
  """prefill(A), decode steps over the next tokens (row 0: 2 steps, count
  2; rows 1, 2: 5 steps past a flush of L = 4, count 1), then the rest as
  a continued prefill == one prefill of the whole prompt."""
  toks = tokens(2)
  split = np.array([3, 2, 4])
  _, st = models.prefill(model, jnp.asarray(toks), jnp.asarray(split),
                         state(model, mode))
  snaps = []
  for i in range(5):
    _, st = models.decode_step(
        model, jnp.asarray(toks[np.arange(B), split + i]), st)
    if i in (1, 4):
      snaps.append(jax.tree.map(jnp.copy, st))
  done = split + np.array([2, 5, 5])
  pick = jnp.asarray(done - split == 2)
  mixed = jax.tree.map(
      lambda a, b: jnp.where(pick.reshape((-1,) + (1,) * (a.ndim - 1)), a,
                             b), *snaps)
  if mode == "replay":
    np.testing.assert_array_equal(mixed.layers[0].ssm.count, [2, 1, 1])
  lc, cont = models.prefill_from_state(model, *chunk(toks, done, LENGTHS),
                                       mixed)
  lw, whole = models.prefill(model, jnp.asarray(toks), jnp.asarray(LENGTHS),
                             state(model, mode))
  np.testing.assert_allclose(lc, lw, **LOGITS_TOL)
  assert_states_close(cont, whole, f"{mode} mid-buffer")


def test_stochastic_rounding_policy_keys_the_whole_prompts_step(model):
  """Replay states under "f32+fp8+sr" (f32 masters, fp8 read copies
  rounded stochastically, keyed by the row's step): the continued state's
  step counters are the whole prompt's, its row ids the state's, and its
  read copies the whole prefill's, bit for bit (the same bits round the
  same f32 master)."""
  policy = P.PrecisionPolicy.preset("f32+fp8+sr")
  ids = jnp.array([7, 3, 11], jnp.int32)
  (lw, whole), (lc, cont) = whole_and_split(
      model, "replay", tokens(3), SPLITS[0], precision=policy, row_ids=ids)
  np.testing.assert_allclose(lc, lw, **LOGITS_TOL)
  for i in (0, 2, 3):  # the Mamba, Gated DeltaNet and KDA layers
    g, w = cont.layers[i].ssm, whole.layers[i].ssm
    np.testing.assert_array_equal(g.step, LENGTHS)
    np.testing.assert_array_equal(g.row_id, ids)
    np.testing.assert_array_equal(
        np.asarray(g.read_copy, np.float32),
        np.asarray(w.read_copy, np.float32), f"layers[{i}].read_copy")
    np.testing.assert_allclose(g.checkpoint, w.checkpoint, **TOL["float32"])


@pytest.mark.parametrize("variant", [
    dict(attn_qk_norm=True, attn_output_gate=True, rotary_dim=4),
    dict(mla_kv_lora_rank=8, mla_qk_nope_head_dim=4, mla_qk_rope_head_dim=4,
         mla_v_head_dim=8, num_kv_heads=4, rope_theta=None,
         attention_multiplier=8 ** -0.5)], ids=["gated", "mla"])
def test_gated_and_latent_attention(variant):
  m = build(ALL.replace(pattern="*-", **variant), 4)
  (lw, whole), (lc, cont) = whole_and_split(m, "baseline", tokens(4),
                                            SPLITS[1])
  np.testing.assert_allclose(lc, lw, **LOGITS_TOL)
  assert_states_close(cont, whole, str(variant))


@jax.jit
def _continue(gp, toks, lengths, st):
  """The traceable entry under jit, not donating (the test reuses st)."""
  return CP.prefill_from_state_fn(nnx.merge(*gp), toks, lengths, st)


def _poison_state(st):
  """Every KV entry past a row's length and every stale replay slot
  NaN / inf."""
  layers = []
  for s in st.layers:
    if isinstance(s, S.AttentionState):
      stale = (jnp.arange(s.max_len)[None, :]
               >= s.length[:, None])[:, None, :, None]
      s = s.replace(k=jnp.where(stale, jnp.inf, s.k),
                    v=jnp.where(stale, jnp.nan, s.v))
    elif isinstance(s, S.MambaState):
      s = s.replace(ssm=testing.fill_stale_slots(s.ssm, jnp.nan, jnp.inf))
    elif isinstance(s, S.GDNState):
      fill = (gdn_testing.fill_stale_slots
              if isinstance(s.ssm, gdn.GDNReplayState)
              else kda_testing.fill_stale_slots)
      s = s.replace(ssm=fill(s.ssm))
    layers.append(s)
  return st.replace(layers=tuple(layers))


def test_poisoned_pads_and_stale_entries_reach_nothing(model):
  """Pad token ids outside the vocabulary (NaN embeddings: every pad
  activation NaN), stale KV entries and replay slots NaN / inf: the
  logits and the new state are bit-identical to the clean run's, and
  finite."""
  toks, split = tokens(5), SPLITS[0]
  _, part = models.prefill(model, jnp.asarray(toks), jnp.asarray(split),
                           state(model, "replay"))
  part = jax.tree.map(jnp.copy, part)
  clean_toks, lengths = chunk(toks, split, LENGTHS)
  pads = np.arange(T)[None, :] >= np.asarray(lengths)[:, None]
  bad_toks = jnp.where(pads, 64 + 5, clean_toks)  # out of range: NaN rows
  gp = nnx.split(model)
  want = _continue(gp, clean_toks, lengths, part)
  got = _continue(gp, bad_toks, lengths, _poison_state(part))
  np.testing.assert_array_equal(got[0], want[0])
  assert np.isfinite(np.asarray(got[0])).all()
  assert_states_close(got[1], want[1], "poisoned", dict(atol=0, rtol=0))


def test_compiles_once_per_shape_and_names_bad_arguments(model):
  toks = tokens(6)
  before = CP.TRACE_COUNTS["prefill_from_state"]
  for seed, split in ((6, SPLITS[0]), (7, SPLITS[2])):
    _, st = models.prefill(model, jnp.asarray(tokens(seed)),
                           jnp.asarray(split), state(model, "replay"))
    models.prefill_from_state(model, *chunk(toks, split, LENGTHS), st)
  assert CP.TRACE_COUNTS["prefill_from_state"] - before <= 1
  _, st = models.prefill(model, jnp.asarray(toks), jnp.asarray(SPLITS[0]),
                         state(model, "replay"))
  good_toks, good_len = chunk(toks, SPLITS[0], LENGTHS)
  cases = [
      ((good_toks, jnp.array([0, 1, 1])), ValueError, "lengths"),
      ((good_toks, jnp.array([T + 1, 1, 1])), ValueError, "lengths"),
      ((good_toks, good_len[:2]), ValueError, "lengths"),
      ((good_toks.astype(jnp.float32), good_len), TypeError, "tokens"),
      ((good_toks.at[0, 0].set(64), good_len), ValueError, "tokens"),
      ((jnp.zeros((B, MAX_LEN), jnp.int32), jnp.full((B,), MAX_LEN)),
       ValueError, "max_len"),
  ]
  for (tk, ln), err, match in cases:
    with pytest.raises(err, match=match):
      models.prefill_from_state(model, tk, ln, st)
  with pytest.raises(ValueError, match="batch"):
    models.prefill_from_state(model, good_toks[:2], good_len[:2], st)
  with pytest.raises(TypeError, match="ModelState"):
    models.prefill_from_state(model, good_toks, good_len, st.layers)
  pending = st.replace(layers=(st.layers[0].replace(
      ssm=st.layers[0].ssm.replace(pending_window=2)),) + st.layers[1:])
  with pytest.raises(ValueError, match=r"layers\[0\].*pending"):
    models.prefill_from_state(model, good_toks, good_len, pending)


def test_kv_len_bound(model):
  """kv_len at the rows' largest positions + lengths: the same logits and
  state as without; one short of it: the row past it is invalid (NaN
  logits, position -1; the others as before), never attends to part of
  its cache."""
  toks, split = tokens(8), SPLITS[0]
  _, part = models.prefill(model, jnp.asarray(toks), jnp.asarray(split),
                           state(model, "replay"))
  ck, cl = chunk(toks, split, LENGTHS)
  fn = CP.prefill_from_state_fn  # eager: the test reuses `part`
  want = fn(model, ck, cl, part, None)
  top = int(LENGTHS.max())
  got = fn(model, ck, cl, part, top)
  np.testing.assert_array_equal(got[0], want[0])
  assert_states_close(got[1], want[1], "kv_len", dict(atol=0, rtol=0))
  short = fn(model, ck, cl, part, top - 1)
  over = LENGTHS == top
  assert np.isnan(np.asarray(short[0])[over]).all()
  np.testing.assert_array_equal(np.asarray(short[1].positions)[over], -1)
  np.testing.assert_array_equal(np.asarray(short[0])[~over],
                                np.asarray(want[0])[~over])
  with pytest.raises(ValueError, match="kv_len"):
    models.prefill_from_state(model, ck, cl, part, kv_len=0)
