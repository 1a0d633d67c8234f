"""`python -m epd_ring`: the `epd-ring` command line."""

import sys

from epd_ring.executor.tools.cli import main

sys.exit(main())
