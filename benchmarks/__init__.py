"""Side-by-side benchmarks of pmaptap against raw jax.debug.callback."""
