"""Structured outputs (vLLM's name): a request's tokens held to a JSON schema, to any JSON, to a regular expression
or to one of given strings, by xgrammar (vLLM's default backend, an optional dependency: `pip install xgrammar`;
it imports torch and transformers).

Before each token the request's grammar matcher says which tokens may come next; the others get -inf in the
sampler graph's `logit_bias` row, so every sampling parameter keeps its meaning over the tokens the grammar allows
(vLLM applies its bitmask to the logits the same way), and the chosen token advances the matcher. The grammar ends
the request when it is complete (its end is the stop token). On a speculative engine a draft ends where the grammar
stops allowing it (`draft_prefix`) and every node of the verified tree gets the mask of the grammar's state there
(`tree_masks`, a walk of the matcher with rollback), put on that node's logits (runner/core/engine.py `_verify`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.sampling.compile_process import CompileProcess, GrammarError


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must be: exactly one of a JSON schema, any JSON value, a regular expression, or a choice."""

    json: dict | str | None = None  # a JSON schema (as a dict or its text)
    json_object: bool = False  # any JSON value (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex or choice")
        choice = self.choice
        if choice is not None and (
            not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice)
        ):
            raise ValueError("structured outputs: choice must be a non-empty list of non-empty strings")


# whitespace characters JSON may have in one place: enough to pretty-print a few levels deep, not so many that a
# weak model writes whitespace until max_tokens (unbounded, a random test model did at every temperature)
MAX_WHITESPACE = 8


# seconds a grammar may take to compile for the server's clients (`runner serve --grammar-timeout`): ordinary
# schemas take milliseconds to ~1 s (a JSON grammar over a 49k vocabulary, under load)
DEFAULT_GRAMMAR_TIMEOUT = 10.0
# what a grammar's compile process may allocate beyond what it holds once started (xgrammar and torch imported)
GRAMMAR_MEMORY_MIB = 2048
# compiled grammars kept for requests that use them again, where they compile (xgrammar's cache) and where they are
# used (from a compile process): an ordinary JSON grammar takes ~1 MB
GRAMMAR_CACHE_BYTES = 256 * 2**20


class GrammarCompiler:
    """The engine's vocabulary as xgrammar sees it, and its compiled grammars.

    With a `timeout` (seconds), grammars compile in a child process (`CompileProcess`) that is killed and started
    again when a compile takes longer or needs more than `memory_mib`: a schema whose grammar explodes (a few
    thousand optional properties take tens of seconds and GBs) then costs its request a GrammarError, not the
    process its memory or a core for minutes. Without one they compile here, as long as they take."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        stop_token_ids: list[int],
        timeout: float | None = None,
        memory_mib: int = GRAMMAR_MEMORY_MIB,
    ) -> None:
        self._process = None
        if timeout is not None:  # started first: its imports overlap this process's own
            self._process = CompileProcess(tokenizer_file, vocab_size, stop_token_ids, timeout, memory_mib)
            self._process.start()
        xgrammar = _import_xgrammar()
        self._xgrammar = xgrammar
        self._info = tokenizer_info(tokenizer_file, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = new_compiler(self._info) if timeout is None else None
        self._received: OrderedDict = OrderedDict()  # (kind, source) -> grammar from the compile process
        self._received_lock = threading.Lock()  # grammars are asked for from the server's worker threads

    def constraint(self, spec: StructuredOutputs) -> TokenConstraint:
        """A fresh matcher for one request."""
        if spec.json is not None and not json_schema_satisfiable(spec.json):
            raise GrammarError(
                "no finite JSON value satisfies this schema: every way through it requires a value that contains "
                "itself (a $ref cycle through required properties or non-empty arrays)"
            )
        kind, source = grammar_source(spec)
        if self._process is None:
            grammar = compile_grammar(self._compiler, kind, source)
        else:
            grammar = self._compiled_elsewhere(kind, source)
        constraint = TokenConstraint(self._xgrammar.GrammarMatcher(grammar), self.vocab_size)
        if not constraint.allowed().any():  # (the schema check above cannot see every dead end)
            raise GrammarError("the structured output allows no output: no token may come first")
        return constraint

    def _compiled_elsewhere(self, kind: str, source: str):
        """A grammar from the compile process, kept here too (least recently used out first), since bringing it
        over costs more than compiling an ordinary one (a JSON grammar on a 49k vocabulary: ~1.5 MB serialized,
        ~75 ms to serialize and deserialize) and clients tend to send the same schema again."""
        key = (kind, source)
        with self._received_lock:
            grammar = self._received.pop(key, None)
        if grammar is None:
            grammar = self._xgrammar.CompiledGrammar.deserialize_json(self._process.compile(kind, source), self._info)
        with self._received_lock:
            self._received[key] = grammar  # (re)inserted last: the most recently used
            while sum(g.memory_size_bytes for g in self._received.values()) > GRAMMAR_CACHE_BYTES:
                self._received.pop(next(iter(self._received)))
        return grammar


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError as err:  # itself, or torch / transformers, which it imports
        raise GrammarError(f"structured outputs need xgrammar (pip install xgrammar): {err}") from None
    return xgrammar


def tokenizer_info(tokenizer_file: Path, vocab_size: int, stop_token_ids: list[int]):
    """The engine's vocabulary as an xgrammar TokenizerInfo."""
    xgrammar = _import_xgrammar()
    from tokenizers import Tokenizer

    tokenizer_json = Path(tokenizer_file).read_text()
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab(with_added_tokens=True)
    encoded = [""] * vocab_size  # ids past the tokenizer's (the model's padding rows) decode to nothing
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded[token_id] = token
    # how the vocabulary spells bytes (byte-level "Ġ", SentencePiece byte fallback, raw), as xgrammar's own
    # from_huggingface detects it from the same tokenizer.json
    metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    return xgrammar.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids,
        add_prefix_space=metadata["add_prefix_space"],
    )


def grammar_source(spec: StructuredOutputs) -> tuple[str, str]:
    """("json", a JSON schema's text) or ("regex", a regular expression): what xgrammar compiles for `spec`."""
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json  # OpenAI's JSON mode answers an object
        return "json", schema if isinstance(schema, str) else json.dumps(schema)
    if spec.regex is not None:
        return "regex", spec.regex
    return "regex", "|".join(_regex_literal(c) for c in spec.choice)


def new_compiler(info):
    """An xgrammar GrammarCompiler for the vocabulary `info`, with a bounded cache (unbounded by default)."""
    return _import_xgrammar().GrammarCompiler(info, cache_limit_bytes=GRAMMAR_CACHE_BYTES)


def compile_grammar(compiler, kind: str, source: str):
    """`source` compiled by an xgrammar GrammarCompiler; GrammarError with the parser's message if it cannot be."""
    try:
        if kind == "json":
            return compiler.compile_json_schema(source, max_whitespace_cnt=MAX_WHITESPACE)
        return compiler.compile_regex(source)
    except Exception as err:  # xgrammar raises RuntimeError / ValueError with the parser's message
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(err).splitlines()[0])  # its log prefix: time, source
        raise GrammarError(f"cannot compile the structured output: {message}") from None


def json_schema_satisfiable(schema: dict | str | bool) -> bool:
    """Whether some finite JSON value can satisfy `schema`, as far as required properties, non-empty arrays,
    combinators, enums and $refs within the schema go: `{"$ref": "#"}`, or definitions that require each other
    with no way out, have none. What it cannot tell (another keyword, a reference outside the schema) it takes as
    satisfiable. A reference back to a schema being checked counts as unsatisfiable along that path, which is
    the least fixed point: a value must be finite."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return True  # xgrammar reports what is wrong with it
    root, visiting = schema, set()

    def resolve(ref: str):
        if not ref.startswith("#"):
            return True
        node = root
        for part in (p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return True
        return node

    def satisfiable(node) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict) or id(node) in visiting:
            return not isinstance(node, dict)
        visiting.add(id(node))
        try:
            if "$ref" in node and not satisfiable(resolve(str(node["$ref"]))):
                return False
            if "enum" in node and not node["enum"]:
                return False
            if "anyOf" in node or "oneOf" in node:
                if not any(satisfiable(option) for option in node.get("anyOf", []) + node.get("oneOf", [])):
                    return False
            if not all(satisfiable(part) for part in node.get("allOf", [])):
                return False
            kinds = node.get("type")
            kinds = kinds if isinstance(kinds, list) else [kinds]
            return any(_kind_satisfiable(node, kind, satisfiable) for kind in kinds)
        finally:
            visiting.discard(id(node))

    return satisfiable(schema)


def _kind_satisfiable(node: dict, kind, satisfiable) -> bool:
    """One `type` of a schema node (None: whatever the node's keywords make it)."""
    if kind in ("object", None):
        properties = node.get("properties") or {}
        if not all(satisfiable(properties[name]) for name in node.get("required", []) if name in properties):
            return False
    if kind in ("array", None) and (node.get("minItems") or 0) > 0:
        items = node.get("items", True)
        if isinstance(items, (dict, bool)) and not satisfiable(items):
            return False
    return True


class TokenConstraint:
    """One request's place in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
        self._vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar lets come next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[: self._vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} breaks the request's grammar")  # the mask makes this unreachable

    @property
    def complete(self) -> bool:
        """The grammar has taken its stop token: nothing more may come."""
        return self._matcher.is_terminated()

    def _advance(self, tokens: list[int]) -> int:
        """Take `tokens` while the grammar allows them; how many it took (`_rollback` them after)."""
        taken = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                break
            taken += 1
        return taken

    def _rollback(self, taken: int) -> None:
        if taken:
            self._matcher.rollback(taken)

    def draft_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of a draft the grammar allows from here (the matcher is left where it was)."""
        taken = self._advance(tokens)
        self._rollback(taken)
        return list(tokens[:taken])

    def allowed_after(self, tokens: list[int]) -> np.ndarray | None:
        """[vocab] bool: the tokens allowed after `tokens` (the matcher is left where it was); None where the grammar
        does not allow them or ends within them."""
        taken = self._advance(tokens)
        allowed = None if taken < len(tokens) or self._matcher.is_terminated() else self.allowed()
        self._rollback(taken)
        return allowed

    def tree_masks(self, tokens: list[int], parents: list[int]) -> np.ndarray:
        """[nodes, vocab] bool: the tokens the grammar allows after each node of a draft tree (node 0: the token it
        has taken last; every other node's token allowed after its parent, see `draft_prefix`). After the grammar's
        end nothing is masked: the request ends there."""
        masks = np.ones((len(tokens), self._vocab_size), bool)
        children = [[c for c in range(1, len(tokens)) if parents[c] == node] for node in range(len(tokens))]

        def visit(node: int) -> None:
            if self._matcher.is_terminated():
                return
            masks[node] = self.allowed()
            for child in children[node]:
                if self._matcher.accept_token(int(tokens[child])):
                    visit(child)
                    self._matcher.rollback(1)

        visit(0)
        return masks


def _regex_literal(text: str) -> str:
    special = set(r"\.^$|?*+()[]{}")
    return "".join("\\" + c if c in special else c for c in text)
