"""tools/: what of the measuring tools can be checked without a GPU."""

import os

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")


@pytest.fixture
def ab(monkeypatch):
    """tools/ab.py as a module (it is run as a script), its knobs and whether the Gluon
    kernels run put back as they were after the test (use() sets them globally)."""
    from memattn.kernels import hopper

    monkeypatch.syspath_prepend(TOOLS)
    import ab

    for key in ab.DEFAULTS:
        module, name = ab.knob_module(key), key.split(".")[1]
        monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(hopper, "enabled", hopper.enabled)
    return ab


def test_ab_variants_set_only_knobs_it_knows(ab):
    """Each of tools/ab.py's variants sets knobs of its DEFAULTS (each read from the
    module whose code reads it): a misspelt knob would be set as a new attribute that
    no kernel reads, and the A/B would time the shipped kernels against themselves."""
    unknown = {(name, key) for name, knobs in ab.VARIANTS.items() if knobs
               for key in knobs if key not in ab.DEFAULTS}  # fmt: skip
    assert not unknown
    for key in ab.DEFAULTS:
        assert hasattr(ab.knob_module(key), key.split(".")[1]), key


def test_ab_use_sets_a_variant_and_puts_the_shipped_knobs_back(ab):
    """use() sets a variant's knobs over the shipped ones and a later use() of another
    variant puts back the first one's: each A/B round starts from the shipped kernels."""
    ab.use(ab.VARIANTS["bwd_serial"])
    assert ab.knob_module("bwd.DEPENDENT_LAUNCHES").DEPENDENT_LAUNCHES is False
    ab.use(ab.VARIANTS["default"])
    for key, value in ab.DEFAULTS.items():
        assert getattr(ab.knob_module(key), key.split(".")[1]) == value, key


def test_ab_kernel_windows_count_the_gaps_between_a_calls_kernels(ab):
    """kernel_windows: a call's window runs from a flush's end to the next flush's start
    (its kernels and the idle time between them, as do_bench times it), each kernel's
    time is its median over the calls, the first call is left out."""
    flush = f"void at::native::vectorized_elementwise_kernel<4, at::native::{ab.FLUSH_MARKER}>"
    events, t = [], 0.0
    for pre, main, post in [(99, 99, 99), (70, 700, 50), (72, 720, 52), (71, 710, 51),
                            (73, 730, 53), (74, 740, 54)]:
        events.append((t, t + 80, flush))
        t += 82  # 2 us before the first kernel, 1 between the next ones
        for name, us in (("_delta_kernel", pre), ("_bwd_sm90_kernel", main),
                         ("_dq_from_tiles_kernel", post)):
            events.append((t, t + us, name))
            t += us + 1
    events.append((t, t + 80, flush))
    window, kernels = ab.kernel_windows(events[::-1])  # any order
    assert window == 72 + 720 + 52 + 5  # the median call and its 5 us of gaps
    assert kernels == [("_delta_kernel", 72), ("_bwd_sm90_kernel", 720),
                       ("_dq_from_tiles_kernel", 52)]
    with pytest.raises(ValueError, match="fewer than three flushes"):
        ab.kernel_windows(events[:5])


def test_compile_report_counts_global_accesses_of_one_element(monkeypatch):
    """compile_sm90.narrow_global_accesses: loads and stores without .v2 / .v4 (cache
    qualifiers and predicates aside), the figure that shows a variant's lost alignment."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    monkeypatch.syspath_prepend(TOOLS)
    import compile_sm90  # pops TRITON_INTERPRET: monkeypatch puts it back after

    ptx = """
\t@%p1 st.global.v4.b32 [ %rd1 + 0 ], { %r1, %r2, %r3, %r4 };
\t@!%p2 st.global.b32 [ %rd2 + 0 ], { %r5 };
\tst.global.b16 [%rd3], %rs1;
\tld.global.nc.L1::evict_last.v4.b32 { %r6, %r7, %r8, %r9 }, [ %rd4 + 0 ];
\tld.global.L1::evict_last.b32 { %r10 }, [ %rd5 + 0 ];
\t@%p3 ld.global.v2.b32 { %r11, %r12 }, [ %rd6 + 0 ];
\tred.global.add.f32 [%rd7], %f1;
\tld.shared.b32 %r13, [%r14];
"""
    assert compile_sm90.narrow_global_accesses(ptx) == (1, 2)


def test_ab_moved_keeps_values_and_tensors_at_new_addresses(ab):
    """--move-inputs: the tensors the calls hold keep their values, objects and
    requires_grad, at new addresses."""
    import torch

    tensors = [torch.randn(3, 5, requires_grad=True), torch.randn(7)]
    before = [(t.data_ptr(), t.detach().clone()) for t in tensors]
    pads = ab.moved(tensors, 4096)
    assert len(pads) == 2 and all(p.numel() == 4096 for p in pads)
    assert tensors[0].requires_grad and not tensors[1].requires_grad
    for t, (ptr, values) in zip(tensors, before):
        assert t.data_ptr() != ptr and torch.equal(t.detach(), values)
