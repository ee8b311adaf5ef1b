"""Random calls, options drawn together (check.random_call), through the public call
against the float64 reference, forward and backward: combinations the feature grid does
not spell out. The seed is the test's id; `memattn check --random N --seed S` draws the
same calls.

CPU (CI): a few at the interpreter's sizes. GPU (`pytest -m gpu`): many at sizes that
fill the tiles, most on the Hopper kernels; MEMATTN_RANDOM_SEEDS=FIRST:STOP draws
others (a longer search for bugs: `MEMATTN_RANDOM_SEEDS=96:1000 pytest -m gpu -n 16
tests/test_check.py`).
"""

import os

import pytest
import torch

from memattn import cli
from memattn.check import check_backward, check_forward, random_call

from .conftest import cpu_only


def _check(seed: int, gpu: bool):
    call = random_call(seed, gpu)
    device = "cuda" if gpu else "cpu"
    results = (check_forward(call.case, call.dtype, device, seed=seed)
               + check_backward(call.case, call.dtype, device, seed=seed,
                                bias_grad=call.bias_grad, lse_grad=call.lse_grad,
                                frozen=call.frozen))  # fmt: skip
    failed = [f"{r.what}: error {r.error:.3g} > allowed {r.allowed:.3g}"
              for r in results if not r.passed]  # fmt: skip
    assert not failed, f"{call}: " + "; ".join(failed)


@cpu_only
@pytest.mark.parametrize("seed", range(6))
def test_random_calls_cpu(seed):
    _check(seed, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(*map(int, os.environ.get("MEMATTN_RANDOM_SEEDS",
                                                                  "0:96").split(":"))))
def test_random_calls_gpu(seed):
    _check(seed, gpu=True)


@pytest.mark.parametrize("gpu", [False, True])
def test_random_calls_draw_every_option(gpu):
    """Over a few hundred seeds every option comes up, alone and with others, and the
    same seed draws the same call."""
    calls = [random_call(seed, gpu) for seed in range(300)]
    assert random_call(7, gpu) == calls[7]
    options = [c.case.options for c in calls]
    for name in ("causal", "window", "align", "softcap", "scale", "dropout_p",
                 "deterministic"):  # fmt: skip
        assert sum(name in o for o in options) >= 15, name
    cases = [c.case for c in calls]
    assert sum(c.varlen for c in cases) >= 50
    assert sum(c.varlen and 0 in c.lengths_q for c in cases) >= 5  # empty sequences
    assert sum(c.heads > c.kv_heads for c in cases) >= 100  # GQA/MQA
    assert sum(c.dqk != c.dv for c in cases) >= 50
    assert {c.layout for c in cases} == {"contiguous", "transposed", "strided"}
    assert {c.alibi for c in cases} == {None, "H", "BH"}
    biases = {c.bias for c in cases} - {None}
    assert len(biases) >= 12 and any(len(b) < 4 for b in biases)
    with_bias = [c.bias_grad for c in calls if c.case.bias]
    assert any(with_bias) and not all(with_bias)  # gradients asked and not
    assert 40 <= sum(c.lse_grad for c in calls) <= 120
    frozen = {c.frozen for c in calls} - {()}
    assert len(frozen) >= 6 and ("q", "k", "v") in frozen  # the last with a bias gradient
    assert all(c.bias_grad for c in calls if c.frozen == ("q", "k", "v"))
    given = [c for c in cases if "max_seqlen_q" in c.options]
    assert sum(c.options["max_seqlen_k"] > max(c.lengths_k) for c in given) >= 5  # padded
    assert sum(c.options["max_seqlen_q"] == max(c.lengths_q) for c in given) >= 2  # exact
    assert sum(len(o) >= 3 for o in options) >= 20  # options together
    dtypes = {c.dtype for c in calls}
    assert dtypes == ({torch.bfloat16, torch.float16, torch.float32} if gpu
                      else {torch.float32, torch.float16})  # fmt: skip
    if gpu:  # few queries against long keys: the split-KV forward's calls
        assert sum(not c.varlen and c.seqlen_q <= 64 and c.seqlen_k >= 4096
                   for c in cases) >= 10  # fmt: skip


def test_check_command_refuses_a_negative_count(capsys):
    assert cli.main(["check", "--random", "-3"]) == 2
    assert "--random must be >= 0 (0: the feature grid), got -3" in capsys.readouterr().err
