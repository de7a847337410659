"""The OpenAI-compatible server, over real HTTP: a uvicorn server on a free loopback port, driven
by the official ``openai`` client and by raw ``httpx`` for what a client library would never
send. Answers are compared with ``LLM.generate`` on the same engine settings."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from minillm import LLM, SamplingParams
from minillm.server import ServerThread, build_app, build_engines
from minillm.server.response_cache import ResponseCache

MODEL, OTHER = "tiny-shakespeare-8m", "tiny-shakespeare-1m"
ENGINE = dict(dtype="fp32", kv_cache_memory=16_000_000, max_num_seqs=16)
PROMPT = "KING.\nNow is the winter"


@pytest.fixture(scope="module")
def server():
    engines = build_engines([MODEL, OTHER], **ENGINE)
    with ServerThread(build_app(engines, ResponseCache(16))) as srv:
        srv.engines = engines
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    return {MODEL: LLM(MODEL, **ENGINE), OTHER: LLM(OTHER, **ENGINE)}


def expected(reference, prompt, model=MODEL, **params):
    return reference[model].generate(prompt, SamplingParams(**params))[0]


def assert_idle(server, timeout=10.0):
    """Every request finished or aborted, every block back in the pool (cached blocks are free)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        busy = {
            n: (len(e.engine.requests), e.engine.block_manager.num_used_blocks, e.client.num_open, e._pending)
            for n, e in server.engines.items()
        }
        if all(v == (0, 0, 0, 0) for v in busy.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle: (requests, used blocks, sinks, pending) = {busy}")
        time.sleep(0.05)


# ---- answers equal the engine's --------------------------------------------------------------


def test_completion_equals_llm_generate(client, reference, server):
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    want = expected(reference, PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids) == 16
    assert got.object == "text_completion" and got.model == MODEL
    assert_idle(server)


def test_token_id_prompts_and_a_batch_of_prompts(client, reference):
    ids = reference[MODEL].tokenizer.encode(PROMPT)
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == expected(reference, ids, max_tokens=8, temperature=0).text
    got = client.completions.create(model=MODEL, prompt=[PROMPT, "ROMEO.\n"], max_tokens=8, temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert got.choices[0].text == expected(reference, PROMPT, max_tokens=8, temperature=0).text
    assert got.choices[1].text == expected(reference, "ROMEO.\n", max_tokens=8, temperature=0).text
    got = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=4, temperature=0)
    assert got.choices[1].text == expected(reference, ids[:3], max_tokens=4, temperature=0).text


def test_chat_completion_uses_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who art thou?"}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    want = expected(reference, messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_completion_and_chat_concatenate_to_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    messages = [{"role": "user", "content": "Speak."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_the_event_stream_is_framed_as_server_sent_events(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])


def test_seeded_sampling_is_reproducible(client, reference):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=7, **args).choices[0].text
    b = client.completions.create(seed=7, **args).choices[0].text
    c = client.completions.create(seed=8, **args).choices[0].text
    assert a == b != c
    assert a == expected(reference, PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=7).text


def test_stop_strings_end_the_answer_before_the_stop(client, reference):
    full = expected(reference, PROMPT, max_tokens=24, temperature=0).text
    stop = full[6:9]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].text == full[: full.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == got.choices[0].text


def test_routing_by_model_name(client, reference):
    for name in (MODEL, OTHER):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert got.choices[0].text == expected(reference, PROMPT, model=name, max_tokens=8, temperature=0).text
        assert got.model == name
    assert {m.id for m in client.models.list()} == {MODEL, OTHER}


# ---- bad input: the right status, the field named, the server unharmed -------------------------

BAD = [
    # (body or raw bytes, status, param)
    (b"{not json", 400, None),
    (b"\xff\xfe\x00", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "12"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2**64}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": []}, 400, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x " * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"50": 100}}, 400, "logit_bias"),
    ({"model": MODEL, "prompt": "x", "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": ["x"] * 300}, 400, "prompt"),
    (b'{"model": "m", "prompt": "a", "max_tokens": ' + b"1" * 5000 + b"}", 400, None),
    (b'{"model": "m", "prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=range(len(BAD)))
def test_bad_requests_get_a_json_error_naming_the_field(server, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [([], "messages"), ([{"role": "bot", "content": "x"}], "messages.0.role"),
     ([{"role": "user", "content": 5}], "messages.0.content"), ("hello", "messages")],
)  # fmt: skip
def test_bad_chat_requests(server, messages, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_oversized_bodies_and_unknown_routes(server):
    big = b'{"model": "x", "prompt": "' + b"a" * (10 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/nothing", json={})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"


# ---- cancellation, many clients, backpressure --------------------------------------------------


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        events = r.iter_lines()
        got = [next(events) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        engine = server.engines[MODEL].engine
        assert engine.requests and engine.block_manager.num_used_blocks > 0
    assert_idle(server)


def test_fifty_streams_of_which_a_third_leave(server, reference):
    prompts = [f"{name}.\n" for name in ("KING", "ROMEO", "JULIET", "HAMLET", "FIRST CITIZEN")]
    want = {p: expected(reference, p, max_tokens=24, temperature=0, ignore_eos=True).text for p in prompts}
    threads_before = threading.active_count()

    async def one(i: int, http: httpx.AsyncClient):
        prompt = prompts[i % len(prompts)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
                    if i % 3 == 0 and len(text) > 5:
                        return None  # leave mid-stream: the context manager closes the connection
        return prompt, text

    async def main():
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(i, http) for i in range(50)))

    results = asyncio.run(main())
    finished = [r for r in results if r is not None]
    assert len(finished) == 50 - len(range(0, 50, 3))
    assert all(text == want[prompt] for prompt, text in finished)
    assert_idle(server)
    from minillm.server.app import PARSE_THREADS

    assert threading.active_count() <= threads_before + PARSE_THREADS  # the parse pool's fixed threads, no more


def test_a_full_queue_answers_429_then_recovers():
    engines = build_engines([MODEL], max_waiting=2, **(ENGINE | {"max_num_seqs": 1}))
    with ServerThread(build_app(engines)) as srv:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

        answers = asyncio.run(main())
        codes = sorted(r.status_code for r in answers)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        refused = next(r for r in answers if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "queue_full"
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code == 200
        assert "minillm_requests_rejected_total" in httpx.get(srv.url + "/metrics").text


def test_a_failing_step_fails_its_requests_and_the_server_keeps_serving(server, client, monkeypatch):
    engine = server.engines[OTHER].engine
    real = engine.step
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real()

    monkeypatch.setattr(engine, "step", broken)
    r = httpx.post(server.url + "/v1/completions", json={"model": OTHER, "prompt": PROMPT, "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and "simulated" in r.json()["error"]["message"]
    assert client.completions.create(model=OTHER, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    assert_idle(server)


# ---- cache and metrics ---------------------------------------------------------------------------


def test_greedy_responses_are_cached_and_sampled_ones_are_not(server, client):
    def hits():
        text = httpx.get(server.url + "/metrics").text
        return float(
            next(line.split()[-1] for line in text.splitlines() if line.startswith("minillm_response_cache_hits"))
        )

    before = hits()
    a = client.completions.create(model=MODEL, prompt="To be", max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt="To be", max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and hits() == before + 1
    client.completions.create(model=MODEL, prompt="To be", max_tokens=6, temperature=0.8, seed=1)
    client.completions.create(model=MODEL, prompt="To be", max_tokens=6, temperature=0.8, seed=1)
    assert hits() == before + 1


def test_fields_the_schema_ignores_neither_grow_nor_miss_the_response_cache(server):
    """A 1 MB unknown field, 20 times: one entry, answered from the cache, each with its own id."""
    cache = server.app.state.response_cache
    body = {"model": MODEL, "prompt": "Good morrow", "max_tokens": 5, "temperature": 0}
    first = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    size = cache.nbytes
    answers = [
        httpx.post(server.url + "/v1/completions", json=body | {"junk": "x" * (1 << 20)}, timeout=60).json()
        for _ in range(20)
    ]
    assert cache.nbytes == size < 20_000  # the junk is in no key
    assert all(a["choices"] == first["choices"] for a in answers)
    assert len({a["id"] for a in answers} | {first["id"]}) == 21  # a hit is a new response, not a replay


def test_the_response_cache_keeps_to_its_byte_budget():
    cache = ResponseCache(100, max_bytes=4_000)
    for i in range(20):
        cache.put(f"key{i}", {"text": "y" * 400})
    assert cache.nbytes <= 4_000 and len(cache) < 20 and cache.get("key19") is not None and cache.get("key0") is None
    cache.put("huge", {"text": "z" * 2_000})  # over a quarter of the budget: not kept, nothing evicted for it
    assert cache.get("huge") is None and cache.get("key19") is not None


def test_metrics_in_prometheus_text_format(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, user="metrics-test")
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    for name in ("minillm_requests", "minillm_generation_tokens", "minillm_prompt_tokens",
                 "minillm_time_to_first_token_seconds", "minillm_time_per_output_token_seconds",
                 "minillm_num_requests_running", "minillm_num_requests_waiting", "minillm_kv_blocks_used",
                 "minillm_kv_blocks_total", "minillm_response_cache_hits"):  # fmt: skip
        assert name in families, name
    total = {s.labels["model"]: s.value for s in families["minillm_kv_blocks_total"].samples}
    assert total[MODEL] == server.engines[MODEL].engine.block_manager.num_blocks
    generated = {s.labels["model"]: s.value for s in families["minillm_generation_tokens"].samples
                 if s.name.endswith("_total")}  # fmt: skip
    assert generated[MODEL] >= 5


# ---- the batch runner ----------------------------------------------------------------------------


def test_batch_file_runs_offline_in_input_order(tmp_path, reference):
    from minillm.cli import main

    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 0}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": [{"role": "user", "content": "Speak."}], "max_tokens": 5,
                  "temperature": 0}},
    ]  # fmt: skip
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    odd = '{"custom_id": "huge", "url": "/v1/completions", "body": {"model": "M", "prompt": "a", "max_tokens": N}}'
    odd = odd.replace("M", MODEL).replace("N", "9" * 5000)
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n{broken\n" + odd + "\n"
                   + json.dumps({"custom_id": "url", "url": ["x"], "body": {}}) + "\n")  # fmt: skip
    rc = main(["batch", str(src), str(dst), "--model", MODEL, "--dtype", "fp32", "--kv-cache-memory", "16000000",
               "--quiet"])  # fmt: skip
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert rc == 1  # four lines failed, the others were answered
    assert [o["custom_id"] for o in out] == ["a", "bad", "c", None, None, "url"]
    assert [o["response"]["status_code"] for o in out] == [200, 400, 200, 400, 400, 400]
    assert out[0]["response"]["body"]["choices"][0]["text"] == expected(reference, PROMPT, max_tokens=6,
                                                                        temperature=0).text  # fmt: skip
    assert out[1]["error"]["param"] == "max_tokens"
    assert out[2]["response"]["body"]["choices"][0]["message"]["content"]


# ---- n samples and logprobs ----------------------------------------------------------------------


def test_n_samples_are_reproducible_per_index(client, reference):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3)
    got = client.completions.create(**args)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for j, choice in enumerate(got.choices):  # sample j is what a single request seeded seed + j gets
        assert choice.text == expected(reference, PROMPT, max_tokens=12, temperature=1.0, seed=11 + j).text
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.prompt_tokens == len(reference[MODEL].tokenizer.encode(PROMPT))  # the prompt counted once
    assert got.usage.completion_tokens == 36
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text


def test_streamed_n_samples_interleave_by_index(client):
    args = dict(model=MODEL, prompt=[PROMPT, "ROMEO.\n"], max_tokens=10, temperature=0.9, seed=5, n=2)
    whole = client.completions.create(**args)
    texts = {}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[k] for k in range(4)] == [c.text for c in whole.choices]


def test_logprobs_on_completions_and_chat(client, reference):
    import math

    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == got.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and math.isclose(chosen, max(top.values()), rel_tol=1e-6)  # greedy = the top token
    want = expected(reference, PROMPT, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    assert [round(r.logprob, 5) for r in want.logprobs] == [round(x, 5) for x in lp.token_logprobs]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].logprobs is None


def test_max_tokens_beyond_the_context_is_refused_by_name_and_an_unset_one_is_cut(server, reference):
    """One rule (docs/server.md): a max_tokens the client sets must fit in the context beside the
    prompt (400 naming the limit otherwise); left unset, it is cut to what the context leaves."""
    context = reference[MODEL].max_model_len
    prompt_ids = reference[MODEL].tokenizer.encode(PROMPT)
    room = context - len(prompt_ids)
    url = server.url + "/v1"
    r = httpx.post(url + "/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": room + 1}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["message"] == (
        f"this model's context is {context} tokens; prompt has {len(prompt_ids)}, so max_tokens may be at most "
        f"{room}, not {room + 1}"
    )
    batch = {"model": MODEL, "prompt": ["x", PROMPT], "max_tokens": room + 1}
    r = httpx.post(url + "/completions", json=batch, timeout=60)
    assert r.status_code == 400 and "prompt[1] has" in r.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}
    r = httpx.post(url + "/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    fits = {"model": MODEL, "prompt": prompt_ids, "max_tokens": room, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/completions", json=fits, timeout=120)  # exactly the room left: served whole
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == room
    long_prompt = prompt_ids * (context // len(prompt_ids))
    long_prompt = long_prompt[: context - 3]
    unset = {"model": MODEL, "prompt": long_prompt, "temperature": 0, "ignore_eos": True}  # default 16, 3 fit
    r = httpx.post(url + "/completions", json=unset, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_request_that_can_never_fit_the_pool_is_refused():
    engines = build_engines([MODEL], dtype="fp32", kv_cache_memory=200_000)
    with ServerThread(build_app(engines)) as srv:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "can never fit" in r.json()["error"]["message"]
        ok = httpx.post(srv.url + "/v1/completions", json=body | {"max_tokens": 4}, timeout=60)
        assert ok.status_code == 200


def test_hostile_model_names_neither_break_nor_bloat_the_metrics(server):
    for name, status in (("\ud800", 400), ("bogus-1", 404), ("bogus-2", 404)):  # a lone surrogate is not text
        body = json.dumps({"model": name, "prompt": "a"}).encode()
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status and r.json()["error"]["param"] == "model"
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and "bogus" not in metrics.text


def test_a_chat_template_that_refuses_a_conversation_is_a_400():
    engines = build_engines([MODEL], **ENGINE)
    tok = engines[MODEL].engine.tokenizer
    tok.hf.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    with ServerThread(build_app(engines)) as srv:
        body = {"model": MODEL, "messages": [{"role": "system", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "no system role" in r.json()["error"]["message"]


def test_many_prompts_count_against_the_queue_limit():
    engines = build_engines([MODEL], max_waiting=4, **ENGINE)
    with ServerThread(build_app(engines)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ["To be"] * 24, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "To be", "max_tokens": 2, "n": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        ok = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": ["To be"] * 4, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_step_that_fails_after_finishing_a_request_answers_it_and_frees_its_seat(server, monkeypatch):
    engine = server.engines[OTHER].engine
    real = engine.scheduler.commit
    calls = {"n": 0}

    def broken(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated failure after the tokens were appended")
        return real(chunks)

    monkeypatch.setattr(engine.scheduler, "commit", broken)
    r = httpx.post(server.url + "/v1/completions", json={"model": OTHER, "prompt": PROMPT, "max_tokens": 1}, timeout=30)
    assert r.status_code == 503 and "simulated" in r.json()["error"]["message"]
    assert_idle(server)
    assert not engine.scheduler.running


# ---- no request fails a step for others ------------------------------------------------------------

EXTREMES = {
    "top_k": [-2, -1, 0, 1, 2**31 - 1, 2**31, 2**63, 9223372036854775808, 10**30],
    "temperature": [0, 5e-324, 1e-300, 1e300, 1.7976931348623157e308, -1, "1"],
    "top_p": [5e-324, 1e-300, 1, 2, 0, -0.5],
    "min_p": [0, 1, 1e-300, 1.5, -1],
    "repetition_penalty": [5e-324, 1e-300, 1e300, 0, -1],
    "seed": [-1, 0, 2**63, 2**64 - 1, 2**64, 10**40],
    "max_tokens": [0, -1, 1, 2**31, 2**63],
    "n": [0, 1, 3, 17, 10**9],
    "logprobs": [-1, 0, 5, 20, 21, 2**40],
    "stop": [[""], ["\n"] * 5, ["a" * 10_000], [None]],
    "ignore_eos": [True, "yes"],
}


def test_random_extreme_settings_never_touch_innocent_streams(server, reference):
    """Hostile requests with random extreme values of every field, sent while innocent streams
    run: each hostile one is answered (200, or a 4xx naming a field), never a 5xx, and every
    innocent stream gets exactly LLM.generate's tokens."""
    import random

    rng = random.Random(30)
    prompts = [f"{name}.\n" for name in ("KING", "ROMEO", "JULIET", "HAMLET")]
    want = {p: expected(reference, p, max_tokens=24, temperature=0, ignore_eos=True).text for p in prompts}
    hostile = []
    for _ in range(48):
        fields = rng.sample(sorted(EXTREMES), rng.randint(1, 4))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": rng.random() < 0.5}
        body.update({name: rng.choice(EXTREMES[name]) for name in fields})
        hostile.append(body)

    async def innocent(prompt: str, http: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += event["choices"][0]["text"]
        return prompt, text

    async def attack(body: dict, http: httpx.AsyncClient):
        async with http.stream("POST", "/v1/completions", json=body) as r:
            raw = (await r.aread()).decode()
        if r.status_code == 200 and body["stream"]:
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            errors = [e["error"] for e in events if "error" in e]
            assert all(e["type"] == "invalid_request_error" and e["param"] for e in errors), (body, errors)
            return body, 200
        if r.status_code != 200:
            error = json.loads(raw)["error"]
            assert 400 <= r.status_code < 500 and error["param"], (body, r.status_code, error)
        return body, r.status_code

    async def main():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            runs = [innocent(p, http) for p in prompts * 3] + [attack(b, http) for b in hostile]
            return await asyncio.gather(*runs)

    results = asyncio.run(main())
    innocents, attacks = results[:12], results[12:]
    assert all(text == want[prompt] for prompt, text in innocents)
    codes = [code for _, code in attacks]
    assert 200 in codes and any(400 <= c < 500 for c in codes)  # the mix had both kinds
    assert_idle(server)
