"""The course's checks, one module per chapter (``chNN_*.py``); ``common.py``, ``engines.py`` and the
``chNN_common.py`` modules hold what several checks of a chapter share."""
