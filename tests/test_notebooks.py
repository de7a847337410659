"""Every chapter runs, solved and as a learner gets it, under nbval — one test per notebook, so
the notebooks share the suite's workers instead of running one after another at its end.

Each test runs ``pytest --nbval`` (solutions: every cell's output compared, sanitized where a
cell says ``# NBVAL_IGNORE_OUTPUT``) or ``pytest --nbval-lax`` (the student notebooks: every
cell runs, the exercises' ``NotImplementedError`` included where a check cell expects it) on one
notebook, in a process of its own with its own kernel, exactly as a person would type it.

Chapters 00, 01 and 10 — a learner's first cells, and the server a learner starts as an
operator would — run as shipped: the default engine (its decode step compiling in the
background where the model is big enough) on a cold cache holding only the converted models,
with no compiled package and no inductor cache; each notebook gets a cold cache of its own. The
other chapters' subject is not the compile: they run eagerly (``MINILLM_COMPILE=0``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.assets import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted(p.name for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
AS_SHIPPED = ("00_welcome.ipynb", "01_prefill_and_decode.ipynb", "10_serving.ipynb")
NOTEBOOK_TIMEOUT_S = 1500  # the slowest chapter takes ~5 min alone on 2 cores


def cold_cache(folder: Path) -> Path:
    """A cache as a new learner's machine has it: the converted models, nothing compiled or measured."""
    folder.mkdir(parents=True)
    for model in cache_dir().iterdir():
        if (model / "config.json").is_file():
            (folder / model.name).symlink_to(model.resolve())
    return folder


def notebook_env(chapter: str, tmp_path: Path) -> dict[str, str]:
    # pytest's own variables stay with this process (an xdist worker's would confuse the child's).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTEST_XDIST"))}
    if chapter in AS_SHIPPED:
        env.pop("MINILLM_COMPILE", None)
        env.pop("MINILLM_COMPILE_NICENESS", None)  # the compiler at the lowest priority, as shipped
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # minillm puts it under the cold cache
        env.pop("OMP_NUM_THREADS", None)  # the machine's own thread count (a busy machine's governor adapts it)
        env["MINILLM_CACHE"] = str(cold_cache(tmp_path / "cold-cache"))
    else:
        env["MINILLM_COMPILE"] = "0"
    return env


def test_the_chapter_lists_are_the_course():
    assert len(CHAPTERS) == 11 and all(c in CHAPTERS for c in AS_SHIPPED)
    assert sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")) == CHAPTERS


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 60)
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("kind", ["solutions", "notebooks"])
def test_the_notebook_runs_under_nbval(kind, chapter, tmp_path):
    mode = "--nbval" if kind == "solutions" else "--nbval-lax"
    command = [sys.executable, "-m", "pytest", mode, "--nbval-current-env", "-q", "-p", "no:cacheprovider",
               "-o", "addopts=", f"{kind}/{chapter}"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=notebook_env(chapter, tmp_path), capture_output=True, text=True,
                          timeout=NOTEBOOK_TIMEOUT_S)  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert done.returncode == 0, f"{kind}/{chapter}: {summary[0]}\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
