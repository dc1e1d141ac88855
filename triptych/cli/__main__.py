"""``python -m triptych.cli ...``: the ``triptych`` command."""

import sys

from triptych.cli import main

sys.exit(main())
