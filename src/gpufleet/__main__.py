"""``python -m gpufleet``: the command line (``cli.py``)."""

import sys

from gpufleet.cli import main

sys.exit(main())
