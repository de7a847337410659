"""More wrong answers per chapter, one module each, added to ``check_catalogue``'s tables on import.

Each module imports ``right``/``wrong`` from ``check_catalogue`` and registers the mistakes a learner
makes in that chapter's exercises — off by one, the wrong axis, dtype or rounding, a forgotten field,
two arguments swapped — each with a fragment of the message that must name it.
"""
