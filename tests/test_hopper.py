"""kernels/hopper.py: what the Gluon kernels share. The launcher's bookkeeping runs on
the CPU against a stand-in kernel; the real launches run on the GPU."""

import collections
import itertools

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

import memattn
from memattn import bench
from memattn.kernels import backward_sm90, common, forward_sm90, hopper

from .test_forward import hopper_kernel_runs_here


class _StandInCudaLauncher:
    """Triton 3.6's CudaLauncher surface: called as run(grid..., *args), and its C
    launcher behind a descriptor wrapper that closes over it as ``launcher``."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.runs, self.c_launches = [], []

        def launcher(*args):
            self.c_launches.append(args)

        def inner(*args):  # wrap_handle_tensordesc's shape
            return launcher(*args)

        self.launch = inner

    def __call__(self, *args):
        self.runs.append(args)


class _StandInKernel:
    function = "fn"
    packed_metadata = "meta"

    class metadata:
        tensordesc_meta = None

    def __init__(self):
        self.run = _StandInCudaLauncher()

    def launch_metadata(self, *args):
        return "launch meta"


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


def test_launcher_goes_through_triton_once_per_key_then_launches_directly(launcher):
    """The first launch of a key goes through JITFunction.run (which compiles where its
    own cache has not); later ones go straight to the C launcher, whatever the grid."""
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert len(launcher.fn.compiles) == 1
    launcher((5,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert len(launcher.fn.compiles) == 1
    run = launcher.fn.compiles[0][3].run
    assert run.runs == []
    # Triton's C launcher format: grid, stream, function, cooperative and PDL flags,
    # two scratch buffers, metadata, launch metadata, two hooks, then the signature's
    # arguments in order: runtime ones, then the constexprs (num_warps is an option)
    (launch,) = run.c_launches
    assert launch[:13] == (5, 1, 1, 1234, "fn", False, True, None, None, "meta", None, None,
                           None)  # fmt: skip
    assert launch[13:] == (x, 32, 0.5, 16, True)


def test_launcher_keys_scalars_by_value_and_type(launcher):
    """A scalar of another value, or of another type with an equal value (1, 1.0 and
    True hash alike), is a new key: it goes through JITFunction.run, which specialises
    it as it should, and only then launches directly."""
    x = torch.zeros(64)
    for n, f in ((32, 0.5), (48, 0.5), (32, 0.25), (1, 0.5), (1.0, 0.5), (True, 0.5),
                 (32, 1), (32, 0.5)):  # fmt: skip
        launcher((3,), x, n, f, BLOCK=16, FLAG=True, num_warps=4)
    assert [c[1][1:] for c in launcher.fn.compiles] == [
        (32, 0.5), (48, 0.5), (32, 0.25), (1, 0.5), (1.0, 0.5), (True, 0.5), (32, 1)]
    assert [type(c[1][1]) for c in launcher.fn.compiles[3:6]] == [int, float, bool]
    assert launcher.fn.compiles[0][3].run.c_launches[0][13:] == (x, 32, 0.5, 16, True)


def test_launcher_keys_a_variant_without_working_out_the_arguments(launcher, monkeypatch):
    """A caller's variant is the whole key beside the device: the same variant launches
    directly whatever the scalars (it fixes their specialisation and the constexprs); a
    new one goes through run()."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    monkeypatch.setattr(hopper, "_specialisation", None)  # never called with a variant
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant=("a", 1))
    launcher((5,), x, 48, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant=("a", 1))
    assert len(launcher.fn.compiles) == 1
    assert launcher.fn.compiles[0][3].run.c_launches[0][13:] == (x, 48, 0.5, 16, True)
    launcher((5,), x, 48, 0.5, BLOCK=32, FLAG=True, num_warps=4, variant=("a", 2))
    assert len(launcher.fn.compiles) == 2  # another variant, through run()
    assert launcher.fn.compiles[1][2] == dict(BLOCK=32, FLAG=True, num_warps=4)


def test_launcher_checks_variants_against_the_arguments(launcher, monkeypatch):
    """With CHECK_VARIANTS (the suites set it) a variant launched with arguments of
    another specialisation than its first launch is a caller's bug, and raises."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", True)
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    launcher((4,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    with pytest.raises(AssertionError, match="another specialisation"):
        launcher((4,), x, 1, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    with pytest.raises(AssertionError, match="another specialisation"):
        launcher((4,), x[1:], 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    with pytest.raises(AssertionError, match="another specialisation"):  # constexprs too
        launcher((4,), x, 32, 0.5, BLOCK=32, FLAG=True, num_warps=4, variant="v")


def test_launcher_launches_a_prepared_call_as_it_was_first_launched(launcher, monkeypatch):
    """A call launched with ``prepare=key`` leaves its C launcher arguments, tensors as
    addresses (nothing kept alive); launch_prepared(programs, key) launches them as
    they were, on the current stream, and is False for a key not prepared, under a
    launch hook, and in tests (CHECK_VARIANTS), which make the arguments every time."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    x = torch.zeros(64)
    assert not launcher.launch_prepared(3, "k")
    for grid in ((3,), (3,)):  # the first compiles, the second prepares
        launcher(grid, x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v",
                 prepare="k")
    run = launcher.fn.compiles[0][3].run
    assert run.c_launches[-1][13:] == (x.data_ptr(), 32, 0.5, 16, True)
    assert launcher.launch_prepared(7, "k")
    assert run.c_launches[-1][:4] == (7, 1, 1, 1234)
    assert run.c_launches[-1][4:] == run.c_launches[-2][4:]
    assert not launcher.launch_prepared(7, "other")
    hook = hopper.knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hook)
    assert not launcher.launch_prepared(7, "k")
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hopper.knobs.HookChain())
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", True)
    assert not launcher.launch_prepared(7, "k")
    assert len(run.c_launches) == 2


def test_launcher_checks_a_prepared_key_against_the_arguments(launcher, monkeypatch):
    """With CHECK_VARIANTS each launch given a ``prepare`` key compares its arguments
    with those the key first prepared: a key that misses something the arguments are
    made of (here another tensor's address) is a caller's bug, and raises."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", True)
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v",
                 prepare="k")
    with pytest.raises(AssertionError, match="prepared call"):
        launcher((3,), y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v",
                 prepare="k")


def test_launcher_goes_through_triton_with_a_launch_hook(launcher, monkeypatch):
    """A launch hook (proton, say) sees every launch: Triton's own path calls it."""
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    hook = hopper.knobs.HookChain()  # Triton's default: empty, so not called
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hook)
    launcher((4,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    run = launcher.fn.compiles[0][3].run
    assert len(run.c_launches) == 1 and run.runs == []
    hook.add(lambda metadata: None)
    launcher((5,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert len(run.c_launches) == 1
    (launch,) = run.runs
    assert launch[:8] == (5, 1, 1, 1234, "fn", "meta", "launch meta", hook)
    assert launch[9:] == (x, 32, 0.5, 16, True)


def test_replays_launch_what_a_call_launched_when_recorded(launcher, monkeypatch):
    """A recording keeps its launches (C launcher, programs, arguments with tensors as
    addresses: nothing kept alive) for its key; Replays.launch launches them again as
    they were, on the current stream, prepared or not when recorded, and is False for
    another key, inside sharing_sms (plans differ there), under a launch hook and in
    tests (CHECK_VARIANTS); forget_plans forgets them."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    replays = hopper.Replays()
    x, y = torch.zeros(64), torch.zeros(64)

    def path():  # two launches, the second prepared after its first call
        launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="a")
        if not launcher.launch_prepared(5, "k"):
            launcher((5,), y, 48, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="a",
                     prepare="k")

    with replays.recording("call"):
        path()  # the first launch compiles: nothing kept
    assert not replays.launch("call") and replays.launches == {}
    for _ in range(2):  # made, then with the second launch prepared
        with replays.recording("call"):
            path()
    run = launcher.fn.compiles[0][3].run
    made = list(run.c_launches)
    assert [launch[:4] for launch in made[-2:]] == [(3, 1, 1, 1234), (5, 1, 1, 1234)]
    assert replays.launch("call")
    assert run.c_launches[-2:] == made[-2:]  # as recorded
    assert made[-2][13:] == (x.data_ptr(), 32, 0.5, 16, True)
    assert not replays.launch("other")
    with memattn.sharing_sms():
        assert not replays.launch("call")
    hook = hopper.knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hook)
    assert not replays.launch("call")
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hopper.knobs.HookChain())
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", True)
    assert not replays.launch("call")
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    assert len(run.c_launches) == len(made) + 2
    hopper.forget_plans()
    assert not replays.launch("call")


def test_replays_keep_no_recording_that_failed_or_went_through_triton(launcher, monkeypatch):
    """A recording ended by an exception, or with a launch through Triton's own path (a
    launch hook here), is not kept; recording stops at the block's end either way."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    replays = hopper.Replays()
    x = torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)  # compiled
    with pytest.raises(RuntimeError), replays.recording("call"):
        launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
        raise RuntimeError
    hook = hopper.knobs.HookChain()
    hook.add(lambda metadata: None)
    with monkeypatch.context() as hooked:
        hooked.setattr(hopper.knobs.runtime, "launch_enter_hook", hook)
        with replays.recording("call"):
            launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert replays.launches == {} and hopper._RECORDING.launches is None
    with replays.recording(None):  # no key: nothing recorded
        launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert replays.launches == {}


def test_replays_check_a_recording_against_the_one_kept(launcher, monkeypatch):
    """With CHECK_VARIANTS each recording of a key compares its launches with those
    first kept for it: a key that misses something the launches are made of (here a
    tensor's address) is a caller's bug, and raises; so is a recorded path that
    allocates (an address no key holds)."""
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", True)
    replays = hopper.Replays()
    x, y = torch.zeros(64), torch.zeros(64)
    launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    for _ in range(2):
        with replays.recording("call"):
            launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    with pytest.raises(AssertionError, match="recorded call's launches"), \
            replays.recording("call"):  # fmt: skip
        launcher((3,), y, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    counts = iter(range(10))  # the allocator's count: one allocation inside the block
    monkeypatch.setattr(hopper, "_allocations", lambda: next(counts))
    with pytest.raises(AssertionError, match="allocated memory"), replays.recording("new"):
        launcher((3,), x, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4, variant="v")
    assert "new" not in {key[-1] for key in replays.launches}


def test_launch_splices_descriptor_maps_between_the_other_arguments(monkeypatch):
    """Each descriptor becomes its map's arguments in place; the rest pass as they are,
    in order, then the constexprs."""
    monkeypatch.setattr(hopper, "_tensor_map_args",
                        lambda desc, meta: [f"map{meta}", *desc.shape])  # fmt: skip
    kernel = _StandInKernel()
    kernel.metadata = type("metadata", (), {"tensordesc_meta": [1, 2]})
    t = torch.zeros(2, 64, 3, 16, dtype=torch.bfloat16)
    first, second = hopper.descriptor(t, 32), hopper.descriptor(t, 16)
    for args, expected in (
        ((first, 7, second, 8.0, None), ["map1", 2, 3, 64, 16, 7, "map2", 2, 3, 64, 16, 8.0,
                                         None]),
        ((7, first, second), [7, "map1", 2, 3, 64, 16, "map2", 2, 3, 64, 16]),
    ):  # fmt: skip
        compiled = hopper._Compiled(kernel, [16], args, None)
        assert list(compiled.arguments(1234, args)[9:]) == [*expected, 16]


def test_tensor_maps_are_encoded_once_per_address_and_geometry(monkeypatch):
    encodes = []
    monkeypatch.setattr(hopper.nvidia_driver, "make_tensordesc_arg",
                        lambda desc, meta: encodes.append(desc) or ["map", *desc.shape])
    monkeypatch.setattr(hopper, "_TENSOR_MAPS", {})
    meta = {"swizzle": 128}
    t = torch.zeros(2, 64, 3, 16, dtype=torch.bfloat16)
    first = hopper._tensor_map_args(hopper.descriptor(t, 32), meta)
    assert hopper._tensor_map_args(hopper.descriptor(t, 32), meta) == first
    assert len(encodes) == 1
    for other in (hopper.descriptor(t, 16), hopper.descriptor(t.clone(), 32),
                  hopper.descriptor(t[:1], 32), hopper.descriptor(t.transpose(1, 2), 32)):
        hopper._tensor_map_args(other, meta)
    hopper._tensor_map_args(hopper.descriptor(t, 32), dict(meta))  # another kernel's
    assert len(encodes) == 6
    assert hopper._tensor_map_args(hopper.descriptor(t, 32), None) == ["map", 2, 3, 64, 16]
    assert len(encodes) == 7  # no map, nothing kept


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
@pytest.mark.parametrize("head_dim", [64, 256])
def test_repeat_calls_launch_directly_and_match_gpu(monkeypatch, head_dim):
    """The first call of a variant goes through JITFunction.run, later ones straight to
    Triton's C launcher with cached tensor maps, then with the arguments it prepared
    (Launcher.launch_prepared; the backward: the launches it recorded,
    backward_sm90._REPLAYS), and with a launch hook set through Triton's own launcher,
    which calls the hook: the same results, forward and backward
    (`_assert_same_results`)."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    wide = backward_sm90.wide
    launchers = [forward_sm90._launch_forward, backward_sm90.narrow._launch_backward,
                 wide._launch_backward_wide, wide._launch_dq_wide]  # fmt: skip
    for launcher in launchers:
        monkeypatch.setattr(launcher, "fn", _CountingJit(launcher.fn))
        monkeypatch.setattr(launcher, "kernels", {})
        monkeypatch.setattr(launcher, "prepared", {})
    monkeypatch.setattr(hopper, "_TENSOR_MAPS", {})
    q, k, v = (torch.randn(2, 1100, 4, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))  # fmt: skip
    grad = torch.randn_like(q)

    def call():
        out, lse = memattn.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), grad))

    first = call()
    used = [launcher for launcher in launchers if launcher.fn.runs]
    kernels = 3 if head_dim == 256 else 2  # forward, backward (and D=256's dQ kernel)
    assert len(used) == kernels and all(launcher.fn.runs == 1 for launcher in used)
    second = call()
    assert all(launcher.fn.runs == 1 for launcher in used)
    assert all(c.raw is not None for launcher in used for c in launcher.kernels.values())
    assert len(hopper._TENSOR_MAPS) > 0
    _assert_same_results(first, second)
    # The second call prepared each launch's arguments and recorded the backward's
    # launches (each checked against the ones it made); outside the suite's checks
    # (CHECK_VARIANTS) a call of the same addresses launches them as kept: the forward's
    # prepared arguments, the backward's recorded launches. Which addresses a call's
    # outputs get is the allocator's business: freed results let the next calls reuse
    # theirs.
    assert all(launcher.prepared for launcher in used) and backward_sm90._REPLAYS.launches
    del second
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    hits = []
    for launcher in used:
        monkeypatch.setattr(launcher, "launch_prepared",
                            lambda *a, f=launcher.launch_prepared: hits.append(f(*a)) or hits[-1])
    replays = _counted_replays(monkeypatch)
    prepared = None
    for _ in range(3):
        hits.clear()
        replays.clear()
        prepared = None  # frees the last try's results before the next call
        prepared = call()
        if hits == [True] and replays == [True]:  # the forward's, the backward's
            break
    assert hits == [True] and replays == [True], (hits, replays)
    assert all(launcher.fn.runs == 1 for launcher in used)
    _assert_same_results(first, prepared)

    names = []
    hook = hopper.knobs.HookChain()
    hook.add(lambda metadata: names.append(metadata.get()["name"]))
    monkeypatch.setattr(hopper.knobs.runtime, "launch_enter_hook", hook)
    third = call()
    assert {"_fwd_sm90_kernel"} < set(names)
    assert all(launcher.fn.runs == 1 for launcher in used)
    _assert_same_results(first, third)


# Backward calls whose launches backward_sm90 records and replays: each of its kernels
# (D=64 masked with dQ converted by head, windowed D=128 with ALiBi and dropout, packed
# sequences, the wide kernels, the split kernel) and a gradient into lse.
REPLAYED = {
    "D64 causal": dict(dim=(64, 64), kw=dict(causal=True), seqlen=1100),  # keys enough
    "D128 window alibi dropout": dict(dim=(128, 128), kw=dict(window=(100, 0), dropout_p=0.2),
                                      alibi=True),
    "D128 packed causal": dict(dim=(128, 128), kw=dict(causal=True), packed=True),
    "D256 causal": dict(dim=(256, 256), kw=dict(causal=True)),
    "Dqk192 Dv128": dict(dim=(192, 128), kw={}),
    "D128 grad_lse": dict(dim=(128, 128), kw={}, grad_lse=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(REPLAYED), ids=list(REPLAYED))
def test_replayed_backward_reads_its_inputs_as_recorded_gpu(monkeypatch, case):
    """A backward call at the addresses of a recorded one launches its recording
    (backward_sm90._REPLAYS) and gives what the full path gives for the values its
    tensors hold then: new values in grad_out, read through the same addresses."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    c = REPLAYED[case]
    dqk, dv = c["dim"]
    gen = torch.Generator(device="cuda").manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    kw = dict(c["kw"])
    if c.get("packed"):
        lengths = [300, 1, 177, 0, 420]
        cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda",
                          dtype=torch.int32)  # fmt: skip
        q, k, v = randn(cu[-1], 4, dqk), randn(cu[-1], 4, dqk), randn(cu[-1], 4, dv)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=420, max_seqlen_k=420)
    else:
        sq = c.get("seqlen", 300)
        q, k, v = randn(2, sq, 4, dqk), randn(2, sq + 33, 4, dqk), randn(2, sq + 33, 4, dv)
    if c.get("alibi"):
        kw["alibi_slopes"] = torch.rand(4, device="cuda", generator=gen)
    out, lse, rng = memattn.ops.forward(q, k, v, **kw)
    grad_out = randn(*out.shape)
    if c.get("grad_lse"):
        kw["grad_lse"] = torch.randn(lse.shape, device="cuda", generator=gen)
    replays = _counted_replays(monkeypatch)

    def grads():
        return memattn.ops.backward(grad_out, q, k, v, out, lse, rng_state=rng, **kw)[:3]

    first = grads()  # compiled where no test has yet, then recorded
    assert replays[:1] == [False], "the Gluon backward did not take the call"
    replayed = None
    for _ in range(4):  # until the allocator gives the buffers the recorded addresses
        replayed = None  # frees the last try's
        replayed = grads()
        if replays[-1]:
            break
    assert replays[-1], replays
    _assert_same_results((None, None, *first), (None, None, *replayed))
    grad_out.copy_(randn(*out.shape))  # new values at the same address
    del replayed
    for _ in range(3):
        replayed = None
        replayed = grads()
        if replays[-1]:
            break
    assert replays[-1], replays
    backward_sm90._REPLAYS.launches.clear()  # the full path, for the same values
    _assert_same_results((None, None, *grads()), (None, None, *replayed))
    assert replays[-1] is False


def _counted_replays(monkeypatch) -> list[bool]:
    """What each backward_sm90._REPLAYS.launch returns from here on, in order."""
    replays, launch = [], backward_sm90._REPLAYS.launch
    monkeypatch.setattr(backward_sm90._REPLAYS, "launch",
                        lambda key: replays.append(launch(key)) or replays[-1])
    return replays


def _assert_same_results(first, second):
    """out, lse, dk and dv bit for bit; dq to rounding, since at D 64 and 128 the Gluon
    backward adds its fp32 tiles in whatever order programs finish (why deterministic=True
    runs backward.py there): a different order may flip the last bit of a bf16 dq
    element."""
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        if a is None and b is None:  # not compared
            continue
        if name == "dq":
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3 * a.abs().max().item())
        else:
            assert torch.equal(a, b), f"{name} differs between two identical calls"


def _spec(bias, seqlen_q=40, seqlen_k=24, dtype=torch.bfloat16):
    q = torch.empty(2, seqlen_q, 4, 64, dtype=dtype)
    k = torch.empty(2, seqlen_k, 4, 64, dtype=dtype)
    return memattn.spec.check_call(q, k, k, bias=bias)


def _bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize(
    "make, readable, full",
    [(lambda: _bf16(2, 4, 40, 24), True, True),
     (lambda: _bf16(4, 40, 24), True, False),  # broadcast over batches
     (lambda: _bf16(2, 1, 40, 24), True, False),  # over heads
     (lambda: _bf16(40, 24), True, False),
     (lambda: _bf16(2, 4, 24, 40).transpose(-1, -2), False, True),  # key stride 40
     (lambda: _bf16(2, 4, 40, 1).expand(2, 4, 40, 24), False, True),  # over keys
     (lambda: _bf16(2, 4, 1, 24), False, False),  # over queries
     (lambda: _bf16(2, 4, 40, 25)[..., :24], False, True),  # rows of 50 bytes
     (lambda: _bf16(2 * 4 * 40 * 24 + 1)[1:].view(2, 4, 40, 24), False, True)],
    ids=["full", "HQK", "B1QK", "QK", "keys strided", "keys broadcast", "queries broadcast",
         "rows unaligned", "base unaligned"],
)  # fmt: skip
def test_which_biases_tma_reads(make, readable, full):
    """bias_readable: the biases the Gluon kernels read by TMA tiles, as they are where
    their rows are aligned (common.rows_aligned at TMA_BIAS_ALIGNMENT), else over the
    copy dispatch makes (common.aligned_bias: the same values, aligned)."""
    bias = make()
    spec = _spec(bias)
    spans = bias.shape[-2] == 40  # every query (and key)
    assert hopper.bias_readable(spec, bias) == spans
    assert not hopper.bias_readable(spec, bias.float())  # not q's dtype
    assert hopper.bias_full(spec, bias) == full
    as_is = common.rows_aligned(bias, hopper.TMA_BIAS_ALIGNMENT)
    assert (spans and as_is) == readable
    aligned = common.aligned_bias(bias, hopper.TMA_BIAS_ALIGNMENT)
    assert (aligned is bias) == as_is and torch.equal(aligned, bias)
    assert common.rows_aligned(aligned, hopper.TMA_BIAS_ALIGNMENT)
    assert hopper.bias_full(spec, aligned) == full


def test_which_biases_are_key_rows():
    """hopper.bias_row: constant along queries and spanning Sk; no bias is not one."""
    spec = _spec(None)
    assert not hopper.bias_row(spec, None)
    for shape, row in [((2, 1, 1, 24), True), ((1, 4, 1, 24), True), ((24,), True),
                       ((2, 4, 40, 24), False), ((2, 4, 1, 1), False)]:
        bias = _bf16(*shape)
        assert hopper.bias_row(_spec(bias), bias) == row, shape


def test_bias_descriptor_indexes_broadcast_dimensions_at_zero():
    """A broadcast dimension has size 1 (the kernels index it at 0) and a stride TMA
    accepts: a multiple of 16 bytes, whatever the tensor's own (here 0, from expand)."""
    bias = torch.empty(40, 24, dtype=torch.bfloat16).expand(1, 1, 40, 24)
    desc = hopper.bias_descriptor(bias, 64, 128)
    assert desc.shape == [1, 1, 40, 24]
    assert desc.block_shape == [1, 1, 64, 128]
    assert desc.strides[2:] == [24, 1]
    assert all(s > 0 and s * 2 % 16 == 0 for s in desc.strides[:3])


@pytest.mark.gpu
def test_prepared_launches_see_packed_token_counts_gpu(monkeypatch):
    """A launch's arguments are made once per key (Launcher.launch_prepared); for packed
    sequences the key must hold the token counts, which the spec does not fix and the
    TMA descriptors do: calls over views of one buffer (the same addresses and strides,
    as a caching allocator hands out) with more tokens each time must not clip at the
    first call's count."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    monkeypatch.setattr(backward_sm90, "MIN_KEYS_PER_QUERY",
                        dict.fromkeys(backward_sm90.HEAD_DIMS, 0))
    buffers = torch.randn(4, 1100, 2, 128, device="cuda", dtype=torch.bfloat16)
    for tokens in (300, 700, 1100):  # the longest sequence stays 300: one spec
        q, k, v = (t[:tokens].requires_grad_(True) for t in buffers[:3])
        grad = buffers[3, :tokens]
        cu = torch.arange(0, tokens + 1, 300, device="cuda", dtype=torch.int32)
        cu = torch.cat([cu, cu.new_tensor([tokens])]) if cu[-1] != tokens else cu
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300, max_seqlen_k=300,
                  causal=True)  # fmt: skip
        out = memattn.attention(q, k, v, **kw)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
        ref = memattn.reference.attention(*ref_leaves, **kw)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double())
        for got, want in zip((out, *grads), (ref, *ref_grads)):
            torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_minus_inf_bias_rows_in_the_gluon_kernels_gpu(monkeypatch):
    """Through the Gluon kernels: a -inf bias row is empty (out 0, lse -inf, gradients
    0, never NaN), a finfo.min row averages v, as the reference has them."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90, "MIN_KEYS_PER_QUERY",
                        dict.fromkeys(backward_sm90.HEAD_DIMS, 0))
    launched = []
    for module, name in ((forward_sm90, "forward"), (backward_sm90, "backward")):
        run = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, run=run, n=name: launched.append(n)
                            or run(*a))
    q, k, v = (torch.randn(1, 200, 2, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    bias = torch.randn(1, 2, 200, 200, device="cuda", dtype=torch.bfloat16)
    bias[:, :, 3] = float("-inf")
    bias[:, 1, :, 150:] = float("-inf")
    bias[:, :, 5] = torch.finfo(torch.bfloat16).min
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, bias)]
    out, lse = memattn.attention(*leaves[:3], bias=leaves[3], return_lse=True)
    out.backward(torch.randn_like(out))
    assert launched == ["forward", "backward"]
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))
    assert torch.isneginf(lse[:, :, 3]).all()
    for t in (out, *(leaf.grad for leaf in leaves)):
        assert not t.isnan().any()
    assert torch.equal(leaves[3].grad[:, :, 3], torch.zeros_like(leaves[3].grad[:, :, 3]))
    ref = memattn.reference.attention(q.double(), k.double(), v.double(), bias=bias.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    # head 0's row 5 sees every key at finfo.min (head 1's only the first 150)
    torch.testing.assert_close(out[0, 5, 0].double(), v[0, :, 0].double().mean(dim=0),
                               atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("fold", [False, True], ids=["strided", "folded"])
@pytest.mark.parametrize("heads, blocks", [(1, 1), (1, 2), (3, 1), (2, 7), (5, 4), (4, 8),
                                           (33, 3)])  # fmt: skip
@pytest.mark.parametrize("sms", [1, 5, 132])
def test_work_items_cover_every_block_once(heads, blocks, sms, fold, monkeypatch):
    """The persistent schedule's arithmetic (hopper.work_item, work_items), run in
    Python: the programs `programs` launches walk every (head, block) exactly once;
    folded, each program's pairs within a head hold ranks r and blocks-1-r (equal work
    under a causal mask), or blocks-r where an odd count put a pair across heads."""
    monkeypatch.setattr(hopper, "sm_count", lambda device_index: sms)
    total = heads * blocks
    programs = hopper.programs(total, fold, True, 0)
    assert programs == min(sms, (total + 1) // 2 if fold else total)
    walked = []
    for pid in range(programs):
        count = hopper.work_items.fn(pid, programs, total, fold)
        items = [hopper.work_item.fn(pid, j, programs, blocks, fold) for j in range(count)]
        assert all(0 <= head < heads and 0 <= rank < blocks for head, rank in items)
        if fold:
            for (h0, r0), (h1, r1) in zip(items[::2], items[1::2]):
                balanced = r0 + r1 == blocks - 1 or (blocks % 2 and r0 + r1 == blocks)
                assert h0 != h1 or balanced, (pid, items)
        walked += items
    assert sorted(walked) == [(h, r) for h in range(heads) for r in range(blocks)]


@pytest.mark.parametrize("heads, blocks, together", [(1, 1, 1), (3, 5, 1), (4, 8, 4),
                                                     (5, 4, 2), (7, 3, 4), (33, 32, 16)])
def test_rank_major_items_cover_every_block_once(heads, blocks, together):
    """hopper.rank_major_item, run in Python: a grid of heads x blocks programs stands for
    every (head, block) once; within each group of ``together`` heads (the last one
    maybe fewer) rank 0 of every head comes first, then rank 1, and so on."""
    programs = heads * blocks
    items = [hopper.rank_major_item.fn(pid, programs, blocks, together)
             for pid in range(programs)]  # fmt: skip
    assert sorted(items) == list(range(programs))
    for first in range(0, heads, together):
        group = items[first * blocks:min(heads, first + together) * blocks]
        assert {item // blocks for item in group} == set(range(first, min(heads, first + together)))
        ranks = [item % blocks for item in group]
        assert ranks == sorted(ranks)


@pytest.mark.parametrize("sq, sk, block_m, block_n, options", [
    (1000, 1000, 128, 128, dict(causal=True)), (16384, 16384, 192, 128, dict(causal=True)),
    (700, 1100, 128, 64, dict(causal=True, align="bottom_right")),
    (1100, 700, 128, 128, dict(causal=True, align="bottom_right")),  # early rows see none
    (900, 900, 128, 128, dict(window=(-1, 300)))])  # fmt: skip
def test_right_bound_tiles_count_the_keys_each_block_walks(sq, sk, block_m, block_n, options):
    """hopper.right_bound_tiles: a query block of rank r (rank 0 the last) walks key tiles
    up to the last key its rows [start, start + BLOCK_M) may see (rows past the sequence
    count, as the kernel's key range takes the block whole), none where no row sees a
    key; counted here row by row from the mask's definition."""
    q = torch.empty(1, sq, 1, 64, device="meta")
    k = torch.empty(1, sk, 1, 64, device="meta")
    spec = memattn.spec.check_call(q, k, k, **options)
    off = sk - sq if spec.bottom_right else 0
    blocks = -(-sq // block_m)
    expected = []
    for rank in range(blocks):
        start = (blocks - 1 - rank) * block_m
        last_key = max(min(sk - 1, row + off + spec.window_right)
                       for row in range(start, start + block_m))  # fmt: skip
        expected.append(-(-(last_key + 1) // block_n) if last_key >= 0 else 0)
    assert hopper.right_bound_tiles(spec, blocks, block_m, block_n) == expected


@pytest.mark.parametrize("heads, blocks, group, programs", [(1, 1, 256, 1), (3, 5, 16, 4),
                                                            (16, 128, 256, 132),
                                                            (128, 22, 256, 132), (7, 9, 1, 200)])
def test_rank_table_deals_every_block_once_as_a_list_schedule(heads, blocks, group, programs):
    """hopper.rank_table: every (head, rank) item once, each program's between its offsets;
    replayed in rank_major_item's order, each block went to a program whose blocks so
    far ended first by key tiles (ties to the lower program), and each program walks its
    blocks in that order; so no program ends more than a block's tiles past another."""
    gen = torch.Generator().manual_seed(heads * blocks)
    tiles = sorted(torch.randint(1, 40, (blocks,), generator=gen).tolist(), reverse=True)
    table = hopper.rank_table(tiles, heads, group, programs)
    offsets = table[:programs + 1]
    assert offsets[0] == programs + 1 and offsets[-1] == len(table) == programs + 1 + heads * blocks
    dealt = [table[offsets[p]:offsets[p + 1]] for p in range(programs)]
    assert sorted(table[programs + 1:]) == list(range(heads * blocks))
    owner = {item: p for p, items in enumerate(dealt) for item in items}
    ends, walked = [0] * programs, [[] for _ in range(programs)]
    together = -(-group // blocks)
    for pid in range(heads * blocks):
        item = hopper.rank_major_item.fn(pid, heads * blocks, blocks, together)
        p = owner[item]
        assert p == min(range(programs), key=lambda q: (ends[q], q)), (pid, item)
        ends[p] += tiles[item % blocks]
        walked[p].append(item)
    assert walked == dealt
    assert max(ends) - min(ends) <= max(tiles)


@pytest.mark.parametrize("lengths", [(700, 5, 1300, 64), (0, 128, 129, 0, 1), (4000,),
                                     (1,) * 7, (127, 128, 129, 255, 256, 257),
                                     bench.DOC_LENGTHS])  # fmt: skip
@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("extra", [0, 300], ids=["exact", "tokens past cu_seqlens"])
def test_packed_items_cover_every_block_once(lengths, heads, extra):
    """Packed sequences' grid (common.packed_items, packed_rank; the kernel's search for
    an item's sequence, packed_sequence, done here in Python): its items hold every
    (sequence, head, block) exactly once, each sequence's after the last one's, blocks
    last first, each block across the heads; every other item is past its sequence's
    blocks, also where the packed tensor holds tokens past cu_seqlens's last."""
    block = 128
    cu = [0, *itertools.accumulate(lengths)]
    walked = []
    for g in range(common.packed_items(len(lengths), cu[-1] + extra, heads, block)):
        b = sum(heads * (cu[i] // block + i) <= g for i in range(len(lengths))) - 1
        h, rank = hopper.packed_rank.fn(g, heads, b, cu[b], block)
        assert 0 <= h < heads and rank >= 0
        blocks = -(-lengths[b] // block)
        if rank < blocks:  # else past the sequence's blocks
            walked.append((b, h, blocks - 1 - rank))
    assert walked == [(b, h, m) for b, n in enumerate(lengths)
                      for m in reversed(range(-(-n // block))) for h in range(heads)]


@gluon.jit
def _position_items_kernel(Items, CuSeq, num_items, H, num_seqs, BLOCK_M: gl.constexpr,
                           HEADS: gl.constexpr):  # fmt: skip
    """Each item's (b, h, start_m, key tiles) from packed_position_block in one warp (as
    the load warp runs it), causal, cu_seqlens the same for queries and keys."""
    field = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    for g in range(num_items):
        b, h, _, start_m, _, _, _, _, _, _, _, _, n_tiles = hopper.packed_position_block(
            g, H, 1, num_seqs, CuSeq, CuSeq, -1, 0, BLOCK_M, 128, False, False, True,
            HEADS)  # fmt: skip
        values = (gl.where(field == 0, b, 0) + gl.where(field == 1, h, 0)
                  + gl.where(field == 2, start_m, 0) + gl.where(field == 3, n_tiles, 0))
        gl.store(Items + 4 * g + field, values, mask=field < 4)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(700, 5, 1300, 64), (0, 128, 129, 0, 1), (1,) * 7,
                                     bench.DOC_LENGTHS, (300,) * 128])  # fmt: skip
@pytest.mark.parametrize("heads, together", [(3, 2), (16, 4), (5, 8)])
@pytest.mark.parametrize("block", [128, 192])
def test_packed_position_items_cover_every_block_once_gpu(lengths, heads, together, block):
    """hopper.packed_position_block on the GPU: the packed grid's items hold every
    (sequence, head, block) once, heads in groups of ``together`` (the last group maybe
    fewer), each group's blocks by position last first, each position's sequences in
    turn, each across the group's heads; every item from heads x the blocks on is
    past the end (start_m at the sequence's length, no key tile)."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    cu = [0, *itertools.accumulate(lengths)]
    num_items = common.packed_items(len(lengths), cu[-1], heads, block)
    items = torch.full((num_items, 4), -7, device="cuda", dtype=torch.int32)
    cu_seqlens = torch.tensor(cu, device="cuda", dtype=torch.int32)
    _position_items_kernel[(1,)](items, cu_seqlens, num_items, heads, len(lengths),
                                 BLOCK_M=block, HEADS=together, num_warps=1)  # fmt: skip
    blocks = [-(-n // block) for n in lengths]
    want = [(b, h, p * block)
            for first in range(0, heads, together)
            for p in reversed(range(max(blocks)))
            for b in range(len(lengths)) if blocks[b] > p
            for h in range(first, min(heads, first + together))]  # fmt: skip
    got = [tuple(row) for row in items.tolist()]
    # key tiles of 128 up to the block's last visible key (the sequence's end at most)
    assert got[:len(want)] == [(b, h, start, -(-min(lengths[b], start + block) // 128))
                               for b, h, start in want]
    assert got[len(want):] == [(0, 0, lengths[0], 0)] * (num_items - len(want))


@pytest.mark.parametrize("lengths", [(700, 5, 1300, 64), (0, 128, 129, 0, 1), (4000,),
                                     (1,) * 7, (127, 128, 129, 255, 256, 257),
                                     bench.DOC_LENGTHS])  # fmt: skip
@pytest.mark.parametrize("heads", [1, 3, 16])
@pytest.mark.parametrize("block", [96, 128])
@pytest.mark.parametrize("extra", [0, 300], ids=["exact", "tokens past cu_seqlens"])
def test_packed_head_ranks_cover_every_block_once(lengths, heads, block, extra):
    """The backward's packed grid (common.packed_items over the keys, packed_head_rank;
    packed_sequence done here in Python): every (sequence, kv head, key block) exactly
    once, each sequence's after the last one's, each head's blocks back to back first
    first; at most one item a (sequence, head) past its blocks, for 128-key blocks and
    192/128's 96. Where the packed tensor holds tokens past cu_seqlens's last, the
    last sequence's items past its heads' fall on its last head, past its blocks (no
    head past the heads: the forward's plain stores and the backward's sequence bounds
    take it as it comes)."""
    cu = [0, *itertools.accumulate(lengths)]
    walked, past = [], collections.Counter()
    for g in range(common.packed_items(len(lengths), cu[-1] + extra, heads, block)):
        b = sum(heads * (cu[i] // block + i) <= g for i in range(len(lengths))) - 1
        h, rank = hopper.packed_head_rank.fn(g, heads, b, cu[b], lengths[b], block)
        assert 0 <= h < heads and rank >= 0
        if rank * block < lengths[b]:
            walked.append((b, h, rank))
        else:
            past[b, h] += 1
    assert walked == [(b, h, n) for b, length in enumerate(lengths) for h in range(heads)
                      for n in range(-(-length // block))]
    # the last (sequence, head): its own item past its blocks (if any), then every item
    # the tokens past cu_seqlens's last add
    last, first = lengths[-1], cu[-2]
    own = (first + last) // block - first // block + 1 - -(-last // block)
    added = heads * ((cu[-1] + extra) // block - cu[-1] // block)
    assert past.pop((len(lengths) - 1, heads - 1), 0) == own + added
    assert max(past.values(), default=0) <= 1


@gluon.jit
def _packed_key_items_kernel(Items, CuSeq, num_items, H, num_seqs, num_n_blocks,
                             BLOCK_N: gl.constexpr):  # fmt: skip
    """Each program of the backward's packed grid: the item backward_sm90.shared._packed_key_item
    gives it (-1 past its sequence's blocks), in one warp."""
    for g in range(num_items):
        item = backward_sm90.shared._packed_key_item(g, H, CuSeq, num_seqs, num_n_blocks, BLOCK_N)
        gl.store(Items + g, item)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(700, 5, 1300, 64), (0, 128, 129, 0, 1), (1,) * 7,
                                     bench.DOC_LENGTHS, (300, 900) * 64])  # fmt: skip
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_packed_key_items_cover_every_block_once_gpu(lengths, heads):
    """The backward's packed grid on the GPU (_packed_key_item over common.packed_items)
    where the packed tensor holds 200 tokens past cu_seqlens's last (unchecked where its
    values go unread): every (sequence, kv head, key block) exactly once, sequence after
    sequence, each head's blocks back to back first first; every other program -1, the
    last sequence's items past its heads' too."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    block = 128
    cu = [0, *itertools.accumulate(lengths)]
    num_n = max(1, -(-max(lengths) // block))
    num_items = common.packed_items(len(lengths), cu[-1] + 200, heads, block)
    items = torch.full((num_items,), -7, device="cuda", dtype=torch.int32)
    cu_seqlens = torch.tensor(cu, device="cuda", dtype=torch.int32)
    _packed_key_items_kernel[(1,)](items, cu_seqlens, num_items, heads, len(lengths), num_n,
                                   BLOCK_N=block, num_warps=1)  # fmt: skip
    want = [(b * heads + h) * num_n + n for b in range(len(lengths)) for h in range(heads)
            for n in range(-(-lengths[b] // block))]  # fmt: skip
    got = items.tolist()
    assert [g for g in got if g >= 0] == want
    assert got.count(-1) == num_items - len(want)


@gluon.jit
def _packed_blocks_kernel(Items, CuSeq, num_items, H, num_seqs, BLOCK_M: gl.constexpr):
    """Each item's (b, h, start_m, key tiles) from hopper.packed_block without a mask in
    one warp (as the forward's load warp runs it), cu_seqlens the same for queries and
    keys."""
    field = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    for g in range(num_items):
        b, h, _, start_m, _, _, _, _, _, _, _, _, n_tiles = hopper.packed_block(
            g, H, 1, num_seqs, CuSeq, CuSeq, -1, -1, BLOCK_M, 128, False, False, False)
        values = (gl.where(field == 0, b, 0) + gl.where(field == 1, h, 0)
                  + gl.where(field == 2, start_m, 0) + gl.where(field == 3, n_tiles, 0))
        gl.store(Items + 4 * g + field, values, mask=field < 4)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(700, 5, 1300, 64), (0, 128, 129, 0, 1), (1,) * 7,
                                     bench.DOC_LENGTHS])  # fmt: skip
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_packed_blocks_cover_every_block_once_gpu(lengths, heads):
    """The forward's packed grid without a mask on the GPU (hopper.packed_block over
    common.packed_items) where the packed tensor holds 200 tokens past cu_seqlens's
    last (unchecked where its values go unread): every (sequence, head, query block)
    exactly once, sequence after sequence, each head's blocks back to back last first,
    with its key tiles; every other item past its sequence's end (no key tile) and
    with a head inside the heads, as O's and lse's plain stores there take it."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    block = 128
    cu = [0, *itertools.accumulate(lengths)]
    num_items = common.packed_items(len(lengths), cu[-1] + 200, heads, block)
    items = torch.full((num_items, 4), -7, device="cuda", dtype=torch.int32)
    cu_seqlens = torch.tensor(cu, device="cuda", dtype=torch.int32)
    _packed_blocks_kernel[(1,)](items, cu_seqlens, num_items, heads, len(lengths),
                                BLOCK_M=block, num_warps=1)  # fmt: skip
    want = [(b, h, m * block, -(-lengths[b] // 128)) for b in range(len(lengths))
            for h in range(heads) for m in reversed(range(-(-lengths[b] // block)))]
    got = [tuple(row) for row in items.tolist()]
    assert [row for row in got if row[3] > 0] == want
    past = [row for row in got if row[3] == 0]
    assert len(past) == num_items - len(want)
    assert all(0 <= h < heads and start_m == lengths[b] for b, h, start_m, _ in past)


def test_launcher_refuses_grids_of_more_dimensions(launcher):
    """Later launches pass the C launcher grid[0] alone: a 2-D grid would lose rows."""
    with pytest.raises(ValueError, match="1-D grid"):
        launcher((4, 2), torch.zeros(4), 3, 0.5, BLOCK=16, FLAG=True)


@pytest.mark.parametrize("scale", [0.125, 1.7])
@pytest.mark.parametrize("shape", [(3, 1, 1, 70), (1, 2, 1, 1500), (70,)],
                         ids=["B11K", "1H1K", "K"])
def test_bias_row_scores_is_what_the_kernels_start_from(shape, scale, monkeypatch):
    """The forward's key row (hopper.bias_row_scores), computed once per call: the bias
    divided by the scale in fp32, -inf kept, finite values clamped at -BIAS_ROW_FLOOR
    (so a row of finfo.min averages), over every (batch, head) row and key block."""
    def launch(grid, *args, **kwargs):  # Triton's own launch (the interpreter on CPU)
        hopper._bias_row_scores_kernel[grid](*args, **kwargs)

    monkeypatch.setattr(hopper, "_launch_bias_row_scores", launch)
    bias = torch.randn(shape).to(torch.bfloat16)
    flat = bias.view(-1)
    flat[::7] = float("-inf")
    flat[3::11] = torch.finfo(torch.bfloat16).min
    row = hopper.bias_row_scores(bias, scale)
    assert row.stride(-1) == 1 and all(s * 4 % 16 == 0 for s in row.stride()[:-1]), (
        "rows start 16-byte aligned: the forward loads them by TMA")
    b = bias.double().reshape(row.shape)
    floor = hopper.BIAS_ROW_FLOOR.value
    expected = torch.where(b == float("-inf"), b, (b / scale).clamp(min=-floor)).float()
    torch.testing.assert_close(row, expected, rtol=1e-6, atol=0)
    assert torch.isfinite(row[b > float("-inf")]).all()


@pytest.mark.parametrize("shape", [(3, 4, 1, 9), (3, 1, 1, 9), (1, 4, 1, 9), (4, 1, 9), (9,)],
                         ids=["BH1K", "B11K", "1H1K", "H1K", "K"])
def test_sum_to_bias_reduces_the_kernels_rows_to_the_bias(shape):
    """The Gluon backward leaves a key row bias's gradient as (B, H, Sk) fp32 sums over
    each head's queries; common.sum_to_bias sums them over what the bias broadcasts over
    and returns the bias's shape and dtype."""
    partial = torch.randn(3, 4, 9, dtype=torch.float32)
    bias = torch.zeros(shape, dtype=torch.bfloat16)
    padded = (1,) * (4 - len(shape)) + shape
    summed = [d for d in (0, 1) if padded[d] == 1]
    expected = partial.sum(dim=summed, keepdim=True) if summed else partial  # dim=[]: all
    got = common.sum_to_bias(partial.unsqueeze(2), bias)
    assert got.shape == bias.shape and got.dtype == bias.dtype
    torch.testing.assert_close(got, expected.reshape(shape).to(torch.bfloat16))


BIAS_GRAD_CALLS = {  # name: (lengths q, lengths k (None: packed, the same tensor), options)
    "dense causal": ((70,), (90,), dict(causal=True)),
    "dense causal bottom-right": ((70,), (90,), dict(causal=True, align="bottom_right")),
    "dense window": ((100,), (100,), dict(window=(9, 3))),
    "dense, no mask": ((40,), (150,), {}),
    "packed causal": ((70, 5, 129), None, dict(causal=True)),
    "packed causal bottom-right, other key lengths": ((70, 5, 129), (90, 33, 100),
                                                      dict(causal=True, align="bottom_right")),
    "packed window": ((70, 5, 129), None, dict(window=(20, 0))),
}  # fmt: skip


@pytest.mark.parametrize("padded", [False, True], ids=["rows as keys", "padded rows"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared bias", "a plane each"])
@pytest.mark.parametrize("name", list(BIAS_GRAD_CALLS))
def test_bias_grad_tiles_zero_convert_and_fill_what_no_query_sees(name, per_sequence, padded,
                                                                   monkeypatch):  # fmt: skip
    """backward_sm90.bias_grad_tiles, run through Triton (the interpreter on CPU): the
    fp32 buffer of a summed bias gradient is zeroed wherever a pair is seen, and its
    conversion leaves the adds there and zeros everywhere else; a full gradient gets
    zeros at every pair no query sees and nothing else is written. Seen: the reference's
    mask, each sequence's for a plane of its own, their union for a shared bias. Padded:
    the full gradient and the buffer over padded rows (as the Gluon backward makes them
    where Sk is not a multiple of 8: every call here), the conversion's output
    contiguous; the gradient's padding is never written (the buffer's may be zeroed)."""
    def launch(grid, *args, variant, **kwargs):
        backward_sm90._bias_grad_tiles_kernel[grid](*args, **kwargs)

    monkeypatch.setattr(backward_sm90, "_launch_bias_grad_tiles", launch)
    lens_q, lens_k, options = BIAS_GRAD_CALLS[name]
    packed = len(lens_q) > 1
    same = lens_k is None
    lens_k = lens_q if same else lens_k
    if packed:
        cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
        cu_k = cu_q if same else torch.tensor([0, *itertools.accumulate(lens_k)],
                                              dtype=torch.int32)  # fmt: skip
        q = torch.zeros(int(cu_q[-1]), 2, 16)
        k = torch.zeros(int(cu_k[-1]), 2, 16)
        varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                      max_seqlen_k=max(lens_k))
    else:  # a batch of two, one plane each or one shared: the same mask either way
        cu_q = cu_k = None
        q, k = torch.zeros(2, lens_q[0], 2, 16), torch.zeros(2, lens_k[0], 2, 16)
        varlen = {}
    spec = memattn.spec.check_call(q, k, k, **options, **varlen)
    sq, sk = spec.seqlen_q, spec.seqlen_k
    planes = spec.batch if per_sequence else 1
    seen = torch.zeros(planes, 2, sq, sk, dtype=torch.bool)
    for b in range(spec.batch):
        n_q, n_k = (lens_q[b], lens_k[b]) if packed else (sq, sk)
        mask = memattn.reference.visible_mask(spec, n_q, n_k, "cpu")
        if not per_sequence and packed and spec.bottom_right and not same:
            mask = torch.ones(n_q, n_k, dtype=torch.bool)  # diagonals differ: all count
        seen[b if per_sequence else 0, :, :n_q, :n_k] |= mask

    row = common.cdiv(sk, 8) * 8 if padded else sk
    assert row != sk or not padded, "a call here whose rows need no padding"
    buf_row = common.cdiv(sk, 16) * 16 if padded else sk
    full_rows = torch.full((planes, 2, sq, row), float("nan"), dtype=torch.bfloat16)
    full = full_rows[..., :sk]
    backward_sm90.bias_grad_tiles(backward_sm90.ZERO_UNSEEN, spec, None, full, cu_q, cu_k)
    assert torch.equal(full.isnan(), seen), "zeros exactly where no query sees"
    assert (full[~seen] == 0).all()

    buf = torch.full((planes, 2, sq, buf_row), float("nan"))[..., :sk]
    backward_sm90.bias_grad_tiles(backward_sm90.ZERO_SEEN, spec, buf, None, cu_q, cu_k)
    assert (buf[seen] == 0).all()
    assert full_rows[..., sk:].isnan().all(), "the gradient's padding written"
    adds = torch.randn(buf.shape)
    buf[seen] += adds[seen]
    out = torch.full(buf.shape, float("nan"), dtype=torch.bfloat16)
    backward_sm90.bias_grad_tiles(backward_sm90.CONVERT, spec, buf, out, cu_q, cu_k)
    # one rounding to bf16, one ulp at most (the interpreter truncates; the GPU rounds)
    torch.testing.assert_close(out.float(), torch.where(seen, adds, 0.0), rtol=2**-7, atol=0)
    assert (out[~seen] == 0).all()


SHARING_CASES = [(128, {}), (64, {}), (128, dict(causal=True)), (64, dict(window=(300, 0))),
                 (128, dict(causal=True, window=(700, 0)))]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, options", SHARING_CASES,
                         ids=[f"D{d}-{'-'.join(o) or 'full'}" for d, o in SHARING_CASES])
def test_sharing_sms_grids_give_the_persistent_programs_results_gpu(head_dim, options):
    """Inside memattn.sharing_sms the Gluon kernels launch a program per block where they
    run persistent programs outside it (here several blocks an SM): the forward's out and
    lse and the backward's dK and dV bit for bit those of the persistent programs (each
    block made by the same code in the same order), dQ (added up across programs in no
    fixed order) within a bf16 rounding of them."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q, k, v = (torch.randn(4, 2048, 8, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for _ in range(3))  # fmt: skip
    grad = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def call():
        out, lse = memattn.attention(q, k, v, return_lse=True, **options)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), grad))

    outside = call()
    with memattn.sharing_sms():
        inside = call()
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), inside, outside, strict=True):
        if name == "dq":
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
        else:
            assert torch.equal(got, want), name
