"""``engine=remote``: the trainer's side of a capture node on another host.

``capture`` sends the token ids of one micro-batch to the node (``POST /capture``, JSON:
ids are small) and reads each sequence's aux hidden states and top-k from the Mooncake
store by the manifests the node answers with (binary, never JSON), removing them after
reading. Before the first capture the node's target is checked against the one this run
resolved (content hash, aux layer ids): features of another build are refused, with where
each build was made (:mod:`eagle3.target.build_record`).
"""

from __future__ import annotations

import re
import uuid
from typing import Any, Optional
from urllib.parse import urlsplit

from eagle3.engines.base import Engine
from eagle3.engines.http import JSONHTTPClient, ServerUnavailable
from eagle3.engines.remote.transfer import check_manifest, discard, fetch, open_store, parse_address
from eagle3.errors import Eagle3Error
from eagle3.features import Capture


class NodeClient(JSONHTTPClient):
    """HTTP client of a capture node (:mod:`eagle3.engines.remote.server`)."""

    server_name = "capture node"


def check_node_target(node: dict, target, url: str) -> None:
    """Refuse a node whose target differs from ``target`` (a :class:`eagle3.target.TargetInfo`).

    Args:
        node: the node's ``GET /info`` ``target`` record.

    Raises:
        Eagle3Error: another content hash (with both build records and what to copy), other
            aux layer ids, or another hidden size.
    """
    from eagle3.target.build_record import hash_mismatch_advice

    if node.get("content_hash") != target.content_hash:
        raise Eagle3Error(
            f"the capture node at {url} serves {node.get('name')} with content hash {node.get('content_hash')}, but "
            f"this run's model={target.name} resolves to {target.content_hash}; serve the same build on both. "
            + hash_mismatch_advice(node.get("build"), getattr(target, "build", None), getattr(target, "path", None),
                                   subject="the node's target"))
    for key in ("aux_layer_ids", "hidden_size"):
        if node.get(key) is not None and list(map(int, _as_list(node[key]))) != list(map(int, _as_list(getattr(target, key)))):
            raise Eagle3Error(f"the capture node at {url} captures {key}={node[key]}, this run needs "
                              f"{getattr(target, key)}; start the node with the same model.aux_layer_ids")


def check_url(url: Any) -> str:
    """``url`` without a trailing ``/`` once it is ``http(s)://HOST:PORT``.

    Raises:
        Eagle3Error: another form (no scheme, no port, a path).
    """
    parts = urlsplit(str(url).strip())
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise Eagle3Error(f"engine.url={url!r} must be http://HOST:PORT, the address of a capture node "
                          "(python -m eagle3.engines.remote --port PORT)")
    return str(url).strip().rstrip("/")


def node_info(client: JSONHTTPClient) -> dict:
    """The node's ``GET /info`` (a dict with ``target`` and ``engine``).

    Raises:
        Eagle3Error: no capture node answers at ``client.url`` (start one, or fix engine.url), or
            what answers is not one.
    """
    try:
        info = client.request("GET", "/info")
    except ServerUnavailable as e:
        last = re.search(r"\(last error: (.*)\); check", str(e))
        raise Eagle3Error(f"no capture node answers at engine.url={client.url} ({last.group(1) if last else e}); "
                          "start one there (python -m eagle3.engines.remote --port PORT --master HOST:PORT model=...) "
                          "or pass engine.url= the address of a running one") from None
    except Eagle3Error as e:
        code = re.search(r"HTTP (\d+)", str(e))
        raise Eagle3Error(f"engine.url={client.url} is not a capture node (GET /info answered "
                          f"{'HTTP ' + code.group(1) if code else e}); pass the address of python -m "
                          "eagle3.engines.remote") from None
    if not isinstance(info, dict) or not isinstance(info.get("target"), dict):
        raise Eagle3Error(f"engine.url={client.url} is not a capture node (its /info has no target); pass the address "
                          "of python -m eagle3.engines.remote")
    return info


def check_shapes(m: Any, length: int, top_k: int, url: str) -> None:
    """Refuse a manifest whose tensors are not ``[length, 3, *]`` and ``[length, top_k]`` (what was asked for).

    Raises:
        Eagle3Error: a malformed manifest, or other shapes.
    """
    check_manifest(m)
    try:
        shapes = {n: [int(d) for d in t["shape"]] for n, t in m["tensors"].items()}
    except (KeyError, TypeError, ValueError):
        shapes = {}
    aux, ids, lp = (shapes.get(n) for n in ("aux_hidden_states", "topk_ids", "topk_logprobs"))
    if not aux or aux[:2] != [length, 3] or ids != [length, top_k] or lp != [length, top_k]:
        raise Eagle3Error(f"the capture node at {url} answered capture {m['handle']} with shapes {shapes} for a "
                          f"sequence of {length} tokens and top_k={top_k}; run the same eagle3 version on both hosts")


def _as_list(v):
    return v if isinstance(v, (list, tuple)) else [v]


class RemoteEngine(Engine):
    """A capture node reached at ``url`` whose tensors arrive through the Mooncake store of ``master``.

    Args:
        url: the node's ``http://host:port``.
        store: a set-up ``MooncakeHiddenStatesStore`` (:func:`eagle3.engines.remote.transfer.open_store`).
        timeout_s: bound of one capture request, seconds.
        fetch_timeout_s: how long to wait for a published object to be readable, seconds.

    Raises:
        Eagle3Error: the node does not answer ``/info``.
    """

    def __init__(self, url: str, store, timeout_s: float = 600.0, fetch_timeout_s: float = 120.0,
                 node: Optional[dict] = None):
        self.url, self.store, self.fetch_timeout_s = url, store, float(fetch_timeout_s)
        self.client = NodeClient(url, timeout_s=timeout_s, max_retries=2)
        self.node = node if node is not None else node_info(self.client)
        self.tokenizer = None  # the trainer loads the target's tokenizer itself

    @classmethod
    def from_config(cls, model_cfg, engine_cfg, cache_dir, run_dir=None) -> "RemoteEngine":
        """Ask the node at ``engine_cfg.url`` for its target and check it is ``model_cfg``'s
        (:func:`check_node_target`), then connect to the store of ``engine_cfg.master``.

        Raises:
            Eagle3Error: a missing or malformed ``engine.url`` / ``engine.master``, no node
                answering, a node of another target, no master answering.
        """
        from eagle3.target import resolve_target

        if not engine_cfg.url or not engine_cfg.master:
            raise Eagle3Error("engine=remote needs engine.url=http://NODE:PORT (python -m eagle3.engines.remote) and "
                              "engine.master=HOST:PORT (the Mooncake master)")
        url = check_url(engine_cfg.url)
        parse_address(engine_cfg.master, "engine.master")
        client = NodeClient(url, timeout_s=engine_cfg.timeout_s, max_retries=2)
        node = node_info(client)
        check_node_target(node.get("target") or {}, resolve_target(model_cfg, cache_dir), url)
        store = open_store(engine_cfg.master, engine_cfg.local_hostname, engine_cfg.protocol, engine_cfg.segment_mb,
                           device_name=engine_cfg.device_name, knob="engine.master")
        return cls(url, store, engine_cfg.timeout_s, engine_cfg.fetch_timeout_s, node=node)

    def info(self) -> dict[str, Any]:
        """``{"name": "remote", "node": <the node engine's info>}`` (what sets the numerics; no URLs)."""
        return {"name": "remote", "node": self.node.get("engine")}

    def generate(self, prompts, sampling):
        raise Eagle3Error("engine=remote captures features for online training only; regenerate replies with "
                          "extract.py engine=hf, vllm or sglang (features=none)")

    def capture(self, sequences: list[list[int]], top_k: int) -> list[Capture]:
        """See :meth:`Engine.capture`: one ``POST /capture`` and one store read per sequence.

        Raises:
            Eagle3Error: the node refused the request, stayed unreachable (``ServerUnavailable``),
                answered the wrong number of manifests or manifests of other shapes than asked
                for, or an object could not be read (the objects not read yet are removed).
        """
        body = {"request": uuid.uuid4().hex, "sequences": [list(map(int, s)) for s in sequences], "top_k": int(top_k)}
        answer = self.client.request("POST", "/capture", body)
        manifests = answer.get("manifests") if isinstance(answer, dict) else None
        if not isinstance(manifests, list) or len(manifests) != len(sequences):
            raise Eagle3Error(f"the capture node at {self.url} answered {len(manifests or [])} captures for "
                              f"{len(sequences)} sequences")
        out: list[Capture] = []
        try:
            for seq, m in zip(body["sequences"], manifests):
                check_shapes(m, len(seq), body["top_k"], self.url)
                out.append(fetch(self.store, m, self.fetch_timeout_s))
        except Eagle3Error:
            for m in manifests[len(out):]:  # the failed one too, when it was not read
                if isinstance(m, dict) and isinstance(m.get("handle"), str):
                    discard(self.store, m["handle"])
            raise
        return out

    def close(self) -> None:
        self.store = None
