"""``python -m drafters.export``: see :mod:`drafters.export`."""

import sys

from . import main

sys.exit(main())
