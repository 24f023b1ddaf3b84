"""mode=schedule against real vLLM servers (slow: four servers start, 2-4 minutes each on a CPU).

Skipped unless ``EAGLE3_VLLM_PYTHON`` names the python of a vLLM installation (as
tests/test_vllm_live.py). A one-layer drafter overfit on six prompts (extracted in process)
is served as static chains of 3 and 1 beside a server without speculation, all with
``max_num_seqs=4``, swept at concurrency 1 and 4 in two interleaved rounds; the schedule
derived from those runs is served through vLLM's ``num_speculative_tokens_per_batch_size``
and swept again beside them. Checked: every server runs the requested cap; at batch 1 the
schedule server drafts exactly the band's k per verify pass (the server applies the written
schedule), its greedy answers equal the baseline's, and it is faster than no speculation
there; the report, the SGLang config and the export's deployment notes are written, and the
export still reads. Ports ``EAGLE3_VLLM_PORT`` + 4 to + 7.
"""

from __future__ import annotations

import json
import os

import pytest

from test_vllm_live import COMMON, OVERFIT_PROMPTS, PORT, PY, _compose, _overfit_drafter
from test_vllm_live import pytestmark  # noqa: F401  (the same live mark and skips)


def test_a_derived_schedule_is_served_and_measured(tmp_path):
    from eagle3.evaluate.run import run_evaluate
    from eagle3.export import read_vllm_export
    from eagle3.extract.run import run_extract

    lines = "".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in OVERFIT_PROMPTS)
    (tmp_path / "train.jsonl").write_text(lines)
    (tmp_path / "evalset.jsonl").write_text(lines)  # other ids: not left out as trained on
    run_extract(_compose("extract", COMMON + [
        f"data.path={tmp_path / 'train.jsonl'}", "data.validation_fraction=0", "data.test_fraction=0",
        "engine.device=cpu", "sampling.max_new_tokens=48", f"output_dir={tmp_path / 'features'}"]))
    export = _overfit_drafter(tmp_path, tmp_path / "features")
    out = tmp_path / "eval"
    res = run_evaluate(_compose("evaluate", COMMON + [
        "engine=vllm", f"engine.python={PY}", f"engine.port={PORT + 4}", "engine.max_num_seqs=4",
        "engine.launch_timeout_s=1200", "mode=schedule", f"data.path={tmp_path / 'evalset.jsonl'}",
        "schedule.concurrency=[1,4]", "schedule.chains=[3,1]", "schedule.rounds=2", "max_new_tokens=48",
        "warmup_prompts=1", f"drafter_dir={export}", f"output_dir={out}"]))
    print("\n" + (out / "schedule.md").read_text())
    assert set(res["max_running_requests"]["served"]) == {"off", "chain-3", "chain-1", "schedule"}
    assert set(res["max_running_requests"]["served"].values()) == {4}
    assert res["derived"][0]["concurrency"] == 1 and res["derived"][0]["num_steps"] >= 1
    sched = res["schedule"]
    assert sched[0][0] == 1 and sched[-1][1] == 4
    k1 = sched[0][2]
    assert res["vllm_speculative_config"]["num_speculative_tokens_per_batch_size"] == sched
    at1 = res["table"][1]["schedule"]
    assert at1["draft_tokens_per_draft"] == pytest.approx(k1)  # batch 1 runs the first band's k, every pass
    assert at1["matches_off"][0] == at1["matches_off"][1] > 0
    row1 = next(r for r in res["comparison"] if r["concurrency"] == 1)
    assert row1["vs_off"] > 1.0
    for name in ("schedule.json", "throughput_schedule.png", "sglang_adaptive_config.json"):
        assert (out / name).is_file()
    notes = json.loads((export / "deployment_schedule.json").read_text())
    assert notes["schedule"] == sched
    assert read_vllm_export(export).written_aux_ids  # the notes do not disturb the export
    assert os.path.isfile(export / "deployment_schedule.md")
