"""``python -m eagle3.engines.sglang {capture|baseline|speculative} model=... [overrides]``.

Prints the ``sglang.launch_server`` command eagle3 would run (see
:func:`eagle3.engines.sglang.cli.main`).
"""

from eagle3.engines.sglang.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
