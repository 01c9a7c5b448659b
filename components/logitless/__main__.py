"""``python -m logitless ...`` is the ``logitless`` command (see :mod:`logitless.cli`)."""

import sys

from logitless.cli import main

sys.exit(main())
