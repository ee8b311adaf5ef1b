"""kernels/hopper.py: what the Gluon kernels share. The launcher's bookkeeping runs on
the CPU against a stand-in kernel; the real launches run on the GPU."""

import pytest
import torch

import memattn
from memattn.kernels import forward_sm90, hopper

from .test_forward import hopper_kernel_runs_here


class _StandInKernel:
    function = "fn"
    packed_metadata = "meta"

    def __init__(self):
        self.launches = []

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.launches.append(args)


class _StandInJit:
    """JITFunction's surface that Launcher uses: arg_names and fn[grid](*args, **kw)."""

    arg_names = ["x", "n", "f", "BLOCK", "FLAG"]

    def __init__(self):
        self.compiles = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            kernel = _StandInKernel()
            self.compiles.append((grid, args, kwargs, kernel))
            return kernel

        return run


class _StandInDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def launcher(monkeypatch):
    monkeypatch.setattr(hopper.driver, "_active", _StandInDriver())
    return hopper.Launcher(_StandInJit())


def test_launcher_compiles_once_per_specialisation_then_launches_directly(launcher):
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert len(launcher.fn.compiles) == 1
    launcher((5,), x, 48, 0.25, BLOCK=16, FLAG=True, num_warps=4)  # same specialisation
    assert len(launcher.fn.compiles) == 1
    kernel = launcher.fn.compiles[0][3]
    # grid, stream, function, metadata, launch metadata, hooks, then the signature's
    # arguments in order: runtime ones, then the constexprs (num_warps is an option)
    (launch,) = kernel.launches
    assert launch[:4] == (5, 1, 1, 1234)
    assert launch[4:6] == ("fn", "meta")
    assert launch[9:] == (x, 48, 0.25, 16, True)


@pytest.mark.parametrize(
    "change",
    [dict(n=33), dict(n=1), dict(n=2**31), dict(x=torch.zeros(64)[1:]),
     dict(x=torch.zeros(64, dtype=torch.float16)), dict(BLOCK=32), dict(num_warps=8)],
    ids=["n not /16", "n == 1", "n wide", "x misaligned", "x dtype", "constexpr", "option"],
)  # fmt: skip
def test_launcher_compiles_again_when_run_would_specialise_differently(launcher, change):
    call = dict(x=torch.zeros(64), n=32, BLOCK=16, num_warps=4)
    launcher((1,), call["x"], call["n"], 0.5, BLOCK=call["BLOCK"], FLAG=False,
             num_warps=call["num_warps"])  # fmt: skip
    call.update(change)
    launcher((1,), call["x"], call["n"], 0.5, BLOCK=call["BLOCK"], FLAG=False,
             num_warps=call["num_warps"])  # fmt: skip
    assert len(launcher.fn.compiles) == 2


class _CountingJit:
    """Wraps a JITFunction, counting the launches that go through JITFunction.run."""

    def __init__(self, fn):
        self.fn, self.arg_names, self.runs = fn, fn.arg_names, 0

    def __getitem__(self, grid):
        self.runs += 1
        return self.fn[grid]


@pytest.mark.gpu
def test_repeat_calls_launch_directly_and_match_gpu(monkeypatch):
    """The first call of a variant goes through JITFunction.run, the second straight to
    the compiled kernel: the same result, bit for bit."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    launcher = forward_sm90._launch_forward
    monkeypatch.setattr(launcher, "fn", _CountingJit(launcher.fn))
    monkeypatch.setattr(launcher, "kernels", {})
    q, k, v = (torch.randn(2, 2100, 4, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    first = memattn.attention(q, k, v, return_lse=True)
    assert launcher.fn.runs == 1
    second = memattn.attention(q, k, v, return_lse=True)
    assert launcher.fn.runs == 1
    assert all(torch.equal(a, b) for a, b in zip(first, second))
