"""vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize."""

from __future__ import annotations

from starlette.responses import Response

from app.errors import BadRequestError
from app.protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from app.serving.base import OpenAIServing, decode_request, json_response


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, body: bytes) -> Response:
        req: TokenizeRequest = decode_request(body, TokenizeRequest)
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequestError("Give either prompt or messages.", "prompt")
        if req.messages is not None:
            ids = self._render_chat(req)
        else:
            assert req.prompt is not None
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.input_processor.tokenize_prompt(req.prompt, add_special)
        strs = [self.token_texts.text_of(t) for t in ids] if req.return_token_strs else None
        return json_response(TokenizeResponse(len(ids), self.max_model_len, ids, strs))

    def detokenize(self, body: bytes) -> Response:
        req: DetokenizeRequest = decode_request(body, DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.input_processor.limits.vocab_size
        for token_id in req.tokens:
            if not 0 <= token_id < vocab:
                raise BadRequestError(f"Token id {token_id} is out of vocabulary (size {vocab}).", "tokens")
        return json_response(DetokenizeResponse(self.input_processor.tokenizer.decode(req.tokens)))
