"""What the trace side builds and the host side reads: the frozen tap spec
and the placement of a per-shard tap's shards. Imports neither ``_trace``
nor ``_host``, so each side can import it without importing the other."""
