"""The router's tokenizer, built from what a worker's Info sends: no model files in the router.

Workers of one model send the same tokenizer, so instances are shared, keyed by a digest of the
tokenizer fields of Info. Text prompts are encoded with the tokenizer's own special-token rule
(a Llama 3 tokenizer adds its BOS token, SmolLM2's adds nothing); a chat is rendered with the
chat template, which writes any special tokens itself, and encoded without adding more.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from tokenizers import Tokenizer

from common.pb import worker_pb2

# Special tokens tokenizer_config.json may name, as transformers' constructor arguments.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered with the model's chat template."""


class RouterTokenizer:
    """Encodes prompts and decodes tokens exactly as the router's Generate does. Encoding and
    decoding are safe from several threads (long prompts are tokenized off the event loop)."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer  # a transformers fast tokenizer; the detokenizer reads it too
        self._token_texts: dict[int, str] = {}
        self._byte_level = _decodes_byte_level(json.loads(hf_tokenizer.backend_tokenizer.to_str()).get("decoder"))

    @classmethod
    def from_info(cls, info: worker_pb2.InfoResponse) -> RouterTokenizer:
        from transformers import PreTrainedTokenizerFast  # heavy import, only when first needed

        config = json.loads(info.tokenizer_config_json or "{}")
        special = {key: _token_content(config[key]) for key in _SPECIAL_TOKEN_KEYS
                   if config.get(key) is not None}
        if info.bos_token:
            special["bos_token"] = info.bos_token
        if info.eos_token:
            special["eos_token"] = info.eos_token
        backend = Tokenizer.from_str(info.tokenizer_json.decode())
        return cls(PreTrainedTokenizerFast(tokenizer_object=backend,
                                           chat_template=info.chat_template or None, **special))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    # The *_batch calls of `tokenizers`, unlike encode/decode, let go of the GIL while they
    # work: a prompt of megabytes takes seconds to encode, and holding the GIL that long
    # would stall the router's event loop, and every other client with it.

    def encode_text(self, text: str) -> list[int]:
        return self.hf.backend_tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, continue_final_message: bool = False,
                    template_kwargs: dict | None = None) -> list[int]:
        """Renders the conversation (and the `tools` it may call) with the chat template, then
        encodes it; raises ChatTemplateError when the model has no template or the template
        refuses the chat. `continue_final_message`: the last message is left open (transformers
        cuts the rendering after its content); `template_kwargs`: more template variables."""
        if not self.has_chat_template:
            raise ChatTemplateError("the model has no chat template; send text or token_ids")
        try:
            prompt = self.hf.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(template_kwargs or {}))
        except Exception as error:  # jinja errors, including the template's raise_exception()
            message = f"the chat template cannot render this chat: {error}"
            raise ChatTemplateError(message) from error
        return self.hf.backend_tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.backend_tokenizer.decode_batch([list(token_ids)],
                                                      skip_special_tokens=skip_special_tokens)[0]

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens included (for logprobs)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.backend_tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text


    def token_piece(self, token_id: int) -> str:
        """The token's string in the vocabulary ("Ġlove", "<0xE2>"), or "" for an unknown id."""
        return self.hf.backend_tokenizer.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, also when they are part of a UTF-8 character (which decoding
        a token on its own turns into U+FFFD): a byte-level token's characters mapped back to
        their bytes, a byte-fallback token (`<0xE2>`) its byte, any other its decoded text."""
        piece = self.token_piece(token_id)
        if self._byte_level and piece and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return self.token_text(token_id).encode()


def _byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE (GPT-2's) writes bytes as: printable ones stand for
    themselves, the other 68 bytes are shifted to code points from 256 up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decodes_byte_level(decoder: dict | None) -> bool:
    """Whether the tokenizer's decoder (tokenizer.json's) is, or holds, a ByteLevel one."""
    if not decoder:
        return False
    return decoder.get("type") == "ByteLevel" or any(
        _decodes_byte_level(d) for d in decoder.get("decoders") or ())


def _token_content(value: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return value["content"] if isinstance(value, dict) else value


_shared: dict[str, RouterTokenizer] = {}


def tokenizer_for(info: worker_pb2.InfoResponse) -> RouterTokenizer:
    """The tokenizer of a worker's model, shared with every worker that sends the same one.
    Blocking (building one takes a fraction of a second): run it in a thread."""
    digest = hashlib.sha256()
    for part in (info.tokenizer_json, info.tokenizer_config_json.encode(),
                 info.chat_template.encode(), info.bos_token.encode(), info.eos_token.encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    key = digest.hexdigest()
    if key not in _shared:
        _shared[key] = RouterTokenizer.from_info(info)
    return _shared[key]
