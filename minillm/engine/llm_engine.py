"""``LLMEngine``: the online engine — requests come and go while the model runs.

    engine = LLMEngine("smollm2-135m")
    engine.add_request("The capital of France is", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for delta in engine.step():          # tokens produced by this step
            print(delta.request_id, delta.text, end="")

Each ``step()`` is one iteration of the serving loop:

    schedule → step inputs (plain data) → runner: logits → sample (+ logprobs) → append
    → commit blocks → free finished requests → report what was produced

A request with ``SamplingParams.n > 1`` is one sequence until its prompt's logits come; then
its n first tokens are drawn from that row and n - 1 more sequences are forked off it, sharing
its KV blocks copy-on-write (``_fork``); from then on they are independent sequences.

``LLM.generate`` and ``LLM.stream`` are thin loops over this class. The loop is the same for
every mode; ``engine/builder.py`` decides which scheduler and runner do the work: in
``mode="paged"`` (the default) the scheduler, block manager and paged pool of chapters 03-04;
the earlier rungs (``naive``, ``contiguous``) the same scheduler's static policy and their own runners.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

import minillm.hooks as hooks
from minillm.assets import resolve_model
from minillm.config import EngineConfig, ModelConfig, Where, check_compatible
from minillm.engine.builder import build_engine_parts, build_parallel_parts, prepare_process, start_kernel_build
from minillm.engine.gc_pause import collection_paused
from minillm.engine.scheduler import ScheduledChunk, SchedulerOutput
from minillm.engine.stats import EngineStats
from minillm.engine.virtual_clock import TimedRunner, VirtualClock
from minillm.inputs import InputProcessor, Prompt
from minillm.metrics import StepPhases, StepRecord
from minillm.models import load_model
from minillm.outputs import RequestOutput, SampleId, StreamDelta, TokenLogprob
from minillm.runtime.background_compile import FastPathStatus
from minillm.runtime.runner import ChunkInput, StepInputs
from minillm.runtime.thread_governor import ThreadGovernor
from minillm.sampling import SamplingParams, token_logprobs
from minillm.sequence import Sequence
from minillm.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, model: str | Path = "smollm2-135m", **engine_args):
        """``engine_args`` are ``EngineConfig`` fields (see its docstring)."""
        self.engine_config = config = EngineConfig(**engine_args)
        check_compatible(config, Where(deployment="engine"))  # data_parallel_size > 1 is LLM's, not one engine's
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
        prepare_process()  # importing minillm set nothing; an engine's process-wide set-up happens here
        start_kernel_build(config, self.device)  # a cold C++ build overlaps the tokenizer and weights
        self.tokenizer = Tokenizer(self.model_dir)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        # Sliding-window attention: the engine's option, else the checkpoint's (Mistral).
        self.sliding_window = config.sliding_window or self.model_config.sliding_window
        if config.world_size > 1:  # the model lives in worker processes, one shard each
            self.model = None
            parts = build_parallel_parts(
                config, self.model_config, self.model_dir, self.max_model_len, self.sliding_window
            )
        else:
            self.model = load_model(self.model_dir, self.dtype, self.device, max_positions=self.max_model_len)
            parts = build_engine_parts(
                config, self.model, self.model_config, self.max_model_len, self.sliding_window, self.tokenizer,
                self.model_dir,
            )
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.attention_backend = parts.attention_backend
        self.block_manager = parts.block_manager  # None outside the paged mode
        self.kv_cache = parts.kv_cache
        self.graphs = parts.graphs
        # What every auto/None choice became (print(engine.resolved)); written back into the config
        # too, so engine_config.compile says whether this engine compiled.
        self.resolved = parts.resolved
        self.engine_config = replace(config, compile=parts.resolved.compile)
        self.speculator = parts.speculator  # proposes and verifies; does nothing without speculative_config
        self.resolved.speculation = self.speculator.describe()
        self.speculator.resolved = self.resolved  # the governor's decisions show there as they change
        # Whether this step can verify a tree (runners other than the paged one: chains only).
        self.speculator.trees_verifiable = getattr(self.runner, "supports_trees", lambda: False)
        self._tree_paths: dict[int, list[int]] = {}  # this step's verified trees: chunk -> accepted branch
        # Fewer OpenMP threads while other processes keep cores busy (a busy laptop); one process only.
        adapt = config.adapt_threads and self.device.type == "cpu" and config.world_size == 1
        self.threads = ThreadGovernor(config.num_threads, enabled=adapt)
        self._rng = random.Random(config.seed)
        self._next_id = 0
        # Every unfinished request, by the id add_request returned: its sequence, or for n > 1 its
        # sample 0 (whose `.samples` lists them all), kept until the last sample has finished.
        self.requests: dict[Hashable, Sequence] = {}
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
        ranks = getattr(self.runner, "ranks", None)  # a parallel engine's workers: what each holds
        weights = self.model.weight_bytes() if ranks is None else sum(r["weights_bytes"] for r in ranks)
        pool = self.kv_cache.nbytes if self.kv_cache is not None else None
        report: dict = {
            "weights_bytes": weights,  # across every rank of a parallel engine (see "ranks")
            "kv_pool_bytes": pool if ranks is None else sum(r["kv_pool_bytes"] for r in ranks),
            # How many blocks those bytes hold: an int8 pool (kv_cache_dtype="int8") holds ~2x.
            "kv_pool_blocks": self.block_manager.num_blocks if self.block_manager is not None else None,
            "allocated_bytes": None,
            "peak_allocated_bytes": None,
        }
        if ranks is not None:
            report["ranks"] = ranks
        if self.device.type == "cuda":
            report["allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def close(self) -> None:
        """Stop the worker processes of a parallel engine, and a compile still running in the
        background. An engine dropped without ``close()`` stops them when it is garbage-collected
        (a background compile: when this process exits)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        build = getattr(self.graphs, "build", None)
        if build is not None:
            build.close()

    def failure(self) -> str | None:
        """Why this engine can no longer serve — a parallel engine's worker died or was stopped —
        or None while it can (what a server's ``/health`` reports)."""
        failure = getattr(self.runner, "failure", None)
        return failure() if failure is not None else None

    def fast_path_status(self) -> FastPathStatus:
        """Where the decode fast path stands: ``building`` (a compile or load behind the running
        engine, with what it is doing), ``ready``, ``failed`` (with why; decode runs eagerly), or
        ``off`` (with why: ``resolved.compile_reason``)."""
        build = getattr(self.graphs, "build", None)
        if build is not None:
            return build.status()
        if self.graphs is None:
            return FastPathStatus("off", self.resolved.compile_reason)
        sizes = tuple(getattr(self.graphs, "batch_sizes", ()))
        return FastPathStatus("ready", self.resolved.decode_fast_path, sizes, sizes)

    def wait_for_fast_path(self, timeout: float | None = None) -> FastPathStatus:
        """Block until the decode fast path is ready or has failed (at most ``timeout`` seconds),
        e.g. before measuring the compiled speed; its status then."""
        build = getattr(self.graphs, "build", None)
        return build.wait(timeout) if build is not None else self.fast_path_status()

    def _warm_up(self) -> None:
        """One tiny request through the whole path, so one-time costs (kernel selection, oneDNN
        primitive creation, allocator growth) are not billed to the first real request. It
        arrives as if it had waited a whole ``batch_timeout``: a dynamic-batching engine would
        otherwise hold its own construction until the timeout ran out."""
        waited = self.clock() - getattr(self.scheduler, "batch_timeout", 0.0)
        self.add_request([0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="__warm_up__",
                         arrival_time=waited)  # fmt: skip
        while self.has_unfinished_requests():
            self.step()
        self.step_records.clear()
        self.num_steps = 0
        self.speculator.forget_measurements()  # its one-time costs say nothing about speculating
        if self.block_manager is not None:  # forget the warm-up's cached block and statistics
            self.block_manager.reset_prefix_cache()

    # ----------------------------------------------------------------------------------------
    # Requests
    # ----------------------------------------------------------------------------------------

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        where: str = "prompt",
        arrival_time: float | None = None,
        priority: int = 0,
        request_id: Hashable | None = None,
    ) -> Sequence:
        """Validate one request and build its ``Sequence`` (not yet queued).

        ``params.n > 1`` needs the paged engine (the samples share the prompt's blocks copy-on-write;
        the naive and contiguous runners have no blocks to share) and at most ``max_num_seqs``
        samples (they run together). Speculation of either kind works: a draft model rebuilds
        each forked sample's draft state from its tokens, as after a preemption.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for {where} must be SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have been changed after construction
        if params.n > 1 and self.block_manager is None:
            raise ValueError(
                f"n={params.n} for {where}: parallel samples share the prompt's KV blocks copy-on-write, "
                f"which needs mode='paged' (this engine has mode={self.mode!r})"
            )
        if params.n > self.engine_config.max_num_seqs:
            raise ValueError(
                f"n={params.n} for {where} exceeds max_num_seqs={self.engine_config.max_num_seqs}: "
                "a request's samples run together"
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority for {where} must be an int, got {priority!r}")
        if arrival_time is not None and (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, (int, float))
            or not math.isfinite(arrival_time)
        ):
            raise TypeError(f"arrival_time for {where} must be a time.perf_counter() value, got {arrival_time!r}")
        text, ids = self.input_processor.process(prompt, where)
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
        # Samples 1..n-1 draw from seed + i: each is exactly the request with n=1 and that seed.
        seeds = [
            (params.seed + i) % 2**64 if params.seed is not None else self._rng.getrandbits(63)
            for i in range(1, params.n)
        ]
        seq.pending_generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
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

        With ``params.n > 1`` the prompt is prefilled once and its n samples decode separately;
        their deltas and outputs carry this id and their ``index`` (see ``StreamDelta``).

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

    def abort(self, request_id: Hashable) -> RequestOutput:
        """Stop a request now — every sample still running, for ``n > 1`` — and free their
        blocks; returns ``request_output`` (finish_reason "abort" where a sample was cut)."""
        with self._lock:
            first = self.requests.pop(request_id, None)
            if first is None:
                raise ValueError(f"abort: no unfinished request with id {request_id!r}")
            now = self.clock()
            for seq in first.samples:
                if not seq.is_finished:
                    self.scheduler.finish(seq)
                    self.runner.release(seq.request_id)
                    self.speculator.release(seq.request_id)
                    seq.abort(now)
            return self.request_output(first)

    @staticmethod
    def request_output(seq: Sequence) -> RequestOutput:
        """The output of the request whose (first) sequence is ``seq``: its own, and for
        ``n > 1`` every sample's in ``samples`` (index order)."""
        out = seq.to_output()
        if seq.params.n > 1:
            out.samples = [s.to_output() for s in seq.samples]
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests (not samples: a request with n > 1 counts once) with a sample still running."""
        return len(self.requests)

    # ----------------------------------------------------------------------------------------
    # The step
    # ----------------------------------------------------------------------------------------

    def step(self) -> list[StreamDelta]:
        """Run one scheduler step; return a delta for every request that produced a token.

        The last delta of a request carries ``finish_reason``, the complete ``output`` and
        ``request_finished``. With ``n > 1``, one delta per sample (``index``), each sample's last
        with its ``finish_reason`` and ``output``; ``request_finished`` only on the very last.
        A step with nothing to run (all queued requests waiting for a dynamic batch to fill)
        returns an empty list without touching the model.
        """
        # One step at a time (requests may be added or aborted from other threads), with the
        # cyclic collector paused: the step's thousands of short-lived objects die young (gc_pause.py).
        with self._lock, collection_paused():
            return self._step()

    def _step(self) -> list[StreamDelta]:
        # Wall-clock stamps between the phases (not self.clock, which a replay may simulate):
        # where the step's time went, kept in its record (StepPhases).
        t0 = time.perf_counter()
        started = self.clock()
        self.speculator.propose(self.scheduler.running, self.scheduler.queued_for_a_place())  # if speculating
        scheduled = self.scheduler.schedule(started)
        for seq in scheduled.preempted:
            self.speculator.release(seq.request_id)
        if not scheduled.chunks:
            return []
        self.threads.adjust()  # in the thread that runs the step: OpenMP's thread count is per thread
        t1 = time.perf_counter()
        inputs = self._step_inputs(scheduled)
        t2 = time.perf_counter()
        logits = self.runner.execute(inputs)
        t3 = time.perf_counter()
        if inputs.want_hidden:  # a feature-level draft drafts from what this pass computed
            self.speculator.observe(inputs.chunks, self.runner.last_hidden, [c.seq for c in scheduled.chunks])
        sampling = [c for c in scheduled.chunks if c.num_logits]
        try:
            for chunk in scheduled.chunks:
                chunk.seq.num_computed_tokens = chunk.start + chunk.num_tokens
            emitted, forks = self._choose_tokens(sampling, logits)
            logprobs = self._logprobs(sampling, logits, emitted, forks)
            t4 = time.perf_counter()
            deltas = self._append(sampling, emitted, forks, logprobs)
        except BaseException:  # interrupted (Ctrl-C) before every token was appended: let the
            for c in sampling:  # sequences without their token run this step again, or they would wait forever
                if len(c.seq) == c.start + c.num_tokens - len(c.draft_tokens):
                    c.seq.num_computed_tokens = c.start
            raise
        try:
            self.scheduler.commit(scheduled.chunks)
        finally:  # finished sequences were already handed out: free them even if committing failed
            for seq in [c.seq for c in sampling if c.seq.is_finished]:
                self.scheduler.finish(seq)
                self.runner.release(seq.request_id)
                self.speculator.release(seq.request_id)
        self.num_steps += 1
        self.speculator.step_done(scheduled.chunks, sum(map(len, emitted)), self.clock() - started)
        if self.step_records.maxlen != 0:
            # The runner's own input building (its tensors) counts as inputs, not as the model.
            runner_inputs = getattr(self.runner, "last_inputs_seconds", 0.0)
            phases = StepPhases(
                schedule=t1 - t0,
                inputs=t2 - t1 + runner_inputs,
                model=t3 - t2 - runner_inputs,
                sample=t4 - t3,
                output=time.perf_counter() - t4,
            )
            self._record(started, scheduled, phases)
        return deltas

    def _step_inputs(self, scheduled: SchedulerOutput) -> StepInputs:
        """The step as plain data: what the runner sees of each sequence (a tree's proposals
        with their parents: the scheduler may have kept fewer of them, and a prefix of a tree
        whose parents come first is a tree)."""
        chunks = [
            ChunkInput(
                c.seq.request_id,
                c.seq.tokens(c.start, c.start + c.num_tokens - len(c.draft_tokens)) + c.draft_tokens,
                c.start,
                c.num_logits,
                self.scheduler.block_table(c.seq),
                len(c.seq.prompt_token_ids) + c.seq.max_output,
                tree_parents=c.seq.draft_parents[: len(c.draft_tokens)] if c.draft_tokens and c.seq.draft_parents else None,
            )
            for c in scheduled.chunks
        ]
        return StepInputs(chunks, scheduled.copies, want_hidden=self.speculator.wants_hidden)

    @staticmethod
    def _logit_ends(chunks: list[ScheduledChunk]) -> list[int]:
        """``ends[i]:ends[i + 1]`` are chunk ``i``'s rows of the step's logits."""
        ends = [0]
        for c in chunks:
            ends.append(ends[-1] + c.num_logits)
        return ends

    def _choose_tokens(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor
    ) -> tuple[list[list[int]], dict[int, list[int]]]:
        """The tokens each sampling chunk emits: one sampled token, or — for a verify chunk —
        the proposals the target accepts and its own next token. And ``forks``: for a chunk
        giving the first logits of a request with ``n > 1``, the first tokens of samples
        1..n-1, drawn from the same row with their own generators."""
        emitted: list[list[int]] = [[] for _ in chunks]
        forks: dict[int, list[int]] = {}
        ends = self._logit_ends(chunks)
        plain = [i for i, c in enumerate(chunks) if not c.draft_tokens]
        if plain and len(plain) == len(chunks) == len(logits) and not any(c.seq.pending_generators for c in chunks):
            # The usual step: one row per chunk, nobody forks — no row index to build.
            seqs = [c.seq for c in chunks]
            rows, generators = logits, [s.generator for s in seqs]
        elif plain:
            rows_of, seqs, generators = [], [], []
            for i in plain:
                seq = chunks[i].seq
                for generator in [seq.generator, *seq.pending_generators]:
                    rows_of.append(ends[i + 1] - 1)
                    seqs.append(seq)
                    generators.append(generator)
            rows = (
                logits
                if len(rows_of) == len(plain) == len(logits)
                else logits[torch.tensor(rows_of, device=logits.device)]
            )
        if plain:
            needs_history = any(s.params.repetition_penalty != 1.0 for s in seqs)
            tokens = hooks.sample(  # chapter 01's sampler exercise plugs in here
                rows,
                [s.params for s in seqs],
                generators,
                seen=[s.token_ids for s in seqs] if needs_history else None,
            )
            at = 0
            for i in plain:
                fan = 1 + len(chunks[i].seq.pending_generators)
                emitted[i] = tokens[at : at + 1]
                if fan > 1:
                    forks[i] = tokens[at + 1 : at + fan]
                at += fan
        self._tree_paths = {}
        for i, chunk in enumerate(chunks):
            if chunk.draft_tokens and chunk.seq.draft_parents:  # a tree: the accepted branch and its tokens
                parents = chunk.seq.draft_parents[: len(chunk.draft_tokens)]
                path, emitted[i] = self.speculator.verify_tree(
                    chunk.seq, chunk.draft_tokens, parents, logits[ends[i] : ends[i + 1]]
                )
                self._tree_paths[i] = path
            elif chunk.draft_tokens:  # verify: the k + 1 rows of this chunk decide
                emitted[i] = self.speculator.verify(chunk.seq, chunk.draft_tokens, logits[ends[i] : ends[i + 1]])
        return emitted, forks

    def _logprobs(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, emitted: list[list[int]], forks: dict[int, list[int]]
    ) -> list[list[TokenLogprob] | None]:
        """For chunks whose request asked for logprobs: a record per token of
        ``emitted[i] + forks[i]`` (None for the others, which cost nothing). Emitted token ``j``
        of a chunk is predicted by its row ``j`` (a verify chunk's rows are consecutive
        positions); forked first tokens all come from the one row of the prefill's end."""
        out: list[list[TokenLogprob] | None] = [None] * len(chunks)
        wanted = [i for i, c in enumerate(chunks) if c.seq.params.logprobs is not None]
        if not wanted:
            return out
        ends = self._logit_ends(chunks)
        rows, tokens, num_top = [], [], []
        for i in wanted:
            k = chunks[i].seq.params.logprobs
            path = self._tree_paths.get(i)  # a tree's emitted token j follows its row of path[j-1]
            for j, token in enumerate(emitted[i]):
                rows.append(ends[i] + (j if path is None or j == 0 else 1 + path[j - 1]))
                tokens.append(token)
                num_top.append(k)
            for token in forks.get(i, []):
                rows.append(ends[i])
                tokens.append(token)
                num_top.append(k)
        records = token_logprobs(logits[torch.tensor(rows, device=logits.device)], tokens, num_top)
        at = 0
        for i in wanted:
            count = len(emitted[i]) + len(forks.get(i, []))
            out[i] = records[at : at + count]
            at += count
        return out

    def _fork(self, first: Sequence, index: int, token: int, now: float) -> Sequence:
        """Sample ``index`` of ``first``'s request, whose first token is ``token``: it shares
        ``first``'s blocks (the prompt's K/V; a write into a shared block is copied first, by
        ``BlockManager.allocate_slots``) and runs from the next step on, on its own."""
        child = Sequence(
            SampleId(first.request_id, index),
            first.prompt,
            first.prompt_token_ids,
            first.params,
            self.tokenizer,
            first.pending_generators[index - 1],
            self.max_model_len,
            first.metrics.arrival_time,
            first.priority,
        )
        child.group_id, child.index = first.group_id, index
        child.metrics.first_scheduled_time = first.metrics.first_scheduled_time
        child.metrics.num_forward_passes = 1  # the prefill's, which produced its first token
        child.num_cached_tokens = first.num_cached_tokens
        first.samples.append(child)
        child.append_token(token, now)
        if not child.is_finished:  # one that ends at its first token needs no blocks
            self.block_manager.fork(first, child)
            self.scheduler.adopt(child)
        return child

    def _append(
        self,
        chunks: list[ScheduledChunk],
        emitted: list[list[int]],
        forks: dict[int, list[int]],
        logprobs: list[list[TokenLogprob] | None],
    ) -> list[StreamDelta]:
        now = self.clock()
        deltas = []
        for i, (chunk, tokens, records) in enumerate(zip(chunks, emitted, logprobs)):
            seq = chunk.seq
            appended = seq.append_tokens(tokens, now)
            metrics = seq.metrics
            metrics.num_forward_passes += 1
            if chunk.draft_tokens:
                accepted = len(tokens) - 1  # the last emitted token is the target's own
                metrics.num_verify_steps += 1
                metrics.spec_proposed += len(chunk.draft_tokens)
                metrics.spec_accepted += accepted
                if i in self._tree_paths:  # the accepted branch's K/V moves up behind the sequence
                    self.runner.keep_tree_branch(self.scheduler.block_table(seq), chunk.start + 1,
                                                 self._tree_paths[i][:accepted])  # fmt: skip
                if not seq.is_finished:  # rejected proposals: their K/V goes (a finished one frees all)
                    self.scheduler.rollback(seq, chunk.start + 1 + accepted)
                else:  # ... but first its full blocks go to the prefix cache: only those whose K/V is the sequence's
                    seq.num_computed_tokens = min(seq.num_computed_tokens, chunk.start + 1 + accepted, len(seq))
                self.speculator.after_verify(seq, self._tree_paths.get(i))
            deltas.append(self._delta(seq, tokens[:appended], None if records is None else records[:appended]))
            if i in forks:
                for j, token in enumerate(forks[i], start=1):
                    child = self._fork(seq, j, token, now)
                    deltas.append(
                        self._delta(child, [token], None if records is None else [records[len(tokens) + j - 1]])
                    )
                seq.pending_generators = []
        # A request is over with its last sample: that sample's delta (the last of the request
        # in this step) says so, and the request leaves `requests`.
        last = {d.request_id: d for d in deltas if d.finish_reason is not None}
        for request_id, delta in last.items():
            if self.requests[request_id].request_finished:
                delta.request_finished = True
                del self.requests[request_id]
        return deltas

    @staticmethod
    def _delta(seq: Sequence, new: list[int], records: list[TokenLogprob] | None) -> StreamDelta:
        """The delta of ``seq``'s appended tokens ``new`` (and their logprob ``records``); its
        text is made when read, off the step, where the text waits (``sequence.py``)."""
        if records is not None:
            seq.logprobs.extend(records)
        if seq.deferred_text:
            return seq.deferred_delta(new, records)
        delta = StreamDelta(
            seq.group_id,
            new[-1],
            seq.take_stream_text(),
            seq.finish_reason,
            token_ids=new,
            index=seq.index,
            logprobs=records,
        )
        if seq.is_finished:
            delta.output = seq.to_output()
        return delta

    def _record(self, started: float, scheduled: SchedulerOutput, phases: StepPhases) -> None:
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
            phases=phases,
        )
        bm = self.block_manager
        if self.record_block_tables and bm is not None:
            record.block_tables = {rid: list(t) for rid, t in bm.tables.items()}
            record.block_hashes = [b.hash is not None for b in bm.blocks]
            record.block_refs = [b.ref_count for b in bm.blocks]
        self.step_records.append(record)

    # ----------------------------------------------------------------------------------------
    # Public views and instruments (what the course and the visualisations use, instead of
    # reaching into the scheduler, the pools or the runner)
    # ----------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of what the engine holds now: steps run, requests running and waiting, KV
        blocks used / cached / free, prefix-cache lookups and hits (``engine/stats.py``)."""
        with self._lock:
            return EngineStats.of(self)

    @contextlib.contextmanager
    def simulated_time(
        self, cost: Callable[[int], float], draft_cost: Callable[[int], float] | None = None
    ) -> Iterator[VirtualClock]:
        """Inside the ``with``, run on simulated time: every timestamp comes from a fresh
        ``VirtualClock`` (yielded), and each forward pass moves it on by ``cost(tokens in the
        pass)`` — each pass of a draft model by ``draft_cost(tokens)`` (None: the draft's passes
        take no time). The engine's decisions and tokens are its own; its clock and runners are
        restored on the way out, also after an error (``engine/virtual_clock.py``)."""
        clock = VirtualClock()
        draft = getattr(self.speculator, "draft", None) if draft_cost is not None else None
        saved = self.clock, self.runner, getattr(draft, "runner", None)
        self.clock, self.runner = clock, TimedRunner(self.runner, clock, cost)
        if draft is not None:
            draft.runner = TimedRunner(draft.runner, clock, draft_cost)
        # What speculation measured on one clock says nothing about the other (governor.py): each
        # simulated run starts afresh, so it is the same run whatever ran before it.
        self.speculator.forget_measurements()
        try:
            yield clock
        finally:
            self.clock, self.runner = saved[0], saved[1]
            if draft is not None:
                draft.runner = saved[2]
            self.speculator.forget_measurements()
