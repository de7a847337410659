"""Prefill/decode disaggregation: the two phases on different workers, the KV cache sent between.

A prefill is one long, compute-bound pass; a decode step is short and bandwidth-bound. On one
engine they share every step, so a long prompt arriving stalls every running decode for that
step (the TPOT spikes chapter 04 measured). Disaggregation (DistServe, Zhong et al., 2024,
arXiv:2401.09670; Splitwise, Patel et al., 2024, arXiv:2311.18854) gives each phase its own
worker:

    driver ──request──▶ prefill worker: prompt → first token + K/V blocks
                              │ torch.distributed send: block hashes, then K and V
                              ▼
                        decode worker: K/V into its pool under the same hashes → decode
    driver ◀──tokens── (both workers report what finished)

The decode worker writes the received blocks into its pool *as prefix-cache entries*
(``BlockManager.reserve_imported``): named by the same chained hashes its own cache would give
them, so when the request arrives ``match_prefix`` finds the whole prompt cached — no new
mechanism, the prefix cache of chapter 03 is the landing zone. Only full blocks travel; the
prompt's last partial block (< ``block_size`` tokens) and the first token are recomputed by the
decode worker.

The price: the K/V of every prompt crosses a link (``2 × layers × kv_heads × head_dim × bytes``
per token), and one worker's compute sits idle whenever its phase has nothing to do.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from minillm.assets import resolve_model
from minillm.config import EngineConfig, ModelConfig, Where, check_compatible
from minillm.engine import LLMEngine
from minillm.engine.client import EngineClient
from minillm.inputs import InputProcessor
from minillm.kvcache.block_manager import prompt_block_hashes
from minillm.parallel.processes import START_TIMEOUT, STEP_TIMEOUT, WorkerGroup
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

PREFILL, DECODE = 0, 1


@dataclass(frozen=True)
class DisaggSpec:
    model: str
    engine_args: dict
    threads: tuple[int, int]  # prefill worker's, decode worker's


@dataclass
class DisaggregatedOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    arrival_time: float
    first_token_time: float  # on the prefill worker
    finish_time: float
    token_times: list[float] = field(default_factory=list)  # every generated token's
    transfer_bytes: int = 0  # K/V sent prefill → decode
    transfer_seconds: float = 0.0  # from the prefill worker's send to the blocks written on the decode worker
    recomputed_tokens: int = 0  # prompt tokens the decode worker computed again (the partial last block)
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        n = len(self.token_ids)
        return (self.finish_time - self.first_token_time) / (n - 1) if n > 1 else None


class DisaggregatedLLM:
    """A prefill worker and a decode worker (processes joined by gloo; the driver, this process,
    routes requests and collects answers). ``engine_args`` go to both workers' engines."""

    def __init__(self, model: str = "smollm2-135m", prefill_threads: int = 1, decode_threads: int = 1, **engine_args):
        config = EngineConfig(**engine_args)  # validated here, before any worker starts
        check_compatible(config, Where(config.resolve_device().type, deployment="disaggregated"))
        for name, value in (("prefill_threads", prefill_threads), ("decode_threads", decode_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        folder = resolve_model(model)
        self.tokenizer = Tokenizer(folder)
        model_config = ModelConfig.from_folder(folder)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        self.inputs = InputProcessor(self.tokenizer, model_config.vocab_size, max_model_len)
        self.spec = DisaggSpec(str(model), dict(engine_args, device="cpu"), (prefill_threads, decode_threads))
        self.workers = WorkerGroup(_disagg_main, self.spec, 2, "gloo", stop_ranks=(PREFILL, DECODE))
        self.info = self.workers.gather_ready("load the model")
        self._next_id = 0
        self._in_flight: dict[int, int] = {}  # request id → index in the current generate call

    def close(self) -> None:
        self.workers.shutdown()

    def __enter__(self) -> DisaggregatedLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _checked(self, prompt, params: SamplingParams, where: str) -> list[int]:
        """The prompt's ids, or a ``ValueError`` naming what is wrong — here, before a worker
        could fail on it (a worker's failure ends both)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for {where} must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.n != 1 or params.logprobs is not None or params.stop:
            raise ValueError(f"{where}: DisaggregatedLLM serves n=1 without logprobs or stop strings")
        return self.inputs.process(prompt, where)[1]

    def submit(self, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None) -> int:
        """Send one request to the prefill worker; returns its id."""
        self.workers.check_open()
        ids = self._checked(prompt, params, "prompt")
        rid, self._next_id = self._next_id, self._next_id + 1
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        self.workers.send(PREFILL, ("request", rid, ids, params, arrival))
        return rid

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams], arrivals: list[float] | None = None) -> list[DisaggregatedOutput]:  # fmt: skip
        """Run ``prompts`` (with one ``params`` or one per prompt); ``arrivals``: each prompt's
        arrival in seconds after the start (a workload replayed in real time), else all at
        once. Outputs in prompt order."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # every request checked before any is sent
            self._checked(prompt, p, f"prompt {i}")
        start = time.perf_counter()
        arrivals = arrivals or [0.0] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        ids = self._in_flight = {}  # a late answer to an earlier, interrupted call is dropped
        done: dict[int, DisaggregatedOutput] = {}
        refused: dict[int, str] = {}
        try:
            while len(done) + len(refused) < len(prompts):
                now = time.perf_counter() - start
                while order and arrivals[order[0]] <= now:
                    i = order.pop(0)
                    ids[self.submit(prompts[i], params[i], start + arrivals[i])] = i
                wait = STEP_TIMEOUT if not order else max(0.0, arrivals[order[0]] - now)
                if wait > 0 and not any(conn.poll() for conn in self.workers.conns):
                    if order:
                        time.sleep(min(wait, 0.002))
                        continue
                _, (kind, output) = self.workers.receive({PREFILL, DECODE}, STEP_TIMEOUT, "finish a request")
                if kind == "refused":  # an engine refused it (e.g. it can never fit the pool): say so after
                    rid, message = output
                    if rid in ids:
                        refused[ids[rid]] = message
                    continue
                if output.request_id not in ids:
                    continue
                output.text = self.tokenizer.decode(output.token_ids)
                done[ids[output.request_id]] = output
        except KeyboardInterrupt:
            self.workers.shutdown("interrupted")
            raise
        if refused:
            i = min(refused)
            raise ValueError(f"prompt {i} was refused: {refused[i]}")
        return [done[i] for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------
# The workers
# ---------------------------------------------------------------------------------------------


@dataclass
class _Request:
    """A request in a worker: what the worker must remember about it (``data``), and the sink of
    its deltas, which the worker reads from ``EngineClient.step``'s routed pairs instead."""

    data: tuple

    def put(self, item) -> None:
        if isinstance(item, BaseException):  # only EngineClient.fail/close send these: not used here
            raise item


def _disagg_main(spec: DisaggSpec, rank: int, conn) -> None:
    torch.set_num_threads(spec.threads[rank])
    engine = LLMEngine(spec.model, **spec.engine_args)
    conn.send(("ready", {"rank": rank, "role": "prefill" if rank == PREFILL else "decode", "blocks": engine.block_manager.num_blocks}))  # fmt: skip
    (_prefill_loop if rank == PREFILL else _decode_loop)(engine, conn)


def _prefill_loop(engine, conn) -> None:
    """Prefill each request (one token), then send its full blocks' K/V to the decode worker."""
    client = EngineClient(engine)
    bs = engine.block_manager.block_size
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)
        while conn.poll():
            message = conn.recv()
            if message[0] == "stop":
                dist.send_object_list([None], dst=DECODE)  # the decode worker's receiver ends too
                return
            _, rid, ids, params, arrival = message
            try:
                client.add(ids, replace(params, max_tokens=1), _Request((ids, params, arrival)), request_id=rid,
                           arrival_time=arrival, where=f"request {rid!r}")  # fmt: skip
            except (ValueError, TypeError) as err:  # refused: the engine and the other requests go on
                conn.send(("refused", (rid, str(err))))
                continue
        for request, delta in client.step():
            if not delta.request_finished:
                continue
            ids, params, arrival = request.data
            out = delta.output
            first_time = out.metrics.token_times[0]  # perf_counter: one clock for every process on this machine
            if params.max_tokens == 1 or out.finish_reason == "stop":  # done already: nothing to hand over
                conn.send(("done", DisaggregatedOutput(delta.request_id, ids, out.token_ids, out.finish_reason,
                                                       arrival, first_time, first_time, [first_time])))  # fmt: skip
                continue
            manager, cache = engine.block_manager, engine.kv_cache
            blocks = []
            for h in prompt_block_hashes(ids, bs):
                if h not in manager.cached:
                    break
                blocks.append(manager.cached[h])
            index = torch.tensor(blocks, dtype=torch.long)
            k, v = cache.k[:, index].contiguous(), cache.v[:, index].contiguous()
            meta = (
                delta.request_id,
                ids,
                out.token_ids[0],
                params,
                arrival,
                first_time,
                len(blocks),
                time.perf_counter(),
            )
            dist.send_object_list([meta], dst=DECODE)
            if blocks:
                dist.send(k, dst=DECODE)
                dist.send(v, dst=DECODE)


def _decode_loop(engine, conn) -> None:
    """Receive K/V (a thread blocks on torch.distributed), land it in the prefix cache, decode."""
    cache = engine.kv_cache
    arrived: queue.Queue = queue.Queue()

    def receive():
        shape = list(cache.k.shape)
        while True:
            meta = [None]
            dist.recv_object_list(meta, src=PREFILL)
            if meta[0] is None:
                return
            n = meta[0][6]
            k = v = None
            if n:
                shape[1] = n
                k, v = torch.empty(shape, dtype=cache.k.dtype), torch.empty(shape, dtype=cache.v.dtype)
                dist.recv(k, src=PREFILL)
                dist.recv(v, src=PREFILL)
            arrived.put((meta[0], k, v))

    receiver = threading.Thread(target=receive, daemon=True, name="kv-receiver")
    receiver.start()
    client = EngineClient(engine)
    while True:
        if conn.poll() and conn.recv()[0] == "stop":
            receiver.join(START_TIMEOUT)
            return
        landed = []
        if not engine.has_unfinished_requests():  # idle: wait a little for the next hand-over
            try:
                landed.append(arrived.get(timeout=0.005))
            except queue.Empty:
                continue
        while not arrived.empty():
            landed.append(arrived.get())
        for meta, k, v in landed:
            rid, ids, first, params, arrival, first_time, n, sent = meta
            held, to_fill = engine.block_manager.reserve_imported(ids[: n * engine.block_manager.block_size])
            for j, block_id in to_fill:
                cache.k[:, block_id] = k[:, j]
                cache.v[:, block_id] = v[:, j]
            engine.block_manager.release_imported(held)
            written = time.perf_counter()
            tail = replace(params, max_tokens=params.max_tokens - 1)
            bytes_sent = 0 if k is None else k.nbytes + v.nbytes
            request = _Request((ids, first, arrival, first_time, bytes_sent, written - sent))
            try:
                client.add(ids + [first], tail, request, request_id=rid, arrival_time=arrival, where=f"request {rid!r}")
            except (ValueError, TypeError) as err:
                conn.send(("refused", (rid, str(err))))
                continue
        for request, delta in client.step():
            if not delta.request_finished:
                continue
            ids, first, arrival, first_time, bytes_sent, seconds = request.data
            out = delta.output
            times = [first_time] + list(out.metrics.token_times)
            conn.send(("done", DisaggregatedOutput(
                delta.request_id, ids, [first] + out.token_ids, out.finish_reason, arrival, first_time, times[-1],
                times, bytes_sent, seconds, len(ids) + 1 - out.num_cached_tokens,
            )))  # fmt: skip
