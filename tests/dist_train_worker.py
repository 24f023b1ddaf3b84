"""One process of a data-parallel toy training run (launched by tests/test_distributed.py).

    accelerate launch --multi_gpu --num_processes 2 tests/dist_train_worker.py FEATURES OUT [STOP_AFTER] key=json ...

(``--multi_gpu`` is Accelerate's torchrun launcher; on a machine without GPUs the
processes run on the CPU with the gloo backend.) Trains the toy drafter of
``toy.py`` on ``FEATURES`` into ``OUT`` with the given ``TrainConfig`` overrides
(values are JSON), stopping with a checkpoint after ``STOP_AFTER`` optimizer steps
when given, and appends ``[rank, step, sample ids]`` of every micro-batch to
``OUT/order-<rank>.jsonl``. A process that fails writes its traceback to
``OUT/error-<rank>.txt``, one that hangs for 300 s the stacks of its threads to
``OUT/hang-<rank>.txt`` (the launcher's stderr interleaves the ranks and a test shows
only its tail).

``DIST_FAULT=KIND:RANK:STEP`` in the environment (tests/test_distributed_faults.py) makes
process RANK fail when its first micro-batch of optimizer step STEP arrives, before its
forward pass: ``kill`` (SIGKILL: it dies) or ``hang`` (it sleeps: alive, answering no peer).
"""

import json
import sys
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from toy import embed, make_cfg, tiny_target  # noqa: E402

from eagle3.train.run import train_drafter  # noqa: E402


def main() -> None:
    import faulthandler
    import os

    features, out, *pairs = sys.argv[1:]
    stop_after = int(pairs.pop(0)) if pairs and "=" not in pairs[0] else None
    over = {}
    for p in pairs:
        k, v = p.split("=", 1)
        over[k] = json.loads(v)

    rank = int(os.environ.get("RANK", "0"))
    log = Path(out) / f"order-{rank}.jsonl"
    Path(out).mkdir(parents=True, exist_ok=True)
    hang_path = Path(out) / f"hang-{rank}.txt"
    hang = open(hang_path, "w")
    # a hung collective fails the test with every process's stack, not a timeout
    faulthandler.dump_traceback_later(300, exit=True, file=hang)

    fault = os.environ.get("DIST_FAULT", "").split(":")

    def on_batch(step, ids):
        with open(log, "a") as f:
            f.write(json.dumps([rank, step, ids]) + "\n")
        if len(fault) == 3 and (rank, step) == (int(fault[1]), int(fault[2])):
            import signal
            import time

            faulthandler.cancel_dump_traceback_later()  # the fault is no hang to report
            hang.close()
            hang_path.unlink(missing_ok=True)
            if fault[0] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # "hang": the launcher's SIGTERM ends it once a peer has failed

    try:
        train_drafter(make_cfg(features, out, **over), tiny_target(), embed(), on_batch=on_batch, stop_after=stop_after)
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        hang.close()
        hang_path.unlink(missing_ok=True)  # reached only when the process did not hang


if __name__ == "__main__":
    main()
