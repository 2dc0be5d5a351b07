"""Records out to other tools (CSV, TensorBoard, plots, a sharded run merged
into one file): the layer's one entry."""

from pmaptap.tapfile.export.csv_rows import write_csv
from pmaptap.tapfile.export.merging import merge, merge_follow
from pmaptap.tapfile.export.plot import PlotError, per_leaf, plot_tap
from pmaptap.tapfile.export.tensorboard import TensorBoardExport, tag_parts
from pmaptap.tapfile.export.tensorboard import export as export_tensorboard
from pmaptap.tapfile.export.tensorboard import follow as follow_tensorboard
