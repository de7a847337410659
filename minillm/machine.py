"""What machine a figure was measured on: the CPU model and the flags that decide the fast
paths (bf16 dot products, AMX tiles), cores, threads, versions, the GPU if any. Every benchmark
records it, and the engine keys per-machine decisions on it (``attention/precision.py``)."""

from __future__ import annotations

import importlib.util
import os
import platform
from pathlib import Path

import torch


def machine_description(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == (platform.processor() or platform.machine()):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                present = set(line.split(":", 1)[1].split())
                flags = [
                    f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in present
                ]
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_flags": flags,  # what decides the fast paths: bf16 dot products, AMX tiles
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_tag(machine: dict) -> str:
    """The GPU's or else the CPU's name as a file-name part (``AMD_EPYC``): result files of runs
    on two machines must not overwrite each other."""
    name = machine.get("gpu") or machine.get("cpu") or "cpu"
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (its kernels then run on CUDA, or on the CPU
    in Triton's interpreter). A probe of this environment, not a setting."""
    return importlib.util.find_spec("triton") is not None
