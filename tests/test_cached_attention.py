"""cached_attention (a continued prefill's chunk against its KV cache, block
by block) against a float64 softmax over the live entries."""

import numpy as np
import pytest

from replayssm_jax.models.cached_attention import (cached_attention,
                                                   key_block_for, key_blocks)

# f32 throughout; the blocks' running softmax sums in another order.
TOL = 2e-5


def reference(q, k, v, new_len, pos, scale):
  """float64 numpy: query t of row r sees entries j < new_len[r], j <=
  pos[r, t]."""
  b, t, hq, d = q.shape
  hk = k.shape[1]
  rep = hq // hk
  out = np.zeros((b, t, hq, d))
  for r in range(b):
    for i in range(t):
      n = min(new_len[r], pos[r, i] + 1)
      for h in range(hq):
        kk = k[r, h // rep, :n].astype(np.float64)
        s = scale * kk @ q[r, i, h].astype(np.float64)
        p = np.exp(s - s.max())
        out[r, i, h] = (p / p.sum()) @ v[r, h // rep, :n].astype(np.float64)
  return out.reshape(b, t, hq * d)


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("s,key_block", [(256, 64), (192, 64), (96, 512)])
def test_equals_softmax_over_live_entries_with_stale_poison(s, key_block,
                                                            bounded):
  """The whole cache, or (bounded) only the blocks up to the largest
  new_len (kv_len: 2 of 4 blocks at s 256)."""
  rng = np.random.default_rng(0)
  b, t, hq, hk, d = 3, 8, 4, 2, 16
  length = np.array([5, 100, 40]) % (s - t)
  new_len = length + np.array([8, 3, 8])  # row 1: a chunk of 3 (pads after)
  pos = length[:, None] + np.arange(t)[None]
  q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
  k = rng.standard_normal((b, hk, s, d)).astype(np.float32)
  v = rng.standard_normal((b, hk, s, d)).astype(np.float32)
  for r in range(b):  # stale entries hold inf / NaN
    k[r, :, new_len[r]:] = np.inf
    v[r, :, new_len[r]:] = np.nan
  kv_len = int(new_len.max()) if bounded else None
  got = np.asarray(cached_attention(q, k, v, new_len, pos, 0.25,
                                    key_block=key_block, kv_len=kv_len))
  want = reference(q, k, v, new_len, pos, 0.25)
  for r in range(b):  # a row's pads (t >= its chunk) are not outputs
    real = min(t, new_len[r] - length[r])
    np.testing.assert_allclose(got[r, :real], want[r, :real], rtol=TOL,
                               atol=TOL)
  assert np.isfinite(got).all()


def test_key_blocks_cover_the_bound():
  assert key_blocks(None, 4096) == 8  # the whole cache
  assert key_blocks(1, 4096) == 1
  assert key_blocks(512, 4096) == 1 and key_blocks(513, 4096) == 2
  assert key_blocks(10_000, 4096) == 8  # at most the cache
  assert key_blocks(103, 256, key_block=64) == 2


def test_key_block_divides_the_cache():
  assert key_block_for(4096) == 512
  assert key_block_for(1536) == 512
  assert key_block_for(192) == 64
  assert key_block_for(96) == 96  # no power-of-two divisor >= 64: one block
  assert key_block_for(1024, key_block=128) == 128
