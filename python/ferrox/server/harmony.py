"""OpenAI's harmony format (gpt-oss), read back from a chat completion's
text: the model answers in messages, each a header and a body,

```text
<|channel|>analysis<|message|>Let me think.<|end|>
<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>
<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>
(one text; broken into lines here)
```

The `analysis` channel is reasoning, `final` (and a `commentary` without a
recipient, a preamble) is content, and a message addressed
`to=functions.NAME` is a call of that tool whose body is its JSON arguments
(the recipient may also stand in the header before the channel). The
prompt side is the tokenizer's own chat template. The server asks the
engine for this text with the special tokens kept (`skip_special_tokens`
false), since the markers are special tokens. Text that does not begin with
a marker is content as it stands (an output a grammar shaped).

The parser is text-level, so it serves any vocabulary that has these
markers (openai-harmony's own parser needs its o200k vocabulary, which it
fetches over the network on first use).
"""

from __future__ import annotations

import json
import re

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_TERMINATORS = (END, CALL, RETURN)
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_FUNCTIONS = "functions."


class HarmonyStream:
    """Splits a harmony output into reasoning, content and tool calls, fed
    piece by piece (`feed`, then `finish`); a marker split across pieces is
    held back until the next piece decides it."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "first"  # first, header, body, between, plain
        self._kind = "content"  # of the current body: reasoning, content, call
        self._call_name = ""
        self._arguments = ""

    def feed(self, text: str) -> tuple[str, str, list[tuple[str, str]]]:
        """(reasoning, content, finished calls as (name, JSON arguments)) of
        the new text."""
        self._buffer += text
        out = _Pieces()
        while self._buffer:
            if self._state == "first":
                stripped = self._buffer.lstrip()
                if stripped.startswith((CHANNEL, START)) or not stripped:
                    self._state = "between" if stripped.startswith(START) else "header"
                    self._buffer = stripped
                    continue
                if CHANNEL.startswith(stripped) or START.startswith(stripped):
                    break  # "<|cha": wait
                self._state = "plain"
                continue
            if self._state == "plain":
                out.content += self._buffer
                self._buffer = ""
                break
            if self._state == "between":
                if self._buffer.startswith(START):
                    self._buffer = self._buffer[len(START) :]
                    self._state = "header"
                    continue
                if START.startswith(self._buffer):
                    break
                self._state = "header"  # (a message without its start)
                continue
            if self._state == "header":
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    break  # (the header stays in the buffer until its end)
                self._open(self._buffer[:at])
                self._buffer = self._buffer[at + len(MESSAGE) :]
                self._state = "body"
                continue
            # body: up to the first terminator
            ends = [(i, t) for t in _TERMINATORS if (i := self._buffer.find(t)) >= 0]
            if ends:
                at, terminator = min(ends)
                self._body(self._buffer[:at], out)
                self._buffer = self._buffer[at + len(terminator) :]
                self._close(out, complete=True)
                self._state = "between"
                continue
            keep = _partial_marker(self._buffer, (*_TERMINATORS, START))
            self._body(self._buffer[: len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return out.reasoning, out.content, out.calls

    def finish(self) -> tuple[str, str, list[tuple[str, str]]]:
        """What is left at the end of the output: a body cut short (by
        max_tokens, or an end token the text leaves out) ends its message; a
        header never finished is markup, dropped."""
        out = _Pieces()
        rest, self._buffer = self._buffer, ""
        if self._state in ("plain", "first"):
            out.content += rest
        elif self._state == "body":
            self._body(rest, out)
            self._close(out, complete=False)
        self._state = "between"
        return out.reasoning, out.content, out.calls

    def _open(self, header: str) -> None:
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        if recipient and recipient.group(1).startswith(_FUNCTIONS):
            self._kind, self._call_name = "call", recipient.group(1)[len(_FUNCTIONS) :]
            self._arguments = ""
        elif name == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"  # final, or a commentary preamble

    def _body(self, text: str, out: _Pieces) -> None:
        if self._kind == "reasoning":
            out.reasoning += text
        elif self._kind == "call":
            self._arguments += text
        else:
            out.content += text

    def _close(self, out: _Pieces, complete: bool) -> None:
        """Ends a message: a call's arguments become a call (if the message
        ended, or what was cut short still parses as JSON), else content."""
        if self._kind != "call":
            return
        arguments = self._arguments.strip()
        if complete or _parses(arguments):
            out.calls.append((self._call_name, arguments or "{}"))
        else:
            out.content += self._arguments
        self._kind, self._arguments = "content", ""


class _Pieces:
    def __init__(self) -> None:
        self.reasoning = ""
        self.content = ""
        self.calls: list[tuple[str, str]] = []


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-size:]):
                longest = size
                break
    return longest


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
