"""Data parallelism offline: ``LLM(model, data_parallel_size=N)`` — N replica engines in worker
processes, each ``generate`` call's prompts routed over them by the router of ``router.py``
(the served version, replicas behind an HTTP router, is ``data_parallel.py``). ``LLM``
(``entrypoints/llm.py``, the floor above) holds one of these as ``llm.replicas``."""

from __future__ import annotations

import os

from minillm.assets import resolve_model
from minillm.cluster.router import Router
from minillm.config import EngineConfig
from minillm.inputs import routing_ids
from minillm.parallel.processes import STEP_TIMEOUT, WorkerGroup
from minillm.tokenizer import Tokenizer


class DataParallelLLM:
    """``LLM(model, data_parallel_size=N, router_policy=...)``: N replica engines in worker
    processes; ``generate`` routes each prompt (``self.router`` records every choice), runs the
    replicas' shares at the same time and returns the outputs in prompt order. Offline
    generation only: a stream belongs to one engine — serve replicas with
    ``minillm serve --data-parallel-size N`` for that.

    ``replica_main(spec, rank, conn)`` is what each worker runs (``LLM`` passes its own,
    ``entrypoints.llm.serve_replica``: this module stays below the front door and never imports it)."""

    def __init__(self, model, replica_main, data_parallel_size: int = 2, router_policy: str | None = None,
                 **engine_args):  # fmt: skip
        # Every option checked, and how they combine (config/compatibility.py), before any replica starts.
        config = EngineConfig(data_parallel_size=data_parallel_size, router_policy=router_policy, **engine_args)
        self.config, self.size = config, config.data_parallel_size
        size = self.size
        self.router = Router(size, config.router_policy or "prefix_aware", config.block_size)
        self.tokenizer = Tokenizer(resolve_model(model))
        threads = config.num_threads or max(1, (os.cpu_count() or 1) // size)
        spec = (str(model), dict(engine_args, num_threads=threads))
        self.workers = WorkerGroup(replica_main, spec, size, "gloo", threads, stop_ranks=tuple(range(size)))
        self.replicas = self.workers.gather_ready("load its replica")
        self._job = 0

    def close(self) -> None:
        self.workers.shutdown()

    def __enter__(self) -> DataParallelLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts, sampling_params=None) -> list:
        """Like ``LLM.generate``: one ``RequestOutput`` per prompt, in prompt order (a replica
        validates its prompts as one engine would; a bad one raises its ``ValueError``)."""
        self.workers.check_open()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        shares: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            replica = self.router.route(self.router.num_routed, routing_ids(self.tokenizer, prompt))
            shares.setdefault(replica, []).append(i)
        self._job += 1
        try:
            for replica, idx in shares.items():
                self.workers.send(replica, ("generate", self._job, [prompts[i] for i in idx], [params[i] for i in idx]))
            outputs: list = [None] * len(prompts)
            pending, error = set(shares), None
            while pending:
                replica, (kind, job, payload) = self.workers.receive(pending, STEP_TIMEOUT, "generate")
                if job != self._job:
                    continue  # an interrupted call's late answer
                pending.discard(replica)
                for _ in shares[replica]:
                    self.router.finished(replica)
                if kind == "refused":
                    error = error or payload
                    continue
                for i, out in zip(shares[replica], payload):
                    outputs[i] = out
        except KeyboardInterrupt:
            self.workers.shutdown("interrupted")
            raise
        if error is not None:
            raise ValueError(error)
        return outputs
