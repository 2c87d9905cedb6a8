"""``python -m metadist`` is the ``metadist`` command."""

import sys

from metadist.cli import main

sys.exit(main())
