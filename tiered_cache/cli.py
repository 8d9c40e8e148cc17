"""The `tiered-cache` script entry (`tiered_cache.cli:main`): see tiered_cache.tools.cli.
`python -m tiered_cache.cli` runs the command too (as `python -m tiered_cache` does)."""

import sys

from tiered_cache.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
