"""Gemma 3 with images against transformers on the same weights (its own
processor's prompts): greedy tokens equal and logprobs close whole, chunked
(the scheduler computes each image in one chunk: its tokens attend to each
other both ways), under a sliding window shorter than the prompts, and from
a prefix-cache hit that ends inside an image; text-only prompts too. What
cannot run is refused: an image longer than a step's token budget, and
images on an attention backend without bidirectional image spans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ferrox import LLM, SamplingParams
from ferrox.common.errors import InvalidArgumentError
from ferrox.common.multimodal import image_runs
from tests import models

MAX_TOKENS = 6


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


IMAGE = "<start_of_image>"
CASES: list[tuple[str, list[Any]]] = [
    (chat(IMAGE + "The quick brown fox"), [models.test_image(0, (64, 64))]),
    (
        chat("Pack my box" + IMAGE + " with five" + IMAGE + " dozen"),
        [models.test_image(1, (112, 56)), models.test_image(2)],
    ),
    (chat("def add(a, b):"), []),  # text only
]


@pytest.fixture(scope="module")
def gemma_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl") / "model")


@torch.inference_mode()
def hf_greedy(
    path: Path, text: str, images: list[Any], both_ways: bool = True
) -> tuple[list[int], list[int], list[float]]:
    """transformers' prompt ids (its processor's), greedy tokens and their
    logprobs, each step a whole forward pass (`both_ways=False`: without the
    token types, so that image tokens attend causally)."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    seq = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    prompt = seq[0].tolist()
    tokens, logprobs = [], []
    for _ in range(MAX_TOKENS):
        kinds = (seq == model.config.image_token_id).long() if both_ways else None
        out = model(input_ids=seq, token_type_ids=kinds, pixel_values=inputs.get("pixel_values"))
        step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(step.argmax())
        tokens.append(tok)
        logprobs.append(float(step[tok]))
        seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    return prompt, tokens, logprobs


@pytest.fixture(scope="module")
def expected(gemma_vl: Path) -> list[tuple[list[int], list[int], list[float]]]:
    return [hf_greedy(gemma_vl, text, images) for text, images in CASES]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def request(text: str, images: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
    if images:
        out["multi_modal_data"] = {"image": images}
    return out


def assert_matches(outputs: list[Any], expected: list[Any]) -> None:
    for out, (prompt, tokens, logprobs) in zip(outputs, expected, strict=True):
        assert out.prompt_token_ids == prompt  # the processor's layout of each image
        seq = out.outputs[0]
        assert seq.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids, strict=True)]
        np.testing.assert_allclose(got, logprobs, atol=2e-3, rtol=1e-3)


def test_the_oracle_tells_both_ways_from_causal(gemma_vl: Path, expected: list[Any]) -> None:
    """Image tokens attending causally would change the logprobs well past
    the tolerance, and the prompts outgrow the local layers' window."""
    text, images = CASES[0]
    _, _, causal = hf_greedy(gemma_vl, text, images, both_ways=False)
    assert np.abs(np.subtract(causal, expected[0][2])).max() > 0.02
    assert len(expected[0][0]) > 24


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        # 20-token steps: each 16-token image waits for a chunk of its own.
        dict(max_num_batched_tokens=20, max_num_seqs=4, block_size=4),
        dict(attention_backend="torch", max_num_batched_tokens=20, max_num_seqs=4, block_size=4),
    ],
    ids=["one-batch", "chunked", "torch-backend-chunked"],
)
def test_gemma3_images_match_transformers(
    gemma_vl: Path, expected: list[Any], options: dict[str, Any]
) -> None:
    llm = LLM(str(gemma_vl), max_model_len=256, **options)
    outputs = llm.generate([request(t, i) for t, i in CASES], greedy(), use_tqdm=False)
    assert_matches(outputs, expected)
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


def test_a_prefix_hit_inside_an_image_resumes_it(gemma_vl: Path, expected: list[Any]) -> None:
    text, images = CASES[0]
    llm = LLM(str(gemma_vl), max_model_len=256, block_size=8)
    first = llm.generate(request(text, images), greedy(), use_tqdm=False)[0]
    ((offset, length),) = image_runs(first.prompt_token_ids, llm.engine.runner.model.image_token_id)
    # The same image and text, then other words: the hit ends at a block
    # boundary before the prompts part, inside the image here.
    other = text.replace("The quick brown fox", "Zebra")
    later = llm.generate(request(other, images), greedy(), use_tqdm=False)[0]
    hit = later.metrics.num_cached_tokens
    assert offset < hit < offset + length, (offset, length, hit)
    assert_matches([later], [hf_greedy(gemma_vl, other, images)])


def test_what_cannot_run_is_refused(gemma_vl: Path) -> None:
    text, images = CASES[0]
    llm = LLM(str(gemma_vl), max_model_len=256, max_num_batched_tokens=12, max_num_seqs=4)
    with pytest.raises(InvalidArgumentError, match="max_num_batched_tokens=12"):
        llm.generate(request(text, images), greedy(), use_tqdm=False)
    assert llm.engine.stats().num_used_blocks == 0
    assert llm.generate(request(chat("hi"), []), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # (the fused layers attend causally: image rows need the module path's mask)
    with pytest.raises(InvalidArgumentError, match="attend both ways"):
        LLM(str(gemma_vl), max_model_len=256, batch_invariant=True, quantization="q8_0")

    from transformers import AutoConfig

    from ferrox.layers.attention.torch_backend import TorchAttentionBackend
    from ferrox.models.gemma3 import Gemma3ForConditionalGeneration

    class Causal(TorchAttentionBackend):
        name = "causal-only"
        supports_image_spans = False

    config = Gemma3ForConditionalGeneration.language_config(AutoConfig.from_pretrained(gemma_vl))
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config, Causal)
    assert model.image_refusal is not None and "'causal-only'" in model.image_refusal


def test_chat_with_an_image_part_matches_generate(gemma_vl: Path, expected: list[Any]) -> None:
    """The chat template writes `<start_of_image>`; the frontend writes the
    image out as the processor does (the server's path, with its processor
    in a child process)."""

    from ferrox.common import protocol as p
    from ferrox.frontend.media import ImageProcessor, run_processor

    llm = LLM(str(gemma_vl), max_model_len=256)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": CASES[0][1][0]},
                {"type": "text", "text": "The quick brown fox"},
            ],
        }
    ]
    assert_matches([llm.chat(messages, greedy(), use_tqdm=False)[0]], expected[:1])
    layout = llm.engine.runner.model.image_prompt()
    ready = p.Ready("m", 256, 10, 8, 4, 0.0, "cpu", "float32", "float32", image_prompt=layout)
    decoded = p.output_decoder.decode(p.encoder.encode(ready))
    assert isinstance(decoded, p.Ready) and decoded.image_prompt == layout
    child = ImageProcessor(gemma_vl, in_process=False)
    try:
        (remote,) = child.process(CASES[0][1])
    finally:
        child.close()
    from transformers import AutoImageProcessor

    (local,) = run_processor(AutoImageProcessor.from_pretrained(gemma_vl), CASES[0][1])
    assert remote.grid == local.grid == [] and remote.tokens == local.tokens == 0
    np.testing.assert_array_equal(remote.pixels, local.pixels)
