"""One rank of a tensor- / pipeline-parallel engine: a model shard, its own KV pool, its part of
every step.

The scheduler runs once (in the driver); each step's ``StepInputs`` — plain data: ids,
positions, block tables, copy-on-write pairs — reach rank 0, which **broadcasts** them to every
rank. Block ids mean the same thing on every rank: each rank's pool has the same blocks, each
holding only that rank's K/V heads of its stage's layers. Then:

- **TP** (``pp_size == 1``): every rank runs the whole step on its shard; the all-reduces
  inside the layers keep the hidden states identical on every rank, and the LM head's logits
  are gathered, so rank 0 has the full logits;
- **PP**: the step's chunks are cut into **micro-batches**; stage ``s`` runs micro-batch ``m``
  as soon as stage ``s - 1`` has sent its hidden states, so the stages work on different
  micro-batches at once (GPipe's schedule). The last stage sends the logits to rank 0.

Rank ``r`` is tensor-parallel rank ``r % tp_size`` of stage ``r // tp_size``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from minillm.config import EngineConfig, KVCacheDtype, ModelConfig, environment
from minillm.kvcache.paged import PagedKVCache
from minillm.layers.tensor_parallel import COMM, ParallelContext
from minillm.models import load_model
from minillm.models.llama import LlamaForCausalLM
from minillm.quantization import check_quantizable
from minillm.runtime.model_setup import configure_model
from minillm.runtime.paged_runner import PagedRunner
from minillm.runtime.runner import ChunkInput, StepInputs


@dataclass(frozen=True)
class ShardSpec:
    """Everything a rank needs to build its shard (plain values: it crosses process borders)."""

    model_dir: str
    dtype: str  # e.g. "bfloat16"
    device: str
    max_model_len: int
    window: int | None
    attention_backend: str
    cpu_prepack: bool
    num_blocks: int
    block_size: int
    kv_cache_dtype: KVCacheDtype
    tp_size: int = 1
    pp_size: int = 1
    num_microbatches: int = 1
    threads: int = 1
    quantization: str | None = None  # int8 / int4: each rank quantizes its own slices
    quantization_group_size: int | None = None  # int4: resolved by the driver, the same on every rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def shard_quantization(model_config: ModelConfig, tp_size: int, method: str, group_size: int | None) -> int | None:
    """Check, before any worker starts, that every tensor-parallel rank's shard can take
    ``method`` (a ``ValueError`` naming the layer and the rank's slice — an int4 group that does
    not cut a row-parallel slice into whole groups, say); each shard is built on the meta device,
    shapes only. Returns the int4 group size every rank uses (the one-process model's default
    when none is given), else None."""
    group = group_size
    for rank in range(tp_size):
        with torch.device("meta"):
            shard = LlamaForCausalLM(model_config, ParallelContext(tp_rank=rank, tp_size=tp_size))
        group = check_quantizable(shard, method, group_size)
    return group


def split_microbatches(chunks: list[ChunkInput], parts: int) -> list[list[ChunkInput]]:
    """At most ``parts`` contiguous groups of ``chunks`` with about equal numbers of tokens (in
    order, so the logits of the groups concatenate to the step's)."""
    parts = max(1, min(parts, len(chunks)))
    total = sum(c.num_tokens for c in chunks)
    groups: list[list[ChunkInput]] = [[]]
    done = 0
    for i, c in enumerate(chunks):
        left_chunks, left_groups = len(chunks) - i, parts - len(groups)
        cut = groups[-1] and (done >= total * len(groups) / parts or left_chunks <= left_groups)
        if cut and len(groups) < parts:
            groups.append([])
        groups[-1].append(c)
        done += c.num_tokens
    return groups


class ShardWorker:
    """This rank's shard of the model and pool, and its part of each step."""

    def __init__(self, spec: ShardSpec, rank: int):
        self.spec, self.rank = spec, rank
        tp, pp = spec.tp_size, spec.pp_size
        # Every rank creates every stage's TP group, in the same order (a collective call).
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None for s in range(pp)]
        stage = rank // tp
        self.parallel = ParallelContext(rank % tp, tp, stage, pp, groups[stage])
        dtype, device = getattr(torch, spec.dtype), torch.device(spec.device)
        if device.type == "cuda":  # one GPU per rank (on its node)
            device = torch.device("cuda", int(environment.get("LOCAL_RANK") or rank))
            torch.cuda.set_device(device)
        self.model = load_model(spec.model_dir, dtype, device, spec.max_model_len, parallel=self.parallel)
        weights = EngineConfig(
            cpu_prepack=spec.cpu_prepack,
            quantization=spec.quantization,
            quantization_group_size=spec.quantization_group_size,
        )
        configure_model(self.model, weights, spec.attention_backend, spec.window)
        attn = self.model.layers[0].attn
        local = replace(
            ModelConfig.from_folder(spec.model_dir),
            num_layers=len(self.model.layers),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
        )
        self.cache = PagedKVCache(local, spec.num_blocks, spec.block_size, dtype, device, spec.kv_cache_dtype)
        self.runner = PagedRunner(self.model, self.cache, spec.window)
        self.hidden_size = local.hidden_size
        self.vocab_size = local.vocab_size
        self.output_rank = (pp - 1) * tp  # TP rank 0 of the last stage

    def describe(self) -> dict:
        """What this rank holds (for reports, tests and the chapter)."""
        attn = self.model.layers[0].attn
        return {
            "rank": self.rank,
            "tp_rank": self.parallel.tp_rank,
            "stage": self.parallel.pp_rank,
            "layers": [self.model.layer_range.start, self.model.layer_range.stop],
            "q_heads": attn.num_heads,
            "kv_heads": attn.num_kv_heads,
            "weights_bytes": self.model.weight_bytes(),
            "kv_pool_bytes": self.cache.nbytes,
        }

    def gather_descriptions(self) -> list[dict] | None:
        """Every rank's ``describe()``, on rank 0 (a collective: every rank calls it)."""
        gathered = [None] * self.spec.world_size if self.rank == 0 else None
        dist.gather_object(self.describe(), gathered, dst=0)
        return gathered

    # ---------------------------------------------------------------------------------------

    def serve(self, conn=None) -> None:
        """The rank's loop: take each message (rank 0 from ``conn``, the driver's pipe; the
        others from rank 0's broadcast) and do it, until ``stop``."""
        while True:
            message = [conn.recv() if self.rank == 0 else None]
            dist.broadcast_object_list(message, src=0)
            kind, *rest = message[0]
            if kind == "stop":
                return
            step_id, inputs, timed = rest
            logits, timings = self.step(inputs, timed)
            if self.rank == 0:
                conn.send(("logits", step_id, logits.cpu().numpy(), timings))

    def broadcast_and_step(self, inputs: StepInputs, timed: bool = False):
        """Rank 0 driving in-process (a ``torchrun`` launch): broadcast, then run its part."""
        dist.broadcast_object_list([("step", 0, inputs, timed)], src=0)
        return self.step(inputs, timed)

    def broadcast_stop(self) -> None:
        dist.broadcast_object_list([("stop",)], src=0)

    def step(self, inputs: StepInputs, timed: bool = False) -> tuple[torch.Tensor | None, list | None]:
        """Run this rank's part of one step. Returns (logits on rank 0 else None, and when
        ``timed``, on rank 0, every rank's spans: each micro-batch's compute interval and
        what its collectives cost inside it)."""
        spans: list[dict] = []
        if self.spec.pp_size == 1:
            with self._span(spans, 0):
                logits = self.runner.execute(inputs)
        else:
            logits = self._pipeline_step(inputs, spans)
        if self.spec.pp_size > 1 and inputs.num_logits:  # the last stage hands the logits to rank 0
            if self.rank == self.output_rank:
                dist.send(logits.contiguous(), dst=0)
            elif self.rank == 0:
                logits = torch.empty(inputs.num_logits, self.vocab_size, device=self.model.device)
                dist.recv(logits, src=self.output_rank)
        if self.rank != 0:
            logits = None
        elif logits is None:  # a step that wants no logits (a middle chunk of a long prompt)
            logits = torch.empty(0, self.vocab_size, device=self.model.device)
        timings = None
        if timed:
            gathered = [None] * self.spec.world_size if self.rank == 0 else None
            dist.gather_object(spans, gathered, dst=0)
            timings = [span for part in gathered for span in part] if self.rank == 0 else None
        return logits, timings

    @contextmanager
    def _span(self, spans: list[dict], microbatch: int):
        """Record one piece of work: when it ran, and the time and bytes of its collectives."""
        seconds, reduced, gathered = COMM.seconds, COMM.all_reduce_bytes, COMM.all_gather_bytes
        start = time.perf_counter()
        yield
        spans.append({
            "rank": self.rank, "stage": self.parallel.pp_rank, "microbatch": microbatch,
            "start": start, "end": time.perf_counter(), "comm_s": COMM.seconds - seconds,
            "all_reduce_bytes": COMM.all_reduce_bytes - reduced, "all_gather_bytes": COMM.all_gather_bytes - gathered,
        })  # fmt: skip

    def _pipeline_step(self, inputs: StepInputs, spans: list) -> torch.Tensor | None:
        """GPipe's forward schedule over this step's micro-batches: receive (stage > 0), run this
        stage's layers, send on without waiting (stage < last) — so while stage 1 works on
        micro-batch 0, stage 0 already works on micro-batch 1."""
        tp = self.spec.tp_size
        first, last = self.parallel.is_first_stage, self.parallel.is_last_stage
        self.cache.copy_blocks(inputs.block_copies)
        outputs, sends = [], []
        for m, chunks in enumerate(split_microbatches(inputs.chunks, self.spec.num_microbatches)):
            layout = self.runner.layout(chunks)
            hidden = None
            if not first:
                tokens = sum(c.num_tokens for c in chunks)
                hidden = torch.empty(1, tokens, self.hidden_size, dtype=self.model.dtype, device=self.model.device)
                dist.recv(hidden, src=self.rank - tp)
            with self._span(spans, m):
                out = self.model(layout, hidden)
            if last:
                outputs.append(out)
            else:
                out = out.clone()  # an ordinary tensor, kept alive until the send completes
                sends.append((dist.isend(out, dst=self.rank + tp), out))
        for request, _ in sends:
            request.wait()
        return torch.cat(outputs) if last else None
