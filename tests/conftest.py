"""Test set-up: CPU runs go through Triton's interpreter; every output is poisoned.

TRITON_INTERPRET must be set before memattn's kernels are decorated; memattn imports
them lazily, so setting it here, before any test imports them, is early enough.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["MEMATTN_POISON_OUTPUTS"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# tests at the interpreter's small sizes; the GPU suite has its own at the device's
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes; the GPU has its own")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


def capture(fn):
    """fn captured into a CUDA graph after a warm-up call on a side stream (torch's
    recipe: lazy set-up and first allocations outside the capture). Returns the graph
    and what fn returned while captured: the tensors each replay refills."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


@pytest.fixture(autouse=True, scope="session")
def _check_launch_variants():
    """Every Gluon launch given a `variant` also works out its key from the arguments and
    checks that the variant's first launch had the same (hopper.Launcher): the suite
    then tests each caller's variant against every call it makes."""
    from memattn.kernels import hopper

    hopper.CHECK_VARIANTS = True


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Launch plans are cached from the kernels' knobs and the SM count, which tests
    monkeypatch: each test makes its own and leaves none (this fixture's teardown runs
    after monkeypatch has put the knobs back)."""
    from memattn.kernels import hopper

    hopper.forget_plans()
    yield
    hopper.forget_plans()
