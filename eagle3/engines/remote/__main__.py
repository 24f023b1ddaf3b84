"""``python -m eagle3.engines.remote --port 8100 --master HOST:50051 [extract.py overrides]``: a capture node.

See :mod:`eagle3.engines.remote.server`. ``--host`` is the address to listen on (default
``127.0.0.1``; ``0.0.0.0`` for other hosts), ``--local-hostname`` the address the Mooncake
store gives out for this node (default: ``--host``, or this machine's name when listening on
all addresses), ``--protocol`` ``tcp`` or ``rdma`` (``--device-name mlx5_0``).

What can be checked without the target is checked before it is loaded (minutes for a large
one): the overrides, the port, the master, and that the address given out is one other hosts
can reach when the master is on another host.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import socket
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parents[3] / "conf"


def compose_config(overrides: list[str]):
    """``extract.py``'s typed config with ``engine=hf`` and ``overrides``.

    Raises:
        Eagle3Error: an option this command does not have, an ``engine=`` other than ``hf``,
            an unknown config choice or key, or any other override Hydra refuses.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from eagle3.cli import config_groups, to_typed, unknown_group_choice, unknown_override_key
    from eagle3.config import ExtractConfig
    from eagle3.errors import Eagle3Error

    flag = next((o for o in overrides if o.startswith("-")), None)
    if flag is not None:
        raise Eagle3Error(f"{flag} is not an option of python -m eagle3.engines.remote (--port, --host, --master, "
                          "--local-hostname, --protocol, --device-name, --segment-mb); the rest are extract.py's key=value")
    engine = next((o.partition("=")[2] for o in overrides if o.lstrip("+").partition("=")[0] == "engine"), "hf")
    if engine != "hf":
        raise Eagle3Error(f"the capture node runs the target in process (engine=hf); drop engine={engine} "
                          "(its settings are engine.device=, engine.capture_batch_size=, ...)")
    overrides = ["engine=hf"] + [o for o in overrides if o.lstrip("+").partition("=")[0] != "engine"]
    problem = unknown_group_choice(overrides, CONF, config_groups(CONF, "extract")) or unknown_override_key(
        overrides, ExtractConfig, config_groups(CONF, "extract"), CONF)
    if problem:
        raise Eagle3Error(problem)
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return to_typed(compose(config_name="extract", overrides=overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        text = f"{e}\n{e.__cause__ or ''}"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("See ", "Config search"))]
        raise Eagle3Error(f"an override is refused ({': '.join(lines[:2]) or type(e).__name__}); pass extract.py's "
                          "key=value settings (model=, engine.device=, ...)") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_local_hostname(master: str, local: str) -> None:
    """Refuse a loopback ``local`` (the address given out to the store) while the master is on
    another host: the other hosts' reads of this node's captures would go to themselves.

    Raises:
        Eagle3Error: that case, naming ``--local-hostname``.
    """
    from eagle3.engines.remote.transfer import parse_address
    from eagle3.errors import Eagle3Error

    host, _ = parse_address(master, "--master")
    if _is_loopback(local) and not _is_loopback(host):
        raise Eagle3Error(f"the master {master} is on another host, but this node would give out {local} as its "
                          "address to the store; pass --local-hostname an address of this machine that the trainer "
                          "reaches (and --host 0.0.0.0 to answer it)")


def main(argv: list[str] | None = None) -> int:
    """Load the target, set up the store, serve until interrupted; 2 on an ``Eagle3Error``."""
    from eagle3.engines import build_engine
    from eagle3.engines.remote.server import CaptureNode, check_listen, serve
    from eagle3.engines.remote.transfer import check_master, open_store
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
    engine = None
    try:
        cfg = compose_config(overrides)
        local = a.local_hostname or (socket.gethostname() if a.host in ("0.0.0.0", "::") else a.host)
        check_local_hostname(a.master, local)
        if a.segment_mb < 1:
            raise Eagle3Error(f"--segment-mb {a.segment_mb} must be >= 1: the node's captures live in its segment")
        check_listen(a.host, a.port)
        check_master(a.master, "--master")
        engine = build_engine(cfg.model, cfg.engine, cfg.cache_dir, None)
        store = open_store(a.master, local, a.protocol, a.segment_mb, device_name=a.device_name, knob="--master",
                           local_puts=True)
        server = serve(CaptureNode(engine, engine.target, store), a.host, a.port)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        if engine is not None:
            engine.close()
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
