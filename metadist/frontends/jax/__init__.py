"""The JAX frontend."""
