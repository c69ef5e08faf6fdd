"""Embeddings (`LLM.embed`): the final hidden state of each prompt's last
token, equal to transformers' on the same weights, in a mixed batch with a
shared prefix, with chunked prefill and from the prefix cache (a prompt of
whole cached blocks and one token more is planned as a decode row); and
generation and embedding requests in one step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ferrox import LLM, PoolingParams, SamplingParams
from ferrox.common import errors
from tests import models


def hf_embeddings(path: Path, prompts: list[list[int]], normalize: bool = True) -> list[np.ndarray]:
    hf = models.hf_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
            vector = hidden[0, -1].double()
            if normalize:
                vector = vector / vector.norm()
            out.append(vector.numpy())
    return out


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(2, models.VOCAB_SIZE, (12,), generator=gen).tolist()
    return [
        [*prefix, 5],  # 13 tokens: three blocks of 4 and one token more
        [*prefix, 7, 8, 9],
        torch.randint(2, models.VOCAB_SIZE, (30,), generator=gen).tolist(),
        [3],
    ]


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3"])
@pytest.mark.parametrize(
    "options", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}], ids=["whole", "chunked"]
)
def test_embeddings_match_transformers(
    tiny_models: dict[str, Path], name: str, options: dict
) -> None:
    path = tiny_models[name]
    prompts = _prompts()
    expected = hf_embeddings(path, prompts)
    llm = LLM(str(path), num_kv_blocks=128, block_size=4, **options)
    for run in range(2):  # the second run finds the prompts in the prefix cache
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == prompts
        for out, want in zip(outputs, expected, strict=True):
            got = np.asarray(out.outputs.embedding)
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, atol=2e-5)
        cached = [o.metrics.num_cached_tokens for o in outputs if o.metrics]
        if run == 1:
            assert cached[0] == 12 and cached[2] == 28
    assert llm.engine.stats().num_used_blocks == 0
    llm.engine.scheduler.check_integrity()


def test_unnormalized_embeddings_and_a_mixed_step(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama-gqa-tied"]
    prompts = _prompts()[:2]
    raw = hf_embeddings(path, prompts, normalize=False)
    llm = LLM(str(path), num_kv_blocks=128, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([prompts[1]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    embed = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(normalize=False))
    mixed = llm.generate([prompts[0], prompts[1]], [embed, greedy], use_tqdm=False)
    np.testing.assert_allclose(np.asarray(mixed[0].embedding), raw[0], rtol=1e-4, atol=1e-4)
    assert mixed[1].embedding is None and mixed[1].outputs[0].token_ids == alone
    out = llm.embed(prompts[1], PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(np.asarray(out.outputs.embedding), raw[1], rtol=1e-4, atol=1e-4)
    assert llm.engine.stats().num_used_blocks == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n": 2}, "n = 1 and max_tokens = 1"),
        ({"max_tokens": 4}, "n = 1 and max_tokens = 1"),
        ({"logprobs": 2}, "no logprobs"),
    ],
)
def test_embedding_params_are_checked(fields: dict, message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        SamplingParams(**{"max_tokens": 1, "pooling": PoolingParams(), **fields})
    with pytest.raises(errors.InvalidArgumentError, match="normalize must be a bool"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]


def test_scores_are_the_cosine_of_the_embeddings(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["llama-gqa-tied"]
    llm = LLM(str(path), num_kv_blocks=128, block_size=4)
    tok = llm.get_tokenizer()
    query, docs = "the weather", ["sunny and warm", "a recipe for bread", "the weather"]
    vectors = hf_embeddings(path, [tok.encode(t) for t in (query, *docs)])
    expected = [float(vectors[0] @ v) for v in vectors[1:]]
    one_to_many = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    assert one_to_many == pytest.approx(expected, abs=1e-5)
    assert one_to_many[2] == pytest.approx(1.0, abs=1e-6)
    pairs = llm.score([query, docs[1]], [docs[0], docs[1]], use_tqdm=False)
    assert [o.outputs.score for o in pairs] == pytest.approx([expected[0], 1.0], abs=1e-5)
    with pytest.raises(errors.InvalidArgumentError, match="give one text_1"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_embeddings_beside_speculative_decoding(tiny_models: dict[str, Path]) -> None:
    """Under n-gram speculation (prompts that repeat themselves, so drafts
    are found), embedding requests keep the state of their prompt's last
    token, cached or not, next to generating requests."""
    path = tiny_models["llama-gqa-tied"]
    prompts = [[5, 6, 7, 8] * 3 + [5], [9, 10, 11] * 5]
    expected = hf_embeddings(path, prompts)
    llm = LLM(
        str(path),
        num_kv_blocks=128,
        block_size=4,
        speculative_config={"model": "[ngram]", "num_speculative_tokens": 3},
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    embed = SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams())
    for _ in range(2):
        outs = llm.generate([*prompts, *prompts], [embed, embed, greedy, greedy], use_tqdm=False)
        for out, want in zip(outs[:2], expected, strict=True):
            np.testing.assert_allclose(np.asarray(out.embedding), want, atol=2e-5)
    assert llm.engine.stats().num_used_blocks == 0


def test_a_base_model_checkpoint_serves_embeddings_only(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """An embedding model published as its base model (Qwen3-Embedding's
    layout: `Qwen3Model`, tensor names without `model.`, no LM head) loads;
    its embeddings are transformers' `last_hidden_state`, and generation is
    refused with the reason."""
    import shutil

    from transformers import AutoModel

    source = tiny_models["qwen3"]
    hf = models.hf_model(source)
    base = hf.model
    base.config.tie_word_embeddings = False
    base.config.architectures = ["Qwen3Model"]
    base.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp_path / name)
    with torch.no_grad():
        hf_base = AutoModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    from safetensors import safe_open

    with safe_open(str(next(tmp_path.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
    assert "embed_tokens.weight" in names and not any(
        n.startswith(("model.", "lm_head")) for n in names
    )
    prompts = _prompts()
    llm = LLM(str(tmp_path), num_kv_blocks=64, block_size=4)
    assert not llm.engine.runner.model.generates
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            want = hf_base(torch.tensor([prompt])).last_hidden_state[0, -1].double()
        want = (want / want.norm()).numpy()
        np.testing.assert_allclose(np.asarray(out.outputs.embedding), want, atol=2e-5)
    with pytest.raises(errors.InvalidArgumentError, match="no LM head"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0


def _classifier(tiny_models: dict[str, Path], root: Path, num_labels: int) -> Path:
    """A tiny Qwen3ForSequenceClassification with random weights (its head
    included), saved with the tiny models' tokenizer."""
    import shutil

    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = tiny_models["qwen3"]
    config = AutoConfig.from_pretrained(source)
    config.architectures = ["Qwen3ForSequenceClassification"]
    config.num_labels = num_labels
    config.tie_word_embeddings = False
    torch.manual_seed(num_labels)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.3)
    path = root / f"classifier-{num_labels}"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path


def _hf_logits(path: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].double().numpy() for p in prompts]


@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_classifier_head_matches_transformers(
    tiny_models: dict[str, Path], tmp_path: Path, num_labels: int
) -> None:
    """*ForSequenceClassification: the head on the last token's state, as
    probabilities (a sigmoid for one label, a softmax for several) or
    logits; with one label, a cross-encoder's scores of text pairs. It
    neither embeds nor generates."""
    path = _classifier(tiny_models, tmp_path, num_labels)
    prompts = _prompts()
    logits = _hf_logits(path, prompts)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4)
    assert llm.engine.runner.model.labels is not None
    assert len(llm.engine.runner.model.labels) == num_labels
    for _ in range(2):  # the second from the prefix cache
        probs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for out, want in zip(probs, logits, strict=True):
            expected = (
                1 / (1 + np.exp(-want)) if num_labels == 1 else np.exp(want) / np.exp(want).sum()
            )
            np.testing.assert_allclose(out.outputs.probs, expected, atol=2e-5)
    raw = llm.classify(prompts[0], PoolingParams(activation=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.probs, logits[0], atol=1e-4)
    with pytest.raises(errors.InvalidArgumentError, match="sequence classifier"):
        llm.embed(prompts[0], use_tqdm=False)
    with pytest.raises(errors.InvalidArgumentError, match="no LM head"):
        llm.generate(prompts[0], SamplingParams(max_tokens=2), use_tqdm=False)
    tok = llm.get_tokenizer()
    if num_labels == 1:
        query, docs = "the weather", ["sunny and warm", "a recipe"]
        pairs = [list(tok(query, text_pair=d)["input_ids"]) for d in docs]
        want = [1 / (1 + np.exp(-x[0])) for x in _hf_logits(path, pairs)]
        scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
        assert scores == pytest.approx(want, abs=2e-5)
    else:
        with pytest.raises(errors.InvalidArgumentError, match="one label"):
            llm.score("a", "b", use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0


def test_a_model_without_a_head_does_not_classify(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama-gqa-tied"]), num_kv_blocks=64, block_size=4)
    with pytest.raises(errors.InvalidArgumentError, match="no sequence-classification head"):
        llm.classify([5, 6, 7], use_tqdm=False)


def test_vllms_runner_and_convert_options(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = tiny_models["llama-gqa-tied"]
    pooling = LLM(str(path), num_kv_blocks=64, block_size=4, runner="pooling")
    hidden = pooling.engine.hf_config.hidden_size
    assert len(pooling.embed([5, 6, 7], use_tqdm=False)[0].outputs.embedding) == hidden
    with pytest.raises(errors.InvalidArgumentError, match="runner='pooling'"):
        pooling.generate([5, 6, 7], SamplingParams(max_tokens=2), use_tqdm=False)
    generating = LLM(str(path), num_kv_blocks=64, block_size=4, runner="generate")
    with pytest.raises(errors.InvalidArgumentError, match="runner='generate'"):
        generating.embed([5, 6, 7], use_tqdm=False)
    plain = LLM(str(path), num_kv_blocks=64, block_size=4, convert="none")
    with pytest.raises(errors.InvalidArgumentError, match="convert='none'"):
        plain.embed([5, 6, 7], use_tqdm=False)
    classifier = _classifier(tiny_models, tmp_path, 1)
    with pytest.raises(errors.ModelLoadError, match="runner='generate' needs"):
        LLM(str(classifier), num_kv_blocks=64, block_size=4, runner="generate")
    served = LLM(str(classifier), num_kv_blocks=64, block_size=4, convert="none")
    assert len(served.classify([5, 6, 7], use_tqdm=False)[0].outputs.probs) == 1
    with pytest.raises(errors.InvalidArgumentError, match="not turned into a classifier"):
        LLM(str(path), convert="classify")
    with pytest.raises(errors.InvalidArgumentError, match="runner must be one of"):
        LLM(str(path), runner="draft")


def test_a_causal_lm_scores_as_a_yes_no_reranker(tiny_models: dict[str, Path]) -> None:
    """Qwen3-Reranker's way, as vLLM serves it (hf_overrides): the causal
    LM's p("yes") against p("no") at the prompt's last token becomes a
    one-label head, so classify and score give that probability."""
    path = tiny_models["qwen3"]
    hf = models.hf_model(path)
    llm_probe = LLM(str(path), num_kv_blocks=64, block_size=4)
    tok = llm_probe.get_tokenizer()
    no, yes = tok.convert_ids_to_tokens([40, 41])
    overrides = {
        "architectures": ["Qwen3ForSequenceClassification"],
        "classifier_from_token": [no, yes],
        "is_original_qwen3_reranker": True,
    }
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, hf_overrides=json.dumps(overrides))
    assert llm.engine.runner.model.labels == [yes]
    prompts = _prompts()
    got = [o.outputs.probs[0] for o in llm.classify(prompts, use_tqdm=False)]
    with torch.no_grad():
        logits = [hf(torch.tensor([p])).logits[0, -1].double() for p in prompts]
    want = [float(torch.softmax(x[[40, 41]], dim=0)[1]) for x in logits]
    assert got == pytest.approx(want, abs=2e-5)
    with pytest.raises(errors.ModelLoadError, match="two classifier_from_token"):
        LLM(str(path), hf_overrides={**overrides, "classifier_from_token": [yes]})
    with pytest.raises(errors.InvalidArgumentError, match="not valid JSON"):
        LLM(str(path), hf_overrides="{")
    with pytest.raises(errors.ModelLoadError, match="hf_overrides cannot set 'hidden_size'"):
        LLM(str(path), hf_overrides={"hidden_size": "wide"})


def test_matryoshka_dimensions(tiny_models: dict[str, Path]) -> None:
    """`dimensions` keeps an embedding's first values, then normalises;
    only where the model's config says it was trained for it."""
    path = tiny_models["llama-gqa-tied"]
    prompts = _prompts()[:2]
    raw = hf_embeddings(path, prompts, normalize=False)
    llm = LLM(str(path), num_kv_blocks=64, block_size=4, hf_overrides={"is_matryoshka": True})
    out = llm.embed(prompts, PoolingParams(dimensions=16), use_tqdm=False)
    for got, full in zip(out, raw, strict=True):
        want = full[:16] / np.linalg.norm(full[:16])
        np.testing.assert_allclose(got.outputs.embedding, want, atol=2e-5)
    hidden = llm.engine.hf_config.hidden_size
    with pytest.raises(errors.InvalidArgumentError, match=f"at most {hidden}"):
        llm.embed(prompts, PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    listed = LLM(
        str(path), num_kv_blocks=64, block_size=4, hf_overrides={"matryoshka_dimensions": [8, 32]}
    )
    assert (
        len(
            listed.embed(prompts[0], PoolingParams(dimensions=8), use_tqdm=False)[
                0
            ].outputs.embedding
        )
        == 8
    )
    with pytest.raises(errors.InvalidArgumentError, match=r"one of \[8, 32\]"):
        listed.embed(prompts[0], PoolingParams(dimensions=16), use_tqdm=False)
    plain = LLM(str(path), num_kv_blocks=64, block_size=4)
    with pytest.raises(errors.InvalidArgumentError, match="Matryoshka-trained"):
        plain.embed(prompts[0], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(errors.InvalidArgumentError, match="dimensions must be an int"):
        PoolingParams(dimensions=0)
