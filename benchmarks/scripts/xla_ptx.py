"""The PTX that XLA compiles for the replay step's kernels, on the GPU.

Compiles one replay step (Nemotron-H 8B layer shapes, no data) with XLA's
dump on, then prints, for each replayssm_* kernel entry in the dumped PTX,
its launch directives (`.reqntid`, and `.maxnreg` when
`ReplayConfig.flush_max_registers` capped it) and, where a `ptxas` is on
the PATH, its registers and spills. `--out` keeps the PTX files (the
registers can then be read on any machine with `ptxas -arch=sm_90a -v`).

  PYTHONPATH=. python benchmarks/scripts/xla_ptx.py --dtype float16 \\
      --config flush_num_warps=4,flush_max_registers=128 --out $OUT/ptx
"""

import argparse
import ast
import glob
import os
import re
import shutil
import subprocess
import tempfile


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dtype", default="float16", help="checkpoint dtype")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--buffer_len", type=int, default=16)
  ap.add_argument("--config", default="",
                  help="ReplayConfig fields, e.g. flush_max_registers=128")
  ap.add_argument("--out", default="", help="copy the PTX files here")
  a = ap.parse_args()
  dump = tempfile.mkdtemp()
  # Before jax is imported: XLA reads its flags once.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_dump_to={dump}"
                             " --xla_dump_hlo_as_text")
  # A persistent-cache hit would skip the compile and its dump.
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import pallas_kernels as pk  # pylint: disable=g-import-not-at-top
  import triton_offline  # pylint: disable=g-import-not-at-top

  fields = {}
  for item in filter(None, a.config.split(",")):
    key, value = item.split("=", 1)
    fields[key.strip()] = ast.literal_eval(value.strip())
  step, args = triton_offline.replay_step(
      batch=a.batch, nheads=128, headdim=64, dstate=128, ngroups=8,
      buffer_len=a.buffer_len, checkpoint_dtype=jnp.dtype(a.dtype),
      config=pk.ReplayConfig(**fields))
  jax.jit(step).lower(*args).compile()
  ptxas = shutil.which("ptxas")
  files = sorted(glob.glob(os.path.join(dump, "**", "*.ptx"),
                          recursive=True))
  if not files:
    raise SystemExit(f"no PTX dumped under {dump}: "
                     f"{sorted(os.listdir(dump))[:40]}")
  for path in files:
    text = open(path).read()
    for m in re.finditer(r"\.entry (replayssm\w*)\(.*?\)\s*((?:\.\w+[^\n{]*\n)*)",
                         text, re.S):
      directives = " ".join(m.group(2).split())
      line = f"{m.group(1)}: {directives or '(no directives)'}"
      if ptxas:
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o",
                              os.devnull], capture_output=True, text=True,
                             check=False)
        regs = re.findall(rf"Compiling entry function '{m.group(1)}'.*?"
                          r"Used (\d+) registers", run.stderr, re.S)
        if regs:
          line += f"; ptxas: {regs[0]} registers"
      print(line, flush=True)
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    for path in files:
      shutil.copy(path, a.out)


if __name__ == "__main__":
  main()
