"""The ``qwen3_coder`` tool parser for vLLM 0.6.3, registered with its ``ToolParserManager``.

vLLM 0.6.3 has no parser for the format Qwen3.5/3.6 write (``<tool_call><function=name>
<parameter=x>...``); the format itself is read by ``vllm_overrides.qwen3_coder_format``.
The YAML loads this module with ``--tool-parser-plugin`` (``qwen3_coder_plugin.py``) and selects
it with ``--tool-call-parser qwen3_coder``.

Streaming, as vLLM 0.6.3's chat stream generator drives it:

- the parser never answers ``None``: 0.6.3 skips a ``None`` delta *before* it looks at the
  finish reason, so a ``None`` on the last token would lose the stream's finish chunk;
- a call's name goes out when its ``<function=name>`` header is complete, its arguments (one
  JSON string, ``qwen3_coder_format.arguments_json``) when its ``</function>`` arrives;
- with ``n > 1`` vLLM 0.6.3 hands *one* parser instance to every choice; the state is kept per
  choice, selected by ``CURRENT_CHOICE`` (set by ``engines/v0/serving.py`` while a choice's
  output is processed).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from vllm.utils import random_uuid

from vllm_overrides import qwen3_coder_format as fmt

PARSER_NAME = "qwen3_coder"

# The choice (``CompletionOutput.index``) whose text is being parsed in this task.
CURRENT_CHOICE: ContextVar[int] = ContextVar("vllm_overrides_current_choice", default=0)


@dataclass
class _StreamState:
    content_sent: int = 0  # characters of the text already sent as content
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments"} per call
    args_sent: list[str] = field(default_factory=list)  # the arguments string sent per call


class Qwen3CoderToolParser(ToolParser):
    def __init__(self, tokenizer: Any) -> None:
        self._states: dict[int, _StreamState] = {}
        super().__init__(tokenizer)

    # vLLM 0.6.3's stream generator reads these two after the last token of a choice.
    @property
    def _state(self) -> _StreamState:
        return self._states.setdefault(CURRENT_CHOICE.get(), _StreamState())

    @property  # type: ignore[override]
    def prev_tool_call_arr(self) -> list[dict[str, Any]]:
        return self._state.calls

    @prev_tool_call_arr.setter
    def prev_tool_call_arr(self, value: list[dict[str, Any]]) -> None:
        self._state.calls = value

    @property  # type: ignore[override]
    def streamed_args_for_tool(self) -> list[str]:
        return self._state.args_sent

    @streamed_args_for_tool.setter
    def streamed_args_for_tool(self, value: list[str]) -> None:
        self._state.args_sent = value

    def extract_tool_calls(
        self, model_output: str, request: ChatCompletionRequest
    ) -> ExtractedToolCallInformation:
        parsed = fmt.parse(model_output, fmt.tool_schemas(request.tools))
        complete = [c for c in parsed.calls if c.complete]
        if not complete:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=model_output
            )
        calls = [
            ToolCall(function=FunctionCall(name=c.name, arguments=fmt.arguments_json(c)))
            for c in complete
        ]
        content = parsed.content.strip()
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=calls, content=content or None
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage:
        state = self._state
        parsed = fmt.parse(current_text, fmt.tool_schemas(request.tools))
        if parsed.tools_started:
            content_end = len(parsed.content)
        else:
            content_end = len(current_text) - fmt.held_back(current_text)
        content = current_text[state.content_sent : content_end]
        state.content_sent = max(state.content_sent, content_end)

        deltas: list[DeltaToolCall] = []
        for i, call in enumerate(parsed.calls):
            if i == len(state.calls):
                state.calls.append({"name": call.name, "arguments": {}})
                state.args_sent.append("")
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        id=f"chatcmpl-tool-{random_uuid()}",
                        type="function",
                        function=DeltaFunctionCall(name=call.name).model_dump(exclude_none=True),
                    )
                )
            if call.complete and not state.args_sent[i]:
                arguments = fmt.arguments_json(call)
                state.calls[i]["arguments"] = call.arguments
                state.args_sent[i] = arguments
                deltas.append(
                    DeltaToolCall(
                        index=i,
                        function=DeltaFunctionCall(arguments=arguments).model_dump(
                            exclude_none=True
                        ),
                    )
                )
        if deltas:
            return DeltaMessage(content=content or None, tool_calls=deltas)
        return DeltaMessage(content=content)


def register() -> None:
    """Make ``--tool-call-parser qwen3_coder`` resolve to this parser (idempotent)."""
    ToolParserManager.register_module(PARSER_NAME, force=True, module=Qwen3CoderToolParser)


register()
