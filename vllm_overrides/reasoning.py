"""Qwen3-style reasoning split (``<think>...</think>``), independent of any vLLM version.

The Qwen3.5/3.6 chat template opens the think block itself when thinking is on (the generation
prompt ends with ``<think>\\n``), so the model's text starts *inside* the reasoning and closes it
with ``</think>``; with thinking off the template renders an empty, closed block and the text is
the answer. A model may also open the block itself. The rules, shared by both lines:

- whether the text starts inside the reasoning is read from the prompt: the last think marker in
  the prompt's tokens is an opening one;
- a ``<think>`` at the very start of the text (whitespace aside) opens the reasoning too;
- everything up to the first ``</think>`` is reasoning, everything after it is content
  (the newlines the template puts after ``</think>`` are not part of the answer);
- a text that starts inside the reasoning and never closes it is all reasoning (the budget ended
  while the model was thinking): the answer is then empty, never the chain of thought.

vLLM 0.32.0 ships this as its ``qwen3`` reasoning parser; vLLM 0.6.3 has none, and the platform
line uses these functions (``engines/v0/serving.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_reasoning(
    prompt_ids: Sequence[int], open_id: int | None, close_id: int | None
) -> bool:
    """True when the last think marker among the prompt's tokens opens a block."""
    for token in reversed(prompt_ids):
        if token == close_id:
            return False
        if token == open_id:
            return True
    return False


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A whole answer as ``(reasoning, content)``; None where a part is absent."""
    splitter = ThinkSplitter(in_reasoning)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    reasoning += more_reasoning
    content += more_content
    return (reasoning or None), (content or None)


class ThinkSplitter:
    """Splits a stream of text deltas into reasoning and content deltas.

    A marker can arrive split over several deltas (a tokenizer that does not keep it atomic):
    text that could be the start of a marker is held back until the next delta decides it, and
    ``flush`` releases it at the end of the stream.
    """

    def __init__(self, in_reasoning: bool) -> None:
        # "start": nothing seen yet, a leading <think> may still open the block.
        self.state = "reasoning" if in_reasoning else "start"
        self.held = ""
        self.after_close = False  # strip the newlines right after </think>

    def feed(self, delta: str) -> tuple[str, str]:
        """The (reasoning, content) parts of one delta; either may be empty."""
        text = self.held + delta
        self.held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.state = "reasoning"
                    text = stripped[len(THINK_OPEN) :]
                    continue
                if stripped == "" or THINK_OPEN.startswith(stripped):
                    self.held = text  # whitespace or a partial "<think>": undecided
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                cut = text.find(THINK_CLOSE)
                if cut >= 0:
                    reasoning.append(text[:cut])
                    text = text[cut + len(THINK_CLOSE) :]
                    self.state = "content"
                    self.after_close = True
                    continue
                keep = _partial_suffix(text, THINK_CLOSE)
                reasoning.append(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                break
            # content
            if self.after_close:
                text = text.lstrip("\n")
                if not text:
                    break
                self.after_close = False
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the stream."""
        held, self.held = self.held, ""
        if not held:
            return "", ""
        if self.state == "reasoning":
            return held, ""
        if self.state == "start" and held.strip() == "":
            return "", ""  # only whitespace before a marker that never came
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
