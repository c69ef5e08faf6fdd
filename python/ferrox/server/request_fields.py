"""Request fields the server does not serve: none is silently ignored.

A top-level field of a request body that the request's struct does not name
is one of three kinds:

- a field of the OpenAI or vLLM API that ferrox does not honour
  (`UNSUPPORTED_FIELDS`): 400 naming it, with the reason;
- a field accepted and deliberately ignored (`IGNORED_FIELDS`): bookkeeping
  for the caller's side (`store`, `metadata`, ...) that cannot change the
  output;
- anything else (a vendor's extension, a typo): accepted, and logged once
  per field name, so that an operator sees what clients send.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from ferrox.server.openai_protocol import BadRequest

logger = logging.getLogger("ferrox.server")

# Fields of the OpenAI / vLLM request bodies that ferrox does not honour, and why.
UNSUPPORTED_FIELDS = {
    "audio": "ferrox serves text-only models",
    "modalities": "ferrox serves text-only models",
    "mm_processor_kwargs": "ferrox serves text-only models",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "ferrox has no web search",
    "functions": "the deprecated functions field is not supported; use tools",
    "function_call": "the deprecated function_call field is not supported; use tool_choice",
    "reasoning_effort": "the model decides how long it reasons; see chat_template_kwargs",
    "verbosity": "output verbosity is not supported",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "truncate_prompt_tokens": "prompts are never truncated; shorten the prompt",
    "allowed_token_ids": "allowed_token_ids is not supported; use structured_outputs",
    "bad_words": "bad_words is not supported; use logit_bias",
    "documents": "retrieval documents in the chat template are not supported",
    "structural_tag": "structural tags are not supported; use structured_outputs",
    "guided_whitespace_pattern": "use structured_outputs.disable_any_whitespace",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "tokens are returned as text",
    "return_token_ids": "token ids are not returned; use /tokenize",
    "cache_salt": "the prefix cache is shared by all requests",
    "kv_transfer_params": "ferrox has no KV transfer",
    "vllm_xargs": "no extension arguments are read",
    "request_id": "the server names every request itself",
}
# Fields accepted and deliberately ignored: they cannot change the output.
IGNORED_FIELDS = frozenset(
    {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)


@dataclass(frozen=True)
class FieldRules:
    """One API's fields beyond its structs': refused with a reason, or ignored."""

    unsupported: Mapping[str, str]
    ignored: frozenset[str]


OPENAI_FIELDS = FieldRules(UNSUPPORTED_FIELDS, IGNORED_FIELDS)

_logged: set[str] = set()
_known: dict[type, frozenset[str]] = {}


def check_fields(
    body: bytes, kind: type[msgspec.Struct], rules: FieldRules = OPENAI_FIELDS
) -> None:
    """Raises BadRequest for an unsupported top-level field of `body`; logs
    an unknown one once. A body that is not a JSON object is left for
    decoding to report."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError):
        return
    known = _known.get(kind)
    if known is None:
        info = msgspec.structs.fields(kind)
        known = _known[kind] = frozenset(f.encode_name for f in info)
    for name in fields:
        if name in known or name in rules.ignored:
            continue
        reason = rules.unsupported.get(name)
        if reason is not None:
            raise BadRequest(f"{name} is not supported by this server: {reason}", param=name)
        if name not in _logged and len(_logged) < 1024:
            _logged.add(name)
            logger.warning(
                "requests carry the field %r, which this server does not know; it is ignored",
                name[:64],
            )
