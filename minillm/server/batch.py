"""``minillm batch IN.jsonl OUT.jsonl``: an OpenAI batch file, run offline through the engine.

The input follows the OpenAI Batch API's line format
(https://platform.openai.com/docs/guides/batch): one JSON object per line,
``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}``. Every
line is validated exactly as the server would validate it (``plan.py``); the valid ones are
queued at once and run with continuous batching — the throughput-optimal way to run a known
set of requests, with no HTTP in between. The output has one line per input line, in input
order: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``,
where a refused line carries its 4xx status and the same error body the server would send.
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from minillm.engine import LLMEngine
from minillm.server.launch import served_name
from minillm.server.plan import choose_engine, parse, plan, response_of
from minillm.server.protocol import APIError, error_body


def run_batch_file(
    input_path: str | Path,
    output_path: str | Path,
    models: list[str] | None,
    engine_args: dict,
    progress: bool = True,
) -> dict:
    """Run every line of ``input_path``; write ``output_path``; return counts."""
    lines = Path(input_path).read_text(encoding="utf-8").splitlines()
    engines = {served_name(m): LLMEngine(m, **engine_args) for m in (models or ["smollm2-135m"])}
    results: list[dict | None] = [None] * len(lines)
    plans = {}  # line number → Plan
    for number, line in enumerate(lines):
        if not line.strip():
            continue
        custom_id = None
        try:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"line {number + 1} is not valid JSON: {exc.msg}") from None
            if not isinstance(item, dict):
                raise APIError(400, f"line {number + 1} must be a JSON object")
            custom_id = item.get("custom_id")
            if item.get("method", "POST") != "POST":
                raise APIError(400, f"method {item.get('method')!r} is not supported; use POST", "method")
            if not isinstance(item.get("body"), dict):
                raise APIError(400, "body must be a JSON object", "body")
            req = parse(item.get("url", ""), item["body"])
            engine = choose_engine(req, engines)
            plans[number] = (custom_id, plan(req, engine, engine, f"batch-{number}"))
        except APIError as exc:
            results[number] = _line(number, custom_id, exc.status, exc.body())
        except (Exception, RecursionError) as exc:  # noqa: BLE001 (one odd line must not sink the batch)
            body = error_body(f"line {number + 1} cannot be used: {type(exc).__name__}: {exc}"[:300])
            results[number] = _line(number, custom_id, 400, body)
    for _, p in plans.values():
        for seq in p.seqs:
            p.engine.enqueue(seq)
    outputs = _run(engines, sum(len(p.seqs) for _, p in plans.values()), progress)
    for number, (custom_id, p) in plans.items():
        samples = [sample for s in p.seqs for sample in outputs[s.request_id]]
        results[number] = _line(number, custom_id, 200, response_of(p, samples))
    with open(output_path, "w", encoding="utf-8") as out:
        for result in results:
            if result is not None:
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
    done = sum(1 for r in results if r is not None and r["response"]["status_code"] == 200)
    failed = sum(1 for r in results if r is not None) - done
    return {"lines": len(results), "completed": done, "failed": failed, "output": str(output_path)}


def _run(engines: dict, total: int, progress: bool) -> dict:
    """Step every engine until all of its requests finish; each request's samples by its id."""
    outputs = {}
    with tqdm(total=total, unit="req", disable=not progress, desc="batch") as bar:
        while any(e.has_unfinished_requests() for e in engines.values()):
            for engine in engines.values():
                if engine.has_unfinished_requests():
                    for delta in engine.step():
                        if delta.output is not None:  # one sample finished (n > 1 has several)
                            outputs.setdefault(delta.request_id, []).append(delta.output)
                        if delta.request_finished:
                            outputs[delta.request_id].sort(key=lambda o: o.index)
                            bar.update(1)
    return outputs


def _line(number: int, custom_id, status: int, body: dict) -> dict:
    ok = status == 200
    return {
        "id": f"batch_req_{number}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"batch-{number}", "body": body},
        "error": None if ok else body.get("error", error_body("failed")["error"]),
    }
