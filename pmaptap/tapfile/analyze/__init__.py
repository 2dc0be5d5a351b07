"""A whole run looked at (``summary``, ``validate``, fingerprint verdicts, in
parallel where it is large): the layer's one entry (tests/project/test_layout.py)."""

from pmaptap.tapfile.analyze.fingerprints import divergence_series
from pmaptap.tapfile.analyze.parallel import jobs_for, summarize_file, validate_file
from pmaptap.tapfile.analyze.table import summary_table
from pmaptap.tapfile.analyze.validate import line_text
