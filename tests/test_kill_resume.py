"""SIGKILL and resume: ``python extract.py`` and ``python train.py`` are each killed at ten seeded
moments of their run and started again with the same command; the folder they end with equals an
uninterrupted run's byte for byte, except the fields that describe a launch rather than its result
(named and checked below).

The kill points come from ``tests/kill_hook/sitecustomize.py``, put on the subprocesses'
``PYTHONPATH`` (eagle3 itself has no hook): it traces a run's file events (a folder made, a
temporary file renamed to its final name, each with a name of its own) and kills the process with
SIGKILL at a named one. The uninterrupted run's trace is the timeline: ten of its events are drawn
(seeded, over the whole run), each killed *before* its operation (a shard, manifest or side-count
file written under its temporary name but not renamed; a checkpoint folder complete but not
renamed; an export folder not swapped in) or after a random fraction of the time to the next event
(start-up, model load and generation, a capture, ``save_state`` writing a checkpoint, training
steps). Some kinds of point are always among the ten (``MUST``). A point that an earlier launch got
past (a timer that fired late) moves to the next free event of its ``MUST`` kind, or to a free event
drawn after it, or, once the run has reached its end, into the start-up of its rerun. Both stages run side by side, each process on one thread, to halve the wall time
on two cores.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "kill_hook"
KILLS = 10
SHORT_GAP_S = 0.02  # seconds
SEED = int(os.environ.get("EAGLE3_KILL_SEED", "46"))  # another seed draws other points (a soak run)
# kinds of point every run is killed at: (event pattern, mode)
MUST = {
    "extract": [(r"mkdir:\.hydra$", "timer"),  # Hydra's start: imports, the target's check, the model load
                (r"rename:manifest\.json\[0 ", "timer"),  # generating the first window's replies
                (r"rename:extract_stats", "timer"),  # a shard's capture and write
                (r"rename:shard-", "before"), (r"rename:manifest\.json\[[1-9]", "before")],
    "train": [(r"mkdir:\.hydra$", "timer"),  # imports, the features' checksums, the drafter's build
              (r"rename:checkpoints/step-", "timer"),  # training steps
              (r"mkdir:checkpoints/step-\d+\.tmp", "timer"),  # save_state writing a checkpoint
              (r"rename:checkpoints/step-", "before"), (r"(mkdir|rename):export/", "before")],
}
PROMPTS = ["Hi there", "Name a colour.", "2+2?", "Tell me about the sea.", "Why is the sky blue?", "Count to three.",
           "What is rain?", "Say hello.", "Pick a number.", "Name a fruit.", "What is a cat?", "Spell dog."]


@dataclass
class Launch:
    """One start of a stage's command: what it was to be killed at, its exit status, its events."""

    kill_at: str
    rc: int
    events: list[dict]
    stderr: str = ""


@dataclass
class Chain:
    """An uninterrupted run (``ref``, in ``ref_dir``) and the killed and resumed one (in ``kill_dir``)."""

    ref_dir: Path
    kill_dir: Path
    ref: Launch
    launches: list[Launch] = field(default_factory=list)

    def kills(self) -> list[str]:
        return [x.kill_at for x in self.launches if x.rc == -signal.SIGKILL]


def _launch(cmd: list[str], cwd: Path, kill_at: str = "") -> Launch:
    """Run ``cmd`` in ``cwd`` (output folder ``cwd/out``) with the hook; returns when it exits or is killed."""
    cwd.mkdir(parents=True, exist_ok=True)
    trace = cwd / "trace.jsonl"
    trace.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOK), str(ROOT)]), EAGLE3_KILL_ROOT=str(cwd / "out"),
               EAGLE3_KILL_TRACE=str(trace), EAGLE3_KILL_AT=kill_at, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    events = []
    for line in trace.read_text().splitlines() if trace.exists() else []:
        try:
            events.append(json.loads(line))
        except ValueError:  # the line a timer's kill cut short
            pass
    return Launch(kill_at, r.returncode, events, r.stderr[-3000:])


@dataclass(frozen=True)
class Point:
    """A kill point: the uninterrupted run's event ``index``, ``"before"`` its operation or
    ``"timer"``; ``must``: the ``MUST`` pattern it stands for (None for a drawn one)."""

    index: int
    mode: str
    must: Optional[str] = None


def _draw(ref: list[dict], rng: random.Random, must: list[tuple[str, str]]) -> list[Point]:
    """Ten kill points on the uninterrupted run's trace: one of each ``must`` kind (never its last
    event, so a later one can stand in for it), the rest drawn over every event after Hydra's start
    (before it nothing of the stage has run), half of them before the event's operation. A timer
    kills a random fraction of the time to the next event later, so the last event is killed before
    its operation only."""
    last = len(ref) - 1
    first = 1 + next(i for i, e in enumerate(ref) if e["id"] == "mkdir:.hydra")
    points: dict[int, Point] = {}
    for pattern, mode in must:
        matches = [i for i, e in enumerate(ref) if re.match(pattern, e["id"])]
        options = matches[:-1] or matches
        i = rng.choice([i for i in options if i not in points])
        points[i] = Point(i, mode, pattern)
    modes = ["before", "timer"] * KILLS
    rng.shuffle(modes)
    for i, mode in zip(rng.sample([i for i in range(first, len(ref)) if i not in points], KILLS - len(points)), modes):
        # a timer in a gap of a few milliseconds would fire after the next events (its thread waits for
        # the GIL), past the points drawn there: such a point is killed before its event instead
        short = i == last or ref[i + 1]["t"] - ref[i]["t"] < SHORT_GAP_S
        points[i] = Point(i, "before" if short else mode)
    return sorted(points.values(), key=lambda p: p.index)


def _stand_in(ref: list[dict], p: Point, pos: int, taken: set[int], rng: random.Random) -> Point:
    """A point for ``p``, which a launch got past (a timer fires early or late): the next free event
    of its ``MUST`` kind, else a free event drawn after ``pos``; when the run has reached its last
    event, a kill in the start-up of the finished run's rerun (a timer after Hydra's start)."""
    free = [i for i in range(pos + 1, len(ref)) if i not in taken]
    same = [i for i in free if p.must and re.match(p.must, ref[i]["id"])]
    if not free:
        return Point(next(i for i, e in enumerate(ref) if e["id"] == "mkdir:.hydra"), "timer")
    i = same[0] if same else rng.choice(free)
    return Point(i, "before" if i == len(ref) - 1 else p.mode, p.must if same else None)


def _spec(ref: list[dict], p: Point, rng: random.Random) -> str:
    """``EAGLE3_KILL_AT`` for a point: ``<event>|before`` or ``<event>|<seconds>``."""
    if p.mode == "before":
        return f"{ref[p.index]['id']}|before"
    gap = ref[p.index + 1]["t"] - ref[p.index]["t"] if p.index + 1 < len(ref) else 0.0
    return f"{ref[p.index]['id']}|{rng.random() * gap:.6f}"


def _kill_chain(cmd: list[str], base: Path, stage: str) -> Chain:
    """The uninterrupted run, then the same command killed at ten points and resumed to its end."""
    ref = _launch(cmd, base / "ref")
    assert ref.rc == 0, ref.stderr
    chain = Chain(base / "ref" / "out", base / "kill" / "out", ref)
    rng = random.Random(f"{SEED}-{stage}")
    events, index_of = ref.events, {e["id"]: i for i, e in enumerate(ref.events)}
    assert len(index_of) == len(events) > KILLS + 5  # every event named once, enough of them
    todo, pos = _draw(events, rng, MUST[stage]), -1  # pos: the furthest event a launch reached
    while todo and len(chain.launches) < 3 * KILLS:
        passed = [p for p in todo if p.index <= pos]
        todo = [p for p in todo if p.index > pos]
        for p in passed:
            todo = sorted(todo + [_stand_in(events, p, pos, {t.index for t in todo}, rng)], key=lambda t: t.index)
        launch = _launch(cmd, base / "kill", _spec(events, todo.pop(0), rng))
        chain.launches.append(launch)
        assert launch.rc in (-signal.SIGKILL, 0), launch.stderr
        pos = max([pos] + [index_of.get(e["id"], -1) for e in launch.events])
        if launch.rc == 0:  # a timer that the run's end beat: a kill of its rerun instead
            todo.insert(0, _stand_in(events, Point(len(events) - 1, "timer"), len(events) - 1, set(), rng))
    final = _launch(cmd, base / "kill")
    chain.launches.append(final)
    assert final.rc == 0, final.stderr
    return chain


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _compare(chain: Chain, launch_fields) -> None:
    """Every file of the killed run's folder equals the uninterrupted run's byte for byte, except
    those ``launch_fields(name, ref_bytes, got_bytes)`` checks (it returns True for a file it checked),
    Hydra's record of the launch (its ``runtime.cwd`` and ``runtime.output_dir``, the two runs' own
    folders: equal once those are swapped) and the stage's log (timestamps; a resumed run appends
    each launch's lines)."""
    ref, got = _files(chain.ref_dir), _files(chain.kill_dir)
    assert sorted(got) == sorted(ref)  # no file missing, no temporary file or old checkpoint left
    for name in ref:
        if launch_fields(name, ref[name], got[name]):
            continue
        if name == ".hydra/hydra.yaml":
            a, b = str(chain.ref_dir.parent), str(chain.kill_dir.parent)
            assert got[name].decode().replace(b, a) == ref[name].decode(), name
        elif name.endswith(".log"):
            assert got[name]
        else:
            assert got[name] == ref[name], name


def _write_chats(path: Path) -> Path:
    rows = []
    for i, q in enumerate(PROMPTS):
        m = [{"role": "user", "content": q}]
        if i % 3 == 0:  # every third conversation has a second user turn to regenerate
            m += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And then?"}]
        rows.append({"messages": m})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _extract_cmd(tiny_target_dir: Path, tmp: Path) -> list[str]:
    chats = _write_chats(tmp / "chats.jsonl")
    return [sys.executable, str(ROOT / "extract.py"), "model=smollm2-135m-bf16", "model.name=tiny",
            f"model.source={tiny_target_dir}", "data=jsonl", f"data.path={chats}", "data.validation_fraction=0.2",
            "data.test_fraction=0.0", f"cache_dir={tmp / 'cache'}", "engine.device=cpu", "engine.generate_batch_size=2",
            "engine.capture_batch_size=2", "engine.max_batch_tokens=512", "sampling.max_new_tokens=10",
            "capture.top_k=4", "capture.max_length=96", "capture.shard_size_mb=0.04", "output_dir=out"]


def _train_cmd(tmp: Path) -> list[str]:
    """A toy features folder (tests/toy.py) for a tiny float32 Llama of its sizes, and train.py on it:
    12 optimizer steps over two epochs, a checkpoint every 2."""
    from toy import write_target_and_features

    write_target_and_features(tmp / "toy_target", tmp / "features", tmp / "cache", n=30)
    return [sys.executable, str(ROOT / "train.py"), f"model.source={tmp / 'toy_target'}", "model.name=tiny",
            "model.quantization.method=none", "model.dtype=float32", f"cache_dir={tmp / 'cache'}",
            f"features_dir={tmp / 'features'}", "data.name=toy", "drafter.ttt_steps=3", "drafter.draft_vocab_size=48",
            "loop.max_tokens_per_batch=48", "loop.max_steps=12", "loop.save_every=2", "loop.log_every=1",
            "loop.tracker=none", "export.speculators=false", "device=cpu", "output_dir=out"]


@pytest.fixture(scope="module")
def chains(tiny_target_dir, tmp_path_factory) -> dict[str, Chain]:
    """Both stages' chains, run side by side."""
    ext, tr = tmp_path_factory.mktemp("kill_extract"), tmp_path_factory.mktemp("kill_train")
    cmds = {"extract": (_extract_cmd(tiny_target_dir, ext), ext), "train": (_train_cmd(tr), tr)}
    with ThreadPoolExecutor(2) as pool:
        futures = {s: pool.submit(_kill_chain, cmd, base, s) for s, (cmd, base) in cmds.items()}
        return {s: f.result() for s, f in futures.items()}


def _check_kills(chain: Chain, stage: str) -> None:
    kills = chain.kills()
    assert len(kills) == KILLS, [x.kill_at for x in chain.launches]
    for pattern, mode in MUST[stage]:
        if mode == "before":  # deterministic: the process dies at that operation
            assert any(re.match(pattern, k) and k.endswith("|before") for k in kills), (pattern, kills)
    # the points are spread over the run: from its first half and from its second half
    order = [e["id"] for e in chain.ref.events]
    at = sorted(order.index(k.rpartition("|")[0]) for k in kills)
    assert at[0] < len(order) // 2 <= at[-1], kills


def test_extract_killed_ten_times_ends_with_the_uninterrupted_runs_files(chains):
    chain = chains["extract"]
    _check_kills(chain, "extract")
    ref_manifest = json.loads((chain.ref_dir / "manifest.json").read_text())
    assert len(ref_manifest["shards"]) >= 5 and ref_manifest["complete"]  # several shards, two windows
    assert len(list((chain.ref_dir / "replies").iterdir())) == 2

    def launch_fields(name, a, b):
        if name != "manifest.json":
            return False
        # summary.this_run: the last launch's own counts and timing (resumed shards, wall time, tokens/s)
        a, b = json.loads(a), json.loads(b)
        assert a["summary"].pop("this_run").keys() == b["summary"].pop("this_run").keys()
        assert json.dumps(a) == json.dumps(b)  # the rest, in the same order: shards, sha256s, counts, plan
        return True

    _compare(chain, launch_fields)


TRAIN_LAUNCH_FIELDS = {"tokens_per_s", "train_time_s", "wall_time_s", "peak_memory_gb", "launch_first_step", "train"}


def test_train_killed_ten_times_ends_with_the_uninterrupted_runs_files(chains):
    chain = chains["train"]
    _check_kills(chain, "train")
    assert len(list((chain.ref_dir / "checkpoints").iterdir())) == 2

    def launch_fields(name, a, b):
        a, b = json.loads(a) if name.endswith(".json") else a, json.loads(b) if name.endswith(".json") else b
        if name == "metrics.json":
            # this launch's speed, time and memory; launch_first_step, the step it resumed from; train, the
            # last log interval, which never spans a resume: with loop.log_every=1 the last step's metrics,
            # the same unless this launch trained no step (it resumed from the last checkpoint)
            assert {k for k in a if a[k] != b[k]} <= TRAIN_LAUNCH_FIELDS and a.keys() == b.keys()
            assert b["train"] == (a["train"] if b["launch_first_step"] < b["step"] else {})
            return True
        if name == "summary.json":  # the sweep row: tokens/s and peak memory of this launch
            assert {k for k in a["summary"] if a["summary"][k] != b["summary"][k]} <= {"tokens_per_s", "peak_mem_gb"}
            assert {k: v for k, v in a.items() if k != "summary"} == {k: v for k, v in b.items() if k != "summary"}
            return True
        return False

    _compare(chain, launch_fields)


def test_a_shard_write_killed_inside_safetensors_leaves_nothing_after_the_resume(tmp_path):
    """safetensors writes through a temporary ``.tmpXXXXXX`` beside its destination; a process killed
    inside ``save_file`` (here by SIGXFSZ at a 1 MiB file size limit, mid-write) leaves it behind, and
    the resumed writer removes it, keeping every other file."""
    from eagle3.features import FeatureWriter

    child = ("import resource, signal, torch\nfrom safetensors.torch import save_file\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
             "save_file({'x': torch.zeros(1 << 20)}, 'shard-00000.safetensors.tmp')\n")
    (tmp_path / "notes.txt").write_text("kept")
    r = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGXFSZ, r.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and left[0].startswith(".tmp") and len(left[0]) == 10, left  # the orphan, notes.txt
    FeatureWriter.open(tmp_path, {"capture": {"top_k": 4}}, [("s0", "train")], samples_per_shard=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "notes.txt"]
