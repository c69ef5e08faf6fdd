"""Synthetic workloads, generated locally from a tokenizer's vocabulary.

A dataset is a list of *sessions*; each session is a list of turns sent one
after another (a turn waits for the previous answer, which joins the
history). Single-request workloads have one-turn sessions.

- random:        independent prompts of input_len * [1 - r, 1 + r] tokens
- shared-prefix: groups sharing a system prompt, each with its own question
- chat:          a 2,000-token system prompt shared by every user (or several,
                 --chat-num-system-prompts, taken in turn); multi-turn
                 conversations that resend the history; 50-300 output tokens
- agent:         ~8,000-token contexts that grow by a tool result per step
                 and are resent each step
- fan-out:       an agent fanning out sub-tasks: every request shares one
                 1,000-token prefix with a 32-token task of its own, all
                 arriving at once; 64 output tokens (the prefix follows
                 --seed: a new seed, or a fresh server, finds it uncached)
- batch:         unique 1,000-2,000-token inputs, 10-50 output tokens
- sharegpt:      first user turns of a ShareGPT JSON file (--dataset-path), each
                 asking for as many tokens as the recorded reply had; as vLLM,
                 prompts under 4 or over 1,024 tokens and pairs over 2,048 are
                 left out
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ferrox.common.errors import InvalidArgumentError

DATASETS = ("random", "shared-prefix", "chat", "agent", "fan-out", "batch", "sharegpt")


@dataclass
class Turn:
    user: str  # the new user text of this turn
    output_len: int
    system: str | None = None  # the shared system prompt (first turn only)


@dataclass
class Session:
    turns: list[Turn]
    history: list[dict[str, str]] = field(default_factory=list)


class TextSampler:
    """Random text made of real vocabulary tokens (no special tokens)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # Tokens that are whole text on their own: byte fragments of
        # multi-byte characters would decode to U+FFFD and re-encode longer.
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.ids = np.array(
            [i for i, p in enumerate(pieces) if i not in special and p and "\ufffd" not in p],
            dtype=np.int64,
        )
        self.rng = np.random.default_rng(seed)

    def text(self, num_tokens: int) -> str:
        """About `num_tokens` tokens of text: decoded random ids, trimmed so
        that it re-encodes to at most `num_tokens` tokens."""
        ids = self.rng.choice(self.ids, size=max(num_tokens, 1)).tolist()
        text = self.tokenizer.decode(ids)
        for _ in range(4):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) <= num_tokens:
                break
            text = self.tokenizer.decode(encoded[:num_tokens])
        return text

    def length(self, mean: int, range_ratio: float) -> int:
        low = max(int(mean * (1 - range_ratio)), 1)
        high = max(int(mean * (1 + range_ratio)), low)
        return int(self.rng.integers(low, high + 1))

    def between(self, low: int, high: int) -> int:
        return int(self.rng.integers(low, high + 1))


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("datasets")
    g.add_argument("--dataset-name", choices=DATASETS, default="random")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send in all")
    g.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (sharegpt)")
    g.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="output tokens for every request"
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0, help="a prefix shared by all")
    g.add_argument("--shared-prefix-num-groups", type=int, default=8)
    g.add_argument("--shared-prefix-len", type=int, default=2048, help="system prompt tokens")
    g.add_argument("--shared-prefix-question-len", type=int, default=128)
    g.add_argument("--shared-prefix-output-len", type=int, default=256)
    g.add_argument("--chat-system-prompt-len", type=int, default=2000)
    g.add_argument(
        "--chat-num-system-prompts",
        type=int,
        default=1,
        help="distinct system prompts, conversations taking them in turn",
    )
    g.add_argument("--chat-num-turns", type=int, default=3, help="turns per conversation")
    g.add_argument("--chat-user-len", type=int, default=100, help="tokens per user message")
    g.add_argument("--chat-output-len-min", type=int, default=50)
    g.add_argument("--chat-output-len-max", type=int, default=300)
    g.add_argument("--agent-context-len", type=int, default=6000, help="first step's context")
    g.add_argument("--agent-step-len", type=int, default=250, help="tokens each step adds")
    g.add_argument("--agent-num-steps", type=int, default=8)
    g.add_argument("--agent-output-len", type=int, default=64)
    g.add_argument("--fan-out-prefix-len", type=int, default=1000, help="the shared prefix")
    g.add_argument("--fan-out-task-len", type=int, default=32, help="tokens of each sub-task")
    g.add_argument("--fan-out-output-len", type=int, default=64)
    g.add_argument("--batch-input-len-min", type=int, default=1000)
    g.add_argument("--batch-input-len-max", type=int, default=2000)
    g.add_argument("--batch-output-len-min", type=int, default=10)
    g.add_argument("--batch-output-len-max", type=int, default=50)


def build_sessions(args: argparse.Namespace, tokenizer: Any) -> list[Session]:
    s = TextSampler(tokenizer, args.seed)
    n = args.num_prompts
    name = args.dataset_name
    if name == "random":
        prefix = s.text(args.random_prefix_len) if args.random_prefix_len else ""
        return [
            Session(
                [
                    Turn(
                        prefix + s.text(s.length(args.random_input_len, args.random_range_ratio)),
                        s.length(args.random_output_len, args.random_range_ratio),
                    )
                ]
            )
            for _ in range(n)
        ]
    if name == "sharegpt":
        return sharegpt_sessions(args, tokenizer)
    if name == "shared-prefix":
        systems = [s.text(args.shared_prefix_len) for _ in range(args.shared_prefix_num_groups)]
        return [
            Session(
                [
                    Turn(
                        s.text(args.shared_prefix_question_len),
                        args.shared_prefix_output_len,
                        systems[i % len(systems)],
                    )
                ]
            )
            for i in range(n)
        ]
    if name == "chat":
        systems = [
            s.text(args.chat_system_prompt_len) for _ in range(max(1, args.chat_num_system_prompts))
        ]
        sessions = []
        for i in range(-(-n // args.chat_num_turns)):
            turns = min(args.chat_num_turns, n - i * args.chat_num_turns)
            sessions.append(
                Session(
                    [
                        Turn(
                            s.text(args.chat_user_len),
                            s.between(args.chat_output_len_min, args.chat_output_len_max),
                            systems[i % len(systems)] if t == 0 else None,
                        )
                        for t in range(turns)
                    ]
                )
            )
        return sessions
    if name == "agent":
        sessions = []
        for i in range(-(-n // args.agent_num_steps)):
            steps = min(args.agent_num_steps, n - i * args.agent_num_steps)
            first = Turn(s.text(args.agent_context_len), args.agent_output_len)
            rest = [
                Turn(s.text(args.agent_step_len), args.agent_output_len) for _ in range(steps - 1)
            ]
            sessions.append(Session([first, *rest]))
        return sessions
    if name == "fan-out":
        prefix = s.text(args.fan_out_prefix_len)
        return [
            Session([Turn(prefix + s.text(args.fan_out_task_len), args.fan_out_output_len)])
            for _ in range(n)
        ]
    return [  # batch
        Session(
            [
                Turn(
                    s.text(s.between(args.batch_input_len_min, args.batch_input_len_max)),
                    s.between(args.batch_output_len_min, args.batch_output_len_max),
                )
            ]
        )
        for _ in range(n)
    ]


def sharegpt_sessions(args: argparse.Namespace, tokenizer: Any) -> list[Session]:
    if not args.dataset_path:
        raise InvalidArgumentError("--dataset-name sharegpt needs --dataset-path FILE")
    try:
        entries = json.loads(Path(args.dataset_path).read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read the ShareGPT file {args.dataset_path}: {e}") from e
    pairs = []
    for entry in entries if isinstance(entries, list) else []:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    order = np.random.default_rng(args.seed).permutation(len(pairs))
    sessions = []
    for i in order.tolist():
        prompt, reply = pairs[i]
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        output_len = args.sharegpt_output_len or len(
            tokenizer.encode(reply, add_special_tokens=False)
        )
        if prompt_len < 4 or output_len < 4 or prompt_len > 1024 or prompt_len + output_len > 2048:
            continue
        sessions.append(Session([Turn(prompt, output_len)]))
        if len(sessions) == args.num_prompts:
            break
    if not sessions:
        raise InvalidArgumentError(f"no usable conversation in {args.dataset_path}")
    return sessions


PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    # Preset -> defaults applied when the user did not set them.
    "chat": {"endpoint": "chat", "request_rate": [2.0]},
    "agent": {"endpoint": "chat", "max_concurrency": 4},
    "fan-out": {"request_rate": [float("inf")]},
    "batch": {"request_rate": [float("inf")]},
}
