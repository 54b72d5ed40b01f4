"""The delta-rule families (Gated DeltaNet, Kimi Delta Attention) side by
side, for the tests they share (tests/test_delta_rule_reference.py,
tests/test_delta_rule_replay.py) and those of each family's own
(tests/test_{gdn,kda}_{reference,replay}.py): each family's ops, random
states and inputs at one small shape; `numpy_loop`, the rule token by
token in float64; `run`, a family's baseline and replay steps over the same
tokens in one scan."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import gdn
from replayssm_jax import kda
from replayssm_jax import testing
from replayssm_jax.gdn import reference as GR
from replayssm_jax.gdn import testing as GT
from replayssm_jax.kda import reference as KR
from replayssm_jax.kda import testing as KT
from tests.harness import rows_changed

B, HK, HV, K, VD = 4, 2, 4, 8, 6


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
  """One delta-rule family's ops at the shape above."""
  name: str
  step: Callable  # the reference baseline step
  step_op: Callable  # the public step (its dispatcher)
  step_scan: Callable  # its scan: (s0, **seq) -> (o, states)
  replay_step: Callable
  materialize: Callable
  chunked_prefill: Callable
  replay_from: Callable  # (full [B, HV, K, VD], L, **kw) -> replay state
  random_state: Callable  # (key, L, counts, **kw) -> (rstate, full)
  inputs: Callable  # (key, T, batch=B, hk=HK, **kw) -> {name: [b, T, ..]}
  fill_stale_slots: Callable
  decays: str  # the log-decays' field: one entry per slot or per row
  decays_per_row: bool = False
  # `inputs` keywords of the widest gates the rule takes (the reference
  # tests' inputs)
  full_range: dict = dataclasses.field(default_factory=dict)
  rings: tuple[str, ...] = ("d_buf", "k_buf")  # one entry per slot

  @property
  def buffers(self) -> tuple[str, ...]:
    return self.rings + (self.decays,)


GDN = Family(
    name="gdn", step=GR.gdn_step, step_op=gdn.gdn_step,
    step_scan=GR.gdn_step_scan,
    replay_step=gdn.gdn_replay_step, materialize=gdn.gdn_materialize,
    chunked_prefill=gdn.gdn_chunked_prefill,
    replay_from=functools.partial(gdn.gdn_replay_state_from, num_k_heads=HK),
    random_state=lambda key, L, counts, **kw: GT.random_gdn_replay_state(
        key, B, HK, HV, K, VD, L, counts, **kw),
    inputs=lambda key, T, batch=B, hk=HK, **kw: GT.random_inputs(
        key, batch, hk, HV, K, VD, T=T, **kw),
    fill_stale_slots=GT.fill_stale_slots, decays="g_buf")

# Gates in [-3, 0] unless a test passes lower_bound (None: Kimi Linear's
# unbounded gate).
KDA = Family(
    name="kda", step=KR.kda_step, step_op=kda.kda_step,
    step_scan=KR.kda_step_scan,
    replay_step=kda.kda_replay_step, materialize=kda.kda_materialize,
    chunked_prefill=kda.kda_chunked_prefill,
    replay_from=kda.kda_replay_state_from,
    random_state=lambda key, L, counts, **kw: KT.random_kda_replay_state(
        key, B, HV, K, VD, L, counts, **kw),
    inputs=lambda key, T, batch=B, hk=HK, lower_bound=-3.0: KT.random_inputs(
        key, batch, hk, HV, K, VD, T=T, lower_bound=lower_bound),
    fill_stale_slots=KT.fill_stale_slots, decays="g_sum",
    decays_per_row=True, full_range=dict(lower_bound=None))

FAMILIES = (GDN, KDA)


def reference_inputs(fam: Family, seed, batch=B, T=None, hk=HK):
  """Fresh random inputs over the family's widest gates ([batch, ...] or
  [batch, T, ...]) and a random [batch, HV, K, VD] state (never zeros)."""
  inp = fam.inputs(jax.random.PRNGKey(seed), T, batch=batch, hk=hk,
                   **fam.full_range)
  state = jax.random.normal(jax.random.PRNGKey(seed + 1000),
                            (batch, HV, K, VD))
  return inp, state


def numpy_loop(state, q, k, v, g, beta, use_qk_l2norm=True, scale=None):
  """The delta rule token by token in float64 (transformers' recurrent
  form; g per head or per key channel): [b, T, ...] inputs -> (o [b, T,
  HV, V], final state)."""
  f = lambda x: np.asarray(x, np.float64)  # noqa: E731
  s, q, k, v, g, beta = map(f, (state, q, k, v, g, beta))
  rep = v.shape[2] // q.shape[2]
  q, k = np.repeat(q, rep, axis=2), np.repeat(k, rep, axis=2)
  if use_qk_l2norm:
    q, k = (x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
            for x in (q, k))
  q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
  out = []
  for t in range(q.shape[1]):
    decay = np.exp(g[:, t])
    s = s * decay.reshape(decay.shape + (1,) * (s.ndim - decay.ndim))
    kv = np.einsum("bhkv,bhk->bhv", s, k[:, t])
    d = beta[:, t][..., None] * (v[:, t] - kv)
    s = s + k[:, t][..., :, None] * d[..., None, :]
    out.append(np.einsum("bhkv,bhk->bhv", s, q[:, t]))
  return np.stack(out, 1), s


def assert_matches_values(fam: Family, inputs, want_o, want_state, tol):
  """The chunked prefill (chunks of 2), the stepwise scan and the float64
  loop on fixed `inputs` (q, k, v, g, beta, initial state) all give the
  values another implementation computed (transformers')."""
  q, k, v, g, beta, s0 = inputs
  o, s = fam.chunked_prefill(q, k, v, g, beta, chunk_size=2,
                             initial_state=s0)
  o_step, snaps = fam.step_scan(s0, q, k, v, g, beta)
  o64, s64 = numpy_loop(s0, q, k, v, g, beta)
  for how, o, s in (("chunked", o, s), ("stepwise", o_step, snaps[:, -1]),
                    ("float64 loop", o64, s64)):
    testing.assert_close(o, want_o, tol, f"{how} o")
    testing.assert_close(s, want_state, tol, f"{how} state")


def steps_for(fam: Family, seed, nsteps, **kw):
  """[T, batch, ...] token inputs."""
  inp = fam.inputs(jax.random.PRNGKey(seed), nsteps, **kw)
  return {n: jnp.swapaxes(x, 0, 1) for n, x in inp.items()}


@functools.partial(jax.jit, static_argnames=("fam", "policy"))
def run(fam: Family, rstate, full, steps, policy=None):
  """Baseline and replay over the same tokens in one scan -> (final replay
  state, per step: outputs o_b / o_r, states s_b / s_r (materialized),
  which rows wrote the checkpoint (and read copy), counts, max |k ring|)."""
  def body(carry, tok):
    r, s = carry
    o_b, s = fam.step(s, **tok)
    o_r, new = fam.replay_step(r, **tok, policy=policy)
    out = dict(o_b=o_b, o_r=o_r, s_b=s, s_r=fam.materialize(new),
               wrote=rows_changed(r.checkpoint, new.checkpoint),
               count=new.count, kmax=jnp.max(jnp.abs(new.k_buf.astype(
                   jnp.float32)), axis=(1, 2, 3)))
    if r.read_copy is not None:
      out["copy_wrote"] = rows_changed(r.read_copy, new.read_copy)
    return (new, s), out

  (final, _), out = jax.lax.scan(body, (rstate, full), steps)
  return final, out


def one_step_setup(fam: Family, L=8):
  """(counts, a random replay state at those counts, one token's inputs)."""
  counts = (0, L - 1, L // 2, 2)
  rstate, _ = fam.random_state(jax.random.PRNGKey(5), L, counts)
  tok = {n: x[0] for n, x in steps_for(fam, 6, 1).items()}
  return counts, rstate, tok
