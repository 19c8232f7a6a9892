"""How far float8 weights move the Local-v1.5 talker's outputs (`talker.fp8_weights`).

One random-weight talker, the same inputs (random prompt rows through the backbone, random codes
through the local block, teacher-forced), computed four ways: fp32 (the reference), bf16 (as
served), bf16 with float8 matmuls in the backbone and in every layer (both schemes of
`talker.fp8_scheme`: the weights alone rounded, and the inputs too), and, through the paged
serving path (half of each sequence prefilled, the rest decoded a row a step), over a bf16 and
a float8 KV cache (`talker.kv_cache_dtype`). Each line gives a way's distance from fp32, so
float8's error reads against the error bf16 already has:

    weights   hidden rel  logits rel  KL(T)  top-1  top-k
    bf16      ...

hidden/logits rel: ||x - x_fp32|| / ||x_fp32|| of the backbone's final hidden states and of the 12
audio heads' logits; KL(T): mean KL divergence of the sampled distribution at temperature T
(shipped 1.7) from fp32's, nats a token; top-1: share of tokens whose most likely code is
fp32's; top-k: mean share of fp32's k (25) most likely codes among this way's k.

Random weights are not the released ones: a checkpoint with outlier channels can lose more to
per-row activation scales than a random one. The figures bound what the kernels do, not what a
listener hears.
"""

from __future__ import annotations

import argparse
import copy

import torch

from stages.models.local_v15.config import full_size_config, tiny_config
from stages.models.local_v15.loader import build_talker_module


@torch.no_grad()
def outputs(model, rows: torch.Tensor, codes: torch.Tensor,
            kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [B, S, 1 + n_vq], codes [B * S, n_vq] -> (hidden [B * S, H], audio logits
    [B * S, n_vq, codebook]) in fp32. `kv_dtype`: through the paged serving path instead, the
    first half of each sequence prefilled, the rest decoded a row a step over a KV cache of that
    element type (the Triton paged attention on CUDA)."""
    if kv_dtype is None:
        hidden = model.transformer.forward_dense(model.embed_rows(rows))  # [B, S, H]
    else:
        hidden = paged_hidden(model, rows, kv_dtype)
    h = hidden.reshape(-1, hidden.shape[-1])
    _, audio = model.teacher_forced_logits(h, codes)
    return h.float(), audio.float()


def paged_hidden(model, rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """rows [B, S, 1 + n_vq] -> hidden [B, S, H] through `Qwen3Model.forward` over a paged cache."""
    from stages.runtime.attention.backends import ReferenceAttention
    from stages.runtime.attention.metadata import build_attention_metadata
    from stages.runtime.kv_cache import PagedKVCache

    B, S, _ = rows.shape
    backbone = model.transformer
    cache = PagedKVCache(backbone.config.kv_cache_spec(B * (S // 16 + 2), 16), dtype=kv_dtype, device=rows.device)
    if rows.is_cuda:
        from stages.runtime.attention.triton_paged import TritonPagedAttention
        attention = TritonPagedAttention()
    else:
        attention = ReferenceAttention()
    embeds = model.embed_rows(rows)  # [B, S, H]
    out = torch.empty_like(embeds)
    first = S // 2
    for start, n in [(0, first)] + [(t, 1) for t in range(first, S)]:
        meta = build_attention_metadata(cache, [(b, n) for b in range(B)], rows.device)
        h = backbone(embeds[:, start:start + n].reshape(B * n, -1), meta, cache, attention)  # [B * n, H]
        out[:, start:start + n] = h.reshape(B, n, -1)
    return out


def compare(hidden, logits, ref_hidden, ref_logits, temperature: float, k: int) -> dict[str, float]:
    rel = lambda x, r: ((x - r).norm() / r.norm()).item()
    p_log = torch.log_softmax(ref_logits / temperature, dim=-1)
    q_log = torch.log_softmax(logits / temperature, dim=-1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1).mean().item()
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    ref_top = ref_logits.topk(k, dim=-1).indices  # [T, n_vq, k]
    top = logits.topk(k, dim=-1).indices
    overlap = (ref_top.unsqueeze(-1) == top.unsqueeze(-2)).any(-1).float().mean().item()
    return {"hidden_rel": rel(hidden, ref_hidden), "logits_rel": rel(logits, ref_logits),
            "kl": kl, "top1": top1, "topk": overlap}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=["tiny", "full"], default="full")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=128, help="prompt rows a sequence")
    ap.add_argument("--temperature", type=float, default=1.7)
    ap.add_argument("--top-k", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    config = full_size_config() if args.size == "full" else tiny_config()
    with torch.device(args.device):
        model = build_talker_module(config).float().eval()
    cfg = model.config
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = torch.randint(0, cfg.codebook_size, (args.batch, args.rows, 1 + cfg.n_vq), generator=g)
    rows[..., 0] = torch.randint(0, cfg.backbone.vocab_size, (args.batch, args.rows), generator=g)
    codes = torch.randint(0, cfg.codebook_size, (args.batch * args.rows, cfg.n_vq), generator=g)
    rows, codes = rows.to(args.device), codes.to(args.device)
    print(f"torch {torch.__version__}, {args.device}, random {args.size} talker, {args.batch} x {args.rows} rows, "
          f"T={args.temperature}, top-k {args.top_k}", flush=True)
    ref = outputs(model, rows, codes)
    model = model.to(torch.bfloat16)
    print(f"{'weights':16s} {'hidden rel':>10s} {'logits rel':>10s} {'KL(T)':>9s} {'top-1':>6s} {'top-k':>6s}")
    ways = [("bf16", "none", "w8a16", None), ("fp8 backbone", "backbone", "w8a16", None),
            ("fp8 all", "all", "w8a16", None), ("w8a8 backbone", "backbone", "w8a8", None),
            ("w8a8 all", "all", "w8a8", None),
            ("bf16, KV bf16", "none", "w8a16", torch.bfloat16), ("bf16, KV fp8", "none", "w8a16", torch.float8_e4m3fn),
            ("fp8 all, KV fp8", "all", "w8a16", torch.float8_e4m3fn)]
    for name, which, scheme, kv_dtype in ways:
        way = copy.deepcopy(model)
        way.use_fp8_weights(which, scheme)
        m = compare(*outputs(way, rows, codes, kv_dtype), *ref, args.temperature, args.top_k)
        print(f"{name:16s} {m['hidden_rel']:10.4f} {m['logits_rel']:10.4f} {m['kl']:9.2e} {m['top1']:6.3f} "
              f"{m['topk']:6.3f}", flush=True)
        del way


if __name__ == "__main__":
    main()
