"""A stand-in engine client and tokenizer for driving vLLM 0.6.3's serving classes in tests.

The engine client yields the ``RequestOutput`` objects a test scripts (its text is the test's,
never a model's); the tokenizer is a word-level one whose vocabulary holds the Qwen chat and
think markers as single tokens, so prompts render through our chat template and the serving
layer sees the same marker tokens as with the real tokenizer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = REPO / "chat_template_multi_system.jinja"
MARKERS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
           "<|endoftext|>"]  # fmt: skip


def make_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", *MARKERS, "user", "assistant", "system", "tool", "hi", "\n"]
    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]",
                                  eos_token="<|im_end|>")  # fmt: skip
    tok.add_tokens(MARKERS)  # atomic, and kept in decoded text like Qwen's markers
    return tok


class FakeEngine:
    """``EngineClient`` enough for ``OpenAIServingChat``: scripted outputs per request."""

    errored = False

    def __init__(
        self,
        tokenizer: Any,
        script: list[list[tuple[int, str, int, str | None]]],
        num_cached_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # script: one list per engine step of (choice index, text, token count, finish reason)
        self.script = script
        self.num_cached_tokens = num_cached_tokens
        self.prompts: list[list[int]] = []
        self.params: list[Any] = []

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self.tokenizer

    async def is_tracing_enabled(self) -> bool:
        return False

    async def generate(self, inputs: Any, params: Any, request_id: str, **_: Any
                       ) -> AsyncIterator[Any]:  # fmt: skip
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = list(inputs["prompt_token_ids"])
        self.prompts.append(prompt_ids)
        self.params.append(params)
        delta = params.output_kind == RequestOutputKind.DELTA
        texts: dict[int, str] = {}
        counts: dict[int, int] = {}
        steps = self.script
        for n, step in enumerate(steps):
            outputs = []
            for index, text, tokens, finish in step:
                texts[index] = texts.get(index, "") + text
                counts[index] = counts.get(index, 0) + tokens
                shown, ids = (text, [7] * tokens) if delta else (texts[index], [7] * counts[index])
                outputs.append(CompletionOutput(index, shown, ids, 0.0, None, finish))
            last = n == len(steps) - 1
            if not delta and not last:
                continue
            res = RequestOutput(request_id, None, prompt_ids, None, outputs, last)
            if self.num_cached_tokens is not None:
                res.num_cached_tokens = self.num_cached_tokens
            yield res


def make_chat(engine: FakeEngine, max_model_len: int = 4096) -> Any:
    from vllm.entrypoints.openai.serving_engine import BaseModelPath

    from vllm_overrides.engines.v0.serving import SCHEDULER, V0ServingChat

    SCHEDULER["max_num_seqs"] = None  # a server's setting; an HTTP test may have set one

    model_config = SimpleNamespace(
        max_model_len=max_model_len, multimodal_config=None,
        hf_config=SimpleNamespace(model_type="qwen3_5_moe"),
    )  # fmt: skip
    return V0ServingChat(
        engine, model_config, [BaseModelPath(name="llm", model_path="llm")], "assistant",
        lora_modules=None, prompt_adapters=None, request_logger=None,
        chat_template=str(TEMPLATE), enable_auto_tools=True, tool_parser="qwen3_coder",
    )  # fmt: skip


def patched_module(patch: str, name: str) -> Any:
    """The vLLM file ``patch`` changes, with the patch applied (by the project's patch engine,
    whether or not the overlay is deployed), loaded as module ``name``; the installed vLLM is
    left as it is."""
    import importlib.util
    import sys
    import tempfile

    import vllm

    from vllm_overrides import patching

    site = Path(vllm.__file__).resolve().parents[1]
    (fp,) = patching.parse_patch((REPO / "patches" / "vllm-0.6.3" / patch).read_text("utf-8"))
    lines = (site / fp.path).read_text(encoding="utf-8").splitlines(keepends=True)
    state = patching._lines_state(lines, fp)
    assert state in ("applied", "unapplied"), f"{fp.path}: {state}"
    if state == "unapplied":
        lines = patching._apply_hunks(lines, fp.hunks, reverse=False)
    path = Path(tempfile.mkdtemp(prefix="vo-patched-")) / Path(fp.path).name
    path.write_text("".join(lines), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
