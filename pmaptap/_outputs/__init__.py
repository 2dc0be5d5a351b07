"""The output transport (``pmaptap.jit`` / ``pmaptap.pmap``): a step's taps
leave it as extra outputs instead of host callbacks. Its trace half turns
the taps marked while the step is traced (``_trace/marks.py``) into outputs
(``lift.py``; ``later.py``: a fingerprint of the step's outputs, hashed by
a program of its own) and wraps ``jax.jit`` / ``jax.pmap`` (``jit.py``); its
host half (``drain.py``) reads the outputs once the step has run and hands
each payload to routing, as a host callback does. Above both sides: it
imports the trace side and the host side's seam (routing, barrier), and
neither imports it."""

from pmaptap._outputs.jit import jit, pmap

__all__ = ["jit", "pmap"]
