"""The pooling routes: `POST /v1/embeddings`, `POST /v1/score` and
`POST /v1/rerank` (also at `/rerank` and `/v2/rerank`, the Jina and Cohere
shape).

Every input is an embedding request through the same scheduler as
generation (one prefill, the prefix cache applies): the final hidden state
of its last token, scaled to unit length (see `PoolingParams`). A score is
the cosine similarity of two inputs' embeddings (a bi-encoder's score),
which for unit vectors is their dot product; rerank orders the documents
by their score against the query. Cross-encoder scoring (a
sequence-classification head) is not served.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ferrox.common.errors import InvalidArgumentError
from ferrox.common.pooling_params import PoolingParams, score_pairs
from ferrox.common.sampling_params import SamplingParams, check_priority
from ferrox.server import openai_protocol as op
from ferrox.server.request_translation import prompt_list
from ferrox.server.serving import OpenAIServing

_EMBED = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams())


class ScoreRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/score``: one text against others, or pairs."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
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

    async def _embed(
        self,
        http: Request,
        inputs: list[str | list[int]],
        priority: int,
        admitted: list[int],
        *,
        param: str = "input",
        add_special_tokens: bool = True,
    ) -> tuple[list[list[float]], int]:
        """Each input's embedding, and the prompt tokens they took."""
        try:
            check_priority(priority)
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
        base = op.random_id("embd")
        runs = [
            self.serving.new_run(f"{base}-{i}", ids, _Fields(priority), params=_EMBED)
            for i, ids in enumerate(prompts)
        ]
        await self.serving.run_all(http, runs)
        vectors = []
        for i, run in enumerate(runs):
            if run.state.embedding is None:
                raise RuntimeError(f"the engine returned no embedding for input {i}")
            vectors.append(run.state.embedding)
        return vectors, sum(len(ids) for ids in prompts)

    # ---- /v1/embeddings ----------------------------------------------------------

    async def embeddings(self, http: Request) -> Response:
        async def build(body: bytes, admitted: list[int]) -> Response:
            req = self.serving.decode(body, op.EmbeddingRequest)
            if (missing := self.serving.check_model(req.model)) is not None:
                return missing
            if req.dimensions is not None:
                raise op.BadRequest(
                    "dimensions is not supported: embeddings have the model's hidden size",
                    param="dimensions",
                )
            inputs = prompt_list(req.input, "input")
            vectors, tokens = await self._embed(
                http, inputs, req.priority, admitted, add_special_tokens=req.add_special_tokens
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
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            inputs: list[str | list[int]] = list(texts)
            vectors, tokens = await self._embed(
                http, inputs, req.priority, admitted, param="text_2"
            )
            by_text = dict(zip(texts, vectors, strict=True))
            data = [
                {"index": i, "object": "score", "score": _cosine(by_text[a], by_text[b])}
                for i, (a, b) in enumerate(pairs)
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
            inputs: list[str | list[int]] = [req.query, *req.documents]
            vectors, tokens = await self._embed(
                http, inputs, req.priority, admitted, param="documents"
            )
            query, documents = vectors[0], vectors[1:]
            scores = [_cosine(query, document) for document in documents]
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


class _Fields(msgspec.Struct):
    """The request fields a run reads besides its sampling parameters."""

    priority: int = 0


def _cosine(a: list[float], b: list[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-12))


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _json(value: Any) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


__all__ = ["PoolingServing", "RerankRequest", "ScoreRequest"]
