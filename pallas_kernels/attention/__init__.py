"""The decode attention kernel (`kernel.py`)."""

from pallas_kernels.attention.kernel import (AttentionConfig, block_len,
                                             decode_attention, shape_problem)

__all__ = ["AttentionConfig", "block_len", "decode_attention",
           "shape_problem"]
