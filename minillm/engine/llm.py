"""``LLM``: the offline entry point — load a model, generate for a batch of prompts, stream.

    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    print(out.text, out.metrics.ttft)

A prompt is a string, a list of token ids, or a chat (a list of ``{"role", "content"}``
messages rendered with the model's chat template). Every request is validated before any
work starts, so a bad prompt raises a ``ValueError`` naming it and the engine stays usable.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Union

import torch

from minillm.assets import resolve_model
from minillm.config import EngineConfig, ModelConfig
from minillm.engine.runner import CachedRunner, NaiveRunner
from minillm.errors import PromptTooLongError
from minillm.models import load_model
from minillm.sampling import SamplingParams, sample
from minillm.sequence import RequestOutput, Sequence, SequenceStatus, StreamDelta
from minillm.tokenizer import ChatMessages, Tokenizer

Prompt = Union[str, list[int], ChatMessages]


class LLM:
    def __init__(self, model: str | Path = "smollm2-135m", **engine_args):
        """``engine_args`` are ``EngineConfig`` fields: device, dtype, max_model_len,
        max_num_seqs, mode ("kv_cache" | "naive"), num_threads, seed, attention_backend
        ("auto" | "torch" | "sdpa"), cpu_prepack, compile."""
        self.engine_config = EngineConfig(**engine_args)
        if self.engine_config.num_threads is not None:
            torch.set_num_threads(self.engine_config.num_threads)
        self.model_dir = resolve_model(model)
        self.model_config = ModelConfig.from_folder(self.model_dir)
        self.device = self.engine_config.resolve_device()
        self.dtype = self.engine_config.resolve_dtype(self.model_config, self.device)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = self.engine_config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}")
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.dtype, self.device, max_positions=self.max_model_len)
        self.model.set_attention_backend(self.engine_config.attention_backend)
        prepack = self._should_prepack()
        if self.engine_config.compile and self.dtype != torch.float32:
            prepack = False  # packed half-precision kernels are opaque to the compiler
        if prepack:
            self.model.prepack_for_cpu()
        if self.engine_config.compile:
            # Measured on CPU: fp32 runs batched steps fastest on prepacked weights and
            # single-sequence steps fastest compiled; half precision fastest compiled throughout.
            self.model.compile_decode(single_row_only=prepack)
        self._rng = random.Random(self.engine_config.seed)
        self._next_id = 0
        self._warm_up()

    def _warm_up(self) -> None:
        """Run one tiny prefill and decode step so one-time costs (kernel selection, oneDNN
        primitive creation, allocator growth) are not billed to the first real request's TTFT."""
        runner = self._runner()
        dummy = Sequence(
            -1,
            "",
            [0],
            SamplingParams(max_tokens=1),
            self.tokenizer,
            torch.Generator(device=self.device),
            self.max_model_len,
        )
        runner.start([dummy])
        runner.prefill()
        dummy.output_token_ids.append(0)
        runner.decode()

    def _should_prepack(self) -> bool:
        from minillm.models.cpu_prepack import prepack_available

        wanted = self.engine_config.cpu_prepack  # measured faster on CPU (see cpu_prepack.py)
        return wanted and self.device.type == "cpu" and prepack_available(self.dtype)

    @property
    def mode(self) -> str:
        return self.engine_config.mode

    def _runner(self):
        return NaiveRunner(self.model) if self.mode == "naive" else CachedRunner(self.model)

    # ----------------------------------------------------------------------------------------
    # Requests
    # ----------------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt, index: int) -> tuple[str, list[int]]:
        where = f"prompt {index}"
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

    def _make_sequence(self, prompt: Prompt, params: SamplingParams, index: int) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for prompt {index} must be SamplingParams, got {type(params).__name__}")
        params.validate()  # fields may have been changed after construction
        text, ids = self._prompt_ids(prompt, index)
        if not ids:
            raise ValueError(f"prompt {index} ({text!r:.40}) encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt {index} has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room "
                f"to generate (at most {self.max_model_len - 1} prompt tokens)"
            )
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        seq = Sequence(self._next_id, text, ids, params, self.tokenizer, generator, self.max_model_len)
        self._next_id += 1
        return seq

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
        return [self._make_sequence(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]

    # ----------------------------------------------------------------------------------------
    # The generation loop
    # ----------------------------------------------------------------------------------------

    def _run_batch(self, seqs: list[Sequence]) -> Iterator[list[tuple[Sequence, int]]]:
        """Run one static batch to completion, yielding ``(sequence, token)`` after each step."""
        runner = self._runner()
        now = time.perf_counter()
        for s in seqs:
            s.status = SequenceStatus.RUNNING
            s.metrics.first_scheduled_time = now
        runner.start(seqs)
        logits = runner.prefill()
        while True:
            active = list(runner.order)
            needs_history = any(s.params.repetition_penalty != 1.0 for s in active)
            tokens = sample(
                logits,
                [s.params for s in active],
                [s.generator for s in active],
                seen=[s.token_ids for s in active] if needs_history else None,
            )
            now = time.perf_counter()
            for seq, token in zip(active, tokens):
                seq.append_token(token, now)
            yield list(zip(active, tokens))
            for seq in active:
                if seq.is_finished:
                    runner.release(seq)
            if not runner.order:
                return
            logits = runner.decode()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt, in batches of up to ``max_num_seqs``; outputs keep prompt order."""
        seqs = self._make_sequences(prompts, sampling_params)
        size = self.engine_config.max_num_seqs
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(seqs), desc="generating", unit="req")
        for start in range(0, len(seqs), size):
            for step in self._run_batch(seqs[start : start + size]):
                if progress is not None:
                    progress.update(sum(seq.is_finished for seq, _ in step))
        if progress is not None:
            progress.close()
        return [s.to_output() for s in seqs]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield a ``StreamDelta`` per generated token as soon as it is sampled."""
        (seq,) = self._make_sequences([prompt], sampling_params)
        for step in self._run_batch([seq]):
            for s, token in step:
                yield StreamDelta(s.request_id, token, s.take_stream_text(), s.finish_reason)
