"""Evaluate stage: speculative decoding with the trained drafter against the served target."""

import hydra

import eagle3  # noqa: F401  (registers the config schema)
from eagle3.cli import run_stage


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg):
    if cfg.get("mode", "evaluate") == "doctor":  # the doctor's own entry is doctor.py
        from eagle3.doctor.run import run_doctor  # checks + probe; exits 1 when a check fails

        return run_stage(run_doctor, cfg)
    from eagle3.evaluate.run import run_evaluate

    return run_stage(run_evaluate, cfg)


if __name__ == "__main__":
    from pathlib import Path

    from eagle3.cli import exit_on_bad_output_dir, exit_on_unknown_choice, exit_on_unknown_key
    from eagle3.config import EvaluateConfig

    conf = Path(__file__).resolve().parent / "conf"
    exit_on_unknown_choice(conf, "evaluate")
    exit_on_unknown_key(EvaluateConfig, conf, "evaluate")
    exit_on_bad_output_dir()
    main()
