"""The tokenizer alone, for a process that runs no model (the server's
frontend, `AsyncLLM`, the benchmark client), loaded without torch.

A GGUF file's tokenizer is built from its metadata. For a Hugging Face
directory, `AutoTokenizer` decides the class (from tokenizer_config.json,
config.json and its own tables) and that class may rebuild the pipeline
tokenizer.json describes; importing `AutoTokenizer` imports torch. So a child
process loads it once with `AutoTokenizer` and saves what it built as a plain
tokenizers-backend tokenizer (tokenizer.json holds the whole pipeline:
normalizer, pre-tokenizer, model, post-processor, decoder; tokenizer_config.json
the special tokens and chat template). The frontend loads that export, cached
under the ferrox cache by the content of the source files. A class that adds
methods of its own (beyond building its pipeline in `__init__`) is not
exported: the frontend then loads it with `AutoTokenizer`, torch and all.

    python -m ferrox.model_files.tokenizer SOURCE_DIR EXPORT_DIR   # the child's job
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrox.common.errors import ModelLoadError
from ferrox.model_files.default import cache_dir
from ferrox.model_files.gguf_reader import load_gguf_tokenizer
from ferrox.model_files.hub import resolve_model_path

if TYPE_CHECKING:
    from ferrox.common.config import EngineConfig

logger = logging.getLogger(__name__)

# Files AutoTokenizer may read to decide and build a tokenizer.
_SOURCE_FILES = ("config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
_SOURCE_PREFIXES = ("tokenizer", "chat_template", "merges", "vocab")
_EXPORT_TIMEOUT_S = 300.0
# The class a plain export loads as (what AutoTokenizer maps a
# "PreTrainedTokenizerFast" tokenizer_config.json to).
_PLAIN_CLASS = "TokenizersBackend"


# OpenAI's harmony chat format (gpt-oss) marks its channels with these.
HARMONY_TOKENS = ("<|channel|>", "<|message|>")


def speaks_harmony(tokenizer: Any) -> bool:
    """Whether the model answers chats in OpenAI's harmony format (gpt-oss):
    in channels (analysis, commentary, final) that the server's chat APIs
    read back (`server/harmony.py`)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return all(token in vocab for token in HARMONY_TOKENS)


def load_tokenizer(config: EngineConfig) -> Any | None:
    """The tokenizer of `config.tokenizer` or else of `config.model`; None for
    random weights (`load_format="dummy"`) that come without one."""
    if config.tokenizer is not None:
        return load_hf_tokenizer(resolve_model_path(config.tokenizer), config.load_format)
    path = resolve_model_path(config.model)
    if path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path, config.load_format)


def load_hf_tokenizer(path: Path, fmt: str) -> Any | None:
    """The tokenizer of a Hugging Face directory (or of the one holding `path`),
    as `AutoTokenizer` builds it, loaded from a plain export where the class
    allows."""
    directory = path if path.is_dir() else path.parent
    sources = _source_files(directory)
    try:
        if all(p.name == "config.json" for p in sources):
            raise ModelLoadError(
                f"cannot load a tokenizer from {str(directory)!r}: no tokenizer files"
            )
        export = cache_dir() / "tokenizers" / _export_key(sources)
        if not (export / "tokenizer.json").is_file() and not (export / "CLASS").is_file():
            _export(directory, export)
    except ModelLoadError:
        if fmt == "dummy":
            return None  # random weights may come without a tokenizer: token ids only
        raise
    if (export / "CLASS").is_file():  # a class of its own: loaded as it is
        logger.info(
            "tokenizer class %s adds methods of its own; loading it with AutoTokenizer",
            (export / "CLASS").read_text().strip(),
        )
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(export, local_files_only=True)


def _source_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_file() and (p.name in _SOURCE_FILES or p.name.startswith(_SOURCE_PREFIXES))
    )


def _export_key(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for package in ("transformers", "tokenizers", "ferrox"):
        digest.update(f"{package}={_version(package)};".encode())
    for source in sources:
        digest.update(source.name.encode() + b"\0")
        digest.update(hashlib.sha256(source.read_bytes()).digest())
    return digest.hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _export(directory: Path, export: Path) -> None:
    """Runs the export in a child process, into a fresh folder renamed into
    place (so a reader never sees half an export)."""
    export.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=export.parent))
    try:
        child = subprocess.run(
            [sys.executable, "-m", "ferrox.model_files.tokenizer", str(directory), str(staging)],
            capture_output=True,
            text=True,
            timeout=_EXPORT_TIMEOUT_S,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if child.returncode != 0:
            lines = (child.stderr or child.stdout).strip().splitlines()
            reason = lines[-1] if lines else f"exit status {child.returncode}"
            raise ModelLoadError(f"cannot load a tokenizer from {str(directory)!r}: {reason}")
        try:
            staging.rename(export)
        except OSError:
            if not export.is_dir():  # not another process's export won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_tokenizer(directory: Path, export: Path) -> None:
    """What the child runs: loads `directory` with AutoTokenizer and saves it
    as a plain tokenizer into `export`, or writes the class name to
    `export/CLASS` when the class has methods of its own."""
    from transformers import AutoTokenizer, TokenizersBackend

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    cls = type(tokenizer)
    if not issubclass(cls, TokenizersBackend) or _own_methods(cls, TokenizersBackend):
        (export / "CLASS").write_text(f"{cls.__module__}.{cls.__qualname__}\n")
        return
    tokenizer.save_pretrained(export)
    config_file = export / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = _PLAIN_CLASS
    config.pop("auto_map", None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _own_methods(cls: type, base: type) -> list[str]:
    """Methods the classes between `cls` and `base` define, other than the
    `__init__` that builds the pipeline (and `model`, the tokenizers model class
    it builds with)."""
    names = []
    for klass in cls.__mro__:
        if klass is base:
            break
        for name, value in vars(klass).items():
            if name in ("__init__", "model"):
                continue
            if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                names.append(name)
    return names


if __name__ == "__main__":
    try:
        export_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
    except Exception as exc:  # reported to the parent as the last stderr line
        print(f"{type(exc).__name__}: {exc}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
