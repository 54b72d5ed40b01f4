"""The causal conv1d decode step and window kernels (`kernel.py`)."""

from pallas_kernels.conv.kernel import (ConvConfig, block_channels,
                                        causal_conv1d_step,
                                        causal_conv1d_window, shape_problem)

__all__ = ["ConvConfig", "block_channels", "causal_conv1d_step",
           "causal_conv1d_window", "shape_problem"]
