"""Pallas kernels of the Gated DeltaNet decode state (Triton backend on a
GPU, interpret mode elsewhere): the baseline step (`step.gdn_step`, state
updated in place), the ReplaySSM step (`replay.gdn_replay_step`) and the
speculative verify (`verify.gdn_replay_verify`, windows T <= 8). Each
matches its reference in `replayssm_jax.gdn`; `config` holds the launch
fields and the checks that refuse what the kernels cannot run."""

from pallas_kernels.gdn.config import (GDNConfig, GDNPlan, plan,
                                       replay_problem, step_problem,
                                       verify_problem)
from pallas_kernels.gdn.replay import gdn_replay_step
from pallas_kernels.gdn.step import gdn_step
from pallas_kernels.gdn.verify import gdn_replay_verify

__all__ = ["GDNConfig", "GDNPlan", "gdn_replay_step", "gdn_replay_verify",
           "gdn_step", "plan", "replay_problem",
           "step_problem", "verify_problem"]
