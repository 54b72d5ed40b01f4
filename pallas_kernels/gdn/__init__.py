"""Pallas kernels of the Gated DeltaNet decode state (Triton backend on a
GPU, interpret mode elsewhere): the baseline step (`step.gdn_step`, state
updated in place), the ReplaySSM step (`replay.gdn_replay_step`) and the
speculative verify (`verify.gdn_replay_verify`). Each matches its
reference in `replayssm_jax.gdn`."""

from pallas_kernels.gdn.config import GDNConfig, GDNPlan, plan
from pallas_kernels.gdn.step import gdn_step

__all__ = ["GDNConfig", "GDNPlan", "gdn_step", "plan"]
