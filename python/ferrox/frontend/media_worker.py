"""The child process that runs a model's image processor for a frontend
that stays without torch (frontend/media.py): `python -m
ferrox.frontend.media_worker MODEL_DIR`, reading msgpack frames of [width,
height, RGB bytes] images on standard input and writing, per request, the
processed [rows, shape, grid, tokens] of each image, or an error's text."""

from __future__ import annotations

import sys

import msgspec


def main(model_dir: str) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    from ferrox.frontend.media import read_frame, run_processor, write_frame

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever a library prints stays off the replies
    processor = AutoImageProcessor.from_pretrained(model_dir)
    while True:
        try:
            request = msgspec.msgpack.decode(read_frame(stdin))
        except EOFError:
            return
        try:
            images = [Image.frombytes("RGB", (w, h), data) for w, h, data in request]
            reply: object = [
                [p.pixels.tobytes(), list(p.pixels.shape), p.grid, p.tokens]
                for p in run_processor(processor, images)
            ]
        except Exception as e:  # the image's fault: the caller answers 400
            reply = f"{type(e).__name__}: {e}"
        write_frame(stdout, msgspec.msgpack.encode(reply))


if __name__ == "__main__":
    main(sys.argv[1])
