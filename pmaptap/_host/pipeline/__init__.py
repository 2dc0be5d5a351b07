"""One session's pipeline: a tap's payload to records in the file.

    ingest --> queue.py (the bound, the overflow policy) --> loops.py: the
    aggregator thread (aggregate.py, with payload.py, records.py, encode.py;
    fingerprints.py, shards.py) --> the writer thread --> a sink (sinks/)

pipeline.py wires them and answers flush() and close().

The one entry of this sub-package (tests/project/test_layout.py)."""

from pmaptap._host.pipeline.aggregate import Aggregator, value_key
from pmaptap._host.pipeline.encode import encode_array
from pmaptap._host.pipeline.pipeline import Pipeline
from pmaptap._host.pipeline.queue import OVERFLOW_POLICIES
from pmaptap._host.pipeline.records import RecordBuilder

__all__ = [
    "OVERFLOW_POLICIES",
    "Aggregator",
    "Pipeline",
    "RecordBuilder",
    "encode_array",
    "value_key",
]
