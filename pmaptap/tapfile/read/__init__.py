"""Reading records (``read``, the commands' entries, frames, assembled
arrays, following a growing run): the layer's one entry."""

from pmaptap.tapfile.read.assembly import assemble
from pmaptap.tapfile.read.attempts import ATTEMPT_NAME, Attempts, Restarts, attempt_of, latest, scan
from pmaptap.tapfile.read.divergence import DivergenceIndex
from pmaptap.tapfile.read.follower import (
    LineFollower,
    PendingFollower,
    RunFollower,
    StopFlag,
    follow,
    matching,
    open_follower,
    polls,
    stop_on_signals,
)
from pmaptap.tapfile.read.frame import per_device, write_parquet
from pmaptap.tapfile.read.query import Filter, parse_steps
from pmaptap.tapfile.read.reader import Stored, read
from pmaptap.tapfile.read.stream import first_pass
from pmaptap.tapfile.read.views import (
    COLUMNS,
    COLUMNS_ALL_ATTEMPTS,
    RUN,
    Entry,
    Table,
    format_ids,
    format_number,
    id_order,
    iter_entries,
    json_line,
    leaves,
    row,
    scalar,
    sorted_ids,
    with_run,
)
