"""Your engine: the package's engine with every piece you wrote plugged in.

Each check you pass keeps your code in ``your_engine/`` beside the notebook (``records.py``).
``your_engine()`` loads those records, fits each into the hook its check graded it through
(``plugs.py``), builds the engine inside those hooks and tells you, piece by piece, whose code
runs — yours or the package's — and how often the engine called yours::

    from minillm.course import your_engine

    engine = your_engine("smollm2-135m")
    print(engine)                                  # the pieces: yours, the package's, or not in this mode
    engine.generate(["The capital of France is"])  # runs your code where the course covers it
    with engine.serving() as url:                  # minillm's OpenAI-compatible server, on your engine
        ...

``minillm serve MODEL --your-engine FOLDER`` serves it from a terminal.

The engine is built in fp32 with the ``torch`` attention backend and without ``torch.compile``:
those are the settings under which the engine calls every hook in Python, so your code runs
instead of a kernel or a compiled graph that has the package's arithmetic baked in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import minillm.hooks as hooks
from minillm.course.plugs import PLUGS, Plug
from minillm.course.records import Record, default_folder, read_records

#: The engine settings under which every hook runs in Python (see the module's docstring).
ENGINE_DEFAULTS = {"dtype": "fp32", "attention_backend": "torch", "compile": False}


@dataclass
class Piece:
    """One hook of the engine and whose code answers it."""

    hook: str
    chapter: str
    owner: str  # "yours" or "package"
    check: str = ""  # the check that recorded yours
    note: str = ""  # why yours is not plugged in, or when the engine calls it
    calls: int = 0  # how often the engine called yours since the engine was built

    @property
    def yours(self) -> bool:
        return self.owner == "yours"


class _Counted:
    """The learner's plug, counting its calls (so the report can say which of their pieces ran)."""

    def __init__(self, fn: Callable, piece: Piece):
        self.fn, self.piece = fn, piece

    def __call__(self, *args, **kwargs):
        self.piece.calls += 1
        return self.fn(*args, **kwargs)


def _model_config(model: str):
    from minillm.assets import resolve_model
    from minillm.config.model import ModelConfig

    return ModelConfig.from_folder(resolve_model(model))


def plug_records(records: dict[str, Record], mode: str, config) -> tuple[dict[str, Callable], list[Piece], list[str]]:
    """The hook overrides that put the recorded pieces into an engine of ``mode``, the piece
    table (every hook, whose code answers it) and the passed checks that are not engine pieces.

    Later chapters win where two checks plug the same hook (chapter 05's grouped-query attention
    over chapter 01's causal attention): the later one was written for the more general engine."""
    points = hooks.points()
    pieces = {name: Piece(name, point.chapter.split(" ")[0], "package") for name, point in points.items()}
    overrides: dict[str, Callable] = {}
    taught_only: list[str] = []
    for check, rec in sorted(records.items(), key=lambda item: (item[1].chapter, item[0])):
        plug: Plug | None = PLUGS.get(check)
        if plug is None:
            taught_only.append(check)
            continue
        if rec.error:
            for hook in plug.hooks:
                pieces[hook].note = f"your {check} was not recorded: {rec.error}"
            continue
        if mode not in plug.modes:
            for hook in plug.hooks:
                if not pieces[hook].yours:
                    pieces[hook].note = f"yours ({check}) runs in mode={'/'.join(sorted(plug.modes))!r}"
            continue
        try:
            built = plug.build(tuple(rec.load()), config)
        except Exception as err:  # noqa: BLE001 — a record that no longer loads is reported, the package's runs
            for hook in plug.hooks:
                pieces[hook].note = f"your {check} did not load: {type(err).__name__}: {err}"
            continue
        for hook, fn in built.items():
            piece = pieces[hook]
            piece.owner, piece.check, piece.note, piece.calls = "yours", check, plug.when, 0
            overrides[hook] = _Counted(fn, piece)
    return overrides, list(pieces.values()), taught_only


class YourEngine:
    """An ``LLM`` whose hooks run the learner's recorded pieces whenever it is used through this object."""

    def __init__(self, model: str = "smollm2-135m", folder: str | Path | None = None, mode: str = "paged",
                 **engine_args):  # fmt: skip
        from minillm import LLM

        self.model, self.mode = model, mode
        self.folder = Path(folder) if folder is not None else default_folder()
        self.records = read_records(self.folder)
        self.overrides, self.pieces, self.taught_only = plug_records(self.records, mode, _model_config(model))
        self.engine_args = {**engine_settings(engine_args), "mode": mode}
        with self.plugged():  # the rotary tables and the block pool are made as the engine is built
            self.llm = LLM(model, **self.engine_args)

    @contextlib.contextmanager
    def plugged(self) -> Iterator[None]:
        """Inside the ``with``, every engine of this process runs the learner's pieces (hooks are process-wide)."""
        with hooks.override(**self.overrides):
            yield

    def generate(self, prompts, sampling_params=None, **kwargs):
        """``LLM.generate`` with the learner's pieces plugged in."""
        with self.plugged():
            return self.llm.generate(prompts, sampling_params, **kwargs)

    @contextlib.contextmanager
    def serving(self, **app_args) -> Iterator[str]:
        """minillm's OpenAI-compatible server on this engine, in a thread of this process; yields
        its URL (``openai.OpenAI(base_url=url + "/v1", api_key="none")``)."""
        from minillm.server.app import build_app
        from minillm.server.async_engine import AsyncEngine
        from minillm.server.launch import ServerThread

        served = AsyncEngine(self.llm.engine, self.model, 256)
        with self.plugged(), ServerThread(build_app({self.model: served}, **app_args)) as server:
            yield server.url

    @property
    def yours(self) -> list[Piece]:
        return [p for p in self.pieces if p.yours]

    def __str__(self) -> str:
        rows = [
            f"your engine ({self.model}, mode={self.mode!r}): {len(self.yours)} of {len(self.pieces)} pieces are yours"
        ]
        if not self.records:
            rows.append(f"  no records in {self.folder}: every check you pass in a notebook of this folder adds one")
        for p in self.pieces:
            ran = f", called {p.calls}×" if p.yours else ""
            note = f" — {p.note}" if p.note else ""
            rows.append(f"  {'✅ yours  ' if p.yours else '   package'}  {p.chapter:>2}  {p.hook}{ran}{note}")
        if self.taught_only:
            rows.append("  passed, graded on their own (not a hook of this engine): " + ", ".join(self.taught_only))
        return "\n".join(rows)

    __repr__ = __str__


def engine_settings(engine_args: dict) -> dict:
    """``engine_args`` with what your pieces need: the ``torch`` attention backend and no compile
    (anything else would run kernels in their place, so they are refused), fp32 unless a dtype is given."""
    for name, needed in (("attention_backend", "torch"), ("compile", False)):
        if engine_args.get(name, "auto") not in ("auto", None, needed):
            raise ValueError(
                f"your engine runs your pieces in Python, with {name}={needed!r}; {name}={engine_args[name]!r} would run "
                "the package's kernels in their place"
            )
    out = {**engine_args, "attention_backend": "torch", "compile": False}
    if out.get("dtype", "auto") == "auto":
        out["dtype"] = ENGINE_DEFAULTS["dtype"]
    return out


def serving_plugs(folder: str | Path | None, model: str, engine_args: dict) -> tuple[dict[str, Callable], dict, str]:
    """For ``minillm serve --your-engine FOLDER``: the hook overrides of the recorded pieces (to
    hold for the server's life), the engine settings, and the piece table to print."""
    folder = Path(folder) if folder is not None else default_folder()
    records = read_records(folder)
    if not records:
        raise ValueError(
            f"--your-engine {folder}: no records there; each check passed in a notebook of that folder adds one"
        )
    overrides, pieces, _ = plug_records(records, "paged", _model_config(model))
    yours = [p for p in pieces if p.yours]
    table = f"your engine from {folder}: {len(yours)} of {len(pieces)} pieces are yours: " + ", ".join(
        p.hook for p in yours
    )
    return overrides, {**engine_settings(engine_args), "mode": "paged"}, table


def your_engine(model: str = "smollm2-135m", folder: str | Path | None = None, mode: str = "paged",
                **engine_args) -> YourEngine:  # fmt: skip
    """The engine with every piece you passed plugged in (records in ``folder``, default
    ``./your_engine``). ``mode``: "paged" (the serving engine), "contiguous" or "naive" (chapter
    01's whole-sequence engine, where your decoder layer runs). Other ``engine_args`` go to ``LLM``."""
    if mode not in ("paged", "contiguous", "naive"):
        raise ValueError(f"mode={mode!r}: use 'paged', 'contiguous' or 'naive'")
    return YourEngine(model, folder, mode, **engine_args)
