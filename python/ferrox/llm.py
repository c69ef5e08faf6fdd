"""LLM: the offline, synchronous API (`generate`, `chat`), vLLM-style."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
from tqdm.auto import tqdm

from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError, error_class
from ferrox.common.lora import LoRARequest
from ferrox.common.multimodal import ImageInput
from ferrox.common.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ferrox.common.pooling_params import PoolingParams, cosine, score_pairs
from ferrox.common.sampling_params import SamplingParams
from ferrox.engine.core import EngineCore
from ferrox.frontend.media import (
    ImageProcessor,
    MediaLimits,
    chat_images,
    multimodal_prompt,
    pil_images,
)
from ferrox.frontend.output_processor import OutputProcessor
from ferrox.model_files.tokenizer import speaks_harmony

PromptInput = str | Sequence[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    """An engine in this process.

    `LLM()` loads the bundled SmolLM2-135M-Instruct; `LLM(model=path, **options)`
    takes a Hugging Face directory or a .gguf file and any `EngineConfig` option
    (`max_num_seqs`, `max_num_batched_tokens`, `max_model_len`, `block_size`,
    `enable_prefix_caching`, `seed`, `dtype`, `device`, `load_format`, ...).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.create(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.engine.tokenizer)
        self._counter = itertools.count()
        self._image_processor: ImageProcessor | None = None  # loaded on the first image
        self.media_limits = MediaLimits()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start_profile(self) -> None:
        """Starts the torch profiler in the engine (needs `profiler_dir`)."""
        self.engine.start_profile()

    def stop_profile(self) -> Path:
        """Stops it; returns the Chrome trace written to `profiler_dir`."""
        return self.engine.stop_profile()

    def reset_prefix_cache(self) -> int:
        """Drops every cached prefix (blocks no request uses); returns how many."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completes each prompt (a string, a list of token ids, or a dict with
        `prompt` or `prompt_token_ids`, and for a vision-language model
        `multi_modal_data={"image": PIL image or list of them}` with a text
        prompt holding one image placeholder per image); returns outputs in
        input order. `lora_request`: the LoRA adapter of every prompt, or one
        per prompt (None: the base model); the engine needs `enable_lora=True`."""
        items = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(items))
        adapters = _as_lora_list(lora_request, len(items))
        prepared = [self._prepare(p) for p in items]
        requests = [(text, ids) for text, ids, _ in prepared]
        for (_text, ids), sp in zip(requests, params, strict=True):
            self.engine.validate(ids, sp)
        images = [imgs for _, _, imgs in prepared]
        return self._run(requests, params, use_tqdm, adapters, images)

    def _prepare(
        self, prompt: PromptInput
    ) -> tuple[str | None, list[int], list[ImageInput] | None]:
        """A prompt's text and token ids, and its images (placeholders
        expanded) when it has `multi_modal_data`."""
        text, ids = self._tokenize(prompt)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return text, ids, None
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidArgumentError(
                "multi_modal_data takes images only: {'image': a PIL image or a list of them}"
            )
        if "prompt_token_ids" in prompt:
            raise InvalidArgumentError(
                "multi_modal_data needs a text prompt (with one image placeholder per image), "
                "not prompt_token_ids"
            )
        model: Any = self.engine.runner.model
        if not getattr(model, "supports_images", False):
            raise InvalidArgumentError(
                f"this model ({type(model).__name__}) takes no images: its prompts are text only"
            )
        images = pil_images(data.get("image"), "multi_modal_data['image']")
        if self._image_processor is None:
            self._image_processor = ImageProcessor(Path(self.engine.loaded.source), in_process=True)
        processed = self._image_processor.process(images)
        assert text is not None and isinstance(prompt, dict)  # (a text prompt, checked above)
        add_special = prompt.get("add_special_tokens", True)
        ids, inputs = multimodal_prompt(
            text, self._require_tokenizer(), model.image_prompt(), processed, add_special
        )
        return text, ids, inputs

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: the final hidden state of its last token,
        unit length unless `pooling_params` says `normalize=False` (see
        `PoolingParams`); outputs in input order. The prompts are prefilled
        through the same scheduler as generation, so the prefix cache serves
        what it holds of them."""
        outputs = self._pool(prompts, pooling_params, "embed", use_tqdm)
        return [
            EmbeddingRequestOutput(
                request_id=out.request_id,
                prompt_token_ids=out.prompt_token_ids or [],
                outputs=EmbeddingOutput(embedding=cast(list[float], out.embedding)),
                metrics=out.metrics,
            )
            for out in outputs
        ]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities, from the model's
        sequence-classification head (`*ForSequenceClassification`; the
        labels are `llm.engine.runner.model.labels`): a sigmoid for one
        label, a softmax over several, or logits with `activation=False`."""
        outputs = self._pool(prompts, pooling_params, "classify", use_tqdm)
        return [
            ClassificationRequestOutput(
                request_id=out.request_id,
                prompt_token_ids=out.prompt_token_ids or [],
                outputs=ClassificationOutput(probs=cast(list[float], out.embedding)),
                metrics=out.metrics,
            )
            for out in outputs
        ]

    def _pool(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        task: Literal["embed", "classify"],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        items = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling = [pooling_params or PoolingParams()] * len(items)
        else:
            pooling = list(pooling_params)
            if len(pooling) != len(items):
                raise InvalidArgumentError(
                    f"got {len(pooling)} pooling params for {len(items)} prompts; give one, or "
                    "one per prompt"
                )
        params = [
            SamplingParams(max_tokens=1, temperature=0.0, pooling=dataclasses.replace(p, task=task))
            for p in pooling
        ]
        return self._run([self._tokenize(p) for p in items], params, use_tqdm)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """The score of each pair: `text_1` against every text of `text_2`,
        or the two lists pair by pair. With a cross-encoder (a one-label
        sequence-classification head) a score is the head's probability for
        the pair, encoded together as the tokenizer pairs two texts; with
        other models it is the cosine similarity of the texts' embeddings
        (see `embed`), each distinct text embedded once."""
        pairs = score_pairs(
            text_1 if isinstance(text_1, str) else list(text_1),
            text_2 if isinstance(text_2, str) else list(text_2),
        )
        labels = self.engine.runner.model.labels
        if labels is not None:
            scores = self._cross_encoder_scores(pairs, labels, use_tqdm)
        else:
            scores = self._cosine_scores(pairs, use_tqdm)
        return [
            ScoringRequestOutput(
                request_id=f"score-{next(self._counter)}", outputs=ScoringOutput(score)
            )
            for score in scores
        ]

    def _cross_encoder_scores(
        self, pairs: list[tuple[str, str]], labels: list[str], use_tqdm: bool
    ) -> list[float]:
        if len(labels) != 1:
            raise InvalidArgumentError(
                f"scoring needs a cross-encoder with one label; this classifier has "
                f"{len(labels)} ({labels[:4]}): use classify"
            )
        tokenizer = self._require_tokenizer()
        prompts: list[PromptInput] = [
            {"prompt_token_ids": list(tokenizer(a, text_pair=b)["input_ids"])} for a, b in pairs
        ]
        return [out.outputs.probs[0] for out in self.classify(prompts, use_tqdm=use_tqdm)]

    def _cosine_scores(self, pairs: list[tuple[str, str]], use_tqdm: bool) -> list[float]:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        vectors = {
            text: np.asarray(out.outputs.embedding, dtype=np.float64)
            for text, out in zip(texts, self.embed(texts, use_tqdm=use_tqdm), strict=True)
        }
        return [cosine(vectors[a], vectors[b]) for a, b in pairs]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of
        them (with `tools` and `chat_template_kwargs` passed to it)."""
        tokenizer = self._require_tokenizer()
        if speaks_harmony(tokenizer):
            raise InvalidArgumentError(
                "this model answers chats in OpenAI's harmony format (gpt-oss), whose channels "
                "LLM.chat does not split; use the server's chat API, which does, or "
                "LLM.generate with a prompt in that format"
            )
        if not messages:
            raise InvalidArgumentError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptInput] = []
        for conversation in conversations:
            if not conversation or not all(isinstance(m, dict) for m in conversation):
                raise InvalidArgumentError("each conversation must be a non-empty list of dicts")
            turns, images = chat_images(cast(list[Message], list(conversation)), self.media_limits)
            text = tokenizer.apply_chat_template(
                turns,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            prompt: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _require_tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer: give prompts as token ids")
        return tokenizer

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" not in prompt:
                raise InvalidArgumentError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            text = prompt["prompt"]
            add_special = prompt.get("add_special_tokens", True)
            ids = self._require_tokenizer().encode(text, add_special_tokens=add_special)
            return text, list(ids)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidArgumentError(
            "prompts must be strings, lists of token ids, or dicts with 'prompt' / "
            "'prompt_token_ids'"
        )

    def _run(
        self,
        requests: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
        adapters: list[LoRARequest | None] | None = None,
        images: list[list[ImageInput] | None] | None = None,
    ) -> list[RequestOutput]:
        ids = [f"gen-{next(self._counter)}" for _ in requests]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        engine = self.engine
        start, generated = time.perf_counter(), engine.num_generated_tokens
        try:
            for out in self.stream_outputs(
                ids, requests, params, lora_requests=adapters, images=images
            ):
                results[order[out.request_id]] = out
                bar.update(1)
                elapsed = time.perf_counter() - start
                tokens = engine.num_generated_tokens - generated
                bar.set_postfix_str(
                    f"output {tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False
                )
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def stream_outputs(
        self,
        request_ids: list[str],
        requests: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        *,
        stream: bool = False,
        lora_requests: list[LoRARequest | None] | None = None,
        images: list[list[ImageInput] | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Runs requests to the end through the one output path; yields each
        finished request's output, or (`stream`) each step's delta of each."""
        engine, processor = self.engine, self.output_processor
        adapters = lora_requests or [None] * len(requests)
        request_images = images or [None] * len(requests)
        for (_, prompt_ids), sp in zip(requests, params, strict=True):
            engine.validate(prompt_ids, sp)  # every request, before any work
        # The engine holds at most max_num_seqs + max_queued_requests of them
        # at once; the rest are added as others finish.
        bound = engine.config.max_admitted_requests
        pending = iter(zip(request_ids, requests, params, adapters, request_images, strict=True))
        added: list[str] = []

        def feed() -> None:
            while bound is None or engine.num_unfinished_requests < bound:
                item = next(pending, None)
                if item is None:
                    return
                rid, (text, prompt_ids), sp, lora, imgs = item
                state = processor.add_request(rid, text, prompt_ids, sp, stream=stream)
                added.append(rid)
                engine.add_request(
                    rid,
                    prompt_ids,
                    sp,
                    final_only=state.final_only,
                    validated=True,
                    lora_request=lora,
                    images=imgs,
                )

        try:
            feed()
            while engine.has_unfinished_requests():
                outputs, stops = processor.process(*engine.step())
                for rid, error_type, message in engine.take_failures():
                    raise error_class(error_type)(f"request {rid}: {message}")
                for stop in stops:
                    engine.stop_sequence(stop.request_id, stop.index, stop.num_output_tokens)
                yield from outputs
                feed()
        finally:
            # Nothing may linger in the engine, whatever ended the loop.
            for rid in added:
                engine.abort_request(rid)
                processor.abort(rid)


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if not items:
        raise InvalidArgumentError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [cast(list[int], items)]  # one prompt of token ids
    return cast(list[PromptInput], items)


def _as_lora_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None] | None:
    if lora is None or isinstance(lora, LoRARequest):
        return None if lora is None else [lora] * n
    items = list(lora)
    if len(items) != n:
        raise InvalidArgumentError(
            f"got {len(items)} lora requests for {n} prompts; give one, or one per prompt"
        )
    if not all(x is None or isinstance(x, LoRARequest) for x in items):
        raise InvalidArgumentError("lora_request must be LoRARequest objects (or None)")
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    items = list(params)
    if len(items) != n:
        raise InvalidArgumentError(
            f"got {len(items)} sampling params for {n} prompts; give one, or one per prompt"
        )
    if not all(isinstance(p, SamplingParams) for p in items):
        raise InvalidArgumentError("sampling_params must be SamplingParams objects")
    return items
