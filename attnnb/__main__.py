"""``python -m attnnb``: see :mod:`attnnb.cli`."""

import sys

from .cli import main

sys.exit(main())
