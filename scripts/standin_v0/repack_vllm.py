"""Repack vLLM 0.6.3's PyPI wheel into the stand-in's vLLM: its Python layer, no compiled code.

The platform's vLLM is upstream 0.6.3's Python tree with CoreX ops under it (PLATFORM.md). The
PyPI wheel's ``.so`` files are CUDA kernels built for torch 2.4; on torch 2.1 they cannot load,
just as they are absent on the card, where our ops stand in for the vendor's. So the stand-in
keeps every ``.py`` file and drops every ``.so``. The version gets the local label ``+cpu``:
vLLM 0.6.3 picks its CPU platform by that label (``vllm/platforms/__init__.py``), as its own CPU
build from the sdist does. ``+corex.3.2.3`` on the card, ``+cpu`` here: ``patch_ops.sh`` accepts
any local label of 0.6.3.

:data:`STANDIN_EDITS` are the stand-in's only changes to vLLM's Python code (each must match
exactly once; all listed in ``engines/v0/STANDIN.md``):

- Upstream 0.6.3 asks for torch 2.4; the vendor's tree runs on torch 2.1. Two lines of
  upstream's fail to import there, and two edits change exactly those.
- On the card, device "cuda" runs vLLM's GPU executor and ``Worker``; here the device is "cpu",
  which upstream sends to its CPU executor (no chunked prefill, no prefix caching, no request
  ids for models with inner state). Two edits, one in each engine's ``_get_executor_cls``, ask
  the stand-in's ``vllm_standin`` package (``scripts/standin_v0/``) for the executor instead
  when it is installed: the card's executors and worker on CPU tensors.

Usage: ``python repack_vllm.py IN.whl OUT_DIR`` -> ``OUT_DIR/vllm-0.6.3+cpu-py3-none-any.whl``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

LABEL = "+cpu"


def _route_cpu_to_standin(cpu_executor: str, is_async: bool) -> tuple[str, str]:
    """The edit of one engine's ``_get_executor_cls``: device "cpu" -> the stand-in's executor."""
    upstream = (
        '        elif engine_config.device_config.device_type == "cpu":\n'
        f"            from vllm.executor.cpu_executor import {cpu_executor}\n"
        f"            executor_class = {cpu_executor}\n"
    )
    standin = upstream + (
        "            import importlib.util  # the stand-in: the card's Worker on the CPU\n"
        '            if importlib.util.find_spec("vllm_standin") is not None:\n'
        "                from vllm_standin.executor import standin_executor_class\n"
        f"                executor_class = standin_executor_class(engine_config, {is_async})\n"
    )
    return upstream, standin


# path in the wheel -> (upstream text, the stand-in's text)
STANDIN_EDITS: dict[str, tuple[str, str]] = {
    # torch 2.1 has neither register_fake (2.4) nor impl_abstract (2.2); the fakes only describe
    # compiled ops, and the stand-in has none.
    "vllm/_custom_ops.py": (
        "        from torch.library import impl_abstract as register_fake\n",
        "        try:\n"
        "            from torch.library import impl_abstract as register_fake\n"
        "        except ImportError:  # torch 2.1\n"
        "            def register_fake(name):\n"
        "                return lambda fn: fn\n",
    ),
    # torch 2.1's dynamo has no accumulated_cache_size_limit (2.2); setting it raises.
    "vllm/worker/model_runner.py": (
        "torch._dynamo.config.accumulated_cache_size_limit = 128\n",
        "if hasattr(torch._dynamo.config, \"accumulated_cache_size_limit\"):  # torch >= 2.2\n"
        "    torch._dynamo.config.accumulated_cache_size_limit = 128\n",
    ),
    "vllm/engine/llm_engine.py": _route_cpu_to_standin("CPUExecutor", False),
    "vllm/engine/async_llm_engine.py": _route_cpu_to_standin("CPUExecutorAsync", True),
}


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def repack(wheel: Path, out_dir: Path) -> Path:
    name, version = wheel.name.split("-")[:2]
    new_version = version.split("+")[0] + LABEL
    old_info, new_info = f"{name}-{version}.dist-info", f"{name}-{new_version}.dist-info"
    out = out_dir / f"{name}-{new_version}-py3-none-any.whl"
    out_dir.mkdir(parents=True, exist_ok=True)
    records: list[list[str]] = []
    edited: set[str] = set()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            path = item.filename
            if path.endswith(".so") or path.endswith("/RECORD"):
                continue
            data = src.read(item)
            if path in STANDIN_EDITS:
                old, new = STANDIN_EDITS[path]
                text = data.decode()
                if text.count(old) != 1:
                    raise SystemExit(f"{path}: the stand-in's edit does not match once")
                edited.add(path)
                data = text.replace(old, new).encode()
            if path.startswith(old_info + "/"):
                path = new_info + path[len(old_info) :]
                if path.endswith("/METADATA"):
                    data = data.replace(f"Version: {version}\n".encode(),
                                        f"Version: {new_version}\n".encode(), 1)
                elif path.endswith("/WHEEL"):
                    text = data.decode()
                    lines = [ln for ln in text.splitlines() if not ln.startswith("Tag:")]
                    data = ("\n".join(lines + ["Tag: py3-none-any"]) + "\n").encode()
            dst.writestr(path, data)
            records.append([path, _record_hash(data), str(len(data))])
        # The PyPI wheel of 0.6.3 lacks the version module its build should have written
        # (vllm.__version__ reads "dev" and /version says so); the stand-in writes it.
        version_py = f'__version__ = "{new_version}"\n__version_tuple__ = (0, 6, 3)\n'.encode()
        dst.writestr("vllm/_version.py", version_py)
        records.append(["vllm/_version.py", _record_hash(version_py), str(len(version_py))])
        if edited != set(STANDIN_EDITS):
            raise SystemExit(f"edits whose file is missing: {sorted(set(STANDIN_EDITS) - edited)}")
        records.append([f"{new_info}/RECORD", "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(records)
        dst.writestr(f"{new_info}/RECORD", buf.getvalue())
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: repack_vllm.py IN.whl OUT_DIR")
    print(repack(Path(sys.argv[1]), Path(sys.argv[2])))
