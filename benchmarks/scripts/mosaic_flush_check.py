"""Checks the Mosaic GPU flush (`replay.mosaic_flush.flush`) against
the reference element by element at GPU shapes and prints where they
differ (which rows, heads, headdim rows; y and the checkpoint apart), for
each checkpoint dtype and fold. A diagnostic for the GPU, where interpret
mode's tests cannot see register layouts or the TMA pipeline:

  python benchmarks/scripts/mosaic_flush_check.py
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.replay import mosaic_flush
from replayssm_jax import reference, testing


def main():
  print("device", jax.devices()[0].device_kind, "jax", jax.__version__)
  b, h, p, n, g, L = 4, 16, 64, 128, 2, 16
  counts = np.array([L - 1, 3, L - 1, 0])
  flush = counts == L - 1
  ok = True
  for ckdt in (jnp.float32, jnp.float16):
    for with_z in (False, True):
      for pieces in (0, None):
        key = jax.random.PRNGKey(3)
        params = testing.random_params(key, h, with_D=True,
                                       with_dt_bias=True)
        tok = testing.random_step_inputs(jax.random.PRNGKey(4), b, h, p, n,
                                         g, jnp.bfloat16, with_z=with_z)
        rs, _ = testing.random_replay_state(
            key, b, h, p, n, g, L, counts, params["A"],
            checkpoint_dtype=ckdt, buffer_dtype=jnp.bfloat16)
        y_ref, r_ref = reference.replay_state_update(
            rs, **tok, **params, dt_softplus=True)
        fn = jax.jit(lambda ck: mosaic_flush.flush(
            ck, rs.x_buf, rs.b_buf, rs.dt_buf, rs.count, tok["x"],
            tok["dt"], params["A"], tok["B"], tok["C"], params["D"],
            tok.get("z"), params["dt_bias"], True, fold_pieces=pieces,
            interpret=jax.default_backend() != "gpu"))
        if ckdt == jnp.float32 and not with_z and pieces is None:
          # How the call's outputs alias its inputs, as compiled here.
          hlo = fn.lower(rs.checkpoint).compile().as_text()
          for line in hlo.splitlines():
            if "custom-call(" in line:
              alias = re.search(r"output_to_operand_aliasing=\{[^}]*\}", line)
              print("  hlo:", line.strip()[:160], "...",
                    alias.group(0) if alias else "(no aliasing)")
        y, ck = fn(rs.checkpoint)
        y, yr = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
        c, cr = (np.asarray(v, np.float32) for v in (ck, r_ref.checkpoint))
        c0 = np.asarray(rs.checkpoint, np.float32)
        ey = np.abs(y - yr)[flush] / np.abs(yr[flush]).max()
        ec = np.abs(c - cr)[flush] / np.abs(cr[flush]).max()
        same_nonflush = bool((c[~flush] == c0[~flush]).all())
        name = (f"{jnp.dtype(ckdt).name} z={with_z} fold_pieces={pieces}")
        good = ey.max() < 3e-2 and ec.max() < 3e-2 and same_nonflush
        ok &= bool(good)
        print(f"{name}: y err {ey.max():.2e} (nan {np.isnan(y[flush]).sum()},"
              f" bad {(ey > 3e-2).sum()} of {ey.size}), state err "
              f"{ec.max():.2e}, non-flush rows' checkpoint untouched {same_nonflush}: "
              f"{'PASS' if good else 'FAIL'}")
        if ey.max() >= 3e-2 or np.isnan(ey).any():
          bad = np.argwhere(~(ey < 3e-2))
          print("  first bad (flush row, head, p):", bad[:8].tolist())
          rows = np.nonzero(flush)[0]
          r0, h0 = rows[bad[0][0]], bad[0][1]
          print("  y   ", np.round(y[r0, h0, :16], 4).tolist())
          print("  ref ", np.round(yr[r0, h0, :16], 4).tolist())
          print("  bad p per head:", sorted({int(v) for v in bad[:, 2]})[:64])
  ok &= check_replay_steps(8)
  ok &= check_replay_steps(128)
  ok &= check_replay_steps(512)  # the counters reach SMEM in two TMA copies
  ok &= check_model_decode()
  print("ALL PASS" if ok else "SOME FAILED")


def check_model_decode(batch=128, steps=40):
  """A bf16 hybrid model's teacher-forced decode steps (jitted, state
  donated) with the default Pallas kernels (f32 checkpoint at batch 128:
  the Mosaic flush) and with the flush route forced to Triton, each against
  the XLA reference ops: the Mosaic flush's logits error must be no larger
  than twice the Triton flush's (plus 1e-3)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from pallas_kernels import replay as replay_kernel  # pylint: disable=g-import-not-at-top
  from replayssm_jax import models  # pylint: disable=g-import-not-at-top
  cfg = models.ModelConfig(vocab_size=256, d_model=256, pattern="M-M*M-",
                           ssm_heads=8, head_dim=64, d_state=128, n_groups=2,
                           chunk_size=16, num_heads=4, num_kv_heads=2,
                           attn_head_dim=64, intermediate_size=512,
                           dtype="bfloat16", param_dtype="bfloat16")
  model = models.HybridLM(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(0, 256, (batch, 24)), jnp.int32)
  lengths = jnp.asarray(rng.integers(5, 25, batch), jnp.int32)
  tokens = jnp.asarray(rng.integers(0, 256, (steps, batch)), jnp.int32)

  def run(implementation):
    state = model.init_state(batch, 24 + steps, "replay", 16)
    _, state = models.prefill(model, prompts, lengths, state)
    out = []
    for t in range(steps):
      logits, state = models.decode_step(model, tokens[t], state,
                                         implementation)
      out.append(np.asarray(logits, np.float32))
    return np.stack(out)

  ref = run("reference")
  mosaic = run(None)
  resolve = replay_kernel.default_flush_route
  replay_kernel.default_flush_route = (
      lambda config, *a, **k: resolve(
          config if config.flush_route else
          dataclasses.replace(config, flush_route="triton"), *a, **k))
  jax.clear_caches()  # _decode_jit would reuse the default's compilation
  try:
    triton = run(None)
  finally:
    replay_kernel.default_flush_route = resolve
    jax.clear_caches()
  scale = np.abs(ref).max()
  e_m, e_t = (float(np.abs(v - ref).max() / scale) for v in (mosaic, triton))
  good = e_m <= 2 * e_t + 1e-3
  print(f"model decode, batch {batch}, {steps} steps: logits err vs the "
        f"reference ops: default (Mosaic flush) {e_m:.2e}, Triton flush "
        f"{e_t:.2e}: {'PASS' if good else 'FAIL'}")
  return good


def check_replay_steps(b=8):
  """replay_state_update with flush_route='mosaic_gpu' (the Triton output
  route, then the Mosaic flush) and with the default config (at batch >=
  128 on an f32 checkpoint: the same Mosaic flush, on its persistent grid)
  against the reference: one step, and L steps in a lax.scan from
  staggered counters (every row flushes once)."""
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  import replayssm_jax as rsj  # pylint: disable=g-import-not-at-top
  h, p, n, g, L = 16, 64, 128, 2, 16
  counts = (L - 1 - np.arange(b)) % L
  key = jax.random.PRNGKey(5)
  params = testing.random_params(key, h, with_D=True, with_dt_bias=True)
  rs, _ = testing.random_replay_state(key, b, h, p, n, g, L, counts,
                                      params["A"], checkpoint_dtype=jnp.float32,
                                      buffer_dtype=jnp.bfloat16)
  toks = [testing.random_step_inputs(jax.random.PRNGKey(10 + t), b, h, p, n,
                                     g, jnp.bfloat16, with_z=False)
          for t in range(L)]
  xs = jax.tree.map(lambda *v: jnp.stack(v), *toks)
  ok = True
  if jax.default_backend() == "gpu":
    print(f"batch {b}: ReplayConfig() resolves to flush_route="
          + pk.replay_kernel.default_flush_route(
              pk.ReplayConfig(), rs, True, False).flush_route)
  for impl, cfg in (("reference", None),
                    ("pallas", pk.ReplayConfig(flush_route="mosaic_gpu")),
                    ("pallas", pk.ReplayConfig())):
    kw = {} if cfg is None else dict(config=cfg)

    def step(r, t, impl=impl, kw=kw):
      y, r = rsj.replay_state_update(r, **t, **params, dt_softplus=True,
                                     implementation=impl, **kw)
      return r, y

    if impl == "pallas" and jax.default_backend() == "gpu":
      # Whole-checkpoint copies in the compiled step (interpret mode on the
      # CPU copies blocks through its own loops: not counted there).
      hlo = jax.jit(step, donate_argnums=0).lower(rs, toks[0]).compile()
      shape = f"[{','.join(map(str, rs.checkpoint.shape))}]"
      copies = [ln for ln in hlo.as_text().splitlines()
                if " copy(" in ln and shape in ln.split("=")[1][:40]]
      print(f"batch {b} flush_route={cfg.flush_route}: {len(copies)} checkpoint "
            f"copies in the compiled step")
      ok &= not copies
    y1 = jax.jit(step)(rs, toks[0])[1]
    rL, ys = jax.jit(lambda r: jax.lax.scan(step, r, xs))(rs)
    if impl == "reference":
      ref1, refs, ref_ck = y1, ys, rL.checkpoint
      continue
    y1, ys, ref1, refs = (np.asarray(v, np.float32)
                          for v in (y1, ys, ref1, refs))
    e1 = np.abs(y1 - ref1).max(axis=(1, 2)) / np.abs(ref1).max()
    es = np.abs(ys - refs).max(axis=(2, 3)) / np.abs(refs).max()  # [L, b]
    eck = np.abs(np.asarray(rL.checkpoint, np.float32)
                 - np.asarray(ref_ck, np.float32)).max()
    good = e1.max() < 3e-2 and es.max() < 3e-2
    ok &= bool(good)
    print(f"batch {b} flush_route={cfg.flush_route}: one step y err per row {np.round(e1, 4).tolist()}"
          f" (flush row 0); scan max y err {es.max():.2e}, checkpoint abs "
          f"err {eck:.2e}: {'PASS' if good else 'FAIL'}")
    if not good:
      bad = np.argwhere(es >= 3e-2)
      print("  scan (step, row) bad:", bad[:16].tolist(),
            "flush step of each row:", ((L - 1 - counts) % L).tolist())
  return ok


if __name__ == "__main__":
  main()
