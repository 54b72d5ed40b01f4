"""Pallas kernels of the ReplaySSM decode step.

* output route (rows with count c < L-1): y = exp(Lambda) (S_0 C)
  + sum_j s_j (B_j . C) x_j + D x from the checkpoint S_0 (or its read
  copy) and the buffer, then append (x, dt', B) at slot c (`output.py`;
  or split in a readout kernel and a window kernel, `split.py`).
* flush route (rows with c == L-1): fold the L-1 buffered tokens and the
  current one into a new checkpoint, store it, and read y from it
  (`flush.py`, the fold in `fold.py`; or the Mosaic GPU flush,
  `mosaic_flush.flush`).
* at small batch both routes in one launch (`fused.py`).

`config.plan_replay_step` resolves a `ReplayConfig` for one state and
device; `step.replay_state_update` launches what the plan says. Matches
`replayssm_jax.reference.replay_state_update`.

Dual precision (a state with a read copy, `precision.PrecisionPolicy`): the
output route reads the read copy (bf16/f16, or fp8 e4m3/int8 dequantized
in f32 with its per-(row, head, headdim-row) scales) in place of the
checkpoint; the flush route reads the master + buffer, folds in f32,
stores the master in its dtype and the copy re-stored from the stored
master (`precision.store`), both aliased input->output so non-flush rows'
master, copy and scales keep their bits. Stochastic rounding of the flush
stores recomputes the reference's random bits per element in-kernel.
"""

from pallas_kernels.replay.config import (ReplayConfig, ReplayPlan,
                                          default_block_p,
                                          default_flush_grid,
                                          default_flush_launch,
                                          default_flush_route,
                                          default_fused_launch,
                                          default_num_warps,
                                          default_output_route,
                                          plan_replay_step)
from pallas_kernels.replay.fold import (default_flush_programs,
                                        default_fold_mode, dot_precision,
                                        flush_programs, fold_dot,
                                        fold_product, persistent_items,
                                        rank1_fold, split_dot)
from pallas_kernels.replay.program import (CopySpec, FlushStores, Program,
                                           copy_counts, copy_operands,
                                           copy_spec, pad_pow2, unpack)
from pallas_kernels.replay.step import replay_state_update

__all__ = [
    "CopySpec", "FlushStores", "Program", "ReplayConfig", "ReplayPlan",
    "copy_counts", "copy_operands", "copy_spec", "default_block_p",
    "default_flush_grid", "default_flush_launch", "default_flush_programs",
    "default_flush_route", "default_fold_mode", "default_fused_launch",
    "default_num_warps", "default_output_route", "dot_precision",
    "flush_programs", "fold_dot", "fold_product", "pad_pow2",
    "persistent_items", "plan_replay_step", "rank1_fold",
    "replay_state_update", "split_dot", "unpack",
]
