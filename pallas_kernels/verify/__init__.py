"""Pallas kernels of the speculative verify on a ReplayState: the fold
kernel (rows whose window does not fit behind their history fold it into
the checkpoint first) and the window kernel (the T outputs from checkpoint +
history + window, then the appends); `config.plan_verify` resolves a
`VerifyConfig` for one state and device. Matches
`replayssm_jax.verify_reference.replay_verify_reference`."""

from pallas_kernels.verify.config import (DEFAULT_FOLD_NUM_WARPS,
                                          DEFAULT_NUM_STAGES,
                                          DEFAULT_NUM_WARPS,
                                          DEFAULT_READOUT_CHUNK,
                                          VerifyConfig, VerifyPlan,
                                          default_block_p, plan_verify)
from pallas_kernels.verify.kernel import replay_verify

__all__ = [
    "DEFAULT_FOLD_NUM_WARPS", "DEFAULT_NUM_STAGES", "DEFAULT_NUM_WARPS",
    "DEFAULT_READOUT_CHUNK", "VerifyConfig", "VerifyPlan", "default_block_p",
    "plan_verify", "replay_verify",
]
