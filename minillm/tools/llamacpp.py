"""llama.cpp as the benchmark's anchor: its own ``llama-bench`` (and ``llama-batched-bench``
for batches) run on the same machine, in the same run, on the same model converted to GGUF.

We do not link llama.cpp; we run its benchmark tools as subprocesses and read their JSON, so
the figures are the ones llama.cpp itself reports (decode ``tg``, prefill ``pp``). How to
build the tools and convert the model: the README's "Benchmarks" section.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch
from gguf import GGUFReader

from minillm.config import environment

# general.file_type of a GGUF file (llama.cpp's LLAMA_FTYPE_*) → the dtype our engine runs.
FILE_TYPES = {0: torch.float32, 1: torch.float16, 32: torch.bfloat16}


class LlamaCpp:
    def __init__(self, llama_bench: str | None, gguf: str | None, threads: int):
        if llama_bench is None:
            raise ValueError("--gguf needs --llama-bench PATH: the llama.cpp binary that runs it")
        if gguf is None:
            raise ValueError(
                "--llama-bench needs --gguf PATH: the model converted with llama.cpp's convert_hf_to_gguf.py"
            )
        self.binary = Path(llama_bench)
        self.gguf = Path(gguf)
        for path, what in ((self.binary, "--llama-bench"), (self.gguf, "--gguf")):
            if not path.is_file():
                raise ValueError(f"{what} {path}: no such file")
        self.threads = threads
        batched = self.binary.with_name("llama-batched-bench")
        self.batched = batched if batched.is_file() else None
        self.dtype = gguf_dtype(self.gguf)
        self.build = None

    def supports_batch(self, batch: int) -> bool:
        """Batch 1 through llama-bench; larger batches need llama-batched-bench beside it."""
        return batch == 1 or self.batched is not None

    def measure(self, batch: int | str, prompt_len: int, new_tokens: int) -> dict:
        """One measurement, as llama.cpp reports it: ``{"decode_tok_s"}`` for a batch (all
        sequences together), ``{"prefill_tok_s"}`` for ``batch="prefill"``."""
        if batch == "prefill":
            entry = self._llama_bench("-p", str(prompt_len), "-n", "0")
            return {"prefill_tok_s": entry["avg_ts"]}
        if batch == 1:  # decoding after a prompt_len-token context, as our engines do
            entry = self._llama_bench("-p", "0", "-n", str(new_tokens), "-d", str(prompt_len))
            return {"decode_tok_s": entry["avg_ts"]}
        context = batch * (prompt_len + new_tokens) + 16
        args = ["-npp", str(prompt_len), "-ntg", str(new_tokens), "-npl", str(batch), "-c", str(context)]
        out = self._run(self.batched, "-m", str(self.gguf), "-t", str(self.threads), *args, "--output-format", "jsonl")
        entry = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        return {"decode_tok_s": entry["speed_tg"], "prefill_tok_s": entry["speed_pp"]}

    def describe(self) -> dict:
        return {
            "llama_bench": str(self.binary),
            "llama_batched_bench": str(self.batched) if self.batched else None,
            "gguf": self.gguf.name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "build": self.build,
        }

    def _llama_bench(self, *args: str) -> dict:
        out = self._run(self.binary, "-m", str(self.gguf), "-t", str(self.threads), "-r", "1", "-o", "json", *args)
        (entry,) = json.loads(out)
        self.build = entry.get("build_commit")
        return entry

    def _run(self, binary: Path, *args: str) -> str:
        cmd = [str(binary), *args]
        env = None
        if shutil.which(binary.name) is None:  # a build tree: its shared libraries sit beside it
            env = environment.for_children(LD_LIBRARY_PATH=f"{binary.parent}:{environment.get('LD_LIBRARY_PATH') or ''}")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:  # not executable, not a binary, hung
            raise RuntimeError(f"{binary}: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout


def gguf_dtype(path: Path) -> torch.dtype:
    """The weights' dtype of a GGUF file (its ``general.file_type``)."""
    try:
        field = GGUFReader(str(path)).fields.get("general.file_type")
    except (ValueError, OSError) as e:
        raise ValueError(f"--gguf {path}: not a readable GGUF file ({e})") from e
    if field is None:
        raise ValueError(f"{path}: no general.file_type; convert with --outtype bf16 (or f32 / f16)")
    file_type = int(field.parts[field.data[0]][0])
    if file_type not in FILE_TYPES:
        raise ValueError(f"{path}: file type {file_type} is quantized; the anchor compares bf16/f16/f32 weights")
    return FILE_TYPES[file_type]
