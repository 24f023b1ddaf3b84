"""Extract stage: regenerate responses with the served target and capture its aux hidden states."""

import sys
from pathlib import Path

import hydra

import eagle3  # noqa: F401  (registers the config schema)
from eagle3.cli import run_stage

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="extract")
def main(cfg):
    from eagle3.extract.run import run_extract

    return run_stage(run_extract, cfg)


if __name__ == "__main__":
    from eagle3.extract.run import unknown_group_choice

    problem = unknown_group_choice(sys.argv[1:], CONF)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
