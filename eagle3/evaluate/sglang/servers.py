"""The two SGLang servers of a served evaluation: opening them and checking what they run.

:func:`open_server` connects to ``engine.baseline_url`` / ``engine.speculative_url`` or
launches the server itself (``engine.url`` / ``engine.urls``, extraction's settings, are
refused by :func:`check_served_urls`), and refuses a speculative server that does not
run EAGLE3 or a baseline that runs a drafter; :func:`check_speculative_server` compares what the
speculative server serves with the configured settings and the evaluated export;
:func:`cap_warnings` warns when a tested concurrency exceeds what a server admits. The
speculative server silently caps running requests at 48 unless
``--max-running-requests`` is given (``srt/arg_groups/speculative_hook.py``); the
effective cap is read back from ``/server_info``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eagle3.engines import sglang as sg
from eagle3.errors import Eagle3Error
from eagle3.export import export_dir, read_json_object

#: the two servers, measured in this order
ROLES = ("baseline", "speculative")


@dataclass
class Server:
    """One opened server: its client, its ``/server_info`` and, when launched here, the
    process and its command line."""

    role: str
    client: sg.SGLangClient
    info: dict
    launched: Optional[sg.LaunchedServer] = None
    launch_command: Optional[list[str]] = None

    def describe(self) -> dict:
        """``{url, version, launch_command, effective}``: the report's record of the
        server (``effective``: :func:`eagle3.engines.sglang.effective_settings`)."""
        cmd = self.launch_command or self.info.get("launch_command")
        return {
            "url": self.client.url,
            "version": sg.server_version(self.info),
            "launch_command": cmd if isinstance(cmd, (str, type(None))) else " ".join(map(str, cmd)),
            "effective": sg.effective_settings(self.info),
        }

    def stop(self) -> None:
        """Stop the server if it was launched here (a connected one is left running)."""
        if self.launched is not None:
            self.launched.stop()
            self.launched = None


def check_served_urls(engine_cfg: Any) -> None:
    """Refuse ``engine.url`` / ``engine.urls`` in served evaluation.

    Those name extraction's capture servers; served evaluation measures two servers and
    reads only ``engine.baseline_url`` and ``engine.speculative_url`` (or launches each
    server itself when they are unset), so a URL there would otherwise be ignored.

    Raises:
        Eagle3Error: ``engine.url`` or ``engine.urls`` is set.
    """
    url, urls = getattr(engine_cfg, "url", None), [str(u) for u in getattr(engine_cfg, "urls", None) or []]
    given = ([f"engine.url={url}"] if url else []) + ([f"engine.urls=[{','.join(urls)}]"] if urls else [])
    if given:
        raise Eagle3Error(
            f"served evaluation does not read engine.url / engine.urls ({', '.join(given)}), which name extraction's "
            "capture servers; pass engine.baseline_url=http://HOST:PORT (the target without a drafter) and "
            "engine.speculative_url=http://HOST:PORT (the target serving the drafter) instead"
        )


def open_server(role: str, cfg: Any, run_dir: Path) -> Server:
    """Connect to ``engine.<role>_url`` or launch the server for ``role``.

    Raises:
        Eagle3Error: not reachable (naming ``engine.<role>_url``); neither URL nor sglang
            to launch with; a speculative server that does not run EAGLE3 or a baseline
            that runs a drafter.
    """
    e = cfg.engine
    url = getattr(e, f"{role}_url", None)
    if url:
        client, info = sg.connect(url, e, setting=f"engine.{role}_url")
        server = Server(role, client, info)
    else:
        server = _launch(role, cfg, run_dir)
    algo = server.info.get("speculative_algorithm")
    if role == "speculative" and "speculative_algorithm" in server.info and str(algo).upper() != "EAGLE3":
        server.stop()
        raise Eagle3Error(
            f"the speculative server at {server.client.url} runs speculative_algorithm={algo}; start it with "
            "--speculative-algorithm EAGLE3 --speculative-draft-model-path <the drafter's export/sglang folder>"
        )
    if role == "baseline" and algo:
        server.stop()
        raise Eagle3Error(
            f"the baseline server at {server.client.url} runs speculative decoding ({algo}); start it without "
            "--speculative-algorithm so the speed-up has a plain reference"
        )
    return server


def _launch(role: str, cfg: Any, run_dir: Path) -> Server:
    """Launch the server for ``role`` here (the speculative one with the drafter export),
    the baseline on ``engine.port`` and the speculative one on ``engine.port + 1``.

    Raises:
        Eagle3Error: sglang is not installed, no drafter export, or the launch failed.
    """
    e = cfg.engine
    if not sg.sglang_available(e.python, sg.server_env(e)):
        raise Eagle3Error(
            f"no {role} SGLang server is configured (engine.{role}_url) and the sglang package is not installed "
            f"here: start both servers where the GPUs are (docs/sglang.md) and pass "
            f"engine.baseline_url=http://HOST:PORT engine.speculative_url=http://HOST:PORT"
        )
    spec = None
    if role == "speculative":
        d = export_dir(cfg.drafter_dir, "sglang")
        if not (d / "config.json").is_file():
            raise Eagle3Error(f"no SGLang drafter export at {d}; train one first or set drafter_dir=<export/sglang folder>")
        spec = {"draft_model_path": str(d.resolve()), "num_steps": cfg.speculative.num_steps,
                "topk": cfg.speculative.topk, "num_draft_tokens": cfg.speculative.num_draft_tokens}
    from eagle3.target import resolve_target

    model_path = sg.resolve_model_path(cfg.model, {"path": resolve_target(cfg.model, cfg.cache_dir).path})
    port = int(e.port) + ROLES.index(role)  # both servers run at once: baseline on port, speculative on port + 1
    launched, cmd = sg.launch_server(cfg.model, e, model_path=model_path, run_dir=run_dir, name=role,
                                     speculative=spec, port=port)
    try:
        client = sg.SGLangClient(launched.url, e.request_timeout_s, e.max_retries, e.backoff_s)
        info = client.server_info()
    except BaseException:
        launched.stop()
        raise
    return Server(role, client, info, launched, cmd)


def check_speculative_server(server: Server, cfg: Any, export_meta: dict) -> list[str]:
    """Warnings (and errors) about what the speculative server serves.

    Raises:
        Eagle3Error: its drafter (when readable here) captures other aux layers than the
            ones the drafter was trained on, or has a ``config.json`` / ``eagle3_meta.json``
            that is not valid JSON.
    """
    warnings = []
    info = server.info
    want = {"speculative_num_steps": cfg.speculative.num_steps, "speculative_eagle_topk": cfg.speculative.topk,
            "speculative_num_draft_tokens": cfg.speculative.num_draft_tokens}
    diff = {k: (info.get(k), v) for k, v in want.items() if k in info and info.get(k) != v}
    if diff:
        warnings.append(
            "the speculative server runs " + ", ".join(f"{k}={a} (configured {b})" for k, (a, b) in diff.items())
            + "; results are reported for the server's settings"
        )
    draft = info.get("speculative_draft_model_path")
    if draft and os.path.isfile(os.path.join(draft, "config.json")):
        read_json_object(Path(draft, "config.json"))  # a damaged file is one sentence, not a traceback
    served = sg.read_draft_aux_ids(draft, cfg.model.architecture)
    trained = export_meta.get("aux_layer_ids") if export_meta else None
    if served is not None and trained is not None and list(served) != list(trained):
        raise Eagle3Error(
            f"the speculative server's drafter ({draft}) makes the target capture aux layers {served} but the "
            f"drafter under evaluation was trained on {list(trained)}; serve the evaluated export"
        )
    if draft and os.path.isfile(os.path.join(draft, "eagle3_meta.json")) and export_meta:
        served_meta = read_json_object(Path(draft, "eagle3_meta.json"))
        for key in ("features_manifest_sha256", "chat_template_hash"):
            if key in served_meta and key in export_meta and served_meta[key] != export_meta[key]:
                warnings.append(f"the served drafter's {key} differs from the evaluated export's: is it the same drafter?")
    elif draft is None and "speculative_draft_model_path" in info:
        warnings.append("the speculative server reports no draft model path")
    return warnings


def cap_warnings(role: str, eff: dict, concurrency: list[int]) -> list[str]:
    """A warning when a tested concurrency exceeds what the server admits or graphs."""
    out = []
    caps = [v for v in (eff.get("max_running_requests"), eff.get("effective_max_running_requests")) if isinstance(v, int)]
    if caps:
        cap = min(caps)
        over = [c for c in concurrency if c > cap]
        if over:
            out.append(
                f"the {role} server admits at most {cap} running requests (effective max_running_requests) but "
                f"concurrency {over} was tested: requests beyond {cap} wait in its queue, so those throughputs "
                "measure the cap, not the drafter; set engine.max_running_requests (--max-running-requests) above "
                "the largest concurrency"
            )
    cg = eff.get("cuda_graph_max_bs")
    if isinstance(cg, int) and any(c > cg for c in concurrency):
        out.append(
            f"the {role} server captures CUDA graphs up to batch {cg}; decode batches above it run without "
            "graphs (set engine.cuda_graph_max_bs)"
        )
    return out
