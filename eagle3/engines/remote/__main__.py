"""``python -m eagle3.engines.remote --port 8100 --master HOST:50051 [extract.py overrides]``: a capture node.

See :mod:`eagle3.engines.remote.server`. ``--host`` is the address to listen on (default
``127.0.0.1``; ``0.0.0.0`` for other hosts), ``--local-hostname`` the address the Mooncake
store gives out for this node (default: ``--host``, or this machine's name when listening on
all addresses), ``--protocol`` ``tcp`` or ``rdma`` (``--device-name mlx5_0``).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Load the target, set up the store, serve until interrupted; 2 on an ``Eagle3Error``."""
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed
    from eagle3.engines import build_engine
    from eagle3.engines.remote.server import CaptureNode, serve
    from eagle3.engines.remote.transfer import open_store
    from eagle3.errors import Eagle3Error

    ap = argparse.ArgumentParser(prog="python -m eagle3.engines.remote", description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--master", required=True, help="the Mooncake master, HOST:PORT")
    ap.add_argument("--local-hostname", default=None)
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    ap.add_argument("--device-name", default="")
    ap.add_argument("--segment-mb", type=int, default=1024, help="memory this node gives the store, MiB")
    a, overrides = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    conf = Path(__file__).resolve().parents[3] / "conf"
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = to_typed(compose(config_name="extract", overrides=["engine=hf"] + overrides))
        engine = build_engine(cfg.model, cfg.engine, cfg.cache_dir, None)
        local = a.local_hostname or (socket.gethostname() if a.host == "0.0.0.0" else a.host)
        store = open_store(a.master, local, a.protocol, a.segment_mb, device_name=a.device_name)
        server = serve(CaptureNode(engine, engine.target, store), a.host, a.port)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("capture node for %s on http://%s:%d (store master %s)", cfg.model.name,
                                     a.host, a.port, a.master)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
