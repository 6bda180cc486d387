"""Text <-> token ids, chat templates, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer

from engines.format import TokenizerInfo


class ChatTemplateError(ValueError):
    pass


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a file that holds the template, or the template itself."""
    try:
        if Path(value).is_file():
            return Path(value).read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{" not in value:
        raise ChatTemplateError(f"chat template {value!r} is neither a file nor a Jinja template")
    return value


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str):
    """A Jinja chat template, compiled in the sandbox transformers uses (templates come with checkpoints)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not parse: {err} (line {err.lineno})") from None


class TextCodec:
    def __init__(self, tokenizer_file: Path, info: TokenizerInfo) -> None:
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.info = info
        self.bos_id = self._tokenizer.token_to_id(info.bos_token) if info.bos_token else None
        self._template = compile_chat_template(info.chat_template) if info.chat_template else None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @functools.cached_property
    def longest_token(self) -> int:
        """The most characters of text one token stands for, read off the vocabulary's own strings (a byte-level
        token's string has a character per byte, a byte-fallback token's is longer than its one byte): a text of
        more than `k * longest_token` characters cannot encode to k tokens or fewer."""
        return max(len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: start with the BOS token where the tokenizer adds one (once: not before a BOS the
        text, e.g. a chat template's, already starts with)."""
        return self._with_bos(self._tokenizer.encode(text, add_special_tokens=False).ids, add_special_tokens)

    def encode_chat(self, text: str, contents: list[str], add_special_tokens: bool = False) -> list[int]:
        """A rendered chat `text` as ids, where special-token text inside the messages' own `contents` (found in
        `text` in order) stays plain text: only the template writes special tokens, so a message holding
        "<|im_end|><|im_start|>system" cannot open a system turn of its own. ChatTemplateError where such a
        content is not in `text` as it was given (a template that rewrites it)."""
        pieces, cursor = [], 0
        for content in contents:
            if not any(special in content for special in self._special_texts):
                continue  # nothing to keep from the tokenizer's special-token matching
            start = text.find(content, cursor)
            if start < 0:
                raise ChatTemplateError(
                    "a message holds special-token text, and this chat template changes the message, so it cannot "
                    "be kept as plain text (the server's --parse-special-tokens-in-content would read it as tokens)"
                )
            pieces += [(text[cursor:start], self._tokenizer), (content, self._literal_tokenizer)]
            cursor = start + len(content)
        pieces.append((text[cursor:], self._tokenizer))
        ids = [i for piece, tokenizer in pieces if piece for i in tokenizer.encode(piece, add_special_tokens=False).ids]
        return self._with_bos(ids, add_special_tokens)

    @functools.cached_property
    def _special_texts(self) -> list[str]:
        return [token.content for token in self._tokenizer.get_added_tokens_decoder().values() if token.special]

    @functools.cached_property
    def _literal_tokenizer(self):
        """The same tokenizer, reading special-token text as plain text (its own instance: the flag is state)."""
        literal = Tokenizer.from_str(self._tokenizer.to_str())
        literal.encode_special_tokens = True
        return literal

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if (
            add_special_tokens
            and self.info.add_bos_token
            and self.bos_id is not None
            and (not ids or ids[0] != self.bos_id)
        ):
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        documents: list | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The chat as the model reads it. `continue_final_message`: the text ends inside the last message (an
        assistant answer the model goes on with), not after its end-of-turn; `template_kwargs`: more variables for
        the template (e.g. a model's `enable_thinking`), as transformers' apply_chat_template takes them;
        `chat_template`: this template instead of the engine's."""
        template = self._template if chat_template is None else compile_chat_template(chat_template)
        if template is None:
            raise ChatTemplateError("this engine's tokenizer has no chat template (give one: --chat-template)")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ChatTemplateError("each chat message needs a 'role' and a 'content'")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt exclude each other: the first "
                "goes on with the last message, the second starts a new one"
            )
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.info.bos_token or "",
            "eos_token": self.info.eos_token or "",
            "tools": tools,  # templates that describe tools (or documents) read them, as transformers passes them
            "documents": documents,
        }
        clashes = sorted(set(template_kwargs or {}) & set(variables))
        if clashes:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {', '.join(clashes)}")
        text = template.render(**(template_kwargs or {}), **variables)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1]["content"])
        return text


def _cut_after_final_message(text: str, final: str) -> str:
    """The rendered chat up to the end of the last message's content (transformers' continue_final_message rule,
    with the same second try for templates that strip the content's surrounding whitespace)."""
    if not final.strip():
        raise ChatTemplateError("continue_final_message needs a last message with content to go on from")
    for content in (final, final.strip()):
        index = text.rfind(content)
        if index != -1:
            return text[: index + len(content)]
    raise ChatTemplateError("continue_final_message: the last message's content is not in the rendered chat")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text increments, holding back incomplete UTF-8 sequences.

    Each token decodes a short window, not the whole output (that made a step's cost grow with the output): the
    ids from `prefix` on, against the same window without the newest ids. Starting both at a token already shown
    keeps what a tokenizer does at a token boundary (a leading space of a word piece) the same in both."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool = True) -> None:
        self._codec = codec
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # where the window starts: a token or so before the ids not shown yet
        self._shown = 0  # ids up to here are in `text`
        self.text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._codec.decode(self._ids[self._prefix : self._shown], self._skip_special_tokens)
        window = self._codec.decode(self._ids[self._prefix :], self._skip_special_tokens)
        if window.endswith("\ufffd") or len(window) <= len(before):  # a split character: wait for the rest
            return ""
        delta = window[len(before) :]
        self.text += delta
        self._prefix, self._shown = self._shown, len(self._ids)
        return delta
