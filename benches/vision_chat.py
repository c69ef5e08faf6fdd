"""One-image chats on a random-weight Qwen2.5-VL or Gemma 3, ferrox against
transformers on the same weights, in one process:

- TTFT: a one-image chat from its image to its first token (the image
  processor, the vision encoder, the prefill), a fresh image each repeat;
- second turn: the same chat again, its image and prompt now in ferrox's
  prefix cache (transformers has no cache across calls: its figure is the
  first turn's);
- output tok/s: 1 and 8 streams (8 different images), 64 new tokens each,
  generated tokens over the whole time.

    python benches/vision_chat.py [--repeats 3] [--shape small|3b|gemma3]
        [--quantization q8_0] [--json FILE]

`--shape small` (default): a decoder of Qwen2.5-0.5B's size (hidden 896, 24
layers, MLP 4864, vocabulary 151,936) with Qwen2.5-VL's heads of 128 (7
query / 1 KV heads, M-RoPE sections 16 / 24 / 24) under a
reduced vision tower (8 blocks of 640, 10 heads, MLP 1280; blocks 3 and 7
over the whole image), 336 x 336 images (576 patches, 144 image tokens).
`3b`: Qwen2.5-VL-3B's shapes (decoder hidden 2048, 36 layers; vision 32
blocks of 1280). `gemma3`: Gemma 3 with a decoder of Gemma 3 1B's size
(hidden 1152, 26 layers of 4 query / 1 KV heads of 256, five local layers
of a 512-token window to one global, MLP 6912, vocabulary 262,144) under
a reduced SigLIP tower (8 blocks of 768, 12 heads, MLP 3072) over 448 x
448 images (1024 patches pooled to Gemma's 256 image tokens, which attend
to each other both ways). Float32 weights; `--quantization q8_0` gives ferrox's
decoder Q8_0 blocks (its vision tower stays float) while transformers keeps
float32, so that figure compares what a CPU user runs, not the same
numerics. Prints medians (min-max) over the repeats and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrox import LLM, SamplingParams  # isort: skip  (before torch)
import torch

from machine import cpu_description, write_record  # isort: skip

# The random-weight model comes from the tests' builder (its tokenizer,
# processor and chat template).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import models  # isort: skip

SHAPES: dict[str, tuple[dict[str, Any], dict[str, Any], int]] = {
    "small": (
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=7,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
        ),
        dict(
            depth=8,
            hidden_size=640,
            intermediate_size=1280,
            num_heads=10,
            out_hidden_size=896,
            window_size=112,
            fullatt_block_indexes=[3, 7],
        ),
        336,
    ),
    "3b": (
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "mrope_section": [16, 24, 24],
            },
        ),
        dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        336,
    ),
    "gemma3": (
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            layer_types=[
                "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(26)
            ],
            max_position_embeddings=4096,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=12,
            image_size=448,
            patch_size=14,
        ),
        448,
    ),
}
NEW_TOKENS = 64
QWEN_TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the chart."
    "<|im_end|>\n<|im_start|>assistant\n"
)
GEMMA_TEXT = (
    "<start_of_turn>user\n<start_of_image>Describe the chart.<end_of_turn>\n<start_of_turn>model\n"
)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


class Transformers:
    """The reference: the model's processor inputs and transformers' forward
    and generate on the same weights."""

    def __init__(self, path: Path, gemma: bool) -> None:
        from transformers import (
            AutoImageProcessor,
            AutoModelForImageTextToText,
            AutoProcessor,
            AutoTokenizer,
        )

        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.gemma = gemma
        self.processor = (AutoProcessor if gemma else AutoImageProcessor).from_pretrained(path)
        self.pad = self.model.config.image_token_id

    def inputs(self, images: list[Any]) -> dict[str, torch.Tensor]:
        if self.gemma:  # its processor writes the prompt too (and the token types)
            texts, nested = [GEMMA_TEXT] * len(images), [[i] for i in images]
            return dict(self.processor(text=texts, images=nested, return_tensors="pt"))
        processed = self.processor(images=images, return_tensors="pt")
        tokens = int(processed["image_grid_thw"][0].prod()) // 4
        ids: list[int] = []
        for t in self.tokenizer(QWEN_TEXT, add_special_tokens=False)["input_ids"]:
            ids += [t] * tokens if t == self.pad else [t]
        batch = torch.tensor([ids] * len(images))
        return dict(
            input_ids=batch,
            attention_mask=torch.ones_like(batch),
            mm_token_type_ids=(batch == self.pad).int(),
            **processed,
        )

    @torch.inference_mode()
    def ttft(self, image: Any) -> float:
        start = time.perf_counter()
        inputs = self.inputs([image])
        inputs.pop("attention_mask")
        self.model(**inputs).logits[0, -1].argmax()
        return time.perf_counter() - start

    @torch.inference_mode()
    def throughput(self, images: list[Any]) -> float:
        start = time.perf_counter()
        out = self.model.generate(
            **self.inputs(images),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        assert out.shape[1] - self.inputs(images[:1])["input_ids"].shape[1] == NEW_TOKENS
        return len(images) * NEW_TOKENS / (time.perf_counter() - start)


def request(image: Any, text: str) -> dict[str, Any]:
    return {"prompt": text, "add_special_tokens": False, "multi_modal_data": {"image": [image]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--quantization", choices=["q8_0", "q4_1"], default=None)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    text, vision, side = SHAPES[args.shape]
    folder = Path(tempfile.mkdtemp(prefix="ferrox-vl-bench-"))
    gemma = args.shape == "gemma3"
    if gemma:
        path = models.build_tiny_gemma3_vl(
            folder / "model", 512, 256, text, vision, test_weights=False
        )
    else:
        path = models.build_tiny_vl_model(
            folder / "model", text, vision, max_pixels=side * side, test_weights=False
        )
    prompt = GEMMA_TEXT if gemma else QWEN_TEXT
    print(f"cpu: {cpu_description()}")
    llm = LLM(str(path), max_model_len=1024, max_num_seqs=8, quantization=args.quantization)
    hf = Transformers(path, gemma)
    seed = iter(range(1000, 100000))

    def image() -> Any:
        return models.test_image(next(seed), (side, side))

    first = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm.generate(request(image(), prompt), first, use_tqdm=False)  # warm-up
    hf.ttft(image())
    figures: dict[str, list[float]] = {
        k: [] for k in ("ttft", "second_turn", "hf_ttft", "tps_1", "tps_8", "hf_tps_1", "hf_tps_8")
    }
    for _ in range(args.repeats):
        img = image()
        start = time.perf_counter()
        out = llm.generate(request(img, prompt), first, use_tqdm=False)[0]
        figures["ttft"].append(time.perf_counter() - start)
        start = time.perf_counter()
        again = llm.generate(request(img, prompt), first, use_tqdm=False)[0]
        figures["second_turn"].append(time.perf_counter() - start)
        assert again.metrics.num_cached_tokens > len(out.prompt_token_ids) // 2
        figures["hf_ttft"].append(hf.ttft(image()))
        for n in (1, 8):
            images = [image() for _ in range(n)]
            start = time.perf_counter()
            llm.generate([request(i, prompt) for i in images], full, use_tqdm=False)
            figures[f"tps_{n}"].append(n * NEW_TOKENS / (time.perf_counter() - start))
            figures[f"hf_tps_{n}"].append(hf.throughput([image() for _ in range(n)]))
    tokens = len(out.prompt_token_ids)
    weights = args.quantization or "float32"
    print(f"shape {args.shape}, ferrox {weights}: prompt {tokens} tokens ({side} x {side} image), "
          f"{NEW_TOKENS} new")  # fmt: skip
    print(
        f"TTFT s      ferrox {spread(figures['ttft'])}  transformers {spread(figures['hf_ttft'])}"
    )
    print(f"2nd turn s  ferrox {spread(figures['second_turn'])} (image and prompt cached)")
    for n in (1, 8):
        print(f"{n} stream(s) tok/s  ferrox {spread(figures[f'tps_{n}'])}  "
              f"transformers {spread(figures[f'hf_tps_{n}'])}")  # fmt: skip
    med = {k: statistics.median(v) for k, v in figures.items()}
    ratios = {
        "ttft_vs_transformers": med["hf_ttft"] / med["ttft"],
        "second_turn_vs_first": med["ttft"] / med["second_turn"],
        "tps_1_vs_transformers": med["tps_1"] / med["hf_tps_1"],
        "tps_8_vs_transformers": med["tps_8"] / med["hf_tps_8"],
    }
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}x")
    if args.json:
        write_record(
            args.json,
            shape=args.shape,
            quantization=args.quantization,
            prompt_tokens=tokens,
            runs=figures,
            ratios=ratios,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
