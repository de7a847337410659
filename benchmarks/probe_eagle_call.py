"""Where one call of the EAGLE head spends its time on CPU: the whole call against its parts.

    python benchmarks/probe_eagle_call.py [--rows 3] [--past 200] [--threads 2]

The head as the engine loads it (bf16, matrices prepacked for oneDNN) over SmolLM2-135M: one
call of ``EagleHead.forward`` as a tree level makes it (``--rows`` nodes over ``--past`` draft
keys, under a mask) and one of ``EagleHead.logits``, each the median of 500 — then each part
timed alone: the five prepacked matrix products and the draft-vocabulary product, one RMSNorm,
and the attention as the head runs it (keys repeated per query head) against PyTorch's grouped
form (``enable_gqa=True``). A part timed alone runs with its weights warm in cache; so the five
products are also timed back to back, and after a write of 64 MiB has flushed the caches (as the
target's pass, which streams ~270 MB, does between two steps).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from timing import median_ms


def median_us(fn, repeats: int = 500) -> float:
    return median_ms(fn, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--past", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from minillm import LLM
    from minillm.assets import resolve_model
    from minillm.machine import machine_description
    from minillm.speculative.eagle import load_eagle_head

    llm = LLM("smollm2-135m", compile=False, num_threads=args.threads)
    head = load_eagle_head(resolve_model("smollm2-eagle"), llm.model)
    cfg, dtype, T, P = head.cfg, head.fc.weight.dtype, args.rows, args.past
    machine = machine_description(torch.device("cpu"))
    print(f"probe_eagle_call: {machine['cpu']}, {args.threads} threads; head {dtype}, prepacked: "
          f"{bool(head.packed)}; {T} rows over {P} draft keys")  # fmt: skip
    feats = torch.randn(T, cfg.hidden_size, dtype=dtype)
    tokens, positions = torch.arange(T) + 100, torch.full((T,), P)
    past_k = torch.randn(P, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    past_v = torch.randn_like(past_k)
    mask = torch.ones(T, P + T, dtype=torch.bool).tril(P)
    with torch.inference_mode():
        call = median_us(lambda: head(feats, tokens, positions, past_k, past_v, mask=mask))
        scores = median_us(lambda: head.logits(feats))
        inputs = {"fc": 2 * cfg.hidden_size, "down": cfg.intermediate_size}
        parts = {}
        for name, weight in head.packed.items():
            x = torch.randn(T, inputs.get(name, cfg.hidden_size), dtype=dtype)
            parts[name] = median_us(lambda x=x, w=weight: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
        norm = median_us(lambda: head.input_norm(feats))
        groups = cfg.num_heads // cfg.num_kv_heads
        q = torch.randn(1, cfg.num_heads, T, cfg.head_dim, dtype=dtype)
        keys = torch.randn(P + T, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)

        def repeated():
            kh = keys.transpose(0, 1).repeat_interleave(groups, 0)[None]
            return F.scaled_dot_product_attention(q, kh, kh, attn_mask=mask)

        def grouped():
            kh = keys.transpose(0, 1)[None]
            return F.scaled_dot_product_attention(q, kh, kh, attn_mask=mask, enable_gqa=True)

        mm, order = torch.ops.mkldnn._linear_pointwise, ("fc", "qkv", "o", "gate_up", "down")
        xs = {name: torch.randn(T, inputs.get(name, cfg.hidden_size), dtype=dtype) for name in order}

        def five():
            for name in order:
                mm(xs[name], head.packed[name], None, "none", [], "")

        flush = torch.ones(64 * 2**20 // 2, dtype=dtype)  # 64 MiB: more than the caches hold
        back_to_back = median_us(five)
        flushed = median_us(lambda: (flush.add_(1), five()), 100) - median_us(lambda: flush.add_(1), 100)
        same = torch.equal(repeated(), grouped())
        attention = (median_us(repeated), median_us(grouped))
    layer = sum(v for k, v in parts.items() if k != "head")
    print(f"one head call (forward): {call:.0f} µs; its scores (logits): {scores:.0f} µs")
    print("alone: " + ", ".join(f"{k} {v:.0f} µs" for k, v in parts.items()) + f"; the layer's five: {layer:.0f} µs")
    print(f"alone: one RMSNorm {norm:.0f} µs (two per call); attention with repeated keys {attention[0]:.0f} µs, "
          f"grouped (enable_gqa) {attention[1]:.0f} µs, same output: {same}")  # fmt: skip
    print(f"the five products back to back: {back_to_back:.0f} µs; after a 64 MiB write flushed the caches: "
          f"{flushed:.0f} µs (the layer's weights: {sum(head.packed[n].numel() for n in order) * 2 / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
