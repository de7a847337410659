"""Recipe: a small draft model for SmolLM2-135M-Instruct, trained on data alone and distilled.

    python data/recipes/distill_smollm2_draft.py              # everything, ~25 min on 2 CPU cores
    python data/recipes/distill_smollm2_draft.py --threads 1  # the same on a busy shared machine
    python data/recipes/distill_smollm2_draft.py --steps 30 --no-save --cache /tmp/d   # a pilot

Speculative decoding needs a draft that guesses the target's *next token* cheaply and often
right. This recipe builds one for SmolLM2-135M-Instruct and runs the chapter's experiment:
the same draft, trained the same way on the same text, once on the text alone and once
distilled from SmolLM2's own distributions. Which one agrees with the target more often?

**Architecture.** A Llama model with SmolLM2's tokenizer and width (hidden 576, 9 heads / 3 KV
heads, head_dim 64, SwiGLU 1536), but ``--layers`` (default 2) decoder layers instead of 30.
Hidden 576 lets it *share SmolLM2's embedding, which is also its tied LM head* — frozen, so the
49152 x 576 matrix (28M of the 35M parameters) needs neither training nor committing. What is
new is 3.5M parameters per layer plus the final norm: 7.1M for two layers, 14 MB in bf16.
At decode time the head dominates the draft's cost either way (28M multiply-adds per token
against 3.5M per layer), so a second layer costs ~10% more draft time. Measured in pilots
(distilled, 100 steps x 8 windows, lr 3e-3): one layer reached held-out perplexity 441,
top-1 agreement with SmolLM2 0.246 and acceptance 0.066; two layers 235, 0.306 and 0.090.
Hence 2. (The same pilots chose 4 windows a step over 8 for the same tokens: perplexity 159
against 235.)

**Initialisation.** SmolLM2's own first ``--layers`` decoder layers and its final norm. They
were trained to read exactly this embedding space — their attention and MLP features are
about these vectors — so the draft starts from features that mean something rather than
from noise, and both variants start from the same weights. The untrained draft is still a
poor predictor: after two of thirty layers the residual stream is mostly the input token's
own embedding, so the tied head mostly predicts the token it just read (held-out
perplexity in the millions). The first ~20 steps repair that.

**Text** (everything ships offline):

- *chat*: SmolLM2's own greedy answers (``--max-answer`` tokens) to prompts built from
  templates — questions about the Python reference's topics (the keys of
  ``pydoc_data.topics``) and everyday subjects — rendered with SmolLM2's chat template.
  This is the text a draft meets when the target serves chat.
- *prose*: Python's reference manual (``pydoc_data.topics``, all topics joined in sorted
  order), ``--prose-chars`` characters from ``PROSE_TRAIN_START`` (72,000-272,000 by
  default). Characters 0-40,000 are held out for
  evaluation (``benchmarks/bench_quant.py`` evaluates the target there too) and the
  quantization calibration slice (60,000-72,000) is not trained on either.

Chat and prose are cut into windows of ``SEQ_LEN`` tokens; both variants see the same windows
in the same order, with the same optimizer, schedule and token budget.

**The two losses.** (a) *data alone*: next-token cross-entropy on the text. (b) *distilled*:
KL(target || draft) at temperature 1 against SmolLM2's distribution at every position,
truncated to the teacher's top ``--topk`` tokens (renormalised; the covered mass is
recorded). The teacher runs once over the windows and its top-k is cached.

**The experiment.** For each variant (and the untrained initialisation): SmolLM2 serves 8
free-chat prompts that no training prompt resembles, greedy, 64 tokens, in fp32 (so that its
text is exactly its plain greedy output whichever draft proposes), with the draft
proposing k = 4 tokens a step (``LLM("smollm2-135m", speculative_config=...)``) — acceptance
rate, mean accepted length, target forward passes per token — and the draft's perplexity and
top-1 agreement with SmolLM2 on the held-out prose.

**Storage.** ``data/smollm2-draft`` (distilled) and ``data/smollm2-draft-data`` (data alone)
hold ``config.json``, ``model.safetensors`` (the decoder layers and final norm, bf16),
``training.json`` and ``README.md``; ``minillm.assets.resolve_model("smollm2-draft")`` adds
SmolLM2's embedding, tokenizer and generation config into a cached, complete HF folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
TARGET = "smollm2-135m"
SEED = 1234
SEQ_LEN = 256
HELDOUT_CHARS = (0, 40_000)  # evaluation prose: the slice bench_quant evaluates the target on
PROSE_TRAIN_START = 72_000  # after the calibration slice (60,000-72,000)
VARIANTS = {"data": "smollm2-draft-data", "distill": "smollm2-draft"}

#: The experiment's prompts: free chat, none of them (nor their subjects) used for training.
EVAL_PROMPTS = [
    "Write a short poem about the ocean.",
    "What are three tips for staying focused while studying?",
    "Explain how a rainbow forms.",
    "Give me a simple recipe for pancakes.",
    "What is the difference between a virus and a bacterium?",
    "Describe a day in the life of a lighthouse keeper.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
]

SUBJECTS = [
    "volcanoes", "photosynthesis", "the moon", "honey bees", "coffee", "chess", "the internet",
    "democracy", "gravity", "classical music", "the Roman Empire", "electric cars", "recycling",
    "the human heart", "dinosaurs", "black holes", "the water cycle", "earthquakes", "the French Revolution",
    "jazz", "meditation", "solar panels", "penguins", "the stock market", "machine learning",
    "the printing press", "climate change", "tea", "the Great Wall of China", "friendship", "gardening",
    "marathon running", "the piano", "cats", "dogs", "bread baking", "the Olympic Games", "mountains",
    "deserts", "rain forests", "chocolate", "libraries", "trains", "bicycles", "cloud computing",
    "Shakespeare", "ancient Egypt", "the periodic table", "elephants", "public speaking",
]  # fmt: skip
SUBJECT_TEMPLATES = [
    "Tell me about {x}.",
    "What are three interesting facts about {x}?",
    "Explain {x} to a ten-year-old.",
    "Write a short paragraph about {x}.",
    "Write a haiku about {x}.",
]
PYTHON_TEMPLATES = [
    "Explain {x} in Python with a short example.",
    "What should a beginner know about {x} in Python?",
]
KEYWORDS = {"assert", "async", "await", "break", "class", "continue", "del", "else", "for", "global", "if",
            "import", "in", "lambda", "nonlocal", "pass", "raise", "return", "try", "while", "with", "yield"}  # fmt: skip
TOPIC_NAMES = {
    "atom-identifiers": "identifiers", "atom-literals": "literals", "augassign": "augmented assignment",
    "bltin-code-objects": "code objects", "bltin-ellipsis-object": "the Ellipsis object",
    "bltin-null-object": "the None object", "bltin-type-objects": "type objects", "execmodel": "the execution model",
    "exprlists": "expression lists", "formatstrings": "format strings", "id-classes": "reserved identifier classes",
    "operator-summary": "operator precedence", "specialattrs": "special attributes",
    "specialnames": "special method names", "typesfunctions": "function objects", "typesmapping": "mapping types",
    "typesmethods": "method objects", "typesmodules": "module objects", "typesseq": "sequence types",
    "typesseq-mutable": "mutable sequence types",
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def training_prompts() -> list[str]:
    """Every (template, subject) pair, in a fixed order."""
    from pydoc_data.topics import topics

    names = []
    for key in sorted(topics):
        if key in KEYWORDS:
            names.append(f"the `{key}` keyword")
        else:
            names.append(TOPIC_NAMES.get(key, key.replace("-", " ")))
    prompts = [t.format(x=x) for x in SUBJECTS for t in SUBJECT_TEMPLATES]
    prompts += [t.format(x=x) for x in names for t in PYTHON_TEMPLATES]
    assert not set(prompts) & set(EVAL_PROMPTS)
    return prompts


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# ---------------------------------------------------------------------------------------------
# 1. the text
# ---------------------------------------------------------------------------------------------


def generate_chat_docs(prompts: list[str], max_answer: int, llm=None, step: int = 64) -> tuple[list[list[int]], dict]:
    """SmolLM2's greedy answers, as token ids of the whole rendered conversation, ``step``
    prompts a call to ``llm`` (default: the contiguous engine, as this recipe was run)."""
    from minillm import LLM, SamplingParams

    if llm is None:
        llm = LLM(TARGET, mode="contiguous", max_num_seqs=32, num_threads=torch.get_num_threads())
    eos = sorted(llm.tokenizer.eos_token_ids)
    newline = llm.tokenizer.encode("\n", add_special_tokens=False)
    docs, finished, answer_tokens = [], 0, 0
    for i in range(0, len(prompts), step):
        outs = llm.generate([chat(p) for p in prompts[i : i + step]], SamplingParams(max_tokens=max_answer))
        for out in outs:
            ids = list(out.token_ids)
            if out.finish_reason == "stop":
                finished += 1
                if not ids or ids[-1] not in eos:
                    ids.append(eos[0])
                ids += newline  # the chat template closes every turn with "<|im_end|>\n"
            answer_tokens += len(out.token_ids)
            docs.append(list(out.prompt_token_ids) + ids)
        log(f"generated {min(i + step, len(prompts))}/{len(prompts)} answers ({answer_tokens:,} tokens)")
    stats = {"prompts": len(prompts), "answer_tokens": answer_tokens, "finished_with_eos": finished,
             "chat_tokens": sum(len(d) for d in docs), "max_answer_tokens": max_answer}  # fmt: skip
    return docs, stats


def windows_of(ids: list[int]) -> torch.Tensor:
    n = len(ids) // SEQ_LEN
    return torch.tensor(ids[: n * SEQ_LEN], dtype=torch.long).view(n, SEQ_LEN)


# ---------------------------------------------------------------------------------------------
# 2. the teacher
# ---------------------------------------------------------------------------------------------


@torch.inference_mode()
def teacher_topk(windows: torch.Tensor, topk: int, batch: int = 8) -> dict:
    """SmolLM2's top-k log-probabilities at every position of every window (and its own loss)."""
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.models.llama import ForwardBatch

    model = load_model(resolve_model(TARGET), torch.bfloat16)
    n = len(windows)
    logp = torch.empty(n, SEQ_LEN, topk)
    index = torch.empty(n, SEQ_LEN, topk, dtype=torch.int32)
    nll, start = 0.0, time.time()
    positions = torch.arange(SEQ_LEN)[None]
    for i in range(0, n, batch):
        x = windows[i : i + batch]
        lp = torch.log_softmax(model(ForwardBatch(x, positions.expand(len(x), -1))).float(), -1)
        nll += -lp[:, :-1].gather(-1, x[:, 1:, None]).sum().item()
        values, idx = lp.topk(topk, dim=-1)
        logp[i : i + batch], index[i : i + batch] = values, idx.to(torch.int32)
        if (i // batch) % 10 == 0:
            log(f"teacher {min(i + batch, n)}/{n} windows ({time.time() - start:.0f}s)")
    mass = logp.exp().sum(-1)
    return {"logp": logp, "index": index, "mass": mass.mean().item(),
            "loss": nll / (n * (SEQ_LEN - 1))}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 3. the draft
# ---------------------------------------------------------------------------------------------


def init_draft(layers: int):
    """A ``layers``-deep Llama with SmolLM2's width, its first layers, final norm and (frozen,
    tied) embedding."""
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.assets import resolve_model

    folder = resolve_model(TARGET)
    config = LlamaConfig.from_pretrained(str(folder), num_hidden_layers=layers)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    keep = tuple(f"model.layers.{i}." for i in range(layers)) + ("model.norm.", "model.embed_tokens.")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k).float() for k in f.keys() if k.startswith(keep)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def new_weights(model) -> dict[str, torch.Tensor]:
    """What the repository stores: everything but the shared embedding (and its tied head)."""
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
            if not k.startswith(("model.embed_tokens.", "lm_head."))}  # fmt: skip


def draft_logprobs(model, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=x).last_hidden_state
        logits = model.lm_head(hidden)
    return torch.log_softmax(logits.float(), -1)


def train_variant(kind: str, layers: int, windows: torch.Tensor, teacher: dict, args) -> tuple[object, dict]:
    """``kind`` "data": cross-entropy on the text; "distill": KL(teacher top-k || draft)."""
    model = init_draft(layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    gen = torch.Generator().manual_seed(SEED)  # the same batches, in the same order, for both variants
    order: list[int] = []
    curve, start = [], time.time()
    model.train()
    for step in range(args.steps):
        if len(order) < args.batch:
            order += torch.randperm(len(windows), generator=gen).tolist()
        idx, order = order[: args.batch], order[args.batch :]
        x = windows[idx]
        logq = draft_logprobs(model, x)
        if kind == "data":
            loss = -logq[:, :-1].gather(-1, x[:, 1:, None]).mean()
        else:
            lp = teacher["logp"][idx]
            p = torch.softmax(lp, -1)  # the top-k renormalised
            loss = (p * (torch.log(p.clamp_min(1e-12)) - logq.gather(-1, teacher["index"][idx].long()))).sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            curve.append([step, round(loss.item(), 4)])
            log(f"[{kind}] step {step:3d}/{args.steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)")
    model.eval()
    return model, {"wall_time_s": round(time.time() - start, 1), "loss_curve": curve, "final_loss": curve[-1][1]}


@torch.inference_mode()
def heldout_eval(model, windows: torch.Tensor, teacher_argmax: torch.Tensor) -> dict:
    """Perplexity on the held-out prose, and how often the draft's top-1 equals SmolLM2's."""
    nll, agree, n = 0.0, 0, 0
    for i in range(0, len(windows), 8):
        x = windows[i : i + 8]
        logq = draft_logprobs(model, x)
        nll += -logq[:, :-1].gather(-1, x[:, 1:, None]).sum().item()
        agree += int((logq.argmax(-1) == teacher_argmax[i : i + 8]).sum())
        n += x.numel()
    loss = nll / (len(windows) * (SEQ_LEN - 1))
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2),
            "top1_agreement": round(agree / n, 4)}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 4. the experiment: the draft in the engine
# ---------------------------------------------------------------------------------------------


def speculation(draft_folder: Path | None, k: int, max_tokens: int) -> dict:
    """SmolLM2 on the evaluation prompts, greedy, fp32; with ``draft_folder`` proposing ``k`` a step."""
    from minillm import LLM, SamplingParams

    spec = (
        None if draft_folder is None else {"method": "draft", "model": str(draft_folder), "num_speculative_tokens": k}
    )
    # fp32: in bf16 the (k+1)-token verify pass rounds differently from one-token decoding, so
    # SmolLM2's greedy text drifts from its plain output after a few dozen tokens and every draft
    # would be measured on a slightly different text. In fp32 it is the same text for all.
    llm = LLM(
        TARGET,
        dtype="fp32",
        speculative_config=spec,
        max_num_seqs=len(EVAL_PROMPTS),
        num_threads=torch.get_num_threads(),
    )
    outs = llm.generate([chat(p) for p in EVAL_PROMPTS], SamplingParams(max_tokens=max_tokens))
    m = [o.metrics for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    result = {
        "tokens": [list(o.token_ids) for o in outs],
        "forward_passes_per_token": round(sum(x.num_forward_passes for x in m) / tokens, 4),
    }
    if spec is not None:
        proposed, accepted, steps = (sum(getattr(x, a) for x in m) for a in ("spec_proposed", "spec_accepted",
                                                                             "num_verify_steps"))  # fmt: skip
        result.update(
            acceptance_rate=round(accepted / proposed, 4),
            mean_accepted_length=round(accepted / steps, 4),
            per_prompt=[{"prompt": p, "acceptance_rate": round(x.acceptance_rate, 4),
                         "mean_accepted_length": round(x.mean_accepted_length, 4),
                         "forward_passes_per_token": round(x.forward_passes_per_token, 4)}
                        for p, x in zip(EVAL_PROMPTS, m)],
        )  # fmt: skip
    return result


def save_variant(model, layers: int, out: Path) -> None:
    from safetensors.torch import save_file

    from minillm.assets import resolve_model

    config = json.loads((resolve_model(TARGET) / "config.json").read_text())
    config["num_hidden_layers"] = layers
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(new_weights(model), str(out / "model.safetensors"), metadata={"format": "pt"})


def write_card(out: Path, name: str, kind: str, record: dict, exp: dict) -> None:
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    d, s = exp["variants"]["data"], exp["variants"]["distill"]
    init = exp["init"]
    other = VARIANTS["data" if kind == "distill" else "distill"]
    loss = "KL(SmolLM2 || draft) on SmolLM2's top-{} distribution".format(record["topk"]) if kind == "distill" \
        else "next-token cross-entropy on the text alone"  # fmt: skip
    text = record["text"]
    (out / "README.md").write_text(f"""# {name}

A {record["config"]["num_hidden_layers"]}-layer draft model for speculative decoding with
SmolLM2-135M-Instruct (`smollm2-135m`), trained by `data/recipes/distill_smollm2_draft.py` with
**{loss}**.
Its twin `{other}` has the same architecture, initialisation, text, token budget and
optimizer, and the other loss: the pair is the distillation experiment of the course.

- **Architecture**: Llama, SmolLM2's width (hidden 576, 9 heads / 3 KV heads, head_dim 64, SwiGLU
  1536) with {record["config"]["num_hidden_layers"]} decoder layers instead of 30. It shares SmolLM2's tokenizer and its
  49152 x 576 embedding, which is also the tied LM head, kept frozen:
  {record["params"]["new"]:,} new parameters (layers + final norm) of {record["params"]["total"]:,}.
- **Storage**: this folder holds only the new weights (`model.safetensors`, bf16,
  {record["files"]["model.safetensors_bytes"] / 1e6:.1f} MB) and `config.json`.
  `minillm.assets.resolve_model("{name}")` assembles the complete HF folder once into the cache,
  adding SmolLM2's embedding, tokenizer and generation config.
- **Initialisation**: SmolLM2's first {record["config"]["num_hidden_layers"]} decoder layers and its final norm — layers
  that already read this embedding space.
- **Text**: SmolLM2's own greedy chat answers to {text["chat"]["prompts"]} template prompts (everyday subjects,
  Python reference topics; {text["chat"]["chat_tokens"]:,} tokens with the prompts) plus Python's reference manual
  (`{text["prose"]}`; {text["prose_tokens"]:,} tokens), in
  {text["windows"]} windows of {SEQ_LEN} tokens.
- **Training**: {record["steps"]} steps x {record["batch"]} windows x {SEQ_LEN} tokens ({record["tokens_seen"]:,} tokens),
  AdamW lr {record["lr"]}, cosine schedule, fp32 weights with bf16 autocast on CPU; wall time
  {record["train"]["wall_time_s"]:.0f} s (whole recipe: {record["wall_times_s"]["total"]:.0f} s).

## The experiment

SmolLM2 serving 8 held-out free-chat prompts, greedy, 64 tokens, fp32, the draft proposing
k = 4 tokens a step; perplexity and top-1 agreement with SmolLM2 on held-out prose (characters
0-40,000 of `pydoc_data.topics`; SmolLM2's own perplexity there: {exp["target_heldout_ppl"]:.1f}).

| draft | acceptance rate | mean accepted length | forward passes / token | held-out ppl | top-1 agreement |
|---|---|---|---|---|---|
| initialisation (untrained) | {init["acceptance_rate"]:.3f} | {init["mean_accepted_length"]:.2f} | {init["forward_passes_per_token"]:.3f} | {init["heldout_ppl"]:.2g} | {init["top1_agreement"]:.3f} |
| data alone (`smollm2-draft-data`) | {d["acceptance_rate"]:.3f} | {d["mean_accepted_length"]:.2f} | {d["forward_passes_per_token"]:.3f} | {d["heldout_ppl"]:.1f} | {d["top1_agreement"]:.3f} |
| distilled (`smollm2-draft`) | {s["acceptance_rate"]:.3f} | {s["mean_accepted_length"]:.2f} | {s["forward_passes_per_token"]:.3f} | {s["heldout_ppl"]:.1f} | {s["top1_agreement"]:.3f} |

Distilled minus data alone: acceptance rate {s["acceptance_rate"] - d["acceptance_rate"]:+.3f}, top-1 agreement
{s["top1_agreement"] - d["top1_agreement"]:+.3f}, held-out perplexity {s["heldout_ppl"] - d["heldout_ppl"]:+.1f}. Cross-entropy optimises
perplexity; distillation optimises matching SmolLM2, which is what a draft is for (8 prompts x
64 tokens make an acceptance rate noisy: the per-prompt figures are in `training.json`).

Greedy speculative decoding returns exactly SmolLM2's own tokens whichever draft proposes
(checked by the recipe: {exp["identical_to_target"]}). Per-prompt figures are in `training.json`.

A teaching model: it is only useful as a draft for SmolLM2-135M-Instruct.
""")


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the draft (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per variant")
    parser.add_argument("--batch", type=int, default=4, help=f"windows of {SEQ_LEN} tokens per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--topk", type=int, default=64, help="teacher tokens kept per position")
    parser.add_argument("--max-answer", type=int, default=128, help="tokens per generated chat answer")
    parser.add_argument("--prose-chars", type=int, default=200_000, help="training prose, from PROSE_TRAIN_START")
    parser.add_argument("--prompts", type=int, default=None, help="use only the first N training prompts")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per step in the experiment")
    parser.add_argument("--cache", type=Path, default=None, help="keep the generated text here and reuse it (pilots)")
    parser.add_argument("--no-save", action="store_true", help="do not write data/smollm2-draft*")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores; 1 on a busy shared machine)"
    )
    args = parser.parse_args()
    if set(args.variants) != set(VARIANTS) and not args.no_save:
        parser.error("--variants with one variant needs --no-save (the cards compare both)")
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    t0 = time.time()
    times: dict[str, float] = {}

    from minillm.assets import assemble_draft, resolve_model
    from minillm.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model(TARGET))
    prompts = training_prompts()[: args.prompts]
    log(f"{len(prompts)} training prompts, {len(EVAL_PROMPTS)} evaluation prompts")

    # 1. the text
    t = time.time()
    cached = args.cache / f"chat-{len(prompts)}-{args.max_answer}.json" if args.cache else None
    if cached is not None and cached.is_file():
        docs, chat_stats = json.loads(cached.read_text())
    else:
        docs, chat_stats = generate_chat_docs(prompts, args.max_answer)
        if cached is not None:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps([docs, chat_stats]))
    times["generate"] = round(time.time() - t, 1)
    prose = pydoc_text()
    prose_ids = tok.encode(prose[PROSE_TRAIN_START : PROSE_TRAIN_START + args.prose_chars], add_special_tokens=False)
    heldout_ids = tok.encode(prose[HELDOUT_CHARS[0] : HELDOUT_CHARS[1]], add_special_tokens=False)
    windows = windows_of([i for d in docs for i in d] + prose_ids)
    heldout = windows_of(heldout_ids)
    log(f"text: {chat_stats['chat_tokens']:,} chat + {len(prose_ids):,} prose tokens = {len(windows)} windows; "
        f"held out: {len(heldout)} windows ({times['generate']:.0f}s)")  # fmt: skip

    # 2. the teacher
    t = time.time()
    key = hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:12]
    cached = args.cache / f"teacher-{key}-{args.topk}.pt" if args.cache else None
    if "distill" not in args.variants:
        teacher = {"mass": None, "loss": None}
    elif cached is not None and cached.is_file():
        teacher = torch.load(cached)
    else:
        teacher = teacher_topk(windows, args.topk)
        if cached is not None:
            torch.save(teacher, cached)
    held_teacher = teacher_topk(heldout, 1)
    target_ppl = math.exp(held_teacher["loss"])
    times["teacher"] = round(time.time() - t, 1)
    log(
        f"teacher: top-{args.topk} mass {teacher['mass']}, SmolLM2 held-out ppl {target_ppl:.2f} ({times['teacher']:.0f}s)"
    )
    teacher_argmax = held_teacher["index"][..., 0].long()

    # 3. the variants, and the experiment
    t = time.time()
    init = init_draft(args.layers).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_variant(init, args.layers, Path(tmp) / "src")
        folder = assemble_draft(Path(tmp) / "src", resolve_model(TARGET), Path(tmp) / "init")
        init_result = {**speculation(folder, args.k, 64), **heldout_eval(init, heldout, teacher_argmax)}
    reference = speculation(None, args.k, 64)
    times["evaluate_init_and_target"] = round(time.time() - t, 1)
    log(f"init: acceptance {init_result['acceptance_rate']:.3f}, held-out ppl {init_result['heldout_ppl']:.1f}")

    results, trained = {}, {}
    for kind in args.variants:
        model, train = train_variant(kind, args.layers, windows, teacher, args)
        times[f"train_{kind}"] = train["wall_time_s"]
        t = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src" if args.no_save else DATA / VARIANTS[kind]
            save_variant(model, args.layers, src)
            folder = assemble_draft(src, resolve_model(TARGET), Path(tmp) / "full")
            spec = speculation(folder, args.k, 64)
            sizes = {"model.safetensors_bytes": (src / "model.safetensors").stat().st_size,
                     "model.safetensors_sha256_16": file_digest(src / "model.safetensors")}  # fmt: skip
        times[f"evaluate_{kind}"] = round(time.time() - t, 1)
        results[kind] = {**spec, **heldout_eval(model, heldout, teacher_argmax)}
        trained[kind] = {"train": train, "files": sizes,
                         "params": {"new": sum(v.numel() for v in new_weights(model).values()),
                                    "total": sum(p.numel() for p in model.parameters())}}  # fmt: skip
        log(f"[{kind}] acceptance {spec['acceptance_rate']:.3f}, mean accepted {spec['mean_accepted_length']:.2f}, "
            f"passes/token {spec['forward_passes_per_token']:.3f}, held-out ppl {results[kind]['heldout_ppl']:.1f}, "
            f"top-1 agreement {results[kind]['top1_agreement']:.3f}")  # fmt: skip
    times["total"] = round(time.time() - t0, 1)

    identical = all(r["tokens"] == reference["tokens"] for r in [init_result, *results.values()])
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens"}  # noqa: E731
    experiment = {
        "prompts": EVAL_PROMPTS, "k": args.k, "max_tokens": 64, "greedy": True,
        "target_forward_passes_per_token": reference["forward_passes_per_token"],
        "target_heldout_ppl": round(target_ppl, 2), "identical_to_target": identical,
        "init": strip(init_result), "variants": {k: strip(v) for k, v in results.items()},
    }  # fmt: skip
    log(f"wall times: {times}")
    print(json.dumps({k: {m: v.get(m) for m in ("acceptance_rate", "mean_accepted_length",
                                                 "forward_passes_per_token", "heldout_ppl", "top1_agreement")}
                      for k, v in {"init": init_result, **results}.items()}, indent=2))  # fmt: skip
    if args.no_save or set(args.variants) != set(VARIANTS):
        return
    for kind, name in VARIANTS.items():
        record = {
            "name": name, "variant": kind, "loss": "kl_topk" if kind == "distill" else "cross_entropy",
            "target": "SmolLM2-135M-Instruct", "config": {"num_hidden_layers": args.layers, "hidden_size": 576,
            "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64},
            "init": f"SmolLM2 layers 0-{args.layers - 1} + final norm; embedding/tied head shared and frozen",
            **trained[kind], "steps": args.steps, "batch": args.batch, "seq_len": SEQ_LEN,
            "tokens_seen": args.steps * args.batch * SEQ_LEN, "lr": args.lr, "optimizer": "AdamW(0.9, 0.95), wd 0, "
            "5% warmup, cosine to 10%, grad clip 1.0", "topk": args.topk, "temperature": 1.0, "seed": SEED, "threads": torch.get_num_threads(),
            "teacher_topk_mass": round(teacher["mass"], 4), "text": {"chat": chat_stats,
            "prose": f"pydoc_data.topics chars {PROSE_TRAIN_START}-{PROSE_TRAIN_START + args.prose_chars}",
            "prose_tokens": len(prose_ids), "windows": len(windows), "heldout": f"pydoc_data.topics chars "
            f"{HELDOUT_CHARS[0]}-{HELDOUT_CHARS[1]}", "heldout_tokens": len(heldout) * SEQ_LEN},
            "wall_times_s": times, "experiment": experiment,
        }  # fmt: skip
        write_card(DATA / name, name, kind, record, experiment)
    log(f"wrote {', '.join(str(DATA / n) for n in VARIANTS.values())}")


if __name__ == "__main__":
    main()
