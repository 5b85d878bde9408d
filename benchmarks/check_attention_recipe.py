"""GPU check of fxfuse::softcap_attention's recipe path (causal / window / documents / key padding, no mask tensor)
and of its 64-bit mask addressing, against float64.

1. Accuracy: bf16 op vs a float64 reference, forward and every gradient, beside eager bf16 attention's own
   distance from float64 (the op must be within 2x of it), over head dims 64 / 128 / 256, GQA, softcap, window,
   packed documents of ragged lengths, left / right padding (fully masked rows).
2. The recipe path against the mask-tensor path on the same mask (same kernels, different masking), and the
   mask-tensor path at a size whose mask passes 2^31 elements (a right-padded batch of 3 rows at 32k:
   [3, 1, 32768, 32768], the case that died with an illegal memory access before 64-bit addressing).

Run: python benchmarks/check_attention_recipe.py  (rows to $OUT/attention_recipe_check.jsonl and stdout)
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fxfuse.attention.reference import attention_reference  # noqa: E402
from fxfuse.ops import document_ranges, softcap_attention  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a quick dry run of the script (--tiny sizes)
TINY = DEV == "cpu"


def emit(**row):
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(os.path.join(OUT, "attention_recipe_check.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def doc_ids(B, S, bounds):
    ids = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        for x in bounds[b]:
            ids[b, x:] += 1
    return ids.to(DEV)


def errs(out, grads, ref, rgrads):
    return [float((a.double() - b).abs().max()) for a, b in zip([out, *grads], [ref, *rgrads])]


def accuracy(name, B, Hq, Hkv, S, D, bounds, kv_valid, softcap=0.0, window=0, masked_rows="zero"):
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, Hq, S, D, device=DEV, generator=g).bfloat16().requires_grad_()
    k = torch.randn(B, Hkv, S, D, device=DEV, generator=g).bfloat16().requires_grad_()
    v = torch.randn(B, Hkv, S, D, device=DEV, generator=g).bfloat16().requires_grad_()
    do = torch.randn(B, Hq, S, D, device=DEV, generator=g).bfloat16()
    ids = doc_ids(B, S, bounds)
    keep = (ids[:, :, None] == ids[:, None, :])
    if kv_valid is not None:
        keep = keep & kv_valid[:, None, :]
    mr = {"zero": 0, "uniform": 1, "nan": 2}[masked_rows]
    scale = D ** -0.5
    out = softcap_attention(q, k, v, scaling=scale, softcap=softcap, causal=True, window=window, kernel="fxfuse",
                            doc_ranges=document_ranges(ids), key_valid=kv_valid, masked_rows=masked_rows)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = attention_reference(q, k, v, mask=keep[:, None], scaling=scale, softcap=softcap, causal=True,
                              window=window, masked_rows=mr)
    rgrads = torch.autograd.grad(ref, (q, k, v), do.double())
    eager = attention_reference(q, k, v, mask=keep[:, None], scaling=scale, softcap=softcap, causal=True,
                                window=window, masked_rows=mr, dtype=torch.bfloat16)
    egrads = torch.autograd.grad(eager, (q, k, v), do)
    e_op, e_eager = errs(out, grads, ref, rgrads), errs(eager, egrads, ref, rgrads)
    # the mask-tensor path on the same mask: same answer
    out_m = softcap_attention(q, k, v, mask=keep[:, None], scaling=scale, softcap=softcap, causal=True,
                              window=window, masked_rows=masked_rows)
    ok = all(a <= max(2 * b, 2e-2) for a, b in zip(e_op, e_eager))
    emit(check="accuracy", case=name, B=B, Hq=Hq, Hkv=Hkv, S=S, D=D, softcap=softcap, window=window,
         masked_rows=masked_rows, err_op_vs_fp64=[f"{e:.2e}" for e in e_op],
         err_eager_bf16_vs_fp64=[f"{e:.2e}" for e in e_eager],
         recipe_vs_mask_tensor=f"{float((out.float() - out_m.float()).abs().max()):.2e}", within_2x_eager=ok)
    return ok


def mask_past_2_31():
    """The mask-tensor path with a [3, 1, 32768, 32768] bool mask (3.2e9 elements), forward and backward, and
    the recipe path on the same (causal + right padding) mask: the same rows."""
    B, H, S, D = 3, 8, 32768, 64
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(B, H, S, D, device=DEV, generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(B, 2, S, D, device=DEV, generator=g, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(B, 2, S, D, device=DEV, generator=g, dtype=torch.bfloat16).requires_grad_()
    lens = torch.tensor([S, S - 5000, 7000], device=DEV)
    kv_valid = torch.arange(S, device=DEV)[None, :] < lens[:, None]
    t0 = time.perf_counter()
    out_r = softcap_attention(q, k, v, causal=True, key_valid=kv_valid)
    out_r.float().sum().backward()
    gr = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.cuda.synchronize()
    t_recipe = time.perf_counter() - t0
    mask = torch.ones(S, S, device=DEV, dtype=torch.bool).tril_()[None, None] & kv_valid[:, None, None, :]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out_m = softcap_attention(q, k, v, mask=mask)
    out_m.float().sum().backward()
    torch.cuda.synchronize()
    t_mask = time.perf_counter() - t0
    pairs = list(zip([out_r, *gr], [out_m, q.grad, k.grad, v.grad]))
    d = [float((a.float() - b.float()).abs().max()) for a, b in pairs]
    mag = [float(b.float().abs().max()) for _, b in pairs]
    # the two paths sum in different orders: allow one bf16 ulp at the tensor's largest magnitude (2^-7 of it;
    # dk of out.sum() at 32k reaches ~10, where one ulp is 0.0625), and 1e-2 absolute below that
    # rows past 2^31 in the mask: batch row 2 starts at 2 * 32768^2 = 2^31
    emit(check="mask_past_2^31", mask_shape=list(mask.shape), mask_elements=mask.numel(),
         recipe_vs_mask_tensor_out_dq_dk_dv=[f"{e:.2e}" for e in d], recipe_s=round(t_recipe, 2),
         max_abs_out_dq_dk_dv=[f"{m:.3g}" for m in mag],
         mask_tensor_s=round(t_mask, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
         ok=all(e <= max(2**-7 * m, 1e-2) for e, m in zip(d, mag)))


def main():
    results = []
    cases = [
        ("docs ragged D64 GQA4", 2, 16, 4, 1000, 64, [[7, 130, 131, 600], [1, 999]], None, 0.0, 0, "zero"),
        ("docs D128 GQA4", 1, 32, 8, 2048, 128, [[100, 900, 1500]], None, 0.0, 0, "zero"),
        ("docs + window D128", 1, 8, 2, 3000, 128, [[64, 1900]], None, 0.0, 257, "zero"),
        ("softcap docs + window D256", 1, 8, 4, 1500, 256, [[333, 1000]], None, 50.0, 400, "uniform"),
    ]
    if TINY:
        cases = [("docs tiny", 2, 4, 2, 40, 16, [[7, 20], [1]], None, 0.0, 0, "zero"),
                 ("softcap window tiny", 1, 4, 2, 50, 16, [[10]], None, 50.0, 9, "uniform")]
    for c in cases:
        results.append(accuracy(*c))
    for side in ("left", "right", "holes"):
        # holes: padding inside a row's valid-key span (the kernels then read the padding flags in every tile)
        # beside a row without (flags read only in the tiles at the span's edges)
        B, S = (2, 60) if TINY else (2, 777)
        valid = torch.ones(B, S, dtype=torch.bool, device=DEV)
        if side == "left":
            valid[0, :S // 8] = False
            valid[1, :S * 2 // 3] = False
        elif side == "right":
            valid[0, -(S // 8):] = False
            valid[1, -(S * 2 // 3):] = False
        else:
            valid[0, S // 3:S // 3 + S // 10] = False
            valid[0, -(S // 5):] = False
            valid[1, S // 7:] = False
        for mr in ("zero", "uniform"):
            results.append(accuracy(f"{side} padding D128 {mr}", B, 8, 2, S, 128, [[], []], valid, 0.0, 0, mr))
    try:
        if not TINY:
            mask_past_2_31()
    except Exception as e:
        emit(check="mask_past_2^31", error=f"{type(e).__name__}: {str(e)[:300]}")
    torch.cuda.synchronize() if DEV == "cuda" else None
    emit(check="summary", accuracy_cases=len(results), within_2x_eager=sum(results))


if __name__ == "__main__":
    main()
