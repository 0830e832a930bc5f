"""Our V0 attention backend (VO_PAGED) through vLLM 0.6.3's own metadata path (CPU).

The metadata comes from vLLM's ``ModelInputForGPUBuilder`` (the GPU model runner's input
preparation) fed real ``SequenceGroupMetadata``: a mixed batch under chunked prefill with a
fresh prompt, a later chunk over a cached context, a prefix-cache hit (partial and past its
cached blocks) and two decodes. The backend's output is checked against the float64
references of ``vllm_overrides.native.paged_attention_reference``; copy / swap of blocks and
the selector patch are checked too.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import vllm
from vllm.attention import Attention
from vllm.config import CacheConfig
from vllm.sequence import SequenceData, SequenceGroupMetadata
from vllm.worker.model_runner import (
    ModelInputForGPUBuilder,
    ModelInputForGPUWithSamplingMetadata,
)
from vllm.worker.model_runner_base import _init_attn_metadata_from_tensor_dict

from vllm_overrides import patching
from vllm_overrides.engines.v0 import attention as vo
from vllm_overrides.native import paged_attention as pa
from vllm_overrides.native import paged_attention_reference as ref

REPO = Path(__file__).resolve().parents[3]
PATCH = REPO / "patches" / "vllm-0.6.3" / "0001-attention-selector-our-backend.patch"
BS, HEADS, KV_HEADS, HEAD = 16, 8, 2, 256
SCALE = HEAD**-0.5


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((out.double() - want).norm() / want.norm())


def _runner(chunked_prefill: bool) -> SimpleNamespace:
    """The attributes of GPUModelRunnerBase that the input builder reads (eager, CPU)."""
    return SimpleNamespace(
        attn_backend=vo.VOPagedBackend,
        scheduler_config=SimpleNamespace(
            chunked_prefill_enabled=chunked_prefill, is_multi_step=False, use_v2_block_manager=True
        ),
        model_config=SimpleNamespace(is_encoder_decoder_model=False, enforce_eager=True),
        sliding_window=None,
        block_size=BS,
        lora_config=None,
        prompt_adapter_config=None,
        multi_modal_input_mapper=None,
        _model_input_cls=ModelInputForGPUWithSamplingMetadata,
        inter_data_cache={},
        device=torch.device("cpu"),
        pin_memory=False,
        model_is_mrope=False,
        max_seq_len_to_capture=8192,
        max_batchsize_to_capture=256,
        graph_block_tables=np.zeros((256, 64), dtype=np.int32),
    )


def _group(
    seq_id: int,
    tokens: int,
    computed: int,
    chunk: int | None,
    table: list[int] | None,
    computed_blocks: list[int] | None = None,
) -> SequenceGroupMetadata:
    """A one-sequence group: ``tokens`` prompt tokens of which ``computed`` are cached; a
    prompt (prefill) when ``chunk`` is given, else a decode of the last token."""
    data = SequenceData.from_seqs(list(range(100, 100 + tokens)))
    if chunk is None:  # decode: the prompt is computed and one token was generated since
        data.update_num_computed_tokens(tokens)
        data.append_token_id(7, 0.0)
    elif computed:
        data.update_num_computed_tokens(computed)
    return SequenceGroupMetadata(
        request_id=str(seq_id),
        is_prompt=chunk is not None,
        seq_data={seq_id: data},
        sampling_params=None,
        block_tables={seq_id: table} if table is not None else None,
        token_chunk_size=chunk if chunk is not None else 1,
        computed_block_nums=computed_blocks,
    )


def _build(groups: list[SequenceGroupMetadata], chunked_prefill: bool = True) -> Any:
    builder = ModelInputForGPUBuilder(_runner(chunked_prefill))
    for g in groups:
        builder.add_seq_group(g)
    return builder.build()


def _tables(lens: list[int], num_blocks: int) -> list[list[int]]:
    perm = torch.randperm(num_blocks).tolist()
    out, at = [], 0
    for n in lens:
        k = math.ceil(n / BS)
        out.append(perm[at : at + k])
        at += k
    return out


def test_mixed_chunked_prefill_prefix_hit_and_decode_batch() -> None:
    num_blocks = 64
    # (total tokens the sequence has after this step, what the step computes)
    # A: fresh prompt, one chunk of 40.   B: prompt of 100, 64 computed, chunk 36.
    # C: prefix hit on 2 blocks (32 tokens), prompt 50 -> computes 18 over 32.
    # D: later chunk of a prompt whose hit (1 block) is behind it: 80 computed, chunk 20.
    # E, F: decodes at 70 and 33 tokens.
    tables = _tables([40, 100, 50, 100, 70, 33], num_blocks)
    groups = [
        _group(0, 40, 0, 40, tables[0]),
        _group(1, 100, 64, 36, tables[1]),
        _group(2, 50, 0, 50, tables[2], computed_blocks=tables[2][:2]),
        _group(3, 100, 80, 20, tables[3], computed_blocks=tables[3][:1]),
        _group(4, 69, 0, None, tables[4]),
        _group(5, 32, 0, None, tables[5]),
    ]
    model_input = _build(groups)
    meta = model_input.attn_metadata
    assert isinstance(meta, vo.VOPagedMetadata)
    query_lens, context_lens = [40, 36, 18, 20], [0, 64, 32, 80]
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.num_decode_tokens) == (4, 114, 2)
    assert meta.context_lens == context_lens + [69, 32]
    assert meta.prefill_metadata.prefill_lens() == (query_lens, context_lens)
    # the builder's fix: D's block table covers its context, not just its one computed block
    assert meta.block_tables[3, :7].tolist() == tables[3][:7]

    kv = torch.randn(pa.kv_cache_shape(num_blocks, BS, KV_HEADS, HEAD))
    T = 116
    q = torch.randn(T, HEADS * HEAD)
    k = torch.randn(T, KV_HEADS * HEAD)
    v = torch.randn(T, KV_HEADS * HEAD)
    kc0, vc0 = (c.clone() for c in pa.split_kv_cache(kv))

    impl = vo.VOPagedBackend.get_impl_cls()(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    out = impl.forward(q, k, v, kv, meta)
    assert out.shape == (T, HEADS * HEAD)

    q3, k3, v3 = (x.view(T, -1, HEAD) for x in (q, k, v))  # [T, heads, D] views of the flat inputs
    # every new token is in the cache at its slot
    want_kc, want_vc = ref.write_kv_reference(k3, v3, kc0, vc0, meta.slot_mapping)
    assert torch.equal(kv[0], want_kc) and torch.equal(kv[1], want_vc)
    full = torch.tensor([t + [0] * (7 - len(t)) for t in tables])
    want_prefill = ref.prefill_attention_reference(
        q3[:114], k3[:114], v3[:114], kc0, vc0, full[:4], query_lens, context_lens, SCALE
    )
    want_decode = ref.decode_attention_reference(
        q3[114:], want_kc, want_vc, full[4:], [70, 33], SCALE
    )
    got = out.view(T, HEADS, HEAD)
    assert _rel_err(got[:114], want_prefill) <= 1e-5
    assert _rel_err(got[114:], want_decode) <= 1e-5

    # Tensor-parallel workers rebuild the metadata from the broadcast dict (non-None fields
    # only): same lengths, no cached sub-metadata travelling, same answer.
    sent = meta.asdict_zerocopy()
    assert not any(name.startswith("_") for name in sent)
    rebuilt = _init_attn_metadata_from_tensor_dict(vo.VOPagedBackend, dict(sent))["attn_metadata"]
    assert rebuilt.prefill_metadata.prefill_lens() == (query_lens, context_lens)
    kv_again = torch.cat([kc0[None], vc0[None]])
    assert torch.equal(impl.forward(q, k, v, kv_again, rebuilt), out)


def test_profile_run_without_cache_and_plain_prefill() -> None:
    """The profile run (empty kv_cache, no block tables) and a prefill without chunked
    prefill (empty block tables) attend over their own tokens only."""
    groups = [_group(0, 24, 0, 24, None), _group(1, 9, 0, 9, None)]
    meta = _build(groups, chunked_prefill=False).attn_metadata
    assert meta.block_tables.numel() == 0 and (meta.slot_mapping == -1).all()
    q = torch.randn(33, HEADS * HEAD, dtype=torch.float16)
    k = torch.randn(33, KV_HEADS * HEAD, dtype=torch.float16)
    v = torch.randn(33, KV_HEADS * HEAD, dtype=torch.float16)
    impl = vo.VOPagedImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "auto")
    out = impl.forward(q, k, v, torch.empty(0, dtype=torch.float16), meta)
    want = ref.prefill_attention_reference(
        q.view(33, HEADS, HEAD),
        k.view(33, KV_HEADS, HEAD),
        v.view(33, KV_HEADS, HEAD),
        None,
        None,
        None,
        [24, 9],
        [0, 0],
        SCALE,
    )
    assert out.dtype == torch.float16
    assert _rel_err(out.view(33, HEADS, HEAD), want) <= 2e-2


def test_copy_blocks_and_swap_blocks() -> None:
    caches = [torch.randn(pa.kv_cache_shape(10, BS, KV_HEADS, HEAD)) for _ in range(3)]
    before = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 4], [1, 7], [3, 2]])
    vo.VOPagedBackend.copy_blocks(caches, pairs)
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 4], b[:, 1]) and torch.equal(c[:, 7], b[:, 1])
        assert torch.equal(c[:, 2], b[:, 3])
        untouched = [i for i in range(10) if i not in (2, 4, 7)]
        assert torch.equal(c[:, untouched], b[:, untouched])

    gpu, cpu = caches[0], torch.zeros(pa.kv_cache_shape(6, BS, KV_HEADS, HEAD))
    vo.VOPagedBackend.swap_blocks(gpu, cpu, torch.tensor([[9, 0], [2, 5]]))
    assert torch.equal(cpu[:, 0], gpu[:, 9]) and torch.equal(cpu[:, 5], gpu[:, 2])
    assert (cpu[:, 1:5] == 0).all()
    vo.VOPagedBackend.swap_blocks(cpu, gpu, torch.tensor([[5, 8]]))
    assert torch.equal(gpu[:, 8], before[0][:, 3])  # block 3 went 3 -> 2 -> cpu 5 -> 8


def test_impl_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="sliding window"):
        vo.VOPagedImpl(HEADS, HEAD, SCALE, KV_HEADS, None, 4096, "auto")
    with pytest.raises(ValueError, match="fp8"):
        vo.VOPagedImpl(HEADS, HEAD, SCALE, KV_HEADS, None, None, "fp8")
    with pytest.raises(ValueError, match="ALiBi"):
        vo.VOPagedImpl(HEADS, HEAD, SCALE, KV_HEADS, [0.5] * HEADS, None, "auto")


def _patched_selector(tmp_path: Path) -> Any:
    """vLLM's selector.py with our patch applied (by the project's patch engine), loaded as a
    separate module so the installed vLLM stays as it is."""
    site = Path(vllm.__file__).resolve().parents[1]
    (fp,) = patching.parse_patch(PATCH.read_text(encoding="utf-8"))
    assert fp.path == "vllm/attention/selector.py"
    lines = (site / fp.path).read_text(encoding="utf-8").splitlines(keepends=True)
    state = patching._lines_state(lines, fp)
    assert state in ("applied", "unapplied"), state
    if state == "unapplied":
        lines = patching._apply_hunks(lines, fp.hunks, reverse=False)
    path = tmp_path / "patched_selector.py"
    path.write_text("".join(lines), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("vo_patched_selector", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_selector_patch_picks_ours_unless_switched_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sel = _patched_selector(tmp_path)
    args = (HEAD, None, torch.float16, "auto", BS, False)
    monkeypatch.delenv(vo.ENV_SWITCH, raising=False)
    assert sel.get_attn_backend(*args) is vo.VOPagedBackend
    sel.get_attn_backend.cache_clear()
    monkeypatch.setenv(vo.ENV_SWITCH, "vllm")
    theirs = sel.get_attn_backend(*args)
    assert theirs is not vo.VOPagedBackend and theirs.get_name() == "torch-sdpa"  # CPU platform
    sel.get_attn_backend.cache_clear()
    monkeypatch.setenv(vo.ENV_SWITCH, "ours")
    # a sliding window is not ours to serve: vLLM chooses (and our log line says why)
    assert sel.get_attn_backend(HEAD, 4096, torch.float16, "auto", BS, False) is not (
        vo.VOPagedBackend
    )
    sel.get_attn_backend.cache_clear()
    monkeypatch.setenv(vo.ENV_SWITCH, "bogus")
    with pytest.raises(ValueError, match="VO_ATTENTION"):
        sel.get_attn_backend(*args)
    sel.get_attn_backend.cache_clear()


def test_attention_layer_contract(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``Attention`` layer (what model code builds) over our backend: decode of two
    sequences against the reference."""
    sel = _patched_selector(tmp_path)
    monkeypatch.delenv(vo.ENV_SWITCH, raising=False)
    import vllm.attention.layer as layer

    monkeypatch.setattr(layer, "get_attn_backend", sel.get_attn_backend)
    attn = Attention(
        HEADS, HEAD, SCALE, num_kv_heads=KV_HEADS, cache_config=CacheConfig(BS, 0.9, 0, "auto")
    )
    sel.get_attn_backend.cache_clear()
    assert isinstance(attn.impl, vo.VOPagedImpl)
    tables = _tables([300, 17], 40)
    meta = _build([_group(0, 299, 0, None, tables[0]), _group(1, 16, 0, None, tables[1])])
    meta = meta.attn_metadata
    kv = torch.randn(vo.VOPagedBackend.get_kv_cache_shape(40, BS, KV_HEADS, HEAD))
    q = torch.randn(2, HEADS * HEAD)
    k = torch.randn(2, KV_HEADS * HEAD)
    v = torch.randn(2, KV_HEADS * HEAD)
    out = attn(q, k, v, kv, meta)
    full = torch.tensor([tables[0], tables[1] + [0] * (len(tables[0]) - len(tables[1]))])
    want = ref.decode_attention_reference(
        q.view(2, HEADS, HEAD), kv[0], kv[1], full, [300, 17], SCALE
    )
    assert _rel_err(out.view(2, HEADS, HEAD), want) <= 1e-5
