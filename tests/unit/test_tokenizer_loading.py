"""The frontend's tokenizer (model_files/tokenizer.py): what AutoTokenizer builds,
loaded from a plain export without torch; cached; errors typed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ferrox.common.errors import ModelLoadError
from ferrox.model_files import tokenizer as frontend_tokenizer
from tests.live_server import make_model_dir

TEXTS = [
    "Hello, world!",
    "def add(a, b):\n    return a + b\n",
    "  leading spaces and 12345 digits\ttabs",
    "<s>special</s> tokens inside",
    "ünïcödé — and emoji 🙂",
]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("FERROX_CACHE_DIR", str(root))
    return root


def _with_class(source: Path, root: Path, tokenizer_class: str, model_type: str | None) -> Path:
    path = make_model_dir(source, root)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = tokenizer_class
    config_file.write_text(json.dumps(config))
    if model_type is not None:
        model = json.loads((path / "config.json").read_text())
        model["model_type"] = model_type
        (path / "config.json").write_text(json.dumps(model))
    return path


def _assert_same(ours: Any, reference: Any) -> None:
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    for text in TEXTS:
        ids = reference.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == reference.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
            ids, skip_special_tokens=True
        )
    assert (ours.bos_token_id, ours.eos_token_id) == (
        reference.bos_token_id,
        reference.eos_token_id,
    )
    assert ours.all_special_tokens == reference.all_special_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    ("tokenizer_class", "model_type"),
    [
        ("PreTrainedTokenizerFast", None),  # as saved: the plain class
        ("Qwen2Tokenizer", "qwen2"),  # a class that rebuilds the pipeline in __init__
        ("PreTrainedTokenizerFast", "qwen2"),  # AutoTokenizer overrides the hub's class here
        ("GPT2TokenizerFast", None),
    ],
)
def test_export_matches_auto_tokenizer(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    cache: Path,
    tokenizer_class: str,
    model_type: str | None,
) -> None:
    from transformers import AutoTokenizer, TokenizersBackend

    path = _with_class(tiny_models["qwen2"], tmp_path, tokenizer_class, model_type)
    ours = frontend_tokenizer.load_hf_tokenizer(path, "auto")
    assert type(ours) is TokenizersBackend
    _assert_same(ours, AutoTokenizer.from_pretrained(path, local_files_only=True))


def test_export_is_cached_by_content(
    tiny_models: dict[str, Path], tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_model_dir(tiny_models["llama-gqa-tied"], tmp_path / "a")
    frontend_tokenizer.load_hf_tokenizer(path, "auto")
    (export,) = (cache / "tokenizers").iterdir()

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("the export should have come from the cache")

    monkeypatch.setattr(subprocess, "run", no_child)
    copy = make_model_dir(tiny_models["llama-gqa-tied"], tmp_path / "b")  # same content
    assert frontend_tokenizer.load_hf_tokenizer(copy, "auto").encode("hi") == [
        *frontend_tokenizer.load_hf_tokenizer(path, "auto").encode("hi")
    ]
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"  # changed content: a new export
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AssertionError, match="from the cache"):
        frontend_tokenizer.load_hf_tokenizer(copy, "auto")
    assert [p.name for p in (cache / "tokenizers").iterdir()] == [export.name]


def test_class_with_methods_of_its_own_loads_with_auto_tokenizer(
    tiny_models: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    from transformers import AutoTokenizer

    path = _with_class(tiny_models["llama-gqa-tied"], tmp_path, "CodeLlamaTokenizer", None)
    reference = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert frontend_tokenizer._own_methods(type(reference), _backend())  # the premise
    ours = frontend_tokenizer.load_hf_tokenizer(path, "auto")
    assert type(ours) is type(reference)
    (export,) = (cache / "tokenizers").iterdir()
    assert (export / "CLASS").read_text().strip().endswith("CodeLlamaTokenizer")
    assert ours.get_vocab() == reference.get_vocab()


def _backend() -> type:
    from transformers import TokenizersBackend

    return TokenizersBackend


def test_missing_or_broken_tokenizer(
    tiny_models: dict[str, Path], tmp_path: Path, cache: Path
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_models["llama-gqa-tied"] / "config.json", bare)
    assert frontend_tokenizer.load_hf_tokenizer(bare, "dummy") is None
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        frontend_tokenizer.load_hf_tokenizer(bare, "auto")
    broken = make_model_dir(tiny_models["llama-gqa-tied"], tmp_path / "broken")
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer from"):
        frontend_tokenizer.load_hf_tokenizer(broken, "auto")
    assert not any((cache / "tokenizers").glob(".export-*"))  # no staging left behind


def test_frontend_modules_do_not_import_torch(model_dir: Path, smollm2_path: Path) -> None:
    """AsyncLLM and the server app, built on an HF directory and on the GGUF
    default, with tokenizers loaded, in a fresh interpreter: no torch."""
    script = (
        "import sys\n"
        "import ferrox, ferrox.server.launch, ferrox.cli\n"
        "from ferrox.frontend.async_llm import AsyncLLM\n"
        f"for model in ({str(model_dir)!r}, {str(smollm2_path)!r}):\n"
        "    llm = AsyncLLM(model)\n"
        "    assert llm.tokenizer.encode('hi'), model\n"
        "print(sorted(m for m in ('torch', 'ferrox.engine.core') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stderr
