"""What the run drivers (``long_context_runs.py``, ``seed_runs.py``) share: stopping the runs
still going at a deadline, and reading a curve of a run's CSV log that may not be there."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Dict, List, Tuple


def stop_runs(procs: Dict[str, tuple], grace_s: float) -> None:
    """SIGTERM the process group of every run in ``procs`` (name -> (Popen, ...)), wait up to
    ``grace_s`` for them to exit (a stopped run finishes its step and writes its checkpoint),
    then SIGKILL the ones still going."""
    for name, (proc, *_) in procs.items():
        print(f"deadline: stopping {name}", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)
    stop = time.monotonic() + grace_s
    while time.monotonic() < stop and any(proc.poll() is None for proc, *_ in procs.values()):
        time.sleep(1)
    for proc, *_ in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def curve(csv: Path, metric: str) -> Tuple[List[int], List[float]]:
    """``(steps, values)`` of ``metric`` in a run's CSV log; empty when the log or the column
    is missing (a run that stopped early)."""
    from ttt_flash.lightning.curves import read_curve

    try:
        return read_curve(csv, metric)
    except (FileNotFoundError, KeyError):
        return [], []
