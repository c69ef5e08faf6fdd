"""The `ferrox` command line on a tiny model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ferrox import cli


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ferrox", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().startswith("ferrox ")


def test_generate_prints_the_completion(
    tiny_models: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    model = str(tiny_models["llama-gqa-tied"])
    args = ["generate", "Hello", "--model", model, "--max-tokens", "5", "--temperature", "0"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_chat_streams_and_keeps_history(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama-gqa-tied"], model)
    # The tiny tokenizer has no chat template: give it a minimal one.
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    lines = iter(["hi there", "/reset", "again", "/exit"])
    args = cli.build_parser().parse_args(
        ["chat", "--model", str(model), "--max-tokens", "4", "--temperature", "0"]
    )
    assert cli.cmd_chat(args, read=lambda _prompt: next(lines)) == 0
    assert capsys.readouterr().out.count("\n") >= 2


def test_errors_exit_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", "x", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_info_prints_the_resolved_config(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info", "--max-num-seqs", "3"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu" in out and "max_num_seqs=3" in out
