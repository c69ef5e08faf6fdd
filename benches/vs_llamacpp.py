"""ferrox and llama.cpp side by side on one GGUF (default the bundled model),
same threads, one run.

    python benches/vs_llamacpp.py                  # the whole table
    python benches/vs_llamacpp.py --model FILE     # another GGUF (benches/make_bench_gguf.py)
    python benches/vs_llamacpp.py --setup-only     # build the peer and stop

The peer is llama.cpp at the version vendored by llama-cpp-python (pinned
below). The first run installs llama-cpp-python into this environment (pip
compiles llama.cpp; pip's wheel cache keeps the result) and builds the
`llama-server` binary from the same vendored source into the ferrox cache
folder; later runs reuse both. Building needs a C++ compiler; cmake and ninja
come from pip.

Under `FERROX_CPU_ISA=avx2` (ferrox's kernels and torch's capped to what a
CPU without AVX-512 runs) the peer is capped too: llama.cpp is built a
second time for AVX2 only (`GGML_NATIVE=OFF`, AVX2 / FMA / F16C, no
AVX-512), and both the Python binding (through `LLAMA_CPP_LIB_PATH`) and
`llama-server` run that build.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from baseline import current_commit  # isort: skip
from machine import cpu_description
from side_by_side import free_port, start, stop

LLAMA_CPP_PYTHON = "0.3.36"


def peer_dir() -> Path:
    from ferrox.model_files.default import cache_dir

    out = cache_dir() / f"llama-cpp-python-{LLAMA_CPP_PYTHON}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def avx2_only() -> bool:
    """Whether this run is capped to AVX2 (`FERROX_CPU_ISA=avx2`)."""
    return os.environ.get("FERROX_CPU_ISA", "").strip().lower() == "avx2"


def llama_cpp_module() -> Any:
    """The peer's Python binding; installed by this script, not by ferrox's extras.
    Capped to AVX2, it loads the AVX2-only build's library."""
    if avx2_only():
        os.environ["LLAMA_CPP_LIB_PATH"] = str(peer_dir() / "build-avx2" / "bin")
    return importlib.import_module("llama_cpp")


def ensure_python_binding() -> None:
    try:
        installed = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed == LLAMA_CPP_PYTHON:
        return
    print(f"installing llama-cpp-python {LLAMA_CPP_PYTHON} (compiles llama.cpp once)", flush=True)
    pip("install", "-q", "cmake", "ninja", "scikit-build-core")
    pip("install", "-q", "--no-deps", f"llama-cpp-python=={LLAMA_CPP_PYTHON}")
    pip("install", "-q", "diskcache", "jinja2", "numpy", "typing-extensions")


def ensure_server() -> Path:
    """`llama-server` (and its libraries) built from the source
    llama-cpp-python vendors: for this CPU, or for AVX2 only."""
    root = peer_dir()
    build = root / ("build-avx2" if avx2_only() else "build")
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    pip("install", "-q", "cmake", "ninja", "scikit-build-core")
    sdist = next(root.glob("llama_cpp_python-*.tar.gz"), None)
    if sdist is None:
        pip(
            "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
            "-d", str(root), f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
        )  # fmt: skip
        sdist = next(root.glob("llama_cpp_python-*.tar.gz"))
    src = root / "src"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    vendored = next(src.glob("*/vendor/llama.cpp"))
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    isa = (
        ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
         "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"]
        if avx2_only()
        else []
    )  # fmt: skip
    subprocess.run(
        [
            "cmake", "-S", str(vendored), "-B", str(build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *isa,
        ],
        check=True, env=env,
    )  # fmt: skip
    targets = ["llama-server", "llama"]  # (the binding loads the AVX2 build's libllama)
    subprocess.run(
        ["cmake", "--build", str(build), "-j", str(os.cpu_count()), "--target", *targets],
        check=True, env=env,
    )  # fmt: skip
    return binary


# ---- single stream, in process -------------------------------------------------------------


def prompt_ids(tokenizer: Any, length: int) -> list[int]:
    """A fixed English prompt of `length` tokens (text repeated and cut)."""
    text = (
        "The history of the Roman Empire spans many centuries, from the founding of the city "
        "to the fall of Constantinople. Its roads, laws and languages shaped Europe. "
    )
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:length]


class FerroxEngine:
    name = "ferrox"

    def __init__(self, options: dict[str, Any]) -> None:
        from ferrox import LLM

        self.llm = LLM(**options)

    def generate(self, ids: list[int], max_tokens: int) -> tuple[int, float]:
        """(tokens made, seconds from the first token to the last)."""
        from ferrox import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        m = out.metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        return len(out.outputs[0].token_ids), m.last_token_time - m.first_token_time


class LlamaCppEngine:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int) -> None:
        self.llm = llama_cpp_module().Llama(
            model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
            n_batch=512, verbose=False,
        )  # fmt: skip

    def generate(self, ids: list[int], max_tokens: int) -> tuple[int, float]:
        """(tokens made, seconds from the first token to the last): the
        binding's token loop (greedy, EOS not stopping it), timed at each
        token it yields, without `create_completion`'s text handling."""
        self.llm.reset()  # no reuse of the previous call's KV cache
        made, first, last = 0, 0.0, 0.0
        for _ in self.llm.generate(ids, top_k=1, temp=0.0, reset=True):
            last = time.perf_counter()
            made += 1
            if made == 1:
                first = last
            if made == max_tokens:
                break
        return made, last - first


def single_stream(engines: list[Any], ids: list[int], new: int, repeats: int) -> dict[str, Any]:
    """Prefill tok/s (a 1-token generation) and decode tok/s (the `new`
    tokens after the first of a longer one, timed from the first token to
    the last within that request), alternating engines, `repeats` times,
    each repeat in the other order than the one before (so that neither
    engine always runs right after the other)."""
    figures: dict[str, dict[str, list[float]]] = {
        e.name: {"prefill": [], "decode": []} for e in engines
    }
    for e in engines:  # warm-up
        e.generate(ids, 4)
    for repeat in range(repeats):
        for e in engines if repeat % 2 == 0 else engines[::-1]:
            start = time.perf_counter()
            e.generate(ids, 1)
            first = time.perf_counter() - start
            made, decoding = e.generate(ids, new + 1)
            if made != new + 1:
                raise RuntimeError(f"{e.name} made {made} tokens, not {new + 1}")
            figures[e.name]["prefill"].append(len(ids) / first)
            figures[e.name]["decode"].append(new / decoding)
    return figures


# ---- servers ------------------------------------------------------------------------------


def _role(pid: int) -> str:
    """What a process of a server's tree is, from its command line."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "resource_tracker" in command:
        return "resource tracker"
    return "engine" if "spawn_main" in command else "server"


def tree_memory(pid: int) -> dict[str, Any]:
    """Resident bytes of a process and all its descendants: `rss` sums each
    process's resident set (pages shared between them count once per
    process), `pss` shares such pages out (each counts once in all);
    `pss_by_role` splits the PSS by process (server, engine, ...)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total: dict[str, Any] = {"rss": 0, "pss": 0, "processes": 0, "pss_by_role": {}}
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        total["processes"] += 1
        for line in rollup:
            key, _, value = line.partition(":")
            if key in ("Rss", "Pss"):
                total[key.lower()] += int(value.split()[0]) * 1024
            if key == "Pss":
                role = _role(p)
                by_role = total["pss_by_role"]
                by_role[role] = by_role.get(role, 0) + int(value.split()[0]) * 1024
    return total


def serve_chat(
    command: list[str], port: int, log: Path, concurrencies: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    from ferrox.bench import serve as bench

    proc = start(command, port, log)
    try:
        result: dict[str, Any] = {"idle": tree_memory(proc.pid)}
        for c in concurrencies:
            parser = argparse.ArgumentParser()
            bench.add_arguments(parser)
            bargs = parser.parse_args(
                [
                    "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "chat",
                    "--endpoint", "chat", "--max-concurrency", str(c),
                    "--num-prompts", str(max(2 * c, args.min_requests)),
                    "--chat-system-prompt-len", str(args.system_len), "--chat-num-turns", "2",
                    "--chat-user-len", "60", "--chat-output-len-min", str(args.output_len),
                    "--chat-output-len-max", str(args.output_len), "--ignore-eos",
                    "--disable-tqdm",
                ]
            )  # fmt: skip
            bench.apply_presets(bargs)
            tokenizer = bench.load_tokenizer(None)
            report = asyncio.run(bench.run_once(bargs, tokenizer, float("inf")))
            if report["failed"]:
                errors = sorted({e for e in report["errors"] if e})[:3]
                raise RuntimeError(
                    f"{command[0]}: {report['failed']} requests failed ({errors}); see {log}"
                )
            result[f"c{c}"] = {
                k: report[k] for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms")
            }
        result["loaded"] = tree_memory(proc.pid)
        return result
    finally:
        stop(proc)


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--setup-only", action="store_true")
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the bundled model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--system-len", type=int, default=700, help="chat system prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-requests", type=int, default=6)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument(
        "--ferrox-option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help='an LLM / serve option for ferrox, e.g. quantization="none"',
    )
    parser.add_argument("--skip-servers", action="store_true")
    parser.add_argument("--logs", type=Path, default=Path("vs-llamacpp-logs"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cap = os.environ.get("FERROX_CPU_ISA", "native").strip().lower() or "native"
    if cap not in ("native", "amx", "avx512", "avx2"):
        # (llama.cpp is built natively or for AVX2 alone: an AVX-VNNI cap would
        # measure ferrox's capped kernels against the peer's native ones)
        raise SystemExit(f"FERROX_CPU_ISA={cap}: this script runs uncapped, avx512 or avx2 only")
    ensure_python_binding()
    server_bin = ensure_server()
    if args.setup_only:
        print(f"llama-cpp-python {LLAMA_CPP_PYTHON} and {server_bin} are ready")
        return

    from ferrox.model_files import default_model_path
    from ferrox.model_files.gguf_reader import load_gguf_tokenizer

    gguf = args.model.expanduser() if args.model else default_model_path()
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.ferrox_option)}
    options = {"model": str(gguf), **options}
    tokenizer = load_gguf_tokenizer(gguf)
    ids = prompt_ids(tokenizer, args.prompt_len)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "threads": args.threads, "model": gguf.name,
        "llama_cpp_python": LLAMA_CPP_PYTHON, "ferrox_options": options,
        "llama_cpp_build": "avx2" if avx2_only() else "native",
        "command": " ".join(sys.argv), "cpu": cpu_description(),
        "commit": current_commit(),
    }  # fmt: skip
    import torch

    torch.set_num_threads(args.threads)
    engines = [
        # No prefix cache: every repeat computes its prompt, as llama.cpp's does.
        FerroxEngine({"enable_prefix_caching": False, **options}),
        LlamaCppEngine(gguf, args.threads, args.prompt_len + args.new_tokens + 16),
    ]
    result["single"] = single_stream(engines, ids, args.new_tokens, args.repeats)
    del engines
    gc.collect()

    if not args.skip_servers:
        args.logs.mkdir(exist_ok=True)
        flags = [f"--{k.replace('_', '-')}={v if isinstance(v, str) else json.dumps(v)}"
                 for k, v in options.items()]  # fmt: skip
        slots = max(args.concurrency)
        ctx = slots * (args.system_len + 2 * (60 + args.output_len) + 256)
        servers = {
            "ferrox": lambda port: [
                sys.executable, "-m", "ferrox", "serve", "--port", str(port), *flags,
            ],
            "llama-server": lambda port: [
                str(server_bin), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1",
                "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
                "-c", str(ctx), "--cont-batching",
            ],
        }  # fmt: skip
        for name, command in servers.items():
            port = free_port()
            result[name] = serve_chat(
                command(port), port, args.logs / f"{name}.log", args.concurrency, args
            )
    print_table(result, args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    single = result["single"]
    ours, theirs = single["ferrox"], single["llama.cpp"]
    print(f"\n{'what':<44}{'ferrox':>22}{'llama.cpp':>22}{'ratio':>8}")
    for key, label in (("decode", "single-stream decode tok/s"), ("prefill", "prefill tok/s")):
        ratio = statistics.median(ours[key]) / statistics.median(theirs[key])
        print(f"{label + f' ({args.prompt_len}-token prompt)':<44}"
              f"{spread(ours[key]):>22}{spread(theirs[key]):>22}{ratio:>7.2f}x")  # fmt: skip
    # Each repeat's two figures were measured seconds apart: their
    # ratio leaves out the machine's slower drifts, which the medians keep.
    for key, label in (("decode", "single-stream decode"), ("prefill", "prefill")):
        pairs = [x / y for x, y in zip(ours[key], theirs[key], strict=True)]
        print(f"  {label}, ratio per repeat: median {statistics.median(pairs):.2f}x "
              f"({min(pairs):.2f}-{max(pairs):.2f}, {len(pairs)} repeats)")  # fmt: skip
    if "ferrox" not in result:
        return
    a, b = result["ferrox"], result["llama-server"]
    for c in args.concurrency:
        x, y = a[f"c{c}"]["output_throughput"], b[f"c{c}"]["output_throughput"]
        print(f"{f'chat, {c} stream(s), output tok/s':<44}{x:>22.1f}{y:>22.1f}{x / y:>7.2f}x")
        x, y = a[f"c{c}"]["median_ttft_ms"], b[f"c{c}"]["median_ttft_ms"]
        print(f"{f'chat, {c} stream(s), TTFT p50 ms':<44}{x:>22.0f}{y:>22.0f}{x / y:>7.2f}x")
    for when, label in (("idle", "after start"), ("loaded", "after the chat runs")):
        for key in ("rss", "pss"):
            x, y = a[when][key] / 2**20, b[when][key] / 2**20
            what = f"server {key.upper()} {label}, MB"
            print(f"{what:<44}{x:>22.0f}{y:>22.0f}{x / y:>7.2f}x")
        for name, tree in (("ferrox", a), ("llama.cpp", b)):
            roles = ", ".join(f"{r} {v / 2**20:.0f}" for r, v in tree[when]["pss_by_role"].items())
            print(f"  {name} PSS by process {label}, MB: {roles}")


if __name__ == "__main__":
    main()
