"""The catalogue of answers every course check is tested against, one module per chapter.

For every exercise: at least two correct answers written independently (they must pass) and at
least twelve typical wrong answers, each with a fragment of the message it must fail with — the
mistakes learners make (returning the prompt too, a LIFO eviction, a hash that ignores block
order, a scheduler that admits while preempting, off by one, the wrong axis, dtype or rounding,
a forgotten field, two arguments swapped, ...). ``test_check_catalogue.py`` runs them all.

Each chapter module declares its own ``ANSWERS`` (``answers.Answers``); importing one changes
nothing elsewhere. The chapters are listed here, in order, and merged by ``answers_by_check``.
"""

from __future__ import annotations

from catalogue import ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10

CHAPTERS = (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10)


def answers_by_check() -> tuple[dict[str, list[tuple]], dict[str, list[tuple[tuple, str]]]]:
    """Every chapter's (right, wrong) tables merged: check name → answers. Fresh dicts on each
    call: a caller that adds to them changes no one else's."""
    right: dict[str, list[tuple]] = {}
    wrong: dict[str, list[tuple[tuple, str]]] = {}
    for chapter in CHAPTERS:
        for check, answers in chapter.ANSWERS.right_answers.items():
            right.setdefault(check, []).extend(answers)
        for check, answers in chapter.ANSWERS.wrong_answers.items():
            wrong.setdefault(check, []).extend(answers)
    return right, wrong
