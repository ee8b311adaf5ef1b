"""kernels/decode.py: the split-KV forward for few queries and long keys, against the
float64 reference (check_forward: out and lse, dropout's mask from memattn.dropout_mask).

CPU (CI): the interpreter at small sizes with MIN_KEYS lowered so that these calls take
the kernel, several splits each (16-key tiles, 4 "SMs"). GPU (`pytest -m gpu`): the
decode shapes at their real sizes, bfloat16.
"""

import dataclasses
import zlib

import pytest
import torch

from memattn import reference
from memattn.check import (
    FEATURE_CASES,
    FLOOR,
    Case,
    check_backward,
    check_forward,
    relative_error,
)
from memattn.kernels import decode

from .conftest import cpu_only
from .test_forward import assert_results


def few_queries(case: Case) -> Case:
    """A feature case with 1-5 queries a sequence (keys as they were)."""
    if case.varlen:
        lengths = tuple(min(n, 1 + i % 5) for i, n in enumerate(case.lengths_q))
        return dataclasses.replace(case, lengths_q=lengths)
    return dataclasses.replace(case, seqlen_q=3 if case.seqlen_q <= case.seqlen_k else 5,
                               seqlen_k=min(case.seqlen_k, 37) if case.seqlen_q > case.seqlen_k
                               else case.seqlen_k)  # fmt: skip


DECODE_CASES = [few_queries(c) for c in FEATURE_CASES] + [
    Case("one query, GQA 4:1", seqlen_q=1, seqlen_k=70, heads=8, kv_heads=2),
    Case("MQA group of 20 x 5 queries: several row blocks", seqlen_q=5, seqlen_k=45,
         heads=20, kv_heads=1, options=dict(causal=True, align="bottom_right")),
    Case("key padding bias B11K, causal bottom-right", seqlen_q=4, seqlen_k=61, bias="B11K",
         options=dict(causal=True, align="bottom_right")),
    Case("window inside one split", seqlen_q=2, seqlen_k=80,
         options=dict(window=(9, 0), align="bottom_right")),
    Case("varlen decode, an empty cache", lengths_q=(1, 1, 1, 1), lengths_k=(40, 0, 7, 66),
         options=dict(causal=True, align="bottom_right")),
    Case("varlen decode, one long cache beside short ones", lengths_q=(1, 2, 1, 1, 1),
         lengths_k=(3, 200, 9, 0, 17), heads=4, kv_heads=2),
]


@pytest.fixture
def decode_runs(monkeypatch):
    """Every few-query call takes the split-KV kernel here; records its launches."""
    monkeypatch.setattr(decode, "MIN_KEYS", 0)
    launched = []
    run = decode.forward
    monkeypatch.setattr(decode, "forward", lambda *a: launched.append(a[0]) or run(*a))
    return launched


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_decode_cpu(case, dtype, decode_runs):
    assert_results(check_forward(case, dtype, "cpu", seed=zlib.crc32(case.name.encode()) % 997))
    assert decode_runs, "the split-KV kernel did not run"


@cpu_only
def test_one_split_writes_out_itself(decode_runs, monkeypatch):
    """With enough programs for the GPU there is one split: no partials, no merge."""
    monkeypatch.setattr(decode, "INTERPRETER_PROGRAMS", 4)
    case = Case("one split", seqlen_q=3, seqlen_k=70, options=dict(causal=True))
    assert_results(check_forward(case, torch.float32, "cpu", seed=3))
    cfg = decode.configs(decode_runs[0], interpreting=True)[0]
    assert decode.num_splits(decode_runs[0], 4, cfg, torch.device("cpu")) == 1


@cpu_only
def test_packed_splits_follow_the_batchs_keys(decode_runs):
    """Packed sequences of different lengths: a split is the batch's keys spread over one
    wave (16 programs under the interpreter), so a 4096-key cache beside seven of 64
    keys (4544 in all, to 8192) takes 8 splits of 512, where the longest's keys over the
    splits the batch leaves room for (16 // 8 programs) gave it 2 of 2048."""
    case = Case("lengths", lengths_q=(1,) * 8, lengths_k=(4096,) + (64,) * 7, heads=4,
                kv_heads=1)
    assert_results(check_forward(case, torch.float32, "cpu", seed=5))
    spec = decode_runs[0]
    cfg = decode.configs(spec, interpreting=True)[0]
    k = torch.empty(4544, 1, spec.head_dim_qk)
    assert decode.packed_keys(spec, k) == 8192
    cpu = torch.device("cpu")
    assert decode.plan(spec, cfg, cpu, 8192) == (1, 8, 8, 512)
    assert decode.plan(spec, cfg, cpu) == (1, 8, 2, 2048)  # the dense batches' rule


@cpu_only
def test_a_groups_64_rows_try_the_wide_rows_tile_first(decode_runs):
    """64 query rows a program (B8 Sq16 H32/8, D=128, bf16) on the GPU: the split kernel
    tries WIDE_ROWS_TILE first, then smaller tiles (where a bias's do not fit), each once,
    32 keys, then SMALLEST_TILE."""
    assert_results(check_forward(DECODE_CASES[0], torch.float32, "cpu", seed=1))
    spec = dataclasses.replace(decode_runs[0], batch=8, heads=32, kv_heads=8, seqlen_q=16,
                               seqlen_k=32768, head_dim_qk=128, head_dim_v=128,
                               dtype=torch.bfloat16, has_bias=False)  # fmt: skip
    tiles = decode.configs(spec, interpreting=False)
    assert tiles[0] == decode.WIDE_ROWS_TILE and tiles[0].block_m == 64
    assert len(set(tiles)) == len(tiles) and tiles[-2].block_n == 32
    assert tiles[-1] == decode.SMALLEST_TILE


@cpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (192, 128), (256, 256), (128, 256)])
@pytest.mark.parametrize("rows", [1, 64])
def test_every_call_ends_with_the_smallest_tile(dtype, dims, rows, decode_runs):
    """Every call's tiles shrink to SMALLEST_TILE, which fits where larger ones do not
    (float32 past 128 columns at 64 rows fitted none on an H100 before), each tried once,
    largest first."""
    assert_results(check_forward(DECODE_CASES[0], torch.float32, "cpu", seed=1))
    spec = dataclasses.replace(decode_runs[0], batch=2, heads=32, kv_heads=8,
                               seqlen_q=rows // 4 or 1, seqlen_k=8192, head_dim_qk=dims[0],
                               head_dim_v=dims[1], dtype=dtype, has_bias=False)  # fmt: skip
    tiles = decode.configs(spec, interpreting=False)
    assert tiles[-1] == decode.SMALLEST_TILE and len(set(tiles)) == len(tiles)
    # shared memory, elements: Q's tile and K's and V's rings
    footprint = [t.block_m * dims[0] + t.num_stages * t.block_n * sum(dims) for t in tiles]
    assert footprint == sorted(footprint, reverse=True)


@cpu_only
@pytest.mark.parametrize("case", [DECODE_CASES[0], DECODE_CASES[-1],
                                  few_queries(FEATURE_CASES[-1])], ids=lambda c: c.name)
def test_decode_then_backward_cpu(case, decode_runs):
    """The backward takes the split-KV forward's out and lse as any forward's."""
    assert_results(check_backward(case, torch.float32, "cpu", seed=11))
    assert decode_runs


GPU_DECODE = [
    Case("B8 Sq1 Sk32768 H32/8", batch=8, seqlen_q=1, seqlen_k=32768, heads=32, kv_heads=8,
         dqk=128, dv=128),
    Case("B1 Sq1 Sk131072 H32/8", batch=1, seqlen_q=1, seqlen_k=131072, heads=32,
         kv_heads=8, dqk=128, dv=128),
    Case("B2 Sq16 Sk8192 causal, key padding bias", batch=2, seqlen_q=16, seqlen_k=8192,
         heads=32, kv_heads=8, dqk=128, dv=128, bias="B11K",
         options=dict(causal=True, align="bottom_right")),
    Case("B4 Sq5 Sk5000 dropout, ALiBi, D64", batch=4, seqlen_q=5, seqlen_k=5000, heads=16,
         kv_heads=2, dqk=64, dv=64, alibi="H", options=dict(dropout_p=0.1)),
    Case("varlen decode", lengths_q=(1, 4, 1, 64), lengths_k=(9000, 4100, 0, 20000),
         heads=32, kv_heads=8, dqk=128, dv=128, options=dict(causal=True, align="bottom_right")),
    Case("varlen decode, one long cache beside short ones", lengths_q=(1,) * 8,
         lengths_k=(65536,) + (2048,) * 6 + (0,), heads=32, kv_heads=8, dqk=128, dv=128),
    Case("D256 window", batch=2, seqlen_q=8, seqlen_k=6000, heads=8, kv_heads=8, dqk=256,
         dv=256, options=dict(window=(1024, 0), align="bottom_right")),
    # 36 rows a group at Dqk 192: in float32 no tile fitted shared memory (a random call)
    Case("Dqk192 Dv128 H8/2 Sq9", batch=1, seqlen_q=9, seqlen_k=4276, heads=8, kv_heads=2,
         dqk=192, dv=128),
    Case("D256 H8/2 Sq16", batch=1, seqlen_q=16, seqlen_k=4200, heads=8, kv_heads=2,
         dqk=256, dv=256),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_DECODE, ids=lambda c: c.name)
def test_decode_gpu(case, dtype, decode_runs):
    """float32 too: its dots are 3xTF32 (forward.dot_precision) and its tiles its own."""
    assert_results(check_forward(case, dtype, "cuda", seed=5))
    assert decode_runs


@pytest.mark.gpu
def test_repeat_decode_calls_launch_prepared_and_match_gpu(monkeypatch):
    """On CUDA both kernels launch through hopper.Launcher: the first call through
    JITFunction.run, later ones from the C launcher, and outside the suite's variant
    checks from the arguments the last call of the same tensors prepared; every result
    bit for bit the first's (split-KV adds in a fixed order)."""
    if decode.hopper is None:
        pytest.skip("a Triton without Gluon's Hopper API launches through Triton")
    import memattn
    from memattn.kernels import hopper

    from .test_hopper import _CountingJit

    launchers = [decode._launch_split_kv, decode._launch_merge]
    for launcher in launchers:
        monkeypatch.setattr(launcher, "fn", _CountingJit(launcher.fn))
        monkeypatch.setattr(launcher, "kernels", {})
        monkeypatch.setattr(launcher, "prepared", {})
    q = torch.randn(2, 3, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 20000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def call():
        return memattn.attention(q, k, v, causal=True, align="bottom_right", return_lse=True)

    first = call()
    assert all(launcher.fn.runs == 1 for launcher in launchers)  # split, then merge
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    hits = []
    for launcher in launchers:
        monkeypatch.setattr(launcher, "launch_prepared",
                            lambda *a, f=launcher.launch_prepared: hits.append(f(*a)) or hits[-1])
    result = None
    for _ in range(4):
        hits.clear()
        result = None  # frees the last try's outputs for the next call to reuse
        result = call()
        if hits == [True, True]:
            break
    assert hits == [True, True], hits
    assert all(launcher.fn.runs == 1 for launcher in launchers)
    for a, b in zip(first, result, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "cuda_graph"])
def test_decode_steps_see_the_kernels_before_them_gpu(graphed):
    """On sm_90 both kernels launch as programmatic dependents (decode.PDL): each may
    start while the kernel before it in the stream ends, and must wait for that
    kernel's writes before it reads. Decode steps that each copy their query into place
    and write a key into the cache just before the call, a key that takes most of the
    step's attention, eager and replayed from a CUDA graph, against each step in
    float64 on the inputs it should have seen."""
    import memattn

    torch.manual_seed(0)
    steps, batch, heads, kv_heads, keys = 4, 2, 16, 4, 12288
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    k0, v = new(batch, keys, kv_heads, 128), new(batch, keys, kv_heads, 128)
    queries = new(steps, batch, 1, heads, 128)
    # each step's key: its group's mean query, scaled (scores ~17 against the others'
    # ~1: e^17 outweighs 12288 keys' e^0.5 a hundredfold)
    fresh = queries[:, :, 0].unflatten(2, (kv_heads, heads // kv_heads)).mean(3) * 6
    q, k = torch.empty_like(queries[0]), k0.clone()
    outs = torch.empty_like(queries)

    def run():
        for s in range(steps):
            q.copy_(queries[s])
            k[:, keys - steps + s] = fresh[s]
            outs[s] = memattn.attention(q, k, v)

    run()  # compiles, outside any capture
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        k.copy_(k0)
        outs.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    seen = k0.clone()
    for s in range(steps):
        seen[:, keys - steps + s] = fresh[s]
        ref = reference.attention(queries[s].double(), seen.double(), v.double())
        low = reference.attention(queries[s], seen, v)
        err = relative_error(outs[s], ref)
        allowed = 2 * relative_error(low, ref) + FLOOR[torch.bfloat16]
        assert err <= allowed, f"step {s}: error {err:.3g} > allowed {allowed:.3g}"
