"""The baseline Mamba-2 decode step: the Triton kernel (`triton.py`, the
default on a GPU) and the Mosaic GPU one (`mosaic.py`, on request)."""

from pallas_kernels.ssu.mosaic import MosaicSSUConfig
from pallas_kernels.ssu.triton import (SSUConfig, baseline_verify,
                                       selective_state_update)

__all__ = ["MosaicSSUConfig", "SSUConfig", "baseline_verify",
           "selective_state_update"]
