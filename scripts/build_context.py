"""Snapshot the image's build context: exactly the files the Dockerfile reads.

    python scripts/build_context.py DEST [--from DIR]

Copies the Dockerfile, .dockerignore and every COPY/ADD source and ``RUN --mount=type=bind``
source of the Dockerfile from DIR (default: this checkout) into DEST (emptied first). Build
inputs are hard-linked (large wheels; never modified through the copy). Building from the
snapshot keeps one image test consistent while the working tree changes under it, and the
build-failure tests mutate copies of it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def dockerfile_sources(dockerfile: Path) -> list[str]:
    """Context paths the Dockerfile reads: COPY/ADD sources and RUN --mount bind sources."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8"))
    sources: list[str] = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].upper() in ("COPY", "ADD"):
            if any(w.startswith("--from") for w in words[1:]):
                continue
            args = [w for w in words[1:] if not w.startswith("--")]
            if args and args[0].startswith("["):
                raise ValueError(f"JSON-form {words[0]} is not supported here: {line}")
            sources += args[:-1]
        elif words[0].upper() == "RUN":
            for w in words[1:]:
                if w.startswith("--mount=") and "type=bind" in w:
                    opts = dict(
                        o.split("=", 1) for o in w[len("--mount=") :].split(",") if "=" in o
                    )
                    if "from" not in opts:
                        sources.append(opts.get("source", opts.get("src", ".")))
    out = sorted({s.rstrip("/") or "." for s in sources})
    bad = [s for s in out if s in (".", "") or any(c in s for c in "*?[")]
    if bad:
        raise ValueError(f"whole-context or wildcard sources are not supported here: {bad}")
    return out


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def make_context(dest: Path, source: Path = REPO_DIR) -> Path:
    """Fill DEST (emptied first) with the build context read from SOURCE."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("Dockerfile", ".dockerignore"):
        if (source / name).exists():
            shutil.copy2(source / name, dest / name)
    for rel in dockerfile_sources(source / "Dockerfile"):
        src, dst = source / rel, dest / rel
        if not src.exists():
            raise FileNotFoundError(f"the Dockerfile reads {rel}, which {source} lacks")
        dst.parent.mkdir(parents=True, exist_ok=True)
        copy = _link_or_copy if rel.split("/")[0] == "build-inputs" else shutil.copy2
        if src.is_dir():
            shutil.copytree(src, dst, copy_function=copy, ignore=IGNORE, dirs_exist_ok=True)
        else:
            copy(src, dst)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--from", dest="source", type=Path, default=REPO_DIR)
    args = parser.parse_args()
    make_context(args.dest, args.source)
    print(args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
