"""A/B kernel variants on the same inputs, on the device: the tile kernels ("tile"),
the Gluon kernels as shipped ("default", but at every size: "shipped_keys" runs the
tile backward where dispatch does), and Gluon knob settings (VARIANTS).
Per shape and variant: the relative error against the float64 reference (S <= 4096,
first batch), TFLOP/s as `memattn bench` times it (do_bench, autograd recording, host
included), TFLOP/s of the GPU alone (CUDA graph replay) and host µs per call in a loop;
--kernels adds, from torch.profiler over calls each after do_bench's L2 flush, the
median window from a flush's end to the next one's start (the call's GPU time, idle gaps
between its kernels included) and each kernel's median time. bf16, 16k tokens a shape
(B = 16384 / S, H = 2048 / Dqk): "DxS", "c" for causal, then "d" for deterministic,
"Dqk/DvxS" for another V (any head dims: "96x4096c" runs as 128, dispatch.kernel_spec),
"sN" for a softcap of N ("128x4096s30": the bench's
softcap row), "pP" after it for dropout of P ("256x4096cs30p0.1"; no error column: the
reference draws no mask), "wN" for a window of N keys ending at the query (the bench's window row:
"128x4096w1024"), "+BHQK"-style letters for a bias of that shape (1 where
it broadcasts; no gradient asked of it, but with ".grad": "+1HQK.grad"; the error
column then covers dQ, dK and dV only); the shapes "docs" and "docs-full" are the
bench's packed documents (causal and not, H=16, D=128), "docs/N" and "docs/N-full"
16384 tokens of documents N long, "docs/skew" one of 16384 tokens beside 255 of 64;
"docs+1HQK.grad" adds a bias the documents share, "docs@192/128" other head dims; a "d"
after the documents' part ("docs-fulld", "docs/512d") makes the call deterministic, as
after a dense shape, and
"pP" at its end adds dropout ("docsp0.1": the bench's documents with dropout); an "a"
at a dense shape's end (before a bias) adds ALiBi ("128x4096a": the bench's alibi row).
"decodeBqSQkSK" is a decode row of the bench (H32/8, D128, forward only, no autograd;
"decode8q16k32768": B8 Sq16 Sk32768), rated in GB/s of K and V read once;
"decode-skew8" and "decode-skew64" packed caches, one long beside short ones (SKEWED_DECODE).

--rounds N times the variants N times more, in turn, and prints each one's median;
--move-inputs (the forward) moves q, k, v and a bias to new addresses before each round
and prints every round's figures: whether a variant's speed follows where its tensors
lie (L2 slices and partitions are chosen by address).

    python tools/ab.py [--pass fwd|bwd] [--shapes 128x4096c,192/128x4096c,128x4096+1H1K,docs]
                       [--variants tile,default] [--rounds 5]

Revisions against each other (a regression's bisect): extract each one's tree beside
the working tree (git archive REV memattn tools | tar -x -C DIR, under an ignored
folder the device call carries), then in one device call run this script from each
tree in turn (cd DIR && PYTHONPATH=$PWD python tools/ab.py ...), the first tree again
at the end to show the machine did not drift.
"""

import argparse
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench, do_bench_cudagraph

import memattn
from memattn import bench, reference
from memattn.check import relative_error
from memattn.kernels import backward_sm90, decode, forward_sm90, hopper, tuning

# name -> knobs, "fwd.NAME" of forward_sm90, "bwd.NAME" of the backward_sm90 module that
# reads it (BACKWARD_KNOBS), "decode.NAME" of decode (over the shipped values); "tile"
# runs the tile kernels
VARIANTS = {
    "tile": None,
    "default": {},
    "rows128": {"fwd.BLOCK_M_D64": 128},  # two softmax warpgroups at D=64 too
    "fold_all": {"fwd.FOLD": True},  # two query blocks per program, masked or not
    "fold_none": {"fwd.FOLD": False},  # masked calls unfolded
    "one_q": {"fwd.MAX_Q_STAGES": 1},  # one Q buffer
    "grid": {"fwd.PERSISTENT": False},  # a program per query block (per pair under a mask)
    # masked forwards: a program per block, heads in groups of N blocks, rank by rank
    **{f"fwd_by_rank{n}": {"fwd.MASKED_BY_RANK_BLOCKS": dict.fromkeys((64, 128, 192, 256), n)}
       for n in (0, 128, 256, 512, 1024)},  # 0: folded strides, as before
    # ... at D 64/128 from N blocks a head, dealt by the host to persistent programs
    # (fwd.RANK_TABLE), or a program per block where the rank order is shipped
    **{f"fwd_table{n}": {"fwd.MASKED_BY_RANK_BLOCKS": {64: 256, 128: 256, 192: 0, 256: 256},
                         "fwd.MIN_BLOCKS_BY_RANK": {64: n, 128: n, 192: 0, 256: 96}}
       for n in (0, 8, 40)},
    "fwd_no_table": {"fwd.RANK_TABLE": False},
    # a program per block (memattn.sharing_sms' grids): under a mask rank by rank in
    # groups of N blocks (0: folded pairs, as sharing_sms has them at D=128)
    **{f"grid_by_rank{n}": {"fwd.PERSISTENT": False,
                            "fwd.MASKED_BY_RANK_BLOCKS": dict.fromkeys((64, 128, 192, 256), n)}
       for n in (0, 128, 1024)},
    # the mask's code in every step loop, or out of it wherever the keys fill the tiles
    "fwd_masked_code": {"fwd.FULL_TILES": dict.fromkeys((64, 128, 192, 256), False)},
    "fwd_full_tiles": {"fwd.FULL_TILES": dict.fromkeys((64, 128, 192, 256), True)},
    "dq_folded": {"bwd.DQ_MASKED_BY_RANK_BLOCKS": 0},  # the D=256 dQ kernel's pairs
    "dq_after": {"bwd.DQ_AS_DEPENDENT": False},  # ... launched after dK/dV's kernel ends
    "bwd_by_keys": {"bwd.BY_ROLE": False},  # D=256 dK/dV: warpgroups split by keys, columns
    "bwd_rows64": {"bwd.BLOCK_M_D64": 64},  # 64 query rows a backward step at D=64
    "summed_outer": {"bwd.SUMMED_BIAS_INNER": False},  # summed biases in the shipped order
    "dbias_fp32": {"bwd.PACKED_BIAS_ADDS": 0},  # packed sequences' shared bias: fp32 buffer
    "two_parts8k": {"fwd.MIN_SEQLEN_Q_D64_MASKED": 16384},  # D=64 masked S8192: 2 warpgroups
    # the backward's shipped MIN_KEYS_PER_QUERY (the tile kernels below it; elsewhere the
    # Gluon kernels run at every size)
    "shipped_keys": {"bwd.MIN_KEYS_PER_QUERY": backward_sm90.MIN_KEYS_PER_QUERY},
    "no_skip_empty": {"bwd.SKIP_EMPTY_KEY_BLOCKS": False},  # packed: blocks past the end run
    "dq_writer": {"bwd.DQ_WRITER": {64: True, 128: True}},  # dQ's adds from a warp of their own
    "no_packed_writer": {"bwd.DQ_WRITER_PACKED_UNMASKED": False},  # packed unmasked: no writer
    "no_dq_writer": {"bwd.DQ_WRITER": {64: False, 128: False},  # ... from the warpgroups
                     "bwd.DQ_WRITER_PACKED_UNMASKED": False},
    "no_ordered": {"bwd.ORDERED_DQ": False},  # deterministic calls on the tile kernels
    # an "ordered" bias gradient's turns counted 2 or 3 steps late
    **{f"sum_lag{n}": {"bwd.ORDERED_SUM_TURN_LAG": n} for n in (2, 3)},
    "sums_unspread": {"bwd.SPREAD_SUMS": False},  # B1QK ordered: the kv heads walk alike
    **{f"spread{n}": {"bwd.SPREAD_STEPS": n} for n in (0, 1, 3, 4)},  # 0: all the tiles
    # ... shared over the batch, masked: each batch's blocks N ranks after the one before's
    **{f"stagger{n}": {"bwd.ORDERED_BATCH_STAGGER": n} for n in (0, 2, 3)},
    "bwd_grid": {"bwd.PERSISTENT_BLOCKS": False},  # a backward program per key block
    "ordered_grid": {"bwd.ORDERED_DEALT": False},  # ... for ORDERED_DQ's calls, not dealt
    "ordered_unfolded": {"bwd.ORDERED_SUM_FOLD": False},  # ... an ordered bias sum's too
    # ... its other calls: a program per block, or persistent strides at every Dqk
    "sum_grid": {"bwd.ORDERED_SUM_PERSISTENT": {64: False, 128: False}},
    "sum_persistent": {"bwd.ORDERED_SUM_PERSISTENT": {64: True, 128: True}},
    "ordered_unrotated": {"bwd.ORDERED_ROTATE": False},  # unbounded: first first, dealt
    # ... with dQ's writer warp (a program then ends without waiting for its last adds)
    "grid_writer": {"bwd.PERSISTENT_BLOCKS": False, "bwd.DQ_WRITER": {64: True, 128: True}},
    # masked backwards folded at every length (shipped: a program per block past 64)
    "masked_folded_long": {"bwd.MASKED_PERSISTENT_MAX_BLOCKS": 1 << 30},
    # masked backwards: persistent programs, folded, or a program per block, the heads'
    # blocks rank by rank in groups of at least N blocks
    "masked_folded": {"bwd.MASKED_BY_RANK_BLOCKS": {64: 0, 128: 0}},
    **{f"by_rank{n}": {"bwd.MASKED_BY_RANK_BLOCKS": {64: 0, 128: n}}
       for n in (1, 16, 64, 128, 1024, 1 << 30)},
    "no_split": {"bwd.SPLIT_HEAD_DIM_PAIRS": ()},  # 192/128 on the tile kernels
    "rescale_always": {"fwd.RESCALE_THRESHOLD": 0.0},  # O rescaled at every tile
    "no_turns": {"fwd.TURNS_MAX_HEAD_DIM": 0},  # softmax warpgroups issue freely
    "dq32_at192": {"bwd.DQ_BLOCK_N": {256: 32, 192: 32}},  # 32-key tiles in 192's dQ kernel
    "wide192": {"bwd.FUSED_SPLIT": False},  # 192/128 on the wide kernels, dQ's apart
    "split_heads1": {"bwd.SPLIT_HEADS_TOGETHER": 1},  # 192/128: each head's blocks in turn
    "bias_batch_outer": {"fwd.BIAS_BATCH_INNER": False},  # 1HQK's forward head after head
    "scratch32": {"fwd.DROPOUT_SCRATCH": 32 * 1024},  # the forward's buffers beside dropout
    "bias_outer_nograd": {"bwd.BIAS_TILES_BATCH_INNER": False},  # its backward so too
    "block_ranges": {"fwd.OWN_KEY_RANGES": False},  # 192-row blocks' key ranges per block
    # packed sequences sharing a bias plane, masked: sequence by sequence, or by position
    # in groups of N heads
    "by_sequence": {"fwd.POSITION_HEADS": 0},
    "position2": {"fwd.POSITION_HEADS": 2},
    "position8": {"fwd.POSITION_HEADS": 8},
    "position16": {"fwd.POSITION_HEADS": 16},
    # a last block's warpgroup past the sequence does its work all the same
    "no_idle": {"fwd.IDLE_WARPGROUPS": False, "bwd.IDLE_HALVES": False},
    "no_pdl": {"decode.PDL": False},  # decode's kernels launched after the last one ends
    "bwd_serial": {"bwd.DEPENDENT_LAUNCHES": False},  # the backward's three launches so too
    "dq_convert_after": {"bwd.DQ_CONVERTED_BY_HEAD": False},  # dQ converted after the grid
    "dq_by_head_masked": {"bwd.MASKED_BY_HEAD": {64: True, 128: True}},  # ... by head, masked
    "short_by_rank": {"bwd.SHORT_CAUSAL_KEYS": 0},  # short causal D=128: rank by rank too
    # ... by head (shipped), N persistent conversion programs an SM
    **{f"convert{n}": {"bwd.DQ_CONVERSION_PROGRAMS_PER_SM": n} for n in (4, 16)},
    # decode's tile at 64 rows (block_m, block_n, warps, stages; shipped 64, 64, 4, 3):
    # the programs an SM holds and the splits follow from its shared memory
    "dec64x64w8s4": {"decode.WIDE_ROWS_TILE": tuning.Config(64, 64, 8, 4)},  # one an SM
    "dec64x64w4s2": {"decode.WIDE_ROWS_TILE": tuning.Config(64, 64, 4, 2)},
    "dec64x64w8s2": {"decode.WIDE_ROWS_TILE": tuning.Config(64, 64, 8, 2)},
    "dec64x32w4s3": {"decode.WIDE_ROWS_TILE": tuning.Config(64, 32, 4, 3)},
    "dec64x128w8s2": {"decode.WIDE_ROWS_TILE": tuning.Config(64, 128, 8, 2)},
    # ... and below 64 rows (keys, warps, stages; shipped 128, 4, 3: one program an SM)
    **{f"few{n}w{w}s{s}": {"decode.FEW_ROWS_TILE": (n, w, s)}
       for n, w, s in ((64, 4, 3), (64, 4, 2), (32, 4, 3), (128, 4, 2), (64, 4, 4), (128, 8, 3))},
    # the D 64/128 backward's K and V views made in each step: every call, or none
    "kv_views_always": {"bwd.KV_VIEWS_PER_STEP": True},
    "kv_views_never": {"bwd.KV_VIEWS_PER_STEP": False},
    "split_views_once": {"bwd.SPLIT_VIEWS_PER_STEP": False},  # 192/128's views once a block
}
FORWARD_KNOBS = ("FOLD", "OWN_KEY_RANGES", "BLOCK_M_D64", "PERSISTENT", "MAX_Q_STAGES",
                 "RESCALE_THRESHOLD", "TURNS_MAX_HEAD_DIM", "MIN_SEQLEN_Q_D64_MASKED",
                 "BIAS_BATCH_INNER", "POSITION_HEADS", "DROPOUT_SCRATCH", "IDLE_WARPGROUPS",
                 "MASKED_BY_RANK_BLOCKS", "MIN_BLOCKS_BY_RANK", "RANK_TABLE", "FULL_TILES")
# "bwd.NAME": the backward module whose code reads the knob
BACKWARD_KNOBS = {name: module for module, names in (
    (backward_sm90.narrow, ("BLOCK_M_D64", "SUMMED_BIAS_INNER", "SKIP_EMPTY_KEY_BLOCKS",
                            "DQ_WRITER", "DQ_WRITER_PACKED_UNMASKED", "ORDERED_DQ",
                            "PERSISTENT_BLOCKS", "MASKED_BY_RANK_BLOCKS", "BIAS_TILES_BATCH_INNER",
                            "MASKED_PERSISTENT_MAX_BLOCKS", "KV_VIEWS_PER_STEP", "IDLE_HALVES",
                            "ORDERED_SUM_TURN_LAG", "SPREAD_SUMS", "SPREAD_STEPS",
                            "ORDERED_BATCH_STAGGER", "ORDERED_DEALT",
                            "ORDERED_SUM_FOLD", "ORDERED_ROTATE",
                            "ORDERED_SUM_PERSISTENT")),
    (backward_sm90.shared, ("PACKED_BIAS_ADDS", "SPLIT_HEAD_DIM_PAIRS", "FUSED_SPLIT",
                            "DEPENDENT_LAUNCHES", "DQ_CONVERTED_BY_HEAD", "MASKED_BY_HEAD",
                            "DQ_CONVERSION_PROGRAMS_PER_SM", "SHORT_CAUSAL_KEYS")),
    (backward_sm90.wide, ("DQ_BLOCK_N", "DQ_MASKED_BY_RANK_BLOCKS", "DQ_AS_DEPENDENT",
                          "BY_ROLE")),
    (backward_sm90.split, ("SPLIT_HEADS_TOGETHER", "SPLIT_VIEWS_PER_STEP")),
    (backward_sm90, ("MIN_KEYS_PER_QUERY",))) for name in names}  # fmt: skip


def knob_module(key: str):
    """The module a knob's key ("fwd.NAME", "bwd.NAME", "decode.NAME") is set on."""
    prefix, name = key.split(".")
    return {"fwd": forward_sm90, "decode": decode}.get(prefix) or BACKWARD_KNOBS[name]


DEFAULTS = {**{f"fwd.{name}": getattr(forward_sm90, name) for name in FORWARD_KNOBS},
            **{f"bwd.{name}": getattr(module, name) for name, module in BACKWARD_KNOBS.items()},
            "decode.PDL": decode.PDL, "decode.WIDE_ROWS_TILE": decode.WIDE_ROWS_TILE,
            "decode.FEW_ROWS_TILE": decode.FEW_ROWS_TILE}
# A/B the kernels themselves, at every size
DEFAULTS["bwd.MIN_KEYS_PER_QUERY"] = dict.fromkeys(backward_sm90.HEAD_DIMS, 0)


def use(knobs) -> None:
    """Gluon with these knobs over the shipped ones, or the tile kernels (None)."""
    hopper.enabled = knobs is not None
    for key, value in {**DEFAULTS, **(knobs or {})}.items():
        setattr(knob_module(key), key.split(".")[1], value)
    hopper.forget_plans()  # plans are made from the knobs


# Packed batches of one long sequence beside short ones: "docs/skew" (H16, D128) and
# "decode-skew8", "decode-skew64" (Sq=1 a sequence, H32/8, D128)
SKEWED_DOCS = (16384,) + (64,) * 255
SKEWED_DECODE = {"decode-skew8": (131072,) + (4096,) * 7,
                 "decode-skew64": (65536,) + (1024,) * 63}


def inputs(shape: str, device: str = "cuda"):
    """(q, k, v, grad_out, options, flops of the forward) for "Dqk[/Dv]xS[c][+BIAS]" or
    "docs[/N][-full]"; for "decodeBqSQkSK" (q, k, v, None, {}, bytes of K and V) (see the
    module's docstring)."""
    new = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    if shape in SKEWED_DECODE:  # packed caches of different lengths, one query each
        lengths = SKEWED_DECODE[shape]
        cu_k = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
        k, v = new(sum(lengths), 8, 128), new(sum(lengths), 8, 128)
        kw = dict(cu_seqlens_q=torch.arange(len(lengths) + 1, device=device, dtype=torch.int32),
                  cu_seqlens_k=cu_k, max_seqlen_q=1, max_seqlen_k=max(lengths))
        return new(len(lengths), 32, 128), k, v, None, kw, 2 * k.numel() * k.element_size()
    if shape.startswith("decode"):  # the bench's decode rows: bytes of K and V, not flops
        b, rest = shape.removeprefix("decode").split("q")
        sq, sk = (int(x) for x in rest.split("k"))
        k, v = new(int(b), sk, 8, 128), new(int(b), sk, 8, 128)
        return new(int(b), sq, 32, 128), k, v, None, {}, 2 * k.numel() * k.element_size()
    if shape.startswith("docs"):
        shape, _, bias = shape.partition("+")
        shape, _, dropout = shape.partition("p")
        shape, _, dims = shape.partition("@")
        d, dv = (int(x) for x in ((dims or "128").split("/") * 2)[:2])
        deterministic = shape.endswith("d")
        shape = shape.removesuffix("d")
        causal = not shape.endswith("-full")
        size = shape.removesuffix("-full").partition("/")[2]
        lengths = (SKEWED_DOCS if size == "skew" else (int(size),) * (16384 // int(size))
                   if size else bench.DOC_LENGTHS)  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)  # fmt: skip
        q, k = new(sum(lengths), 16, d), new(sum(lengths), 16, d)
        v, do = new(sum(lengths), 16, dv), new(sum(lengths), 16, dv)
        kw = dict(causal=causal, deterministic=deterministic, cu_seqlens_q=cu, cu_seqlens_k=cu,
                  max_seqlen_q=max(lengths), max_seqlen_k=max(lengths),
                  dropout_p=float(dropout or 0))  # fmt: skip
        if bias:  # shared by the documents, indexed by positions in each
            kw["bias"] = _bias(bias, new, B=len(lengths), H=16, Q=max(lengths), K=max(lengths))
        pairs = (n * (n + 1) / 2 if causal else n * n for n in lengths)
        return q, k, v, do, kw, sum(2 * 16 * (d + dv) * p for p in pairs)
    shape, _, bias = shape.partition("+")
    shape, alibi, _ = shape.partition("a")
    shape, _, window = shape.partition("w")
    shape, _, dropout = shape.partition("p")
    shape, _, softcap = shape.partition("s")
    deterministic = shape.endswith("d")
    shape = shape.removesuffix("d")
    causal = shape.endswith("c")
    dims, s = shape.rstrip("c").split("x")
    d, dv = (int(x) for x in (dims.split("/") * 2)[:2])
    s = int(s)
    b, h = max(1, 16384 // s), 2048 // d
    q, k = new(b, s, h, d), new(b, s, h, d)
    v, do = new(b, s, h, dv), new(b, s, h, dv)
    kw = dict(causal=causal, deterministic=deterministic, softcap=float(softcap or 0),
              dropout_p=float(dropout or 0))
    pairs = s * s / (2 if causal else 1)
    if window:  # the bench's window row: each query sees itself and the N - 1 keys before
        kw.update(causal=True, window=(int(window) - 1, 0))
        pairs = bench.visible_pairs(s, True, kw["window"])
    if bias:
        kw["bias"] = _bias(bias, new, B=b, H=h, Q=s, K=s)
    if alibi:  # the bench's slopes, one a head
        kw["alibi_slopes"] = bench.alibi_slopes(h).to(device)
    return q, k, v, do, kw, 2 * b * h * pairs * (d + dv)


def _bias(spec: str, new, **sizes):
    """A bias of "BHQK"-style letters (1 where it broadcasts), ".grad": with its gradient."""
    letters, _, grad = spec.partition(".")
    return new(*(sizes.get(c, 1) for c in letters)).requires_grad_(grad == "grad")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--shapes", default="64x1024,64x4096c,128x1024,128x4096c,256x4096c,docs")
    ap.add_argument("--variants", default="tile,default")
    ap.add_argument("--kernels", action="store_true",
                    help="the call's window and each kernel's time (profiler, flushed calls)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the variants this many times each, in turn (the bench's "
                         "round_order), and print the median with the range: a device's clock "
                         "drifts within a call, so a single pass favours whichever runs first")
    ap.add_argument("--move-inputs", action="store_true",
                    help="with --rounds, the forward: q, k, v and a bias at new addresses "
                         "each round (moved()), every round's figures printed")
    args = ap.parse_args()
    names = args.variants.split(",")
    is_bwd = args.which == "bwd"
    if args.move_inputs and (is_bwd or args.rounds < 2):
        raise SystemExit("--move-inputs: the forward, with --rounds 2 or more (a backward's "
                         "recorded graph keeps the tensors it saved where they were)")
    torch.manual_seed(0)
    print(f"{args.which}: {'shape':12s} {'variant':10s} {'error':>26s} {'bench':>6s} "
          f"{'GPU':>6s} {'host us':>8s}  (TFLOP/s; GB/s for decode)")
    for shape in args.shapes.split(","):
        q, k, v, do, kw, flops = inputs(shape)
        decoding = do is None  # "flops" are K's and V's bytes: x 1e3 makes the TFLOP/s
        if decoding and is_bwd:  # columns (flops / ms / 1e9) GB/s (bytes / ms / 1e6)
            raise SystemExit(f"{shape}: decode rows time the forward only")
        flops *= 2.5 if is_bwd else (1e3 if decoding else 1)
        leaves = [t.requires_grad_(not decoding) for t in (q, k, v)]
        if "bias" in kw and kw["bias"].requires_grad:
            leaves.append(kw["bias"])
        expect = None
        if "cu_seqlens_q" not in kw and not kw.get("dropout_p") and (q.shape[1] <= 4096
                                                                     or decoding):
            first = [t[:1].detach().double().requires_grad_() for t in (q, k, v)]
            first_kw = dict(kw)
            if "bias" in kw:  # the first batch's
                first_kw["bias"] = kw["bias"][:1].detach().double()
            expect = reference.attention(*first, **first_kw)
            if is_bwd:
                expect = torch.autograd.grad(expect, first, do[:1].double())
        calls = {}
        for name in names:
            use(VARIANTS[name])
            if is_bwd:  # the backward alone, through one recorded graph, as the bench
                # times it (bench.measure: out.backward, the gradients set to None first)
                out = memattn.attention(*leaves[:3], **kw)

                def call(out=out):
                    for x in leaves:
                        x.grad = None
                    out.backward(do, retain_graph=True)
                    return tuple(x.grad for x in leaves)
            else:
                call = lambda: memattn.attention(*leaves[:3], **kw)  # noqa: E731
            calls[name] = call
            result = call()
            error = "-"
            if expect is not None:
                got = result if is_bwd else (result,)
                want = expect if is_bwd else (expect,)
                error = " ".join(f"{relative_error(x[:1], r):.1e}" for x, r in zip(got, want))
            bench_ms = do_bench(call)
            gpu = f"{'-':>6s}"  # the backward's autograd graph is not captured: it
            if not is_bwd:  # leaves torch's generator unusable for the next inputs
                gpu = f"{flops / do_bench_cudagraph(call) / 1e9:6.0f}"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(30):
                call()
            host_us = (time.perf_counter() - t0) / 30 * 1e6
            torch.cuda.synchronize()
            print(f"{args.which}: {shape:12s} {name:10s} {error:>26s} "
                  f"{flops / bench_ms / 1e9:6.0f} {gpu} {host_us:8.0f}",
                  flush=True)  # fmt: skip
            if args.kernels:
                window, kernels = profiled_window(call)
                busy = sum(us for _, us in kernels)
                print(f"{args.which}: {shape:12s} {name:10s} window {window:.1f} us = "
                      + " + ".join(f"{kernel[:40]} {us:.1f}" for kernel, us in kernels)
                      + f" + idle {window - busy:.1f} (< 0: kernels overlapping)", flush=True)
        if args.rounds > 1:
            movable = leaves[:3] + ([kw["bias"]] if "bias" in kw else [])
            _rounds(args, shape, names, calls, flops, movable if args.move_inputs else [])
        use({})


def moved(tensors, pad_bytes: int) -> list[torch.Tensor]:
    """Moves each tensor's data to a new allocation, after a pad of ``pad_bytes`` (the
    caching allocator then hands out other addresses): same values, same tensor objects
    (the calls' closures keep them), ``requires_grad`` kept. Returns the pads, to keep
    alive while the new addresses are wanted."""
    pads = []
    for t in tensors:
        pads.append(torch.empty(pad_bytes, dtype=torch.uint8, device=t.device))
        t.data = t.data.clone()
    return pads


FLUSH_MARKER = "FillFunctor<unsigned char>"  # profiled_window's flush, by its kernel's name


def profiled_window(call, calls: int = 20) -> tuple[float, list[tuple[str, float]]]:
    """call's GPU time as do_bench sees it, from torch.profiler over ``calls`` calls each
    after an L2 flush of do_bench's size (bytes zeroed: a kernel of a name no call
    launches): kernel_windows of the events."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls + 1):
            flush.zero_()
            call()
        flush.zero_()
        torch.cuda.synchronize()
    return kernel_windows([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA])  # fmt: skip


def kernel_windows(events) -> tuple[float, list[tuple[str, float]]]:
    """From GPU events (start µs, end µs, name) of calls each after a flush (a kernel
    named with FLUSH_MARKER): the median window from a flush's end to the next flush's
    start, and each of the call's kernels' median time, in launch order. The first
    call, after the profiler starts, is left out."""
    events = sorted(events)
    flushes = [i for i, (_, _, name) in enumerate(events) if FLUSH_MARKER in name]
    windows, kernels = [], {}
    for a, b in zip(flushes[1:], flushes[2:]):
        windows.append(events[b][0] - events[a][1])
        for j, (start, end, name) in enumerate(events[a + 1:b]):
            kernels.setdefault((j, name), []).append(end - start)
    if not windows:
        raise ValueError("kernel_windows: fewer than three flushes among the events")
    return (statistics.median(windows),
            [(name, statistics.median(times)) for (_, name), times in sorted(kernels.items())])


def _rounds(args, shape, names, calls, flops, movable) -> None:
    """Each variant timed args.rounds times, in turn, as the bench times a row: after
    SETTLE_S of the first variant's work (the board's power control runs the clock high
    after an idle spell), over TIMING_REP_MS, in round_order's balanced orders. With
    ``movable`` tensors, each round after the first moves them (moved(): pads of 1-64
    MiB in 4 KiB steps, from a fixed seed) and prints its figures."""
    speeds = {name: [] for name in names}
    use(VARIANTS[names[0]])
    bench.keep_busy(calls[names[0]], [], bench.SETTLE_S, backward=False)  # calls[] is a pass
    pick = random.Random(0)
    for r in range(args.rounds):
        if movable and r:  # the pads live until the next round's
            pads = moved(movable, 4096 * pick.randint(256, 16384))  # noqa: F841
        for name in bench.round_order(names, r):
            use(VARIANTS[name])
            speeds[name].append(flops / do_bench(calls[name], rep=bench.TIMING_REP_MS) / 1e9)
        if movable:
            print(f"{args.which}: {shape:12s} round {r}: "
                  + " ".join(f"{name} {speeds[name][-1]:.0f}" for name in names), flush=True)
    for name in names:
        runs = sorted(speeds[name])
        print(f"{args.which}: {shape:12s} {name:10s} median of {args.rounds}: "
              f"{statistics.median(runs):6.0f} ({runs[0]:.0f}-{runs[-1]:.0f})", flush=True)


if __name__ == "__main__":
    main()
