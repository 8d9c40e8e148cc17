"""An engine process using the page store through the node daemon, for tests: puts or gets
pages named on the command line and prints one JSON line.

    python tests/page_client.py SOCKET put NAME...    -> {"stored": [...]}
    python tests/page_client.py SOCKET get NAME...    -> {"ok": [...], "equal": [...]}
    python tests/page_client.py SOCKET hold NAME...   -> pins NAME... under a handle, prints
                                                         {"handle": h, "slots": n}, then sleeps
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from tests.pages.test_pages import FMT, PART, PB, page  # noqa: E402
from tiered_cache.pages.daemon import DaemonPages  # noqa: E402
from tiered_cache.pages.store import PageStore  # noqa: E402


def main(argv: list[str]) -> int:
    sock, mode, names = argv[0], argv[1], argv[2:]
    st = PageStore(FMT, daemon=DaemonPages(sock, FMT, timeout_s=10), lookup_deadline_s=1.0)
    try:
        if mode == "put":
            print(json.dumps({"stored": st.put(names, [page(n) for n in names], PART)}))
        elif mode == "get":
            outs = [np.zeros(PB, np.uint8) for _ in names]
            ok = st.get(names, outs, PART)
            print(json.dumps({"ok": ok, "equal": [bool(np.array_equal(o, page(n)))
                                                  for o, n in zip(outs, names)]}))
        elif mode == "hold":
            d = st.daemon
            att = d._attach()
            f = d.client.call("page_get", space=att.space, part=PART, keys=[n.encode()
                                                                           for n in names],
                              deadline_ms=1000)
            print(json.dumps({"handle": f["handle"], "slots": len(f["slots"])}), flush=True)
            time.sleep(600)
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        st.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
