"""The gated RMSNorm and residual add + RMSNorm kernels (`kernel.py`)."""

from pallas_kernels.norm.kernel import (NormConfig, add_rms_norm,
                                        gated_rms_norm, shape_problem)

__all__ = ["NormConfig", "add_rms_norm", "gated_rms_norm", "shape_problem"]
