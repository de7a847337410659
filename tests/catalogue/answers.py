"""One chapter's table of answers: the right ones (they must pass) and the wrong ones, each with a
fragment of the message its check must fail with."""

from __future__ import annotations


class Answers:
    """What one chapter module declares; ``catalogue.answers_by_check`` merges the chapters'.

    An answer is the tuple of arguments the check is called with (most exercises take one
    function)."""

    def __init__(self) -> None:
        self.right_answers: dict[str, list[tuple]] = {}
        self.wrong_answers: dict[str, list[tuple[tuple, str]]] = {}

    def right(self, check: str, *fns) -> None:
        self.right_answers.setdefault(check, []).append(fns)

    def wrong(self, check: str, message: str, *fns) -> None:
        self.wrong_answers.setdefault(check, []).append((fns, message))
