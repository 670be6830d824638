"""Applications built on forge_jax (not part of the library)."""
