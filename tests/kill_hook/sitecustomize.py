"""A test-only start-up hook (``tests/test_kill_resume.py`` puts this folder on ``PYTHONPATH``):
traces a stage's file events and kills the process with SIGKILL at a named one.

Environment (nothing happens without ``EAGLE3_KILL_ROOT``):

* ``EAGLE3_KILL_ROOT``: the stage's output folder; only paths inside it are events, named
  relative to it.
* ``EAGLE3_KILL_TRACE``: a file that gets one JSON line per event, ``{"t": seconds since start,
  "id": event}``, written before the event's operation runs.
* ``EAGLE3_KILL_AT``: ``<event>|before`` (SIGKILL before the operation runs: a temporary file is
  written but not yet renamed, a folder not yet made) or ``<event>|<seconds>`` (SIGKILL from a
  timer that many seconds after the event, wherever the process is then).

Events come from Python's audit hooks (``sys.addaudithook``): ``start`` (this module's import),
``mkdir:<path>`` (``os.mkdir``, also through ``os.makedirs``) and ``rename:<destination>``
(``os.rename`` / ``os.replace``). A manifest's rename is told apart by what the new file lists,
``rename:manifest.json[<n> shards]`` or ``[<n> shards, complete]``, and the side counts' by their
number of shards. An event is traced (and can kill) the first time it happens in a process only,
so every event of an uninterrupted run has a name of its own (a folder made again, ``mkdir:.``,
is the first one's). Only the process that imported this module acts (not a forked child).
"""

import json
import os
import signal
import sys
import threading
import time

_ROOT = os.environ.get("EAGLE3_KILL_ROOT")
_PID = os.getpid()
_T0 = time.monotonic()
_busy = False
_seen = set()


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _rel(path):
    try:
        p = os.path.relpath(os.path.abspath(os.fsdecode(os.fspath(path))), _ROOT)
    except (TypeError, ValueError):
        return None
    return None if p.startswith("..") else p


def _tagged(src, dst):
    """``dst`` with what the renamed file ``src`` holds, for the files a run rewrites many times."""
    name = os.path.basename(dst)
    if name not in ("manifest.json", "extract_stats.json"):
        return dst
    try:
        with open(src) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return dst + "[unreadable]"
    if name == "extract_stats.json":
        return f"{dst}[{len(obj)} shards]"
    return f"{dst}[{len(obj.get('shards', []))} shards{', complete' if obj.get('complete') else ''}]"


def _event(name):
    if name in _seen:
        return
    _seen.add(name)
    at = os.environ.get("EAGLE3_KILL_AT", "")
    trace = os.environ.get("EAGLE3_KILL_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write(json.dumps({"t": time.monotonic() - _T0, "id": name}) + "\n")
    target, _, when = at.rpartition("|")
    if target != name:
        return
    os.environ["EAGLE3_KILL_AT"] = ""  # once
    if when == "before":
        _kill()
    timer = threading.Timer(float(when), _kill)
    timer.daemon = True
    timer.start()


def _hook(event, args):
    global _busy
    if _busy or os.getpid() != _PID or event not in ("os.rename", "os.mkdir"):
        return
    _busy = True
    try:
        rel = _rel(args[1] if event == "os.rename" else args[0])
        if rel is not None:
            _event(f"rename:{_tagged(args[0], rel)}" if event == "os.rename" else f"mkdir:{rel}")
    finally:
        _busy = False


if _ROOT:
    sys.addaudithook(_hook)
    _event("start")
