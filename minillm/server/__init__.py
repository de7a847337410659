"""An OpenAI-compatible HTTP server on the engine (``minillm serve``).

``app.py`` holds the routes, ``async_engine.py`` the thread that owns each engine's step loop,
``protocol.py`` the request shapes and errors, ``responses.py`` the response and event-stream
framing, ``metrics.py`` the Prometheus metrics, ``response_cache.py`` the greedy-response cache,
``launch.py`` how to start it (in this process, in a thread, or as a subprocess), and
``batch.py`` the offline batch-file runner (``minillm batch``).
"""

from minillm.server.app import build_app
from minillm.server.async_engine import AsyncEngine
from minillm.server.launch import ServerProcess, ServerThread, build_engines

__all__ = ["AsyncEngine", "ServerProcess", "ServerThread", "build_app", "build_engines"]
