"""The tile table and the fallback to smaller tiles on GPUs with less shared memory."""

import dataclasses

import pytest
import torch
from triton.runtime.errors import OutOfResources

from memattn.check import Case, check_backward, check_forward
from memattn.kernels import backward as backward_kernels
from memattn.kernels import forward as forward_kernels
from memattn.kernels import tuning
from memattn.kernels.common import STATS_SLACK
from memattn.spec import check_call

from .conftest import DEVICE
from .test_forward import assert_results

cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="fakes OutOfResources in the interpreter")


def _spec(**options):
    q = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    return check_call(q, q, q, **options)


def test_launch_fitting_skips_what_did_not_fit():
    spec = _spec(causal=True)
    big, small = tuning.Config(128, 128, 8, 3), tuning.Config(64, 64, 4, 2)
    launched = []

    def launch(cfg):
        launched.append(cfg)
        if cfg is big:
            raise OutOfResources(262144, 232448, "shared memory")

    assert tuning.launch_fitting("test-fit", spec, (big, small), launch) is small
    assert tuning.launch_fitting("test-fit", spec, (big, small), launch) is small
    assert launched == [big, small, small]  # big is not tried again for this spec
    other = _spec()
    assert tuning.launch_fitting("test-fit", other, (big, small), launch) is small
    assert launched[-2:] == [big, small]  # a different spec tries the table's first


def test_launch_fitting_raises_when_nothing_fits():
    spec = _spec(softcap=2.0)

    def launch(cfg):
        raise OutOfResources(300000, 232448, "shared memory")

    configs = (tuning.Config(128, 128, 8, 3), tuning.Config(32, 16, 4, 1))
    for _ in range(2):  # the second time too: Triton's own error, not a silent skip
        with pytest.raises(OutOfResources):
            tuning.launch_fitting("test-none", spec, configs, launch)


@pytest.mark.parametrize("options", [{}, {"causal": True, "dropout_p": 0.1}],
                         ids=["plain", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_table_then_smaller_fallbacks(monkeypatch, head_dim, options):
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    q = torch.empty(1, 8, 2, head_dim, dtype=torch.bfloat16)
    spec = check_call(q, q, q, **options)
    for configs, first, fallbacks in (
        (tuning.forward_configs(spec), tuning.forward_config(spec), tuning.FORWARD_FALLBACKS),
        (tuning.backward_configs(spec), tuning.backward_config(spec),
         tuning.BACKWARD_FALLBACKS),
    ):  # fmt: skip
        assert configs[0] == first and len(set(configs)) == len(configs)
        assert set(configs[1:]) <= set(fallbacks)
    # the backward's query tiles read row statistics past a sequence's end from its
    # slack alone (common.row_stats_buffer), unmasked
    for c in (*tuning.backward_configs(spec), tuning.INTERPRETER_BACKWARD):
        assert max(c.block_m_dkdv, c.block_m_dq) <= STATS_SLACK.value, c


class _TooBigFor:
    """Stands in for a jit kernel: raises OutOfResources, as Triton does before a
    launch, for one BLOCK_M, and launches the real kernel otherwise."""

    def __init__(self, kernel, block_m):
        self.kernel, self.block_m, self.refused = kernel, block_m, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if kwargs["BLOCK_M"] == self.block_m:
                self.refused += 1
                raise OutOfResources(262144, 232448, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


@cpu_only
def test_forward_and_backward_fall_back_and_stay_correct(monkeypatch):
    """A table entry the device cannot hold is replaced by the next config: the results
    are still checked against the float64 reference."""
    too_big_fwd = tuning.Config(64, 16, 1, 1)
    too_big_bwd = dataclasses.replace(tuning.INTERPRETER_BACKWARD, block_m_dkdv=64,
                                      block_m_dq=64)  # fmt: skip
    monkeypatch.setattr(tuning, "forward_configs",
                        lambda spec: (too_big_fwd, tuning.forward_config(spec)))
    monkeypatch.setattr(tuning, "backward_configs",
                        lambda spec: (too_big_bwd, tuning.backward_config(spec)))
    fwd = _TooBigFor(forward_kernels._fwd_kernel, 64)
    dkdv = _TooBigFor(backward_kernels._dkdv_kernel, 64)
    dq = _TooBigFor(backward_kernels._dq_kernel, 64)
    monkeypatch.setattr(forward_kernels, "_fwd_kernel", fwd)
    monkeypatch.setattr(backward_kernels, "_dkdv_kernel", dkdv)
    monkeypatch.setattr(backward_kernels, "_dq_kernel", dq)
    case = Case("fallback", seqlen_q=37, seqlen_k=45, options=dict(causal=True))
    assert_results(check_forward(case, torch.float32, "cpu", seed=5))
    assert_results(check_backward(case, torch.float32, "cpu", seed=5))
    assert fwd.refused >= 1 and dkdv.refused == 1 and dq.refused == 1
