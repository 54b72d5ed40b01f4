"""The conv state's decode write: shifting window vs ring buffer (GPU).

Per SSM mode and conv form (`shift`: the oldest-first window shifted every
step, `MambaState.conv_start=None`; `ring`: the ring buffer's one-slot
write, `replayssm_jax.conv.causal_conv1d_update_ring`): the copies of >= 1
MiB in the optimized HLO of decode_bench's decode loop, the decode step's
time (decode_bench's `bench_mode`: prefill, then the best of `--repeats`
timed loops of `--new_tokens` greedy steps) and whether the loop's last
greedy tokens equal the shift form's. (Commit f801ea8 of this script also
timed the ring's slot written by a scatter, with and without an
optimization barrier: benchmarks/decode_step/conv_state_ring_hybrid_1b_b256_h200.json.)

  PYTHONPATH=. python benchmarks/scripts/conv_ring_check.py \
      --config configs/hybrid_1b.py --batch 256 --out $OUT/conv_ring.json
"""

import argparse
import datetime
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step_profile import load_config  # noqa: E402
from specdec_profile import big_copies  # noqa: E402

from experiments import decode_bench as DB  # noqa: E402
from replayssm_jax.models import MambaState, ModelConfig  # noqa: E402


def _shifting(state):
  """The state with conv_start None: the shifting conv update."""
  return state.replace(layers=tuple(
      s.replace(conv_start=None) if isinstance(s, MambaState) else s
      for s in state.layers))


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--config", default="configs/hybrid_1b.py")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--prompt_len", type=int, default=0,
                  help="0: the config's bench.prompt_len")
  ap.add_argument("--prefill_rows", type=int, default=0,
                  help="0: the config's bench.prefill_rows")
  ap.add_argument("--forms", default="shift,ring")
  ap.add_argument("--modes", default="replay,baseline")
  ap.add_argument("--out", required=True)
  a = ap.parse_args()

  config = load_config(a.config)
  config.bench.new_tokens = a.new_tokens
  config.bench.repeats = a.repeats
  for k in ("prompt_len", "prefill_rows"):
    if getattr(a, k):
      config.bench[k] = getattr(a, k)
  model = DB.build_model(ModelConfig(**config.model.to_dict()),
                        config.seed)
  setup = DB._Setup(model, config, a.batch)  # pylint: disable=protected-access
  graphdef, params = nnx.split(model)
  res = dict(command=" ".join(["python"] + sys.argv),
             date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                 timespec="seconds"),
             device=jax.devices()[0].device_kind, jax=jax.__version__,
             config=a.config, batch=a.batch, new_tokens=a.new_tokens,
             rows=[])
  tokens = {}
  for mode in a.modes.split(","):
    for form in a.forms.split(","):
      DB.decode_loop.clear_cache()
      orig = setup.state

      def state(m, L, pol="", form=form, orig=orig):
        tok, st = orig(m, L, pol)
        return tok, (_shifting(st) if form == "shift" else st)

      setup.state = state
      tok, st = setup.state(mode, 16)
      shapes = jax.eval_shape(lambda s: s, st)
      hlo = DB.decode_loop.lower(graphdef, params, tok, shapes,
                                 a.new_tokens, setup.impl).compile().as_text()
      copies = big_copies(hlo, min_bytes=2**20)
      out_tok, out_st = DB.decode_loop(graphdef, params, tok, st,
                                       a.new_tokens, setup.impl)
      tokens[(mode, form)] = np.asarray(out_tok)
      # Only one state alive at a time (8B at batch 256: 28 GB each; keeping
      # the loop's output runs the H200 out of memory).
      del st, out_st
      rec = DB.bench_mode(setup, mode, 16)
      setup.state = orig
      same = bool((tokens[(mode, form)] == tokens[(mode, "shift")]).all()
                  ) if (mode, "shift") in tokens else None
      row = dict(mode=mode, form=form, ms_per_step=rec["ms_per_step"],
                 times_s=rec["times_s"], copies_ge_1mib=len(copies),
                 copies=copies[:16], last_tokens_equal_shift=same)
      print(json.dumps({k: v for k, v in row.items() if k != "copies"}),
            flush=True)
      res["rows"].append(row)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
