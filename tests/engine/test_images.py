"""Images in prompts (Qwen2.5-VL) against transformers on the same weights:
greedy tokens equal and logprobs close with one and with several images,
in a batch, chunked across the image tokens and under preemption; the
prefix cache serves the same image behind the same text and never another
image behind the same placeholders; the encoder runs once per image while
its output is cached; bad inputs are refused and leave nothing behind."""

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

MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# (prompt text, images): one image, two of different sizes, text around them.
CASES: list[tuple[str, list[Any]]] = [
    (chat(IMAGE + "The quick brown fox"), [models.test_image(0)]),
    (
        chat("Pack my box" + IMAGE + " with" + IMAGE + " five"),
        [models.test_image(1, (112, 56)), models.test_image(2)],
    ),
    (chat(IMAGE + "def add(a, b):"), [models.test_image(3, (56, 56))]),
]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_tiny_vl_model(tmp_path_factory.mktemp("qwen2.5-vl") / "model")


@pytest.fixture(scope="module")
def hf_vl(vl_model: Path) -> Any:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_model, dtype=torch.float32).eval()


def hf_inputs(
    path: Path, text: str, images: list[Any]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """transformers' own inputs: the tokenizer's ids with each placeholder
    repeated for its image (as the model's processor does), and the image
    processor's rows and grids."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    processed = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    pad = tokenizer.convert_tokens_to_ids(models.VL_IMAGE_TOKEN)
    grids = processed["image_grid_thw"].tolist()
    ids: list[int] = []
    for t in tokenizer(text, add_special_tokens=False)["input_ids"]:
        ids += [pad] * (int(np.prod(grids.pop(0))) // 4) if t == pad else [t]
    return ids, dict(processed)


@torch.inference_mode()
def hf_greedy_vl(
    model: Any, path: Path, text: str, images: list[Any]
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, each step a whole forward pass."""
    ids, processed = hf_inputs(path, text, images)
    pad = model.config.image_token_id
    seq = torch.tensor([ids])
    tokens, logprobs = [], []
    for _ in range(MAX_TOKENS):
        out = model(input_ids=seq, mm_token_type_ids=(seq == pad).int(), **processed)
        step = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(step.argmax())
        tokens.append(tok)
        logprobs.append(float(step[tok]))
        seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    return tokens, logprobs


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def request(text: str, images: list[Any]) -> dict[str, Any]:
    return {"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": images}}


def assert_matches(outputs: list[Any], expected: list[tuple[list[int], list[float]]]) -> None:
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        seq = out.outputs[0]
        assert seq.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids, strict=True)]
        np.testing.assert_allclose(got, logprobs, atol=2e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def expected(vl_model: Path, hf_vl: Any) -> list[tuple[list[int], list[float]]]:
    return [hf_greedy_vl(hf_vl, vl_model, text, images) for text, images in CASES]


@pytest.mark.parametrize(
    ("label", "options"),
    [
        ("one-batch", dict()),
        # 16-token steps split every image's placeholders over chunks.
        ("chunked-prefill", dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)),
        (
            "preemption",
            dict(
                num_kv_blocks=12,
                block_size=8,
                max_model_len=64,
                max_num_batched_tokens=32,
                max_num_seqs=4,
            ),
        ),
    ],
)
def test_images_match_transformers(
    vl_model: Path, expected: list[Any], label: str, options: dict[str, Any]
) -> None:
    llm = LLM(str(vl_model), **{"max_model_len": 256, **options})
    outputs = llm.generate([request(t, i) for t, i in CASES], greedy(), use_tqdm=False)
    assert_matches(outputs, expected)
    for out, (_text, images) in zip(outputs, CASES, strict=True):
        spans = image_runs(out.prompt_token_ids, llm.engine.runner.model.image_token_id)
        assert len(spans) == len(images)  # the placeholders, expanded
    stats = llm.engine.stats()
    if label == "preemption":
        assert stats.num_preemptions > 0
    assert stats.num_used_blocks == 0  # nothing held past the requests
    assert llm.engine._num_image_requests == 0  # (steps build no image inputs any more)
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


@pytest.mark.parametrize(
    "family", ["qwen2-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3.5-vl", "qwen3.5-moe-vl"]
)
def test_other_qwen_vl_families_match_transformers(tmp_path: Path, family: str) -> None:
    """Qwen2-VL's tower (LayerNorms, QuickGELU, no windows), Qwen3-VL's
    (learned positions, DeepStack into the first decoder layers, interleaved
    M-RoPE; Qwen3-VL-MoE's over the experts' decoder) and Qwen3.5's (the
    hybrid decoder, partial M-RoPE), whole and chunked across the image
    tokens, and again from the prefix cache (for Qwen3.5: from its state
    snapshots)."""
    from transformers import AutoModelForImageTextToText

    path = models.build_tiny_vl_model(tmp_path / family, family=family)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy_vl(hf, path, text, images) for text, images in CASES]
    for options in (dict(), dict(max_num_batched_tokens=16, max_num_seqs=4, block_size=4)):
        llm = LLM(str(path), max_model_len=256, **options)
        outputs = llm.generate([request(t, i) for t, i in CASES], greedy(), use_tqdm=False)
        assert_matches(outputs, expected)
    again = llm.generate([request(t, i) for t, i in CASES], greedy(), use_tqdm=False)
    assert_matches(again, expected)
    assert (
        sum(o.metrics.num_cached_tokens for o in again)
        > sum(len(o.prompt_token_ids) for o in again) // 2
    )
    assert llm.engine.stats().num_used_blocks == 0


def test_qwen3_vl_moe_reads_the_original_releases_stacked_experts(tmp_path: Path) -> None:
    """The original release stacks the experts transposed ([experts, in,
    out]); transformers 5 saves [experts, out, in]: both load the same."""
    import json

    from safetensors.torch import load_file, save_file

    path = models.build_tiny_vl_model(tmp_path / "moe", family="qwen3-vl-moe")
    text, images = CASES[0]
    new = LLM(str(path), max_model_len=256).generate(
        request(text, images), greedy(), use_tqdm=False
    )[0]
    tensors = load_file(path / "model.safetensors")
    stacked = [k for k in tensors if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert stacked
    for key in stacked:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"transformers_version": "4.57.1"}))
    old = LLM(str(path), max_model_len=256).generate(
        request(text, images), greedy(), use_tqdm=False
    )[0]
    assert old.outputs[0].token_ids == new.outputs[0].token_ids


def test_a_step_encodes_within_its_encoder_budget(
    vl_model: Path, hf_vl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's chunks start at most `max_num_batched_tokens` image rows
    (or one image larger than that): a first chunk that reaches the first
    token of a prompt's third image would start 40 rows in a step of fewer
    tokens, so it stops before that image."""
    text = chat(IMAGE * 3 + "The quick brown fox")
    images = [models.test_image(0), models.test_image(1), models.test_image(2, (112, 112))]
    probe = LLM(str(vl_model), max_model_len=256)
    ids = probe.generate(request(text, images), greedy(), use_tqdm=False)[0].prompt_token_ids
    runs = image_runs(ids, probe.engine.runner.model.image_token_id)
    step = runs[2][0] + 1  # the first chunk ends just past the third image's start
    assert sum(n for _, n in runs) > step
    llm = LLM(str(vl_model), max_model_len=256, max_num_batched_tokens=step, max_num_seqs=4)
    model = llm.engine.runner.model
    calls: list[list[int]] = []
    encode = model.encode_images

    def counted(pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        calls.append([model.image_tokens(g) for g in grids])
        return encode(pixels, grids)

    monkeypatch.setattr(model, "encode_images", counted)
    out = llm.generate(request(text, images), greedy(), use_tqdm=False)
    assert_matches(out, [hf_greedy_vl(hf_vl, vl_model, text, images)])
    assert calls == [[12, 12], [16]], calls


def test_the_prefix_cache_tells_images_apart(vl_model: Path, expected: list[Any]) -> None:
    text, images = CASES[0]
    llm = LLM(str(vl_model), max_model_len=256, block_size=4)
    first = llm.generate(request(text, images), greedy(), use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    offset, length = image_runs(first.prompt_token_ids, llm.engine.runner.model.image_token_id)[0]
    # The same image again: the cache serves the prompt past the image.
    again = llm.generate(request(text, images), greedy(), use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > offset + length
    assert_matches([again], expected[:1])
    assert llm.engine.runner.encoder_cache.num_encoded == 1
    # Another image behind the same text: only the tokens before it hit.
    other = llm.generate(request(text, [models.test_image(9)]), greedy(), use_tqdm=False)[0]
    assert other.metrics.num_cached_tokens <= offset
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.engine.runner.encoder_cache.num_encoded == 2


def test_chat_with_image_parts_matches_generate(vl_model: Path, expected: list[Any]) -> None:
    import base64
    import io

    buffer = io.BytesIO()
    models.test_image(0).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(str(vl_model), max_model_len=256)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "The quick brown fox"},
            ],
        }
    ]
    out = llm.chat(messages, greedy(), use_tqdm=False)[0]
    assert_matches([out], expected[:1])
    pil = [
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": models.test_image(0)},
                {"type": "text", "text": "The quick brown fox"},
            ],
        }
    ]
    assert llm.chat(pil, greedy(), use_tqdm=False)[0].outputs[0].token_ids == expected[0][0]


def test_bad_image_requests_are_refused_and_leave_nothing(
    vl_model: Path, tiny_models: dict[str, Path]
) -> None:
    llm = LLM(str(vl_model), max_model_len=256, limit_mm_per_prompt={"image": 2})
    text, images = CASES[0]
    bad: list[tuple[Any, Any, str]] = [
        (request(text, images + images), greedy(), "placeholders .* for 2 images"),
        (request(chat("no image here"), images), greedy(), "0 image placeholders .* for 1 images"),
        (request(chat(IMAGE * 3), images * 3), greedy(), "limit_mm_per_prompt"),
        (request(text, ["not an image"]), greedy(), "must be a PIL image"),
        ({"prompt": text, "multi_modal_data": {"video": images}}, greedy(), "images only"),
        (
            {"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": images}},
            greedy(),
            "needs a text prompt",
        ),
        (request(text, images), SamplingParams(max_tokens=2, prompt_logprobs=1), "prompt_logprobs"),
    ]
    for prompt, params, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_waiting == 0 and stats.num_running == 0
    # The engine still serves.
    assert llm.generate(request(text, images), greedy(), use_tqdm=False)[0].outputs[0].token_ids
    text_only = LLM(str(tiny_models["llama-gqa-tied"]))
    with pytest.raises(InvalidArgumentError, match="takes no images"):
        text_only.generate(request(text, images), greedy(), use_tqdm=False)


def test_the_engine_checks_images_it_is_given(vl_model: Path) -> None:
    """The engine's own checks (a frontend could send anything)."""
    from ferrox.common.multimodal import image_input

    llm = LLM(str(vl_model), max_model_len=256)
    engine = llm.engine
    image_id = engine.runner.model.image_token_id
    pixels = np.zeros((48, 1176), dtype=np.float32)
    ids = [5] + [image_id] * 12 + [6]
    bad = [
        ([image_input(pixels, [1, 8, 6], 1, 11)], "takes 12 placeholder"),
        ([image_input(pixels, [1, 8, 5], 1, 12)], "multiple of the merge size"),
        ([image_input(pixels[:40], [1, 8, 6], 1, 12)], "pixel values have shape"),
        ([image_input(pixels, [1, 8, 6], 0, 12)], "not all the image token"),
        ([image_input(pixels, [1, 8, 6], 4, 12)], "leave the prompt"),
    ]
    for images, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            engine.add_request("r", ids, greedy(), images=images)
    engine.add_request("ok", ids, greedy(), images=[image_input(pixels, [1, 8, 6], 1, 12)])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_used_blocks == 0


def test_quantized_decoder_under_a_float_vision_tower(vl_model: Path, hf_vl: Any) -> None:
    """quantization=q8_0 rounds the decoder's linear layers (and the CPU's
    fused decode runs them); the vision tower stays in float. The reference:
    transformers with the decoder's weights and their inputs rounded as the
    block kernel rounds them."""
    from ferrox.layers.quant_linear import QuantLinear, dequantize, quantize

    # (a float32 KV cache: blocks default to a float16 one)
    llm = LLM(str(vl_model), max_model_len=256, quantization="q8_0", kv_cache_dtype="float32")
    model = llm.engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    # The integer kernel at every row count (the reference rounds as it
    # does): on a CPU with AMX tiles the prompts' step would take them.
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.batch_invariant = True
    assert not any(isinstance(m, QuantLinear) for m in model.visual.modules())
    assert model.fused_decode is not None
    outputs = llm.generate([request(t, i) for t, i in CASES], greedy(), use_tqdm=False)
    hooks = []
    with torch.no_grad():
        saved = {}
        for name, module in hf_vl.named_modules():
            if isinstance(module, torch.nn.Linear) and ".visual." not in f".{name}":
                saved[name] = module.weight.detach().clone()
                w = module.weight
                w.copy_(dequantize(quantize(w, "q8_0"), "q8_0", module.in_features))
                hooks.append(
                    module.register_forward_pre_hook(
                        lambda _, args: (models.round_like_the_block_kernel(args[0]),)
                    )
                )
    try:
        expected = [hf_greedy_vl(hf_vl, vl_model, text, images) for text, images in CASES]
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for name, module in hf_vl.named_modules():
                if name in saved:
                    module.weight.copy_(saved[name])
    for out, (tokens, logprobs) in zip(outputs, expected, strict=True):
        seq = out.outputs[0]
        assert seq.token_ids == tokens
        got = [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids, strict=True)]
        # Summation order moves an activation across a rounding step now and
        # then; this model's large weights carry that further than the text
        # models' 0.03. A wrong scale or block moves logprobs by whole units.
        np.testing.assert_allclose(got, logprobs, atol=0.1)
