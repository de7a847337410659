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
    assert "'lots' is not a number of bytes" in capsys.readouterr().err


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
