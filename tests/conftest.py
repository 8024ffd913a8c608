"""Shared test setup.

Without a CUDA device the Triton kernels run under the Triton interpreter, which must be
switched on before triton is first imported.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _drop_checkout_from_path():
    """``python -m pytest`` puts the checkout first on sys.path, where its top-level kernels/
    (installed as ttt_flash.kernels) would shadow the PyPI package ``kernels`` that
    transformers imports when it finds one. The tests import the installed ttt_flash."""
    root = Path(__file__).resolve().parents[1]
    kept = [p for p in sys.path if Path(p or os.getcwd()).resolve() != root]
    if len(kept) == len(sys.path):
        return
    saved = sys.path[:]
    sys.path[:] = kept
    if importlib.util.find_spec("ttt_flash") is None:  # not installed: run from the checkout
        sys.path[:] = saved


_drop_checkout_from_path()

# Lightning adds a logging.StreamHandler bound to the sys.stderr of its first import: imported
# here, that is the session's stream, not a test's capsys stream that is closed after the test
# (a later test's log line, e.g. "Seed set to 0", would then fail with "I/O operation on
# closed file" depending on which test a worker ran first).
import lightning.pytorch  # noqa: E402,F401


def pytest_configure(config):
    """Under pytest-xdist (README's ``-n auto``) the worker processes share the cores: each one
    runs ``cores / workers`` torch threads, and the processes it starts inherit that count."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, torch.get_num_threads() // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Without CUDA the ``gpu`` tests skip. With ``--dist loadgroup`` (pytest-xdist), tests that
    share a module-scoped fixture (a multi-process run, a trained checkpoint, a built site) run
    in one worker, which builds the fixture once, and the GPU tests run in one worker, one at a
    time."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("gpu"))
            if not torch.cuda.is_available():
                item.add_marker(skip_gpu)
            continue
        info = getattr(item, "_fixtureinfo", None)
        shared = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds
                  if d.scope in ("module", "package", "session") and d.baseid]
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def gpu_dot(monkeypatch):
    """The Triton interpreter's float32 ``tl.dot`` as the GPU rounds it: one fused multiply-add
    per k in order (tests/_gpu_dot.py), for tests whose bound is near float32 rounding. On a
    CUDA machine the kernels run compiled and nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter

    from _gpu_dot import install

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        interpreter.InterpreterBuilder.create_dot)
    assert install(), "this Triton's interpreter has no InterpreterBuilder.create_dot"
    yield


@pytest.fixture
def one_thread():
    """One torch thread: tiny matmuls on a shared 2-core CPU run several times faster than
    with two threads spinning against other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
