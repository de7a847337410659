"""The ``minillm`` command line: generate, chat, serve, batch, assets, quantize, bench, course.

minillm generate --prompt "The capital of France is" --max-tokens 16
minillm generate --chat --stream --prompt "Write a haiku about caches"
minillm chat
minillm serve --model smollm2-135m --port 8000          # OpenAI-compatible HTTP API
minillm batch requests.jsonl results.jsonl              # an OpenAI batch file, offline
minillm assets
minillm bench --quick
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys

from minillm.config import environment


def _add_engine_args(p: argparse.ArgumentParser, several_models: bool = False) -> None:
    g = p.add_argument_group("engine")
    if several_models:
        g.add_argument(
            "--model",
            action="append",
            help="short name or HF-format folder; repeat to serve several (default: smollm2-135m)",
        )
    else:
        g.add_argument("--model", default="smollm2-135m", help="short name or HF-format folder (default: smollm2-135m)")
    add_engine_flags(g)


def _flag(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _engine_fields():
    """The ``EngineConfig`` fields that are command-line flags (their metadata says how)."""
    import dataclasses

    from minillm.config import EngineConfig

    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", False)]


def _parser_of(parse):
    """An argparse ``type`` from a config parser: its ``ValueError`` becomes a usage error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = getattr(parse, "__name__", "value")  # argparse names it in "invalid <name> value"
    return convert


def add_engine_flags(group) -> None:
    """One flag per ``EngineConfig`` field marked for the command line, generated from the
    field's metadata (``minillm/config/engine.py::option``), so a new option needs no CLI code."""
    for f in _engine_fields():
        meta, flag = f.metadata, _flag(f)
        if f.default is True:  # on by default: the flag turns it off
            group.add_argument(flag, dest=f.name, action="store_false", help=meta["help"])
        elif f.name == "compile":  # three states: auto (None), on, off
            group.add_argument(flag, dest=f.name, default="auto", choices=meta["choices"], help=meta["help"])
        else:
            parse = meta["parse"]
            kind = parse if parse in (int, float) else _parser_of(parse) if parse else None  # argparse words int errors
            choices = list(meta["choices"]) if meta["choices"] else None
            group.add_argument(flag, dest=f.name, default=f.default, type=kind, choices=choices, help=meta["help"],
                               metavar=meta.get("metavar"))  # fmt: skip


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=None)


def _sampling_params(args):
    from minillm.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )


def _engine_kwargs(args) -> dict:
    """``EngineConfig`` keyword arguments from the parsed engine flags."""
    out = {f.name: getattr(args, f.name) for f in _engine_fields()}
    out["compile"] = {"auto": None, "on": True, "off": False}[out["compile"]]
    return out


def _llm(args):
    from minillm.entrypoints import LLM

    return LLM(args.model, **_engine_kwargs(args))


def cmd_serve(args) -> int:

    args.model = list(args.models) + list(args.model or [])  # `serve MODEL` (vLLM's form) and/or --model
    if not 0 <= args.port <= 65535:  # before the slow model load, not an OverflowError after it
        raise ValueError(f"--port {args.port} is not a TCP port: use 0-65535 (0 picks a free one)")
    for name in ("body_timeout", "keep_alive_timeout", "shutdown_timeout", "max_connections", "header_timeout"):
        value = getattr(args, name)
        if not value > 0 or value == float("inf"):
            raise ValueError(f"--{name.replace('_', '-')} {value} must be a positive, finite number")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} must be >= 1")
    if args.data_parallel_size > 1 and args.your_engine is not None:
        raise ValueError("--your-engine serves one engine in this process: drop --data-parallel-size")
    if args.data_parallel_size > 1:  # replicas behind a router: minillm/cluster/data_parallel.py
        from minillm.cluster.data_parallel import serve_data_parallel

        serve_data_parallel(
            args.model or ["smollm2-135m"], args.data_parallel_size, _replica_argv(args.argv, args.models),
            args.router_policy,
            host=args.host, port=args.port, log_level=args.log_level, block_size=args.block_size,
            max_body_bytes=args.max_body_bytes, allowed_hosts=args.allowed_hosts, api_key=args.api_key,
            shutdown_timeout=args.shutdown_timeout,
        )  # fmt: skip
        return 0
    engine_args, plugged = _engine_kwargs(args), contextlib.nullcontext()
    if args.your_engine is not None:  # the learner's recorded pieces, plugged in for the server's life
        import minillm.hooks as hooks
        from minillm.course.your_engine import serving_plugs

        overrides, engine_args, table = serving_plugs(args.your_engine, (args.model or ["smollm2-135m"])[0], engine_args)
        print(table, file=sys.stderr)
        plugged = hooks.override(**overrides)
    with plugged:
        _serve(args, engine_args)
    return 0


def _serve(args, engine_args: dict) -> None:
    from minillm.server.launch import serve

    serve(
        args.model or ["smollm2-135m"],
        host=args.host,
        port=args.port,
        response_cache=args.response_cache,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        enable_docs=args.enable_docs,
        allowed_hosts=args.allowed_hosts,
        api_key=args.api_key,
        body_timeout=args.body_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        max_connections=args.max_connections,
        shutdown_timeout=args.shutdown_timeout,
        header_timeout=args.header_timeout,
        **engine_args,
    )


def _replica_argv(argv: list[str], positional_models: list[str] = ()) -> list[str]:
    """``minillm serve`` arguments for each replica: all but those the router itself uses (the
    models too, given as ``--model`` or positionally: the router hands each replica its own)."""
    # The router is the public face: it checks hosts and the API key; replicas listen on loopback.
    own = {"--host", "--port", "--data-parallel-size", "--router-policy", "--model", "--log-level", "--allowed-hosts",
           "--api-key"}  # fmt: skip
    takes_value = _serve_options_with_values()
    models = list(positional_models)
    out, skip, value_of_previous = [], False, False
    for arg in argv[1:]:  # after "serve"
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in own:
            skip = "=" not in arg and arg in takes_value
        elif not value_of_previous and arg in models:
            models.remove(arg)  # a positional MODEL
        else:
            out.append(arg)
        value_of_previous = arg in takes_value
    return out + ["--data-parallel-size", "1"]  # a replica is one server, whatever slipped through


def _serve_options_with_values() -> set[str]:
    """The ``serve`` options that take a value (so the next word is theirs, not a MODEL)."""
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {s for action in serve._actions if action.nargs != 0 for s in action.option_strings}


def cmd_batch(args) -> int:
    from minillm.server.batch import run_batch_file

    summary = run_batch_file(args.input, args.output, args.model, _engine_kwargs(args), progress=not args.quiet)
    print(json.dumps(summary), file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


# The engines the course starts whose decode step compiles by default: LLM("smollm2-135m") in bf16
# (chapters 00, 01 and 08 share its graph). The course's fp32 SmolLM2 engines (chapters 08 and 09)
# answer a few prompts each and run with compile=False; the tiny models are below the size that
# compiles by default.
COURSE_WARMUP = (("smollm2-135m", {}),)


def cmd_warmup(args) -> int:
    """Build (or load) the compiled decode steps of MODELs — by default the course's — with a
    progress bar, so a classroom's machines have them before the first lesson."""
    import time

    from tqdm import tqdm

    from minillm.engine import LLMEngine

    kwargs = {**_engine_kwargs(args), "compile": True}
    targets = [(m, {}) for m in args.models] if args.models else list(COURSE_WARMUP)
    failed = 0
    for model, extra in targets:
        options = {**kwargs, **extra}
        start = time.perf_counter()
        engine = LLMEngine(model, **options)
        label = f"{model} ({engine.resolved.dtype})"
        status = engine.fast_path_status()
        with tqdm(total=len(status.batch_sizes), desc=label, unit="graph", file=sys.stderr) as bar:
            while status.state == "building":
                status = engine.wait_for_fast_path(timeout=0.5)
                bar.update(len(status.ready) - bar.n)
                bar.set_postfix_str(status.detail[:60])
        compiled = engine.graphs.compile_seconds if engine.graphs is not None else {}
        took = time.perf_counter() - start
        if status.state != "ready":
            print(f"{label}: {status}", file=sys.stderr)
            failed += 1
        else:
            how = f"compiled {sorted(compiled)} in {sum(compiled.values()):.0f} s" if compiled else "already compiled"
            print(f"{label}: ready in {took:.0f} s ({how}; batch sizes {status.batch_sizes})")
        engine.close()
    return 1 if failed else 0


def cmd_cache(args) -> int:
    """What the cache holds (``minillm cache``), or clear its compiled code (``minillm cache clean``)."""
    from minillm.tools import cache

    if args.action == "clean":
        removed = cache.clean(everything=args.all)
        print(f"removed {len(removed)} entries; now:")
    print(cache.format_report(cache.report()))
    return 0


def cmd_generate(args) -> int:
    params = _sampling_params(args)  # validate before the slow model load
    llm = _llm(args)
    prompts = [[{"role": "user", "content": p}] if args.chat else p for p in args.prompt]
    if args.stream:
        for prompt in prompts:
            for delta in llm.stream(prompt, params):
                if args.json:  # one JSON line per delta; the last carries the whole record
                    record = {
                        "text": delta.text,
                        "token_id": delta.token_id,
                        "token_ids": delta.token_ids,
                        "finish_reason": delta.finish_reason,
                    }
                    if delta.output is not None:
                        record["output"] = _output_record(delta.output)
                    print(json.dumps(record), flush=True)
                else:
                    print(delta.text, end="", flush=True)
            if not args.json:
                print()
        return 0
    outputs = llm.generate(prompts, params)
    for out in outputs:
        print(json.dumps(_output_record(out)) if args.json else out.text)
    if args.speculative_config and not args.json:  # the figures of the run, apart from the text
        from minillm.metrics import run_report

        report = run_report(outputs)
        rate = "–" if report.acceptance_rate is None else f"{report.acceptance_rate:.0%}"
        print(
            f"speculative: {report.spec_accepted}/{report.spec_proposed} proposals accepted ({rate}), "
            f"{report.forward_passes_per_token:.2f} target forward passes per output token",
            file=sys.stderr,
        )
    return 0


def _output_record(out) -> dict:
    return {
        "prompt": out.prompt,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "metrics": out.metrics.as_dict(),
    }


def cmd_chat(args) -> int:
    """A streaming chat. Bad input is reported and the session goes on: undecodable bytes, a
    history longer than the context (the oldest turns are dropped), Ctrl-C during a reply
    (stops that reply). Ctrl-C at the prompt, Ctrl-D or /exit end the session."""
    from minillm.errors import PromptTooLongError

    params = _sampling_params(args)
    llm = _llm(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict[str, str]] = []
    if hasattr(sys.stdin, "reconfigure"):  # undecodable bytes arrive as surrogates instead of killing input()
        sys.stdin.reconfigure(errors="surrogateescape")
    print("minillm chat: type a message, /reset to clear the history, /exit or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
            line.encode("utf-8")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except (UnicodeDecodeError, UnicodeEncodeError):
            print("[that input is not valid UTF-8; please type it again]")
            continue
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            turns = []
            continue
        earlier = list(turns)
        turns.append({"role": "user", "content": line})
        stream = first = None
        try:
            while True:  # drop the oldest turns until the conversation fits the context (and the KV pool)
                try:
                    stream = llm.stream(system + turns, params)
                    first = next(stream)
                    break
                except ValueError as err:
                    if not isinstance(err, PromptTooLongError) and "can never fit" not in str(err):
                        raise
                    if len(turns) == 1:
                        print(f"[this message alone does not fit the context ({llm.max_model_len} tokens); not sent]")
                        turns = earlier  # the conversation so far is kept
                        break
                    turns = turns[2:] if len(turns) > 2 else turns[-1:]  # a user/assistant pair at a time
                    print("[history trimmed: the oldest turns no longer fit]")
        except KeyboardInterrupt:  # Ctrl-C before the first token (the prefill): stop this reply only
            if stream is not None:
                stream.close()
            print(" [stopped]")
            turns = earlier
            continue
        if first is None:
            continue
        print("assistant> ", end="", flush=True)
        reply = []
        try:
            for delta in itertools.chain([first], stream):
                reply.append(delta.text)
                print(delta.text, end="", flush=True)
        except KeyboardInterrupt:
            stream.close()  # aborts the request; the session goes on
            print(" [stopped]", end="")
        print()
        turns.append({"role": "assistant", "content": "".join(reply)})


def cmd_assets(args) -> int:
    from minillm.assets import REGISTRY, resolve_model

    names = args.model or sorted(REGISTRY)
    for name in names:
        path = resolve_model(name, progress=True)
        print(f"{name}: {path}")
    return 0


def cmd_quantize(args) -> int:
    from minillm.assets import resolve_model
    from minillm.config import check_quantization, parse_dtype
    from minillm.models.loader import load_model
    from minillm.quantization.checkpoint import save_quantized
    from minillm.tokenizer import Tokenizer

    check_quantization(args.method, args.group_size)  # before the slow load
    if args.from_gguf and (args.method != "int4" or args.group_size not in (None, 32)):
        raise ValueError("--from-gguf keeps the file's Q4_1 blocks: use --method int4 (groups of 32)")
    folder = resolve_model(args.model)
    model = load_model(folder, parse_dtype(args.dtype))
    int4_layers = group = None
    if args.from_gguf:
        from minillm.assets import REGISTRY, gguf_path
        from minillm.quantization.gguf_int4 import gguf_int4_layers

        if args.model not in REGISTRY:
            raise ValueError(f"--from-gguf: {args.model!r} is not a model shipped as GGUF ({', '.join(REGISTRY)})")
        int4_layers, group = gguf_int4_layers(gguf_path(REGISTRY[args.model]), model), 32
    out = save_quantized(
        model, folder, args.out, args.method, args.group_size or group, args.dtype, Tokenizer(folder), int4_layers
    )
    print(f"wrote {args.method} checkpoint to {out}: load it with LLM({str(out)!r})")
    return 0


def cmd_bench(args) -> int:
    from minillm.tools.bench import run_generate_benchmark

    run_generate_benchmark(
        model=args.model,
        dtypes=args.dtypes,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        threads=args.threads,
        device=args.device,
        include_hf=not args.no_hf,
        out_dir=args.out,
        compile=not args.no_compile,
        prefill_len=args.prefill_len,
        llama_bench=args.llama_bench,
        gguf=args.gguf,
        quantization=args.quantization,
    )
    return 0


def cmd_course_build(args) -> int:
    import warnings
    from pathlib import Path

    from minillm.course.build import ExerciseWarning, build

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExerciseWarning)
        differing = build(Path(args.solutions), Path(args.notebooks), check_only=args.check)
    for message in dict.fromkeys(str(w.message) for w in caught):  # each once, in order
        print(f"warning: {message}", file=sys.stderr)
    if args.check:
        for path in differing:
            print(f"out of date: {path}")
        return 1 if differing else 0
    print(f"wrote {len(differing)} notebook(s)" if differing else "notebooks/ is up to date")
    return 0


DEFAULT_GRADE_TIMEOUT = 900  # = minillm.course.grade.DEFAULT_TIMEOUT (not imported: it imports torch)
DEFAULT_GRADE_CELL_TIMEOUT = 600  # = minillm.course.grade.DEFAULT_CELL_TIMEOUT


def cmd_course_nbgrader_source(args) -> int:
    from pathlib import Path

    from minillm.course.build import nbgrader_source

    try:
        written = nbgrader_source(Path(args.solutions), Path(args.course), args.chapter, overwrite=args.overwrite)
    except FileExistsError as err:
        raise ValueError(str(err)) from None
    for path in written:
        print(f"wrote {path}")
    print(f"next, in {args.course}: nbgrader generate_assignment <chapter> (see docs/instructors.md)")
    return 0


def cmd_course_grade(args) -> int:
    from pathlib import Path

    from minillm.course.grade import grade_folder, grade_notebook, write_csv

    path = Path(args.path)
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout}: the seconds allowed per notebook must be positive")
    if args.cell_timeout <= 0:
        raise ValueError(f"--cell-timeout {args.cell_timeout}: the seconds allowed per cell must be positive")
    if path.is_dir():
        grades = grade_folder(path, args.csv, timeout=args.timeout, cell_timeout=args.cell_timeout)
    elif path.is_file():
        grades = [grade_notebook(path, timeout=args.timeout, cell_timeout=args.cell_timeout)]
        if args.csv:
            write_csv(grades, args.csv)
    else:
        raise FileNotFoundError(f"{path}: no such notebook or folder")
    if args.json:
        print(json.dumps([g.as_dict() for g in grades], indent=2, ensure_ascii=False))
    else:
        for g in grades:
            print(g.as_text())
        course = [g for g in grades if g.course]
        if len(grades) > 1:
            points = sum(g.points for g in course)
            most = sum(g.max_points for g in course)
            print(
                f"{len(grades)} notebooks ({len(grades) - len(course)} not course notebooks): {points}/{most} points in all"
            )
        if path.is_dir():
            print(f"wrote {args.csv or path / 'grades.csv'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated options: `serve` hands its arguments on to replica servers, and a prefix such
    # as --data-parallel would slip past the router's filter into every replica.
    parser = argparse.ArgumentParser(
        prog="minillm", description="A compact LLM inference engine and course.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "warmup",
        help="compile the decode steps of MODELs (default: the course's) ahead of a class",
        description="Build the compiled decode step of each MODEL with the engine options given (default: the "
        "course's engine, SmolLM2-135M in bf16), so that no learner waits for it. Graphs go to "
        "<cache>/compiled; a second run loads them in seconds.",
    )
    p.add_argument("models", nargs="*", metavar="MODEL", help="short name or HF-format folder")
    add_engine_flags(p.add_argument_group("engine"))
    p.set_defaults(func=cmd_warmup)

    p = sub.add_parser(
        "cache",
        help="what the cache folder holds (size per part); `clean` removes compiled code",
        description="Report the cache folder ($MINILLM_CACHE, else <repo>/.cache/minillm) part by part, or with "
        "`clean` remove its compiled code (decode packages, inductor's cache) and the files of compiles whose "
        "processes were killed; --all removes everything, converted models too. The engine builds what it needs again.",
    )
    p.add_argument("action", nargs="?", choices=["report", "clean"], default="report")
    p.add_argument("--all", action="store_true", help="with clean: remove everything in the cache")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable: runs batched)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print one JSON record per prompt, with metrics")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive streaming chat")
    p.add_argument("--system", default=None, help="system message")
    _add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat, temperature=0.0, max_tokens=256)

    p = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)", allow_abbrev=False
    )
    p.add_argument(
        "models", nargs="*", metavar="MODEL", help="short name or HF-format folder, as `vllm serve MODEL` (or --model)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--response-cache", type=int, default=0, help="cache this many greedy responses (default: off)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests allowed to wait for a seat; more get 429")
    p.add_argument("--max-body-bytes", type=int, default=2 << 20, help="largest request body accepted (413 above)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--enable-docs", action="store_true", help="serve the interactive API docs at /docs (default: off)")
    p.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to arrive in full (408)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0, help="seconds an idle connection stays open")
    p.add_argument("--header-timeout", type=float, default=10.0, help="seconds a request's headers may take")
    p.add_argument("--max-connections", type=int, default=1024, help="open connections; more get 503")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="on SIGTERM, seconds to finish running requests")
    p.add_argument(
        "--allowed-hosts", metavar="HOST,...", default=None, type=lambda text: [h for h in text.split(",") if h],
        help="Host header names accepted, comma-separated (default: localhost, 127.0.0.1, [::1] on loopback; "
        "any on 0.0.0.0; '*': any)",
    )  # fmt: skip
    p.add_argument(
        "--api-key", default=environment.get("MINILLM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MINILLM_API_KEY, else none)",
    )  # fmt: skip
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="serve from this many engine replicas (processes) behind a router",
    )
    p.add_argument(
        "--router-policy",
        default="prefix_aware",
        choices=["round_robin", "least_loaded", "prefix_aware"],
        help="how the router picks a replica (default: where the prompt's prefix is cached)",
    )
    p.add_argument(
        "--your-engine", metavar="FOLDER", default=None,
        help="serve with the course pieces you passed, recorded in FOLDER (a course folder's your_engine/; "
        "runs the code kept there)",
    )  # fmt: skip
    _add_engine_args(p, several_models=True)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("batch", help="run an OpenAI batch file (JSONL of requests) offline, writing JSONL results")
    p.add_argument("input", help="JSONL: one {custom_id, method, url, body} per line")
    p.add_argument("output", help="JSONL results, one per input line, in input order")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_args(p, several_models=True)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("assets", help="convert the bundled model(s) into HF folders (idempotent)")
    p.add_argument("--model", action="append", help="asset name (default: all)")
    p.set_defaults(func=cmd_assets)

    p = sub.add_parser("quantize", help="quantize a checkpoint once and save it (int8 | int4 | awq | w8a8)")
    p.add_argument("model", help="short name or HF-format folder")
    p.add_argument("--method", required=True, choices=["int8", "int4", "awq", "w8a8"])
    p.add_argument("--group-size", type=int, default=None, help="int4/awq group: 32 | 64 | 128 | 256 (default: auto)")
    p.add_argument("--dtype", default="bf16", help="dtype of the parts kept unquantized (default: bf16)")
    p.add_argument(
        "--from-gguf",
        action="store_true",
        help="int4: take the shipped GGUF file's own Q4_1 blocks (groups of 32) as they are, no re-quantizing",
    )
    p.add_argument("--out", required=True, help="folder to write")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("bench", help="decode/prefill benchmark against HF generate() and, if given, llama.cpp")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the compiled engine (its first start on a machine compiles for ~3 min per dtype)",
    )
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int4", "awq", "w8a8"],
        help="minillm's engines with quantized weights (HF stays unquantized)",
    )
    p.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary: add llama.cpp as the anchor")
    p.add_argument("--gguf", default=None, help="the same model as a GGUF file (bf16) for --llama-bench")
    p.add_argument("--out", default=None, help="folder for the JSON result (default: print only)")
    p.set_defaults(func=cmd_bench)

    course = sub.add_parser("course", help="course tools: build student notebooks, grade submissions")
    course_sub = course.add_subparsers(dest="course_command", required=True)
    p = course_sub.add_parser("build", help="generate notebooks/ from solutions/")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--notebooks", default="notebooks")
    p.add_argument("--check", action="store_true", help="only report notebooks that are out of date (exit 1)")
    p.set_defaults(func=cmd_course_build)
    p = course_sub.add_parser(
        "nbgrader-source", help="write the solved chapters as nbgrader source notebooks (COURSE/source/<chapter>/)"
    )
    p.add_argument("course", help="the nbgrader course folder (created if missing)")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--chapter", action="append", help="only this chapter, e.g. 01_prefill_and_decode (repeatable)")
    p.add_argument("--overwrite", action="store_true", help="replace source notebooks that already exist")
    p.set_defaults(func=cmd_course_nbgrader_source)
    p = course_sub.add_parser(
        "grade", help="run a notebook (or every notebook in a folder) and report its checks and points"
    )
    p.add_argument("path", help="a .ipynb file or a folder of submissions")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--csv", default=None, help="write a CSV here (a folder: default FOLDER/grades.csv)")
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_GRADE_TIMEOUT,
        help=f"seconds each notebook may run, all cells together (default: {DEFAULT_GRADE_TIMEOUT})",
    )
    p.add_argument(
        "--cell-timeout",
        type=float,
        default=DEFAULT_GRADE_CELL_TIMEOUT,
        help=f"seconds one code cell may run: a cell past it is named with its last output (default: "
        f"{DEFAULT_GRADE_CELL_TIMEOUT})",
    )
    p.set_defaults(func=cmd_course_grade)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as err:
        print(f"minillm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the user knows; no traceback
        print("minillm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
