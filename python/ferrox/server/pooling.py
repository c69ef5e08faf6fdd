"""The pooling routes: `POST /v1/embeddings`, `POST /v1/classify`,
`POST /v1/score` and `POST /v1/rerank` (also at `/rerank` and `/v2/rerank`,
the Jina and Cohere shape).

Every input is a pooling request through the same scheduler as generation
(one prefill, the prefix cache applies) whose output is computed from the
final hidden state of its last token (see `PoolingParams`): an embedding
(that state, unit length) or, for a model with a sequence-classification
head, the head's probabilities. A score is, with a cross-encoder (a
one-label head), the head's probability for the pair, encoded together as
the tokenizer pairs two texts; with other models the cosine similarity of
the two texts' embeddings (a bi-encoder's score). Rerank orders the
documents by their score against the query.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.pooling_params import PoolingParams, cosine, score_pairs
from ferrox.common.sampling_params import SamplingParams, check_priority
from ferrox.server import openai_protocol as op
from ferrox.server.request_translation import prompt_list
from ferrox.server.serving import OpenAIServing

_PARAMS = {
    task: SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(task=task))
    for task in ("embed", "classify")
}


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/score``: one text against others, or pairs."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    priority: int = 0


class ClassifyRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/classify``."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    add_special_tokens: bool = True
    priority: int = 0


class RerankRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/rerank``, as Jina and Cohere define it."""

    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    priority: int = 0


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.ctx = serving.ctx

    async def _pool(
        self,
        http: Request,
        inputs: list[str | list[int]],
        req: Any,
        admitted: list[int],
        *,
        task: str = "embed",
        param: str = "input",
        add_special_tokens: bool = True,
        dimensions: int | None = None,
    ) -> tuple[list[list[float]], int]:
        """Each input's pooled output (an embedding, or a classifier's
        probabilities), and the prompt tokens they took. `req`: the decoded
        request (its `priority` is read)."""
        try:
            check_priority(req.priority)
        except InvalidArgumentError as exc:
            raise op.BadRequest(str(exc), param="priority") from exc
        if len(inputs) > self.ctx.limits.max_prompts:
            raise op.BadRequest(
                f"{param} may hold at most {self.ctx.limits.max_prompts} inputs, got {len(inputs)}",
                param=param,
            )
        self.ctx.admit(len(inputs))
        admitted.append(len(inputs))
        encode = self.ctx.tokenizer.encode

        def ids_of(item: str | list[int]) -> list[int]:
            if isinstance(item, str):
                return list(encode(item, add_special_tokens=add_special_tokens))
            self.serving.detokenize(item, param=param)  # checks the ids' range
            return list(item)

        size = sum(len(item) for item in inputs)
        prompts = await self.serving.offload(size, lambda: [ids_of(item) for item in inputs])
        for ids in prompts:
            if not ids:
                raise op.BadRequest(f"{param} holds a text of no tokens", param=param)
            if len(ids) >= self.ctx.max_model_len:
                raise op.ContextLengthBadRequest(
                    f"an input has {len(ids)} tokens; this model embeds at most "
                    f"{self.ctx.max_model_len - 1}",
                    param=param,
                )
        params = _PARAMS[task]
        if dimensions is not None:
            pooling = PoolingParams(task="embed", dimensions=dimensions)
            params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        base = op.random_id("embd")
        runs = [
            self.serving.new_run(f"{base}-{i}", ids, req, params=params)
            for i, ids in enumerate(prompts)
        ]
        try:
            await self.serving.run_all(http, runs)
        except InvalidArgumentError as e:
            # The engine checks dimensions against the model's config; its
            # messages start with the field's name.
            if dimensions is not None and str(e).startswith("dimensions"):
                raise op.BadRequest(str(e), param="dimensions") from e
            raise
        vectors = []
        for i, run in enumerate(runs):
            if run.state.embedding is None:
                raise RuntimeError(f"the engine returned no pooled output for input {i}")
            vectors.append(run.state.embedding)
        return vectors, sum(len(ids) for ids in prompts)

    # ---- /v1/embeddings ----------------------------------------------------------

    async def embeddings(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            req = self.serving.decode(body, op.EmbeddingRequest)
            if (missing := self.serving.check_model(req.model)) is not None:
                return missing
            if req.dimensions is not None and (req.dimensions < 1 or req.dimensions >= 1 << 31):
                raise op.BadRequest(
                    f"dimensions must be at least 1, got {req.dimensions}", param="dimensions"
                )
            self._require(classifier=False)
            inputs = prompt_list(req.input, "input")
            vectors, tokens = await self._pool(
                http,
                inputs,
                req,
                admitted,
                add_special_tokens=req.add_special_tokens,
                dimensions=req.dimensions,
            )
            data = [
                op.EmbeddingData(index=i, embedding=_encoded(vector, req.encoding_format))
                for i, vector in enumerate(vectors)
            ]
            response = op.EmbeddingResponse(
                data=data,
                model=req.model or self.ctx.model_name,
                usage=op.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            )
            return _json(response)

        return await self.serving.handle(http, build)

    # ---- /v1/classify ------------------------------------------------------------

    async def classify(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            req = self.serving.decode(body, ClassifyRequest)
            if (missing := self.serving.check_model(req.model)) is not None:
                return missing
            labels = self._require(classifier=True)
            inputs = prompt_list(req.input, "input")
            probs, tokens = await self._pool(
                http,
                inputs,
                req,
                admitted,
                task="classify",
                add_special_tokens=req.add_special_tokens,
            )
            data = [
                {
                    "index": i,
                    "label": labels[int(np.argmax(p))],
                    "probs": p,
                    "num_classes": len(labels),
                }
                for i, p in enumerate(probs)
            ]
            return _json(
                {
                    "id": op.random_id("classify"),
                    "object": "list",
                    "model": req.model or self.ctx.model_name,
                    "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await self.serving.handle(http, build)

    def _require(self, *, classifier: bool) -> list[str]:
        """The classifier's labels, or a 400 where the route needs the other
        kind of model."""
        labels = self.ctx.labels
        if classifier and labels is None:
            raise op.BadRequest(
                "this model has no sequence-classification head: it serves /v1/embeddings, and "
                "/v1/score and /v1/rerank by the cosine of embeddings",
                param="model",
            )
        if not classifier and labels is not None:
            raise op.BadRequest(
                "this model is a sequence classifier (a cross-encoder): it serves /v1/classify, "
                "/v1/score and /v1/rerank, not embeddings",
                param="model",
            )
        return labels or []

    async def _scores(
        self,
        http: Request,
        pairs: list[tuple[str, str]],
        req: Any,
        admitted: list[int],
        param: str,
    ) -> tuple[list[float], int]:
        """Each pair's score (see the module's docstring), and the tokens it took."""
        labels = self.ctx.labels
        if labels is None:
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            inputs: list[str | list[int]] = list(texts)
            vectors, tokens = await self._pool(http, inputs, req, admitted, param=param)
            by_text = dict(zip(texts, vectors, strict=True))
            return [cosine(by_text[a], by_text[b]) for a, b in pairs], tokens
        if len(labels) != 1:
            raise op.BadRequest(
                f"scoring needs a cross-encoder with one label; this classifier has "
                f"{len(labels)}: use /v1/classify",
                param=param,
            )
        tokenizer = self.ctx.tokenizer
        size = sum(len(a) + len(b) for a, b in pairs)
        encoded: list[str | list[int]] = await self.serving.offload(
            size, lambda: [list(tokenizer(a, text_pair=b)["input_ids"]) for a, b in pairs]
        )
        probs, tokens = await self._pool(http, encoded, req, admitted, task="classify", param=param)
        return [p[0] for p in probs], tokens

    # ---- /v1/score ---------------------------------------------------------------

    async def score(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            req = self.serving.decode(body, ScoreRequest)
            if (missing := self.serving.check_model(req.model)) is not None:
                return missing
            try:
                pairs = score_pairs(req.text_1, req.text_2)
            except InvalidArgumentError as exc:
                raise op.BadRequest(str(exc), param="text_2") from exc
            scores, tokens = await self._scores(http, pairs, req, admitted, "text_2")
            data = [
                {"index": i, "object": "score", "score": score} for i, score in enumerate(scores)
            ]
            return _json(
                {
                    "id": op.random_id("score"),
                    "object": "list",
                    "model": req.model or self.ctx.model_name,
                    "data": data,
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )

        return await self.serving.handle(http, build)

    # ---- /v1/rerank --------------------------------------------------------------

    async def rerank(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            req = self.serving.decode(body, RerankRequest)
            if (missing := self.serving.check_model(req.model)) is not None:
                return missing
            if not req.documents:
                raise op.BadRequest("documents must not be empty", param="documents")
            if req.top_n is not None and req.top_n < 1:
                raise op.BadRequest(f"top_n must be at least 1, got {req.top_n}", "top_n")
            pairs = [(req.query, document) for document in req.documents]
            scores, tokens = await self._scores(http, pairs, req, admitted, "documents")
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
            results: list[dict[str, Any]] = []
            for i in order:
                result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
                if req.return_documents:
                    result["document"] = {"text": req.documents[i]}
                results.append(result)
            return _json(
                {
                    "id": op.random_id("rerank"),
                    "model": req.model or self.ctx.model_name,
                    "usage": {"total_tokens": tokens},
                    "results": results,
                }
            )

        return await self.serving.handle(http, build)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _json(value: Any) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


__all__ = ["PoolingServing", "RerankRequest", "ScoreRequest"]
