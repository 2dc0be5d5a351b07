"""Everything that runs while JAX traces a tapped function."""
