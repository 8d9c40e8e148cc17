"""vLLM: a KV connector (`TieredCacheConnector`) that puts tiered-cache's tiers beneath vLLM's
GPU blocks. docs/vllm.md says how to turn it on.

Only `connector.py` imports vLLM, and only when the class is asked for (PEP 562 module
`__getattr__`): the scheduler and worker logic (scheduler.py, worker.py), the plans, the
layouts and the link to the node service are plain modules, tested without vLLM.

    --kv-transfer-config '{"kv_connector": "TieredCacheConnector",
                           "kv_connector_module_path": "tiered_cache.integrations.vllm",
                           "kv_role": "kv_both"}'
"""

from __future__ import annotations

from typing import Any

CONNECTOR = "TieredCacheConnector"
MODULE = "tiered_cache.integrations.vllm"

__all__ = ["CONNECTOR", "MODULE", "TieredCacheConnector"]


def __getattr__(name: str) -> Any:
    if name in ("TieredCacheConnector", "TieredConnectorMetadata", "TieredWorkerMetadata"):
        from tiered_cache.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
