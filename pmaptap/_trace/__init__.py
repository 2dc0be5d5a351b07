"""Everything that runs while JAX traces a tapped function."""

# First: a JAX the suite does not run on gets one warning naming what it lacks.
from pmaptap._trace.jax_support import check_version as _check_version

_check_version()
