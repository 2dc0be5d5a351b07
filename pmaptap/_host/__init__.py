"""Everything in the training process after the host callback."""
