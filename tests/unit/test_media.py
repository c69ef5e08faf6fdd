"""Images before the engine (frontend/media.py, common/multimodal.py): URLs
loaded within their limits (a local HTTP server stands for an allowed
domain), images checked before and while decoding, placeholders expanded,
hash ids that tell images apart; the engine options that bound images."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ferrox.common.config import EngineConfig
from ferrox.common.errors import InvalidArgumentError
from ferrox.common.multimodal import (
    PLACEHOLDER_BASE,
    ImagePrompt,
    expand_image_text,
    image_input,
    image_runs,
    placeholder_ids,
)
from ferrox.frontend.media import MediaLimits, chat_images, decode_image, load_image_bytes
from tests import models


def png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """http://127.0.0.1:PORT serving /cat.png, /big (over the byte limit),
    /moved (a redirect) and 404 elsewhere."""
    body = png(models.test_image(0))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/cat.png":
                self._send(200, body)
            elif self.path == "/big":
                self._send(200, b"\0" * 5000)
            elif self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
            else:
                self._send(404, b"")

        def _send(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_urls_load_within_their_limits(image_host: str) -> None:
    allowed = MediaLimits(allowed_domains=("127.0.0.1",), max_bytes=4096)
    data = load_image_bytes(f"{image_host}/cat.png", allowed, "img")
    assert decode_image(data, allowed, "img").size == (84, 112)
    cases = [
        (f"{image_host}/cat.png", MediaLimits(), "not an allowed media domain"),
        (f"{image_host}/big", allowed, "larger than 4096 bytes"),
        (f"{image_host}/moved", allowed, "answered 302"),
        (f"{image_host}/nothing", allowed, "answered 404"),
        ("ftp://127.0.0.1/x.png", allowed, "only data URLs"),
        ("data:image/png;base64,***", allowed, "not valid base64"),
        ("data:image/png,abc", allowed, "must be 'data:image/"),
        ("data:text/html;base64,aGk=", allowed, "not an image"),
        ("", allowed, "has no URL"),
    ]
    for url, limits, message in cases:
        with pytest.raises(InvalidArgumentError, match=message):
            load_image_bytes(url, limits, "img")
    encoded = "data:image/png;base64," + base64.b64encode(png(models.test_image(1))).decode()
    assert load_image_bytes(encoded, allowed, "img") == png(models.test_image(1))


def test_images_are_checked_before_and_while_decoding() -> None:
    data = png(models.test_image(0))
    with pytest.raises(InvalidArgumentError, match="more than the limit of 100"):
        decode_image(data, MediaLimits(max_pixels=100), "img")
    with pytest.raises(InvalidArgumentError, match="truncated or malformed"):
        decode_image(data[: len(data) // 2], MediaLimits(), "img")
    with pytest.raises(InvalidArgumentError, match="not a readable image"):
        decode_image(b"GIF89a nonsense", MediaLimits(), "img")
    gray = models.test_image(0).convert("L")
    assert decode_image(png(gray), MediaLimits(), "img").mode == "RGB"


def test_chat_images_replace_parts_in_order() -> None:
    url = "data:image/png;base64," + base64.b64encode(png(models.test_image(2))).decode()
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "image_pil", "image_pil": models.test_image(3, (56, 56))},
            ],
        },
    ]
    turns, images = chat_images(messages, MediaLimits())
    assert turns[0] == messages[0]
    assert turns[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "image"},
    ]
    assert [i.size for i in images] == [(84, 112), (56, 56)]
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].content\[0\] must be a PIL"):
        chat_images(
            [{"role": "user", "content": [{"type": "image_pil", "image_pil": "x"}]}], MediaLimits()
        )


def test_markers_expand_and_hash_ids_tell_images_apart() -> None:
    names = {7: "<B>", 8: "<E>", 9: "<I>"}
    qwen = ImagePrompt(9, 9)
    assert expand_image_text("a<I>b<I>c", qwen, names.get, [3, 2]) == "a<I><I><I>b<I><I>c"
    gemma = ImagePrompt(7, 9, before=["\n\n", 7], after=[8, "\n\n"], tokens=2)
    assert expand_image_text("x<B>y", gemma, names.get, [2]) == "x\n\n<B><I><I><E>\n\ny"
    with pytest.raises(ValueError, match=r"2 image placeholders \(<I>\) for 1 images"):
        expand_image_text("<I><I>", qwen, names.get, [4])
    assert image_runs([1, 9, 9, 9, 2, 9, 9, 3], 9) == [(1, 3), (5, 2)]
    assert image_runs([9], 9) == [(0, 1)] and image_runs([1, 2], 9) == []
    a = image_input(np.zeros((4, 6), np.float32), [1, 2, 2], 0, 1)
    b = image_input(np.ones((4, 6), np.float32), [1, 2, 2], 0, 1)
    again = image_input(np.zeros((4, 6), np.float32), [1, 2, 2], 5, 1)
    assert a.hash == again.hash != b.hash
    first, second = placeholder_ids(a.hash, 20), placeholder_ids(b.hash, 20)
    assert (first >= PLACEHOLDER_BASE).all() and (first < 2 * PLACEHOLDER_BASE).all()
    assert (first != second).all()
    np.testing.assert_array_equal(a.array(), np.zeros((4, 6), np.float32))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(limit_mm_per_prompt='{"video": 1}'), "images only"),
        (dict(limit_mm_per_prompt='{"image": -1}'), "integer >= 0"),
        (dict(limit_mm_per_prompt='{"image": true}'), "integer >= 0"),
        (dict(limit_mm_per_prompt="{oops"), "not valid JSON"),
        (dict(limit_mm_per_prompt="[1]"), "must be an object"),
        (dict(mm_encoder_cache_tokens=-5), "mm_encoder_cache_tokens"),
        (dict(mm_encoder_cache_tokens="many"), "mm_encoder_cache_tokens"),
    ],
)
def test_image_options_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        EngineConfig.create(**options)
    assert EngineConfig.create(limit_mm_per_prompt='{"image": 3}').limit_mm_per_prompt == {
        "image": 3
    }
