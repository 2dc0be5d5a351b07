"""``python -m pmaptap`` runs the ``pmaptap`` command (see cli.py)."""
import sys

from .cli import main

sys.exit(main())
