"""A draft model by distillation, in miniature (chapter 08).

Speculative decoding needs a draft that guesses the target's *next token*, cheaply and often.
Trained on text alone, a small model learns the text; **distilled** (Hinton et al., 2015), it
learns the target: its loss is the cross-entropy against the target's whole distribution at
every position (KL(target ‖ draft) up to a constant) instead of the one token the text has
there. That is the draft's real job — a greedy proposal is accepted when it equals the
target's argmax, a sampled one with probability ``Σ min(p, q)`` (the overlap of the two
distributions) — so distillation optimises what speculation pays for.

The experiment here fits in seconds on a CPU, with the tiny Shakespeare pair: a draft with the
target's width but ``layers`` of its decoder layers, initialised from the target's first layers
and final norm, sharing its embedding (which is also the tied LM head), frozen. Two copies
train from the same weights on the same windows in the same order with the same optimizer; one
on the text's next tokens, one on the target's top-``topk`` distribution (renormalised). Both
are then measured the same way: top-1 agreement and overlap with the target on held-out text,
and acceptance in the engine.

    teacher, draft = load_hf(target), truncated_draft(target, layers=1)
    windows = token_windows(ids, 128)
    topk = teacher_topk(teacher, windows, 64)
    trained = train_draft(draft, windows, "distill", topk, steps=40)
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minillm.assets import resolve_model

LOSSES = ("data", "distill")


def _config(folder: Path):
    # deferred: transformers takes 0.6 s to import; only the recipe's training needs it
    from transformers import LlamaConfig

    return LlamaConfig.from_pretrained(str(folder))


def _state_dict(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(path)).items()})
    return out


def load_hf(model: str | Path):
    """The HF ``transformers`` Llama of ``model`` (a name or a folder) in fp32, for training
    (no progress bars: weights read directly from the safetensors)."""
    # deferred: transformers takes 0.6 s to import; only the recipe's training needs it
    from transformers import LlamaForCausalLM

    folder = resolve_model(str(model))
    hf = LlamaForCausalLM(_config(folder))
    hf.load_state_dict(_state_dict(folder), strict=False)
    hf.tie_weights()
    return hf.eval()


def truncated_draft(target: str | Path, layers: int = 1):
    """A draft with ``target``'s width and tokenizer and its first ``layers`` decoder layers and
    final norm; the embedding (and tied LM head) is shared and frozen."""
    # deferred: transformers takes 0.6 s to import; only the recipe's training needs it
    from transformers import LlamaForCausalLM

    folder = resolve_model(str(target))
    config = _config(folder)
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"layers={layers} must be in [1, {config.num_hidden_layers}] (the target's layers)")
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config)
    weights = {k: v for k, v in _state_dict(folder).items() if _layer_index(k) is None or _layer_index(k) < layers}
    missing, _ = draft.load_state_dict(weights, strict=False)
    if [m for m in missing if m != "lm_head.weight"]:
        raise ValueError(f"{folder} lacks weights the draft needs: {missing[:4]}")
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft.eval()


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None


def num_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def token_windows(ids: list[int] | torch.Tensor, length: int) -> torch.Tensor:
    """``ids`` cut into consecutive windows ``[n, length]`` (the remainder dropped)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = len(ids) // length
    if n == 0:
        raise ValueError(f"{len(ids)} tokens make no window of {length}")
    return ids[: n * length].view(n, length)


@dataclass
class TopK:
    """The teacher's ``k`` most likely tokens at every position of every window, and their
    probabilities renormalised to sum to 1 (``mass``: what the k covered before that)."""

    indices: torch.Tensor  # [windows, length, k]
    probs: torch.Tensor  # [windows, length, k]
    mass: float


@torch.no_grad()
def teacher_topk(teacher, windows: torch.Tensor, k: int = 64, batch: int = 16) -> TopK:
    """One pass of the teacher over ``windows``; keep its top-``k`` distribution per position."""
    indices, probs, mass = [], [], 0.0
    for i in range(0, len(windows), batch):
        p = teacher(windows[i : i + batch]).logits.float().softmax(-1)
        top = p.topk(k, dim=-1)
        covered = top.values.sum(-1, keepdim=True)
        mass += float(covered.sum())
        indices.append(top.indices)
        probs.append(top.values / covered)
    return TopK(torch.cat(indices), torch.cat(probs), mass / windows.numel())


def data_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the text: the one token that came next."""
    logp = logits[:, :-1].log_softmax(-1)
    return -logp.gather(-1, x[:, 1:, None]).mean()


def distill_loss(logits: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the teacher's (top-k) distribution at every position: the KL
    divergence KL(teacher ‖ draft) plus the teacher's entropy, which does not depend on the draft."""
    logq = logits.log_softmax(-1)
    return -(probs * logq.gather(-1, indices)).sum(-1).mean()


def train_draft(
    draft,
    windows: torch.Tensor,
    loss: str,
    topk: TopK | None = None,
    steps: int = 40,
    batch: int = 8,
    lr: float = 3e-3,
    seed: int = 0,
):
    """A trained copy of ``draft`` (the original is left as it is): ``steps`` AdamW steps on
    batches of ``windows`` drawn with ``seed`` — the same batches for either ``loss``."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {LOSSES}")
    if loss == "distill" and topk is None:
        raise ValueError("loss='distill' needs the teacher's topk (teacher_topk)")
    model = copy.deepcopy(draft).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    curve = []
    for _ in range(steps):
        rows = torch.randint(0, len(windows), (batch,), generator=gen)
        x = windows[rows]
        logits = model(x).logits.float()
        value = data_loss(logits, x) if loss == "data" else distill_loss(logits, topk.indices[rows], topk.probs[rows])
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(value.detach()))
    model.curve = curve
    return model.eval()


@torch.no_grad()
def agreement(draft, teacher, windows: torch.Tensor) -> dict[str, float]:
    """On held-out ``windows``: how often the draft's top-1 token equals the teacher's (what a
    greedy proposal needs), the mean overlap ``Σ min(p, q)`` of the two distributions (the
    probability a sampled proposal is accepted), and the draft's own next-token loss."""
    x = windows
    p = teacher(x).logits.float().softmax(-1)
    logits = draft(x).logits.float()
    q = logits.softmax(-1)
    return {
        "top1_agreement": float((p.argmax(-1) == q.argmax(-1)).float().mean()),
        "overlap": float(torch.minimum(p, q).sum(-1).mean()),
        "heldout_loss": float(data_loss(logits, x)),
    }


def save_draft(draft, folder: str | Path, like: str | Path) -> Path:
    """Write ``draft`` as an HF folder the engine can load (``speculative_config={"model": folder}``),
    with the tokenizer and generation config of ``like`` (the target)."""
    folder, src = Path(folder), resolve_model(str(like))
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = draft.config.num_hidden_layers
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {k: v.detach().contiguous() for k, v in draft.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, folder / name)
    return folder
