"""Train stage: an EAGLE-3 drafter on the extracted features, exported for SGLang and vLLM."""

import hydra

import eagle3  # noqa: F401  (registers the config schema)
from eagle3.cli import run_stage


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg):
    from eagle3.train.run import run_train

    return run_stage(run_train, cfg)


if __name__ == "__main__":
    from pathlib import Path

    from eagle3.cli import exit_on_bad_output_dir, exit_on_unknown_choice, exit_on_unknown_key
    from eagle3.config import TrainConfig

    conf = Path(__file__).resolve().parent / "conf"
    exit_on_unknown_choice(conf, "train")
    exit_on_unknown_key(TrainConfig, conf, "train")
    exit_on_bad_output_dir()
    main()
