"""Registers, spills and SASS of the replay kernels, compiled on a CPU.

No GPU needed: each `pallas_call` of `pallas_kernels.replay_state_update`
is lowered for CUDA on the CPU (`.lower(lowering_platforms=("cuda",))`),
which yields its Triton module; the pip `triton` package then runs its own
TTIR pipeline (whose combine pass, e.g., turns `acc + dot(a, b, 0)` into
`dot(a, b, acc)`), its TTGIR / LLVM / PTX stages for sm_90a, ptxas (`-v`:
registers and spills) and cuobjdump (an opcode count of the SASS).

The GPU machine's XLA compiles the same module with the Triton bundled in
its jaxlib, a different version, so the figures are estimates, good for
ranking candidates before spending device time. Pallas' default
`num_stages` is 1 (no pipelining); pass `--stages` to match a config's
`num_stages`.

  pip install triton   # not a project dependency
  PYTHONPATH=. python benchmarks/scripts/triton_offline.py \\
      --dtype float16 --warps 2,4 --config flush_max_registers=168
  PYTHONPATH=. python benchmarks/scripts/triton_offline.py --op gdn_verify \\
      --dtype float32 --warps 1,4 --config block_v=16

Prints one line per (kernel, warps): registers, spill bytes, SASS
instruction count and the most frequent opcodes. `--out DIR` keeps each
kernel's TTIR, TTGIR, PTX and cubin there.
"""

import argparse
import ast
import collections
import contextlib
import glob
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import replay
from pallas_kernels import gdn as gdn_kernels
from pallas_kernels import verify as verify_kernel
from replayssm_jax import testing
from replayssm_jax.gdn.state import GDNReplayState
from replayssm_jax.state import ReplayState


@contextlib.contextmanager
def _capture_triton_modules():
  """Collects the Triton module text of every pallas_call lowered inside
  (a private jax hook: fails loudly if jax moves it)."""
  from jax._src.pallas.triton import pallas_call_registration as pcr  # pylint: disable=g-import-not-at-top
  # The register-cap hook wraps the same lowering function; install it
  # first so the capture sees the capped modules.
  pk.triton_utils.install_register_cap_hook()
  modules = []
  original = pcr.lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = original(*args, **kwargs)
    op = result.module.operation
    modules.append((op.attributes["sym_name"].value
                    if "sym_name" in op.attributes else f"k{len(modules)}",
                    op.get_asm(enable_debug_info=False)))
    return result

  pcr.lowering.lower_jaxpr_to_triton_module = capture
  try:
    yield modules
  finally:
    pcr.lowering.lower_jaxpr_to_triton_module = original


def _shapes(batch, nheads, headdim, dstate, ngroups, buffer_len,
            checkpoint_dtype, window=None):
  """ShapeDtypeStructs of a ReplayState and of a token's (window None) or
  a window's inputs, at the benchmarks' dtypes (bf16 activations and
  buffers, f32 dt buffer)."""
  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  t = () if window is None else (window,)
  inputs = dict(x=sds((batch, *t, nheads, headdim), bf16),
                dt=sds((batch, *t, nheads), bf16),
                B=sds((batch, *t, ngroups, dstate), bf16),
                C=sds((batch, *t, ngroups, dstate), bf16))
  rstate = ReplayState(
      checkpoint=sds((batch, nheads, headdim, dstate), checkpoint_dtype),
      x_buf=sds((batch, buffer_len, nheads, headdim), bf16),
      b_buf=sds((batch, buffer_len, ngroups, dstate), bf16),
      dt_buf=sds((batch, buffer_len, nheads), jnp.float32),
      count=sds((batch,), jnp.int32))
  return rstate, inputs


def replay_step(*, batch, nheads, headdim, dstate, ngroups, buffer_len,
                checkpoint_dtype, config=None, read_dtype=None):
  """(step, (rstate, tokens)): one replay step and ShapeDtypeStructs of
  its arguments (`_shapes`); read_dtype: a read copy of this dtype (8-bit
  ones with their scales)."""
  params = testing.random_params(jax.random.PRNGKey(0), nheads)
  rstate, tok = _shapes(batch, nheads, headdim, dstate, ngroups, buffer_len,
                        checkpoint_dtype)
  if read_dtype is not None:
    read_dtype = jnp.dtype(read_dtype)
    rstate = rstate.replace(
        read_copy=jax.ShapeDtypeStruct(rstate.checkpoint.shape, read_dtype),
        read_scale=(jax.ShapeDtypeStruct((batch, nheads, headdim),
                                         jnp.float32)
                    if read_dtype.itemsize == 1 else None))
  config = config or pk.ReplayConfig()

  def step(rs, tk):
    return replay.replay_state_update(rs, **tk, **params, dt_softplus=True,
                                      config=config)

  return step, (rstate, tok)


def _modules(fn, *args):
  """{kernel name: Triton module text} of fn's pallas_calls (shapes only)."""
  with _capture_triton_modules() as modules:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return dict(modules)


def triton_modules(**kw):
  """The Triton modules of one replay step (keywords of replay_step)."""
  step, args = replay_step(**kw)
  return _modules(step, *args)


def verify_modules(*, batch, nheads, headdim, dstate, ngroups, buffer_len,
                   checkpoint_dtype, window=4, config=None, **unused):
  """The Triton modules of one speculative verify
  (`pallas_kernels.replay_verify`) at `_shapes`' dtypes, no z."""
  del unused
  params = testing.random_params(jax.random.PRNGKey(0), nheads)
  rstate, win = _shapes(batch, nheads, headdim, dstate, ngroups, buffer_len,
                        checkpoint_dtype, window)
  config = config or pk.VerifyConfig()

  def verify(rs, w):
    return verify_kernel.replay_verify(
        rs, **w, A=params["A"], D=params["D"], dt_bias=params["dt_bias"],
        dt_softplus=True, config=config)

  return _modules(verify, rstate, win)


def gdn_modules(*, batch, buffer_len, checkpoint_dtype, window=4,
                config=None, read_dtype=None):
  """The Triton modules of one Gated DeltaNet speculative verify
  (`pallas_kernels.gdn.gdn_replay_verify`), or of one replay step
  (`gdn_replay_step`) where window is None, at the Qwen3.5-shaped layer of
  gdn_kernel_bench.py (16 key / 32 value heads of 128; bf16 inputs and
  rings, f32 g); read_dtype: a read copy of this dtype (8-bit ones with
  their scales)."""
  sds, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
  hk, hv, k, v = 16, 32, 128, 128
  copy = {}
  if read_dtype is not None:
    read_dtype = jnp.dtype(read_dtype)
    copy = dict(read_copy=sds((batch, hv, k, v), read_dtype),
                read_scale=(sds((batch, hv, k), f32)
                            if read_dtype.itemsize == 1 else None))
  rs = GDNReplayState(
      checkpoint=sds((batch, hv, k, v), checkpoint_dtype),
      d_buf=sds((batch, buffer_len, hv, v), bf16),
      k_buf=sds((batch, buffer_len, hk, k), bf16),
      g_buf=sds((batch, buffer_len, hv), f32),
      count=sds((batch,), jnp.int32), **copy)
  t = (batch,) if window is None else (batch, window)
  win = dict(q=sds(t + (hk, k), bf16), k=sds(t + (hk, k), bf16),
             v=sds(t + (hv, v), bf16), g=sds(t + (hv,), f32),
             beta=sds(t + (hv,), f32))
  fn = (gdn_kernels.gdn_replay_step if window is None
        else gdn_kernels.gdn_replay_verify)
  return _modules(lambda r, w: fn(r, **w, config=config), rs, win)


def _tool(name):
  """A CUDA binary shipped with the pip triton package (the newest ptxas
  first: the plain one may be older than the PTX triton emits)."""
  import triton  # pylint: disable=g-import-not-at-top
  found = sorted(glob.glob(os.path.join(os.path.dirname(triton.__file__),
                                        "backends", "nvidia", "bin",
                                        name + "*")), reverse=True)
  if not found:
    raise FileNotFoundError(f"no {name} in the triton package")
  return found


def compile_module(text, *, num_warps, num_stages, workdir):
  """ptxas registers / spills and the SASS opcode counts of one module."""
  # Keep FMA contraction on (triton 3.9 warns when this is unset).
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
  import triton  # pylint: disable=g-import-not-at-top
  from triton._C.libtriton import ir  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  from triton.compiler.compiler import make_backend  # pylint: disable=g-import-not-at-top
  # Attributes XLA's Triton prints that the pip package's parser rejects
  # (they do not change the register allocation).
  text = re.sub(r" evictionPolicy = evict_\w+", "", text)
  src = os.path.join(workdir, "kernel.ttir")
  with open(src, "w") as f:
    f.write(text)
  target = GPUTarget("cuda", 90, 32)
  backend = make_backend(target)
  options = backend.parse_options(dict(num_warps=num_warps,
                                       num_stages=num_stages))
  ctx = ir.context()
  ir.load_dialects(ctx)
  backend.load_dialects(ctx)
  module = ir.parse_mlir_module(src, ctx)
  module.context = ctx
  # A .ttir source skips triton's TTIR stage; run it here (combine, ...).
  module = backend.make_ttir(module, {}, options, target.arch)
  opt = os.path.join(workdir, f"kernel.w{num_warps}.ttir")
  with open(opt, "w") as f:
    f.write(str(module))
  kernel = triton.compile(opt, target=target, options=dict(
      num_warps=num_warps, num_stages=num_stages))
  with open(os.path.join(workdir, f"kernel.w{num_warps}.ttgir"), "w") as f:
    f.write(kernel.asm["ttgir"])  # the layouts and shared-memory copies
  ptx = os.path.join(workdir, f"kernel.w{num_warps}.ptx")
  with open(ptx, "w") as f:
    f.write(kernel.asm["ptx"])
  cubin = os.path.join(workdir, f"kernel.w{num_warps}.cubin")
  for ptxas in _tool("ptxas"):
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx, "-o", cubin],
                         capture_output=True, text=True, check=False)
    if run.returncode == 0:
      break
  else:
    raise RuntimeError(f"ptxas failed: {run.stderr[-500:]}")
  regs = int(re.search(r"Used (\d+) registers", run.stderr).group(1))
  spill = re.search(r"(\d+) bytes spill stores", run.stderr)
  sass = subprocess.run([_tool("cuobjdump")[0], "-sass", cubin],
                        capture_output=True, text=True, check=True).stdout
  ops = collections.Counter(
      m.group(1).split(".")[0] for m in re.finditer(
          r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
  return dict(registers=regs, spill_bytes=int(spill.group(1)) if spill else 0,
              instructions=sum(ops.values()), opcodes=ops.most_common(12))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dtype", default="float16", help="checkpoint dtype")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--warps", default="2,4", help="num_warps to compile at")
  ap.add_argument("--stages", type=int, default=1, help="num_stages")
  ap.add_argument("--config", default="",
                  help="ReplayConfig fields, e.g. flush_max_registers=128")
  ap.add_argument("--read_dtype", default=None,
                  help="a read copy of this dtype (e.g. float8_e4m3fn)")
  ap.add_argument("--kernels", default="", help="name substrings to keep")
  ap.add_argument("--op", default="step",
                  choices=("step", "verify", "gdn_verify", "gdn_step"),
                  help="the replay step's kernels (ReplayConfig fields in "
                  "--config) or the speculative verify's at hybrid_1b's "
                  "layer, window 4 (VerifyConfig fields); gdn_verify: the "
                  "Gated DeltaNet verify's at the Qwen3.5-shaped layer, "
                  "window 4 (GDNConfig fields; --warps overrides "
                  "num_warps); gdn_step: its replay step's")
  ap.add_argument("--out", default="", help="keep TTIR/PTX/cubin here")
  a = ap.parse_args()
  fields = {}
  for item in filter(None, a.config.split(",")):
    key, value = item.split("=", 1)
    fields[key.strip()] = ast.literal_eval(value.strip())
  if a.op in ("gdn_verify", "gdn_step"):
    modules = gdn_modules(
        batch=a.batch, buffer_len=a.buffer_len,
        checkpoint_dtype=jnp.dtype(a.dtype),
        window=4 if a.op == "gdn_verify" else None,
        config=gdn_kernels.GDNConfig(**fields), read_dtype=a.read_dtype)
  elif a.op == "verify":
    modules = verify_modules(
        batch=a.batch, nheads=64, headdim=64, dstate=128, ngroups=8,
        buffer_len=a.buffer_len, checkpoint_dtype=jnp.dtype(a.dtype),
        config=pk.VerifyConfig(**fields))
  else:
    modules = triton_modules(
        batch=a.batch, nheads=128, headdim=64, dstate=128, ngroups=8,
        buffer_len=a.buffer_len, checkpoint_dtype=jnp.dtype(a.dtype),
        config=pk.ReplayConfig(**fields), read_dtype=a.read_dtype)
  keep = list(filter(None, a.kernels.split(",")))
  for name, text in modules.items():
    if keep and not any(k in name for k in keep):
      continue
    for warps in (int(w) for w in a.warps.split(",")):
      workdir = (os.path.join(a.out, f"{name}.w{warps}") if a.out
                 else tempfile.mkdtemp())
      os.makedirs(workdir, exist_ok=True)
      r = compile_module(text, num_warps=warps, num_stages=a.stages,
                         workdir=workdir)
      top = " ".join(f"{op}:{n}" for op, n in r["opcodes"])
      print(f"{name} warps={warps}: {r['registers']} registers, "
            f"{r['spill_bytes']} B spilled, {r['instructions']} SASS "
            f"instructions ({top})", flush=True)


if __name__ == "__main__":
  main()
