"""The tap-file format and everything that reads it (never imports JAX)."""
