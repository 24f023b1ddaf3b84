"""The command line that prints the ``sglang.launch_server`` command eagle3 would run.

``python -m eagle3.engines.sglang {capture|baseline|speculative} model=... [overrides]``
(:mod:`eagle3.engines.sglang.__main__`) composes the stage's Hydra config and prints
the rendered command, so a server can be started by hand where the GPUs are.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from eagle3.engines.sglang.bootstrap import CAPTURE_SPEC, _target_dims, ensure_bootstrap_drafter
from eagle3.engines.sglang.command import (
    cuda_graph_flag,
    probe_server_flags,
    render_launch_command,
    resolve_model_path,
    server_device,
    sglang_available,
)
from eagle3.engines.sglang.launch import server_env
from eagle3.errors import Eagle3Error


def main(argv: list[str] | None = None) -> int:
    """Print the ``sglang.launch_server`` command eagle3 would run, for starting a server
    by hand: ``python -m eagle3.engines.sglang {capture|baseline|speculative} model=... [overrides]``.

    ``capture`` first writes the bootstrap drafter under ``cache_dir`` (once) and prints
    its folder; ``speculative`` serves ``drafter_dir`` (or the default export folder).
    Overrides are those of ``extract.py`` (capture) or ``evaluate.py`` (the others).

    Returns:
        the exit status: 0, or 2 after printing an :class:`~eagle3.errors.Eagle3Error`
        as one ``error:`` line on stderr.
    """
    from hydra import compose, initialize_config_dir

    from eagle3.cli import to_typed

    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("capture", "baseline", "speculative") else "capture"
    conf = Path(__file__).resolve().parents[3] / "conf"  # the repository's conf/, beside eagle3/
    stage = "extract" if mode == "capture" else "evaluate"
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = to_typed(compose(config_name=stage, overrides=["engine=sglang"] + argv))
        dims = _target_dims(cfg.model, cfg.cache_dir)
        spec = None
        if mode == "capture":
            boot = ensure_bootstrap_drafter(cfg.model, dims, list(dims["aux_layer_ids"]), cfg.cache_dir)
            print(f"# bootstrap drafter: {boot}", file=sys.stderr)
            spec = dict(CAPTURE_SPEC, draft_model_path=str(boot.resolve()))
        elif mode == "speculative":
            from eagle3.export import export_dir

            spec = {"draft_model_path": str(export_dir(cfg.drafter_dir, "sglang").resolve()),
                    "num_steps": cfg.speculative.num_steps,
                    "topk": cfg.speculative.topk, "num_draft_tokens": cfg.speculative.num_draft_tokens}
        env = server_env(cfg.engine)
        flags = probe_server_flags(cfg.engine.python, env=env) if sglang_available(cfg.engine.python, env) else None
        cmd = render_launch_command(
            cfg.model, cfg.engine, model_path=resolve_model_path(cfg.model, dims), port=int(cfg.engine.port),
            speculative=spec, capture=mode == "capture", cuda_graph_flag_name=cuda_graph_flag(flags),
            device=server_device(cfg.engine),
        )
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(shlex.join(cmd))
    return 0
