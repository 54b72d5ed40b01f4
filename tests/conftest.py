"""pytest configuration shared by the whole test-suite."""

import gc
import os
import tempfile

import jax
import pytest

# XLA:CPU compiles the "partitionable" threefry PRNG (jax's default) far
# more slowly than the classic one, per new random shape. Tests draw inputs
# of many shapes, so use the classic, equally valid, bit stream. Sharding is
# irrelevant here.
jax.config.update("jax_threefry_partitionable", False)


def _setting(name: str, value) -> None:
  """Sets a jax flag in this process and, through the environment (jax
  reads JAX_<FLAG>), in the scripts, experiments and pytest runs that tests
  start as subprocesses."""
  jax.config.update(name, value)
  os.environ.setdefault(name.upper(), str(value))


# The suite is bound by XLA:CPU compile time (interpret-mode kernels compile
# each case apart), not by run time: skip most of XLA's and LLVM's
# optimization passes. The tests compare against references and
# tolerances, or two paths compiled the same way; the GPU benchmarks check
# every timed configuration at full optimization. REPLAYSSM_TEST_FULL_OPT=1
# runs the suite fully optimized.
if os.environ.get("REPLAYSSM_TEST_FULL_OPT") != "1":
  _setting("jax_disable_most_optimizations", True)

# XLA's persistent compilation cache, shared by the xdist workers (and by
# later runs on the same machine): a program that several tests or both
# workers compile (the reference ops, the same kernel at the same shapes)
# compiles once. REPLAYSSM_TEST_CACHE=<dir> moves it; =0 turns it off.
_CACHE = os.environ.get("REPLAYSSM_TEST_CACHE",
                        os.path.join(tempfile.gettempdir(),
                                     "replayssm_jax_test_xla_cache"))
if _CACHE != "0":
  _setting("jax_compilation_cache_dir", _CACHE)
  _setting("jax_persistent_cache_min_compile_time_secs", 0.1)
  _setting("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops jax's in-memory caches of compiled programs after each test
  module: a worker runs hundreds of modules' programs, which kept would
  grow its memory without bound over the suite. A later module that needs
  a program again reads it back from the persistent cache above."""
  yield
  jax.clear_caches()
  gc.collect()


# Property-based tests (tests/test_fuzz.py): a fixed, derandomized example
# budget in the default profile keeps CI's time and results stable;
# `pytest --hypothesis-profile=long` explores far more.
try:
  from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test dependency; without it the fuzz
  pass               # module is skipped (pytest.importorskip)
else:
  _common = dict(deadline=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.data_too_large])
  settings.register_profile("ci", max_examples=12, derandomize=True,
                            **_common)
  settings.register_profile("long", max_examples=400, **_common)
  settings.load_profile("ci")  # --hypothesis-profile=long overrides it
