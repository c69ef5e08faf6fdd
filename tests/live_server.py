"""A `ferrox serve` subprocess on loopback for tests, and the tiny model it
serves (with a minimal chat template)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

API_KEY = "test-key"
MODEL = "tiny"

# The client of every HTTP call the tests make. httpx's module-level helpers
# (httpx.get, httpx.post, ...) build a client, and with it a TLS context, per
# call: about 50 ms, several times a test, while the servers here speak plain
# HTTP on loopback. No kept-alive connections: each request opens its own, as a
# new client's would; the timeout is httpx's default.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


# A chat template that renders tools, tool calls and results, and Qwen3's
# enable_thinking; two tools with bounded arguments.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}"
    "{% if m.tool_call_id is defined %} [result of {{ m.tool_call_id }}]{% endif %}"
    "{{ '\\n' }}{{ m.content }}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]


class Server:
    def __init__(
        self,
        model: Path,
        *extra: str,
        api_key: str | None = API_KEY,
        new_session: bool = False,
        served_names: tuple[str, ...] = (MODEL,),
    ) -> None:
        """`new_session`: the server leads a process group of its own (for
        signals sent to the whole group). The model is given as `ferrox serve
        MODEL`, as vLLM takes it."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [
            sys.executable,
            "-m",
            "ferrox",
            "serve",
            str(model),
            "--port",
            str(self.port),
        ]
        args += [
            "--served-model-name",
            *served_names,
            "--num-kv-blocks",
            "512",
            "--block-size",
            "4",
        ]
        args += ["--max-num-seqs", "64", *extra]
        if api_key:
            args += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ.copy(),
            start_new_session=new_session,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if HTTP.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not start")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def post(self, path: str, body: object, **kw: object) -> httpx.Response:
        return HTTP.post(self.url + path, json=body, headers=self.headers, timeout=60, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        """Every ferrox metric's value, summed over its samples (engine
        metrics have one per replica), from one scrape."""
        text = HTTP.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("ferrox:"):
                series, value = line.rsplit(" ", 1)
                name = series[len("ferrox:") :].split("{", 1)[0]
                values[name] = values.get(name, 0.0) + float(value)
        return values

    def metric(self, name: str) -> float:
        """One metric's value, summed over its samples."""
        return self.metrics()[name]

    def wait_idle(self, timeout: float = 30) -> None:
        """Until no request runs and every KV block is free or cached."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            busy = m["num_requests_running"] + m["num_requests_waiting"]
            busy += m["num_requests_admitted"]
            if busy == 0 and m["kv_cache_used_blocks"] == 0:
                free = m["kv_cache_free_blocks"] + m["kv_cache_cached_blocks"]
                assert free == m["kv_cache_total_blocks"]
                return
            time.sleep(0.1)
        raise AssertionError("KV blocks still in use: a request leaked")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def tool_server(model: Path, folder: Path, *extra: str, name: str = "smol") -> Server:
    """A server of `model` that renders TOOL_CHAT_TEMPLATE (written into
    `folder`), reads hermes tool calls and qwen3 reasoning."""
    template = folder / "chat.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    return Server(
        model,
        "--max-model-len",
        "1024",
        "--chat-template",
        str(template),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        *extra,
        served_names=(name,),
    )


def warm_prefix(
    server: Server, messages: list[dict[str, Any]], model: str = "smol", **extra: Any
) -> None:
    """Caches the prompt of `messages` with the block its last token falls in.

    Greedy tokens are equal for equal computations, and a prompt computed
    after a prefix-cache hit is another computation than the same prompt
    computed whole (other matmul shapes, keys and values already rounded to
    the cache's dtype), which on a small model can turn a near tie. Requests
    compared token for token are sent after this one has generated past a
    whole block (32 tokens, EOS ignored): each then hits the same prefix,
    whatever it generates itself."""
    server.client().chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=32,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def engine_processes_of(pid: int) -> list[psutil.Process]:
    """The engine-core child (its command runs engine_process_main)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c for c in children if "engine_process_main" in " ".join(c.cmdline())]


def engine_processes(server: Server) -> list[psutil.Process]:
    return engine_processes_of(server.proc.pid)


def make_model_dir(tiny_model: Path, root: Path) -> Path:
    """A copy of a tiny model with a chat template added."""
    path = root / "model"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
