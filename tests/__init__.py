"""Test-suite of replayssm_jax (import shared helpers as `tests.cases`)."""
