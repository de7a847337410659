"""Tooling around the engine, off the request path: what the course and ``benchmarks/`` use to
measure and exercise it.

    bench.py        minillm against HF ``generate()`` (and llama.cpp), same run: ``minillm bench``
    llamacpp.py     llama.cpp's ``llama-bench`` driven for the same comparison
    workloads.py    request workloads (Poisson arrivals, shared prefixes) and wall-clock replay
    replay.py       replay on a virtual clock; ``calibrate`` a step-cost model to this machine
    evaluation.py   perplexity, to judge a quantized or pooled model against its original

Nothing under ``engine/``, ``runtime/`` or ``server/`` imports from here
(``tests/test_architecture.py`` holds the floors).
"""
