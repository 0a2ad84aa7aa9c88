"""``python -m umbp`` is the ``umbp`` command."""

import sys

from umbp.cli import main

sys.exit(main())
