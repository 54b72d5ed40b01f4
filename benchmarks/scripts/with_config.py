"""Runs a module with one kernel config class's defaults replaced.

For an A/B run of a kernel tuning candidate through a whole model before it
becomes a default: the model layers call the Pallas kernels through the
dispatcher, which builds the config class with no arguments
(`pallas_kernels._verify` and the others look the class up in
`pallas_kernels` at call time), so replacing that name changes what every
call in this process gets.

  PYTHONPATH=. python benchmarks/scripts/with_config.py VerifyConfig \\
      '{"readout_chunk": 64}' \\
      experiments.specdec_bench --config=configs/specdec_bench.py ...

The fields are checked by the class itself before the module runs.
Experiment tooling only: nothing in the library uses it. Session 31 ran
replay spec decoding this way (benchmarks/specdec_bench_h200.json runs
35-37).
"""

import functools
import json
import runpy
import sys

import pallas_kernels as pk


def main():
  if len(sys.argv) < 4:
    sys.exit(f"usage: {sys.argv[0]} CONFIG_CLASS JSON_FIELDS MODULE [ARGS]")
  name, fields, module = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
  cls = getattr(pk, name, None)
  if not isinstance(cls, type):
    sys.exit(f"with_config: pallas_kernels has no config class {name!r}")
  cls(**fields)  # fails here on an unknown or bad field
  setattr(pk, name, functools.partial(cls, **fields))
  print(f"with_config: {name}({fields}) as the dispatcher default",
        flush=True)
  sys.argv = [module, *sys.argv[4:]]
  runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
