"""`python -m tiered_cache ...`: the `tiered-cache` command (tiered_cache.tools.cli)."""

import sys

from tiered_cache.tools.cli import main

sys.exit(main())
