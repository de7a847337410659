"""The speculation governor (``speculative/governor.py``): per batch size, propose as many tokens
as the engine's own steps show pays. Unit tests on recorded rates; then the engine on a
simulated clock — a pass that costs per token (compute-bound: proposals never pay at batch 8)
and one that costs the same whatever it holds (weight-bound: they do) — where the decisions are
deterministic, shown in ``resolved.speculation``, and never change a greedy token or a seeded
sampled request's tokens."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch

from minillm import LLMEngine, SamplingParams
from minillm.assets import resolve_model
from minillm.config import ModelConfig, SpeculativeConfig
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.speculative.governor import SpeculationGovernor
from minillm.speculative.ngram import kind_of_text, match_length

TARGET = "tiny-shakespeare-8m"
PROMPTS = ["ROMEO:\nBut soft, what light", "KING HENRY:\nOnce more unto the breach", "HAMLET:\nTo be, or not",
           "JULIET:\nO Romeo, Romeo", "MACBETH:\nIs this a dagger", "PORTIA:\nThe quality of mercy",
           "LEAR:\nBlow, winds", "PROSPERO:\nOur revels now are ended"]  # fmt: skip


def test_candidates_are_powers_of_two_below_k_with_k_and_plain():
    assert SpeculationGovernor(4).candidates == [0, 1, 2, 4]
    assert SpeculationGovernor(6).candidates == [0, 1, 2, 4, 6]
    assert SpeculationGovernor(1).candidates == [0, 1]


def test_starts_on_k_sweeps_once_then_keeps_the_fastest_exploring_within_its_budget():
    gov = SpeculationGovernor(4)
    speed = {0: 100.0, 1: 90.0, 2: 80.0, 4: 60.0}  # at 8 running: plain decoding is fastest
    picks = []
    for _ in range(400):
        k = gov.choose(8)
        picks.append(k)
        gov.record(8, k, int(speed[k]), 1.0)
    assert picks[:4] == [4, 0, 1, 2]  # the configured k (as the engine always did), then each other once
    assert gov.best(8) == 0 and gov.best(15) == 0  # 8-15 running share a class
    late = picks[4:]
    lost = sum(1 - speed[k] / speed[0] for k in late) / len(late)  # step-times lost to exploring, per step
    assert 0 < lost <= gov.EXPLORE_BUDGET * 1.2, lost  # the slower candidates together cost about the budget
    assert late.count(4) < late.count(1)  # the costly candidate is re-measured least often
    # another batch size starts from the nearest one's choice, then sweeps its own
    assert gov.choose(4) == 0 and gov.best(4) is None


def test_a_candidate_tried_on_a_step_with_a_prefill_waits_before_its_next_try():
    """A step with a prefill chunk is no evidence (nothing is recorded): the candidate it tried
    must not be picked again at once, or mixed steps would keep replacing the best with it."""
    gov = SpeculationGovernor(4)
    assert gov.choose(8) == 4
    gov.record(8, 4, 100, 1.0)
    assert gov.choose(8) == 0  # the sweep's next candidate — its step then held a prefill: not recorded
    picks = [gov.choose(8) for _ in range(gov.MIN_GAP - 1)]
    assert 0 not in picks and picks[:2] == [1, 2]  # the others, then the best measured, until MIN_GAP passes
    assert gov.choose(8) == 0


def test_a_candidate_that_becomes_faster_wins_again():
    gov = SpeculationGovernor(2)
    speed = {0: 100.0, 1: 50.0, 2: 40.0}
    for _ in range(40):
        k = gov.choose(4)
        gov.record(4, k, int(speed[k]), 1.0)
    assert gov.best(4) == 0
    speed[2] = 300.0  # acceptance improved: the text turned repetitive
    for _ in range(200):  # k=2 measured at 0.4x waits 2 · (1 - 0.4) / EXPLORE_BUDGET = 60 steps for its next try
        k = gov.choose(4)
        gov.record(4, k, int(speed[k]), 1.0)
    assert gov.best(4) == 2


def test_one_lucky_step_does_not_crown_a_slower_candidate():
    """A step's rate swings with how many proposals it happened to accept: the estimate is a plain
    mean of a candidate's first steps, then a moving average light enough that one step three
    times its usual rate leaves a candidate measured over many steps where it was."""
    gov = SpeculationGovernor(6)
    gov.choose(1)
    for _ in range(40):
        gov.record(1, 6, 12, 0.1)  # 120 tok/s
        gov.record(1, 2, 10, 0.1)  # 100 tok/s
    gov.record(1, 2, 30, 0.1)  # one step at 300 tok/s
    assert gov.best(1) == 6
    rates = [gov.sizes[(1, None)][k].tokens_per_second for k in (2, 6)]
    assert 100 < rates[0] < 111 and rates[1] == pytest.approx(120)
    fresh = SpeculationGovernor(2)
    fresh.choose(1)
    fresh.record(1, 2, 10, 0.1)
    fresh.record(1, 2, 30, 0.1)
    assert fresh.sizes[(1, None)][2].tokens_per_second == pytest.approx(200)  # two steps: their plain mean


def test_the_rate_is_tokens_over_time_not_a_mean_of_step_rates():
    """Ten tokens in 0.1 s, then ten in 0.3 s (the machine was busy): 20 tokens in 0.4 s is
    50 tok/s; the mean of the two steps' rates (100 and 33) would say 67."""
    gov = SpeculationGovernor(2)
    gov.choose(1)
    gov.record(1, 2, 10, 0.1)
    gov.record(1, 2, 10, 0.3)
    assert gov.sizes[(1, None)][2].tokens_per_second == pytest.approx(50)


def test_a_try_that_makes_more_tokens_at_the_same_rate_costs_more_and_waits_longer():
    """At 0.6x the best's rate, a try whose step emits 20 tokens (and takes 2.5 times as long as
    one that emits 8) loses 2.5 times the time: it waits 2.5 times as many steps."""
    gaps = []
    for tokens in (8, 20):
        gov = SpeculationGovernor(4)
        gov.choose(8)
        for _ in range(30):
            gov.record(8, 0, 8, 0.01)  # plain: 800 tok/s
        gov.record(8, 4, tokens, tokens / 480)  # one try of k=4: 480 tok/s, whatever it emits
        sizes = gov.sizes[(8, None)]
        gaps.append(gov._gap(sizes, 0, 4))
    lost = 8 / 480 / 0.01 - 1  # 8 tokens, a plain step's: 1/0.6 - 1 of its step-times lost
    assert gaps[0] == pytest.approx(lost * 3 / SpeculationGovernor.EXPLORE_BUDGET)
    assert gaps[1] == pytest.approx(2.5 * gaps[0])


def test_a_costly_candidate_found_slower_again_and_again_is_tried_less_often_until_it_wins():
    """Each try that leaves a candidate slower and loses half a step or more doubles its wait,
    up to BACKOFF times (where proposals never pay, re-measuring them costs ever less); a cheap
    try is repeated at its own pace; one that wins starts afresh."""

    def gaps_of_tries(gov, speed, steps=3000):
        tries = []
        for n in range(steps):
            k = gov.choose(8)
            if k == 1:
                tries.append(n)
            gov.record(8, k, int(speed[k]), 1.0)
        return [b - a for a, b in zip(tries, tries[1:])]

    gov, speed = SpeculationGovernor(1), {0: 100.0, 1: 40.0}
    gaps = gaps_of_tries(gov, speed)
    base = (1 - 0.4) / gov.EXPLORE_BUDGET  # a try loses 0.6 step-times; one other candidate: 30 steps
    # (the configured k was the best at its first step, before plain decoding was measured)
    assert gaps[:5] == [base, base, 2 * base, 4 * base, 4 * base], gaps[:5]
    assert set(gaps[4:]) == {gov.BACKOFF * base}
    speed[1] = 300.0  # proposals now pay: found at the next try, and kept
    gaps_of_tries(gov, speed, 200)
    assert gov.best(8) == 1 and gov.sizes[(8, None)][1].misses == 0
    cheap = gaps_of_tries(SpeculationGovernor(1), {0: 100.0, 1: 60.0})  # a try loses 0.4 step-times
    assert set(cheap) == {(1 - 0.6) / SpeculationGovernor.EXPLORE_BUDGET}


def test_describe_names_each_batch_size_and_its_choice():
    gov = SpeculationGovernor(4)
    for _ in range(30):
        k = gov.choose(8)
        gov.record(8, k, 100 if k == 0 else 50, 1.0)
    assert gov.describe().startswith("k=4 adaptive; 8+ running: plain (100.0 tok/s, k=4 50.0)")


def test_each_kind_of_text_is_measured_apart():
    """Prompt lookup tells copying from free text before it proposes (``ngram.kind_of_text``):
    what proposing pays on one must not decide for the other, however the two alternate."""
    gov = SpeculationGovernor(8)
    speed = {"copying": {0: 100.0, 1: 140.0, 2: 180.0, 4: 230.0, 8: 260.0},
             "free text": {0: 100.0, 1: 95.0, 2: 85.0, 4: 70.0, 8: 50.0}}  # fmt: skip
    for step in range(600):
        text = "copying" if (step // 50) % 2 else "free text"  # blocks of 50 steps each
        k = gov.choose(1, text)
        gov.record(1, k, int(speed[text][k]), 1.0, text)
    assert gov.best(1, "copying") == 8 and gov.best(1, "free text") == 0 and gov.best(1) is None
    said = gov.describe()
    assert "; 1 running, copying: k=8 (260.0 tok/s, plain 100.0)" in said, said
    assert "; 1 running, free text: plain (100.0 tok/s, k=8 50.0)" in said, said
    # a new batch size starts from the nearest one measured on the same kind of text
    assert gov.choose(2, "copying") == 8 and gov.choose(2, "free text") == 0
    assert gov.choose(2) == 8  # nothing measured without a kind: the configured k


def test_the_kind_of_text_is_told_by_the_matches():
    assert kind_of_text([]) is None and kind_of_text([0, 0]) is None  # nothing to propose
    assert kind_of_text([1]) == "free text" and kind_of_text([2, 0, 1]) == "free text"
    assert kind_of_text([3]) == "copying" and kind_of_text([0, 1, 4, 2]) == "copying"  # one of them copies


def test_prompt_lookup_tells_the_governor_the_kind_of_text_and_a_step_without_a_match_is_no_evidence():
    engine = LLMEngine(TARGET, dtype="fp32", compile=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    speculator, kinds = engine.speculator, collections.Counter()
    propose = speculator.propose

    def checked(running, waiting=0):
        decoding = [s for s in running if s.is_decoding]
        expected = kind_of_text([match_length(s.token_ids) for s in decoding if speculator.eligible(s)])
        decided = dict(speculator.governor.decisions)
        propose(running, waiting)
        batch, _, text = speculator._step
        if expected is None:  # no proposals, no decision, nothing recorded after the step
            assert batch == 0 and text is None and speculator.governor.decisions == decided
            assert not any(s.draft_tokens for s in running)
        else:  # at batch 1 the sequence's kind; prompt lookup at batch 2+: one measurement
            assert text == (expected if len(decoding) == 1 else None), (len(decoding), expected, text)
        kinds[(min(len(decoding), 2), expected)] += 1

    speculator.propose = checked
    for i, prompt in enumerate(PROMPTS[:3]):  # the last one decodes alone for its last 40 tokens
        engine.add_request(prompt, SamplingParams(max_tokens=24 + 40 * (i == 2), temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    said = engine.resolved.speculation
    engine.close()
    assert kinds[(1, "free text")] and kinds[(1, "copying")] and kinds[(2, "free text")], kinds  # each happened
    assert any(expected is None for _, expected in kinds), kinds
    assert "1 running, copying: " in said and "1 running, free text: " in said and "2+ running: " in said, said


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_adaptive_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="adaptive"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "adaptive": bad})


def run(cost, params, spec=None, speculate=True):
    """Every prompt at once on a simulated clock whose passes cost ``cost(tokens)``: the outputs,
    what the engine says it decided, the simulated seconds, and per step: sequences running,
    tokens proposed."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, **(spec or {})}
    engine = LLMEngine(TARGET, dtype="fp32", compile=False, speculative_config=spec if speculate else None,
                       max_num_seqs=8)  # fmt: skip
    proposed = []
    with engine.simulated_time(cost) as clock:
        for prompt in PROMPTS:
            engine.add_request(prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                if d.output is not None:
                    outputs[d.request_id] = d.output
            running = engine.scheduler.running
            proposed.append((len(running), sum(len(s.draft_tokens) for s in running)))
        seconds = clock.now
        said = engine.resolved.speculation  # inside: leaving the simulated clock forgets what it measured
    governor = getattr(engine.speculator, "governor", None)
    assert governor is None or governor.sizes == {}
    engine.close()
    return [outputs[i] for i in sorted(outputs)], said, seconds, proposed


GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def test_when_proposals_cannot_pay_it_turns_them_off_says_so_and_is_not_slower():
    plain, _, plain_s, _ = run(lambda tokens: 1e-3 * tokens, GREEDY, speculate=False)
    adaptive, said, adaptive_s, proposed = run(lambda tokens: 1e-3 * tokens, GREEDY)
    fixed, said_fixed, fixed_s, _ = run(lambda tokens: 1e-3 * tokens, GREEDY,
                                        {"adaptive": False, "prompt_lookup_scaled": False})  # 3 guesses a step, always
    assert "8+ running: plain" in said, said
    assert said_fixed == "ngram, k=3 always"
    assert fixed_s > 1.3 * plain_s  # what always proposing 3 costs here
    assert adaptive_s < 1.1 * plain_s, (adaptive_s, plain_s)  # the first sweep and re-measuring, no more
    same = [o.token_ids for o in plain]
    assert [o.token_ids for o in adaptive] == same and [o.token_ids for o in fixed] == same  # greedy: exact


def test_when_proposals_are_nearly_free_it_keeps_them():
    weight_bound = lambda tokens: 10e-3  # noqa: E731  (a pass costs the same whatever it holds)
    plain, _, plain_s, _ = run(weight_bound, GREEDY, speculate=False)
    adaptive, said, adaptive_s, _ = run(weight_bound, GREEDY)
    assert "8+ running: k=" in said and "8+ running: plain" not in said, said
    assert adaptive_s < plain_s
    assert [o.token_ids for o in adaptive] == [o.token_ids for o in plain]


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_step_counts_every_token_while_requests_wait_and_the_furthest_behind_when_none_do(policy):
    """While requests wait for a place (continuous batching), a step is worth every token it
    made; when none does — or under static batching, whose newcomers wait for the whole batch —
    it is worth ``batch`` times what it brought the end of the last sequence nearer: the most
    tokens any had left less the most any has left after the step."""
    engine = LLMEngine(TARGET, dtype="fp32", compile=False, max_num_seqs=4, scheduling_policy=policy,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})  # fmt: skip
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_tokens=24 + 12 * (i % 2), ignore_eos=True))
    governor, recorded = engine.speculator.governor, []
    record = governor.record
    governor.record = lambda batch, k, tokens, seconds, text: recorded.append(tokens) or record(batch, k, tokens, seconds, text)
    seen = {"waiting": 0, "furthest behind differs": 0, "a queue, but no place to give": 0, "ties moved unevenly": 0}
    while engine.has_unfinished_requests():
        queued = len(engine.scheduler.waiting) if policy == "continuous" else 0
        before = [(s, len(s.output_token_ids), s.max_output - len(s.output_token_ids))
                  for s in engine.scheduler.running if s.is_decoding]  # fmt: skip
        n = len(recorded)
        engine.step()
        if len(recorded) == n:
            continue  # a step with a prefill: no evidence
        moved = [len(s.output_token_ids) - b for s, b, _ in before]
        most = max(left for *_, left in before)
        left_after = max(left - m for m, (*_, left) in zip(moved, before))  # tokens emitted, not a stop's windfall
        expected = sum(moved) if queued or len(before) == 1 else len(before) * (most - left_after)
        assert recorded[-1] == pytest.approx(expected)
        seen["waiting"] += bool(queued)
        seen["furthest behind differs"] += not queued and expected != sum(moved)
        # tied furthest-behind sequences: the batch ends nearer only by the least of their progress
        behind = [m for m, (*_, left) in zip(moved, before) if left == most]
        seen["ties moved unevenly"] += not queued and len(before) > 1 and len(set(behind)) > 1
        seen["a queue, but no place to give"] += not queued and bool(engine.scheduler.waiting)
    engine.close()
    assert seen["furthest behind differs"] > 0  # proposals were accepted unevenly, and it showed
    if policy == "continuous":
        assert seen["waiting"] > 0
    else:  # static batching: requests did wait, for the whole batch, not for a place
        assert seen["a queue, but no place to give"] > 0
        # a batch that starts together ties its furthest behind: the least of their progress counted
        assert seen["ties moved unevenly"] > 0


def test_a_sequence_that_stops_is_credited_with_its_tokens_not_its_unused_budget():
    """The furthest-behind sequence stops at EOS after one token: the batch's end came 1 token
    nearer by the step's own work — the 53 tokens it will never need are the stop's windfall, not
    the proposals' (counted as progress, one such step would crown whichever k ran it)."""
    engine = LLMEngine(TARGET, dtype="fp32", compile=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})  # fmt: skip
    speculator, recorded = engine.speculator, []
    speculator.governor.record = lambda batch, k, tokens, seconds, text: recorded.append(tokens)
    behind = SimpleNamespace(output_token_ids=[1] * 10, max_output=64)  # 54 tokens left
    ahead = SimpleNamespace(output_token_ids=[1] * 20, max_output=64)  # 44 left
    speculator._step, speculator._left = (2, 3, "free text"), [(behind, 54, 10), (ahead, 44, 20)]
    behind.output_token_ids.append(2)  # one token, then EOS: it finished
    ahead.output_token_ids += [2, 3]  # a proposal accepted
    chunks = [SimpleNamespace(seq=behind, draft_tokens=[], is_decode=True),
              SimpleNamespace(seq=ahead, draft_tokens=[5], is_decode=False)]  # fmt: skip
    speculator.step_done(chunks, 3, 0.01)
    engine.close()
    assert recorded == [2 * (54 - 53)]


def test_a_step_that_preempts_the_furthest_behind_is_weighed_by_those_it_ran():
    """A pool too small for every request (14 blocks of 4 tokens for 4 of them) preempts one
    now and then, often one with the most tokens left, in a step that began with nobody
    waiting: it moved no token for want of room, not of proposals. The step is weighed by the
    furthest-behind sequences it ran — never recorded as no progress (a first record of 0
    tokens made the governor divide by zero) — and the greedy tokens stay the target's."""
    per_block = 4 * kv_bytes_per_token(ModelConfig.from_folder(resolve_model(TARGET)), torch.float32)
    small = {"block_size": 4, "kv_cache_memory": 14 * per_block, "max_model_len": 64}
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def generate(speculative_config):
        engine = LLMEngine(TARGET, dtype="fp32", compile=False, speculative_config=speculative_config, **small)
        recorded, preempted_with_none_waiting = [], 0
        if speculative_config:
            record = engine.speculator.governor.record
            engine.speculator.governor.record = lambda b, k, t, s, text: recorded.append(t) or record(b, k, t, s, text)
        for prompt in PROMPTS[:4]:
            engine.add_request(prompt + " " + prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            none_waiting = not engine.scheduler.waiting
            for d in engine.step():
                if d.output is not None:
                    outputs[d.request_id] = d.output.token_ids
            preempted_with_none_waiting += none_waiting and bool(engine.step_records[-1].preempted)
        engine.close()
        return [outputs[i] for i in sorted(outputs)], recorded, preempted_with_none_waiting

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    plain, _, _ = generate(None)
    tokens, recorded, preempted = generate(spec)
    assert preempted > 0  # the case happened
    assert tokens == plain and recorded and min(recorded) >= 1


def test_seeded_sampled_requests_keep_k_and_their_tokens_whatever_the_timing():
    seeded = SamplingParams(max_tokens=48, temperature=0.9, seed=11, ignore_eos=True)
    compute_bound, said, _, _ = run(lambda tokens: 1e-3 * tokens, seeded)
    weight_bound, _, _, _ = run(lambda tokens: 10e-3, seeded)
    assert [o.token_ids for o in compute_bound] == [o.token_ids for o in weight_bound]
    assert sum(o.metrics.spec_proposed for o in compute_bound) > 0  # they kept proposing


def test_configure_sets_k_and_starts_the_measurements_afresh():
    engine = LLMEngine(TARGET, dtype="fp32", compile=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    speculator = engine.speculator
    speculator.configure(2, adaptive=False)
    assert speculator.governor is None and engine.resolved.speculation == "ngram (up to 2^(n-1) guesses after an n-token match), k=2 always"
    speculator.configure(4, adaptive=True)
    assert speculator.governor.candidates == [0, 1, 2, 4] and engine.resolved.speculation == "ngram (up to 2^(n-1) guesses after an n-token match), k=4 adaptive"
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="k="):
            speculator.configure(bad, adaptive=True)
    engine.close()


def test_the_engines_warm_up_is_not_evidence():
    """The warm-up request at construction runs on the wall clock, with one-time costs: a replay
    on a simulated clock must not depend on it (nor on how busy the machine was then)."""
    engine = LLMEngine(TARGET, dtype="fp32", compile=False, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert engine.speculator.governor.sizes == {} and engine.resolved.speculation == "ngram (up to 2^(n-1) guesses after an n-token match), k=3 adaptive"
    engine.close()


def test_a_k_set_by_hand_still_caps_the_proposals():
    """Code written before the governor set ``speculator.k`` for a sweep: it still caps every
    sequence's proposals (``configure`` is the way that also resets the measurements)."""
    engine = LLMEngine(TARGET, dtype="fp32", compile=False,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2})  # fmt: skip
    engine.speculator.k = 1
    for prompt in PROMPTS[:4]:
        engine.add_request(prompt + " " + prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    longest = 0
    while engine.has_unfinished_requests():
        engine.step()
        longest = max([longest, *(len(s.draft_tokens) for s in engine.scheduler.running)])
    assert longest == 1
    engine.close()
