"""The custom ops: torch.library checks, fake tensors, torch.compile, CUDA graphs, and
the gradient through lse."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memattn
from memattn.check import FEATURE_CASES, FLOOR, Case, make_inputs, random_call, relative_error
from memattn.ops import _op_options
from memattn.spec import check_call

from .conftest import DEVICE, capture, cpu_only

OPCHECK_CASES = [
    Case("plain", seqlen_q=9, seqlen_k=11, dqk=16, dv=8),
    Case("everything", seqlen_q=9, seqlen_k=11, dqk=16, dv=8, bias="1HQK", alibi="H",
         options=dict(causal=True, align="bottom_right", window=(4, 0), softcap=2.0,
                      dropout_p=0.2)),
    Case("varlen", lengths_q=(3, 0, 6), lengths_k=(5, 2, 7), dqk=16, dv=16, bias="BHQK",
         options=dict(causal=True)),
    # inputs in other layouts: outputs and gradients come contiguous, as the fakes say
    Case("transposed", seqlen_q=9, seqlen_k=11, dqk=16, dv=8, bias="1HQK", layout="transposed"),
    Case("strided", seqlen_q=9, seqlen_k=11, dqk=16, dv=8, bias="B1Q1", layout="strided"),
    Case("varlen transposed", lengths_q=(3, 6), lengths_k=(5, 7), dqk=16, dv=16, bias="1HQ1",
         layout="transposed", options=dict(max_seqlen_q=8, max_seqlen_k=7)),
]


def op_args(case: Case, requires_grad: bool):
    x = make_inputs(case, torch.float32, DEVICE, seed=1)
    tensors = [x.q, x.k, x.v] + ([x.kwargs["bias"]] if "bias" in x.kwargs else [])
    for t in tensors:
        t.requires_grad_(requires_grad)
    spec = check_call(x.q, x.k, x.v, **x.kwargs)
    rng = memattn.dropout.new_rng_state(DEVICE) if spec.dropout_p > 0 else None
    return (x.q, x.k, x.v, x.kwargs.get("bias"), x.kwargs.get("alibi_slopes"),
            x.kwargs.get("cu_seqlens_q"), x.kwargs.get("cu_seqlens_k"), rng,
            *_op_options(spec))  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.name)
def test_opcheck_forward(case):
    """Schema and fake implementation. Autograd lives in ops._Attention, around the op
    (not registered on it), and is tested through memattn.attention."""
    torch.library.opcheck(torch.ops.memattn.forward.default, op_args(case, requires_grad=False),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@cpu_only
def test_op_spec_is_memoised_on_metadata_and_options():
    """The op's re-check is cached; a call differing in any option or tensor layout
    gets its own spec."""
    case = OPCHECK_CASES[0]
    args = op_args(case, requires_grad=False)
    first = memattn.ops._op_spec(*args[:7], *args[8:])
    assert memattn.ops._op_spec(*args[:7], *args[8:]) is first
    options = list(args[8:])
    options[4] = options[4] * 0.5  # scale
    other = memattn.ops._op_spec(*args[:7], *options)
    assert other is not first and other.scale == first.scale * 0.5
    q_t = args[0].transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert memattn.ops._op_spec(q_t, *args[1:7], *args[8:]) is not first


@cpu_only
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.name)
def test_opcheck_backward(case):
    """The backward op's schema and fake implementation: gradients' shapes, dtypes and
    strides as the kernels make them, every gradient asked for."""
    args = op_args(case, requires_grad=False)
    out, lse = torch.ops.memattn.forward(*args)
    q, k, v, bias, alibi, cu_q, cu_k, rng, *options = args
    needs = [True, True, True, bias is not None]
    torch.library.opcheck(
        torch.ops.memattn.backward.default,
        (torch.randn_like(out), torch.randn_like(lse), q, k, v, out, lse, bias, alibi, cu_q,
         cu_k, rng, *options, needs),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_fake_tensor_shapes_every_option(case):
    """The fake implementations give the real outputs' shapes and dtypes, every option."""
    x = make_inputs(case, torch.float16, DEVICE, seed=2)
    spec = check_call(x.q, x.k, x.v, **x.kwargs)
    rng = memattn.dropout.new_rng_state(DEVICE) if spec.dropout_p > 0 else None
    real = torch.ops.memattn.forward(x.q, x.k, x.v, x.kwargs.get("bias"),
                                     x.kwargs.get("alibi_slopes"), x.kwargs.get("cu_seqlens_q"),
                                     x.kwargs.get("cu_seqlens_k"), rng, *_op_options(spec))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_in = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                   for t in (x.q, x.k, x.v, x.kwargs.get("bias"), x.kwargs.get("alibi_slopes"),
                             x.kwargs.get("cu_seqlens_q"), x.kwargs.get("cu_seqlens_k"), rng)]
        fake = torch.ops.memattn.forward(*fake_in, *_op_options(spec))
    for r, f in zip(real, fake):
        assert r.shape == f.shape and r.dtype == f.dtype


def _count_op_calls(monkeypatch) -> list:
    """Counts calls into the custom ops' bodies (their shared spec re-check)."""
    calls = []
    real = memattn.ops._op_spec

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(memattn.ops, "_op_spec", counting)
    return calls


@cpu_only
def test_eager_calls_skip_the_dispatcher(monkeypatch):
    """Plain eager calls, forward and backward, run the op bodies directly."""
    calls = _count_op_calls(monkeypatch)
    x = make_inputs(OPCHECK_CASES[0], torch.float32, DEVICE, seed=3)
    q, k, v = (t.requires_grad_() for t in (x.q, x.k, x.v))
    out, lse, _ = memattn.ops.forward(q, k, v, causal=True)
    (out.sum() + lse.sum()).backward()
    memattn.ops.backward(torch.ones_like(out), q, k, v, out.detach(), lse.detach(), causal=True)
    assert calls == []


@cpu_only
def test_eager_forward_launches_before_the_function_records(monkeypatch):
    """An eager call's kernels run before _Attention records it, so that its
    bookkeeping overlaps them (PERFORMANCE.md); the Function is handed the outputs."""
    order = []
    real_run, real_forward = memattn.ops._run_forward, memattn.ops._Attention.forward

    def run(*args):
        order.append("kernels")
        return real_run(*args)

    def forward(ctx, *args):
        order.append("Function.forward")
        assert args[-1][-1] is not None  # (out, lse) already there
        return real_forward(ctx, *args)

    monkeypatch.setattr(memattn.ops, "_run_forward", run)
    monkeypatch.setattr(memattn.ops._Attention, "forward", staticmethod(forward))
    x = make_inputs(OPCHECK_CASES[0], torch.float32, DEVICE, seed=5)
    q = x.q.requires_grad_()
    out = memattn.attention(q, x.k, x.v, causal=True)
    assert order == ["kernels", "Function.forward"] and out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@cpu_only
def test_inference_calls_leave_the_function_out(monkeypatch):
    """A call autograd has nothing to record for (no input asks for a gradient, or grad
    mode off) returns the kernels' outputs without the Function, the same values as a
    call it records; forward-mode AD still reaches the Function, which says it has no
    jvp rather than dropping the tangents."""
    recorded = []
    real_forward = memattn.ops._Attention.forward

    def forward(ctx, *args):
        recorded.append(True)
        return real_forward(ctx, *args)

    monkeypatch.setattr(memattn.ops._Attention, "forward", staticmethod(forward))
    x = make_inputs(OPCHECK_CASES[0], torch.float32, DEVICE, seed=6)
    bare = memattn.attention(x.q, x.k, x.v, causal=True)
    with torch.no_grad():
        no_grad = memattn.attention(x.q.requires_grad_(), x.k, x.v, causal=True)
    assert recorded == [] and bare.grad_fn is None and no_grad.grad_fn is None
    recording = memattn.attention(x.q, x.k, x.v, causal=True)
    assert recorded == [True] and recording.grad_fn is not None
    torch.testing.assert_close(bare, recording.detach(), rtol=0, atol=0)
    torch.testing.assert_close(no_grad, bare, rtol=0, atol=0)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.q.detach(), torch.ones_like(x.q))
        with pytest.raises(NotImplementedError, match="jvp"):
            memattn.attention(dual, x.k, x.v, causal=True)


@cpu_only
def test_modes_go_through_the_ops_and_agree(monkeypatch):
    """Under a torch-function mode (here torch.device's) the call goes through the
    custom ops, which give the same result as the direct path, forward and backward."""
    x = make_inputs(OPCHECK_CASES[1], torch.float32, DEVICE, seed=4)
    results = []
    for through_ops in (False, True):
        calls = _count_op_calls(monkeypatch)
        q, k, v, bias = (t.detach().clone().requires_grad_() for t in
                         (x.q, x.k, x.v, x.kwargs["bias"]))  # fmt: skip
        kwargs = {**x.kwargs, "bias": bias, "rng_state": torch.tensor([7, 0])}
        with torch.device(DEVICE) if through_ops else contextlib.nullcontext():
            out, lse, _ = memattn.ops.forward(q, k, v, **kwargs)
            (out.square().sum() + lse.sum()).backward()
        results.append((out, lse, q.grad, k.grad, v.grad, bias.grad))
        assert len(calls) == (2 if through_ops else 0)  # the forward op, the backward op
    for direct, through_ops in zip(*results):
        torch.testing.assert_close(direct, through_ops, rtol=0, atol=0)


@cpu_only
def test_fake_tensor_mode_runs_the_fake_implementation():
    """memattn.attention under FakeTensorMode (as torch.export or meta-device model
    initialisation trace it) gives fake outputs of the right shapes, no kernel runs."""
    with FakeTensorMode():
        q = torch.randn(2, 9, 4, 16)
        k = torch.randn(2, 11, 2, 16)
        v = torch.randn(2, 11, 2, 8)
        out = memattn.attention(q, k, v, causal=True)
    assert out.shape == (2, 9, 4, 8) and out.dtype == torch.float32


class Block(torch.nn.Module):
    """A small attention block, as a model would call memattn."""

    def __init__(self, dim=32, heads=4, kv_heads=2, **options):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = torch.nn.Linear(heads * self.hd, dim)
        self.options = options

    def forward(self, x, **extra):
        *lead, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1)
        q = q.unflatten(-1, (self.heads, self.hd))
        k = k.unflatten(-1, (self.kv_heads, self.hd))
        v = v.unflatten(-1, (self.kv_heads, self.hd))
        out = memattn.attention(q, k, v, **self.options, **extra)
        return self.proj(out.flatten(-2))


@cpu_only
@pytest.mark.parametrize("options", [dict(causal=True), dict(window=(3, 2), softcap=5.0)],
                         ids=["causal", "window+softcap"])
def test_compile_fullgraph_cpu(options):
    """torch.compile(fullgraph=True) traces through memattn and matches eager, forward
    and backward (the CPU path: the custom op runs the interpreted kernels)."""
    torch.manual_seed(0)
    block = Block(**options)
    x = torch.randn(2, 13, 32, requires_grad=True)
    eager = block(x)
    (g_eager,) = torch.autograd.grad(eager.sum(), [x])
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (g,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, g_eager, atol=1e-5, rtol=1e-5)


@cpu_only
def test_compile_fullgraph_varlen_and_dropout_cpu():
    torch.manual_seed(0)
    block = Block(dropout_p=0.1, causal=True)
    x = torch.randn(20, 32, requires_grad=True)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    torch.manual_seed(1)
    a = compiled(x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    torch.manual_seed(1)
    b = compiled(x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=13, max_seqlen_k=13)
    assert torch.equal(a, b), "dropout under compile repeats after the same seed"


def _random_step(seed: int, gpu: bool):
    """A random call (check.random_call) as a training step: (call, fn, step), step(f)
    calling f(q, k, v, bias) in place of memattn.attention and returning out (and lse)
    and every gradient (into out and lse both where the call draws it), dropout's seed
    drawn after torch.manual_seed(seed) where ``reseed``. Deterministic on the GPU (dQ's
    adds are unordered otherwise); max_seqlen given to packed calls, as under
    torch.compile or a CUDA graph's capture, where cu_seqlens cannot be read."""
    call = random_call(seed, gpu)
    x = make_inputs(call.case, call.dtype, DEVICE, seed)
    kwargs = dict(x.kwargs, deterministic=True) if gpu else dict(x.kwargs)
    if call.case.varlen:
        kwargs.setdefault("max_seqlen_q", max(call.case.lengths_q))
        kwargs.setdefault("max_seqlen_k", max(call.case.lengths_k))
    bias = kwargs.pop("bias", None)
    inputs = {"dq": x.q, "dk": x.k, "dv": x.v}
    leaves = [t for name, t in inputs.items() if name[1:] not in call.frozen]
    leaves += [bias] * call.bias_grad
    for t in leaves:
        t.requires_grad_(True)
    grads = []  # made at the first step, outside any capture

    def fn(q, k, v, bias):
        return memattn.attention(q, k, v, bias=bias, **kwargs, return_lse=call.lse_grad)

    def step(f, reseed=True):
        if reseed:
            torch.manual_seed(seed)
        outs = f(x.q, x.k, x.v, bias)
        outs = outs if call.lse_grad else (outs,)
        if not grads:
            gen = torch.Generator().manual_seed(seed + 1)
            grads.extend(torch.randn(o.shape, generator=gen).to(o) for o in outs)
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves, grads))

    return call, fn, step


def _assert_same(call, eager, other, how: str):
    names = ["out", "lse"][: 1 + call.lse_grad] + [
        f"d{n}" for n in "qkv" if n not in call.frozen] + ["dbias"]  # fmt: skip
    for name, e, o in zip(names, eager, other):
        assert torch.equal(e, o), f"{call}: {name} {how} differs, {relative_error(o, e):.3g}"


def _compiled_as_eager(seed: int, gpu: bool):
    """A random call compiled whole against the same call eager, bit for bit: the same
    kernels through the ops' fake and autograd paths, AOTAutograd's tangents (a zero
    grad_lse for an unused lse) and, on the GPU, Inductor's handling of the custom ops
    (their outputs' strides checked against the fakes')."""
    call, fn, step = _random_step(seed, gpu)
    eager = step(fn)
    torch._dynamo.reset()
    # Inductor draws random numbers its own way unless told to fall back to eager's:
    # dropout's seed, drawn by torch.randint, would differ from the eager call's
    with torch._inductor.config.patch(fallback_random=True):
        compiled = step(torch.compile(fn, fullgraph=True,
                                      backend="inductor" if gpu else "aot_eager"))
    _assert_same(call, eager, compiled, "compiled")


@cpu_only
@pytest.mark.parametrize("seed", range(5))
def test_random_calls_compile_as_eager_cpu(seed):
    _compiled_as_eager(seed, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(10))  # a few: each compiles with Inductor
def test_random_calls_compile_as_eager_gpu(seed):
    _compiled_as_eager(seed, gpu=True)


@cpu_only
def test_gradient_through_lse():
    """lse is differentiable: d lse / d s = P, checked against float64 autograd."""
    x = make_inputs(Case("lse", bias="1HQK", options=dict(causal=True)), torch.float32, DEVICE)
    leaves = [x.q, x.k, x.v, x.kwargs["bias"]]
    for t in leaves:
        t.requires_grad_(True)
    out, lse = memattn.attention(x.q, x.k, x.v, **x.kwargs, return_lse=True)
    g_lse = torch.randn_like(lse)
    loss = (out * out).sum() + (torch.where(torch.isinf(lse), 0, lse) * g_lse).sum()
    grads = torch.autograd.grad(loss, leaves)
    l64 = [t.detach().double().requires_grad_(True) for t in leaves]
    kw = dict(x.kwargs, bias=l64[3])
    o64, lse64 = memattn.reference.attention(*l64[:3], **kw, return_lse=True)
    loss64 = (o64 * o64).sum() + (torch.where(torch.isinf(lse64), 0, lse64) * g_lse.double()).sum()
    for g, r in zip(grads, torch.autograd.grad(loss64, l64)):
        assert relative_error(g, r) < 1e-5


# ---------------------------------------------------------------- GPU


def _training_step(model, x, **kw):
    out = model(x, **kw)
    grads = torch.autograd.grad(out.float().square().mean(), [x, *model.parameters()])
    return out, grads


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_compile_modes_match_eager_gpu(mode):
    torch.manual_seed(0)
    block = Block(dim=256, heads=8, kv_heads=2, causal=True, softcap=20.0).cuda().bfloat16()
    x = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager, g_eager = _training_step(block, x)
    compiled = torch.compile(block, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records its CUDA graph on a later call
        out, grads = _training_step(compiled, x)
    assert relative_error(out, eager) < 1e-2
    for g, ge in zip(grads, g_eager):
        assert relative_error(g, ge) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(24))
def test_random_calls_captured_as_eager_gpu(seed):
    """A random call's whole step (forward and backward) captured in a CUDA graph: a
    replay after the same torch.manual_seed gives the eager step's outputs and
    gradients bit for bit (no host reads of device values, no allocation a replay
    loses)."""
    call, fn, step = _random_step(seed, gpu=True)
    eager = step(fn)
    graph, static = capture(lambda: step(fn, reseed=False))
    torch.manual_seed(seed)
    graph.replay()
    _assert_same(call, eager, static, "replayed")


@pytest.mark.gpu
def test_cuda_graph_replay_dropout_gpu():
    """Each replay draws a fresh mask, as eager calls do; the same torch.manual_seed
    before two replays gives the same masks."""
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    memattn.attention(q, k, v, dropout_p=0.3)  # compile the kernel outside the capture
    graph, static_out = capture(lambda: memattn.attention(q, k, v, dropout_p=0.3))
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        graph.replay()
        first = static_out.clone()
        graph.replay()
        outs.append((first, static_out.clone()))
    assert not torch.equal(outs[0][0], outs[0][1]), "two replays drew the same mask"
    for i in range(2):
        err = relative_error(outs[1][i], outs[0][i])
        assert err == 0.0, f"replay {i + 1} after the same seed differs by {err:.3g}"
    assert not torch.equal(outs[0][0], outs[2][0]), "another seed drew the same mask"
    # a replay equals the eager call after the same seed
    torch.manual_seed(7)
    graph.replay()
    torch.manual_seed(7)
    eager = memattn.attention(q, k, v, dropout_p=0.3)
    err = relative_error(static_out, eager)
    assert err == 0.0, f"a replay differs from the eager call after the same seed by {err:.3g}"


@pytest.mark.gpu
def test_cuda_graph_varlen_backward_gpu():
    """A whole training step with varlen inputs captured in a CUDA graph."""
    cu = torch.tensor([0, 100, 100, 357], dtype=torch.int32, device="cuda")
    q = torch.randn(357, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(357, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))

    def step():
        out = memattn.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                max_seqlen_q=257, max_seqlen_k=257)
        return torch.autograd.grad(out.float().sum(), [q, k, v])

    eager = step()
    graph, static = capture(step)
    graph.replay()
    for a, b in zip(static, eager):
        assert torch.equal(a, b)


@cpu_only
def test_one_tensor_as_q_k_and_v():
    """The same tensor as q, k and v: its gradient is the sum of the three, eager and
    under torch.compile (which rejects a Function given one tensor twice)."""
    x = make_inputs(Case("qkv", bias=None, kv_heads=4, dqk=24, dv=24, seqlen_q=19,
                         seqlen_k=19), torch.float32, DEVICE).q.requires_grad_(True)
    y = x.detach().clone().requires_grad_(True)
    out = memattn.attention(x, x, x, causal=True)
    (g,) = torch.autograd.grad(out.square().sum(), [x])
    q, k, v = (y.clone() for _ in range(3))
    ref = memattn.attention(q, k, v, causal=True)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), [y])
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    compiled = torch.compile(lambda t: memattn.attention(t, t, t, causal=True),
                             fullgraph=True, backend="aot_eager")
    (g_compiled,) = torch.autograd.grad(compiled(x).square().sum(), [x])
    torch.testing.assert_close(g_compiled, g_ref, rtol=1e-5, atol=1e-6)


def test_memoised_checks_still_reject_bad_options_after_a_good_call():
    """The Python entry points memoise check_call for dense calls: a call that passed
    must not let through the same call with an option of the wrong type or value."""
    from memattn import ops

    q = torch.randn(1, 8, 2, 16)
    ops.forward(q, q, q, causal=True, window=(4, 0), scale=1.0)
    with pytest.raises(TypeError, match="causal"):
        ops.forward(q, q, q, causal=1, window=(4, 0), scale=1.0)
    with pytest.raises(TypeError, match=r"window\[0\]"):
        ops.forward(q, q, q, causal=True, window=(True, 0), scale=1.0)
    with pytest.raises(ValueError, match="align"):
        ops.forward(q, q, q, causal=True, window=(4, 0), scale=1.0, align="top")
    with pytest.raises(TypeError, match="q, k and v must share a dtype"):
        ops.forward(q, q.half(), q, causal=True, window=(4, 0), scale=1.0)
    with pytest.raises(ValueError, match="same number of keys"):
        ops.forward(q, q, q[:, :4], causal=True, window=(4, 0), scale=1.0)


def test_the_suite_poisons_outputs():
    """new_output reads MEMATTN_POISON_OUTPUTS once, when memattn loads: conftest must
    set it first, or every 'no element left unwritten' check passes vacuously."""
    from memattn.kernels import common

    assert common.POISON_OUTPUTS
    assert torch.isnan(common.new_output((3,), torch.float32, "cpu")).all()


def _merge(parts):
    """Outputs of key blocks merged through their lse: the whole call's (out, lse)."""
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = sum(o * torch.exp(l - lse).transpose(1, 2).unsqueeze(-1) for o, l in parts)
    return out, lse


@cpu_only
@pytest.mark.parametrize("feature", ["alibi", "dropout", "alibi dropout GQA"])
def test_positions_make_blocks_of_the_whole_call(feature):
    """A call on a block of a sequence at its global positions (ops.forward/backward's
    positions) has the whole call's ALiBi distances and dropout mask: a block of query
    rows gives those rows of the whole output and of dQ, key blocks merged through their
    lse give the whole output, and their backwards with the whole call's out and lse
    give the whole dK and dV and, summed, dQ."""
    torch.manual_seed(0)
    heads, kv_heads = (4, 2) if "GQA" in feature else (2, 2)
    q = torch.randn(2, 40, heads, 16)
    k, v = (torch.randn(2, 40, kv_heads, 16) for _ in range(2))
    kw = {}
    if "alibi" in feature:
        kw["alibi_slopes"] = torch.rand(heads)
    if "dropout" in feature:
        kw.update(dropout_p=0.3, rng_state=memattn.dropout.new_rng_state("cpu"))
    close = dict(rtol=1e-4, atol=1e-5)
    out, lse, _ = memattn.ops.forward(q, k, v, **kw)
    grad = torch.zeros_like(out)
    grad[:, 13:29] = torch.randn(2, 16, heads, 16)
    dq, dk, dv, _ = memattn.ops.backward(grad, q, k, v, out, lse, **kw)

    rows = slice(13, 29)
    part, part_lse, _ = memattn.ops.forward(q[:, rows], k, v, positions=(13, 0), **kw)
    # the block against the float64 reference of the whole call, at its rows
    keep = None
    if "dropout_p" in kw:
        keep = memattn.dropout_mask(kw["rng_state"], kw["dropout_p"], 2, heads, 40, 40)
    ref_kw = {n: x for n, x in kw.items() if n != "rng_state"}
    exact = memattn.reference.attention(q.double(), k.double(), v.double(), **ref_kw,
                                        dropout_keep=keep)[:, rows]  # fmt: skip
    plain = memattn.reference.attention(q, k, v, **ref_kw, dropout_keep=keep)[:, rows]
    assert relative_error(part, exact) <= 2 * relative_error(plain, exact) + FLOOR[q.dtype]
    torch.testing.assert_close(part, out[:, rows], **close)
    torch.testing.assert_close(part_lse, lse[:, :, rows], **close)
    dq_r, dk_r, dv_r, _ = memattn.ops.backward(grad[:, rows], q[:, rows], k, v, part, part_lse,
                                               positions=(13, 0), **kw)  # fmt: skip
    for got, want in ((dq_r, dq[:, rows]), (dk_r, dk), (dv_r, dv)):
        torch.testing.assert_close(got, want, **close)

    blocks = [slice(0, 16), slice(16, 40)]
    parts = [memattn.ops.forward(q, k[:, b], v[:, b], positions=(0, b.start), **kw)[:2]
             for b in blocks]  # fmt: skip
    merged, merged_lse = _merge(parts)
    torch.testing.assert_close(merged, out, **close)
    torch.testing.assert_close(merged_lse, lse, **close)
    dq_sum = torch.zeros_like(dq)
    for b in blocks:
        dq_b, dk_b, dv_b, _ = memattn.ops.backward(grad, q, k[:, b], v[:, b], out, lse,
                                                   positions=(0, b.start), **kw)  # fmt: skip
        torch.testing.assert_close(dk_b, dk[:, b], **close)
        torch.testing.assert_close(dv_b, dv[:, b], **close)
        dq_sum += dq_b
    torch.testing.assert_close(dq_sum, dq, **close)


@pytest.mark.parametrize(
    "positions, options, error, match",
    [((1, True), {}, TypeError, "pair of ints"), ((3,), {}, TypeError, "pair of ints"),
     ((1.0, 0), {}, TypeError, "pair of ints"), ((-1, 0), {}, ValueError, ">= 0"),
     ((0, 12), dict(dropout_p=0.1), ValueError, "multiple of 8")],
)  # fmt: skip
def test_positions_are_checked(positions, options, error, match):
    q = torch.randn(1, 8, 2, 16, device=DEVICE)
    with pytest.raises(error, match=match):
        memattn.ops.forward(q, q, q, positions=positions, **options)


def test_positions_are_for_dense_calls():
    q = torch.randn(8, 2, 16, device=DEVICE)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="dense calls"):
        memattn.ops.forward(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, positions=(4, 0))
