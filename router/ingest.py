"""Ingest once: a request's prompts through the chat template and the tokenizer, checked
against the model's limits (the engine's own `RequestLimits`) and its grammar compiled,
before anything goes downstream (the ingress, router/app.py, sends only token ids and
typed parameters to the workers)."""

from __future__ import annotations

from kvray.engine import SamplingParams
from kvray.engine.request_limits import RequestLimits
from kvray.engine.structured_outputs import GrammarCompiler
from kvray.errors import InvalidArgumentError, no_chat_template
from kvray.router.api_error import APIError
from kvray.router.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvray.router.tool_calls import ToolCallParser, parser_for_template


class Ingest:
    """The model's tokenizer and the engine's limits, and the checks a request meets
    before it runs: the same `RequestLimits.check` the engine's intake makes, and its
    grammar compiled (cached), so that a bad request is a 400 here, not a failure later."""

    def __init__(
        self,
        tokenizer,
        limits: RequestLimits,
        model_name: str,
        tool_call_parser: str | None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.tokenizer = tokenizer
        self.limits = limits
        self.model_name = model_name
        template = getattr(tokenizer, "chat_template", None)
        self.tool_call_parser = tool_call_parser or parser_for_template(template)
        self.grammars = GrammarCompiler(tokenizer, limits.vocab_size, eos_token_ids)

    def check(self, params: SamplingParams, grammar_field: str = "structured_outputs") -> None:
        """The request's parameters against the model (token ids, stop strings, the
        grammar's size and depth), then its grammar compiled: InvalidArgumentError, a
        grammar's named after the body field that gave it (`grammar_field`)."""
        try:
            self.limits.check_params(params)
            if params.structured_outputs is not None:
                self.grammars.compile(params.structured_outputs)
        except InvalidArgumentError as e:
            if not e.field.startswith("structured_outputs") or grammar_field == "structured_outputs":
                raise
            field = grammar_field + e.field[len("structured_outputs") :]
            raise InvalidArgumentError(field, e.value, e.allowed) from None

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
        if not getattr(self.tokenizer, "chat_template", None):
            raise no_chat_template()
        conversation = [m.for_template() for m in messages]
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if tools else {}
        return self.tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final,
            continue_final_message=continue_final,
            **extra,
        )

    def tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """/tokenize's answer: the ids of the prompt or of the templated messages, and
        their token strings if asked."""
        if req.messages is not None:
            text = self.chat_text(
                req.messages, req.tools, req.add_generation_prompt, req.continue_final_message
            )
            ids = self.tokenizer(text, add_special_tokens=bool(req.add_special_tokens)).input_ids
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.tokenizer(req.prompt, add_special_tokens=add).input_ids
        return ids, self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None

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
        for _, ids in prompts:
            self.limits.check_prompt(ids)
        return [ids for _, ids in prompts]

    def check_room(self, req, max_tokens: int | None, prompts: list[list[int]]) -> None:
        """As vLLM's server: a `max_tokens` that the longest prompt leaves no room for in
        the context is a 400, not a completion cut short at `max_model_len`."""
        limit, longest = self.limits.max_model_len, max(len(ids) for ids in prompts)
        if max_tokens is not None and longest + max_tokens > limit:
            given = getattr(req, "max_completion_tokens", None) is not None
            raise InvalidArgumentError(
                "max_completion_tokens" if given else "max_tokens",
                max_tokens,
                f"at most {limit - longest} for a prompt of {longest} tokens (max_model_len {limit})",
            )
