"""Ingest once: a request's prompts through the chat template and the tokenizer, checked
against the model's limits, before anything goes downstream (the ingress, router/app.py,
sends only token ids and typed parameters to the workers)."""

from __future__ import annotations

from kvray.errors import InvalidArgumentError
from kvray.router.api_error import APIError
from kvray.router.protocol import ChatCompletionRequest, CompletionRequest
from kvray.router.tool_calls import ToolCallParser, parser_for_template


class Ingest:
    """The model's tokenizer and limits (`max_model_len`, `vocab_size`), and the checks a
    request meets before it runs."""

    def __init__(self, tokenizer, limits: dict, model_name: str, tool_call_parser: str | None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        template = getattr(tokenizer, "chat_template", None)
        self.tool_call_parser = tool_call_parser or parser_for_template(template)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist", param="model", code="model_not_found")

    def tool_parser(self, req: ChatCompletionRequest) -> ToolCallParser | None:
        mode = req.tool_mode
        if mode == "none":
            return None
        function = req.forced_function()
        return ToolCallParser(mode, self.tool_call_parser, function.name if function else None)

    def chat_text(
        self, messages, tools, add_generation_prompt: bool = True, continue_final: bool = False
    ) -> str:
        """The conversation through the model's chat template (tools, if any, in it too)."""
        conversation = [m.for_template() for m in messages]
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        return self.tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final,
            continue_final_message=continue_final,
            **extra,
        )

    def prompts(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        """The request's prompts as token ids, each non-empty, shorter than the context
        and in the vocabulary."""
        if isinstance(req, ChatCompletionRequest):
            text = self.chat_text(req.messages, req.tools if req.tool_mode != "none" else None)
            prompts = [(text, self.tokenizer(text, add_special_tokens=False).input_ids)]
        else:
            raw = req.prompt
            if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
                raw = [raw]
            if not raw:
                raise InvalidArgumentError("prompt", req.prompt, "a non-empty prompt")
            prompts = [(p, self.tokenizer(p).input_ids) if isinstance(p, str) else (None, p) for p in raw]
        limit, vocab = self.limits["max_model_len"], self.limits["vocab_size"]
        for _, ids in prompts:
            if not ids:
                raise InvalidArgumentError("prompt", ids, "at least 1 token")
            if len(ids) >= limit:
                raise InvalidArgumentError("prompt", f"<{len(ids)} tokens>", f"fewer than {limit} tokens")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidArgumentError("prompt", "token ids", f"ids in [0, {vocab - 1}]")
        return [ids for _, ids in prompts]

    def check_room(self, req, max_tokens: int | None, prompts: list[list[int]]) -> None:
        """As vLLM's server: a `max_tokens` that the longest prompt leaves no room for in
        the context is a 400, not a completion cut short at `max_model_len`."""
        limit, longest = self.limits["max_model_len"], max(len(ids) for ids in prompts)
        if max_tokens is not None and longest + max_tokens > limit:
            given = getattr(req, "max_completion_tokens", None) is not None
            raise InvalidArgumentError(
                "max_completion_tokens" if given else "max_tokens",
                max_tokens,
                f"at most {limit - longest} for a prompt of {longest} tokens (max_model_len {limit})",
            )
