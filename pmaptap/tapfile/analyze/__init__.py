"""Looking at a whole run: ``summary`` and its table, ``validate``,
fingerprint verdicts, the shard-wise passes and the worker processes that
read a large run in parallel.

The one entry of this layer (tests/project/test_layout.py)."""

from pmaptap.tapfile.analyze.fingerprints import divergence_series
from pmaptap.tapfile.analyze.parallel import jobs_for, summarize_file, validate_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import line_text
