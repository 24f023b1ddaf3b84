"""``engine=remote``: the trainer's side of a capture node on another host.

``capture`` sends the token ids of one micro-batch to the node (``POST /capture``, JSON:
ids are small) and reads each sequence's aux hidden states and top-k from the Mooncake
store by the manifests the node answers with (binary, never JSON), removing them after
reading. Before the first capture the node's target is checked against the one this run
resolved (content hash, aux layer ids): features of another build are refused, with where
each build was made (:mod:`eagle3.target.build_record`).
"""

from __future__ import annotations

import uuid
from typing import Any

from eagle3.engines.base import Engine
from eagle3.engines.http import JSONHTTPClient
from eagle3.engines.remote.transfer import fetch, open_store
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

    def __init__(self, url: str, store, timeout_s: float = 600.0, fetch_timeout_s: float = 120.0):
        self.url, self.store, self.fetch_timeout_s = url, store, float(fetch_timeout_s)
        self.client = NodeClient(url, timeout_s=timeout_s, max_retries=2)
        self.node = self.client.request("GET", "/info")
        self.tokenizer = None  # the trainer loads the target's tokenizer itself

    @classmethod
    def from_config(cls, model_cfg, engine_cfg, cache_dir, run_dir=None) -> "RemoteEngine":
        """Connect to ``engine_cfg.url`` and the store of ``engine_cfg.master``; check that the
        node's target is ``model_cfg``'s (:func:`check_node_target`)."""
        from eagle3.target import resolve_target

        if not engine_cfg.url or not engine_cfg.master:
            raise Eagle3Error("engine=remote needs engine.url=http://NODE:PORT (python -m eagle3.engines.remote) and "
                              "engine.master=HOST:PORT (the Mooncake master)")
        store = open_store(engine_cfg.master, engine_cfg.local_hostname, engine_cfg.protocol, engine_cfg.segment_mb,
                           device_name=engine_cfg.device_name)
        eng = cls(engine_cfg.url, store, engine_cfg.timeout_s, engine_cfg.fetch_timeout_s)
        check_node_target(eng.node.get("target") or {}, resolve_target(model_cfg, cache_dir), engine_cfg.url)
        return eng

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
                answered the wrong number of manifests, or an object could not be read.
        """
        body = {"request": uuid.uuid4().hex, "sequences": [list(map(int, s)) for s in sequences], "top_k": int(top_k)}
        manifests = self.client.request("POST", "/capture", body).get("manifests") or []
        if len(manifests) != len(sequences):
            raise Eagle3Error(f"the capture node at {self.url} answered {len(manifests)} captures for "
                              f"{len(sequences)} sequences")
        return [fetch(self.store, m, self.fetch_timeout_s) for m in manifests]

    def close(self) -> None:
        self.store = None
