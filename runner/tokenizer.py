"""Text <-> token ids, chat templates, and incremental detokenization for streaming."""

from __future__ import annotations

from pathlib import Path

from engines.format import TokenizerInfo


class ChatTemplateError(ValueError):
    pass


class TextCodec:
    def __init__(self, tokenizer_file: Path, info: TokenizerInfo) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.info = info
        self.bos_id = self._tokenizer.token_to_id(info.bos_token) if info.bos_token else None
        self._template = None
        if info.chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ChatTemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(info.chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if self.info.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        if self._template is None:
            raise ChatTemplateError("this engine's tokenizer has no chat template")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ChatTemplateError("each chat message needs a 'role' and a 'content'")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.info.bos_token or "",
            eos_token=self.info.eos_token or "",
            tools=tools,  # templates that describe tools to the model read them (transformers passes them the same way)
        )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text increments, holding back incomplete UTF-8 sequences.

    Each token decodes a short window, not the whole output (that made a step's cost grow with the output): the
    ids from `prefix` on, against the same window without the newest ids. Starting both at a token already shown
    keeps what a tokenizer does at a token boundary (a leading space of a word piece) the same in both."""

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0  # where the window starts: a token or so before the ids not shown yet
        self._shown = 0  # ids up to here are in `text`
        self.text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._codec.decode(self._ids[self._prefix:self._shown])
        window = self._codec.decode(self._ids[self._prefix:])
        if window.endswith("\ufffd") or len(window) <= len(before):  # a split character: wait for the rest
            return ""
        delta = window[len(before):]
        self.text += delta
        self._prefix, self._shown = self._shown, len(self._ids)
        return delta
