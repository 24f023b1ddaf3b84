"""Extract stage: regenerate responses with the served target and capture its aux hidden states."""

from pathlib import Path

import hydra

import eagle3  # noqa: F401  (registers the config schema)
from eagle3.cli import exit_on_unknown_choice, run_stage

CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(version_base="1.3", config_path="conf", config_name="extract")
def main(cfg):
    from eagle3.extract.run import run_extract

    return run_stage(run_extract, cfg)


if __name__ == "__main__":
    from eagle3.cli import exit_on_bad_output_dir, exit_on_unknown_key
    from eagle3.config import ExtractConfig

    exit_on_unknown_choice(CONF, "extract")
    exit_on_unknown_key(ExtractConfig, CONF, "extract")
    exit_on_bad_output_dir()
    main()
