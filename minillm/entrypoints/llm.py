"""``LLM``: the offline entry point — load a model, generate for a batch of prompts, stream.

    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    print(out.text, out.metrics.ttft)

A prompt is a string, a list of token ids, or a chat (a list of ``{"role", "content"}``
messages rendered with the model's chat template). Every request is validated before any
work starts, so a bad prompt raises a ``ValueError`` naming it and the engine stays usable.

``LLM`` is a thin loop over the online ``LLMEngine`` (``llm.engine``): add the requests,
then ``step()`` until they have finished. Several callers may share one ``LLM`` (threads, or
streams interleaved in one thread): whoever waits runs the next step, and each delta is put in
the mailbox of its own request, so nobody's tokens are lost or taken by another caller.

With ``data_parallel_size=N`` (N > 1) it drives N replica engines instead, each in a worker
process, through ``cluster/replicas.py``'s ``DataParallelLLM`` (``llm.replicas``): ``generate``
routes each prompt to a replica. The front door sits above both the engine and the multi-engine
layer (as vLLM's ``vllm/entrypoints/llm.py`` does), so neither imports upwards to reach the other.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from minillm.cluster.replicas import DataParallelLLM
from minillm.config import EngineConfig
from minillm.engine.client import EngineClient
from minillm.engine.llm_engine import LLMEngine
from minillm.inputs import Prompt
from minillm.outputs import RequestOutput, StreamDelta
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence


class LLM:
    def __init__(self, model: str | Path = "smollm2-135m", **engine_args):
        """``engine_args`` are ``EngineConfig`` fields: device, dtype, max_model_len,
        max_num_seqs, mode ("paged" | "contiguous" | "naive"), num_threads, seed,
        attention_backend ("auto" | "torch" | "sdpa" | "cpu" | "triton"), cpu_prepack, compile, and for the paged
        engine scheduling_policy, block_size, kv_cache_memory, enable_prefix_caching,
        enable_chunked_prefill, max_num_batched_tokens, batch_timeout; quantization ("int8" |
        "int4" | "awq" | "w8a8") with quantization_group_size, sparsity ("2:4" | "2:4-wanda"),
        and kv_cache_dtype ("auto" | "int8" | "fp8"); data_parallel_size and router_policy
        (N > 1: N replicas in worker processes, ``generate`` only — a stream belongs to one engine)."""
        self.replicas: DataParallelLLM | None = None
        self._engine: LLMEngine | None = None
        if engine_args.get("data_parallel_size", 1) != 1:
            self.replicas = DataParallelLLM(model, serve_replica, **engine_args)
            return
        self._engine = LLMEngine(model, **engine_args)
        self.client = EngineClient(self._engine)  # each request's deltas into its own mailbox

    @property
    def engine(self) -> LLMEngine:
        """The one engine this ``LLM`` drives (with ``data_parallel_size`` > 1 there is none
        here: each replica's engine lives in its own process — ``llm.replicas``)."""
        if self._engine is None:
            raise AttributeError(
                f"LLM(data_parallel_size={self.replicas.size}) runs its engines in {self.replicas.size} worker "
                "processes: there is no llm.engine here — llm.generate routes prompts to them (llm.replicas: "
                "the router and the workers)"
            )
        return self._engine

    @property
    def engine_config(self) -> EngineConfig:
        return self.replicas.config if self.replicas is not None else self.engine.engine_config

    def close(self) -> None:
        """Stop a parallel engine's or the replicas' worker processes (``with LLM(...) as llm:``
        does it too)."""
        if self.replicas is not None:
            self.replicas.close()
        else:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The engine's parts, for notebooks and tools.
    resolved = property(lambda self: self.engine.resolved, doc="What the engine's auto choices became.")
    model = property(lambda self: self.engine.model)
    model_config = property(lambda self: self.engine.model_config)
    model_dir = property(lambda self: self.engine.model_dir)
    tokenizer = property(lambda self: self.replicas.tokenizer if self.replicas is not None else self.engine.tokenizer)
    device = property(lambda self: self.engine.device)
    dtype = property(lambda self: self.engine.dtype)
    max_model_len = property(lambda self: self.engine.max_model_len)
    mode = property(lambda self: self.engine.mode)

    def fast_path_status(self):
        """Where the compiled decode step stands: building / ready / failed / off (``LLMEngine``)."""
        return self.engine.fast_path_status()

    def wait_for_fast_path(self, timeout: float | None = None):
        """Block until the compiled decode step is ready or failed (``LLMEngine``)."""
        return self.engine.wait_for_fast_path(timeout)

    def _make_sequences(self, prompts, sampling_params) -> list[Sequence]:
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and all(isinstance(p, (int, dict)) for p in prompts)
        ):
            prompts = [prompts]  # one prompt: a string, a list of ids, or one chat
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
                )
            params = sampling_params
        else:
            params = [sampling_params] * len(prompts)
        # Validate everything first: a bad request raises before any work, poisoning nothing.
        with self.engine._lock:  # request ids are handed out under the engine's lock
            return [self.engine.make_sequence(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs keep prompt order, one ``RequestOutput`` per prompt.

        For ``SamplingParams(n > 1)`` that output is sample 0's, and ``output.samples`` holds all
        n samples (index order; sample ``i`` of a seeded request equals the ``n=1`` request
        seeded with ``seed + i``).

        All requests are queued at once; the engine's scheduler decides how they are batched
        (at most ``max_num_seqs`` run together) — with the requests of any other ``generate`` or
        ``stream`` running on this ``LLM`` at the same time, from this thread or another.
        """
        if self.replicas is not None:
            return self.replicas.generate(prompts, sampling_params)
        seqs = self._make_sequences(prompts, sampling_params)
        progress = None
        if use_tqdm:
            progress = tqdm(total=len(seqs), desc="generating", unit="req")
        boxes = self._submit(seqs, streaming=False)
        try:
            for box in boxes:  # each call steps the engine until this request's last delta arrives
                while not self._next_delta(box).request_finished:
                    pass  # another of its samples is still running
                if progress is not None:
                    progress.update(1)
        except BaseException:  # interrupted (Ctrl-C in a notebook) or failed: leave the engine clean
            self._cancel(seqs)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [self.engine.request_output(s) for s in seqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield a ``StreamDelta`` per generated token as soon as it is sampled; the last one has
        ``finish_reason``, ``output`` and ``request_finished`` set. With ``n > 1`` the samples'
        deltas interleave (told apart by ``index``), each sample's last has its
        ``finish_reason`` and ``output``, and the stream ends after the one with
        ``request_finished``. Several streams (and ``generate`` calls) may run at
        once, interleaved in one thread or from several: each gets exactly its own deltas."""
        if self.replicas is not None:
            raise ValueError(
                f"LLM(data_parallel_size={self.replicas.size}) generates only: a stream belongs to one engine — "
                "stream from LLM(model) or from `minillm serve --data-parallel-size N`"
            )
        (seq,) = self._make_sequences([prompt], sampling_params)
        (box,) = self._submit([seq], streaming=True)
        try:
            while True:
                delta = self._next_delta(box)
                yield delta
                if delta.request_finished:
                    return
        finally:
            self._cancel([seq])  # the caller stopped iterating: free the request's resources

    # ----------------------------------------------------------------------------------------
    # Shared use: one engine loop, each request's deltas delivered to its own caller
    # ----------------------------------------------------------------------------------------

    def _submit(self, seqs: list[Sequence], streaming: bool) -> list[_Mailbox]:
        """Queue ``seqs``; each one's deltas will wait in the mailbox returned for it."""
        with self.engine._lock:
            foreign = self.client.foreign_requests()
            if foreign:
                raise RuntimeError(
                    f"the engine has requests added through llm.engine ({foreign[:3]}); LLM.generate/stream would "
                    "take their tokens: finish or abort them first, or drive llm.engine yourself"
                )
            boxes = [_Mailbox(seq, streaming) for seq in seqs]
            for box in boxes:
                self.client.submit(box.seq, box)
            return boxes

    def _next_delta(self, box: _Mailbox) -> StreamDelta:
        """The next delta of ``box``'s request. When none is waiting, run one engine step, which
        may produce deltas for every running request: each goes to its own request's mailbox."""
        seq = box.seq
        while True:
            with self.engine._lock:
                if box.deltas:
                    return box.deltas.popleft()
                if box.error is not None:  # its own settings failed in a step; the others went on
                    raise box.error
                if seq.request_finished:  # aborted from elsewhere (llm.engine.abort): its last word
                    self.client.forget(seq.request_id)
                    text = seq.take_stream_text()
                    return StreamDelta(
                        seq.request_id, None, text, seq.finish_reason, seq.to_output(), request_finished=True
                    )
                routed = self.client.step()
                for mailbox, delta in routed:
                    mailbox.put(delta)
            if not routed:
                time.sleep(0.001)  # nothing could run yet (a dynamic batch filling up): don't spin

    def _cancel(self, seqs: list[Sequence]) -> None:
        with self.engine._lock:
            for seq in seqs:
                self.client.abort(seq.request_id)


@dataclass
class _Mailbox:
    """One request's deltas, waiting for its caller (an ``EngineClient`` sink)."""

    seq: Sequence
    streaming: bool  # every delta is kept; otherwise only each sample's last (generate)
    deltas: deque[StreamDelta] = field(default_factory=deque)
    error: BaseException | None = None  # why the request ended in a failed step (``RequestFailed``)

    def put(self, delta: StreamDelta | BaseException) -> None:
        if isinstance(delta, BaseException):
            self.error = delta
        elif self.streaming or delta.finish_reason is not None:
            self.deltas.append(delta)


def serve_replica(spec, rank: int, conn) -> None:
    """One data-parallel replica (a worker process): an ``LLM`` answering ``generate`` jobs."""
    model, engine_args = spec
    with LLM(model, **engine_args) as llm:
        conn.send(("ready", {"rank": rank, "blocks": llm.engine.block_manager.num_blocks}))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            _, job, prompts, params = message
            try:
                conn.send(("done", job, llm.generate(prompts, params)))
            except (ValueError, TypeError) as err:  # a bad prompt: refused, the replica keeps serving
                conn.send(("refused", job, f"replica {rank}: {err}"))
