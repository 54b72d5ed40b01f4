"""The state readout y0 = S C alone, in several forms, on an 8-bit / 16-bit
state: is a tensor-core readout cheaper than the output route's
elementwise one, and how close does either come to a plain read?

The replay output route on an fp8 read copy is bound by instruction issue
(Nsight Compute, benchmarks/README.md "Session 17"): per stored element a
conversion, a multiply and an add. Forms timed here (the Pallas ones: one
Triton program per (row, head) tile [headdim, dstate]):

* `xla_sum_u32`: a plain read of the bytes (XLA's sum of their uint32
  view), `xla`: XLA's einsum, for scale.
* `elementwise`: the route's form, sum_n f32(S[p, n]) C[n] (also with
  the tiles of 2 / 4 heads per program loaded together).
* `dot_fp8`: one fp8 tensor-core dot [P, N] x [N, 16] of the stored e4m3
  tile with C cut into three e4m3 pieces (columns 0-2: C 2^s = c0 +
  2^-4 c1 + 2^-8 c2 + r, |r| ~ 2^-12 max|C 2^s|), so the tile is never
  converted; y0 = 2^-s (d0 + 2^-4 d1 + 2^-8 d2).
* `dot_f16`: the tile converted to f16 and one f16 dot with C in two f16
  pieces (hi, lo).

Each is checked against the f32 einsum, then timed as the median of
t(2n) - t(n) over jitted loops (the tile set is larger than the L2).

  PYTHONPATH=. python benchmarks/scripts/readout_micro.py --out /tmp/ro
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
E4M3 = jnp.float8_e4m3fn
NCOL = 16  # the dots' N (Pallas Triton dots need every dim >= 16)


_STEP = 16.0  # each fp8 piece holds the previous one's residual times this
# The dots' column weights: y0 = sum_k w_k d_k over the pieces' columns.
FP8_WEIGHTS = [1.0, 1 / _STEP, 1 / _STEP ** 2] + [0.0] * (NCOL - 3)
F16_WEIGHTS = [1.0, 1.0] + [0.0] * (NCOL - 2)


def fp8_pieces(C):
  """[..., N] -> ([..., N, NCOL] e4m3 pieces, [...] f32 2^-s)."""
  C = C.astype(F32)
  amax = jnp.max(jnp.abs(C), axis=-1, keepdims=True)
  s = jnp.floor(jnp.log2(448.0 / jnp.maximum(amax, 1e-30)))
  u = C * jnp.exp2(s)
  cols = []
  for _ in range(3):
    p = u.astype(E4M3)
    cols.append(p)
    u = (u - p.astype(F32)) * _STEP
  pad = jnp.zeros(C.shape + (NCOL - 3,), E4M3)
  return (jnp.concatenate([jnp.stack(cols, -1), pad], -1),
          jnp.exp2(-s)[..., 0])


def f16_pieces(C):
  C = C.astype(F32)
  hi = C.astype(jnp.float16)
  lo = (C - hi.astype(F32)).astype(jnp.float16)
  pad = jnp.zeros(C.shape + (NCOL - 2,), jnp.float16)
  return jnp.concatenate([jnp.stack([hi, lo], -1), pad], -1)


def _specs(S, per_group, cshape, hp):
  P, N = S.shape[2:]
  tile = pl.BlockSpec((None, hp, P, N), lambda b, h: (b, h, 0, 0))
  cvec = pl.BlockSpec((None, None) + cshape,
                      lambda b, h: (b, h * hp // per_group)
                      + (0,) * len(cshape))
  out = pl.BlockSpec((None, hp, P), lambda b, h: (b, h, 0))
  return [tile, cvec], out


def readout(S, Cin, form, warps, interpret=False, hp=1):
  """y0 [batch, nheads, P] f32 of S [batch, nheads, P, N] and the C operand
  of `form` ([batch, ngroups, N] f32, or its pieces); hp heads (of one
  group) per program, their tiles loaded together (elementwise only)."""
  batch, nheads, P, N = S.shape
  per_group = nheads // Cin.shape[1]
  cshape = Cin.shape[2:]
  w = jnp.array(F16_WEIGHTS if form == "dot_f16" else FP8_WEIGHTS, F32)

  def kernel(s_ref, c_ref, w_ref, o_ref):
    s = s_ref[...]
    if form == "elementwise":
      o_ref[...] = jnp.sum(s.astype(F32) * c_ref[...][None, None, :],
                           axis=2)
      return
    s = s[0]
    if form == "dot_f16":
      s = s.astype(jnp.float16)
    acc = jnp.dot(s, c_ref[...], preferred_element_type=F32)  # [P, NCOL]
    o_ref[...] = jnp.sum(acc * w_ref[...][None, :], axis=1)[None]

  in_specs, out_spec = _specs(S, per_group, cshape, hp)
  in_specs.append(pl.BlockSpec((NCOL,), lambda b, h: (0,)))
  return pl.pallas_call(
      kernel, grid=(batch, nheads // hp), in_specs=in_specs, out_specs=out_spec,
      out_shape=jax.ShapeDtypeStruct((batch, nheads, P), F32),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
      interpret=interpret, name=f"readout_{form}")(S, Cin, w)


def operands(form, C):
  if form == "dot_fp8":
    return fp8_pieces(C)
  if form == "dot_f16":
    return f16_pieces(C), None
  return C.astype(F32), None


def timed(fn, args, n0=8):
  @jax.jit
  def loop(n, *args):
    def body(i, acc):
      return acc + fn(*args)[0, 0, 0] * 1e-9
    return jax.lax.fori_loop(0, n, body, jnp.zeros((), F32))

  def t(n):
    jax.block_until_ready(loop(n, *args))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(n, *args))
    return time.perf_counter() - t0

  n = n0
  while t(2 * n) - t(n) < 0.02:
    n *= 2
  ds = sorted((t(2 * n) - t(n)) / n for _ in range(7))
  return ds[len(ds) // 2] * 1e6


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--out", default=None)
  ap.add_argument("--interpret", action="store_true")
  a = ap.parse_args()
  nheads, P, N, G = (128, 64, 128, 8) if not a.interpret else (4, 16, 32, 2)
  key = jax.random.PRNGKey(0)
  k1, k2 = jax.random.split(key)
  S32 = jax.random.normal(k1, (a.batch, nheads, P, N), F32)
  C = jax.random.normal(k2, (a.batch, G, N), F32).astype(jnp.bfloat16)
  results = dict(device=str(jax.devices()[0].device_kind),
                 jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                         time.gmtime()),
                 batch=a.batch, rows=[])
  for sdt in (E4M3, jnp.float16):
    S = S32.astype(sdt)
    Cg = jnp.repeat(C.astype(F32), nheads // G, axis=1)
    ref = jnp.einsum("bhpn,bhn->bhp", S.astype(F32), Cg,
                     precision=jax.lax.Precision.HIGHEST)
    nbytes = S.size * S.dtype.itemsize
    variants = [("xla", 0, 1), ("xla_sum_u32", 0, 1)] + [
        (form, warps, hp) for form in ("elementwise", "dot_fp8", "dot_f16")
        for warps in (2, 4) for hp in ((1, 2, 4) if form == "elementwise"
                                       else (1,))
        if not (form == "dot_fp8" and sdt != E4M3)
        and (nheads // G) % hp == 0]
    for form, warps, hp in variants:
      cin, scale = operands(form, C)
      row = dict(state=jnp.dtype(sdt).name, form=form, warps=warps,
                 heads_per_program=hp)
      try:
        if form == "xla_sum_u32":  # a read of the bytes, no math
          fn = jax.jit(lambda S, cin, scale: jnp.zeros(S.shape[:3], F32)
                       + jnp.sum(jax.lax.bitcast_convert_type(
                           S.reshape(-1, 4 // S.dtype.itemsize),
                           jnp.uint32)).astype(F32) * 0.0)
        elif form == "xla":
          fn = jax.jit(lambda S, cin, scale: jnp.einsum(
              "bgkpn,bgn->bgkp",
              S.reshape(S.shape[0], G, -1, *S.shape[2:]).astype(F32),
              cin).reshape(S.shape[:3]))
        else:
          fn = jax.jit(lambda S, cin, scale, form=form, warps=warps, hp=hp: (
              readout(S, cin, form, warps, a.interpret, hp)
              * (1.0 if scale is None
                 else jnp.repeat(scale, nheads // G, axis=1)[..., None])))
        y = fn(S, cin, scale)
        err = (float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
               if form != "xla_sum_u32" else None)
        row["max_rel_err"] = err
        if not a.interpret:
          us = timed(fn, (S, cin, scale))
          row.update(us=us, gbps=nbytes / us / 1e3)
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
      print(json.dumps(row), flush=True)
      results["rows"].append(row)
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "readout_micro.json"), "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
