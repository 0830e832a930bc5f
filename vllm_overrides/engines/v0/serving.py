"""vLLM 0.6.3's OpenAI serving classes with what the platform line adds (patch 0010 selects them).

Subclasses, no copied code: each override wraps the parent's method, feeding it the engine's
outputs and rewriting what it yields.

- Reasoning (0.6.3 has no reasoning parsers): the engine's text is split into reasoning and
  content *before* the parent sees it (``vllm_overrides.reasoning``; the text starts inside the
  reasoning when the prompt's last think marker opens a block), so tool calls are parsed from
  the content only; answers and stream deltas carry ``reasoning_content`` and ``reasoning``.
- ``tool_choice`` ``"none"`` and ``"required"`` (0.6.3 refuses both; ``request_rules`` passes
  them in a header): ``none`` renders the tools and parses no call; ``required`` with one tool is
  that tool named, with several a JSON grammar of a non-empty list of calls, returned as
  ``tool_calls`` with finish reason ``tool_calls``.
- Output budget: a ``max_tokens`` larger than what the prompt leaves is fitted to it (finish
  ``length``), as vLLM 0.32.0 does; 0.6.3 answers 400.
- Streams: usage counts every choice's tokens (0.6.3 counts the last choice's only); a named
  tool call's delta carries the name and id once; reasoning deltas ride on the chunk of their
  choice; the ``n > 1`` choices each get their own tool-parser state.
- ``usage.prompt_tokens_details.cached_tokens`` where the engine reports a prefix-cache hit
  (``RequestOutput.num_cached_tokens``, set by the engine's prefix-cache code when present).
- A prompt the engine can never schedule is a 400, not a 200 with no tokens: 0.6.3's block
  manager answers ``NEVER`` for a prompt that needs more KV blocks than the pool minus its 1 %
  watermark, the scheduler marks it ``FINISHED_IGNORED`` (a warning in the log) and the engine
  returns it finished with no token. That decision is made in the engine process (the API
  process's config never learns ``num_gpu_blocks`` under the multiprocessing frontend), so the
  engine's own answer is the signal: such an output raises :class:`PromptNeverScheduled`,
  which becomes an OpenAI error body with status 400 -- for streams too, since the first event
  is awaited before the response starts (it comes with the first output either way).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from vllm.entrypoints.openai.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.logger import init_logger
from vllm.utils import random_uuid

from vllm_overrides.engines.v0.request_rules import MARKER_HEADER
from vllm_overrides.engines.v0.tool_parser import CURRENT_CHOICE, Qwen3CoderToolParser
from vllm_overrides.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    ThinkSplitter,
    prompt_opens_reasoning,
)

logger = init_logger("vllm.overrides.v0.serving")

# id(request) -> the tools of a "required" choice served through the list-of-calls grammar.
_REQUIRED_LIST: dict[int, list[str]] = {}


def required_calls_schema(tools: list[Any]) -> dict[str, Any]:
    """A JSON schema for a non-empty list of ``{"name", "parameters"}`` calls of ``tools``."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": options}}


def calls_from_list(text: str) -> list[dict[str, Any]] | None:
    """The tool calls of a ``required_calls_schema`` answer, as OpenAI ``tool_calls``."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(
            {
                "id": f"chatcmpl-tool-{random_uuid()}",
                "type": "function",
                "function": {
                    "name": item["name"],
                    "arguments": json.dumps(item.get("parameters", {})),
                },
            }
        )
    return calls


MEDIA_PARTS = ("image_url", "audio_url", "video_url")


def _media_param(messages: Any) -> str | None:
    """The first media part of ``messages`` (as ``messages[i].content[j]``), or None."""
    for i, message in enumerate(messages or []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                return f"messages[{i}].content[{j}]"
    return None


def _refuse_media(serving: Any, messages: Any) -> ErrorResponse | None:
    """Media sent to a model that takes none is the client's error, caught before the engine.

    vLLM 0.6.3 lets one image per prompt through to any model (its default limit is 1 per
    modality); a text-only model's engine then fails on it and the whole engine goes down.
    """
    if getattr(serving.model_config, "multimodal_config", None) is not None:
        return None
    where = _media_param(messages)
    if where is None:
        return None
    return ErrorResponse(
        message=f"{where}: this model takes text only; media input is not supported",
        type="BadRequestError",
        param=where,
        code=400,
    )


NEVER_SCHEDULED = "can never be scheduled"


class PromptNeverScheduled(ValueError):
    """The engine ignored a prompt it can never fit into its KV cache (see module docstring)."""

    def __init__(self, prompt_tokens: int) -> None:
        super().__init__(
            f"This prompt ({prompt_tokens:,} tokens) {NEVER_SCHEDULED}: it needs more KV-cache "
            "blocks than the engine has (its GPU blocks less the block manager's 1 % "
            "watermark). Shorten the prompt."
        )


def never_scheduled(res: Any) -> bool:
    """What 0.6.3's engine returns for a ``FINISHED_IGNORED`` sequence group: finished, every
    choice with finish ``length``, and never scheduled (``metrics.first_scheduled_time`` is
    None: the scheduler sets it on the first step that runs the group). Without metrics (an
    engine that sends none) the outputs decide: no token at all (``max_tokens`` >= 1, so a
    served request always has one). Not the token ids when metrics exist: a streamed (delta)
    ignored output carries the whole prompt as its "new" ids (0.6.3 slices ``ids[-0:]``)."""
    outputs = getattr(res, "outputs", None) or []
    if not (getattr(res, "finished", False) and outputs):
        return False
    if not all(o.finish_reason == "length" and not o.text for o in outputs):
        return False
    metrics = getattr(res, "metrics", None)
    if metrics is not None:
        return metrics.first_scheduled_time is None and metrics.first_token_time is None
    return all(not o.token_ids for o in outputs)


async def _refuse_ignored(results: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for res in results:
        if never_scheduled(res):
            raise PromptNeverScheduled(len(res.prompt_token_ids or ()))
        yield res


def _stream_error(event: str) -> str | None:
    """The message of a ``data: {"error": {...}}`` stream event (0.6.3's
    ``create_streaming_error_response``), else None."""
    if not event.startswith("data: {"):
        return None
    try:
        payload = json.loads(event[len("data: ") :])
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    return error.get("message") if isinstance(error, dict) else None


async def _first_event_or_error(serving: Any, response: Any) -> Any:
    """For a streamed answer: await its first event; a never-schedulable prompt's error event
    becomes a 400 response, anything else is streamed as it would have been."""
    if not hasattr(response, "__anext__"):
        return response
    try:
        first = await response.__anext__()
    except StopAsyncIteration:
        return response
    message = _stream_error(first)
    if message is not None and NEVER_SCHEDULED in message:
        return serving.create_error_response(message)

    async def chained() -> AsyncIterator[str]:
        yield first
        async for event in response:
            yield event

    return chained()


class _BudgetFit:
    """``max_tokens`` above what the prompt leaves is fitted to it (0.6.3 answers 400)."""

    max_model_len: int

    def _validate_input(self, request: Any, input_ids: list[int], input_text: str) -> Any:
        if isinstance(request, (ChatCompletionRequest, CompletionRequest)):
            room = self.max_model_len - len(input_ids)
            if request.max_tokens is not None and 0 < room < request.max_tokens:
                request.max_tokens = room
        return super()._validate_input(request, input_ids, input_text)  # type: ignore[misc]


def _think_ids(tokenizer: Any) -> tuple[int | None, int | None]:
    vocab = tokenizer.get_vocab()
    return vocab.get(THINK_OPEN), vocab.get(THINK_CLOSE)


def _compact(payload: dict[str, Any]) -> str:
    """JSON as vLLM's own events are written (pydantic: no spaces, UTF-8 kept)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _usage_details(usage: dict[str, Any], cached: int | None) -> None:
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}


class _Tap:
    """Between the engine and 0.6.3's generators: splits reasoning off, counts, remembers."""

    def __init__(self, tokenizer: Any, stream: bool) -> None:
        self.think_ids = _think_ids(tokenizer)
        self.stream = stream
        self.splitters: dict[int, ThinkSplitter] = {}
        self.reasoning: dict[int, str] = {}  # full answers: per choice; streams: not yet sent
        self.tokens: dict[int, int] = {}
        self.cached: int | None = None
        self.in_reasoning: bool | None = None

    def _split(self, index: int, text: str, last: bool) -> str:
        splitter = self.splitters.get(index)
        if splitter is None:
            splitter = self.splitters[index] = ThinkSplitter(bool(self.in_reasoning))
        reasoning, content = splitter.feed(text)
        if last:
            more_reasoning, more_content = splitter.flush()
            reasoning += more_reasoning
            content += more_content
        if reasoning:
            self.reasoning[index] = self.reasoning.get(index, "") + reasoning
        return content

    async def wrap(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for res in results:
            if self.in_reasoning is None and res.prompt_token_ids is not None:
                self.in_reasoning = prompt_opens_reasoning(res.prompt_token_ids, *self.think_ids)
            cached = getattr(res, "num_cached_tokens", None)
            if cached is not None:
                self.cached = cached
            outputs = list(res.outputs)
            for output in outputs:
                if self.stream:
                    self.tokens[output.index] = self.tokens.get(output.index, 0) + len(
                        output.token_ids
                    )
                else:
                    self.tokens[output.index] = len(output.token_ids)
                output.text = self._split(
                    output.index, output.text, last=not self.stream or output.finished()
                )
            if not self.stream or len(outputs) <= 1:
                if outputs:
                    CURRENT_CHOICE.set(outputs[0].index)
                yield res
                continue
            # One output per RequestOutput: the parent then handles one choice at a time, and
            # the tool parser and the reasoning know whose text they see.
            for output in outputs:
                single = copy.copy(res)
                single.outputs = [output]
                CURRENT_CHOICE.set(output.index)
                yield single


# Set from the server's arguments by ``api.install_api_compat`` (the serving classes are built
# by vLLM from the engine's model config, which does not carry the scheduler's limits).
SCHEDULER = {"max_num_seqs": None}


class _FanOutClient:
    """The engine client, with ``n`` above ``--max-num-seqs`` served as ``n`` one-sequence
    requests, merged back into one answer.

    0.6.3's scheduler never admits a sequence group wider than ``max_num_seqs`` (and at the
    head of its queue it would hold back every later prompt); vLLM 0.32.0 serves such a
    request one choice after the other. The choices are the same kind of samples: each its own
    request, with ``seed + i`` where the client gave a seed so that the choices differ.
    """

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, inputs: Any, params: Any, request_id: str, **kw: Any) -> Any:
        limit = SCHEDULER["max_num_seqs"]
        n = getattr(params, "n", 1) or 1
        if limit is None or n <= limit or getattr(params, "_real_n", None):
            return _refuse_ignored(self._client.generate(inputs, params, request_id, **kw))
        return _refuse_ignored(self._fan_out(inputs, params, request_id, n, **kw))

    async def _fan_out(self, inputs: Any, params: Any, request_id: str, n: int, **kw: Any):
        from vllm.sampling_params import RequestOutputKind

        subs = []
        for i in range(n):
            one = params.clone()
            one.n, one.best_of = 1, None
            if params.seed is not None:
                one.seed = params.seed + i
            subs.append(self._client.generate(inputs, one, f"{request_id}-{i}", **kw))
        if params.output_kind != RequestOutputKind.DELTA:
            finals = []
            for i, sub in enumerate(subs):  # the engine queues them; awaited in order
                last = None
                async for res in sub:
                    last = res
                for output in last.outputs:
                    output.index = i
                finals.append(last)
            merged = finals[0]
            merged.outputs = [o for res in finals for o in res.outputs]
            cached = [getattr(r, "num_cached_tokens", None) for r in finals]
            if cached[0] is not None:
                merged.num_cached_tokens = cached[0]
            yield merged
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, sub: Any) -> None:
            try:
                async for res in sub:
                    for output in res.outputs:
                        output.index = i
                    await queue.put(res)
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i, sub)) for i, sub in enumerate(subs)]
        try:
            done = 0
            while done < n:
                item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()


class V0ServingChat(_BudgetFit, OpenAIServingChat):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engine_client = _FanOutClient(self.engine_client)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Any = None):
        refused = _refuse_media(self, request.messages)
        if refused is not None:
            return refused
        marker = None
        if raw_request is not None:
            marker = raw_request.headers.get(MARKER_HEADER.decode())
        if marker == "none":
            request.tool_choice = "none"
        elif marker == "required" and request.tools:
            if len(request.tools) == 1:
                name = request.tools[0].function.name
                request.tool_choice = ChatCompletionNamedToolChoiceParam(
                    function={"name": name}, type="function"
                )
            else:
                request.tool_choice = "none"
                request.guided_json = required_calls_schema(request.tools)
                _REQUIRED_LIST[id(request)] = [t.function.name for t in request.tools]
        try:
            response = await super().create_chat_completion(request, raw_request)
            return await _first_event_or_error(self, response) if request.stream else response
        finally:
            if not request.stream:
                _REQUIRED_LIST.pop(id(request), None)

    def _should_check_for_unstreamed_tool_arg_tokens(self, delta_message: Any, output: Any) -> bool:
        # Our parser sends a call's arguments whole; 0.6.3's check would replace that delta.
        parser = self.tool_parser
        if isinstance(parser, type) and issubclass(parser, Qwen3CoderToolParser):
            return False
        return super()._should_check_for_unstreamed_tool_arg_tokens(delta_message, output)

    async def chat_completion_full_generator(
        self, request, result_generator, request_id, conversation, tokenizer, request_metadata
    ):
        tap = _Tap(tokenizer, stream=False)
        try:
            response = await super().chat_completion_full_generator(
                request, tap.wrap(result_generator), request_id, conversation, tokenizer,
                request_metadata,
            )  # fmt: skip
        except PromptNeverScheduled as exc:
            _REQUIRED_LIST.pop(id(request), None)
            return self.create_error_response(str(exc))
        required = _REQUIRED_LIST.pop(id(request), None)
        if not isinstance(response, ChatCompletionResponse):
            return response
        payload = response.model_dump()
        for choice in payload["choices"]:
            message = choice["message"]
            reasoning = tap.reasoning.get(choice["index"])
            if reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning
                if message.get("content") == "":
                    message["content"] = None
            if required is not None:
                calls = calls_from_list(message.get("content") or "")
                if calls is not None:
                    message["content"] = None
                    message["tool_calls"] = calls
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
        _usage_details(payload["usage"], tap.cached)
        return _DumpedChatResponse.of(payload)

    async def chat_completion_stream_generator(
        self, request, result_generator, request_id, conversation, tokenizer, request_metadata
    ) -> AsyncGenerator[str, None]:
        tap = _Tap(tokenizer, stream=True)
        required = _REQUIRED_LIST.pop(id(request), None)
        named = isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
        rewriter = _StreamRewriter(tap, required is not None, named)
        async for event in super().chat_completion_stream_generator(
            request, tap.wrap(result_generator), request_id, conversation, tokenizer,
            request_metadata,
        ):  # fmt: skip
            for out in rewriter.rewrite(event):
                yield out


class _DumpedChatResponse(ChatCompletionResponse):
    """A chat answer already dumped to a dict; 0.6.3's route calls ``model_dump`` on it."""

    @classmethod
    def of(cls, payload: dict[str, Any]) -> _DumpedChatResponse:
        # No validation: the payload holds fields 0.6.3's models forbid (reasoning_content,
        # prompt_tokens_details); it was dumped from a validated response.
        response = cls.model_construct(**payload)
        object.__setattr__(response, "_payload", payload)
        return response

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._payload  # type: ignore[attr-defined, no-any-return]


class _StreamRewriter:
    """Rewrites 0.6.3's chat stream events (``data: {...}``) with what ``_Tap`` saw."""

    def __init__(self, tap: _Tap, required_list: bool, named: bool) -> None:
        self.tap = tap
        self.required_list = required_list
        self.named = named
        self.named_started: set[int] = set()
        self.required_text: dict[int, str] = {}

    def _reasoning_delta(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        index = choice.get("index", 0)
        pending = self.tap.reasoning.pop(index, "")
        if not pending or not isinstance(delta, dict):
            if pending:
                self.tap.reasoning[index] = pending
            return
        delta["reasoning_content"] = delta["reasoning"] = pending
        if delta.get("content") == "":
            delta.pop("content")

    def _named(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        for call in choice.get("delta", {}).get("tool_calls") or []:
            function = call.get("function") or {}
            if index in self.named_started:
                function.pop("name", None)
            else:
                self.named_started.add(index)
                call["id"] = f"chatcmpl-tool-{random_uuid()}"
                call["type"] = "function"
            call["index"] = 0  # the one named call of this choice

    def _required(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        delta = choice.get("delta") or {}
        text = delta.pop("content", None)
        if isinstance(text, str):
            self.required_text[index] = self.required_text.get(index, "") + text
        if choice.get("finish_reason") is None:
            return
        calls = calls_from_list(self.required_text.get(index, ""))
        if calls is None:
            delta["content"] = self.required_text.get(index, "")  # what the model wrote
            return
        delta["tool_calls"] = [
            {**call, "index": i} for i, call in enumerate(calls)
        ]  # fmt: skip
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"

    def _usage(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if not isinstance(usage, dict):
            return
        choices = payload.get("choices") or []
        if choices:  # a per-chunk usage: this choice's tokens so far
            done = self.tap.tokens.get(choices[0].get("index", 0), 0)
        else:  # the final usage chunk: every choice
            done = sum(self.tap.tokens.values())
            _usage_details(usage, self.tap.cached)
        usage["completion_tokens"] = done
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + done

    def rewrite(self, event: str) -> list[str]:
        if not event.startswith("data: {"):
            return [event]
        try:
            payload = json.loads(event[len("data: ") :])
        except ValueError:
            return [event]
        for choice in payload.get("choices") or []:
            if not isinstance(choice, dict) or "role" in (choice.get("delta") or {}):
                continue
            self._reasoning_delta(choice)
            if self.named:
                self._named(choice)
            if self.required_list:
                self._required(choice)
        self._usage(payload)
        return [f"data: {_compact(payload)}\n\n"]


class _DumpedCompletionResponse(CompletionResponse):
    """A completion answer already dumped to a dict (see ``_DumpedChatResponse``)."""

    @classmethod
    def of(cls, payload: dict[str, Any]) -> _DumpedCompletionResponse:
        response = cls.model_construct(**payload)
        object.__setattr__(response, "_payload", payload)
        return response

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._payload  # type: ignore[attr-defined, no-any-return]


def _cached_sum(results: list[Any]) -> int | None:
    counts = [getattr(res, "num_cached_tokens", None) for res in results]
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


class _RefusingClient:
    """The engine client, with never-schedulable prompts raised (completions: 0.6.3 turns the
    ValueError into a 400 itself, or into a stream error event)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, *args: Any, **kw: Any) -> Any:
        return _refuse_ignored(self._client.generate(*args, **kw))


class V0ServingCompletion(_BudgetFit, OpenAIServingCompletion):
    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engine_client = _RefusingClient(self.engine_client)

    async def create_completion(self, request: CompletionRequest, raw_request: Any = None):
        response = await super().create_completion(request, raw_request)
        return await _first_event_or_error(self, response) if request.stream else response

    def request_output_to_completion_response(self, final_res_batch, *args: Any, **kw: Any):
        response = super().request_output_to_completion_response(final_res_batch, *args, **kw)
        cached = _cached_sum(list(final_res_batch))
        if cached is None or not isinstance(response, CompletionResponse):
            return response
        payload = response.model_dump()
        _usage_details(payload["usage"], cached)
        return _DumpedCompletionResponse.of(payload)

    async def completion_stream_generator(self, request, result_generator, *args: Any, **kw: Any):
        counts: dict[int, int] = {}
        cached: dict[int, int] = {}
        num_choices = 1 if request.n is None else request.n

        async def counted(results: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for prompt_idx, res in results:
                for output in res.outputs:
                    i = output.index + prompt_idx * num_choices
                    counts[i] = counts.get(i, 0) + len(output.token_ids)
                if getattr(res, "num_cached_tokens", None) is not None:
                    cached[prompt_idx] = res.num_cached_tokens
                yield prompt_idx, res

        stream = super().completion_stream_generator(
            request, counted(result_generator), *args, **kw
        )
        async for event in stream:
            yield _completion_usage(event, counts, cached)


def _completion_usage(event: str, counts: dict[int, int], cached: dict[int, int]) -> str:
    if not event.startswith("data: {") or '"usage"' not in event:
        return event
    payload = json.loads(event[len("data: ") :])
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return event
    choices = payload.get("choices") or []
    if choices:
        done = counts.get(choices[0]["index"], 0)
    else:  # the final usage chunk: every choice of every prompt
        done = sum(counts.values())
        _usage_details(usage, sum(cached.values()) if cached else None)
    usage["completion_tokens"] = done
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + done
    return f"data: {_compact(payload)}\n\n"


class V0ServingTokenization(OpenAIServingTokenization):
    async def create_tokenize(self, request: Any) -> Any:
        refused = _refuse_media(self, getattr(request, "messages", None))
        if refused is not None:
            return refused
        try:
            return await super().create_tokenize(request)
        except Exception as exc:  # noqa: BLE001 - as 0.6.3's chat path: the input could not be read
            # 0.6.3 answers chat requests whose media cannot be loaded with a 400, but lets the
            # same failure escape /tokenize as a 500.
            logger.info("tokenize request refused: %s", exc)
            return self.create_error_response(f"{type(exc).__name__}: {exc}"[:300])


__all__ = ["V0ServingChat", "V0ServingCompletion", "V0ServingTokenization"]
