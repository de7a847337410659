"""A mutation sweep of the course checks: does each check kill small bugs in its reference solution?

For every exercise, the solved function(s) in ``solutions/<chapter>.ipynb`` (the lines between
``### BEGIN SOLUTION`` and ``### END SOLUTION``) are mutated one small change at a time — an
arithmetic or bit operator swapped, a comparison loosened or flipped, a constant ±1 (or doubled,
for a float), an index ±1, ``and``/``or`` swapped — and the exercise's check runs on each mutant.
A mutant the check fails is *killed*; one it passes *survives*. A surviving mutant is either a
bug the check misses (make the check catch it) or *equivalent* — it computes the same thing on
every input a learner's function can get — and then it is listed in ``EQUIVALENT`` with why.

``python tests/mutation_sweep.py [check ...]`` prints the table; ``test_mutation_sweep.py`` holds
each exercise to ``KILL_TARGET`` of its non-equivalent mutants.

Why mutations of the reference and not only hand-written wrong answers: the catalogue holds the
mistakes we thought of; mutants are the ones nobody thought of, generated without our bias.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import io
import json
import linecache
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
KILL_TARGET = 0.90
MUTANT_TIMEOUT_S = 30  # a mutant that loops for ever is cut off (and counted as killed: it never passes)

_BINOP_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Pow: ast.Mult,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
    ast.BitXor: ast.BitOr,
    ast.MatMult: ast.Mult,
}
_COMPARE_SWAPS = {
    ast.Lt: (ast.LtE, ast.Gt),
    ast.LtE: (ast.Lt, ast.GtE),
    ast.Gt: (ast.GtE, ast.Lt),
    ast.GtE: (ast.Gt, ast.LtE),
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
}
_NAME_SWAPS = {  # functions and methods a learner confuses with their opposite
    "min": "max", "max": "min", "argmin": "argmax", "argmax": "argmin", "amin": "amax", "amax": "amin",
    "minimum": "maximum", "maximum": "minimum", "floor": "ceil", "ceil": "floor", "any": "all", "all": "any",
    "tril": "triu", "triu": "tril",
}  # fmt: skip
_SYMBOL = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
    ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|", ast.BitAnd: "&", ast.BitXor: "^", ast.MatMult: "@",
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.And: "and", ast.Or: "or",
}  # fmt: skip


@dataclass
class Mutant:
    exercise: str  # the check's name
    key: str  # stable name: "line 3: `<` → `<=`" (line counted from BEGIN SOLUTION)
    source: str  # the whole mutated cell


@dataclass
class Outcome:
    mutant: Mutant
    verdict: str  # "killed", "survived", "timeout", "check crashed"
    message: str = ""
    seconds: float = 0.0


@dataclass
class ExerciseSweep:
    check: str
    outcomes: list[Outcome] = field(default_factory=list)

    def counted(self) -> list[Outcome]:
        equivalent = EQUIVALENT.get(self.check, {})
        return [o for o in self.outcomes if o.mutant.key not in equivalent]

    @property
    def rate(self) -> float:
        counted = self.counted()
        return sum(o.verdict != "survived" for o in counted) / len(counted) if counted else 1.0

    def survivors(self) -> list[Outcome]:
        return [o for o in self.counted() if o.verdict == "survived"]


# ---- finding the reference solutions ----------------------------------------------------------------


def _cells(chapter: str) -> list[dict]:
    return [c for c in json.loads((SOLUTIONS / f"{chapter}.ipynb").read_text())["cells"] if c["cell_type"] == "code"]


def solution_cell(exercise) -> str:
    """The nearest code cell before the exercise's check cell that holds a solution: the solved
    function(s) (a test-sized example cell may sit between them)."""
    cells = _cells(exercise.chapter)
    at = next(i for i, c in enumerate(cells) if "".join(c["source"]).strip() == exercise.call)
    for cell in reversed(cells[:at]):
        source = "".join(cell["source"])
        if BEGIN in source:
            return source
        if any(e.call == source.strip() for e in _exercises()):
            break  # the previous exercise's check: this one has no solution cell of its own
    raise ValueError(f"{exercise.check}: no cell between the previous check and `{exercise.call}` has {BEGIN}")


def _exercises():
    from minillm.course import EXERCISES

    return EXERCISES


def chapter_namespace(chapter: str) -> dict:
    """What a solution cell sees: every import of the chapter's code cells (not the cells' work)."""
    space: dict = {"__name__": "__main__"}
    for cell in _cells(chapter):
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:  # a cell with IPython magics
            continue
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        if imports:
            exec(compile(ast.Module(imports, []), f"<{chapter} imports>", "exec"), space)
    return space


# ---- the mutations ------------------------------------------------------------------------------------


def _solution_lines(source: str) -> list[tuple[int, int]]:
    """The (first, last) line numbers, 1-based, of each BEGIN…END region."""
    regions, start = [], None
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip() == BEGIN:
            start = number
        elif line.strip() == END and start is not None:
            regions.append((start, number))
            start = None
    return regions


def _where(node, regions) -> int | None:
    line = getattr(node, "lineno", None)
    for first, last in regions:
        if line is not None and first < line < last:
            return line - first  # counted from the BEGIN line of its region
    return None


def _changes(node) -> list[tuple[str, callable]]:
    """Each small change to ``node`` alone: (what it does, a function applying it to a copy)."""
    out = []

    def setter(attr, value):
        return lambda n: setattr(n, attr, value)

    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BINOP_SWAPS:
        new = _BINOP_SWAPS[type(node.op)]
        out.append((f"`{_SYMBOL[type(node.op)]}` → `{_SYMBOL[new]}`", setter("op", new())))
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _COMPARE_SWAPS.get(type(op), ()):

                def swap(n, i=i, new=new):
                    n.ops[i] = new()

                out.append((f"`{_SYMBOL[type(op)]}` → `{_SYMBOL[new]}`", swap))
    if isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append((f"`{_SYMBOL[type(node.op)]}` → `{_SYMBOL[new]}`", setter("op", new())))
    if isinstance(node, ast.AugAssign) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        out.append(("statement dropped", None))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("`not` dropped", None))  # handled by the parent rewrite below
    if isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)) and node.value is not None:
        value = node.value
        if isinstance(value, bool):
            out.append((f"`{value}` → `{not value}`", setter("value", not value)))
        elif isinstance(value, int):
            out += [(f"`{value}` → `{value + 1}`", setter("value", value + 1))]
            out += [(f"`{value}` → `{value - 1}`", setter("value", value - 1))]
        elif isinstance(value, float) and value == value and abs(value) != float("inf"):
            new = value * 2 if value else 1.0
            out.append((f"`{value!r}` → `{new!r}`", setter("value", new)))
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr
        new = _NAME_SWAPS.get(name)
        if new is not None:
            out.append((f"`{name}` → `{new}`", setter("id" if isinstance(node, ast.Name) else "attr", new)))
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, (ast.Slice, ast.Tuple, ast.Constant)):
        if not (isinstance(node.slice, ast.UnaryOp) and isinstance(node.slice.operand, ast.Constant)):
            for sign, op in (("+", ast.Add), ("-", ast.Sub)):
                out.append(
                    (
                        f"index `[{ast.unparse(node.slice)}]` {sign} 1",
                        setter("slice", ast.BinOp(node.slice, op(), ast.Constant(1))),
                    )
                )
    if isinstance(node, ast.Slice):
        for part in ("lower", "upper"):
            bound = getattr(node, part)
            if (
                bound is not None
                and not isinstance(bound, ast.Constant)
                and not (isinstance(bound, ast.UnaryOp) and isinstance(bound.operand, ast.Constant))
            ):
                for sign, op in (("+", ast.Add), ("-", ast.Sub)):
                    out.append(
                        (
                            f"slice {part} `{ast.unparse(bound)}` {sign} 1",
                            setter(part, ast.BinOp(bound, op(), ast.Constant(1))),
                        )
                    )
    return out


class _DropStatement(ast.NodeTransformer):
    """Drops one statement that only has an effect (a call like ``out.append(x)``, an ``x += y``)."""

    def __init__(self, target):
        self.target = target

    def generic_visit(self, node):
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and self.target in value:
                kept = [v for v in value if v is not self.target]
                setattr(node, name, kept or [ast.Pass()])
                return node
        return super().generic_visit(node)


class _DropNot(ast.NodeTransformer):
    def __init__(self, target):
        self.target = target

    def visit_UnaryOp(self, node):
        if node is self.target:
            return node.operand
        return self.generic_visit(node)


def mutants(exercise) -> list[Mutant]:
    """Every one-change mutant of the exercise's solution lines, each with a stable key."""
    source = solution_cell(exercise)
    regions = _solution_lines(source)
    tree = ast.parse(source)
    lines = source.splitlines()
    found, seen = [], set()
    for index, node in enumerate(ast.walk(tree)):
        line = _where(node, regions)
        if line is None:
            continue
        for what, apply in _changes(node):
            mutated = copy.deepcopy(tree)
            target = list(ast.walk(mutated))[index]
            if what == "statement dropped":
                mutated = _DropStatement(target).visit(mutated)
            elif apply is None:
                mutated = _DropNot(target).visit(mutated)
            else:
                apply(target)
            ast.fix_missing_locations(mutated)
            text = ast.unparse(mutated)
            if text in seen:
                continue
            seen.add(text)
            snippet = lines[node.lineno - 1].strip()
            if len(snippet) > 60:
                snippet = snippet[:57] + "..."
            key = f"line {line}: {what} in `{snippet}`"
            n = 2
            while any(m.key == key for m in found):
                key = f"line {line}: {what} in `{snippet}` (#{n})"
                n += 1
            found.append(Mutant(exercise.check, key, text))
    return found


# ---- running them -------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Not an Exception: a check's ``except Exception`` must not swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: int):
    def stop(signum, frame):
        raise _Timeout

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _define(source: str, namespace: dict, tag: str) -> dict:
    """Run a (mutated) solution cell; inspect.getsource must find it (the TP checks and Triton
    read the function's source), so its text goes into linecache under its own file name."""
    filename = f"<mutant {tag}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    space = dict(namespace)
    exec(compile(source, filename, "exec"), space)
    return space


def run(mutant: Mutant, exercise, namespace: dict) -> Outcome:
    import minillm.course as course
    from minillm.course.results import CheckError, CheckFailed

    start = time.perf_counter()
    try:
        space = _define(mutant.source, namespace, f"{exercise.check} {abs(hash(mutant.key))}")
        fns = [space[name] for name in exercise.functions]
    except Exception as err:  # a mutant that does not even define its function: a learner sees it at once
        return Outcome(mutant, "killed", f"does not run: {type(err).__name__}: {err}", time.perf_counter() - start)
    check = getattr(course, exercise.check)
    try:
        with _time_limit(MUTANT_TIMEOUT_S), contextlib.redirect_stdout(io.StringIO()):
            check(*fns)
    except _Timeout:
        return Outcome(mutant, "timeout", "", time.perf_counter() - start)
    except CheckError as err:
        return Outcome(mutant, "check crashed", str(err)[:200], time.perf_counter() - start)
    except CheckFailed as err:
        return Outcome(mutant, "killed", str(err)[:200], time.perf_counter() - start)
    return Outcome(mutant, "survived", "", time.perf_counter() - start)


def sweep(exercise) -> ExerciseSweep:
    namespace = chapter_namespace(exercise.chapter)
    # the chapter's other solved functions (an exercise may call an earlier one)
    from minillm.course import EXERCISES

    for other in EXERCISES:
        if other.chapter == exercise.chapter and other is not exercise:
            namespace = _define(solution_cell(other), namespace, other.check)
    result = ExerciseSweep(exercise.check)
    for mutant in mutants(exercise):
        result.outcomes.append(run(mutant, exercise, namespace))
    return result


def report(results: list[ExerciseSweep]) -> str:
    lines = [
        "| chapter | exercise | mutants | equivalent | killed | survived | kill rate |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    from minillm.course.exercises import BY_CHECK

    for r in results:
        counted = r.counted()
        killed = sum(o.verdict != "survived" for o in counted)
        lines.append(
            f"| {BY_CHECK[r.check].chapter[:2]} | `{r.check}` | {len(r.outcomes)} | {len(r.outcomes) - len(counted)} | "
            f"{killed} | {len(r.survivors())} | {r.rate:.0%} |"
        )
    return "\n".join(lines)


# Surviving mutants that compute the same thing as the reference on every input the exercise's
# contract allows: (check) → {mutant key: why it is equivalent}.
_HASH_ENCODING = (
    "another fixed, deterministic encoding of the same inputs: the exercise asks for a hash that chains the "
    "parent with the tokens in order and is the same in every process, not for these exact bytes — any such "
    "encoding is a right answer (a collision needs a 63-bit coincidence)"
)
_FLASH_MASKED_LATER = (
    "what this load brings in for rows past S is hidden afterwards: those columns' scores become -inf through "
    "`allowed`, so p = 0 there whatever K held"
)
_CLAMP_NEVER_BINDS = (
    "with scale = max|x| / 127, |x| / scale is at most 127 (plus far less than half a step of float error), so "
    "after rounding a clamp at ±128 never binds: the clamp is a guard, and a wider guard changes nothing"
)
EQUIVALENT: dict[str, dict[str, str]] = {
    "check_response_cache": {
        "line 2: `//` → `/` in `if size > self.max_bytes // 4:`": (
            "for a whole number of bytes, size > max_bytes / 4 and size > max_bytes // 4 both mean 4 * size > "
            "max_bytes"
        ),
    },
    "check_stopping": {
        "line 10: `+` → `-` in `search_from = max(0, text_before - longest + 1)  # a new ...`": (
            "starts the search two characters further back: the same matches (an older one would have ended "
            "the request), a little more work"
        ),
        "line 10: `1` → `0` in `search_from = max(0, text_before - longest + 1)  # a new ...`": (
            "starts the search one character further back: the same matches (an older one would have ended "
            "the request), a little more work"
        ),
    },
    "check_sample": {
        "line 6: `>` → `>=` in `logits[i, ids] = torch.where(values > 0, values / p.repet...`": (
            "a logit of exactly 0 is 0 whether divided or multiplied by the penalty"
        ),
        "line 11: `0` → `-1` in `probs = filtered_logits(logits[i : i + 1], [p])[0].softma...`": (
            "the one-row slice's last row is its first"
        ),
        "line 11: slice upper `i + 1` + 1 in `probs = filtered_logits(logits[i : i + 1], [p])[0].softma...`": (
            "filtering is row by row and only row 0 of the result (row i) is used"
        ),
        "line 11: `1` → `2` in `probs = filtered_logits(logits[i : i + 1], [p])[0].softma...` (#2)": (
            "filtering is row by row and only row 0 of the result (row i) is used"
        ),
        "line 11: `1` → `0` in `probs = filtered_logits(logits[i : i + 1], [p])[0].softma...`": (
            "softmax over dim 0 of one row [V] is its only dim; dim=-1 and dim=0 are the same"
        ),
    },
    "check_transformer": {
        "line 12: `0` → `-1` in `a = causal_attention(q[None], k[None], v[None])[0]  # [H,...`": (
            "the batch dim added by [None] has size 1, so its last item is its first"
        ),
    },
    "check_filter_logits": {
        "line 2: `<` → `<=` in `if 0 < top_k < x.shape[-1]:` (#2)": (
            "top_k equal to the vocabulary size keeps every logit (each is >= the smallest), exactly what "
            "skipping top-k does"
        ),
    },
    "check_quantize_per_channel": {
        "line 3: `127` → `128` in `q = torch.round(w / scale[:, None]).clamp(-127, 127).to(t...`": _CLAMP_NEVER_BINDS,
        "line 3: `127` → `128` in `q = torch.round(w / scale[:, None]).clamp(-127, 127).to(t...` (#2)": (
            _CLAMP_NEVER_BINDS
        ),
    },
    "check_quantize_int4": {
        "line 5: `1e-12` → `2e-12` in `scale = ((w.amax(dim=-1) - minimum) / 15).clamp(min=1e-12)`": (
            "the floor only keeps a constant group's scale from 0 (any positive scale gives its weights level 0 and "
            "back min exactly); 2e-12 is as far below any real group's step as 1e-12"
        ),
        "line 6: `0` → `-1` in `q = torch.round((w - minimum[..., None]) / scale[..., Non...`": (
            "w - minimum is >= 0 (a float subtraction of the group's min never goes negative), so q is never below 0 "
            "and the lower clamp never binds"
        ),
        "line 6: `15` → `16` in `q = torch.round((w - minimum[..., None]) / scale[..., Non...`": (
            "(w - min) / scale is at most (max - min) / ((max - min) / 15) = 15 plus far less than half a step of "
            "float error, so after rounding a clamp at 16 never binds"
        ),
    },
    "check_int4_linear": {  # the same quantizer as check_quantize_int4's, inside the class
        "line 6: `1e-12` → `2e-12` in `self.scale = ((w.amax(dim=-1) - self.minimum) / 15).clamp...`": (
            "the floor only keeps a constant group's scale from 0; 2e-12 is as far below any real group's step as 1e-12"
        ),
        "line 7: `0` → `-1` in `q = torch.round((w - self.minimum[..., None]) / self.scal...`": (
            "w - minimum is >= 0, so q is never below 0 and the lower clamp never binds"
        ),
        "line 7: `15` → `16` in `q = torch.round((w - self.minimum[..., None]) / self.scal...`": (
            "(w - min) / scale is at most 15 plus far less than half a step of float error, so a clamp at 16 never binds"
        ),
    },
    "check_quantize_kv": {
        "line 2: `127` → `128` in `q = torch.round(x.float() / scale[..., None]).clamp(-127,...`": _CLAMP_NEVER_BINDS,
        "line 2: `127` → `128` in `q = torch.round(x.float() / scale[..., None]).clamp(-127,...` (#2)": (
            _CLAMP_NEVER_BINDS
        ),
    },
    "check_accept_sampled": {
        "line 10: `<` → `<=` in `if u * q[d] < p[d]:  # u < p(d) / q(d), without dividing ...`": (
            "u is continuous: u · q(d) = p(d) exactly has probability zero (and where p(d) = 0 a draw of u = 0 "
            "happens once in 2^24 draws), so `<` and `<=` accept with the same probability"
        ),
        "line 14: `/` → `*` in `return emitted + [int(torch.multinomial(residual / residu...`": (
            "torch.multinomial draws in proportion to its weights and normalises them itself: the residual times "
            "its sum is the same distribution as the residual over its sum"
        ),
    },
    "check_kv_heads": {
        "line 2: `>=` → `>` in `if num_kv_heads >= tp_size:`": (
            "when num_kv_heads == tp_size both branches give rank r K/V head r and its whole group of query heads "
            "(the replica branch with tp_size // num_kv_heads = 1 replica per head)"
        ),
    },
    "check_cache_key": {
        'line 1: `1.0` → `2.0` in `if body.get("temperature", 1.0) != 0 or body.get("stream"):`': (
            "only whether the default is 0 matters (a missing temperature means sampling, which is never cached): "
            "1.0 and 2.0 both say so"
        ),
    },
    "check_generate_cached": {
        "line 6: `1` → `0` in `new.append(int(logits[-1].argmax()))`": (
            "a decode step feeds one token, so its logits have one row: logits[0] is logits[-1]"
        ),
    },
    "check_block_hash": {
        key: _HASH_ENCODING
        for key in (
            'line 4: `1` → `2` in `return int.from_bytes(h.digest()[:8], "little") >> 1  # a...`',
            'line 4: `1` → `0` in `return int.from_bytes(h.digest()[:8], "little") >> 1  # a...`',
            'line 4: `8` → `7` in `return int.from_bytes(h.digest()[:8], "little") >> 1  # a...`',
            "line 2: `8` → `9` in `h.update((0 if parent_hash is None else parent_hash + 1)....`",
            "line 2: `0` → `1` in `h.update((0 if parent_hash is None else parent_hash + 1)....`",
            "line 2: `+` → `-` in `h.update((0 if parent_hash is None else parent_hash + 1)....`",
            "line 2: `1` → `2` in `h.update((0 if parent_hash is None else parent_hash + 1)....`",
            "line 2: `1` → `0` in `h.update((0 if parent_hash is None else parent_hash + 1)....`",
        )
    },
    "check_choose_victim": {
        "line 2: `<` → `<=` in `return seq if victim.sort_key < seq.sort_key else victim`": (
            "sort keys are unique (priority, arrival, then a per-sequence counter), so two sequences never compare "
            "equal and `<` and `<=` decide alike"
        ),
    },
    "check_continuous_schedule": {
        "line 2: `0` → `-1` in `if budget == 0:`": (
            "an early exit only: with no budget left, tokens_to_run gives every later sequence 0 tokens, so the loop "
            "schedules nothing more whether it stops or not"
        ),
        "line 11: `0` → `-1` in `if len(scheduler.running) >= scheduler.max_num_seqs or bu...`": (
            "an early exit only: with no budget left, try_admit admits nothing (it returns 0) and the next line "
            "stops the loop"
        ),
    },
    "check_gqa_attention": {
        "line 6: `2` → `1` in `scores = scores.view(b, kv, g, t, s).masked_fill(~mask.un...`": (
            "the mask is [B, 1, T, S] by the exercise's contract: unsqueeze(1) and unsqueeze(2) both give "
            "[B, 1, 1, T, S]"
        ),
    },
    "check_speculative_decode": {
        **{
            f"line 2: {change} in `cache = new_cache(model, len(ids) + max_new_tokens + k + 1)`": (
                "the cache needs at most len(prompt) + max_new_tokens + k - 1 positions (the last pass starts at "
                "position len(prompt) + max_new_tokens - 2 at the latest and feeds k + 1 tokens): a cache a position "
                "or two larger, or exactly that size, holds the same K/V"
            )
            for change in ("`+` → `-`", "`1` → `2`", "`1` → `0`")
        },
        'line 1: `-` → `+` in `for n in range(min(max_n, len(tokens) - 1), 0, -1):  # th...`': (
            'n starts at len(tokens) or len(tokens) + 1 instead of len(tokens) - 1: for n >= len(tokens) the search has no start before the suffix (range(len(tokens) - n - 1, -1, -1) is empty), so the same n-grams are tried'
        ),
        'line 1: `1` → `0` in `for n in range(min(max_n, len(tokens) - 1), 0, -1):  # th...` (#2)': (
            'n starts at len(tokens) instead of len(tokens) - 1: for n = len(tokens) the search range is empty, so the same n-grams are tried'
        ),
        'line 3: `1` → `2` in `for start in range(len(tokens) - n - 1, -1, -1):  # the m...` (#2)': (
            'the search also tries start = -1 after every real start failed: tokens[-1:n - 1] is empty for every n the search tries (n <= len(tokens) - 1), so it never matches'
        ),
    },
    "check_flash_kernel": {
        'line 21: `0.0` → `1.0` in `m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)`': (
            "m_safe stands in only for rows that have seen no key (m_new = -inf): there p = exp(-inf - m_safe) and "
            "alpha = exp(-inf - m_safe) are 0 for any finite m_safe"
        ),
        "line 5: `0.0` → `1.0` in `q = tl.load(Q + q_offsets, mask=offs_m[:, None] < T, othe...`": (
            "the query rows past T (loaded as 1.0 instead of 0) give output rows that the masked store never writes"
        ),
        "line 13: `0.0` → `1.0` in `k = tl.load(K + kv_offsets, mask=offs_n[:, None] < S, oth...`": _FLASH_MASKED_LATER,
        "line 14: `0.0` → `1.0` in `v = tl.load(V + kv_offsets, mask=offs_n[:, None] < S, oth...`": (
            "the value rows past S are multiplied by p = 0 (their scores are -inf), and 0 × 1.0 = 0 (unlike an "
            "unmasked load's NaN, which the check plants and catches)"
        ),
    },
}


def main(argv: list[str]) -> int:
    from minillm.course import EXERCISES

    chosen = [e for e in EXERCISES if not argv or e.check in argv]
    results = []
    for exercise in chosen:
        start = time.perf_counter()
        result = sweep(exercise)
        results.append(result)
        print(
            f"{exercise.check}: {len(result.outcomes)} mutants, kill rate {result.rate:.0%} "
            f"({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
        for o in result.outcomes:
            if o.verdict != "killed":
                print(f"    {o.verdict:>13}: {o.mutant.key}  {o.message[:100]}", flush=True)
    print()
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main(sys.argv[1:]))
