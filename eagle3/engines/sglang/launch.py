"""Starting an SGLang server as a child process, waiting for it, and stopping it.

:func:`launch_server` renders the command (:mod:`eagle3.engines.sglang.command`),
checks its flags against the installed server's ``--help``, starts it in its own
session with its log in the run folder and polls ``/health`` until it answers.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from eagle3.engines.sglang.client import SGLangClient
from eagle3.engines.sglang.command import (
    cuda_graph_flag,
    probe_server_flags,
    render_launch_command,
    server_device,
    sglang_available,
    unknown_flags,
)
from eagle3.errors import Eagle3Error

log = logging.getLogger(__name__)


def _tail(path: Path, n: int = 20) -> list[str]:
    """The last ``n`` non-blank lines of the log at ``path`` (its last 64 KiB read; none if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.strip()][-n:]


class LaunchedServer:
    """One ``sglang.launch_server`` process started by us, logging to ``log_path``.

    The process runs in its own session so :meth:`stop` can end it together with the
    scheduler processes it spawns (its process group), and nothing else.
    """

    def __init__(self, cmd: list[str], log_path: Path, url: str, env: dict | None = None):
        self.cmd, self.log_path, self.url, self.env = list(cmd), Path(log_path), url, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the process in its own session, stdout and stderr appended to the log
        after a ``$ <command>`` line."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as f:
            f.write(f"$ {shlex.join(self.cmd)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(
                self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float, poll_s: float = 5.0, report_every_s: float = 60.0) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds waited.

        A progress line shows the elapsed time and the server log's last line, so a
        5-10 minute load of a large model is visibly alive.

        Raises:
            Eagle3Error: the process exited, or ``timeout_s`` passed (the process is then
                stopped); both carry the log's last lines.
        """
        from tqdm.auto import tqdm

        client = SGLangClient(self.url)
        t0 = time.monotonic()
        last_report = t0
        bar = tqdm(total=None, bar_format="waiting for SGLang at {desc} [{elapsed}] {postfix}", desc=self.url, leave=False)
        try:
            while True:
                if client.health(timeout_s=min(10.0, max(1.0, poll_s * 2))):
                    return time.monotonic() - t0
                elapsed = time.monotonic() - t0
                rc = self.proc.poll() if self.proc else None
                if rc is not None:
                    tail = "\n".join(_tail(self.log_path))
                    raise Eagle3Error(
                        f"the SGLang server exited with code {rc} after {elapsed:.0f} s before answering /health "
                        f"(full log: {self.log_path}); its last lines:\n{tail}"
                    )
                if elapsed > timeout_s:
                    tail = "\n".join(_tail(self.log_path))
                    self.stop()
                    raise Eagle3Error(
                        f"the SGLang server did not answer {self.url}/health within {timeout_s:.0f} s; raise "
                        f"engine.launch_timeout_s if it is still loading (log: {self.log_path}); its last lines:\n{tail}"
                    )
                lines = _tail(self.log_path, 1)
                last_line = lines[-1][-160:] if lines else ""
                bar.set_postfix_str(last_line, refresh=True)
                if time.monotonic() - last_report >= report_every_s:
                    log.info("still waiting for SGLang at %s after %.0f s: %s", self.url, elapsed, last_line)
                    last_report = time.monotonic()
                time.sleep(poll_s)
        finally:
            bar.close()

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``grace_s``."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def server_env(engine_cfg: Any) -> dict | None:
    """The environment a launched server (and the probes before it) runs with.

    This process's environment, then what the shell line ``engine.env_script`` exports
    when bash sources it (the CPU build's ``env.sh VENV`` sets ``PYTHONPATH`` to its
    torchvision stand-in, ``SGLANG_USE_CPU_ENGINE`` and ``LD_PRELOAD``), then
    ``engine.env``. None when neither is set (the child inherits ours).

    Raises:
        Eagle3Error: the script fails when sourced (its message quoted).
    """
    script = getattr(engine_cfg, "env_script", None)
    extra = dict(getattr(engine_cfg, "env", None) or {})
    if not script and not extra:
        return None
    env = dict(os.environ)
    if script:
        r = subprocess.run(["bash", "-c", f". {script} >&2 && env -0"], capture_output=True, timeout=60, env=env)
        if r.returncode != 0:
            raise Eagle3Error(
                f"sourcing engine.env_script='{script}' failed with code {r.returncode} "
                f"({r.stderr.decode(errors='replace').strip()[-300:]}); fix the script or its arguments"
            )
        env = dict(kv.split("=", 1) for kv in r.stdout.decode(errors="replace").split("\0") if "=" in kv)
    env.update({str(k): str(v) for k, v in extra.items()})
    return env


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """The first of ``count`` consecutive TCP ports on ``host`` that are all free now.

    Evaluation launches the baseline on ``port`` and the speculative server on
    ``port + 1``, so a caller that needs both asks for ``count=2``. The OS picks the
    first port; the run is checked by binding every port of it at once. A port may be
    taken again before a server binds it.

    Raises:
        OSError: no such run was found in 64 tries.
    """
    for _ in range(64):
        socks: list[socket.socket] = []
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            first = s.getsockname()[1]
            if first + count - 1 > 65535:
                continue
            for k in range(1, count):
                t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(t)
                t.bind((host, first + k))
            return first
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise OSError(f"no {count} consecutive free TCP ports found on {host}")


def launch_server(
    model_cfg: Any,
    engine_cfg: Any,
    *,
    model_path: str,
    run_dir: str | os.PathLike,
    name: str,
    speculative: dict | None = None,
    capture: bool = False,
    port: int | None = None,
) -> tuple[LaunchedServer, list[str]]:
    """Render, check and start one server, wait until it is healthy.

    The installed server's ``--help`` decides the CUDA-graph flag's spelling and every
    rendered flag is checked against it before the (long) start. The probes and the
    server run in :func:`server_env`. The log goes to ``<run_dir>/sglang-<name>.log`` and
    the command to ``<run_dir>/sglang-<name>.cmd``.

    Raises:
        Eagle3Error: sglang is not installed for ``engine.python``, a rendered flag is
            unknown to it, or the server does not come up (with the log's last lines).
    """
    python = engine_cfg.python
    env = server_env(engine_cfg)
    if not sglang_available(python, env):
        raise Eagle3Error(
            f"the sglang package is not installed for '{python}' and engine.url is not set: install sglang "
            "where the GPUs are, or start a server yourself (docs/sglang.md) and pass engine.url=http://HOST:PORT"
        )
    port = int(port or engine_cfg.port)
    flags = probe_server_flags(python, env=env)
    cmd = render_launch_command(
        model_cfg, engine_cfg, model_path=model_path, port=port, speculative=speculative, capture=capture,
        cuda_graph_flag_name=cuda_graph_flag(flags), device=server_device(engine_cfg),
    )
    if flags:
        bad = unknown_flags(cmd, flags)
        if bad:
            raise Eagle3Error(
                f"the installed sglang does not accept {bad}; remove them from engine.extra_args / "
                "model.serve.extra_args or install an sglang version that has them"
            )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"sglang-{name}.cmd").write_text(shlex.join(cmd) + "\n")
    url = f"http://{_connect_host(engine_cfg.host)}:{port}"
    server = LaunchedServer(cmd, run_dir / f"sglang-{name}.log", url, env=env)
    log.info("starting SGLang (%s): %s", name, shlex.join(cmd))
    server.start()
    try:
        waited = server.wait_healthy(float(engine_cfg.launch_timeout_s), float(getattr(engine_cfg, "health_poll_s", 5.0)))
    except BaseException:
        server.stop()
        raise
    log.info("SGLang (%s) is up at %s after %.0f s", name, url, waited)
    return server, cmd


def _connect_host(host: str) -> str:
    """Where to connect to a server bound to ``host``: loopback for a wildcard address."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
