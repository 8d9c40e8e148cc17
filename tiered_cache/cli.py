"""The `tiered-cache` script entry (`tiered_cache.cli:main`): see tiered_cache.tools.cli."""

from tiered_cache.tools.cli import main  # noqa: F401
