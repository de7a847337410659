"""``LLMEngine``: the online engine — requests come and go while the model runs.

    engine = LLMEngine("smollm2-135m")
    engine.add_request("The capital of France is", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for delta in engine.step():          # tokens produced by this step
            print(delta.request_id, delta.text, end="")

Each ``step()`` is one iteration of the serving loop:

    schedule → step inputs (plain data) → runner: logits → sample → append → commit blocks
    → free finished requests → report what was produced

``LLM.generate`` and ``LLM.stream`` are thin loops over this class. The loop is the same for
every mode; ``engine/builder.py`` decides which scheduler and runner do the work: in
``mode="paged"`` (the default) the scheduler, block manager and paged pool of chapters 03-04;
the earlier rungs (``naive``, ``contiguous``) the same scheduler's static policy and their own runners.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Union

import torch

from minillm.assets import resolve_model
from minillm.config import EngineConfig, ModelConfig
from minillm.engine.builder import build_engine_parts
from minillm.engine.runner import ChunkInput, StepInputs
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.errors import PromptTooLongError
from minillm.metrics import StepRecord
from minillm.models import load_model
from minillm.outputs import StreamDelta
from minillm.sampling import SamplingParams, sample
from minillm.sequence import Sequence
from minillm.tokenizer import ChatMessages, Tokenizer

Prompt = Union[str, list[int], ChatMessages]


class LLMEngine:
    def __init__(self, model: str | Path = "smollm2-135m", **engine_args):
        """``engine_args`` are ``EngineConfig`` fields (see its docstring)."""
        self.engine_config = config = EngineConfig(**engine_args)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(model)
        self.model_config = ModelConfig.from_folder(self.model_dir)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.model_config, self.device)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.device, max_positions=self.max_model_len)
        # Sliding-window attention: the engine's option, else the checkpoint's (Mistral).
        self.sliding_window = config.sliding_window or self.model_config.sliding_window
        parts = build_engine_parts(
            config, self.model, self.model_config, self.max_model_len, self.sliding_window, self.tokenizer
        )
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.attention_backend = parts.attention_backend
        self.block_manager = parts.block_manager  # None outside the paged mode
        self.kv_cache = parts.kv_cache
        self.graphs = parts.graphs
        self.speculator = parts.speculator  # proposes and verifies; does nothing without speculative_config
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.requests: dict[Hashable, Sequence] = {}  # every unfinished request, by id
        # add_request / abort / step may come from several threads (a server's handlers and its
        # engine loop): each holds this lock, so they never see the engine half-updated.
        self._lock = threading.RLock()
        # The most recent steps' records (a bounded ring; see EngineConfig.max_step_records).
        self.step_records: deque[StepRecord] = deque(maxlen=config.max_step_records)
        self.num_steps = 0  # steps that ran the model
        self.record_block_tables = False  # snapshot block tables every step (the explorer widget)
        # Where every timestamp comes from (arrivals, token times, step records). A serving
        # replay on simulated time swaps it for a virtual clock: engine/virtual_clock.py.
        self.clock: Callable[[], float] = time.perf_counter
        self._warm_up()

    @property
    def mode(self) -> str:
        return self.engine_config.mode

    # ----------------------------------------------------------------------------------------
    # Setup
    # ----------------------------------------------------------------------------------------

    def memory_report(self) -> dict[str, int | None]:
        """Bytes of weights (every tensor the layers actually hold) and KV pool, and (on CUDA)
        the allocator's current and peak use."""
        weights = self.model.weight_bytes()
        report: dict[str, int | None] = {
            "weights_bytes": weights,
            "kv_pool_bytes": self.kv_cache.nbytes if self.kv_cache is not None else None,
            # How many blocks those bytes hold: an int8 pool (kv_cache_dtype="int8") holds ~2x.
            "kv_pool_blocks": self.kv_cache.num_blocks if self.kv_cache is not None else None,
            "allocated_bytes": None,
            "peak_allocated_bytes": None,
        }
        if self.device.type == "cuda":
            report["allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def _warm_up(self) -> None:
        """One tiny request through the whole path, so one-time costs (kernel selection, oneDNN
        primitive creation, allocator growth) are not billed to the first real request."""
        self.add_request([0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="__warm_up__")
        while self.has_unfinished_requests():
            self.step()
        self.step_records.clear()
        self.num_steps = 0
        if self.block_manager is not None:  # forget the warm-up's cached block and statistics
            self.block_manager.reset_prefix_cache()

    # ----------------------------------------------------------------------------------------
    # Requests
    # ----------------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt, where: str) -> tuple[str, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{where} is an empty string")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.render_chat(prompt)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise ValueError(f"{where} is an empty list of token ids")
            vocab = self.model_config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{where} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
            return self.tokenizer.decode(prompt, skip_special_tokens=False), list(prompt)
        raise TypeError(f"{where} must be a string, a list of token ids or a list of chat messages, got {prompt!r:.80}")

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        where: str = "prompt",
        arrival_time: float | None = None,
        priority: int = 0,
        request_id: Hashable | None = None,
    ) -> Sequence:
        """Validate one request and build its ``Sequence`` (not yet queued)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for {where} must be SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have been changed after construction
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority for {where} must be an int, got {priority!r}")
        if arrival_time is not None and (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, (int, float))
            or not math.isfinite(arrival_time)
        ):
            raise TypeError(f"arrival_time for {where} must be a time.perf_counter() value, got {arrival_time!r}")
        text, ids = self._prompt_ids(prompt, where)
        if not ids:
            raise ValueError(f"{where} ({text!r:.40}) encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"{where} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"to generate (at most {self.max_model_len - 1} prompt tokens)"
            )
        if request_id is not None:
            try:
                hash(request_id)
            except TypeError:
                raise TypeError(f"request_id={request_id!r} must be hashable (a string or an int)") from None
        if request_id is None:
            while self._next_id in self.requests:  # a caller may have chosen this number already
                self._next_id += 1
            request_id = self._next_id
            self._next_id += 1
        elif request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        if arrival_time is None:
            arrival_time = self.clock()
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(
            request_id, text, ids, params, self.tokenizer, generator, self.max_model_len, arrival_time, priority
        )
        if self.block_manager is not None:
            need = self.block_manager.blocks_for(len(ids) + seq.max_output)
            if need > self.block_manager.num_blocks:
                raise ValueError(
                    f"{where} can never fit in the KV pool: {len(ids)} prompt + {seq.max_output} output tokens need "
                    f"{need} blocks of {self.block_manager.block_size}, the pool has {self.block_manager.num_blocks} "
                    "(raise kv_cache_memory or lower max_tokens)"
                )
        return seq

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: Hashable | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Hashable:
        """Queue a request; returns its id. Raises (and queues nothing) if the request is invalid.

        ``arrival_time`` (``time.perf_counter()`` seconds) defaults to now; a workload driver
        passes the scheduled arrival so queueing delay counts in TTFT. Lower ``priority`` runs first.
        """
        where = "prompt" if request_id is None else f"request {request_id!r}"
        with self._lock:
            seq = self.make_sequence(prompt, params, where, arrival_time, priority, request_id)
            self.enqueue(seq)
        return seq.request_id

    def enqueue(self, seq: Sequence) -> None:
        """Queue an already validated sequence (``LLM.generate`` validates a whole batch first)."""
        with self._lock:
            if seq.request_id in self.requests:
                raise ValueError(f"request_id={seq.request_id!r} is already in use by an unfinished request")
            self.requests[seq.request_id] = seq
            self.scheduler.add(seq)

    def abort(self, request_id: Hashable):
        """Stop a request now and free its blocks; returns its ``RequestOutput`` (finish_reason "abort")."""
        with self._lock:
            seq = self.requests.pop(request_id, None)
            if seq is None:
                raise ValueError(f"abort: no unfinished request with id {request_id!r}")
            self.scheduler.finish(seq)
            self.runner.release(request_id)
            self.speculator.release(request_id)
            seq.abort(self.clock())
            return seq.to_output()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ----------------------------------------------------------------------------------------
    # The step
    # ----------------------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Run one scheduler step; return a delta for every request that produced a token.

        The last delta of a request carries ``finish_reason`` and the complete ``output``.
        A step with nothing to run (all queued requests waiting for a dynamic batch to fill)
        returns an empty list without touching the model.
        """
        with self._lock:  # one step at a time; requests may be added or aborted from other threads
            return self._step()

    def _step(self) -> list[StreamDelta]:
        started = self.clock()
        self.speculator.propose(self.scheduler.running)  # proposals for decoding sequences, if speculating
        scheduled = self.scheduler.schedule(started)
        for seq in scheduled.preempted:
            self.speculator.release(seq.request_id)
        if not scheduled.chunks:
            return []
        logits = self.runner.execute(self._step_inputs(scheduled))
        sampling = [c for c in scheduled.chunks if c.num_logits]
        try:
            for chunk in scheduled.chunks:
                chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            emitted = self._choose_tokens(sampling, logits)
            deltas = self._append(sampling, emitted)
        except BaseException:  # interrupted (Ctrl-C) before every token was appended: let the
            for c in sampling:  # sequences without their token run this step again, or they would wait forever
                if len(c.seq) == c.start + c.num_tokens - len(c.draft_tokens):
                    c.seq.num_computed_tokens = c.start
            raise
        self.scheduler.commit(scheduled.chunks)
        for seq in [c.seq for c in sampling if c.seq.is_finished]:
            self.scheduler.finish(seq)
            self.runner.release(seq.request_id)
            self.speculator.release(seq.request_id)
        self.num_steps += 1
        if self.step_records.maxlen != 0:
            self._record(started, scheduled)
        return deltas

    def _step_inputs(self, scheduled: SchedulerOutput) -> StepInputs:
        """The step as plain data: what the runner sees of each sequence."""
        chunks = [
            ChunkInput(
                c.seq.request_id,
                c.seq.tokens(c.start, c.start + c.num_tokens - len(c.draft_tokens)) + c.draft_tokens,
                c.start,
                c.num_logits,
                self.scheduler.block_table(c.seq),
                len(c.seq.prompt_token_ids) + c.seq.max_output,
            )
            for c in scheduled.chunks
        ]
        return StepInputs(chunks, scheduled.copies)

    def _choose_tokens(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sampling chunk emits: one sampled token, or — for a verify chunk —
        the proposals the target accepts and its own next token."""
        emitted: list[list[int]] = [[] for _ in chunks]
        ends = [0]
        for c in chunks:
            ends.append(ends[-1] + c.num_logits)
        plain = [i for i, c in enumerate(chunks) if not c.draft_tokens]
        if plain:
            seqs = [chunks[i].seq for i in plain]
            rows = (
                logits
                if len(plain) == len(logits)
                else logits[torch.tensor([ends[i + 1] - 1 for i in plain], device=logits.device)]
            )
            needs_history = any(s.params.repetition_penalty != 1.0 for s in seqs)
            tokens = sample(
                rows,
                [s.params for s in seqs],
                [s.generator for s in seqs],
                seen=[s.token_ids for s in seqs] if needs_history else None,
            )
            for i, token in zip(plain, tokens):
                emitted[i] = [token]
        for i, chunk in enumerate(chunks):
            if chunk.draft_tokens:  # verify: the k + 1 rows of this chunk decide
                emitted[i] = self.speculator.verify(chunk.seq, chunk.draft_tokens, logits[ends[i] : ends[i + 1]])
        return emitted

    def _append(self, chunks: list[ScheduledChunk], emitted: list[list[int]]) -> list[StreamDelta]:
        now = self.clock()
        deltas = []
        for chunk, tokens in zip(chunks, emitted):
            seq = chunk.seq
            appended = seq.append_tokens(tokens, now)
            metrics = seq.metrics
            metrics.num_forward_passes += 1
            if chunk.draft_tokens:
                accepted = len(tokens) - 1  # the last emitted token is the target's own
                metrics.num_verify_steps += 1
                metrics.spec_proposed += len(chunk.draft_tokens)
                metrics.spec_accepted += accepted
                if not seq.is_finished:  # rejected proposals: their K/V goes (a finished one frees all)
                    self.scheduler.rollback(seq, chunk.start + 1 + accepted)
                self.speculator.after_verify(seq)
            new = tokens[:appended]
            delta = StreamDelta(seq.request_id, new[-1], seq.take_stream_text(), seq.finish_reason, token_ids=new)
            if seq.is_finished:
                del self.requests[seq.request_id]
                delta.output = seq.to_output()
            deltas.append(delta)
        return deltas

    def _record(self, started: float, scheduled: SchedulerOutput) -> None:
        record = StepRecord(
            index=self.num_steps - 1,
            start=started,
            end=self.clock(),
            chunks=[(c.seq.request_id, c.start, c.num_tokens, c.is_decode) for c in scheduled.chunks],
            preempted=[s.request_id for s in scheduled.preempted],
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            **vars(self.scheduler.block_manager.pool_stats()),
            contiguous_reserved_slots=len(self.scheduler.running) * self.max_model_len,
        )
        bm = self.block_manager
        if self.record_block_tables and bm is not None:
            record.block_tables = {rid: list(t) for rid, t in bm.tables.items()}
            record.block_hashes = [b.hash is not None for b in bm.blocks]
            record.block_refs = [b.ref_count for b in bm.blocks]
        self.step_records.append(record)
