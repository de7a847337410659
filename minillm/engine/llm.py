"""``LLM``: the offline entry point — load a model, generate for a batch of prompts, stream.

    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    print(out.text, out.metrics.ttft)

A prompt is a string, a list of token ids, or a chat (a list of ``{"role", "content"}``
messages rendered with the model's chat template). Every request is validated before any
work starts, so a bad prompt raises a ``ValueError`` naming it and the engine stays usable.

``LLM`` is a thin loop over the online ``LLMEngine`` (``llm.engine``): add every request,
then ``step()`` until all have finished.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from minillm.engine.llm_engine import LLMEngine, Prompt
from minillm.outputs import RequestOutput, StreamDelta
from minillm.sampling import SamplingParams
from minillm.sequence import Sequence


class LLM:
    def __init__(self, model: str | Path = "smollm2-135m", **engine_args):
        """``engine_args`` are ``EngineConfig`` fields: device, dtype, max_model_len,
        max_num_seqs, mode ("paged" | "contiguous" | "naive"), num_threads, seed,
        attention_backend ("auto" | "torch" | "sdpa"), cpu_prepack, compile, and for the paged
        engine scheduling_policy, block_size, kv_cache_memory, enable_prefix_caching,
        enable_chunked_prefill, max_num_batched_tokens, batch_timeout."""
        self.engine = LLMEngine(model, **engine_args)

    # The engine's parts, for notebooks and tools.
    engine_config = property(lambda self: self.engine.engine_config)
    model = property(lambda self: self.engine.model)
    model_config = property(lambda self: self.engine.model_config)
    model_dir = property(lambda self: self.engine.model_dir)
    tokenizer = property(lambda self: self.engine.tokenizer)
    device = property(lambda self: self.engine.device)
    dtype = property(lambda self: self.engine.dtype)
    max_model_len = property(lambda self: self.engine.max_model_len)
    mode = property(lambda self: self.engine.mode)

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
        return [self.engine.make_sequence(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs keep prompt order.

        All requests are queued at once; the engine's scheduler decides how they are batched
        (at most ``max_num_seqs`` run together).
        """
        if self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has unfinished online requests; finish or abort them before generate()")
        seqs = self._make_sequences(prompts, sampling_params)
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(seqs), desc="generating", unit="req")
        for seq in seqs:
            self.engine.enqueue(seq)
        try:
            while self.engine.has_unfinished_requests():
                deltas = self.engine.step()
                if progress is not None:
                    progress.update(sum(d.finish_reason is not None for d in deltas))
        except BaseException:  # interrupted (Ctrl-C in a notebook) or failed: leave the engine clean
            for seq in seqs:
                if seq.request_id in self.engine.requests:
                    self.engine.abort(seq.request_id)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [s.to_output() for s in seqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield a ``StreamDelta`` per generated token as soon as it is sampled."""
        (seq,) = self._make_sequences([prompt], sampling_params)
        self.engine.enqueue(seq)
        try:
            while not seq.is_finished:
                for delta in self.engine.step():
                    if delta.request_id == seq.request_id:
                        yield delta
        finally:
            if not seq.is_finished:  # the caller stopped iterating: free the request's resources
                self.engine.abort(seq.request_id)
