"""A tiny random-weight Qwen2 checkpoint (float32) for the stand-in harness test.

Why Qwen2: vLLM 0.6.3 ships ``Qwen2ForCausalLM`` and transformers 4.51.3 ships its Hugging Face
twin, so the V0 engine (chunked prefill, prefix caching, our attention backend) can be compared
token for token with ``transformers``' own ``generate`` without our model code in the way.
Head dim 256 (hidden / heads: vLLM 0.6.3's Qwen2 derives it so) like Qwen3.6's full attention,
2 q heads per kv head (GQA), 2 kv heads so that TP 2 splits them. The tokenizer is a word-level
one built here (``w0 .. wN``): the test feeds token ids, the tokenizer only has to exist and
round-trip.

Usage: ``python tests/engines/v0/standin_tiny_qwen2.py OUT_DIR`` (idempotent: a stamp with the
spec's hash means nothing is done).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 4321
VOCAB = 1000
SPECIALS = ["<unk>", "<|endoftext|>"]
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,  # 4 heads x 256
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "sliding_window": None,
    # Peaked logits (std ~3 over 1000 words): greedy choices far apart relative to the float32
    # rounding differences between two implementations of the same forward.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
STAMP = "standin_tiny_qwen2.json"


def _spec_hash() -> str:
    spec = {"config": CONFIG, "seed": SEED, "specials": SPECIALS, "builder": 1}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build(out: Path) -> Path:
    """Write the checkpoint to ``out`` unless a matching one is there; returns ``out``."""
    stamp = out / STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("hash") == _spec_hash():
        return out
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.float32).eval()
    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    fast.save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({"hash": _spec_hash()}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: standin_tiny_qwen2.py OUT_DIR")
    print(build(Path(sys.argv[1])))
