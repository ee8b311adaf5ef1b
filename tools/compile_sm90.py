"""Compile every kernel variant the check cases launch, for sm_90, on a machine with no
GPU: Triton's own ptxas does the work; a stand-in driver supplies the target, and the
launches become compile-only. Catches what Triton's interpreter does not (compile-time
rules, layouts, register spills, wgmmas ptxas serialises) before any device time is
spent.

    python tools/compile_sm90.py [--all]    # one line per distinct kernel variant
                                            # (--all: every head dim and dtype, slow):
                                            # registers, spills, shared memory, global
                                            # loads / stores of one element (no .v2/.v4),
                                            # a digest of the code
    python tools/compile_sm90.py --pass backward [--variant NAME] [--masks none,causal]
        # one Gluon pass alone (MEMATTN_HOPPER_DIMS, MEMATTN_HOPPER_FEATURES: see
        # _compile_hopper), with tools/ab.py's knobs of that variant over the shipped ones:
        # the spills a knob saves or costs, before any device time is spent
    python tools/compile_sm90.py --pass forward --against REV [...]
        # the same variants from REV's tree too (a temporary git worktree), both trees
        # in processes of their own at once; exits 1 unless every line (registers,
        # spills, shared memory, code digest) is the same: a refactor's proof
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Sm90Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def __getattr__(self, name):
        from triton.backends.nvidia.driver import CudaDriver

        return getattr(CudaDriver, name)


H100_SHARED_BYTES = 232448  # the most dynamic shared memory one block may take (227 KiB)
compiled = {}
case = ""  # the call being compiled, printed beside each new variant
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    key = (self.fn.__name__, kernel.hash if kernel is not None else None)
    if key not in compiled and kernel is not None:
        compiled[key] = kernel
        print(report_line(self.fn.__name__, kernel) + f"  {case}", flush=True)  # runs are long
    return kernel


def report_line(name, kernel) -> str:
    over = kernel.metadata.shared > H100_SHARED_BYTES
    loads, stores = narrow_global_accesses(kernel.asm["ptx"])
    return (f"{name:28s} {ptxas_report(kernel)} shared={kernel.metadata.shared} "
            f"narrow_ld_st={loads}/{stores} code={code_digest(kernel)}"
            + ("  OVER the H100's shared memory" if over else ""))


_GLOBAL_ACCESS = re.compile(r"^\s*(?:@!?%\w+\s+)?(ld|st)\.global\.([\w.:]+)", re.M)


def narrow_global_accesses(ptx: str) -> tuple[int, int]:
    """Global loads and stores in the PTX that move one element each (no .v2 / .v4): a
    variant with many more than its sibling has lost its offsets' alignment (the
    packed preprocess zeroed dQ's buffer 4 bytes a store where a dense batch's stored
    16, for a batch term of 0 that Triton could not prove aligned)."""
    counts = {"ld": 0, "st": 0}
    for op, suffix in _GLOBAL_ACCESS.findall(ptx):
        if not re.search(r"(^|\.)v[24](\.|$)", suffix):
            counts[op] += 1
    return counts["ld"], counts["st"]


def code_digest(kernel) -> str:
    """A digest of the kernel's PTX without source locations and debug sections: equal
    before and after a change, the change left the machine code as it was (a refactor's
    proof, where no GPU is at hand)."""
    ptx = kernel.asm["ptx"].split("\t.section\t.debug")[0]
    code = "\n".join(line for line in ptx.splitlines()
                     if not line.lstrip().startswith((".loc", ".file", "$L__tmp", "$L__func")))
    return hashlib.sha1(code.encode()).hexdigest()[:10]


def ptxas_report(kernel) -> str:
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    path = f"/tmp/memattn_kernel.{os.getpid()}.ptx"  # a process's own: two may run at once
    with open(path, "w") as f:
        f.write(ptx)
    res = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", "/dev/null"],
                         capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores", res.stderr)
    # ptxas waits after every wgmma of the kernel where it cannot pipeline one (C7512:
    # registers; C7514: an accumulator or register operand touched while in flight)
    serialised = re.search(r"\((C75\d\d)\) Potential Performance Loss: wgmma", res.stderr)
    return (f"regs={regs.group(1) if regs else '?'} spill_stores={spill.group(1) if spill else '?'}"
            + (f" WGMMA SERIALISED ({serialised.group(1)})" if serialised else ""))


def _compile_through_run(self, grid, *args, **kwargs):
    """hopper.Launcher without its fast path: every call goes to JITFunction.run (made
    compile-only by main). The fast path wraps the compiled kernel's launcher, which the
    stand-in driver has none of."""
    kwargs.pop("variant", None)
    kwargs.pop("prepare", None)
    self.fn[grid](*args, **kwargs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="every head dim and dtype (slow)")
    ap.add_argument("--pass", dest="which", choices=("forward", "backward"),
                    help="that Gluon pass alone")
    ap.add_argument("--variant", help="tools/ab.py's knobs of that name (with --pass)")
    ap.add_argument("--masks", help=f"of {', '.join([*MASK_NAMES, *MORE_MASKS])}, "
                                    "comma-separated (with --pass; default: the first four)")
    ap.add_argument("--against", metavar="REV",
                    help="compile REV's tree too and compare the two trees' lines")
    args = ap.parse_args()
    if args.against:  # the same arguments for both trees, --against's own left out
        argv, rest = [], iter(sys.argv[1:])
        for a in rest:
            if a == "--against":
                next(rest)
            elif not a.startswith("--against="):
                argv.append(a)
        return compare_against(args.against, argv)
    driver.set_active(_Sm90Driver())
    JITFunction.run = _compile_only
    from memattn.kernels import hopper

    hopper.Launcher.__call__ = _compile_through_run
    os.environ.pop("MEMATTN_POISON_OUTPUTS", None)
    from memattn import check, ops

    ops.require_runnable = lambda device: None  # CPU tensors stand in for CUDA ones
    hopper.schedule_on_device = lambda plan, device_index: torch.tensor(plan.schedule,
                                                                        dtype=torch.int32)

    if args.which:
        return compile_one_pass(args.which, args.variant, args.masks)
    failures = 0
    quick = not args.all
    dims = (128,) if quick else (64, 128, 256)
    cases = [check.gpu_sized(c, tokens=256, head_dim=d) for c in check.FEATURE_CASES
             for d in dims]
    extra = [check.Case("Dqk 192 Dv 128", dqk=192, dv=128, options=dict(causal=True))]
    extra += [check.Case(f"D {d}{' bias' if b else ''}", dqk=d, dv=d, bias=b,
                         options=dict(causal=True))
              for d in (64, 128, 256) for b in (None, "BHQK", "11Q1")]
    runs = [f for f in check.RUNS]
    every_dtype = (torch.bfloat16, torch.float16, torch.float32)
    for case in cases + extra:
        quick_dtypes = (torch.bfloat16, torch.float32) if case in extra else (torch.bfloat16,)
        for dtype in quick_dtypes if quick else every_dtype:
            x = check.make_inputs(case, dtype, "cpu")
            try:
                for run in runs:
                    run_compile_only(run, x)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"FAIL {case.name} {dtype}: {type(e).__name__}: {str(e)[:2000]}")
    failures += compile_hopper_forward()
    failures += compile_hopper_backward()
    return summary(failures)


def compare_against(rev: str, argv: list[str]) -> int:
    """This tool with ``argv`` over REV's tree (a temporary git worktree) and over this
    one, in two processes at once; prints the lines that differ (variants compiled,
    registers, spills, shared memory, code digests) and returns 1 if any does."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = tempfile.mkdtemp(prefix="compile_sm90_")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", base, rev],
                   check=True)
    try:
        runs = [subprocess.Popen([sys.executable, __file__, *argv], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=tree))
                for tree in (base, root)]
        before, after = ([line for line in run.communicate()[0].splitlines()
                          if "kernel variants compiled" in line or " code=" in line]
                         for run in runs)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", base], check=False)
    changed = sorted(set(before) ^ set(after))
    for line in changed:
        print(("- " if line in before else "+ ") + line)
    print(f"{len(after) - 1} lines against {rev}'s {len(before) - 1}: "
          + ("identical" if not changed else f"{len(changed)} differ"))
    return 1 if changed or not after else 0


def summary(failures: int) -> int:
    """The closing line (kernels over the H100's shared memory count as failures) and
    the exit status."""
    failures += sum(k.metadata.shared > H100_SHARED_BYTES for k in compiled.values())
    print(f"{len(compiled)} kernel variants compiled, {failures} failures")
    return 1 if failures else 0


HOPPER_MASKS = ({}, dict(causal=True), dict(causal=True, align="bottom_right"),
                dict(window=(300, 7)))
MASK_NAMES = ("none", "causal", "bottom_right", "window")  # HOPPER_MASKS' in order
# --masks' options beyond those, named alone: deterministic calls (their own orders)
MORE_MASKS = {"deterministic": dict(deterministic=True),
              "deterministic_causal": dict(causal=True, deterministic=True)}


def compile_one_pass(which, variant, masks) -> int:
    """--pass: the Gluon forward's or backward's variants alone, with tools/ab.py's knobs
    of ``variant`` over the shipped ones, under the masks named (all if None)."""
    if variant is not None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import ab  # tools/ab.py: its knobs (imported here, after the stand-in driver)

        if variant not in ab.VARIANTS or ab.VARIANTS[variant] is None:
            print(f"--variant: one of tools/ab.py's Gluon variants, not {variant!r}")
            return 2
        ab.use(ab.VARIANTS[variant])
    names = MASK_NAMES if masks is None else masks.split(",")
    every = dict(zip(MASK_NAMES, HOPPER_MASKS), **MORE_MASKS)
    if unknown := set(names) - set(every):
        print(f"--masks: of {', '.join(every)}, not {', '.join(sorted(unknown))}")
        return 2
    chosen = tuple(every[name] for name in every if name in names)
    compile_pass = compile_hopper_forward if which == "forward" else compile_hopper_backward
    return summary(compile_pass(chosen))


def compile_hopper_forward(masks=HOPPER_MASKS) -> int:
    """The Gluon forward (kernels/forward_sm90.py), which the cases above never reach
    on CPU tensors: every head dim and mask variant it takes."""
    from memattn.kernels import dispatch, forward_sm90

    def launch(spec, q, k, v, bias, alibi, cu_seqlens=(None, None), dbias=True):
        spec = dispatch.kernel_spec(spec, "forward")  # other head dims as the next wider
        if not forward_sm90.takes_head_dims(spec, forward_sm90.hopper.bias_row(spec, bias)):
            return  # forward.py's call: shared memory does not hold the buffers
        lse = torch.empty(*spec.bias_shape[1:3]) if spec.varlen else torch.empty(
            *spec.bias_shape[:3])
        rng = torch.zeros(2, dtype=torch.int64) if spec.dropout_p > 0 else None
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
        forward_sm90.forward(spec, q, k, v, bias, alibi, rng, *cu_seqlens, out, lse)

    return _compile_hopper("forward_sm90", launch, masks)


def compile_hopper_backward(masks=HOPPER_MASKS) -> int:
    """The Gluon backward (kernels/backward_sm90/): every head dim and mask variant, by
    the pass as dispatch runs it (backward_sm90.run: the preprocess, the main kernels,
    dQ's conversion and a bias gradient's kernels, launched as on the device)."""
    from memattn.kernels import backward_sm90, dispatch

    def launch(spec, q, k, v, bias, alibi, cu_seqlens=(None, None), dbias=True):
        spec = dispatch.kernel_spec(spec, "backward")  # other head dims as the next wider
        dbias = dbias and bias is not None
        if not backward_sm90.takes_head_dims(spec) or not dispatch.gluon_backward_computes(
                spec, bias, dbias):
            return  # backward.py's call: other Dqk/Dv; D=256 with a bias...
        lse = (torch.empty(spec.heads, q.shape[0]) if spec.varlen
               else torch.empty(*spec.bias_shape[:3]))  # fmt: skip
        rng = torch.zeros(2, dtype=torch.int64) if spec.dropout_p > 0 else None
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # and dO: any values
        backward_sm90.run(spec, out, None, q, k, v, out, lse, bias, alibi, *cu_seqlens, rng,
                          (True, True, True, dbias))  # fmt: skip

    return _compile_hopper("backward_sm90", launch, masks)


def _compile_hopper(name, launch, masks) -> int:
    """Calls launch(spec, q, k, v, bias, alibi_slopes, cu_seqlens, dbias) for D 64, 128
    and 256 (and Dqk/Dv pairs: MEMATTN_HOPPER_DIMS=192/128,128/64), every mask of
    ``masks`` (HOPPER_MASKS' options), no bias, a full one, one broadcast over the batch
    (sumbias: its gradient summed), one plane for every batch and head (planebias: its
    gradient summed over both), a key-padding row (B, 1, 1, Sk), the full one and the
    row without their gradients (bias_read, rowbias_read: dbias False), dropout, ALiBi,
    softcap,
    packed sequences (varlen: 2100 and 704 tokens, cu_seqlens given; varlen_bias with a
    full bias, varlen_addbias with a plane per head the sequences share (its gradient
    added in bf16), varlen_sumbias with one plane for all, varlen_all with a key row,
    dropout and ALiBi), GQA 4:2, Sq=2100 (D=64's three warpgroups), Sk=704 (full_tiles:
    768, every key tile full: forward_sm90.FULL_TILES); softcap alone or before another
    ("softcap_bias"); returns the number of failures.
    MEMATTN_HOPPER_FEATURES=dropout (comma-separated from those names) and
    MEMATTN_HOPPER_DIMS=256 compile a subset."""
    from memattn.kernels import hopper
    from memattn.spec import check_call

    hopper.sm_count = lambda device_index: 132  # an H100's; no GPU here to ask
    features = os.environ.get("MEMATTN_HOPPER_FEATURES",
                              "none,bias,sumbias,planebias,rowbias,bias_read,rowbias_read,"
                              "dropout,alibi,softcap,varlen,varlen_bias,varlen_addbias,"
                              "varlen_sumbias,varlen_all,full_tiles").split(",")
    dims = [(int(d.split("/")[0]), int(d.split("/")[-1]))
            for d in os.environ.get("MEMATTN_HOPPER_DIMS", "64,128,256").split(",")]
    failures = 0
    for d, dv in dims:
        for options in masks:
            for feature in features:
                label = feature
                read = feature.endswith("_read")  # the bias without its gradient
                feature = feature.removesuffix("_read")
                capped = feature.startswith("softcap")  # softcap, alone or beside the rest
                feature = feature.removeprefix("softcap").removeprefix("_") or "none"
                q = torch.randn(2, 2100, 4, d, dtype=torch.bfloat16)
                keys = 768 if feature == "full_tiles" else 704
                k = torch.randn(2, keys, 2, d, dtype=torch.bfloat16)
                v = torch.randn(2, keys, 2, dv, dtype=torch.bfloat16)
                bias = None
                if feature in ("bias", "bias_dropout"):
                    bias = torch.randn(2, 4, 2100, 704, dtype=torch.bfloat16)
                elif feature == "sumbias":
                    bias = torch.randn(1, 4, 2100, 704, dtype=torch.bfloat16)
                elif feature == "planebias":
                    bias = torch.randn(1, 1, 2100, 704, dtype=torch.bfloat16)
                elif feature == "rowbias":
                    bias = torch.randn(2, 1, 1, 704, dtype=torch.bfloat16)
                elif feature in ("varlen_bias", "varlen_addbias", "varlen_sumbias"):
                    planes = {"varlen_bias": (2, 4), "varlen_addbias": (1, 4)}.get(feature, (1, 1))
                    bias = torch.randn(*planes, 1500, 504, dtype=torch.bfloat16)
                elif feature == "varlen_all":
                    bias = torch.randn(2, 1, 1, 504, dtype=torch.bfloat16)
                dropout_p = 0.1 if feature in ("dropout", "bias_dropout", "varlen_all") else 0.0
                alibi = torch.rand(4) if feature in ("alibi", "varlen_all") else None
                softcap = 30.0 if capped else 0.0
                varlen = {}
                if feature.startswith("varlen"):  # the same tokens as two packed sequences
                    q, k, v = q[:1].flatten(0, 1), k[:1].flatten(0, 1), v[:1].flatten(0, 1)
                    cu_q = torch.tensor([0, 1500, 2100], dtype=torch.int32)
                    cu_k = torch.tensor([0, 504, 704], dtype=torch.int32)
                    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1500,
                                  max_seqlen_k=504)
                global case
                case = f"D={d}/{dv} {options} {label}"
                try:
                    spec = check_call(q, k, v, bias=bias, dropout_p=dropout_p,
                                      alibi_slopes=alibi, softcap=softcap, **options,
                                      **varlen)  # fmt: skip
                    launch(spec, q, k, v, bias, alibi, (varlen.get("cu_seqlens_q"),
                                                        varlen.get("cu_seqlens_k")), not read)
                except Exception as e:  # noqa: BLE001
                    failures += 1
                    while e.__cause__ is not None:  # the innermost error says what failed
                        e = e.__cause__
                    print(f"FAIL {name} D={d}/{dv} {options} {label}: "
                          f"{type(e).__name__}: {str(e)[-3000:]}")
    return failures


def run_compile_only(run, x):
    """Calls the ops directly; outputs are garbage (nothing runs), only compiling counts."""
    from memattn import ops

    out, lse, rng_state = ops.forward(x.q, x.k, x.v, **x.kwargs)
    if run.__name__ == "check_backward":
        needs = (True, True, True, "bias" in x.kwargs)
        for deterministic in (False, True):
            kwargs = dict(x.kwargs, deterministic=deterministic)
            ops.backward(out, x.q, x.k, x.v, out, lse, **kwargs, rng_state=rng_state,
                         needs=needs)


if __name__ == "__main__":
    sys.exit(main())
