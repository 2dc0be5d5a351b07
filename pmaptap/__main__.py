"""``python -m pmaptap`` runs the ``pmaptap`` command (see cli.py)."""

import sys

from pmaptap.cli import main

sys.exit(main())
