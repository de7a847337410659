"""``LLMEngine``: the online engine — requests come and go while the model runs.

    engine = LLMEngine("smollm2-135m")
    engine.add_request("The capital of France is", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for delta in engine.step():          # tokens produced by this step
            print(delta.request_id, delta.text, end="")

Each ``step()`` is one iteration of the serving loop:

    schedule → (copy-on-write) → build flat batch → run the model → sample → update sequences
    → free finished requests' blocks → report what was produced

``LLM.generate`` and ``LLM.stream`` are thin loops over this class. In ``mode="paged"`` (the
default) the scheduler, block manager and paged pool of chapters 03-04 do the work; the
earlier rungs (``naive``, ``kv_cache``) run as static batches through the same API.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Union

import torch

from minillm.assets import resolve_model
from minillm.attention import resolve_backend
from minillm.config import EngineConfig, ModelConfig
from minillm.engine.cuda_graphs import DecodeGraphs
from minillm.engine.paged_runner import PagedModelRunner
from minillm.engine.runner import CachedRunner, NaiveRunner
from minillm.engine.scheduler import Scheduler, SchedulerOutput
from minillm.errors import PromptTooLongError
from minillm.kvcache.block_manager import BlockManager
from minillm.kvcache.paged import PagedKVCache, kv_bytes_per_token
from minillm.metrics import StepRecord
from minillm.models import load_model
from minillm.sampling import SamplingParams, sample
from minillm.sequence import Sequence, SequenceStatus, StreamDelta
from minillm.tokenizer import ChatMessages, Tokenizer

Prompt = Union[str, list[int], ChatMessages]

CPU_DEFAULT_KV_BYTES = 1 << 30


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for the KV pool right now: CUDA's free memory, or the OS's available RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
        self.block_manager: BlockManager | None = None
        self.kv_cache: PagedKVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.device, max_positions=self.max_model_len)
        self.attention_backend = resolve_backend(config.attention_backend, self.device, self.mode)
        self.model.set_attention_backend(self.attention_backend)
        # Sliding-window attention: the engine's option, else the checkpoint's (Mistral).
        self.sliding_window = config.sliding_window or self.model_config.sliding_window
        self.model.sliding_window = self.sliding_window
        self._apply_cpu_fast_paths()
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self.requests: dict[Hashable, Sequence] = {}  # every unfinished request, by id
        self.step_records: list[StepRecord] = []
        self.record_block_tables = False  # snapshot block tables every step (the explorer widget)
        if self.mode == "paged":
            num_blocks = self._num_kv_blocks()  # after the weights: "free memory" must not count them
            self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
            self.kv_cache = PagedKVCache(self.model_config, num_blocks, config.block_size, self.dtype, self.device)
            self.scheduler = Scheduler(
                self.block_manager,
                policy=config.scheduling_policy,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.token_budget,
                enable_chunked_prefill=config.enable_chunked_prefill,
                batch_timeout=config.batch_timeout,
            )
            self.graphs = self._decode_graphs()
            self.runner = PagedModelRunner(
                self.model, self.kv_cache, self.block_manager.block_table_of, self.sliding_window, self.graphs
            )
        else:
            self.scheduler = None
            self._waiting: list[Sequence] = []
            self._batch_runner: NaiveRunner | CachedRunner | None = None
        self._warm_up()

    @property
    def mode(self) -> str:
        return self.engine_config.mode

    # ----------------------------------------------------------------------------------------
    # Setup
    # ----------------------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        config = self.engine_config
        block_bytes = config.block_size * kv_bytes_per_token(self.model_config, self.dtype)
        memory = config.kv_cache_memory
        if isinstance(memory, float):
            budget = int(memory * free_memory_bytes(self.device))
        elif isinstance(memory, int):
            budget = memory
        elif self.device.type == "cuda":
            budget = int(0.9 * free_memory_bytes(self.device))
        else:
            full = config.max_num_seqs * -(-self.max_model_len // config.block_size) * block_bytes
            budget = min(full, CPU_DEFAULT_KV_BYTES)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={memory!r} gives {budget} bytes, less than one KV block "
                f"({block_bytes} bytes = {config.block_size} tokens x {block_bytes // config.block_size} bytes/token)"
            )
        return num_blocks

    def _decode_graphs(self) -> DecodeGraphs | None:
        wanted = self.engine_config.cuda_graphs
        if wanted is None:
            wanted = self.device.type == "cuda" and self.attention_backend == "triton"
        if not wanted:
            return None
        if self.attention_backend != "triton":
            raise ValueError(
                f"cuda_graphs=True needs attention_backend='triton' (got {self.attention_backend!r}): the graph "
                "replays the Triton decode kernels, whose shapes do not change between steps"
            )
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache,
            self.engine_config.max_num_seqs,
            self.max_model_len,
            self.sliding_window,
            capture=self.device.type == "cuda",
        )
        if graphs.capture:
            graphs.capture_all()
        return graphs

    def memory_report(self) -> dict[str, int | None]:
        """Bytes of weights and KV pool, and (on CUDA) the allocator's current and peak use."""
        # From the config: prepacked CPU weights live outside the module's state dict.
        weights = self.model_config.num_params * torch.empty((), dtype=self.dtype).element_size()
        report: dict[str, int | None] = {
            "weights_bytes": weights,
            "kv_pool_bytes": self.kv_cache.nbytes if self.kv_cache is not None else None,
            "allocated_bytes": None,
            "peak_allocated_bytes": None,
        }
        if self.device.type == "cuda":
            report["allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            report["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return report

    def _apply_cpu_fast_paths(self) -> None:
        from minillm.models.cpu_prepack import prepack_available

        config = self.engine_config
        prepack = config.cpu_prepack and self.device.type == "cpu" and prepack_available(self.dtype)
        if config.compile and self.dtype != torch.float32:
            prepack = False  # packed half-precision kernels are opaque to the compiler
        if prepack:
            self.model.prepack_for_cpu()
        if config.compile and self.mode == "kv_cache":
            # Measured on CPU: fp32 runs batched steps fastest on prepacked weights and
            # single-sequence steps fastest compiled; half precision fastest compiled throughout.
            self.model.compile_decode(single_row_only=prepack)

    def _warm_up(self) -> None:
        """One tiny request through the whole path, so one-time costs (kernel selection, oneDNN
        primitive creation, allocator growth) are not billed to the first real request."""
        self.add_request([0], SamplingParams(max_tokens=2, ignore_eos=True), request_id="__warm_up__")
        while self.has_unfinished_requests():
            self.step()
        self.step_records.clear()
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
        text, ids = self._prompt_ids(prompt, where)
        if not ids:
            raise ValueError(f"{where} ({text!r:.40}) encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"{where} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"to generate (at most {self.max_model_len - 1} prompt tokens)"
            )
        if request_id is None:
            while self._next_id in self.requests:  # a caller may have chosen this number already
                self._next_id += 1
            request_id = self._next_id
            self._next_id += 1
        elif request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
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
        seq = self.make_sequence(prompt, params, where, arrival_time, priority, request_id)
        self.enqueue(seq)
        return seq.request_id

    def enqueue(self, seq: Sequence) -> None:
        """Queue an already validated sequence (``LLM.generate`` validates a whole batch first)."""
        self.requests[seq.request_id] = seq
        if self.scheduler is not None:
            self.scheduler.add(seq)
        else:
            self._waiting.append(seq)

    def abort(self, request_id: Hashable):
        """Stop a request now and free its blocks; returns its ``RequestOutput`` (finish_reason "abort")."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise ValueError(f"abort: no unfinished request with id {request_id!r}")
        if self.scheduler is not None:
            self.scheduler.finish(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        else:
            self._batch_runner.release(seq)
            if not self._batch_runner.order:
                self._batch_runner = None
        seq.abort()
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
        if self.scheduler is None:
            return self._static_step()
        started = time.perf_counter()
        scheduled = self.scheduler.schedule(started)
        if not scheduled.chunks:
            return []
        logits, sampled = self.runner.execute(scheduled.chunks, scheduled.copies)
        for chunk in scheduled.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)
            if self.sliding_window is not None:  # blocks behind the window go back to the pool
                self.block_manager.release_behind_window(chunk.seq, self.sliding_window)
        deltas = self._sample_and_append([c.seq for c in sampled], logits)
        for seq in [c.seq for c in sampled if c.seq.is_finished]:
            self.scheduler.finish(seq)
        self._record(started, scheduled, len(sampled))
        return deltas

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[StreamDelta]:
        if not seqs:
            return []
        needs_history = any(s.params.repetition_penalty != 1.0 for s in seqs)
        tokens = sample(
            logits,
            [s.params for s in seqs],
            [s.generator for s in seqs],
            seen=[s.token_ids for s in seqs] if needs_history else None,
        )
        now = time.perf_counter()
        deltas = []
        for seq, token in zip(seqs, tokens):
            seq.append_token(token, now)
            delta = StreamDelta(seq.request_id, token, seq.take_stream_text(), seq.finish_reason)
            if seq.is_finished:
                del self.requests[seq.request_id]
                delta.output = seq.to_output()
            deltas.append(delta)
        return deltas

    def _record(self, started: float, scheduled: SchedulerOutput, num_sampled: int) -> None:
        bm = self.block_manager
        chunks = [(c.seq.request_id, c.start, c.num_tokens, c.is_decode) for c in scheduled.chunks]
        record = StepRecord(
            index=len(self.step_records),
            start=started,
            end=time.perf_counter(),
            chunks=chunks,
            preempted=[s.request_id for s in scheduled.preempted],
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            blocks_used=bm.num_used_blocks,
            blocks_cached=bm.num_cached_blocks,
            blocks_free=len(bm.free_ids),
            tokens_stored=sum(bm.num_tokens.values()),
            reserved_slots=bm.num_used_blocks * bm.block_size,
            wasted_slots=bm.wasted_slots(),
            contiguous_reserved_slots=len(self.scheduler.running) * self.max_model_len,
        )
        if self.record_block_tables:
            record.block_tables = {rid: list(t) for rid, t in bm.tables.items()}
            record.block_hashes = [b.hash is not None for b in bm.blocks]
            record.block_refs = [b.ref_count for b in bm.blocks]
        self.step_records.append(record)

    def _static_step(self) -> list[StreamDelta]:
        """The ``naive`` / ``kv_cache`` rungs: one static batch at a time, through their runners."""
        if self._batch_runner is None:
            if not self._waiting:
                return []
            self._waiting.sort(key=lambda s: s.sort_key)
            batch = self._waiting[: self.engine_config.max_num_seqs]
            del self._waiting[: len(batch)]
            now = time.perf_counter()
            for s in batch:
                s.status = SequenceStatus.RUNNING
                s.metrics.first_scheduled_time = now
            self._batch_runner = NaiveRunner(self.model) if self.mode == "naive" else CachedRunner(self.model)
            self._batch_runner.start(batch)
            logits = self._batch_runner.prefill()
        else:
            logits = self._batch_runner.decode()
        active = list(self._batch_runner.order)
        deltas = self._sample_and_append(active, logits)
        for seq in active:
            if seq.is_finished:
                self._batch_runner.release(seq)
        if not self._batch_runner.order:
            self._batch_runner = None
        return deltas
