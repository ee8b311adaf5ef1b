"""``memattn bench`` without a GPU: the rows, the flop count, what each implementation
computes (on tiny CPU inputs, against memattn.reference), the timing function's error
handling, and the report (ratios, JSON, table, plot) built from fake timings."""

import argparse
import io
import json
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest
import torch
from rich.console import Console

from memattn import bench, cli, reference
from memattn.spec import REFERENCE_DTYPES, check_call


@pytest.fixture(scope="module", autouse=True)
def fresh_import():
    """``import memattn.bench`` in a new interpreter, started before this module's first
    test so that its torch import (seconds) overlaps them; the last test reads it."""
    code = (
        "import sys, memattn.bench; "
        "print([m for m in ('triton', 'matplotlib') if m in sys.modules])"
    )
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:  # fmt: skip
        yield proc


FEATURES = {"bias_grad", "bias_1HQK", "bias_1HQK_causal", "bias_B1QK", "bias_11QK",
            "bias_B11K", "bias_1H1K", "dropout0.1", "window1024_causal", "alibi", "softcap30",
            "gqa8", "varlen_docs", "varlen_causal_docs", "varlen_docs_bias",
            "varlen_causal_docs_bias", "varlen_causal_docs_dropout0.1",
            "dqk192_dv128_causal", "dqk128_dv64_causal", "deterministic",
            "bias_grad_deterministic", "bias_1HQK_causal_deterministic",
            "bias_B1QK_deterministic", "bias_11QK_deterministic",
            "varlen_causal_docs_deterministic"}  # fmt: skip
QUICK = {"D128_S1024", "D128_S1024_causal", "D128_S4096", "D128_S4096_causal", "bias_grad",
         "gqa8", "decode_B8_Sq1_Sk32768"}  # fmt: skip


# ------------------------------------------------------------------ rows


def test_grid_rows_are_16k_tokens_with_the_peers_heads():
    grid = bench.grid_rows()
    assert len(grid) == 3 * 6 * 2
    assert {(r.dqk, r.seqlen, r.causal) for r in grid} == {
        (d, s, c) for d in (64, 128, 256) for s in (512, 1024, 2048, 4096, 8192, 16384)
        for c in (False, True)
    }  # fmt: skip
    for r in grid:
        assert r.batch * r.seqlen == 16384
        assert r.heads == r.kv_heads == {64: 32, 128: 16, 256: 8}[r.dqk]
        assert r.dv == r.dqk and not r.feature


def test_feature_rows_match_the_peers_features():
    rows = {r.name: r for r in bench.FEATURE_ROWS}
    assert set(rows) == FEATURES
    for name, r in rows.items():
        assert r.heads == 16 and r.dv == (64 if name == "dqk128_dv64_causal" else 128)
        if not name.startswith("varlen"):
            assert (r.batch, r.seqlen) == (4, 4096)
        else:
            assert r.docs == rows["varlen_causal_docs"].docs
    assert rows["gqa8"].kv_heads == 2
    assert rows["dqk192_dv128_causal"].dqk == 192 and rows["dqk192_dv128_causal"].causal
    assert rows["window1024_causal"].window == (1023, 0) and rows["window1024_causal"].causal
    docs = rows["varlen_causal_docs"]
    assert docs.batch == 1 and docs.seqlen == sum(docs.docs) == 16384 and len(docs.docs) == 13
    assert len(set(docs.docs)) > 5  # mixed lengths
    assert rows["bias_grad"].bias == "BHQK" and rows["dropout0.1"].dropout == 0.1
    assert rows["varlen_causal_docs_bias"].bias == rows["varlen_docs_bias"].bias == "1HQK"
    assert not rows["varlen_docs_bias"].causal and rows["bias_B11K"].bias == "B11K"
    assert rows["bias_1HQK_causal"].causal and rows["bias_1HQK_causal"].bias == "1HQK"
    assert rows["softcap30"].softcap == 30.0 and rows["alibi"].alibi
    names = [r.name for r in bench.all_rows()]
    assert len(names) == len(set(names)) == 36 + 25 + 4
    det = rows["deterministic"]
    assert det.deterministic and (det.batch, det.seqlen, det.dqk) == (4, 4096, 128)
    assert bench.memattn_kwargs(det, bench.make_inputs(det, "meta"))["deterministic"]
    assert bench.unsupported("flex", det) and bench.unsupported("sdpa_cudnn", det)
    det_bias = rows["bias_grad_deterministic"]
    assert det_bias.deterministic and det_bias.bias == rows["bias_grad"].bias
    det_broadcast = rows["bias_1HQK_causal_deterministic"]
    assert det_broadcast == replace(rows["bias_1HQK_causal"], deterministic=True,
                                    feature="bias_1HQK_causal_deterministic")
    for shape in ("B1QK", "11QK"):  # summed over the heads, over both
        name = f"bias_{shape}_deterministic"
        assert rows[name] == replace(rows[f"bias_{shape}"], deterministic=True, feature=name)
    det_docs = rows["varlen_causal_docs_deterministic"]
    assert det_docs == replace(rows["varlen_causal_docs"], deterministic=True,
                               feature="varlen_causal_docs_deterministic")


def test_decode_rows_are_the_issues_shapes_rated_in_gbps():
    """Four decode shapes (H32/8, D128), forward only, GB/s of K and V read once."""
    rows = {r.name: r for r in bench.DECODE_ROWS}
    assert {(r.batch, r.sq, r.seqlen) for r in rows.values()} == {
        (1, 1, 131072), (8, 1, 32768), (64, 1, 4096), (8, 16, 32768)}
    for r in rows.values():
        assert r.decode and (r.heads, r.kv_heads, r.dqk, r.dv) == (32, 8, 128, 128)
        assert r.bytes_kv() == 2 * r.batch * r.seqlen * 8 * 256
        assert r.flops_fwd() == 4 * r.batch * 32 * r.sq * r.seqlen * 128
        assert bench.gbps(r, 2.0) == r.bytes_kv() / 2e6
    r = rows["decode_B8_Sq16_Sk32768"]
    assert r.describe() == "B8 Sq16 Sk32768 H32/8 D128"
    t = bench.make_inputs(r, "meta")
    assert t.q.shape == (8, 16, 32, 128) and t.k.shape == (8, 32768, 8, 128)
    assert not any(x.requires_grad for x in t.leaves)


def test_quick_is_a_subset_and_keeps_flex_where_cheap():
    quick = bench.select_rows(quick=True)
    assert {r.name for r in quick} == QUICK
    assert set(quick) <= set(bench.select_rows(quick=False))
    assert set(bench.QUICK_FLEX_ROWS) <= QUICK
    row = next(r for r in quick if r.name == "gqa8")
    assert bench.skipped("flex", row, quick=True) and not bench.skipped("flex", row, quick=False)
    assert not bench.skipped("memattn", row, quick=True)


def test_row_and_impl_selection():
    assert [r.name for r in bench.select_rows(False, "gqa8, D64_S512*")] == [
        "D64_S512", "D64_S512_causal", "gqa8"]  # fmt: skip
    assert [r.name for r in bench.select_rows(True, "*causal")] == [
        "D128_S1024_causal", "D128_S4096_causal"]  # fmt: skip
    with pytest.raises(ValueError, match="matches no row"):
        bench.select_rows(False, "nothing*")
    assert bench.select_impls(None) == [n for n in bench.IMPLS
                                        if n != "fa4" or bench.fa4_installed()]  # fmt: skip
    assert bench.select_impls("flex,memattn") == ["memattn", "flex"]  # registry order
    with pytest.raises(ValueError, match="unknown"):
        bench.select_impls("memattn,fa3")


# ------------------------------------------------------------------ flops


def test_flops_of_the_grid_and_causal_halves():
    for r in bench.grid_rows():
        full = 4 * r.batch * r.heads * r.seqlen**2 * r.dqk
        assert r.flops_fwd() == (full / 2 if r.causal else full)
    r = next(r for r in bench.FEATURE_ROWS if r.name == "dqk192_dv128_causal")
    assert r.flops_fwd() == 2 * 4 * 16 * 4096**2 * (192 + 128) / 2
    assert bench.tflops(r, 2.0, backward=True) == 2.5 * r.flops_fwd() / 2.0 / 1e9
    assert bench.tflops(r, None, backward=False) is None


def _brute_force(n: int, causal: bool, window) -> int:
    """Visible pairs by memattn's own definition (reference.visible_mask)."""
    x = torch.zeros(1, n, 1, 1, dtype=torch.float64)
    spec = check_call(x, x, x, causal=causal, window=window, dtypes=REFERENCE_DTYPES)
    return int(reference.visible_mask(spec, n, n, "cpu").sum())


@pytest.mark.parametrize("n", [1, 7, 64, 100])
@pytest.mark.parametrize(
    "causal, window",
    [(False, None), (True, None), (True, (15, 0)), (True, (0, 0)), (False, (3, 5)),
     (False, (-1, 2)), (False, (9, -1)), (True, (200, -1)), (True, (4, 3))],
)  # fmt: skip
def test_visible_pairs_is_exact(n, causal, window):
    assert bench.visible_pairs(n, causal, window) == _brute_force(n, causal, window)


def test_window_and_varlen_rows_count_exactly():
    row = next(r for r in bench.FEATURE_ROWS if r.name == "window1024_causal")
    per_seq = 1024 * 1025 // 2 + (4096 - 1024) * 1024
    assert bench.pairs(row) == row.batch * per_seq
    small = replace(row, batch=3, seqlen=100, window=(9, 0))
    assert bench.pairs(small) == 3 * _brute_force(100, True, (9, 0))

    docs = next(r for r in bench.FEATURE_ROWS if r.name == "varlen_causal_docs")
    assert bench.pairs(docs) == sum(n * (n + 1) // 2 for n in docs.docs)
    lengths = (5, 0, 17, 1, 9)
    small = replace(docs, seqlen=sum(lengths), docs=lengths)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(sum(lengths))[:, None], torch.arange(sum(lengths))[None, :]
    assert bench.pairs(small) == int(((ids[:, None] == ids[None, :]) & (j <= i)).sum())
    assert small.flops_fwd() == 2 * small.heads * bench.pairs(small) * (128 + 128)


# ------------------------------------------------------------------ what each impl computes


def _tiny(row):
    """A small version of a row that keeps its features (GQA, Dqk != Dv, docs, window)."""
    r = replace(row, batch=min(row.batch, 2), heads=4, seqlen=40, dqk=16, dv=16,
                kv_heads=4 if row.kv_heads == row.heads else 1)  # fmt: skip
    if row.dqk != row.dv:
        r = replace(r, dqk=24)
    if row.window:
        r = replace(r, window=(7, 0))
    if row.docs:
        r = replace(r, seqlen=64, docs=(10, 0, 23, 31))
    return r


def _tiny_cases():
    """Every feature row but dropout, small; the window, ALiBi, softcap, GQA and Dqk != Dv
    rows in one (each flex call on the CPU traces its mods: ~0.5 s)."""
    rows = {r.name: _tiny(r) for r in bench.FEATURE_ROWS}
    combined = replace(rows["window1024_causal"], feature="combined", alibi=True,
                       softcap=rows["softcap30"].softcap, kv_heads=rows["gqa8"].kv_heads,
                       dqk=rows["dqk192_dv128_causal"].dqk)  # fmt: skip
    return [rows["bias_grad"], rows["bias_B11K"], rows["bias_1H1K"], rows["gqa8"],
            rows["varlen_causal_docs"], rows["varlen_causal_docs_bias"], combined]


@pytest.mark.parametrize("row", _tiny_cases(), ids=lambda r: r.name)
def test_implementations_compute_memattns_definition(row):
    """flex (eager on the CPU) and SDPA's flash backend (where the CPU has it) on tiny
    inputs agree with memattn.reference given memattn's options for the row."""
    torch.manual_seed(0)
    t = bench.make_inputs(row, "cpu", torch.float32)
    # flex has no backward on the CPU: detached inputs.
    t = replace(t, **{n: getattr(t, n).detach() for n in ("q", "k", "v", "bias")
                      if getattr(t, n) is not None})  # fmt: skip
    want = reference.attention(t.q, t.k, t.v, **bench.memattn_kwargs(row, t))
    ran = []
    for impl in ("flex", "sdpa_flash"):
        if bench.unsupported(impl, row):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = bench.IMPLS[impl](row, t)
        assert out.shape == want.shape, impl
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5, msg=impl)
        ran.append(impl)
    assert ran == (["flex"] if row.name == "combined" or row.docs else
                   ["flex", "sdpa_flash"])  # fmt: skip


def test_unsupported_features_are_declared():
    rows = {r.name: r for r in bench.FEATURE_ROWS}
    for f in ("window1024_causal", "alibi", "softcap30", "varlen_causal_docs"):
        for impl in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn"):
            assert bench.unsupported(impl, rows[f]).startswith("unsupported: SDPA")
        assert bench.unsupported("flex", rows[f]) is None
    assert "dropout" in bench.unsupported("flex", rows["dropout0.1"])
    for f in ("bias_grad", "dropout0.1", "gqa8", "dqk192_dv128_causal"):
        assert bench.unsupported("sdpa_efficient", rows[f]) is None  # tried, may refuse
    for row in bench.all_rows():
        assert bench.unsupported("memattn", row) is None


def test_fa4_is_a_peer_where_it_imports(monkeypatch):
    """FA4 runs every row but those with a bias, dropout or ALiBi; where it does not
    import, no run lists it by default, a row says why, and naming it is an error."""
    rows = {r.name: r for r in bench.all_rows()}
    monkeypatch.setattr(bench, "fa4_installed", lambda: True)
    assert "fa4" in bench.select_impls(None)
    for name, row in rows.items():
        reason = bench.unsupported("fa4", row)
        if row.bias or row.dropout or row.alibi:
            assert reason.startswith("unsupported: FlashAttention-4 has no"), name
        else:
            assert reason is None, name
    assert bench.select_impls("fa4,memattn") == ["memattn", "fa4"]
    monkeypatch.setattr(bench, "fa4_installed", lambda: False)
    assert "fa4" not in bench.select_impls(None)
    assert "does not import" in bench.unsupported("fa4", rows["D128_S4096"])
    with pytest.raises(ValueError, match="fa4 asked for, but flash_attn.cute does not import"):
        bench.select_impls("memattn,fa4")  # a run of empty columns otherwise


def test_bench_refuses_fa4_where_it_does_not_import(monkeypatch, capsys):
    monkeypatch.setattr(bench, "fa4_installed", lambda: False)
    assert cli.main(["bench", "--impls", "memattn,fa4", "--rows", "D128_S4096"]) == 2
    assert "fa4 asked for" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("features", ["plain", "masks_and_mods"])
def test_on_the_gpu_each_impl_agrees_and_times(features):
    """The GPU path end to end on a small row: compiled flex, SDPA's backends, memattn;
    each output against the reference, then the timing function on it."""
    row = replace(bench._BASE, feature="tiny", batch=2, heads=4, kv_heads=4, seqlen=384,
                  dqk=64, dv=64, causal=True)  # fmt: skip
    if features == "masks_and_mods":
        row = replace(row, kv_heads=2, window=(100, 0), alibi=True, softcap=30.0)
    torch.manual_seed(0)
    t = bench.make_inputs(row, "cuda")
    with torch.no_grad():
        q, k, v = (x.float() for x in (t.q, t.k, t.v))
        want = reference.attention(q, k, v, **bench.memattn_kwargs(row, t))
    for impl in bench.IMPLS:
        if bench.unsupported(impl, row):
            continue
        try:
            out = bench.IMPLS[impl](row, t).float()
        except RuntimeError as e:  # an SDPA backend may have no kernel for this GPU
            assert impl.startswith("sdpa_") and "No available kernel" in str(e), (impl, e)
            continue
        err = ((out - want).norm() / want.norm()).item()
        assert err < 2e-2, (impl, err)
        timing = bench.measure(lambda impl=impl: bench.IMPLS[impl](row, t), t.leaves)
        assert timing.fwd_error is None and timing.bwd_error is None, (impl, timing)
        assert timing.fwd_ms > 0 and timing.bwd_ms > 0


# ------------------------------------------------------------------ the timing function


@pytest.fixture
def fake_do_bench(monkeypatch):
    """do_bench without a GPU: one call, 2 ms."""
    import triton.testing

    def do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None,
                 return_mode="mean"):  # fmt: skip
        assert return_mode == "median" and rep == bench.TIMING_REP_MS
        for x in grad_to_none or []:
            x.grad = None
        fn()
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)


def test_measure_times_forward_and_backward(fake_do_bench):
    x = torch.randn(4, 4, requires_grad=True)
    t = bench.measure(lambda: (x * 2).sum(-1), [x])
    assert (t.fwd_ms, t.bwd_ms, t.fwd_error, t.bwd_error) == (2.0, 2.0, None, None)
    assert t.first_call_s is None and x.grad is None  # settle times the first call


def test_first_call_times_a_forward_and_backward_and_keep_busy_repeats_them():
    x = torch.randn(4, 4, requires_grad=True)
    calls = []

    def run():
        calls.append(1)
        return (x * 2).sum(-1)

    seconds = bench.first_call(run, [x])
    assert seconds is not None and seconds >= 0 and x.grad is None and len(calls) == 1
    assert bench.first_call(run, [x], backward=False) >= 0 and len(calls) == 2
    start = time.perf_counter()
    bench.keep_busy(run, [x], 0.05)
    assert time.perf_counter() - start >= 0.05 and len(calls) > 3 and x.grad is None

    def fails():
        raise RuntimeError("No available kernel. Aborting execution.")

    assert bench.first_call(fails, [x]) is None


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_round_order_gives_everyone_the_same_mean_position_over_each_pair(n):
    impls = [f"impl{i}" for i in range(n)]
    for pair in range(2 * n):
        orders = [bench.round_order(impls, 2 * pair + k) for k in (0, 1)]
        assert all(sorted(o) == impls for o in orders)
        assert {o[0] for o in orders} <= set(impls)
        sums = {i: sum(o.index(i) for o in orders) for i in impls}
        assert set(sums.values()) == {n - 1}, sums
    firsts = {bench.round_order(impls, 2 * pair)[0] for pair in range(n)}
    assert firsts == set(impls)  # turned: each one leads a pair in turn


def test_measure_records_failures_per_pass(fake_do_bench):
    def no_kernel():
        warnings.warn("Flash attention does not support non-null attn_mask.", stacklevel=1)
        raise RuntimeError("No available kernel. Aborting execution.")

    t = bench.measure(no_kernel, [])
    assert t.fwd_ms is None and t.bwd_ms is None and t.bwd_error == t.fwd_error
    assert t.fwd_error.startswith("RuntimeError: No available kernel")
    assert "does not support non-null attn_mask" in t.fwd_error
    assert bench.status(t.fwd_error) == "unavailable"

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    x = torch.randn(3, requires_grad=True)
    t = bench.measure(lambda: NoBackward.apply(x), [x])
    assert t.fwd_ms == 2.0 and t.bwd_ms is None
    assert bench.status(t.bwd_error) == "oom" and bench.status(t.fwd_error) == "ok"

    t = bench.measure(lambda: NoBackward.apply(x), [x], backward=False)  # decode rows
    assert t.fwd_ms == 2.0 and t.bwd_ms is None and bench.status(t.bwd_error) == "skipped"


# ------------------------------------------------------------------ the report


FAKE_MS = {"memattn": (1.0, 4.0), "sdpa_flash": (2.0, 2.0), "sdpa_efficient": (4.0, 8.0),
           "sdpa_cudnn": (0.5, 5.0), "flex": (1.25, 3.0)}  # fmt: skip


def _fake_measure(run, leaves, backward=True):
    impl, row = run()  # the fake implementations return who they are
    if not backward:
        return bench.Timing(fwd_ms=FAKE_MS[impl][0], bwd_error=bench.FORWARD_ONLY)
    if impl == "sdpa_flash" and row.bias:
        e = "RuntimeError: No available kernel. Aborting execution."
        return bench.Timing(fwd_error=e, bwd_error=e)
    fwd, bwd = FAKE_MS[impl]
    if impl == "sdpa_cudnn" and row.bias:
        return bench.Timing(fwd_ms=fwd, bwd_error="OutOfMemoryError: CUDA out of memory")
    if impl == "memattn" and row.name == "gqa8":
        return bench.Timing(fwd_error="ValueError: boom", bwd_error="ValueError: boom")
    return bench.Timing(fwd_ms=fwd, bwd_ms=bwd)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """``memattn bench --quick`` with fake implementations and timings, on "meta" tensors
    (the real inputs' shapes, a 2 GiB bias included, and no memory)."""
    tmp = tmp_path_factory.mktemp("bench")
    args = argparse.Namespace(quick=True, json=str(tmp / "b.json"), plot=str(tmp / "b.png"),
                              rows=None, impls=None, compile_workers=0,
                              resume=False)  # fmt: skip
    console = Console(file=io.StringIO(), width=250, record=True)
    results = _run_faked(args, bench.select_rows(True), list(bench.IMPLS), console)
    return results, json.loads((tmp / "b.json").read_text()), console.export_text(), tmp


def _run_faked(args, rows, impls, console, measure=_fake_measure, settled=None):
    """bench.run on "meta" tensors (the real inputs' shapes, no memory) with fake
    implementations that return who they are, timed by ``measure``; their first calls
    take 0.5 s each, and ``settled`` collects (row, impl, what) as settle runs them
    ("first" calls, then "busy" for the seconds asked)."""
    settled = [] if settled is None else settled

    def first_call(run, leaves, backward=True):
        impl, row = run()
        settled.append((row.name, impl, "first"))
        return 0.5

    def keep_busy(run, leaves, seconds, backward=True):
        impl, row = run()
        settled.append((row.name, impl, "busy", seconds))

    with pytest.MonkeyPatch.context() as mp:
        for name in bench.IMPLS:
            mp.setitem(bench.IMPLS, name, lambda row, t, name=name: (name, row))
        mp.setattr(bench, "measure", measure)
        mp.setattr(bench, "first_call", first_call)
        mp.setattr(bench, "keep_busy", keep_busy)
        mp.setattr(bench, "_free", lambda collect=True: None)  # gc.collect: slow, and moot
        return bench.run(args, rows, impls, "meta", console)


def test_json_has_every_row_with_times_and_errors(fake_run):
    results, doc, _, _ = fake_run
    assert {"device", "torch", "triton", "rows", "ratios"} <= set(doc)
    assert doc["device"] == "meta" and doc["torch"] == torch.__version__ and doc["quick"]
    assert len(doc["rows"]) == len(QUICK) * len(bench.IMPLS)
    rows = {(r["row"], r["impl"]): r for r in doc["rows"]}
    r = rows["D128_S4096_causal", "sdpa_cudnn"]
    assert (r["B"], r["H"], r["N"], r["D"], r["causal"], r["status"]) == (
        4,
        16,
        4096,
        128,
        True,
        "ok",
    )
    assert r["flops_fwd"] == 4 * 4 * 16 * 4096**2 * 128 / 2
    assert r["fwd_ms"] == 0.5 and r["fwd_tflops"] == pytest.approx(r["flops_fwd"] / 0.5 / 1e9)
    assert r["bwd_tflops"] == pytest.approx(2.5 * r["flops_fwd"] / 5.0 / 1e9)
    assert rows["bias_grad", "sdpa_flash"]["status"] == "unavailable"
    assert "No available kernel" in rows["bias_grad", "sdpa_flash"]["fwd_error"]
    cudnn = rows["bias_grad", "sdpa_cudnn"]
    assert cudnn["status"] == "oom" and cudnn["fwd_tflops"] and cudnn["bwd_tflops"] is None
    assert rows["gqa8", "memattn"]["status"] == "error"
    assert rows["gqa8", "flex"]["status"] == "skipped"  # --quick: flex on two rows only
    assert rows["D128_S4096", "flex"]["status"] == "ok"
    assert rows["gqa8", "sdpa_flash"]["Hkv"] == 2
    dec = rows["decode_B8_Sq1_Sk32768", "memattn"]  # forward only, GB/s
    assert (dec["Sq"], dec["Sk"], dec["bwd_ms"]) == (1, 32768, None)
    assert dec["fwd_gbps"] == pytest.approx(dec["bytes_kv"] / dec["fwd_ms"] / 1e6)
    assert dec["bwd_error"] == bench.FORWARD_ONLY


def _fake_bench(tmp_path, rows, impls, resume, measured, env=None, rounds=1,
                timings=_fake_measure, settled=None):  # fmt: skip
    """_run_faked without a plot; ``measured`` collects the (row, impl) pairs it times,
    ``env`` stands for the device's environment, ``timings`` for each call's Timing,
    ``settled`` as _run_faked's."""
    args = argparse.Namespace(quick=False, json=str(tmp_path / "r.json"), plot=None, rows=None,
                              impls=None, compile_workers=0, resume=resume,
                              rounds=rounds)  # fmt: skip

    def measure(run, leaves, backward=True):
        impl, row = run()
        measured.append((row.name, impl))
        return timings(run, leaves, backward)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "plot", lambda *a: None)
        if env is not None:
            mp.setattr(bench, "environment", lambda device: env)
        return _run_faked(args, rows, impls, Console(file=io.StringIO(), width=250), measure,
                          settled)


def test_resume_keeps_the_rows_the_json_has_and_runs_the_rest(tmp_path):
    """A run cut short, then --resume: rows already there for every implementation
    asked are kept as they were, the others run; the JSON then has them all in the rows'
    order, with the first part's start; a file from another device is refused."""
    rows = [r for r in bench.select_rows(True) if r.name in ("D128_S1024", "D128_S4096",
                                                               "bias_grad", "gqa8")]
    impls = ["memattn", "flex"]
    first = []
    _fake_bench(tmp_path, rows[:2], impls, False, first)
    doc = json.loads((tmp_path / "r.json").read_text())
    second = []
    results = _fake_bench(tmp_path, rows, impls, True, second)
    assert sorted(first) == sorted((r.name, i) for r in rows[:2] for i in impls)
    assert sorted(second) == sorted((r.name, i) for r in rows[2:] for i in impls)
    assert [(r.row.name, r.impl) for r in results] == [(r.name, i) for r in rows for i in impls]
    resumed = json.loads((tmp_path / "r.json").read_text())
    assert resumed["started"] == doc["started"]
    assert [(e["row"], e["impl"]) for e in resumed["rows"]] == [
        (r.name, i) for r in rows for i in impls]  # fmt: skip
    assert resumed["rows"][:4] == doc["rows"]  # kept as measured, errors and all
    # a third implementation: no row has it, so every row runs again
    third = []
    _fake_bench(tmp_path, rows[:1], [*impls, "sdpa_cudnn"], True, third)
    assert len(third) == 3
    with pytest.raises(bench.ResumeError, match="device"):
        _fake_bench(tmp_path, rows, impls, True, [], env=dict(bench.environment("meta"),
                                                             device="another"))  # fmt: skip


def test_resume_with_rows_keeps_the_other_rows_in_the_file(tmp_path):
    """--resume with --rows (a run handed a subset of rows): the file's entries of the
    rows it was not asked for stay as they were, rows and ratios, in the rows' order;
    the asked rows run again where the file lacks them."""
    rows = [r for r in bench.select_rows(True) if r.name in ("D128_S1024", "D128_S4096",
                                                               "bias_grad", "gqa8")]
    impls = ["memattn", "flex"]
    _fake_bench(tmp_path, [rows[0], rows[2], rows[3]], impls, False, [])
    doc = json.loads((tmp_path / "r.json").read_text())
    measured = []
    _fake_bench(tmp_path, [rows[1], rows[2]], impls, True, measured)  # D128_S4096 is new
    assert sorted(measured) == [("D128_S4096", i) for i in sorted(impls)]
    resumed = json.loads((tmp_path / "r.json").read_text())
    assert [(e["row"], e["impl"]) for e in resumed["rows"]] == [
        (r.name, i) for r in rows for i in impls]  # fmt: skip
    before = {(e["row"], e["impl"]): e for e in doc["rows"]}
    for e in resumed["rows"]:
        if e["row"] != "D128_S4096":
            assert e == before[(e["row"], e["impl"])]
    assert [e["row"] for e in resumed["ratios"]] == [r.name for r in rows]
    assert [e for e in resumed["ratios"] if e["row"] != "D128_S4096"] == doc["ratios"]


def test_resume_with_fewer_impls_keeps_their_untimed_entries_only(tmp_path):
    """Rows run again with fewer implementations (--resume, the memattn entries taken
    out of the file as one re-measures rows): another implementation's entry that holds
    no time (SDPA's flash cannot take a bias) stays beside the new figures; one that
    holds times from the earlier process goes, and the ratios come from this run."""
    rows = [r for r in bench.select_rows(True) if r.name in ("D128_S4096", "bias_grad")]
    _fake_bench(tmp_path, rows, ["memattn", "sdpa_flash", "flex"], False, [])
    path = tmp_path / "r.json"
    doc = json.loads(path.read_text())
    before = {(e["row"], e["impl"]): e for e in doc["rows"]}
    assert before["bias_grad", "sdpa_flash"]["fwd_ms"] is None
    assert before["D128_S4096", "sdpa_flash"]["fwd_ms"] is not None
    doc["rows"] = [e for e in doc["rows"] if e["impl"] != "memattn"]
    path.write_text(json.dumps(doc))
    measured = []
    slow = {**FAKE_MS, "memattn": tuple(2 * t for t in FAKE_MS["memattn"])}

    def timings(run, leaves, backward=True):
        impl, _ = run()
        return bench.Timing(fwd_ms=slow[impl][0], bwd_ms=slow[impl][1])

    _fake_bench(tmp_path, rows, ["memattn", "sdpa_cudnn"], True, measured, timings=timings)
    assert sorted(measured) == sorted((r.name, i) for r in rows for i in ("memattn",
                                                                          "sdpa_cudnn"))
    resumed = json.loads(path.read_text())
    pairs = [(e["row"], e["impl"]) for e in resumed["rows"]]
    assert pairs == [("D128_S4096", "memattn"), ("D128_S4096", "sdpa_cudnn"),
                     ("bias_grad", "memattn"), ("bias_grad", "sdpa_cudnn"),
                     ("bias_grad", "sdpa_flash")]  # fmt: skip
    assert resumed["rows"][-1] == before["bias_grad", "sdpa_flash"]
    for ratio in resumed["ratios"]:  # memattn against this run's cuDNN only
        assert ratio["fwd_best_peer"] == "sdpa_cudnn"
        assert ratio["fwd_ratio"] == pytest.approx(FAKE_MS["sdpa_cudnn"][0] / slow["memattn"][0])


def test_rounds_balance_the_order_and_keep_each_ones_median(tmp_path, monkeypatch):
    """--rounds 3: each row's implementations timed three times in turn (round_order:
    reversed every second round, turned every two), after every implementation's first
    call and SETTLE_S of the first one's work; each kept as the median of its rounds
    (every round's time in the JSON beside it), with its first call's time; a pass no
    round ran keeps the first round's error; --resume refuses a file of another
    --rounds. (Rounds this far apart would get more: EXTRA_ROUNDS, its own test.)"""
    monkeypatch.setattr(bench, "EXTRA_ROUNDS", 0)
    rows = [r for r in bench.select_rows(True) if r.name in ("D128_S4096", "bias_grad")]
    impls = ["memattn", "flex", "sdpa_cudnn"]
    calls: dict[str, int] = {}
    times = {"memattn": [3.0, 1.0, 2.0], "flex": [5.0, 4.0, 9.0], "sdpa_cudnn": [1.0, 1.5, 1.2]}

    def timings(run, leaves, backward=True):  # a time per call, and cuDNN's backward
        impl, row = run()  # failing on the bias row as _fake_measure's does
        k = calls[impl, row.name] = calls.get((impl, row.name), -1) + 1
        fwd = times[impl][k]
        if impl == "sdpa_cudnn" and row.bias:
            return bench.Timing(fwd_ms=fwd, bwd_error="OutOfMemoryError: CUDA out of memory")
        return bench.Timing(fwd_ms=fwd, bwd_ms=2 * fwd)

    measured, settled = [], []
    results = _fake_bench(tmp_path, rows, impls, False, measured, rounds=3, timings=timings,
                          settled=settled)  # fmt: skip
    first_row = [impl for name, impl in measured if name == rows[0].name]
    assert first_row == ["memattn", "flex", "sdpa_cudnn", "sdpa_cudnn", "flex", "memattn",
                         "flex", "sdpa_cudnn", "memattn"]  # fmt: skip
    assert settled[:4] == [("D128_S4096", "memattn", "first"), ("D128_S4096", "flex", "first"),
                           ("D128_S4096", "sdpa_cudnn", "first"),
                           ("D128_S4096", "memattn", "busy", bench.SETTLE_S)]  # fmt: skip
    got = {(r.row.name, r.impl): r.timing for r in results}
    assert len(results) == len(rows) * len(impls)
    mine = got["D128_S4096", "memattn"]
    assert (mine.fwd_ms, mine.bwd_ms, mine.first_call_s) == (2.0, 4.0, 0.5)
    assert mine.fwd_rounds_ms == [3.0, 1.0, 2.0] and mine.bwd_rounds_ms == [6.0, 2.0, 4.0]
    cudnn = got["bias_grad", "sdpa_cudnn"]
    assert cudnn.fwd_ms == 1.2 and cudnn.bwd_ms is None and cudnn.bwd_rounds_ms is None
    assert bench.status(cudnn.bwd_error) == "oom"
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rounds"] == 3
    entry = next(e for e in doc["rows"] if (e["row"], e["impl"]) == ("D128_S4096", "flex"))
    assert (entry["fwd_ms"], entry["fwd_rounds_ms"]) == (5.0, [5.0, 4.0, 9.0])
    with pytest.raises(bench.ResumeError, match="rounds"):
        _fake_bench(tmp_path, rows, impls, True, [], rounds=1)
    assert cli.main(["bench", "--rounds", "0", "--rows", "D128_S4096"]) == 2


def test_rows_whose_rounds_disagree_get_more_rounds(tmp_path):
    """--rounds 2: where an implementation's two rounds disagree (rounds_agree: no
    majority within AGREE of one another), the row's implementations are all timed
    again, a round at a time, until they agree or EXTRA_ROUNDS more have run; a row
    whose rounds agree gets none. The median then rests on the rounds that agree."""
    rows = [r for r in bench.select_rows(True) if r.name in ("D128_S4096", "D128_S1024")]
    impls = ["memattn", "flex"]
    times = {  # a call's forward time, by row and implementation, in the order timed
        ("D128_S1024", "memattn"): [1.0, 1.5, 1.02],  # one stray round, then agreement
        ("D128_S1024", "flex"): [2.0, 2.0, 2.0],
        ("D128_S4096", "memattn"): [1.0, 1.01],  # agree: no third round
        ("D128_S4096", "flex"): [3.0, 3.03],
    }
    calls: dict[tuple[str, str], int] = {}

    def timings(run, leaves, backward=True):
        impl, row = run()
        k = calls[row.name, impl] = calls.get((row.name, impl), -1) + 1
        fwd = times[row.name, impl][k]
        return bench.Timing(fwd_ms=fwd, bwd_ms=2.0)  # the backward always agrees

    measured = []
    results = _fake_bench(tmp_path, rows, impls, False, measured, rounds=2, timings=timings)
    got = {(r.row.name, r.impl): r.timing for r in results}
    assert calls == {("D128_S1024", "memattn"): 2, ("D128_S1024", "flex"): 2,
                     ("D128_S4096", "memattn"): 1, ("D128_S4096", "flex"): 1}  # fmt: skip
    assert [impl for name, impl in measured if name == "D128_S1024"] == [
        "memattn", "flex", "flex", "memattn", "flex", "memattn"]  # round_order's third
    assert got["D128_S1024", "memattn"].fwd_ms == 1.02
    assert got["D128_S1024", "memattn"].fwd_rounds_ms == [1.0, 1.5, 1.02]
    assert got["D128_S4096", "memattn"].fwd_ms == pytest.approx(1.005)

    # rounds that never agree: EXTRA_ROUNDS more at most, the median of all of them
    stray = [1.0, 1.5, 2.0, 3.0, 4.0]
    times.update({("D128_S1024", "memattn"): stray, ("D128_S1024", "flex"): [2.0] * 5})
    calls.clear()
    short = [r for r in rows if r.name == "D128_S1024"]
    results = _fake_bench(tmp_path, short, impls, False, [], rounds=2, timings=timings)
    mine = next(r for r in results if r.impl == "memattn")
    assert len(mine.timing.fwd_rounds_ms) == 2 + bench.EXTRA_ROUNDS
    assert mine.timing.fwd_ms == statistics.median(stray[:2 + bench.EXTRA_ROUNDS])
    # ... marked so in the table and the JSON, the agreeing figures not
    assert bench._cell(mine).startswith(bench.UNSETTLED)
    entry = bench.result_json(mine)
    assert entry["fwd_rounds_agree"] is False and entry["bwd_rounds_agree"] is True
    flex = next(r for r in results if r.impl == "flex")
    assert bench.UNSETTLED not in bench._cell(flex)
    assert bench.unsettled_note(results).startswith(bench.UNSETTLED)
    assert bench.unsettled_note([flex]) is None


@pytest.mark.parametrize(("ms", "agree"), [
    ([1.0], True), ([1.0, 1.04], True), ([1.04, 1.0], True),
    ([1.0, 1.09], False),  # each within 5 % of their median, 9 % apart
    ([3.254, 2.978], False),  # an H100 run's D=256 S16384 forward rounds (ms)
    ([1.0, 1.5, 1.02], True), ([1.0, 1.06, 1.03], True), ([1.0, 1.06, 1.12], False),
    ([1.0, 1.5, 2.0], False), ([1.0, 1.2, 1.03, 1.04], True), ([1.0, 1.04, 1.5, 1.6], False),
])  # fmt: skip
def test_rounds_agree_where_a_majority_lies_within_agree_of_one_another(ms, agree):
    assert bench.rounds_agree([bench.Timing(fwd_ms=x) for x in ms]) is agree
    assert bench.rounds_agree([bench.Timing(fwd_ms=1.0, bwd_ms=x) for x in ms]) is agree


def test_resume_needs_a_json_path(capsys):
    assert cli.main(["bench", "--resume", "--rows", "D128_S4096"]) == 2
    assert "--resume needs --json" in capsys.readouterr().err


def test_ratio_is_memattn_over_the_best_peer_per_pass(fake_run):
    _, doc, _, _ = fake_run
    ratios = {r["row"]: r for r in doc["ratios"]}
    for name, r in ratios.items():
        mine = [x for x in doc["rows"] if x["row"] == name]
        for p in ("fwd", "bwd"):
            ours = next(x[f"{p}_tflops"] for x in mine if x["impl"] == "memattn")
            peers = {x["impl"]: x[f"{p}_tflops"] for x in mine
                     if x["impl"] != "memattn" and x[f"{p}_tflops"] is not None}  # fmt: skip
            if ours is None:
                assert r[f"{p}_ratio"] is None
                continue
            best = max(peers, key=peers.get)
            assert r[f"{p}_best_peer"] == best
            assert r[f"{p}_ratio"] == pytest.approx(ours / peers[best])
    # fwd: cudnn (0.5 ms) is best, memattn takes 1.0 ms; bwd: flash (2 ms) vs memattn 4 ms
    assert ratios["D128_S1024"]["fwd_ratio"] == pytest.approx(0.5)
    assert ratios["D128_S4096"]["bwd_ratio"] == pytest.approx(0.5)
    assert ratios["D128_S4096"]["bwd_best_peer"] == "sdpa_flash"
    # bias_grad bwd: flash n/a, cudnn OOM, flex skipped: efficient (8 ms) is the best peer
    assert ratios["bias_grad"]["bwd_best_peer"] == "sdpa_efficient"
    assert ratios["bias_grad"]["bwd_ratio"] == pytest.approx(2.0)
    assert ratios["gqa8"]["fwd_ratio"] is None


def test_table_shows_cells_ratios_and_reasons(fake_run):
    _, _, text, _ = fake_run
    for name in QUICK:
        assert name in text
    assert "memattn / best peer" in text
    assert "0.50 sdpa_cudnn" in text  # fwd ratio on the plain rows
    assert "n/a / n/a" in text and "OOM" in text and "skip / skip" in text and "err" in text
    assert "sdpa_flash (fwd+bwd) on bias_grad: RuntimeError: No available kernel" in text
    assert "sdpa_cudnn (bwd) on bias_grad: OutOfMemoryError" in text
    assert "skipped:" not in text  # skips are not listed as errors


def test_plot_or_a_message_without_matplotlib(fake_run, monkeypatch, tmp_path):
    results, _, text, tmp = fake_run
    try:
        import matplotlib  # noqa: F401

        assert (tmp / "b.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in text
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    console = Console(file=io.StringIO(), record=True)
    assert not bench.plot(results, tmp_path / "c.png", "t", console)
    assert "matplotlib is not installed" in console.export_text()
    assert not (tmp_path / "c.png").exists()


# ------------------------------------------------------------------ the command


def test_bench_without_cuda_exits_with_a_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", "--quick"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert cli.main(["bench", "--rows", "nothing"]) == 2
    assert "matches no row" in capsys.readouterr().err
    assert cli.main(["bench", "--compile-workers", "-1"]) == 2
    assert "--compile-workers must be >= 0, got -1" in capsys.readouterr().err


def test_bench_list_runs_anywhere(capsys):
    assert cli.main(["bench", "--list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in QUICK) and "dropout0.1" not in out


def test_importing_bench_imports_neither_triton_nor_matplotlib(fresh_import):
    out, err = fresh_import.communicate(timeout=60)
    assert fresh_import.returncode == 0, err
    assert out.strip() == "[]"


def test_warm_caches_runs_each_impl_that_can_run_the_row_once(monkeypatch):
    """--compile-workers' job: one forward and backward per implementation that can
    express the row, and it survives an implementation that fails."""
    calls = []

    def fake(name):
        def run(row, t):
            calls.append(name)
            if name == "sdpa_cudnn":
                raise RuntimeError("No available kernel")
            return (t.q * 2).sum(dim=-1, keepdim=True).expand(*t.q.shape[:-1], row.dv)
        return run

    for name in bench.IMPLS:
        monkeypatch.setitem(bench.IMPLS, name, fake(name))
    dropout = next(r for r in bench.FEATURE_ROWS if r.name == "dropout0.1")
    row = replace(dropout, batch=1, heads=2, kv_heads=2, seqlen=8, dqk=8, dv=8)
    assert row.dropout  # flex has no dropout: skipped
    assert bench.warm_caches((row, list(bench.IMPLS), False, "cpu")) == row.name
    assert calls == ["memattn", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn"]


def test_compile_in_workers_logs_each_row_with_the_time_so_far(monkeypatch):
    """A log file gets a line per row the workers compiled (a progress bar shows nothing
    there): a cut run says how far compiling got."""
    import concurrent.futures

    class InThreads(concurrent.futures.ThreadPoolExecutor):  # no processes, no torch
        def __init__(self, workers, mp_context=None):
            super().__init__(workers)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", InThreads)
    monkeypatch.setattr(bench, "warm_caches", lambda job: job[0].name)
    rows = bench.select_rows(True)[:3]
    lines = []
    bench.compile_in_workers(rows, ["memattn"], True, 2, "cpu", log=lines.append)
    assert len(lines) == 3
    assert sorted(line.split()[1] for line in lines) == sorted(r.name for r in rows)
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"]
    assert all(line.endswith(" s") for line in lines)


@pytest.mark.parametrize(
    "options, path",
    [(dict(), "docs/bench/latest.json"), (dict(quick=True), "bench-out/bench.json"),
     (dict(rows="D128_*"), "bench-out/bench.json"), (dict(impls="memattn,flex"),
                                                     "bench-out/bench.json")],
)  # fmt: skip
def test_default_json_keeps_full_runs_in_docs(options, path):
    """Without --json, only a full run (every row, every peer) replaces the repository's
    record of the latest run; subsets go to the ignored bench-out/."""
    args = argparse.Namespace(**{"quick": False, "rows": None, "impls": None, **options})
    assert bench.default_json(args) == path
