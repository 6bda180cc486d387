"""vLLM's `/tokenize` and `/detokenize`: the token ids a prompt or a chat becomes, so a client can count them
before sending, and back."""

from __future__ import annotations

from runner.serving.protocol import APIError, DetokenizeBody, TokenizeBody
from runner.serving.request_params import adds_bos
from runner.serving.serving_base import ServingContext


class ServingTokenization(ServingContext):
    def tokenize(self, body: TokenizeBody) -> dict:
        self.check_model(body.model)
        self.check_size(body)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is None:
            tokens = self.codec.encode(body.prompt, add_special_tokens=adds_bos(body.add_special_tokens, False))
        else:
            tokens = self.chat_prompt(body)[1]
        return {"count": len(tokens), "max_model_len": self.llm.max_seq_len, "tokens": tokens}

    def detokenize(self, body: DetokenizeBody) -> dict:
        self.check_model(body.model)
        vocab = self.llm.manifest.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.codec.decode(body.tokens)}
