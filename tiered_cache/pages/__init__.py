"""A page store keyed by an engine's own page hashes: put/get/exists of fixed-size pages over
the disk, remote and daemon tiers, with record verification (docs/architecture.md, "Pages").

`PageStore` (pages/store.py) is the entry point; SGLang's HiCache backend and the vLLM
secondary tier (tiered_cache.integrations) sit on it. Nothing here imports torch at import time.
"""
