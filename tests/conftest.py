"""pytest configuration shared by the whole test-suite."""

import jax

# XLA:CPU compiles the "partitionable" threefry PRNG (the default since
# jax 0.5) about 10x slower than the classic one: ~3 s per new random shape
# on the 2-core CI machine versus ~0.3 s. Tests draw inputs of many shapes,
# so use the classic, equally valid, bit stream. Sharding is irrelevant here.
jax.config.update("jax_threefry_partitionable", False)
