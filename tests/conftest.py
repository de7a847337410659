"""Shared fixtures: tiny random-weight models in HF format, built locally (no hub), and the
real SmolLM2 asset (converted once per machine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from minillm.machine import triton_available

if triton_available():  # tests write Triton kernels of their own: triton ready for this machine, first
    import minillm.triton_setup  # noqa: F401

# Engines stay eager unless a test asks for compile=True (as `make test` sets it too): compiling
# every model and pool the suite builds would take hours.
os.environ.setdefault("MINILLM_COMPILE", "0")
# The compiles a test asks for run at normal priority. As shipped the compiler is niced to 19, so
# that it takes only what a learner's engine leaves; beside the other worker's tests it starved
# (a tiny model's compile beside two busy threads: 439 s against 76 s alone). The tests whose
# subject is the background compile as shipped, and chapters 00/01/10, unset it.
os.environ.setdefault("MINILLM_COMPILE_NICENESS", "0")

# `make test` runs two workers on two cores: each keeps to one thread, and so do the processes its
# tests start (servers, ranks, notebook kernels), unless a test sets its own. Two processes of two
# OpenMP threads each on two cores wait on each other's barriers: in the first two-worker run
# (AMD EPYC, 2 cores) the suite's work took 1.2x less time than one worker's, not 2x, and a
# notebook ran up to three times slower than alone. The tests that measure the machine itself
# run alone, with the machine's own thread count (marked `quiet`).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Every step checks the runner's incrementally updated block tables against the block manager's
# lists: preemption, prefix caching, forks, rollbacks and sliding windows all run through them.
from minillm.runtime.block_table_rows import BlockTableRows  # noqa: E402

BlockTableRows.verify = True

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Caches keep keys and values; attention reads them back. Ünïcödé: café, naïve, 東京, 🙂. 0123456789 "
)


def build_tokenizer(folder: Path) -> int:
    """A small byte-level BPE tokenizer with ChatML special tokens; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 20, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    return tok.get_vocab_size()


TINY_VARIANTS = {
    # name: (transformers config class name, overrides)
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "qwen2_bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False)),
    "llama_untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_head_dim": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "mistral_window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "linear_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
}


def child_pids() -> set[int]:
    """This process's live children. Tests that check nothing was left behind compare it before
    and after: an earlier test's engine may hold workers until the garbage collector runs."""
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children()}


def build_tiny_model(folder: Path, variant: str, seed: int = 0, **extra) -> Path:
    """Random-weight HF model of a given variant (``extra``: more config overrides), saved as
    safetensors with our tokenizer."""
    import transformers

    cls_name, overrides = TINY_VARIANTS[variant]
    vocab = build_tokenizer(folder)
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        initializer_range=0.2,  # peaky logits, so greedy argmax is not decided by rounding
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    kwargs.update(overrides, **extra)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF leaves biases at zero; make Qwen2's q/k/v bias actually matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_tiny_model(root / name, name) for name in TINY_VARIANTS}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from minillm.assets import REGISTRY, gguf_path, resolve_model

    try:
        gguf_path(REGISTRY["smollm2-135m"])
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return resolve_model("smollm2-135m")


def hf_model(folder: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------
# Two workers (`make test` runs `pytest -n 2 --dist loadscope`): what runs where, in what order
# ---------------------------------------------------------------------------------------------

# Modules whose tests share no costly module-scoped fixture: their tests are spread over the
# workers one by one. Every other module runs whole on one worker, so a fixture it builds once
# (a compiled engine, a server) is built once, not once per worker.
SPREAD_MODULES = {
    "test_notebooks.py",
    "test_mutation_sweep.py",
    "test_check_catalogue.py",
    "test_course_build.py",
    "test_grading_isolation.py",
    "test_grading_attacks.py",
    "test_quantization.py",
} | set(filter(None, os.environ.get("MINILLM_TEST_SPREAD_ALSO", "").split(",")))  # test_suite_order's real runs
DURATIONS = Path(__file__).with_name("durations.json")  # seconds per test, from the last measured run
UNKNOWN_S = 0.5
NOTEBOOK_S = 40.0  # a notebook not yet in durations.json


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or itself in a spread module."""
    module = nodeid.split("::")[0]
    return nodeid if Path(module).name in SPREAD_MODULES else module


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with our units: xdist's own scheduler, which sends a scope's tests to
    one worker, scoped by ``unit_of``. (``loadgroup``'s ``xdist_group`` marks do nothing under
    pytest 9, whose node ids no longer take xdist's group suffix: with them, make test's modules
    were scattered test by test and every module-scoped fixture was built on both workers.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config, items):
    """Longest work first, so that the last minutes do not wait on one long test: each module
    (or each test of a spread module) is a unit of work; units go out in order of their
    measured seconds (``durations.json``). Outside xdist the order is left as written.
    ``tests/test_suite_order.py`` checks both halves (grouping and order), the grouping in a
    real two-worker run."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's workers collect; its controller only schedules
        return
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(unit_of(item.nodeid), []).append(item)

    def cost(item) -> float:
        default = NOTEBOOK_S if item.get_closest_marker("notebook") else UNKNOWN_S
        return seconds.get(item.nodeid, default)

    ordered = sorted(units.values(), key=lambda unit: -sum(cost(i) for i in unit))  # stable: ties keep file order
    items[:] = [item for unit in ordered for item in unit]
