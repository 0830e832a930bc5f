"""Images through vLLM 0.6.3's V0 engine against transformers (float32 tiny model).

The oracle (``tests/native_engine/hf_oracle.py``'s image prompts, computed in the 0.32 venv whose
transformers knows ``qwen3_5_moe`` with its vision tower) holds each prompt with one
``<|image_pad|>`` per image, the images' specs and transformers' greedy continuation. Here the
engine gets the same token ids and PIL images: our input processor must expand each pad to the
same token count, our vision tower and per-chunk layout must give the same embeddings at the
same places, and our MRoPE positions the same rotations -- the tokens must be identical.

Chunked prefill runs with a 256-token budget, so ``image_two``'s first image (tokens 201-264)
crosses a chunk boundary: each chunk takes its own rows of the image and its own positions.
Both prompts run in one ``generate`` call (two image requests in one step), then each alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from v0_model_harness import ORACLE_JSON, TINY_MODEL

from tests.native_engine.hf_oracle import IMAGE_PROMPTS, make_image

MAX_NUM_BATCHED_TOKENS = 256
MAX_NEW = 32
NAMES = list(IMAGE_PROMPTS)
# The stand-in's CPU encodes the tiny tower; cap its largest image (the profiling run encodes
# one) through the operator knob the platform has too.
MAX_PIXELS = 512 * 512
IMAGE_TOKEN = 248_056
UNUSED_IDS = (248_077, 248_320)  # the tokenizer's length .. the embedding's rows


@pytest.fixture(scope="module")
def oracle() -> dict[str, Any]:
    if not ORACLE_JSON.exists():
        pytest.fail(f"{ORACLE_JSON} is missing: `make build/hf_oracle.json`")
    data = json.loads(ORACLE_JSON.read_text())
    missing = [n for n in NAMES if n not in data]
    assert not missing, f"{ORACLE_JSON} lacks image prompts {missing}: recompute it"
    return data


@pytest.fixture(scope="module")
def llm(oracle: dict[str, Any]) -> Iterator[Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from vllm_overrides.engines.v0 import register

    register()
    engine = LLM(
        model=str(TINY_MODEL),
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=16,
        max_model_len=4096,
        seed=0,
        limit_mm_per_prompt={"image": 4},
        mm_processor_kwargs={"max_pixels": MAX_PIXELS},
        # As the YAML: cache hits must be exact (the image tests match the oracle either way).
        enable_prefix_caching=True,
        swap_space=1,
    )
    yield engine
    del engine


def _images(specs: list[list[Any]]) -> Any:
    from PIL import Image

    imgs = [Image.fromarray(make_image(*s)) for s in specs]
    return imgs[0] if len(imgs) == 1 else imgs


def _generate(llm: Any, names: list[str], oracle: dict[str, Any]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [
        {
            "prompt_token_ids": oracle[n]["prompt"],
            "multi_modal_data": {"image": _images(oracle[n]["images"])},
        }
        for n in names
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        # The engine's prompt is the expanded one transformers' processor gives, with image
        # positions holding content-derived ids from the unused embedding rows (qwen3_5_mm).
        got, want = list(out.prompt_token_ids), oracle[name]["expanded"]
        assert len(got) == len(want), name
        for g, w in zip(got, want, strict=True):
            assert g == w or (w == IMAGE_TOKEN and UNUSED_IDS[0] <= g < UNUSED_IDS[1]), name
    return [list(o.outputs[0].token_ids) for o in outs]


def test_images_batched_match_hf(llm: Any, oracle: dict[str, Any]) -> None:
    got = _generate(llm, NAMES, oracle)
    for name, tokens in zip(NAMES, got, strict=True):
        assert tokens == oracle[name]["tokens"][:MAX_NEW], name


@pytest.mark.parametrize("name", NAMES)
def test_image_alone_matches_hf(llm: Any, oracle: dict[str, Any], name: str) -> None:
    (tokens,) = _generate(llm, [name], oracle)
    assert tokens == oracle[name]["tokens"][:MAX_NEW]


def test_text_after_images_is_unchanged(llm: Any) -> None:
    """A text-only request served by the same engine after image requests: plain positions."""
    from vllm import SamplingParams

    from tests.native_engine.hf_oracle import prompt_ids

    data = json.loads(ORACLE_JSON.read_text())
    if "len20" not in data:
        pytest.skip("text prompts not in this oracle file")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids(20, seed=20)}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == data["len20"]["tokens"][:MAX_NEW]


@pytest.mark.parametrize(
    ("images", "pads", "message"),
    [
        (1, 2, "2 image placeholder(s) for 1 image(s)"),
        (2, 1, "1 image placeholder(s) for 2 image(s)"),
    ],
)
def test_placeholder_count_mismatch_is_refused(
    llm: Any, oracle: dict[str, Any], images: int, pads: int, message: str
) -> None:
    """The request fails with a ValueError at admission; the engine keeps serving."""
    from vllm import SamplingParams

    pad = 248_056
    prompt = [1, 2] + [248_053, pad, 248_054] * pads + [3]
    specs = [["quadrants", 256, 256]] * images
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(
            [{"prompt_token_ids": prompt, "multi_modal_data": {"image": _images(specs)}}],
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )
    (tokens,) = _generate(llm, ["image_one"], oracle)
    assert tokens == oracle["image_one"]["tokens"][:MAX_NEW]


def test_image_ids_follow_the_image_content(llm: Any) -> None:
    """Admission alone (the engine's input processor): the ids at an image's positions depend
    on its pixels only, so V0's token-id block hashes tell two images apart (prefix caching)
    and recognise the same image again."""
    from vllm.inputs import INPUT_REGISTRY

    process = INPUT_REGISTRY.create_input_processor(llm.llm_engine.model_config)
    prompt = [1, 2, 248_053, IMAGE_TOKEN, 248_054, 3]

    def ids(spec: list[Any]) -> list[int]:
        out = process({"prompt_token_ids": prompt, "multi_modal_data": {"image": _images([spec])}})
        return list(out["prompt_token_ids"])

    red, red_again, other = (
        ids(["quadrants", 256, 256]),
        ids(["quadrants", 256, 256]),
        ids(["noise", 256, 256]),
    )
    assert len(red) == len(other) == len(prompt) - 1 + 64
    assert red == red_again
    assert red[:3] == other[:3] == prompt[:3] and red[-2:] == other[-2:] == prompt[-2:]
    assert red[3:-2] != other[3:-2]
    assert all(UNUSED_IDS[0] <= t < UNUSED_IDS[1] for t in red[3:-2] + other[3:-2])


_TP2_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from PIL import Image
from vllm_overrides.engines.v0 import register
register()  # inherited by the forked worker process
from vllm import LLM, SamplingParams
from tests.native_engine.hf_oracle import make_image
cases, budget, max_new, max_pixels = json.loads(sys.argv[1])
llm = LLM(model=sys.argv[2], dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          enable_chunked_prefill=True, max_num_batched_tokens=budget, max_num_seqs=16,
          max_model_len=4096, seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
          limit_mm_per_prompt={"image": 4}, mm_processor_kwargs={"max_pixels": max_pixels})
prompts = [{"prompt_token_ids": ids,
            "multi_modal_data": {"image": [Image.fromarray(make_image(*s)) for s in specs]}}
           for ids, specs in cases]
params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
outs = llm.generate(prompts, params, use_tqdm=False)
print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def test_tp2_images_match_hf(oracle: dict[str, Any]) -> None:
    """Tensor parallel 2 (two CPU ranks, the card's multiprocessing executor): the step's image
    inputs reach rank 1 in the driver's broadcast, the replicated tower gives both ranks the
    same rows. A separate process: vLLM's parallel groups are per process."""
    import subprocess
    import sys

    cases = [[oracle[n]["prompt"], oracle[n]["images"]] for n in NAMES]
    args = json.dumps([cases, MAX_NUM_BATCHED_TOKENS, MAX_NEW, MAX_PIXELS])
    env = {**os.environ, "PYTHONPATH": str(TINY_MODEL.parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", _TP2_SCRIPT, args, str(TINY_MODEL)],
        capture_output=True, text=True, timeout=900, env=env, cwd=TINY_MODEL.parents[1],
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"TP 2 run failed:\n{proc.stderr[-4000:]}"
    got = json.loads(lines[-1][len("RESULT ") :])
    for name, tokens in zip(NAMES, got, strict=True):
        assert tokens == oracle[name]["tokens"][:MAX_NEW], name


def test_prefix_cache_tells_images_apart(llm: Any, oracle: dict[str, Any]) -> None:
    """With prefix caching (the YAML's; this module's engine has it), V0 hashes blocks by token
    ids: the ids at image positions follow the pixels, so a prompt that differs only in its
    images (same sizes, same text) must not reuse the other images' blocks, and the same images
    again are served from the cache with the same tokens."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    spec = oracle["image_two"]
    want = spec["tokens"][:MAX_NEW]

    def run(images: list[list[Any]]) -> Any:
        prompt = {
            "prompt_token_ids": spec["prompt"],
            "multi_modal_data": {"image": _images(images)},
        }
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        return out

    other = [["noise", *spec["images"][0][1:]], ["gradient", *spec["images"][1][1:]]]
    assert other != spec["images"]
    run(other)  # cached first: a hit past the text would serve these images' KV and states
    for _ in range(2):
        out = run(spec["images"])
        assert list(out.outputs[0].token_ids) == want
    # The second run is served from the cache beyond the 200-token text, into the images.
    assert llm.llm_engine.cache_config.enable_prefix_caching
    assert out.num_cached_tokens > 256, out.num_cached_tokens
