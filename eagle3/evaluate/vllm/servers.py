"""The two vLLM servers of a served evaluation: opening them (both up at once) and checking them.

:func:`open_servers` connects to ``engine.baseline_url`` / ``engine.speculative_url`` or
launches each on ``engine.port`` (baseline) and ``engine.port + 1`` (speculative, serving
the drafter); :func:`check_servers` refuses a baseline that speculates and a speculative
server that does not run EAGLE-3 or serves an export written for SGLang;
:func:`cap_warnings` warns when a tested concurrency exceeds a server's ``max_num_seqs``
(read back: :func:`eagle3.engines.vllm.effective_settings`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from eagle3.engines import vllm as vl
from eagle3.errors import Eagle3Error

log = logging.getLogger("eagle3")


@dataclass
class OpenServer:
    """One server of the evaluation: its client, its process when launched here, its record."""

    role: str
    client: vl.VLLMClient
    process: Optional[vl.VLLMServer] = None
    command: Optional[list[str]] = None
    startup_s: Optional[float] = None  # launched here: seconds from start to a healthy /health

    def describe(self) -> dict:
        """``{url, launch_command, startup_s, effective}`` (effective: :func:`eagle3.engines.vllm.effective_settings`,
        plus ``max_running_requests`` = ``max_num_seqs`` for the report's cap)."""
        eff = vl.effective_settings(self.client, self.process.log_path if self.process else None)
        eff["max_running_requests"] = eff.get("max_num_seqs")
        return {"url": self.client.url, "launch_command": " ".join(self.command) if self.command else None,
                "startup_s": self.startup_s, "effective": eff}

    def stop(self) -> None:
        """Stop the process if it was launched here."""
        if self.process is not None:
            self.process.stop()
            self.process = None


def _client(cfg: Any, url: str) -> vl.VLLMClient:
    e = cfg.engine
    return vl.VLLMClient(url, e.request_timeout_s, e.max_retries, e.backoff_s)


def _connect(cfg: Any, role: str, url: str) -> OpenServer:
    """A server the user started: it must answer ``/health`` within ``engine.connect_timeout_s``."""
    client = _client(cfg, url)
    t0 = time.monotonic()
    while not client.health(timeout_s=10.0):
        if time.monotonic() - t0 > float(cfg.engine.connect_timeout_s):
            raise Eagle3Error(f"no vLLM server answers {url}/health (engine.{role}_url); start it or fix the URL")
        time.sleep(2.0)
    return OpenServer(role, client)


def open_servers(cfg: Any, model_path: str, drafter_dir: Path, run_dir: Path) -> dict[str, OpenServer]:
    """Both servers, up at once: connected by URL or launched here (started together, then
    waited for), each process stopped again if the other fails.

    Raises:
        Eagle3Error: a server unreachable or not coming up (with its log's last lines).
    """
    e = cfg.engine
    spec = vl.speculative_config(str(drafter_dir.resolve()), int(cfg.speculative.num_steps))
    out: dict[str, OpenServer] = {}
    try:
        launch = {}
        for i, role in enumerate(("baseline", "speculative")):
            url = getattr(e, f"{role}_url", None)
            if url:
                out[role] = _connect(cfg, role, url)
            else:
                launch[role] = (int(e.port) + i, spec if role == "speculative" else None)
        out.update(launch_servers(cfg, model_path, launch, run_dir))
    except BaseException:
        for s in out.values():
            s.stop()
        raise
    return out


def launch_servers(cfg: Any, model_path: str, roles: dict[str, tuple[int, Optional[dict]]],
                   run_dir: Path) -> dict[str, OpenServer]:
    """Launch one server per role at once (``{role: (port, --speculative-config or None)}``,
    every other flag from ``cfg.engine``), then wait for each to answer ``/health``; every
    process is stopped again if one fails.

    Raises:
        Eagle3Error: a server not coming up (with its log's last lines).
    """
    e = cfg.engine
    out: dict[str, OpenServer] = {}
    try:
        for role, (port, spec) in roles.items():
            started = time.monotonic()
            proc, cmd = vl.start_vllm(e, model_path=model_path, dtype=cfg.model.dtype, seed=int(cfg.seed),
                                      port=int(port), run_dir=run_dir, name=role, speculative=spec)
            out[role] = OpenServer(role, _client(cfg, proc.url), proc, cmd, started)
        for s in out.values():
            s.process.wait_healthy(float(e.launch_timeout_s), float(e.health_poll_s))
            s.startup_s = time.monotonic() - s.startup_s  # seconds from its start to healthy
            log.info("vLLM %s is up at %s, %.0f s after it started", s.role, s.client.url, s.startup_s)
    except BaseException:
        for s in out.values():
            s.stop()
        raise
    return out


def check_servers(desc: dict, cfg: Any, export) -> list[str]:
    """Refuse servers that do not run what is evaluated; return warnings.

    Raises:
        Eagle3Error: the baseline speculates; the speculative server does not run EAGLE-3,
            or serves a drafter export written for SGLang (its aux ids would be read as
            the layers below the trained ones) or one that captures other layers.
    """
    warnings = []
    base, spec = desc["baseline"]["effective"], desc["speculative"]["effective"]
    if base.get("speculative_config"):
        raise Eagle3Error(f"the baseline vLLM server at {desc['baseline']['url']} speculates "
                          f"({base['speculative_config']}); start it without --speculative-config")
    sc = spec.get("speculative_config")
    if sc is None and spec.get("server_info_available"):
        raise Eagle3Error(f"the speculative vLLM server at {desc['speculative']['url']} runs no drafter; start it with "
                          f"--speculative-config '{{\"method\": \"eagle3\", \"model\": \"{export.dir}\", ...}}'")
    if sc is None:
        warnings.append("the speculative server does not expose its config (start it with VLLM_SERVER_DEV_MODE=1): "
                        "which drafter it serves is not checked")
        return warnings
    if str(sc.get("method")).lower() != "eagle3":
        raise Eagle3Error(f"the speculative vLLM server runs method={sc.get('method')}; use \"method\": \"eagle3\"")
    served = sc.get("model")
    if served and os.path.isfile(os.path.join(served, "config.json")):
        from eagle3.export import read_vllm_export

        other = read_vllm_export(served)  # refuses an export/sglang folder, naming export/vllm
        if list(other.meta.get("aux_layer_ids") or []) != list(export.meta.get("aux_layer_ids") or []):
            raise Eagle3Error(f"the speculative server's drafter ({served}) reads aux layers "
                              f"{other.meta.get('aux_layer_ids')} but the evaluated one {export.meta.get('aux_layer_ids')}; "
                              "serve the evaluated export")
        if other.meta.get("features_manifest_sha256") != export.meta.get("features_manifest_sha256"):
            warnings.append(f"the served drafter {served} was trained on other features than {export.dir}: "
                            "is it the same drafter?")
    if sc.get("num_speculative_tokens") not in (None, int(cfg.speculative.num_steps)):
        warnings.append(f"the speculative server proposes {sc['num_speculative_tokens']} tokens per step "
                        f"(configured speculative.num_steps={cfg.speculative.num_steps}); results are for the server's")
    return warnings


def cap_warnings(desc: dict, concurrency: list[int]) -> list[str]:
    """A warning per server whose ``max_num_seqs`` is below a tested concurrency, or unknown,
    and one when the servers' caps differ."""
    out = []
    for role, d in desc.items():
        cap = d["effective"].get("max_num_seqs")
        if cap is None:
            out.append(f"the {role} server's max_num_seqs could not be read back (no /server_info and no launch "
                       "log): throughput above its running-request cap would measure the cap")
        elif any(c > cap for c in concurrency):
            out.append(f"the {role} server runs at most max_num_seqs={cap} requests but concurrency "
                       f"{[c for c in concurrency if c > cap]} was tested: the extra requests queue, so those "
                       "throughputs measure the cap, not the drafter; raise engine.max_num_seqs")
    caps = {role: d["effective"].get("max_num_seqs") for role, d in desc.items()}
    if len(set(caps.values()) - {None}) > 1:
        out.append(f"the servers run different running-request caps (max_num_seqs {caps}): their throughputs "
                   "under load are not comparable; start every server with the same max_num_seqs")
    return out
