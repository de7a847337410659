"""The feature-level (EAGLE) draft head: the runner hands over the target's hidden states, the
head drafts from them incrementally exactly as in one pass, and the engine's greedy output is
the target's alone — with accepted runs and rollbacks, preemption and prefix hits — plus every
bad option named."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.assets import resolve_model
from minillm.config import ModelConfig
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.models import load_model
from minillm.speculative.eagle import EagleConfig, EagleHead, EagleProposer, load_eagle_head, save_eagle_head

TARGET = "tiny-shakespeare-8m"
PROMPTS = [
    "KING.\nNow is the winter",
    "ROMEO.\nBut soft, what light through yonder window breaks? It is the east",
    "HAMLET.\nTo be, or not to be, that is the question. To be, or not",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
]


def random_head(folder, target_name: str = TARGET, vocab: int = 48, seed: int = 0):
    """An untrained head over ``target_name`` (its most common ids: the first ``vocab``), saved."""
    target = load_model(resolve_model(target_name), torch.float32)
    mc = target.config
    cfg = EagleConfig(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size,
                      mc.rms_norm_eps, vocab, target_name)  # fmt: skip
    torch.manual_seed(seed)
    head = EagleHead(cfg, target, torch.arange(vocab))
    save_eagle_head(head, folder)
    return folder


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return random_head(tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def reference():
    llm = LLM(TARGET, dtype="fp32")
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))]


def eagle(head_dir, k: int = 3) -> dict:
    """Always k proposals: these tests count what the head proposed (the governor: test_governor.py)."""
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": k, "adaptive": False}


def test_the_runner_hands_over_every_tokens_hidden_state():
    """``StepInputs.want_hidden``: per chunk, the last layer's output at each of its tokens —
    the same numbers a separate pass gives, in the chunks' order (not the runner's)."""
    llm = LLM(TARGET, dtype="fp32")
    runner = llm.engine.runner
    from minillm.runtime.runner import ChunkInput, StepInputs

    blocks = llm.engine.block_manager
    ids = llm.tokenizer.encode(PROMPTS[2])
    table = list(range(1, 1 + -(-len(ids) // blocks.block_size)))
    chunks = [ChunkInput("a", ids, 0, 1, table)]
    runner.execute(StepInputs(chunks, want_hidden=True))
    (prefill,) = runner.last_hidden
    decode = ChunkInput("a", [ids[-1]], len(ids), 1, table + [table[-1] + 1])
    prompt = ChunkInput("b", ids[:5], 0, 1, [table[-1] + 2])
    runner.execute(StepInputs([prompt, decode], want_hidden=True))  # the runner puts decodes first
    assert [h.shape[0] for h in runner.last_hidden] == [5, 1]
    torch.testing.assert_close(runner.last_hidden[0], prefill[:5], atol=1e-4, rtol=1e-4)  # another batch: fp32 rounding
    from minillm.attention.contiguous import ForwardBatch

    whole = ids + [ids[-1]]
    _, hidden = llm.model.forward_with_hidden(ForwardBatch(torch.tensor([whole]), torch.arange(len(whole))[None]))
    torch.testing.assert_close(prefill, hidden[: len(ids)], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runner.last_hidden[1], hidden[-1:], atol=1e-4, rtol=1e-4)
    runner.execute(StepInputs(chunks))
    assert runner.last_hidden is None  # only when asked


def test_drafting_step_by_step_matches_one_pass(head_dir):
    """The proposer builds the draft layer's keys position by position — catching up on the
    target's features as they arrive — and predicts what one pass over all positions predicts."""
    target = load_model(resolve_model(TARGET), torch.float32)
    head = load_eagle_head(head_dir, target)
    feats = torch.randn(12, target.config.hidden_size)
    tokens = torch.randint(0, 40, (13,))
    with torch.inference_mode():
        whole, k_all, v_all = head(feats, tokens[1:], torch.arange(12))
        first, k1, v1 = head(feats[:5], tokens[1:6], torch.arange(5))
        rest, k2, v2 = head(feats[5:], tokens[6:], torch.arange(5, 12), k1, v1)
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([k1, k2]), k_all)

    class Seq:  # what the proposer reads of a sequence
        request_id, params = "s", SamplingParams(temperature=0)

        def __init__(self, ids):
            self.token_ids = ids

        def __len__(self):
            return len(self.token_ids)

    proposer = EagleProposer(head)
    seq = Seq(tokens[:8].tolist())
    proposer.observe(["s"], [0], [feats[:7]], [seq])  # the target computed positions 0..6
    with torch.inference_mode():
        proposals, _ = proposer.propose([seq], [1])["s"]
        seq.token_ids = tokens.tolist()  # five more tokens accepted; their features arrive
        proposer.observe(["s"], [7], [feats[7:12]], [seq])
        proposals2, _ = proposer.propose([seq], [1])["s"]
        expected = [int(head.vocab_ids[head.logits(whole[i : i + 1])[0].argmax()]) for i in (6, 11)]
    assert [proposals[0], proposals2[0]] == expected
    state = proposer.states["s"]
    torch.testing.assert_close(state.k[:12], k_all, atol=1e-4, rtol=1e-4)  # only true keys were kept


class FakeSeq:
    """What the proposer reads of a sequence."""

    params = SamplingParams(temperature=0)

    def __init__(self, request_id, ids):
        self.request_id, self.token_ids = request_id, ids

    def __len__(self):
        return len(self.token_ids)


def test_catching_up_together_is_each_sequence_alone(head_dir):
    """Sequences that resume proposing catch up in one call of the head (each row masked to its
    own sequence): the proposals, chains and trees, and the draft keys kept are what each
    sequence catching up alone gives."""
    target = load_model(resolve_model(TARGET), torch.float32)
    head = load_eagle_head(head_dir, target)
    torch.manual_seed(1)
    lengths = {"a": 20, "b": 9, "c": 31}
    feats = {r: torch.randn(n, target.config.hidden_size) for r, n in lengths.items()}
    tokens = {r: torch.randint(0, 40, (n + 1,)).tolist() for r, n in lengths.items()}
    together, alone = EagleProposer(head), EagleProposer(head)
    calls = []
    forward = head.forward
    head.forward = lambda *a, **kw: calls.append(len(a[0])) or forward(*a, **kw)
    for cut in ((3, 6, 2), (11, 9, 17), (20, 9, 31)):  # each round: how far each sequence has come
        seqs = {}
        for r, m in zip(lengths, cut):
            for proposer in (together, alone):
                seq = proposer.states[r].seq if r in proposer.states else FakeSeq(r, [])
                seq.token_ids = tokens[r][: m + 1]
                start = proposer.states[r].hi if r in proposer.states else 0
                proposer.observe([r], [start], [feats[r][start:m]], [seq])
                seqs.setdefault(r, []).append(seq)
        with torch.inference_mode():
            calls.clear()
            both = together.propose([s for s, _ in seqs.values()], [1, 1, 1])
            assert len(calls) == 1  # three catch-ups, one call
            each = {r: alone.propose([s], [1])[r] for r, (_, s) in seqs.items()}
            assert {r: p[0] for r, p in both.items()} == {r: p[0] for r, p in each.items()}
            for r in lengths:
                a, b = together.states[r], alone.states[r]
                assert a.filled == b.filled
                torch.testing.assert_close(a.k[: a.filled - a.kv_lo], b.k[: b.filled - b.kv_lo], atol=1e-4, rtol=1e-4)
            trees = together.propose_trees([s for s, _ in seqs.values()], [6, 6, 6], 3, 2)
            assert trees == {r: alone.propose_trees([s], [6], 3, 2)[r] for r, (_, s) in seqs.items()}
    head.forward = forward


def test_a_long_catch_up_and_a_seeded_sampled_request_run_alone(head_dir):
    """A shared call's attention grows with the square of all its rows: a catch-up longer than
    ``SHARED_CATCH_UP_MAX`` (a whole prompt after its prefill) runs alone; so does a seeded
    sampled request's, whose draws must not depend on which others propose."""
    target = load_model(resolve_model(TARGET), torch.float32)
    head = load_eagle_head(head_dir, target)
    proposer, calls = EagleProposer(head), []
    forward = head.forward
    head.forward = lambda *a, **kw: calls.append(len(a[0])) or forward(*a, **kw)
    torch.manual_seed(2)
    behind = {"short": 3, "also short": 5, "long": EagleProposer.SHARED_CATCH_UP_MAX + 16, "seeded": 4}
    seqs = []
    for r, n in behind.items():
        seq = FakeSeq(r, torch.randint(0, 40, (n + 1,)).tolist())
        if r == "seeded":
            seq.params, seq.generator = SamplingParams(temperature=0.8, seed=3), torch.Generator().manual_seed(3)
        proposer.observe([r], [0], [torch.randn(n, target.config.hidden_size)], [seq])
        seqs.append(seq)
    with torch.inference_mode():
        proposer.propose(seqs, [1] * len(seqs))
    head.forward = forward
    assert sorted(calls) == sorted([3 + 5, behind["long"], 4])  # the two short ones shared a call


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_eagle_reproduces_the_target_alone(head_dir, reference, k):
    llm = LLM(TARGET, dtype="fp32", speculative_config=eagle(head_dir, k))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.spec_proposed for o in outs) > 0
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.speculator.draft.states


def test_accepted_runs_rollbacks_preemption_and_prefix_hits(head_dir, reference, monkeypatch):
    """The head's machinery runs as usual, but its first guess each step is replaced by the
    target's own next token and its second by a wrong one: some proposals are accepted, some
    rolled back — in a pool small enough to preempt, and on a second round that hits the prefix
    cache. The tokens never change."""
    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(resolve_model(TARGET)), torch.float32)
    tokenizer_llm = LLM(TARGET, dtype="fp32")
    truth = {tuple(tokenizer_llm.tokenizer.encode(p)): r for p, r in zip(PROMPTS, reference)}
    propose_one = EagleProposer._propose_one

    def right_then_wrong(self, seq, state, k):
        proposals, dists = propose_one(self, seq, state, k)
        future = truth[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :]
        if len(future) >= 2:
            proposals = [future[0], (future[1] + 1) % 40, *proposals[2:]][: len(proposals)]
        return proposals, dists

    monkeypatch.setattr(EagleProposer, "_propose_one", right_then_wrong)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    small = LLM(TARGET, dtype="fp32", speculative_config=eagle(head_dir, 3), max_num_batched_tokens=6,
                block_size=4, kv_cache_memory=14 * per_block, max_model_len=64)  # fmt: skip
    outs = small.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.num_preemptions for o in outs) > 0
    proposed, accepted = sum(o.metrics.spec_proposed for o in outs), sum(o.metrics.spec_accepted for o in outs)
    assert 0 < accepted < proposed
    small.engine.block_manager.check_invariants()
    cached = LLM(TARGET, dtype="fp32", speculative_config=eagle(head_dir, 3), block_size=4)
    for _ in range(2):
        outs = cached.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == reference
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert sum(o.metrics.spec_accepted for o in outs) > 0


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle' needs model=NAME_OR_PATH"),
        ({"method": "eagle", "model": "x", "num_speculative_tokens": 2, "quantization": "int8"}, "unknown key"),
        ({"method": "eagle", "model": "no-such-head", "num_speculative_tokens": 2}, "no-such-head"),
    ],
)
def test_bad_eagle_configs_are_named(spec, message):
    with pytest.raises(Exception, match=message):
        LLM(TARGET, speculative_config=spec)


def test_a_head_for_another_target_is_refused(tmp_path, head_dir):
    with pytest.raises(ValueError, match="not an EAGLE draft head"):
        LLM(TARGET, speculative_config=eagle(resolve_model("tiny-shakespeare-1m")))
    other = random_head(tmp_path / "mha", "tiny-shakespeare-mha")  # hidden 128, 4 heads: not the 8m's 256, 8
    with pytest.raises(ValueError, match="an EAGLE head for hidden 128 / 4 heads, not this target's 256 / 8"):
        LLM(TARGET, speculative_config=eagle(other))


@pytest.mark.slow
def test_smollm2_eagle_in_fp32_reproduces_the_target_alone():
    """The committed head over the real model: SmolLM2's own greedy tokens in fp32, with some
    of the head's proposals accepted."""
    chat = [{"role": "user", "content": "Explain how a rainbow forms."}]
    params = SamplingParams(max_tokens=32)
    plain = LLM("smollm2-135m", dtype="fp32").generate([chat], params)[0]
    spec = {"method": "eagle", "model": "smollm2-eagle", "num_speculative_tokens": 3, "adaptive": False}
    out = LLM("smollm2-135m", dtype="fp32", speculative_config=spec).generate([chat], params)[0]
    assert out.token_ids == plain.token_ids
    assert out.metrics.spec_accepted > 0 and out.metrics.forward_passes_per_token < 1


def test_a_bf16_head_on_cpu_runs_prepacked_with_the_plain_arithmetic(head_dir, monkeypatch):
    """On CPU a bf16 head holds its matrices prepacked for oneDNN (one or two rows a call, where
    plain bf16 matmuls are slow), and where it can run, packed for our few-row bf16 kernel too;
    its features, keys, values and scores equal the plain path's either way."""
    from minillm.layers import cpu_bf16_rows
    from minillm.layers.cpu_prepack import prepack_available

    if not prepack_available(torch.bfloat16):
        pytest.skip("this PyTorch build cannot prepack bf16 linear layers")
    cpu_bf16_rows.unavailable_reason()  # asked first: the head uses the kernel once it is built
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "1")
    target = load_model(resolve_model(TARGET), torch.bfloat16)
    head = load_eagle_head(head_dir, target)
    assert set(head.packed) == {"fc", "qkv", "o", "gate_up", "down", "head"}
    assert set(head.rows_packed) == (set(head.packed) if cpu_bf16_rows.cpu_supports() else set())
    gen = torch.Generator().manual_seed(3)
    h, kv, d = target.config.hidden_size, target.config.num_kv_heads, target.config.head_dim
    feats = torch.randn(3, h, generator=gen).to(torch.bfloat16)
    tokens, positions = torch.tensor([4, 9, 2]), torch.tensor([7, 8, 9])
    past_k = torch.randn(7, kv, d, generator=gen).to(torch.bfloat16)
    past_v = torch.randn(7, kv, d, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        paths = {}
        for path in ("few-row kernel", "oneDNN", "plain"):
            if path == "oneDNN":
                head.rows_packed = {}
            if path == "plain":
                head.packed = {}
            out = [*head(feats, tokens, positions, past_k, past_v)]
            paths[path] = [*out, head.logits(out[0])]
    for path in ("few-row kernel", "oneDNN"):
        for a, b in zip(paths[path], paths["plain"]):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2, msg=path)


def test_a_bf16_head_multiplies_few_rows_through_the_bf16_kernel_where_the_compiled_step_does(head_dir, monkeypatch):
    """Where our few-row bf16 kernel serves the compiled step (a CPU with AVX-512 BF16; here
    forced on with ``MINILLM_CPU_BF16_ROWS=1``), the head's six matrices are packed for it too and
    its proposals' products of up to ``FEW_ROWS`` rows run through it (its Python function, by
    name: counted) — once the kernel is built, never building it on the caller's thread; more rows (a
    long prompt's catch-up) go to oneDNN; ``=0`` packs nothing for it."""
    from minillm.layers import cpu_bf16_rows
    from minillm.layers.cpu_prepack import prepack_available

    if cpu_bf16_rows.unavailable_reason() is not None or not prepack_available(torch.bfloat16):
        pytest.skip(f"the kernel cannot run here: {cpu_bf16_rows.unavailable_reason()}")
    target = load_model(resolve_model(TARGET), torch.bfloat16)
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "0")
    assert load_eagle_head(head_dir, target).rows_packed == {}
    monkeypatch.setenv("MINILLM_CPU_BF16_ROWS", "1")
    head = load_eagle_head(head_dir, target)
    assert set(head.rows_packed) == {"fc", "qkv", "o", "gate_up", "down", "head"}
    h = target.config.hidden_size

    calls = []
    through = cpu_bf16_rows.linear_bf16_rows
    monkeypatch.setattr(cpu_bf16_rows, "linear_bf16_rows", lambda x, packed: calls.append(1) or through(x, packed))

    def kernel_calls(rows: int) -> int:
        feats = torch.randn(rows, h).to(torch.bfloat16)
        tokens, positions = torch.arange(rows) + 4, torch.arange(rows)
        calls.clear()
        with torch.inference_mode():
            head.logits(head(feats, tokens, positions)[0])
        return len(calls)

    assert kernel_calls(3) == 6 and kernel_calls(cpu_bf16_rows.FEW_ROWS) == 6
    assert kernel_calls(cpu_bf16_rows.FEW_ROWS + 1) == 0
    monkeypatch.setattr(cpu_bf16_rows, "ready", lambda: False)  # not built yet: oneDNN, no waiting
    assert kernel_calls(3) == 0


def test_a_batch_of_training_windows_is_each_window_alone(head_dir):
    """The recipe trains on ``[B, T]`` windows in one call: each window causal over itself, as
    the head's one-sequence pass computes it."""
    target = load_model(resolve_model(TARGET), torch.float32)
    head = load_eagle_head(head_dir, target)
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 12, target.config.hidden_size, generator=gen)
    tokens = torch.randint(0, 48, (3, 12), generator=gen)
    positions = torch.arange(12)
    with torch.no_grad():
        batched, k, _ = head(feats, tokens, positions)
        assert batched.shape == feats.shape and k.shape[:2] == (3, 12)
        for i in range(3):
            alone, _, _ = head(feats[i], tokens[i], positions)
            torch.testing.assert_close(batched[i], alone, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no past"):
        head(feats, tokens, positions, k[0], k[0])


def test_the_eagle_recipe_holds_out_whole_topics():
    """``data/recipes/train_eagle_smollm2.py``: no training chat names a held-out topic or is an
    evaluation prompt; the chats mix temperatures and second turns, in a fixed order."""
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "recipes" / "train_eagle_smollm2.py"
    spec = importlib.util.spec_from_file_location("train_eagle_smollm2", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    general, python, held = recipe.topics()
    chats = recipe.training_chats(False)
    prompts = [c["prompt"] for c in chats]
    assert len(held) >= 30 and len(chats) > 5000
    for topic in held:
        named = re.compile(rf"(?<![A-Za-z]){re.escape(topic)}(?![A-Za-z])")
        assert not [p for p in prompts if named.search(p)], topic
    evaluation = recipe.held_out_chats()
    assert len(evaluation) == 8 + len(held) and not set(evaluation) & set(prompts)
    assert {c["temperature"] for c in chats} == set(recipe.TEMPERATURES)
    assert 0.2 < sum(bool(c["follow_up"]) for c in chats) / len(chats) < 0.3
    assert chats == recipe.training_chats(False)
    # a run over the first n chats reads them from a run over all: back in the chats' order
    # (each generate call lists its one-turn chats, then its two-turn ones)
    calls = [chats[i : i + recipe.GENERATE_STEP] for i in range(0, len(chats), recipe.GENERATE_STEP)]
    as_generated = [[c["seed"]] for call in calls for c in sorted(call, key=lambda c: bool(c["follow_up"]))]
    assert recipe.in_chat_order(as_generated, chats)[:1100] == [[c["seed"]] for c in chats[:1100]]
