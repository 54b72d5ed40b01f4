"""ops.decode_attention: the reference against float64 numpy, the Pallas
kernel (interpret mode) against the reference (one query per row and
verify windows), argument checks, Triton lowering, and the model's decode
step and verify through both implementations.

Outputs of the kernel start as NaN in interpret mode (Pallas' uninitialized
value), so a head or row the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import _decode_bench
import pallas_kernels as pk
from replayssm_jax import models
from replayssm_jax import ops
from replayssm_jax import testing


def _inputs(key, batch, q_heads, kv_heads, max_len, head_dim, dtype,
            window=None):
  """Ragged lengths, with an empty and a full row; window: T queries per
  row (q [batch, T, q_heads, head_dim])."""
  kq, kk, kv, kl = jax.random.split(key, 4)
  q = jax.random.normal(kq, (batch,) + (() if window is None else (window,))
                        + (q_heads, head_dim), jnp.float32)
  k = jax.random.normal(kk, (batch, kv_heads, max_len, head_dim), jnp.float32)
  v = jax.random.normal(kv, (batch, kv_heads, max_len, head_dim), jnp.float32)
  lengths = jax.random.randint(kl, (batch,), 1, max_len + 1)
  lengths = lengths.at[0].set(0).at[-1].set(max_len)
  return (q.astype(dtype), k.astype(dtype), v.astype(dtype),
          lengths.astype(jnp.int32))


def _numpy_attention(q, k, v, lengths, scale):
  """float64, row by row, query by query and head by head (window query t
  sees min(lengths + t, max_len) entries)."""
  q, k, v = (np.asarray(jnp.asarray(a, jnp.float32), np.float64)
             for a in (q, k, v))
  qw = q if q.ndim == 4 else q[:, None]
  b, t, hq, d = qw.shape
  rep = hq // k.shape[1]
  out = np.zeros((b, t, hq, d))
  for r in range(b):
    for pos in range(t):
      n = min(int(lengths[r]) + pos, k.shape[2])
      if n == 0:
        continue
      for h in range(hq):
        s = scale * (k[r, h // rep, :n] @ qw[r, pos, h])
        p = np.exp(s - s.max())
        out[r, pos, h] = (p / p.sum()) @ v[r, h // rep, :n]
  return out if q.ndim == 4 else out[:, 0]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 2)])
def test_reference_matches_numpy(dtype, q_heads, kv_heads, window):
  args = _inputs(jax.random.PRNGKey(q_heads * 7 + kv_heads), 5, q_heads,
                 kv_heads, 24, 16, dtype, window=window)
  got = ops.decode_attention(*args, implementation="reference")
  assert got.dtype == jnp.dtype(dtype) and got.shape == args[0].shape
  want = _numpy_attention(*args, 16 ** -0.5)
  testing.assert_close(got, want, testing.tolerance(dtype), "reference")
  first = got[0] if window is None else got[0, 0]
  assert not np.any(np.asarray(first, np.float32)), "a query saw nothing"


KERNEL_CONFIGS = {
    "default": None,
    "block16": pk.AttentionConfig(block_s=16),
    "split32": pk.AttentionConfig(block_s=16, split_s=32),
    "split64_stages2": pk.AttentionConfig(split_s=64, num_stages=2),
}


@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("q_heads,kv_heads,max_len,window", [
    (4, 1, 32, None), (4, 2, 48, None), (2, 2, 16, None), (6, 2, 96, None),
    (32, 2, 64, None), (4, 1, 48, 4), (6, 2, 32, 3), (16, 2, 64, 4)])
def test_kernel_matches_reference(config, dtype, q_heads, kv_heads, max_len,
                                  window):
  """Ragged lengths (0 and max_len included); max_len 48 and 96 are not
  multiples of the default block (gcd blocks of 16 and 32), and split32 /
  split64 leave a split that runs past 48 / 96; 6 / 2 heads: 3 query heads
  per KV head (padded to 16 rows), 32 / 2: 16 (no padding). Windows: 4
  positions x 4 heads (16 rows), 3 x 3 (9, padded to 16), 4 x 8 (32), with
  rows whose later positions reach past max_len."""
  args = _inputs(jax.random.PRNGKey(max_len + q_heads), 6, q_heads, kv_heads,
                 max_len, 16, dtype, window=window)
  want = ops.decode_attention(*args, implementation="reference")
  got = ops.decode_attention(*args, implementation="pallas",
                             config=KERNEL_CONFIGS[config])
  assert got.dtype == want.dtype and got.shape == want.shape
  # Both accumulate in float32 and round the output to dtype once; the
  # online softmax reorders the sums, and p . V takes p to ~2^-17 relative
  # (high + low 16-bit parts), far inside the output's own rounding.
  testing.assert_close(got, want, testing.tolerance(dtype), config)


def test_kernel_scale_and_block_len():
  args = _inputs(jax.random.PRNGKey(3), 3, 4, 2, 48, 32, "float32")
  for scale in (None, 0.05):
    want = ops.decode_attention(*args, scale=scale, implementation="reference")
    got = ops.decode_attention(*args, scale=scale, implementation="pallas")
    testing.assert_close(got, want, testing.TOLERANCES["float32"],
                         f"scale {scale}")
  assert pk.attention.block_len(48, pk.AttentionConfig()) == 16
  assert pk.attention.block_len(384, pk.AttentionConfig()) == 64


def test_out_of_range_lengths_under_jit_are_nan_rows():
  """Traced lengths cannot be checked: both implementations give a row
  whose length lies outside [0, max_len] NaN outputs (the traced-value
  policy), the other rows their own."""
  q, k, v, _ = _inputs(jax.random.PRNGKey(4), 3, 4, 2, 16, 16, "float32")
  bad = jnp.array([-3, 40, 7], jnp.int32)
  for impl in ("reference", "pallas"):
    got = np.asarray(jax.jit(lambda n, i=impl: ops.decode_attention(
        q, k, v, n, implementation=i))(bad))
    want = ops.decode_attention(q, k, v, jnp.array([0, 16, 7], jnp.int32),
                                implementation="reference")
    assert np.isnan(got[:2]).all(), impl
    testing.assert_close(got[2], want[2], testing.TOLERANCES["float32"], impl)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("config", ["default", "split32"])
def test_kernel_unseen_values_never_reach_a_query(config, poison):
  """The kernel: cache entries a query does not see (stale ones past the
  window, and a window position after the query's: a rejected draft)
  holding NaN / inf leave its output bit-identical, while a query that
  sees one returns NaN; one query per row: stale entries past the length.
  (The reference weighs unseen entries by zero: selecting them away there
  copies the whole cache every step.)"""
  impl = "pallas"
  q, k, v, n = _inputs(jax.random.PRNGKey(6), 4, 4, 2, 48, 16, "float32",
                       window=4)
  n = jnp.minimum(n, 40)  # every window inside the cache
  pos = jnp.arange(48)[None, None, :, None]
  # Entry n + 2 (window positions 0-2 do not see it) and the stale tail.
  dirty = (pos == n[:, None, None, None] + 2) | (pos >= n[:, None, None,
                                                              None] + 4)
  run = lambda qq, vv: np.asarray(ops.decode_attention(
      qq, k, vv, n, implementation=impl, config=KERNEL_CONFIGS[config]))
  clean, got = run(q, v), run(q, jnp.where(dirty, poison, v))
  np.testing.assert_array_equal(got[:, :3], clean[:, :3])
  assert np.isnan(got[:, 3]).all()
  stale = jnp.where(pos >= n[:, None, None, None], poison, v)
  np.testing.assert_array_equal(run(q[:, 0], stale), run(q[:, 0], v))


def test_inputs_are_not_mutated():
  args = _inputs(jax.random.PRNGKey(5), 2, 4, 2, 16, 16, "float32")
  copies = [np.array(a) for a in args]
  ops.decode_attention(*args, implementation="pallas")
  for a, c in zip(args, copies):
    np.testing.assert_array_equal(np.asarray(a), c)


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((2, 1, 4, 16, 1))), r"q must be 3-D \[batch, "
     r"q_heads, head_dim\] \(one query per row\) or 4-D"),
    (dict(q=jnp.zeros((2, 3, 4, 8))), r"k_cache must have shape"),
    (dict(q=jnp.zeros((2, 4, 16), jnp.int32)), r"q must have a floating"),
    (dict(k_cache=jnp.zeros((2, 2, 16, 8))),
     r"k_cache must have shape \[batch, kv_heads, max_len, head_dim\] = "
     r"\(2, 2, 16, 16\)"),
    (dict(v_cache=jnp.zeros((2, 2, 12, 16))), r"v_cache must have shape"),
    (dict(q=jnp.ones((2, 3, 16))), r"q_heads \(3, read from q\) must be a "
     r"multiple of kv_heads \(2"),
    (dict(lengths=jnp.ones((3,), jnp.int32)), r"lengths must have shape"),
    (dict(lengths=jnp.ones((2,), jnp.float32)), r"lengths must have an "
     r"integer dtype"),
    (dict(lengths=jnp.array([3, 17], jnp.int32)), r"lengths must lie in "
     r"\[0, max_len\] = \[0, 16\] for every row; rows \[1\] hold \[17\]"),
    (dict(scale=jnp.float32(0.1)), r"scale must be a Python float"),
])
def test_bad_arguments_are_named(change, match):
  q, k, v, n = _inputs(jax.random.PRNGKey(6), 2, 4, 2, 16, 16, "float32")
  args = dict(q=q, k_cache=k, v_cache=v, lengths=n)
  args.update(change)
  with pytest.raises((TypeError, ValueError), match=match):
    ops.decode_attention(**args)


def test_dispatcher():
  args = _inputs(jax.random.PRNGKey(7), 2, 4, 2, 16, 12, "float32")
  assert ops.implementations("decode_attention") == ("pallas", "reference")
  with pytest.raises(NotImplementedError, match=r"head_dim = 12 is not a "
                     r"power of two >= 16"):
    ops.decode_attention(*args, implementation="pallas")
  short = _inputs(jax.random.PRNGKey(7), 2, 4, 2, 40, 16, "float32")
  with pytest.raises(NotImplementedError, match="max_len = 40 is not a "
                     "multiple of 16"):
    ops.decode_attention(*short, implementation="pallas")
  # None runs the reference here (off-GPU the kernel would interpret).
  testing.assert_close(ops.decode_attention(*args),
                       ops.decode_attention(*args, implementation="reference"),
                       testing.TOLERANCES["float32"], "default")
  with pytest.raises(ValueError, match="config can only be given"):
    ops.decode_attention(*args, config=pk.AttentionConfig())
  with pytest.raises(ValueError, match="implementation must be None or one "
                     "of"):
    ops.decode_attention(*args, implementation="pallas_mosaic_gpu")


def test_model_decode_with_the_kernel_matches_the_reference():
  """The decode step with implementation="pallas" (attention, conv and SSM
  kernels) against "reference", over ragged prompts and 6 steps, then a
  speculative verify window of 4 tokens."""
  cfg = models.ModelConfig(**{**_decode_bench.TINY_MODEL,
                              "attn_head_dim": 16})  # a dot operand >= 16
  model = models.HybridLM(cfg, rngs=nnx.Rngs(0))
  prompts = jax.random.randint(jax.random.PRNGKey(8), (3, 7), 0,
                               cfg.vocab_size)
  lengths = jnp.array([7, 3, 5], jnp.int32)
  outs = {}
  for impl in ("reference", "pallas"):
    st = model.init_state(3, 32, ssm_mode="replay", buffer_len=8)
    logits, st = models.prefill(model, prompts, lengths, st)
    seq = []
    for _ in range(6):
      tok = jnp.argmax(logits, -1).astype(jnp.int32)
      logits, st = models.decode_step(model, tok, st, implementation=impl)
      seq.append(logits)
    win = jax.random.randint(jax.random.PRNGKey(9), (3, 4), 0,
                             cfg.vocab_size)
    win_logits, _ = models.verify(model, win, st, implementation=impl)
    outs[impl] = (jnp.stack(seq, 1), win_logits)
  for i, what in enumerate(("decode logits", "verify logits")):
    testing.assert_close(outs["pallas"][i], outs["reference"][i],
                         testing.TOLERANCES["float32"], what)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=str)
def test_kernel_lowers_to_triton(config, window):
  """The kernel lowers for the GPU (Triton IR, cross-lowered on this CPU):
  the dots, the masked loads and stores, the -inf constants."""
  from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # pylint: disable=g-import-not-at-top
  args = _inputs(jax.random.PRNGKey(9), 2, 8, 2, 64, 32, "bfloat16",
                 window=window)
  text = _lower_for_cuda(
      lambda *a: pk.attention.decode_attention(
          *a, config=KERNEL_CONFIGS[config] or pk.AttentionConfig()), *args)
  assert "replayssm_decode_attention" in text
