"""patch_ops.sh against the venv's real vLLM: idempotent apply, tamper detection, version guard."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_overrides import patching
from vllm_overrides.patching import MANIFEST_NAME, find_vllm_site, parse_patch, write_manifest

REPO_DIR = Path(__file__).resolve().parents[1]


def patch_ops(action: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(REPO_DIR / "patch_ops.sh"), action],
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def site() -> Path:
    first = patch_ops("apply")
    assert first.returncode == 0, first.stderr
    return find_vllm_site()


def overlay_inodes(site: Path) -> dict[str, int]:
    overlay = site / "vllm_overrides"
    return {str(p.relative_to(overlay)): p.stat().st_ino for p in overlay.rglob("*.py")}


def test_second_apply_is_a_no_op(site: Path) -> None:
    manifest = (site / MANIFEST_NAME).read_bytes()
    patched = {p: (site / p).read_bytes() for p in json.loads(manifest)["patched_files"]}
    inodes = overlay_inodes(site)
    again = patch_ops("apply")
    assert again.returncode == 0, again.stderr
    assert "already applied" in again.stdout
    assert " applied\n" not in again.stdout.replace("already applied\n", "")
    assert "overlay vllm_overrides" in again.stdout and "already installed" in again.stdout
    assert (site / MANIFEST_NAME).read_bytes() == manifest
    assert {p: (site / p).read_bytes() for p in patched} == patched
    # the overlay was not copied again: a server running from it never sees it vanish
    assert overlay_inodes(site) == inodes


def test_apply_puts_back_an_altered_overlay(site: Path) -> None:
    target = site / "vllm_overrides" / "patching.py"
    original = target.read_bytes()
    target.write_bytes(original + b"\n# altered after deployment\n")
    fixed = patch_ops("apply")
    assert fixed.returncode == 0, fixed.stderr
    assert "already installed" not in fixed.stdout
    assert target.read_bytes() == original
    assert patch_ops("verify").returncode == 0


def test_overlay_copy_and_comparison_leave_byte_code_out(tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    for rel in ("a.py", "sub/b.py", "__pycache__/a.cpython-311.pyc", "sub/c.pyc"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    shutil.copytree(src, dest, ignore=patching._not_copied)
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert copied == ["a.py", "sub/b.py"]
    # byte code a running server writes into the copy does not make it differ from the source
    (dest / "sub" / "__pycache__").mkdir()
    (dest / "sub" / "__pycache__" / "b.cpython-311.pyc").write_text("x")
    assert patching._package_files(dest) == patching._package_files(src)
    (dest / "sub" / "b.py").write_text("changed")
    assert patching._package_files(dest) != patching._package_files(src)


def test_every_patch_is_applied_and_in_the_ledger(site: Path) -> None:
    ledger = (REPO_DIR / "patches" / "README.md").read_text(encoding="utf-8")
    patches = sorted((REPO_DIR / "patches" / "vllm-0.32.0").glob("*.patch"))
    assert patches
    for patch in patches:
        assert patch.name in ledger, f"{patch.name} has no entry in patches/README.md"
        for fp in parse_patch(patch.read_text()):
            assert fp.path in ledger, f"{fp.path} ({patch.name}) not named in the ledger"
    status = patch_ops("status")
    assert status.returncode == 0 and ": applied" in status.stdout
    assert ": unapplied" not in status.stdout and ": conflict" not in status.stdout


@pytest.mark.parametrize("which", ["patched upstream file", "overlay file"])
def test_verify_names_an_altered_deployed_file(site: Path, which: str) -> None:
    manifest = json.loads((site / MANIFEST_NAME).read_text())
    rel = (
        manifest["patched_files"][0]
        if which == "patched upstream file"
        else next(p for p in manifest["files"] if p.startswith("vllm_overrides/"))
    )
    target = site / rel
    original = target.read_bytes()
    try:
        target.write_bytes(original + b"\n# altered after deployment\n")
        bad = patch_ops("verify")
        assert bad.returncode != 0
        assert str(target) in bad.stderr and "sha256" in bad.stderr
    finally:
        target.write_bytes(original)
    good = patch_ops("verify")
    assert good.returncode == 0, good.stderr
    assert "verify: OK" in good.stdout


def test_verify_imports_every_overlay_module(site: Path) -> None:
    """A deployed module that raises on import fails verify even when its hash is the manifest's.

    api_compat is imported lazily (inside build_app): only importing every overlay module catches
    it before the server dies at start.
    """
    target = site / "vllm_overrides" / "engines" / "v1_0_32" / "api_compat.py"
    original = target.read_bytes()
    try:
        target.write_bytes(original + b'\nraise RuntimeError("broken at import")\n')
        write_manifest(site)  # deployed that way: every sha256 matches
        bad = patch_ops("verify")
        assert bad.returncode != 0
        want = "vllm_overrides.engines.v1_0_32.api_compat: import failed: RuntimeError: broken"
        assert f"{want} at import" in bad.stderr, bad.stderr
    finally:
        target.write_bytes(original)
        write_manifest(site)
    good = patch_ops("verify")
    assert good.returncode == 0, good.stderr


def test_unexpected_vllm_version_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "_version.py").write_text("__version__ = version = '0.31.1'\n")
    for action in ("apply", "verify"):
        out = patch_ops(action, PYTHONPATH=str(tmp_path))
        assert out.returncode == 2, (action, out.stdout, out.stderr)
        assert "refusing to patch vLLM 0.31.1" in out.stderr
        assert "0.32.0" in out.stderr
    assert not (tmp_path / "vllm_overrides").exists()


def test_patches_to_one_file_apply_on_top_of_each_other(tmp_path: Path) -> None:
    """Two patches to one file, onto a pristine copy: both land (the second used to be computed
    from the untouched file and overwrote the first -- 0003 vanished behind 0007 in a fresh venv,
    with every server test failing)."""
    import difflib

    from vllm_overrides import patching

    site, pdir = tmp_path / "site", tmp_path / "patches"
    (site / "vllm").mkdir(parents=True)
    pdir.mkdir()
    (site / "vllm" / "_version.py").write_text('__version__ = "0.32.0"\n')
    base = [f"line {i}\n" for i in range(40)]
    (site / "vllm" / "x.py").write_text("".join(base))
    first = base[:5] + ["first patch\n"] + base[5:]
    second = first[:31] + ["second patch\n"] + first[31:]
    for name, a, b in (("0001-a.patch", base, first), ("0002-b.patch", first, second)):
        diff = difflib.unified_diff(a, b, "a/vllm/x.py", "b/vllm/x.py", n=3)
        (pdir / name).write_text("".join(diff))
    patching.apply(site, pdir)
    assert (site / "vllm" / "x.py").read_text() == "".join(second)
    again = patching.apply(site, pdir)
    assert all("already applied" in line for line in again[:2])
    assert (site / "vllm" / "x.py").read_text() == "".join(second)


def test_concurrent_applies_all_succeed(site: Path) -> None:
    """Four applies at once (``make serve`` beside ``make preflight`` both deploy): each waits
    for the site's lock. Without it two or three of four died in the overlay's rmtree +
    copytree (FileExistsError, half-copied package) in each of three trials."""
    runs = [
        subprocess.Popen(
            ["bash", str(REPO_DIR / "patch_ops.sh"), "apply"],
            env={**os.environ, "PYTHON": sys.executable},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
    verify = patch_ops("verify")
    assert verify.returncode == 0, verify.stderr


def test_the_032_line_registers_no_plugin_and_leaves_the_v0_engine_unimported(site: Path) -> None:
    """The package is copied whole, engines/v0 included (hashed like every file), but nothing of
    the platform line's runs here: verify does not import engines/v0 (vLLM 0.6.3 internals) and no
    ``vllm.general_plugins`` entry point is registered; every other overlay module is imported."""
    assert patching.overlay_for(site) is patching.OVERLAYS["0.32.0"]
    assert not list(site.glob("vllm_overrides-*.dist-info"))
    manifest = json.loads((site / MANIFEST_NAME).read_text())
    assert "vllm_overrides/engines/v0/__init__.py" in manifest["files"]
    modules = patching.imported_modules(site, manifest, patching.OVERLAYS["0.32.0"])
    assert not [m for m in modules if m.startswith("vllm_overrides.engines.v0")]
    for module in (
        "vllm_overrides.engines.v1_0_32.api_compat",
        "vllm_overrides.engines.v1_0_32.native_switch",
        "vllm_overrides.engines",
    ):
        assert module in modules
