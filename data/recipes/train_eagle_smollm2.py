"""Recipe: a feature-level (EAGLE) draft head for SmolLM2-135M-Instruct, by self-distillation.

    python data/recipes/train_eagle_smollm2.py                  # the committed head: ~50 min on 2 CPU cores
    python data/recipes/train_eagle_smollm2.py --chats 200 --steps 100 --top1-only --no-save   # a pilot

What it builds (``minillm/speculative/eagle.py``): one decoder layer that reads SmolLM2's own
last hidden state ``f_t`` and the embedding of the next token ``x_{t+1}`` and predicts the next
feature ``f̂_{t+1}``; SmolLM2's final norm and the rows of its tied head for the
``--draft-vocab`` tokens it produces most often turn that into a guess for ``x_{t+2}``.

**Text** (``training_chats``): SmolLM2's own answers (up to ``--max-answer`` tokens), from the
default compiled engine, to chat prompts over 290 topics — general subjects and Python's
reference-manual topics — in up to 31 phrasings each, in a fixed shuffled order of which the
first ``--chats`` are used (3,500: 875 of them go on for a second user turn from
``FOLLOW_UPS``; temperatures 0, 0.7 and 1 in turn, seeded), rendered with the chat template;
plus ``--prose-chars`` of Python's reference manual (the draft recipe's training slice). **34
whole topics are held out** (``topics``: every ninth general subject, and the subjects of the
draft recipe's evaluation prompts): no training chat names one, under any phrasing. SmolLM2
then runs once over 256-token windows of that text: its last hidden state at every position
(the features) and its greedy next token there (the labels) — labels are SmolLM2's choice also
where the text was sampled. Nothing but SmolLM2 and the Python standard library's text is used.

**Loss** (as EAGLE): a smooth-L1 regression of ``f̂_{t+1}`` onto SmolLM2's ``f_{t+1}`` (scaled
by the features' standard deviation) plus ``--ce-weight`` × the cross-entropy of the reduced
head against SmolLM2's distribution over the draft vocabulary at ``t+1``, as EAGLE's code does
(``--no-soft``: against its greedy token). Input features get Gaussian noise (``--noise`` × their
standard deviation): at run-ahead the head reads its own, imperfect, features. Batches of
``--batch`` windows in one call, AdamW at ``--lr`` (warm-up, then a cosine to a tenth).
**Initialisation**: the layer from SmolLM2's last decoder
layer (it already reads late features), ``fc`` as ``[I, 0]`` (start from the feature itself).

**Evaluation** (``evaluate``): teacher-forced top-1 on SmolLM2's greedy answers (64 tokens) to
the held-out chats (``held_out_chats``: the draft recipe's 8 evaluation prompts and one prompt
per held-out topic) and to 16 training chats; tokens per verify pass of ``tree.tree_generate``
on 12 held-out chats for a chain of 4 and trees of 2 and 3 branches; and chain drafting at k = 4
in the engine on the held-out chats (acceptance, accepted tokens per verify step), the head
against prompt lookup.

``--cache DIR`` keeps the generated chats and SmolLM2's features for another run (a run over
the first n chats reads them from a run over more); ``training.json`` records each phase's own
seconds and ``recipe_from_scratch``, what a run without a cache takes.

Stores ``data/smollm2-eagle/`` (``config.json``, ``model.safetensors`` in bf16 with the
vocabulary subset, ``training.json`` with the record of this run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")  # autocast: bf16 in, fp32 norm

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "smollm2-eagle"
TARGET = "smollm2-135m"
SEQ_LEN = 256
SEED = 1234
GENERATE_STEP = 512  # chats per generate call (the engine batches up to 128 of them a step)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def distill_recipe():
    """The draft recipe's prompts and chat generation (one source for both drafts' text)."""
    spec = importlib.util.spec_from_file_location("distill_smollm2_draft", HERE / "distill_smollm2_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Subjects and phrasings beyond the draft recipe's, for variety (``--narrow`` leaves them out).
MORE_SUBJECTS = [
    "glaciers", "tides", "lightning", "tornadoes", "coral reefs", "owls", "whales", "ants", "octopuses",
    "wolves", "sharks", "butterflies", "mushrooms", "oak trees", "cacti", "sunflowers", "bamboo", "rivers",
    "caves", "islands", "the Sahara", "the Amazon river", "the Arctic", "Mars", "Jupiter", "comets", "the sun",
    "telescopes", "satellites", "rockets", "the International Space Station", "electricity", "magnets",
    "batteries", "wind turbines", "nuclear power", "steam engines", "clocks", "compasses", "bridges",
    "skyscrapers", "tunnels", "roads", "airports", "ships", "submarines", "hot air balloons", "helicopters",
    "smartphones", "email", "video games", "robots", "3D printing", "databases", "encryption", "passwords",
    "spreadsheets", "open source software", "operating systems", "web browsers", "search engines",
    "social media", "podcasts", "photography", "film making", "painting", "sculpture", "architecture",
    "poetry", "novels", "fairy tales", "mythology", "theatre", "opera", "the guitar", "the violin", "drums",
    "singing", "dancing", "knitting", "pottery", "woodworking", "cooking rice", "soup", "pizza", "cheese",
    "apples", "bananas", "spices", "vegetables", "breakfast", "healthy eating", "vitamins", "the immune system",
    "the brain", "bones", "muscles", "the lungs", "sleep", "dreams", "memory", "habits", "stress", "happiness",
    "kindness", "teamwork", "leadership", "negotiation", "job interviews", "writing a resume", "saving money",
    "budgeting", "taxes", "banks", "inflation", "trade", "markets", "small businesses", "advertising",
    "city planning", "public transport", "elections", "human rights", "the United Nations", "history museums",
    "ancient Greece", "the Vikings", "the Middle Ages", "the Renaissance", "the Industrial Revolution",
    "the Silk Road", "castles", "pyramids", "maps", "languages", "learning a language", "grammar",
    "punctuation", "mathematics", "fractions", "prime numbers", "geometry", "probability", "statistics",
    "algebra", "the number zero", "chemistry", "atoms", "acids and bases", "rust", "salt", "plastic", "glass",
    "paper", "cotton", "wool", "recycling batteries", "composting", "pollution", "oceans", "forests",
    "biodiversity", "evolution", "genetics", "bacteria", "viruses", "fossils", "weather forecasts", "snow",
    "clouds", "rainbows", "sunsets", "camping", "hiking", "swimming", "football", "basketball", "tennis",
    "yoga", "chess openings", "board games", "puzzles", "magic tricks", "birthdays", "holidays", "weddings",
    "gardening in winter", "houseplants", "pets", "horses", "birds", "fish", "frogs", "snakes", "spiders",
]  # fmt: skip
MORE_TEMPLATES = [
    "What is {x}?",
    "Why are {x} important?",
    "How would you describe {x} to a friend?",
    "Give me five facts about {x}.",
    "Write a short story about {x}.",
    "What are the pros and cons of {x}?",
    "Summarize what people should know about {x}.",
    "Write a limerick about {x}.",
    "What questions do children often ask about {x}?",
    "Describe {x} in three sentences.",
    "What is a common misconception about {x}?",
    "List some words related to {x}.",
    "How has {x} changed over time?",
    "Write an encouraging note about {x}.",
]


#: More phrasings (templates), for variety; each one is asked of every training topic.
EVEN_MORE_TEMPLATES = [
    "Explain {x} step by step.",
    "Write a short email to a friend about {x}.",
    "What would happen if there were no {x}?",
    "Write a tweet about {x}.",
    "Write a short dialogue between two people discussing {x}.",
    "In simple words, how does {x} work?",
    "What is the history of {x}?",
    "Give me some practical advice related to {x}.",
    "Create a quiz question about {x}, with its answer.",
    "What do experts disagree about when it comes to {x}?",
    "Teach me one surprising thing about {x}.",
    "Write a motivational quote inspired by {x}.",
]
#: Second user turns: a quarter of the training chats go on for one more exchange.
FOLLOW_UPS = [
    "Can you give me an example?", "Explain that more simply.", "Summarize your answer in one sentence.",
    "Why is that?", "Tell me more.", "Can you make it shorter?", "What else should I know?",
    "Thanks! Can you turn that into a list?",
]  # fmt: skip
#: Sampling temperatures, in turn over the training chats (0 is greedy): the head meets the
#: contexts SmolLM2 reaches when users sample, while its labels stay SmolLM2's greedy choice.
TEMPERATURES = (0.0, 0.7, 1.0)
#: Whole topics never trained on: every ninth general subject, and the subjects of the draft
#: recipe's evaluation prompts (oceans, rainbows, viruses, bacteria, the sky's colours,
#: breakfast) and Python's sequence types (its "reverse a list" question).
HELD_OUT_NEAR_EVAL = ["oceans", "rainbows", "viruses", "bacteria", "sunsets", "breakfast", "sequence types",
                      "mutable sequence types"]  # fmt: skip


def topics() -> tuple[list[str], list[str], list[str]]:
    """(general subjects, Python topics, held-out topics): the held-out ones appear in no
    training prompt, under any phrasing."""
    recipe = distill_recipe()
    general = list(dict.fromkeys(recipe.SUBJECTS + MORE_SUBJECTS))
    python = [p.split(" in Python")[0].removeprefix("Explain ").removeprefix("What should a beginner know about ")
              for p in recipe.training_prompts() if p.endswith("in Python with a short example.")]  # fmt: skip
    held = list(dict.fromkeys(general[4::9] + HELD_OUT_NEAR_EVAL))
    return general, python, held


def training_chats(narrow: bool) -> list[dict]:
    """The training conversations, in a fixed shuffled order: ``{"prompt", "temperature",
    "seed", "follow_up"}``. ``narrow``: the draft recipe's 408 prompts alone, greedy, one
    turn (the first committed head's text). None is about a held-out topic."""
    recipe = distill_recipe()
    general, python, held = topics()
    if narrow:
        prompts = recipe.training_prompts()
    else:
        templates = recipe.SUBJECT_TEMPLATES + MORE_TEMPLATES + EVEN_MORE_TEMPLATES
        prompts = [t.format(x=x) for x in general if x not in held for t in templates]
        prompts += [t.format(x=x) for x in python if x not in held for t in recipe.PYTHON_TEMPLATES]
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(SEED)).tolist()
    chats = []
    for n, i in enumerate(order):
        temperature = 0.0 if narrow else TEMPERATURES[n % len(TEMPERATURES)]
        follow = None if narrow or n % 4 else FOLLOW_UPS[(n // 4) % len(FOLLOW_UPS)]
        chats.append({"prompt": prompts[i], "temperature": temperature, "seed": SEED + n, "follow_up": follow})
    return chats


def held_out_chats() -> list[str]:
    """The evaluation prompts: the draft recipe's eight, then one per held-out topic (its
    phrasing in turn over the templates) — whole topics no training chat mentions."""
    recipe = distill_recipe()
    _, _, held = topics()
    templates = recipe.SUBJECT_TEMPLATES + MORE_TEMPLATES + EVEN_MORE_TEMPLATES
    return recipe.EVAL_PROMPTS + [templates[i % len(templates)].format(x=x) for i, x in enumerate(held)]


def generate_chat_docs(chats: list[dict], max_answer: int) -> tuple[list[list[int]], dict]:
    """SmolLM2's answers, as token ids of the whole rendered conversation, from the default
    engine (its compiled decode step at up to 128 sequences a step). A chat with a follow-up
    is kept only as its two-turn conversation."""
    from minillm import LLM, SamplingParams

    llm = LLM(TARGET, max_num_seqs=128, num_threads=torch.get_num_threads())
    log(f"decode step: {llm.wait_for_fast_path()}")
    eos = sorted(llm.tokenizer.eos_token_ids)
    newline = llm.tokenizer.encode("\n", add_special_tokens=False)

    def params(c: dict) -> SamplingParams:
        return SamplingParams(max_tokens=max_answer, temperature=c["temperature"], seed=c["seed"])

    def doc(out) -> list[int]:
        ids = list(out.token_ids)
        if out.finish_reason == "stop":
            if not ids or ids[-1] not in eos:
                ids.append(eos[0])
            ids += newline  # the chat template closes every turn with "<|im_end|>\n"
        return list(out.prompt_token_ids) + ids

    docs, answer_tokens, started, step = [], 0, time.time(), GENERATE_STEP
    for i in range(0, len(chats), step):
        batch = chats[i : i + step]
        firsts = llm.generate([[{"role": "user", "content": c["prompt"]}] for c in batch], [params(c) for c in batch])
        answer_tokens += sum(len(o.token_ids) for o in firsts)
        again = [(c, o) for c, o in zip(batch, firsts) if c["follow_up"]]
        docs += [doc(o) for c, o in zip(batch, firsts) if not c["follow_up"]]
        seconds = [[{"role": "user", "content": c["prompt"]}, {"role": "assistant", "content": o.text},
                    {"role": "user", "content": c["follow_up"]}] for c, o in again]  # fmt: skip
        outs = llm.generate(seconds, [params(c) for c, _ in again])
        answer_tokens += sum(len(o.token_ids) for o in outs)
        docs += [doc(o) for o in outs]
        log(f"generated {min(i + step, len(chats))}/{len(chats)} chats ({answer_tokens:,} answer tokens, "
            f"{answer_tokens / (time.time() - started):.0f} tok/s)")  # fmt: skip
    llm.close()
    stats = {"chats": len(chats), "two_turn": sum(bool(c["follow_up"]) for c in chats),
             "temperatures": list(TEMPERATURES), "answer_tokens": answer_tokens,
             "chat_tokens": sum(len(d) for d in docs), "max_answer_tokens": max_answer,
             "seconds": round(time.time() - started)}  # fmt: skip
    return docs, stats


def target_features(windows: torch.Tensor, batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """SmolLM2's last hidden states ``[n, SEQ_LEN, hidden]`` (bf16) and greedy next tokens."""
    from minillm.assets import resolve_model
    from minillm.attention.contiguous import ForwardBatch
    from minillm.models import load_model

    model = load_model(resolve_model(TARGET), torch.bfloat16)
    n = len(windows)
    feats = torch.empty(n, SEQ_LEN, model.config.hidden_size, dtype=torch.bfloat16)
    labels = torch.empty(n, SEQ_LEN, dtype=torch.long)
    positions = torch.arange(SEQ_LEN)[None]
    with torch.inference_mode():
        for i in range(0, n, batch):
            x = windows[i : i + batch]
            logits, hidden = model.forward_with_hidden(ForwardBatch(x, positions.expand(len(x), -1)))
            feats[i : i + batch] = hidden.view(len(x), SEQ_LEN, -1)
            labels[i : i + batch] = logits.argmax(-1)
    return feats, labels


def init_head(vocab_ids: torch.Tensor):
    """An ``EagleHead`` over SmolLM2 (bf16, frozen), its layer from SmolLM2's last, fp32 weights."""
    from safetensors import safe_open

    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.models import load_model
    from minillm.speculative.eagle import EagleConfig, EagleHead

    folder = resolve_model(TARGET)
    mc = ModelConfig.from_folder(folder)
    target = load_model(folder, torch.bfloat16, max_positions=4096)
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = EagleConfig(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size,
                      mc.rms_norm_eps, len(vocab_ids), TARGET)  # fmt: skip
    head = EagleHead(cfg, target, vocab_ids).float()
    last = f"model.layers.{mc.num_layers - 1}."
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "down_proj": "mlp.down_proj", "input_norm": "input_layernorm",
             "post_norm": "post_attention_layernorm"}  # fmt: skip
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f, torch.no_grad():
        for ours, theirs in names.items():
            getattr(head, ours).weight.copy_(f.get_tensor(f"{last}{theirs}.weight").float())
        h = mc.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :h] = torch.eye(h)
    return head, target


def train(head, feats, labels, windows, vocab_ids, args) -> list[dict]:
    """EAGLE's loss over batches of windows: features regressed (smooth L1, in units of the
    features' standard deviation), plus ``ce_weight`` x the cross-entropy of the reduced head
    against SmolLM2's own distribution over the draft vocabulary at ``t+1`` (``--soft``, as
    EAGLE's code does: its head applied to the true feature), or against its greedy token.

    The loss is compiled (``torch.compile``, unless ``--eager``): most of an eager step is not
    the matrix products but the softmax and cross-entropy over ``[batch, 255, draft vocab]`` and
    their gradients, which the compiler fuses — 0.25 s a step against 0.34 s eager (Intel Xeon,
    2 threads, batch 8, soft loss over 8,192 tokens: ``benchmarks/results/train-eagle-pilots-2026-12-06/``,
    p0 compiled, exp2 eager; the compile itself takes ~20 s once)."""
    index = torch.full((head.target[0].config.vocab_size,), -100, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    sigma = feats[: min(len(feats), 256)].float().std().item()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    gen = torch.Generator().manual_seed(SEED)
    positions = torch.arange(SEQ_LEN - 1)

    def losses(noisy: torch.Tensor, x: torch.Tensor, f: torch.Tensor, target: torch.Tensor):
        """(f_t + noise, x_{t+1}) -> f̂_{t+1}: its regression loss, cross-entropy and scores."""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred, _, _ = head(noisy, x, positions)
            reg = F.smooth_l1_loss(pred.float() / sigma, f / sigma)
            scores = head.logits(pred).float()
            if args.soft:
                with torch.no_grad():
                    p = head.logits(f).float().softmax(-1)
                ce = -(p * scores.log_softmax(-1)).sum(-1).mean()
            else:
                ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), ignore_index=-100)
        return reg, ce, scores

    step_losses = losses if getattr(args, "eager", False) else torch.compile(losses)
    curve, order, start = [], [], time.time()
    head.train()
    for step in range(args.steps):
        if len(order) < args.batch:
            order += torch.randperm(len(windows), generator=gen).tolist()
        idx, order = order[: args.batch], order[args.batch :]
        f, x, y = feats[idx].float(), windows[idx], index[labels[idx]]
        noisy = f[:, :-1] + args.noise * sigma * torch.randn(f[:, :-1].shape, generator=gen)
        target = y[:, 1:]  # SmolLM2's next token after x_{t+1}
        reg, ce, scores = step_losses(noisy, x[:, 1:], f[:, 1:], target)
        loss = reg + args.ce_weight * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == args.steps - 1:
            keep = target >= 0
            hits, counted = int((scores.detach().argmax(-1)[keep] == target[keep]).sum()), int(keep.sum())
            record = {"step": step, "reg": float(reg.detach()), "ce": float(ce.detach()),
                      "top1": hits / max(counted, 1), "seconds": round(time.time() - start, 1)}  # fmt: skip
            curve.append(record)
            log(f"step {step}: reg {record['reg']:.3f} ce {record['ce']:.3f} top-1 {record['top1']:.3f}")
    head.eval()
    return curve


def teacher_forced_top1(llm, head, prompts: list[str], max_tokens: int = 64) -> dict:
    """How often the head's first guess is SmolLM2's next token, fed SmolLM2's true features
    (teacher forcing, as in training), at every position of SmolLM2's greedy answers."""
    from minillm import SamplingParams
    from minillm.attention.contiguous import ForwardBatch

    outs = llm.generate([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=max_tokens))
    hits = total = 0
    for out in outs:
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        x = torch.tensor([ids])
        with torch.inference_mode():
            logits, hidden = llm.model.forward_with_hidden(ForwardBatch(x, torch.arange(len(ids))[None]))
            nexts = logits.argmax(-1)[0]  # SmolLM2's next token at every position
            pred, _, _ = head(hidden[:-1], x[0, 1:], torch.arange(len(ids) - 1))  # (f_t, x_{t+1}) -> f̂_{t+1}
            guesses = head.vocab_ids[head.logits(pred).argmax(-1)]  # its guess for x_{t+2}
        start = len(out.prompt_token_ids)
        agree = guesses[start - 1 : len(ids) - 2] == nexts[start : len(ids) - 1]
        hits, total = hits + int(agree.sum()), total + agree.numel()
    return {"prompts": len(prompts), "positions": total, "top1": hits / max(total, 1)}


def tokens_per_pass(llm, head, prompts: list[str], max_tokens: int = 48) -> dict:
    """Tokens emitted per target pass (``tree.tree_generate``, greedy, over a contiguous cache):
    a chain of 4 against trees of 2 and 3 branches of 4 — what a tree buys, from the head alone."""
    from minillm.speculative.tree import tree_generate

    out = {}
    for branches in (1, 2, 3):
        passes = tokens = 0
        for p in prompts:
            ids = llm.tokenizer.encode(
                llm.tokenizer.render_chat([{"role": "user", "content": p}]), add_special_tokens=False
            )
            got = tree_generate(llm.model, head, ids, max_tokens, depth=4, branches=branches)
            passes, tokens = passes + got["passes"] - 1, tokens + len(got["token_ids"]) - 1  # the prefill left out
        out[f"{branches} x 4"] = tokens / passes
    log(f"tokens per verify pass on held-out chats: {out}")
    return out


def speculation(spec: dict, prompts: list[str], k: int = 4, max_tokens: int = 64) -> dict:
    """Chain drafting at a fixed ``k`` (the governor off: every verify step proposes ``k``)."""
    from minillm import LLM, SamplingParams

    llm = LLM(TARGET, compile=False, speculative_config={**spec, "num_speculative_tokens": k, "adaptive": False})
    outs = llm.generate([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=max_tokens))
    llm.close()
    proposed = sum(o.metrics.spec_proposed for o in outs)
    accepted = sum(o.metrics.spec_accepted for o in outs)
    steps = sum(o.metrics.num_verify_steps for o in outs)
    return {"k": k, "prompts": len(prompts), "acceptance_rate": accepted / max(proposed, 1),
            "accepted_per_step": accepted / max(steps, 1),
            "passes_per_token": sum(o.metrics.num_forward_passes for o in outs) / sum(len(o.token_ids) for o in outs)}  # fmt: skip


def evaluate(folder: Path, top1_only: bool = False) -> dict:
    """Held-out and trained-on teacher-forced top-1, and chain acceptance on held-out chats."""
    from minillm import LLM
    from minillm.speculative.eagle import load_eagle_head

    llm = LLM(TARGET, compile=False)
    head = load_eagle_head(folder, llm.model)
    trained = [c["prompt"] for c in training_chats(False)[:16]]
    result = {"held_out": teacher_forced_top1(llm, head, held_out_chats()),
              "trained_on": teacher_forced_top1(llm, head, trained)}  # fmt: skip
    if not top1_only:
        result["tree_generate_held_out"] = tokens_per_pass(llm, head, held_out_chats()[:12])
    llm.close()
    log(
        f"teacher-forced top-1: held out {result['held_out']['top1']:.1%}, trained on {result['trained_on']['top1']:.1%}"
    )
    if top1_only:
        return result
    result["chain_k4_held_out"] = {
        "eagle": speculation({"method": "eagle", "model": str(folder)}, held_out_chats()),
        "ngram": speculation({"method": "ngram"}, held_out_chats()),
    }
    return result


def docs_key(chats: list[dict], max_answer: int) -> str:
    import hashlib

    return hashlib.sha256(json.dumps([chats, max_answer]).encode()).hexdigest()[:16]


def in_chat_order(docs: list[list[int]], chats: list[dict], step: int = GENERATE_STEP) -> list[list[int]]:
    """``generate_chat_docs`` lists each call's one-turn chats, then its two-turn ones: back in
    the chats' order."""
    out, at = [], 0
    for i in range(0, len(chats), step):
        batch = chats[i : i + step]
        one = [j for j, c in enumerate(batch) if not c["follow_up"]]
        two = [j for j, c in enumerate(batch) if c["follow_up"]]
        placed = dict(zip(one + two, docs[at : at + len(batch)]))
        out += [placed[j] for j in range(len(batch))]
        at += len(batch)
    return out


def cached_docs(chats: list[dict], args) -> tuple[list[list[int]], dict]:
    """``generate_chat_docs``, kept in ``--cache`` (keyed by the chats and answer length) so a
    second training run skips the generation; its record keeps the generation's own seconds."""

    path = Path(args.cache) / f"chat-docs-{docs_key(chats, args.max_answer)}.pt" if args.cache else None
    if path is not None and path.exists():
        docs, stats = torch.load(path)
        log(f"chats from {path} (generated in {stats['seconds']} s)")
        return docs, {**stats, "from_cache": str(path.name)}
    every = training_chats(args.narrow)
    whole = Path(args.cache) / f"chat-docs-{docs_key(every, args.max_answer)}.pt" if args.cache else None
    if whole is not None and whole.exists() and chats == every[: len(chats)]:
        docs, stats = torch.load(whole)  # the first len(chats) chats' answers, from the run over them all
        docs = in_chat_order(docs, every)[: len(chats)]
        stats = {**stats, "chats": len(chats), "two_turn": sum(bool(c["follow_up"]) for c in chats),
                 "answer_tokens": None, "chat_tokens": sum(len(d) for d in docs),
                 "seconds": round(stats["seconds"] * len(chats) / len(every)), "from_cache": f"{whole.name}, first {len(chats)}"}  # fmt: skip
        log(f"the first {len(chats)} chats from {whole} (their share of its generation: {stats['seconds']} s)")
        return docs, stats
    docs, stats = generate_chat_docs(chats, args.max_answer)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save((docs, stats), path)
    return docs, stats


def cached_features(windows: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``target_features``, kept in ``--cache`` beside the chats (keyed by the windows), with
    the seconds the pass took when it ran."""
    import hashlib

    key = hashlib.sha256(windows.numpy().tobytes()).hexdigest()[:16]
    path = Path(args.cache) / f"features-{key}.pt" if args.cache else None
    if path is not None and path.exists():
        feats, labels, seconds = torch.load(path)
        log(f"SmolLM2's features from {path} (computed in {seconds} s)")
        args.features_from_cache = True
        return feats, labels, seconds
    mark = time.time()
    feats, labels = target_features(windows)
    seconds = round(time.time() - mark)
    if path is not None:
        torch.save((feats, labels, seconds), path)
    return feats, labels, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chats", type=int, default=3500, help="training chats, the first of the fixed order")
    parser.add_argument("--max-answer", type=int, default=128)
    parser.add_argument("--draft-vocab", type=int, default=4096, help="the head's output tokens")
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--lr", type=float, default=4e-3)
    parser.add_argument("--ce-weight", type=float, default=0.5)
    parser.add_argument(
        "--soft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cross-entropy against SmolLM2's distribution (--no-soft: against its greedy token)",
    )
    parser.add_argument(
        "--prose-chars", type=int, default=400_000, help="reference-manual text, from the draft recipe's training slice"
    )
    parser.add_argument("--eager", action="store_true", help="train without compiling the loss (slower, same loss)")
    parser.add_argument("--noise", type=float, default=0.05, help="Gaussian noise on input features, x their std")
    parser.add_argument(
        "--narrow", action="store_true", help="only the draft recipe's 408 prompts (the first head's text)"
    )
    parser.add_argument("--cache", default=None, help="a folder to keep the generated chats in, for another run")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--top1-only", action="store_true", help="evaluate teacher-forced top-1 only (a pilot)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    began = time.time()
    recipe = distill_recipe()
    chats = training_chats(args.narrow)[: args.chats]
    docs, text_stats = cached_docs(chats, args)
    seconds = {"generate": text_stats["seconds"]}
    from minillm.assets import resolve_model
    from minillm.tokenizer import Tokenizer

    prose = recipe.pydoc_text()[recipe.PROSE_TRAIN_START : recipe.PROSE_TRAIN_START + args.prose_chars]
    prose_ids = Tokenizer(resolve_model(TARGET)).encode(prose, add_special_tokens=False)
    text_stats["prose_tokens"] = len(prose_ids)
    ids = [t for d in docs for t in d] + prose_ids
    windows = recipe.windows_of(ids)
    log(f"{len(windows)} windows of {SEQ_LEN} tokens")
    feats, labels, seconds["features"] = cached_features(windows, args)
    log(f"SmolLM2's features and next tokens ({seconds['features']} s)")
    counts = torch.bincount(labels.flatten(), minlength=49152)
    vocab_ids = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    coverage = counts[vocab_ids].sum().item() / counts.sum().item()
    log(f"draft vocabulary: {len(vocab_ids)} tokens cover {coverage:.1%} of SmolLM2's next tokens")
    head, _ = init_head(vocab_ids)
    mark = time.time()
    curve = train(head, feats, labels, windows, vocab_ids, args)
    seconds["train"] = round(time.time() - mark)
    record = {"args": vars(args), "text": text_stats, "held_out_topics": topics()[2], "windows": len(windows),
              "vocab_coverage": coverage, "curve": curve, "torch": torch.__version__}  # fmt: skip
    out = Path(args.out) if not args.no_save else Path(tempfile.mkdtemp(prefix="eagle-"))
    from minillm.speculative.eagle import save_eagle_head

    save_eagle_head(head, out)
    log(f"saved {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB); evaluating")
    del feats
    mark = time.time()
    record["evaluation"] = evaluate(out, args.top1_only)
    seconds["evaluate"] = round(time.time() - mark)
    from minillm.machine import machine_description

    record["machine"] = machine_description(torch.device("cpu"))
    seconds["this_run"] = round(time.time() - began)
    cached = seconds["generate"] * ("from_cache" in text_stats) + seconds["features"] * getattr(
        args, "features_from_cache", False
    )
    seconds["recipe_from_scratch"] = seconds["this_run"] + cached  # what a run without --cache takes
    record["seconds"] = seconds
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    log(json.dumps({"evaluation": record["evaluation"], "seconds": seconds}))


if __name__ == "__main__":
    main()
