"""The command line: help everywhere, generation (plain, JSON, streaming), clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minillm.cli import build_parser, main


@pytest.mark.parametrize("command", [[], ["generate"], ["chat"], ["assets"], ["bench"]])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: minillm" in capsys.readouterr().out


def test_generate_json(tiny_model, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_model),
            "--dtype",
            "fp32",
            "--prompt",
            "To be",
            "--prompt",
            "Caches",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["To be", "Caches"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in records)
    assert records[0]["metrics"]["ttft"] > 0


def test_generate_stream_matches_plain(tiny_model, capsys):
    args = [
        "generate",
        "--model",
        str(tiny_model),
        "--dtype",
        "fp32",
        "--prompt",
        "To be",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]
    main(args)
    plain = capsys.readouterr().out
    main([*args, "--stream"])
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize(
    "engine_flags",
    [
        ["--mode", "contiguous"],
        ["--scheduling-policy", "static", "--block-size", "4", "--no-prefix-caching"],
        ["--no-chunked-prefill", "--kv-cache-memory", "0.01", "--max-num-seqs", "1"],
    ],
)
def test_engine_flags_give_the_same_tokens(tiny_model, capsys, engine_flags):
    args = ["generate", "--model", str(tiny_model), "--dtype", "fp32", "--prompt", "To be", "--prompt", "Caches"]
    args += ["--max-tokens", "6", "--ignore-eos", "--json"]
    assert main(args) == 0
    default = [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]
    assert main([*args, *engine_flags]) == 0
    assert [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()] == default


def test_bad_engine_flags_are_clean_errors(tiny_model, capsys):
    base = ["generate", "--model", str(tiny_model), "--prompt", "x"]
    assert main([*base, "--block-size", "0"]) == 2
    assert "block_size=0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--kv-cache-memory", "lots"])
    assert exit_info.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_generate_chat(tiny_model, capsys):
    assert main(["generate", "--model", str(tiny_model), "--chat", "--prompt", "hi", "--max-tokens", "3"]) == 0


def test_bad_sampling_value_is_a_clean_error(tiny_model, capsys):
    code = main(["generate", "--model", str(tiny_model), "--prompt", "x", "--top-p", "1.5"])
    assert code == 2
    assert "minillm: error: top_p=1.5 must be in (0, 1]" in capsys.readouterr().err


def test_missing_model_is_a_clean_error(capsys):
    assert main(["generate", "--model", "/no/such/folder", "--prompt", "x"]) == 2
    assert "neither a known name" in capsys.readouterr().err


def test_chat_session_over_stdin(tiny_model):
    """The interactive chat, driven through a pipe: two turns, a reset, then /exit."""
    result = subprocess.run(
        [sys.executable, "-m", "minillm", "chat", "--model", str(tiny_model), "--max-tokens", "4"],
        input="hello\nagain\n/reset\n/exit\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant> ") == 2


def test_console_script_is_declared():
    parser = build_parser()
    assert parser.prog == "minillm"


def test_compile_flag_maps_to_the_engine_option():
    from minillm.cli import _engine_kwargs

    parser = build_parser()
    for flag, value in (("auto", None), ("on", True), ("off", False)):
        args = parser.parse_args(["generate", "--prompt", "x", "--compile", flag])
        assert _engine_kwargs(args)["compile"] is value
    assert _engine_kwargs(parser.parse_args(["generate", "--prompt", "x"]))["compile"] is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prompt", "x", "--compile", "yes"])


def _chat(tiny_model, stdin: bytes, *flags):
    return subprocess.run(
        [sys.executable, "-m", "minillm", "chat", "--model", str(tiny_model), "--max-tokens", "6", *flags],
        input=stdin,
        capture_output=True,
        timeout=120,
    )


def test_chat_survives_bad_bytes_and_an_overlong_history(tiny_model):
    # Non-UTF-8 input is reported and the session continues; a history longer than the
    # context drops its oldest turns; a message longer than the whole context is refused.
    from minillm.tokenizer import Tokenizer

    long = "word " * 12
    tokenizer = Tokenizer(tiny_model)
    n = len(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": long}]), add_special_tokens=False))
    context = int(1.6 * n)  # one long turn fits, two do not
    stdin = (
        b"\xff\xfe bad bytes\nhello\n" + (long + "\n" + long + "\n").encode() + ("x " * 4 * n).encode() + b"\n/exit\n"
    )
    result = _chat(tiny_model, stdin, "--max-model-len", str(context))
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "not valid UTF-8" in out
    assert out.count("history trimmed") >= 1
    assert "this message alone does not fit the context" in out
    assert out.count("assistant> ") == 3


def test_chat_ctrl_c_stops_the_reply_not_the_session(tiny_model, monkeypatch, capsys):
    from minillm.entrypoints.llm import LLM

    real_stream = LLM.stream
    calls = {"n": 0}

    def stream(self, prompt, params=None):
        calls["n"] += 1
        for i, delta in enumerate(real_stream(self, prompt, params)):
            if calls["n"] == 1 and i == 2:
                raise KeyboardInterrupt
            yield delta

    lines = iter(["first", "second", "/exit"])
    monkeypatch.setattr(LLM, "stream", stream)
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(tiny_model), "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "[stopped]" in out and out.count("assistant> ") == 2


def test_stream_json_prints_one_record_per_delta(tiny_model, capsys):
    args = ["generate", "--model", str(tiny_model), "--dtype", "fp32", "--prompt", "To be", "--max-tokens", "5"]
    assert main([*args, "--ignore-eos", "--stream", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 5 and records[-1]["finish_reason"] == "length"
    assert [r["token_id"] for r in records] == records[-1]["output"]["token_ids"]


def test_output_piped_into_head_exits_quietly(tiny_model):
    result = subprocess.run(
        f"{sys.executable} -m minillm generate --model {tiny_model} --prompt a --prompt b --prompt c "
        "--max-tokens 40 --ignore-eos --stream | head -c 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_grade_timeout_flag_is_validated(tmp_path, capsys):
    assert main(["course", "grade", str(tmp_path), "--timeout", "0"]) == 2
    assert "--timeout 0" in capsys.readouterr().err
