"""Images through the OpenAI chat API (a live server of the tiny Qwen2.5-VL):
a data-URL image answers what the offline LLM answers, the frontend stays
without torch (the image processor runs in its child), and bad images get a
400 envelope naming the part, with nothing left behind."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrox import LLM, SamplingParams
from tests import models
from tests.live_server import MODEL, Server


def data_url(image: Any, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = "png" if fmt == "PNG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buffer.getvalue()).decode()


def huge_png(width: int, height: int) -> bytes:
    """A PNG whose header claims `width` x `height` pixels (a decompression
    bomb's shape: a small file that would decode to a huge image)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.build_tiny_vl_model(tmp_path_factory.mktemp("qwen2.5-vl-served") / "model")


@pytest.fixture(scope="module")
def vl_server(vl_model: Path) -> Iterator[Server]:
    s = Server(
        vl_model,
        "--max-model-len",
        "256",
        "--max-image-pixels",
        str(120 * 120),
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--allowed-media-domains",
        "images.invalid",
    )
    yield s
    s.stop()


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "The quick brown fox"}


def test_a_data_url_image_answers_as_offline(vl_server: Server, vl_model: Path) -> None:
    messages = user(image_part(data_url(models.test_image(0))), TEXT)
    out = vl_server.client().chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    offline = LLM(str(vl_model), max_model_len=256).chat(
        [{"role": "user", "content": [image_part(data_url(models.test_image(0))), TEXT]}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.choices[0].message.content == offline.outputs[0].text
    assert out.usage is not None and out.usage.prompt_tokens == len(offline.prompt_token_ids)
    # The image processor ran in a child; the frontend itself has no torch.
    frontend = psutil.Process(vl_server.proc.pid)
    maps = {m.path for m in frontend.memory_maps()}
    assert not any(Path(p).name.startswith("libtorch") for p in maps)
    vl_server.wait_idle()


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ((image_part("data:image/png;base64,@@@"), TEXT), "not valid base64"),
        ((image_part("data:text/plain;base64,aGk="), TEXT), "not an image"),
        (
            (image_part("data:image/png;base64," + base64.b64encode(b"garbage").decode()),),
            "not a readable image",
        ),
        ((image_part("http://elsewhere.invalid/cat.png"), TEXT), "not an allowed media domain"),
        ((image_part("file:///etc/passwd"), TEXT), "only data URLs and http(s)"),
        ((image_part(data_url(models.test_image(0, (200, 200)))), TEXT), "more than the limit"),
        (
            (
                image_part(
                    "data:image/png;base64," + base64.b64encode(huge_png(60000, 60000)).decode()
                ),
            ),
            "content[0]",
        ),
        ((image_part(data_url(models.test_image(0))),) * 3, "limit_mm_per_prompt"),
        (({"type": "image_url"},), "without image_url"),
        (
            (
                {
                    "type": "image_url",
                    "image_url": {"url": "data:image/png;base64,", "detail": "high"},
                },
            ),
            "detail 'high' is not served",
        ),
    ],
)
def test_bad_images_get_a_400_naming_the_part(
    vl_server: Server, parts: tuple[dict[str, Any], ...], message: str
) -> None:
    r = vl_server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": user(*parts), "max_tokens": 4}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    vl_server.wait_idle()


def test_a_truncated_image_is_refused(vl_server: Server) -> None:
    buffer = io.BytesIO()
    models.test_image(0).save(buffer, format="PNG")
    cut = buffer.getvalue()[: len(buffer.getvalue()) // 2]
    url = "data:image/png;base64," + base64.b64encode(cut).decode()
    r = vl_server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": user(image_part(url), TEXT), "max_tokens": 4},
    )
    assert r.status_code == 400 and "truncated or malformed" in r.json()["error"]["message"]
    assert "messages[0].content[0]" in r.json()["error"]["message"]


def test_responses_and_anthropic_images_answer_as_chat(vl_server: Server) -> None:
    """The Responses API's input_image and Anthropic's image block are the
    chat API's image_url part."""
    url = data_url(models.test_image(0))
    chat = vl_server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": user(image_part(url), TEXT),
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()["choices"][0]["message"]["content"]
    response = vl_server.post(
        "/v1/responses",
        {
            "model": MODEL,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_image", "image_url": url},
                        {"type": "input_text", "text": TEXT["text"]},
                    ],
                }
            ],
            "max_output_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["output"][-1]["content"][0]["text"] == chat
    media, data = url.removeprefix("data:").split(";base64,")
    source = {"type": "base64", "media_type": media, "data": data}
    message = vl_server.post(
        "/v1/messages",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image", "source": source}, TEXT]}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert message.status_code == 200, message.text
    assert message.json()["content"][0]["text"] == chat
    vl_server.wait_idle()


@given(st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_image_parts_get_a_400_or_an_answer(vl_server: Server, data: st.DataObject) -> None:
    """Whatever an image part holds: a 200 or a 400, never a 500, and the
    server still serves."""
    payload = st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode())
    url = st.one_of(
        st.text(max_size=20),
        payload.map(lambda p: "data:image/png;base64," + p),
        st.sampled_from(["data:image/png;base64,", "http://", "https://images.invalid:99999/x"]),
        st.integers(),
        st.none(),
    )
    part = st.one_of(
        st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, url),
        st.builds(lambda u: {"type": "image_url", "image_url": u}, url),
        st.builds(lambda k: {"type": k}, st.sampled_from(["image_url", "image_pil", "image"])),
        st.just(TEXT),
    )
    parts = data.draw(st.lists(part, min_size=1, max_size=3))
    r = vl_server.post(
        "/v1/chat/completions", {"model": MODEL, "messages": user(*parts), "max_tokens": 2}
    )
    assert r.status_code in (200, 400), r.text


def test_after_fuzzing_the_server_serves(vl_server: Server) -> None:
    vl_server.wait_idle()
    r = vl_server.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": user(image_part(data_url(models.test_image(5))), TEXT),
            "max_tokens": 2,
        },
    )
    assert r.status_code == 200


def test_streams_and_n_completions_with_an_image(vl_server: Server) -> None:
    messages = user(image_part(data_url(models.test_image(0))), TEXT)
    whole = vl_server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert whole.choices[0].message.content == whole.choices[1].message.content
    stream = vl_server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
    vl_server.wait_idle()
