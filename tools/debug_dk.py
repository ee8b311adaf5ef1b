"""dK error on the GPU across backward configurations (device debugging aid)."""
import torch

import memattn
from memattn.check import Case, check_backward, make_inputs
from memattn.kernels import tuning
from memattn.kernels.tuning import BackwardConfig

configs = {
    "table": None,
    "stages1": BackwardConfig(32, 128, 8, 1, 128, 32, 8, 2),
    "64x64 w4": BackwardConfig(64, 64, 4, 2, 128, 32, 8, 2),
    "32x64 w4 s1": BackwardConfig(32, 64, 4, 1, 128, 32, 8, 2),
    "16x32 w4 s1": BackwardConfig(16, 32, 4, 1, 32, 16, 4, 1),
}
cases = [Case("gqa", seqlen_q=715, seqlen_k=1024, dqk=128, dv=128),
         Case("mha", seqlen_q=715, seqlen_k=1024, kv_heads=4, dqk=128, dv=128),
         Case("mha fp32", seqlen_q=256, seqlen_k=256, kv_heads=4, dqk=64, dv=64)]
for name, cfg in configs.items():
    tuning.backward_override = cfg
    for case in cases:
        dtype = torch.float32 if "fp32" in case.name else torch.bfloat16
        res = check_backward(case, dtype, "cuda", seed=1)
        print(f"{name:12s} {case.name:9s}", " ".join(f"{r.what}={r.error:.2e}/{r.allowed:.1e}" for r in res), flush=True)
tuning.backward_override = None
# where are the dk errors? per key row, plain MHA
x = make_inputs(Case("m", seqlen_q=256, seqlen_k=256, kv_heads=4, dqk=64, dv=64), torch.bfloat16, "cuda")
for t in (x.q, x.k, x.v):
    t.requires_grad_(True)
out = memattn.attention(x.q, x.k, x.v)
g = torch.randn_like(out)
dq, dk, dv = torch.autograd.grad(out, (x.q, x.k, x.v), g)
q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (x.q, x.k, x.v))
o64 = memattn.reference.attention(q64, k64, v64)
rq, rk, rv = torch.autograd.grad(o64, (q64, k64, v64), g.double())
err = (dk.double() - rk).norm(dim=-1) / rk.norm(dim=-1)  # (B, S, H)
print("dk rel err per key row (b0 h0):", [f"{e:.2f}" for e in err[0, :, 0].tolist()[::8]])
print("dk rel err per dim chunk:", [f"{((dk.double()-rk)[..., i:i+16].norm()/rk[..., i:i+16].norm()).item():.2f}" for i in range(0, 64, 16)])
ratio = (dk.double() * rk).sum() / (rk * rk).sum()
print("projection of dk on ref:", ratio.item())
