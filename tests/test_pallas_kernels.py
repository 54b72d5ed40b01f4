"""The Pallas kernel tests are in test_replay_kernel.py,
test_replay_kernel_precision.py, test_replay_plan.py, test_ssu_kernel.py
and test_kernel_lowering.py; this module keeps the name that
test_attention, test_conv, test_norm and test_speculative import the CUDA
lowering helper from."""

from tests.kernel_harness import lower_for_cuda as _lower_for_cuda  # noqa: F401
