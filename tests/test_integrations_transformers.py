"""attn_implementation="memattn" in Hugging Face transformers against transformers' "sdpa".

CPU (CI): a tiny randomly initialised Llama (GQA: 4 query heads, 2 kv heads), float32,
kernels in Triton's interpreter; no downloads. GPU (`pytest -m gpu`): bfloat16.
"""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import memattn.integrations.transformers as mt  # noqa: E402  (registers "memattn")
from memattn.check import relative_error  # noqa: E402
from memattn.kernels.common import TILE_BIAS_ALIGNMENT, rows_aligned  # noqa: E402

from .conftest import cpu_only  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def make_pair(device="cpu", dtype=torch.float32, **sizes):
    """The same random weights under "sdpa" and under "memattn", in eval mode."""
    config = LlamaConfig(**{**TINY, **sizes})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = LlamaForCausalLM(config).to(device, dtype).eval()
    config = LlamaConfig(**{**TINY, **sizes})
    config._attn_implementation = "memattn"
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    model.load_state_dict(ref.state_dict())
    assert model.config._attn_implementation == "memattn"
    assert ref.config._attn_implementation == "sdpa"
    return ref, model


def inputs(batch=2, seqlen=11, padded=True, device="cpu", vocab=TINY["vocab_size"]):
    """Token ids and a 2-D attention mask; row 1 left-padded by 4 when padded."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, seqlen), generator=gen)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    if padded:
        mask[1, :4] = 0
        ids[1, :4] = 0
    return ids.to(device), mask.to(device)


@pytest.fixture
def spy(monkeypatch):
    """Records every memattn.attention call the integration makes (kwargs, bias shape)."""
    calls = []
    real = mt.attention

    def attention(q, k, v, **kwargs):
        bias = kwargs.get("bias")
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape),
                          bias=None if bias is None else tuple(bias.shape),
                          **{n: x for n, x in kwargs.items() if n != "bias"}))  # fmt: skip
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(mt, "attention", attention)
    return calls


# ---------------------------------------------------------------- registration


def test_register_is_idempotent_and_wires_both_interfaces():
    mt.register()
    mt.register()
    assert ALL_ATTENTION_FUNCTIONS["memattn"] is mt.memattn_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["memattn"] is sdpa_mask
    assert "memattn" in ALL_ATTENTION_FUNCTIONS.valid_keys()


def test_memattn_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import memattn, memattn.integrations\n"
            "try:\n    import memattn.integrations.transformers\nexcept ImportError: pass\n"
            "else: raise SystemExit('imported without transformers')\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- the function itself


class Attn(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = 2


def qkv(batch=2, heads=4, kv_heads=2, q_len=5, kv_len=5, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    return q, k, v


def bool_mask(batch, q_len, kv_len, seed=2, hidden_row=None):
    """Random True = attend; every row sees key 0 except hidden_row, which sees nothing."""
    mask = torch.rand(batch, 1, q_len, kv_len, generator=torch.Generator().manual_seed(seed)) > 0.3
    mask[..., 0] = True
    if hidden_row is not None:
        mask[..., hidden_row, :] = False
    return mask


def eager_mask(mask):
    return torch.where(mask, 0.0, torch.finfo(torch.float32).min)


# (name, q_len, kv_len, mask maker, module causal): each as sdpa_attention_forward takes it
FUNCTION_CASES = [
    ("causal, no mask", 7, 7, None, True),
    ("prefill into a static cache: L < S, no mask", 5, 9, None, True),
    ("decode: L = 1, no mask", 1, 9, None, True),
    ("non-causal module, no mask", 5, 9, None, False),
    ("bool mask", 5, 9, lambda: bool_mask(2, 5, 9), True),
    ("bool mask, broadcast batch", 5, 9, lambda: bool_mask(1, 5, 9).expand(2, 1, 5, 9), True),
    ("bool mask, a row with no visible key: 0", 5, 9, lambda: bool_mask(2, 5, 9, hidden_row=2),
     True),
    ("float additive mask", 5, 9, lambda: bool_mask(2, 5, 9) + torch.randn(2, 1, 5, 9), True),
    ("eager-style finfo.min mask, a fully masked row: the mean", 5, 9,
     lambda: eager_mask(bool_mask(2, 5, 9, hidden_row=2)), True),
    ("sdpa_mask, left padding", 6, 6,
     lambda: sdpa_mask(2, 6, 6, attention_mask=torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]]).bool()),
     True),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", FUNCTION_CASES, ids=lambda c: c[0])
def test_function_matches_sdpa_forward(case):
    _, q_len, kv_len, make_mask, causal = case
    q, k, v = qkv(q_len=q_len, kv_len=kv_len)
    mask = make_mask() if make_mask else None
    module = Attn(causal)
    out, weights = mt.memattn_attention_forward(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (2, q_len, 4, 16)
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("kv_len", [9, 16, 33])
def test_boolean_masks_become_biases_read_without_a_copy(kv_len):
    """A boolean mask's bias lies over rows every kernel family reads as they are
    (common.new_bias): memattn makes no copy of its own in each layer; broadcast
    dimensions stay of size 1."""
    mask = bool_mask(1, 5, kv_len).expand(3, 1, 5, kv_len)
    bias = mt._mask_to_bias(mask, torch.float16, kv_len)
    assert bias.shape == (1, 1, 5, kv_len) and rows_aligned(bias, TILE_BIAS_ALIGNMENT)
    expected = torch.zeros(bias.shape, dtype=torch.float16).masked_fill(~mask[:1], float("-inf"))
    assert torch.equal(bias, expected)


@cpu_only
def test_function_position_bias_and_its_gradient():
    q, k, v = qkv(q_len=6, kv_len=6)
    pb = torch.randn(1, 4, 6, 6, requires_grad=True)
    out, _ = mt.memattn_attention_forward(Attn(), q, k, v, None, position_bias=pb)
    (grad,) = torch.autograd.grad(out.square().sum(), [pb])
    pb_ref = pb.detach().clone().requires_grad_(True)
    ref, _ = sdpa_attention_forward(Attn(), q, k, v, None, position_bias=pb_ref)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), [pb_ref])
    assert relative_error(out, ref) <= 1e-5
    assert relative_error(grad, grad_ref) <= 1e-4


@cpu_only
@pytest.mark.parametrize("q_len,kv_len", [(9, 9), (1, 9)], ids=["prefill", "decode"])
def test_function_sliding_window_matches_transformers_mask(q_len, kv_len):
    """With no mask, sliding_window=w means what transformers' own sliding mask means
    (kv > q - w, queries the last q_len positions)."""
    w = 3
    q, k, v = qkv(q_len=q_len, kv_len=kv_len)
    out, _ = mt.memattn_attention_forward(Attn(), q, k, v, None, sliding_window=w)
    mask = sdpa_mask(2, q_len, kv_len, q_offset=kv_len - q_len,
                     mask_function=sliding_window_causal_mask_function(w),
                     allow_is_causal_skip=False)  # fmt: skip
    ref, _ = sdpa_attention_forward(Attn(), q, k, v, mask)
    assert relative_error(out, ref) <= 1e-5


@cpu_only
def test_function_softcap_scaling_and_dropout():
    q, k, v = qkv(q_len=5, kv_len=7)
    module = Attn()
    out, _ = mt.memattn_attention_forward(module, q, k, v, None, scaling=0.5, softcap=2.0)
    s = 2.0 * torch.tanh(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5 / 2.0)
    s = s.masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(1), float("-inf"))
    ref = (s.softmax(-1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
    assert relative_error(out, ref) <= 1e-5

    module.eval()  # eval: dropout ignored, as eager does
    plain, _ = mt.memattn_attention_forward(module, q, k, v, None)
    evald, _ = mt.memattn_attention_forward(module, q, k, v, None, dropout=0.5)
    assert torch.equal(plain, evald)
    module.train()
    torch.manual_seed(5)
    a, _ = mt.memattn_attention_forward(module, q, k, v, None, dropout=0.5)
    torch.manual_seed(5)
    b, _ = mt.memattn_attention_forward(module, q, k, v, None, dropout=0.5)
    assert torch.equal(a, b) and not torch.equal(a, plain)

    with pytest.raises(NotImplementedError, match="s_aux"):
        mt.memattn_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4))


# ---------------------------------------------------------------- whole models


@cpu_only
@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "left_padding"])
def test_logits_match_sdpa(padded, spy):
    ref, model = make_pair()
    ids, mask = inputs(padded=padded)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        expected = ref(ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()
    assert relative_error(logits, expected) <= 1e-4
    # One call per layer, GQA without repeat_kv: k keeps its 2 heads.
    assert len(spy) == TINY["num_hidden_layers"]
    assert spy[0]["q"] == (2, 11, 4, 16) and spy[0]["k"] == (2, 11, 2, 16)
    if padded:  # transformers' boolean mask, as a bias
        assert spy[0]["bias"] == (2, 1, 11, 11) and not spy[0].get("causal")
    else:  # no mask: memattn's own causal mask
        assert spy[0]["bias"] is None and spy[0]["causal"] and spy[0]["align"] == "top_left"


@cpu_only
def test_save_and_from_pretrained(tmp_path):
    ref, _ = make_pair()
    ref.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="memattn").eval()
    assert model.config._attn_implementation == "memattn"
    ids, mask = inputs()
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        expected = ref(ids, attention_mask=mask).logits
    assert relative_error(logits, expected) <= 1e-4


def training_step(model, ids, mask, lr=1e-2):
    """Loss (padding ignored), gradients, and the weights before and after an SGD step."""
    model.train()
    labels = ids.masked_fill(mask == 0, -100)
    loss = model(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return loss.detach(), grads, before


@cpu_only
def test_training_step_gradients_match_sdpa():
    ref, model = make_pair()
    ids, mask = inputs()
    loss, grads, before = training_step(model, ids, mask)
    ref_loss, ref_grads, _ = training_step(ref, ids, mask)
    assert torch.isfinite(loss) and relative_error(loss, ref_loss) <= 1e-5
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, ref_grads[name], scale=1e-6) <= 1e-4, name
    # The attention projections get a gradient through memattn, and the step moves them.
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert grads[q_proj].abs().sum() > 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert q_proj in changed and len(changed) == len(before)


@cpu_only
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_kv_cache_matches_sdpa(cache, spy):
    """Greedy decoding with the KV cache: the dynamic cache with left padding (masks at
    every step), the static cache without padding (prefill into a longer, empty cache
    with no mask: causal top-left, as sdpa)."""
    ref, model = make_pair()
    ids, mask = inputs(padded=cache == "dynamic")
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation=cache,
                  return_dict_in_generate=True, output_logits=True)  # fmt: skip
    out = model.generate(ids, attention_mask=mask, **kwargs)
    expected = ref.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert relative_error(torch.stack(out.logits), torch.stack(expected.logits)) <= 1e-4
    assert [c["q"][1] for c in spy] == [11, 11, 1, 1, 1, 1]  # prefill, then one token a step
    if cache == "static":
        assert spy[0]["k"][1] > 11 and spy[0]["bias"] is None and spy[0]["align"] == "top_left"


# ---------------------------------------------------------------- GPU


def all_grads(grads):
    return torch.cat([g.flatten().float() for g in grads.values()])


@pytest.mark.gpu
def test_bfloat16_logits_and_training_step_gpu():
    """bfloat16 against sdpa in bfloat16 and in float32 (same weights), tolerance 2e-2.

    Rows that the mask hides everywhere (left padding) are compared with float32 sdpa
    only: memattn gives them 0 as sdpa's math and efficient kernels do, but bfloat16
    sdpa with a mask runs cuDNN, whose such rows hold arbitrary values. The padded
    batch's loss reaches them (the last pad predicts the first token), so its gradients
    are compared with float32 sdpa's, as one vector: per parameter, bfloat16 alone is
    up to ~1.8e-2 off float32 (sdpa's too)."""
    sizes = dict(vocab_size=512, hidden_size=512, intermediate_size=1024,
                 num_attention_heads=8, max_position_embeddings=512)  # fmt: skip
    ref, model = make_pair("cuda", torch.bfloat16, **sizes)
    ref32, _ = make_pair("cuda", torch.float32, **sizes)
    for padded in (False, True):
        ids, mask = inputs(batch=2, seqlen=300, padded=padded, device="cuda", vocab=512)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
            expected = ref(ids, attention_mask=mask).logits
            exact = ref32(ids, attention_mask=mask).logits
        assert torch.isfinite(logits).all()
        real = mask.bool()
        assert relative_error(logits[real], expected[real]) <= 2e-2, padded
        assert relative_error(logits, exact) <= 2e-2, padded

    ids, mask = inputs(batch=2, seqlen=300, padded=False, device="cuda", vocab=512)
    loss, grads, before = training_step(model, ids, mask)
    ref_loss, ref_grads, _ = training_step(ref, ids, mask)
    assert torch.isfinite(loss) and relative_error(loss, ref_loss) <= 2e-2
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, ref_grads[name], scale=1e-6) <= 2e-2, name
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed

    ids, mask = inputs(batch=2, seqlen=300, padded=True, device="cuda", vocab=512)
    model.zero_grad(set_to_none=True)
    ref32.load_state_dict(model.state_dict())  # the weights after the step, in float32
    loss, grads, _ = training_step(model, ids, mask)
    exact_loss, exact_grads, _ = training_step(ref32, ids, mask)
    assert torch.isfinite(all_grads(grads)).all()
    assert relative_error(loss, exact_loss) <= 2e-2
    assert relative_error(all_grads(grads), all_grads(exact_grads)) <= 2e-2
