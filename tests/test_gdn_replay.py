"""GDN ReplaySSM decode, the cases of its own (the replay tests both
delta-rule families share: tests/test_delta_rule_replay.py): buffer_len 1
is the baseline step in the checkpoint dtype, bf16 rings, the
constructors and the refused states and inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import PrecisionPolicy
from replayssm_jax import gdn
from replayssm_jax import testing
from replayssm_jax.gdn import testing as GT
from tests.delta_rule_families import (B, GDN, HK, HV, K, VD, one_step_setup,
                                       run, steps_for)


def test_buffer_len_1_is_the_baseline_step_in_the_checkpoint_dtype():
  inp = steps_for(GDN, 3, 4)
  state = jax.random.normal(jax.random.PRNGKey(4), (B, HV, K, VD))
  for dtype in ("bfloat16", "float16"):
    st = state.astype(dtype)
    r = gdn.gdn_replay_state_from(st, 1, num_k_heads=HK)
    assert r.checkpoint.dtype == jnp.dtype(dtype)
    for t in range(4):
      tok = {n: x[t] for n, x in inp.items()}
      o_b, st = gdn.gdn_step(st, **tok)
      o_r, r = gdn.gdn_replay_step(r, **tok)
      testing.assert_close(o_r, o_b, testing.tolerance(dtype), f"o {t}")
      testing.assert_close(r.checkpoint, st, testing.tolerance(dtype),
                           f"state {t}")


def test_bf16_buffer_stays_within_its_tolerance():
  L = 4
  rstate, full = GDN.random_state(jax.random.PRNGKey(77), L,
                                  GT.ragged_counts(B, L),
                                  buffer_dtype=jnp.bfloat16)
  _, out = run(GDN, rstate, full, steps_for(GDN, 78, 2 * L + 3))
  tol = testing.tolerance("bfloat16")
  testing.assert_close(out["o_r"], out["o_b"], tol, "o (bf16 rings)")
  testing.assert_close(out["s_r"], out["s_b"], tol, "state (bf16 rings)")


def test_constructors():
  r = gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK,
                                key_dim=K, value_dim=VD, buffer_len=5)
  assert r.checkpoint.shape == (2, HV, K, VD) and r.buffer_len == 5
  assert r.d_buf.shape == (2, 5, HV, VD) and r.d_buf.dtype == jnp.bfloat16
  assert r.k_buf.shape == (2, 5, HK, K) and r.g_buf.dtype == jnp.float32
  p = PrecisionPolicy.preset("f32+int8+sr")
  r = gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK,
                                key_dim=K, value_dim=VD, buffer_len=5,
                                policy=p)
  assert r.read_copy.dtype == jnp.int8 and r.read_scale.shape == (2, HV, K)
  np.testing.assert_array_equal(r.row_id, [0, 1])
  full = jax.random.normal(jax.random.PRNGKey(0), (2, HV, K, VD))
  r = gdn.gdn_replay_state_from(full, 3, num_k_heads=HK)
  assert r.checkpoint is not full
  np.testing.assert_array_equal(gdn.gdn_materialize(r), full)
  leaves, tree = jax.tree.flatten(r)
  assert len(leaves) == 5
  assert jax.tree.unflatten(tree, leaves).buffer_len == 3


def test_bad_states_and_inputs_are_refused():
  _, rstate, tok = one_step_setup(GDN)
  bad = [
      ("rstate.k_buf", rstate.replace(k_buf=rstate.k_buf[:, :, :, :-1])),
      ("rstate.k_buf", rstate.replace(k_buf=jnp.concatenate(
          [rstate.k_buf, rstate.k_buf[:, :, :1]], axis=2))),
      ("rstate.d_buf", rstate.replace(d_buf=rstate.d_buf[..., :-1])),
      ("rstate.g_buf", rstate.replace(g_buf=rstate.g_buf[..., :-1])),
      ("rstate.count", rstate.replace(count=rstate.count.at[1].set(8))),
      ("rstate.count", rstate.replace(count=rstate.count[:-1])),
  ]
  for name, st in bad:
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
      gdn.gdn_replay_step(st, **tok)
  with pytest.raises(TypeError, match="g_buf"):
    gdn.gdn_replay_step(rstate.replace(
        g_buf=rstate.g_buf.astype(jnp.bfloat16)), **tok)
  with pytest.raises(TypeError, match="k_buf"):
    gdn.gdn_replay_step(rstate.replace(
        k_buf=rstate.k_buf.astype(jnp.bfloat16)), **tok)
  with pytest.raises(ValueError, match="q"):
    gdn.gdn_replay_step(rstate, **{**tok, "q": tok["q"][:, :1]})
  with pytest.raises(ValueError, match="v"):
    gdn.gdn_replay_step(rstate, **{**tok, "v": tok["v"][..., :-1]})
  with pytest.raises(ValueError, match="policy"):
    gdn.gdn_replay_step(rstate, **tok,
                        policy=PrecisionPolicy.preset("f32+bf16"))
  with pytest.raises(ValueError, match="pending"):
    gdn.gdn_replay_step(rstate.replace(pending_window=2), **tok)
  with pytest.raises(ValueError, match="pending_window"):
    rstate.replace(pending_window=0)
  with pytest.raises(TypeError, match="GDNReplayState"):
    gdn.gdn_replay_step(rstate.checkpoint, **tok)
  with pytest.raises(ValueError, match="num_k_heads"):
    gdn.gdn_replay_state_from(rstate.checkpoint, 4, num_k_heads=3)
  with pytest.raises(ValueError, match="buffer_len"):
    gdn.init_gdn_replay_state(2, num_v_heads=HV, num_k_heads=HK, key_dim=K,
                              value_dim=VD, buffer_len=0)
