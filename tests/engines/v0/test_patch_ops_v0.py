"""patch_ops.sh on vLLM 0.6.3 (the platform line), run under the stand-in's Python.

Each test deploys into a throwaway site: a copy of the stand-in's ``vllm`` package in a temporary
folder put first on PYTHONPATH, so ``patch_ops.sh`` finds (and patches) the copy while torch and
the rest still come from the venv. The shared venv is never written to, and the plugin entry
point we register never reaches other tests' vLLM processes.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_overrides import patching
from vllm_overrides.patching import DIST_INFO, MANIFEST_NAME, OVERLAYS, parse_patch

REPO_DIR = Path(__file__).resolve().parents[3]
V0 = OVERLAYS["0.6.3"]
ENTRY = "vllm_overrides.engines.v0:register"


def _standin_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "run under the stand-in (.venv-v0)"
    vllm = Path(spec.origin).resolve().parent
    assert patching.installed_vllm_version(vllm.parent).startswith("0.6.3"), vllm
    return vllm


def make_site(root: Path) -> Path:
    """A site holding a fresh copy of the stand-in's vLLM (12 MB of Python: well under a second),
    as upstream ships it: ``make deploy-v0`` may have patched the venv's, so our diffs are taken
    off the copy."""
    site = root / "site"
    site.mkdir()
    shutil.copytree(_standin_vllm(), site / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    patching.revert(site)
    for name, files in patching.load_patches(V0.patch_dir):
        for fp in files:
            state = patching.patch_state(site, fp)
            assert state == "unapplied", f"{name}: {fp.path} is {state} in the stand-in's vLLM"
    return site


def patch_ops(action: str, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(site)}
    return subprocess.run(
        ["bash", str(REPO_DIR / "patch_ops.sh"), action],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def tree(root: Path) -> dict[str, str]:
    """Every file under root by relative path, with its sha256; byte code and the (empty) lock
    file the deploy actions take turns on aside."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != ".vllm_overrides.lock"
    }


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = make_site(tmp_path_factory.mktemp("v0-site"))
    first = patch_ops("apply", site)
    assert first.returncode == 0, first.stderr
    assert "the overlay for 0.6.3 is deployed" in first.stdout
    return site


def test_apply_installs_the_overlay_and_registers_the_plugin(site: Path) -> None:
    assert (site / "vllm_overrides" / "engines" / "v0" / "__init__.py").is_file()
    entry_points = (site / DIST_INFO / "entry_points.txt").read_text()
    assert entry_points == f"[vllm.general_plugins]\nvllm_overrides = {ENTRY}\n"
    manifest = json.loads((site / MANIFEST_NAME).read_text())
    assert manifest["overlay_for"] == "0.6.3" and manifest["vllm_version"].startswith("0.6.3+")
    # the manifest covers the dist-info as well as the package
    for name in ("METADATA", "entry_points.txt", "RECORD"):
        assert f"{DIST_INFO}/{name}" in manifest["files"]
    assert "vllm_overrides/engines/v0/__init__.py" in manifest["files"]


def test_vllm_discovers_our_plugin(site: Path) -> None:
    """What vLLM 0.6.3's load_general_plugins() iterates, in a fresh interpreter that sees the
    deployed site as a server would, names our entry point exactly once."""
    code = (
        "from importlib.metadata import entry_points\n"
        "print([(e.name, e.value) for e in entry_points(group='vllm.general_plugins')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(site)},
        cwd="/", capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == repr([("vllm_overrides", ENTRY)])


def test_second_apply_is_a_no_op(site: Path) -> None:
    before = tree(site)
    inodes = {p: p.stat().st_ino for p in site.rglob("*.py") if "__pycache__" not in p.parts}
    again = patch_ops("apply", site)
    assert again.returncode == 0, again.stderr
    assert "already installed" in again.stdout and "already registered" in again.stdout
    assert " applied\n" not in again.stdout.replace("already applied\n", "")
    assert tree(site) == before
    # nothing was copied again: a server running from the site never sees a file vanish
    assert {p: p.stat().st_ino for p in inodes} == inodes


def test_every_v0_patch_is_applied_and_in_the_ledger(site: Path) -> None:
    ledger = (REPO_DIR / "patches" / "README.md").read_text(encoding="utf-8")
    status = patch_ops("status", site)
    assert status.returncode == 0, status.stderr
    for patch in sorted(V0.patch_dir.glob("*.patch")):
        assert patch.name in ledger, f"{patch.name} has no entry in patches/README.md"
        for fp in parse_patch(patch.read_text()):
            assert f"{patch.name}: {fp.path}: applied" in status.stdout


def test_verify_passes_and_fails_naming_an_altered_file(site: Path) -> None:
    good = patch_ops("verify", site)
    assert good.returncode == 0, good.stderr
    assert "verify: OK" in good.stdout
    manifest = json.loads((site / MANIFEST_NAME).read_text())
    altered = [f"{DIST_INFO}/entry_points.txt", "vllm_overrides/engines/v0/__init__.py"]
    altered += manifest["patched_files"][:1]
    for rel in altered:
        target = site / rel
        original = target.read_bytes()
        try:
            target.write_bytes(original + b"\n# altered after deployment\n")
            bad = patch_ops("verify", site)
            assert bad.returncode == 1, (rel, bad.stdout)
            assert f"{target}: sha256 differs" in bad.stderr, bad.stderr
        finally:
            target.write_bytes(original)


def test_verify_fails_without_the_plugin_registration(site: Path) -> None:
    dist_info = site / DIST_INFO
    saved = {p.name: p.read_bytes() for p in dist_info.iterdir()}
    shutil.rmtree(dist_info)
    try:
        bad = patch_ops("verify", site)
        assert bad.returncode == 1
        assert f"{dist_info / 'entry_points.txt'}: missing" in bad.stderr, bad.stderr
    finally:
        dist_info.mkdir()
        for name, data in saved.items():
            (dist_info / name).write_bytes(data)


@pytest.fixture
def fresh_site(tmp_path: Path) -> Iterator[Path]:
    yield make_site(tmp_path)


def test_verify_imports_the_v0_modules_and_not_the_032_ones(fresh_site: Path) -> None:
    """An overlay module that raises on import fails verify when it belongs to this generation,
    even with every sha256 matching; 0.32.0's engine switchboard (torch 2.4+ at import) is never
    imported here. The plugin's target is loaded through its entry point."""
    site = fresh_site
    assert patching.apply(site)
    manifest = json.loads((site / MANIFEST_NAME).read_text())
    modules = patching.imported_modules(site, manifest, V0)
    assert "vllm_overrides.engines.v0" in modules and "vllm_overrides.request_compat" in modules
    assert not [m for m in modules if m.startswith("vllm_overrides.engines.v1_0_32")]
    target = site / "vllm_overrides" / "engines" / "v0" / "__init__.py"
    target.write_text(target.read_text() + '\nraise RuntimeError("broken at import")\n')
    patching.write_manifest(site)  # deployed that way: every sha256 matches
    bad = patch_ops("verify", site)
    assert bad.returncode == 1
    assert "vllm_overrides.engines.v0: import failed: RuntimeError: broken at import" in bad.stderr
    assert "does not load: RuntimeError: broken at import" in bad.stderr, bad.stderr


def test_verify_names_an_altered_patched_vllm_file(fresh_site: Path, tmp_path: Path) -> None:
    """Independent of which diffs patches/vllm-0.6.3 holds: one of our own onto the copy."""
    site, pdir = fresh_site, tmp_path / "patches"
    pdir.mkdir()
    rel = "vllm/plugins/__init__.py"
    lines = (site / rel).read_text().splitlines(keepends=True)
    changed = lines[:1] + ["# patched by a test\n"] + lines[1:]
    (pdir / "0001-test.patch").write_text(
        "".join(difflib.unified_diff(lines, changed, f"a/{rel}", f"b/{rel}"))
    )
    log = patching.apply(site, pdir)
    assert f"0001-test.patch: {rel} applied" in log
    assert patching.verify(site, pdir, import_modules=False) == []
    (site / rel).write_text("".join(changed) + "# altered\n")
    problems = patching.verify(site, pdir, import_modules=False)
    assert f"{site / rel}: sha256 differs from the manifest (altered after deploy)" in problems


def test_revert_restores_the_site(fresh_site: Path) -> None:
    site = fresh_site
    pristine = tree(site)
    assert patch_ops("apply", site).returncode == 0
    assert tree(site) != pristine
    undone = patch_ops("revert", site)
    assert undone.returncode == 0, undone.stderr
    assert tree(site) == pristine
    assert not list(site.glob("vllm_overrides*"))


@pytest.mark.parametrize(
    ("version", "overlay"),
    [("0.6.3", "0.6.3"), ("0.6.3+corex.3.2.3", "0.6.3"), ("0.6.3+cpu", "0.6.3"),
     ("0.32.0", "0.32.0"), ("0.32.0+cpu", "0.32.0"), ("0.6.4", None), ("0.6.3.post1", None),
     ("0.7.0", None)],
)  # fmt: skip
def test_the_version_picks_the_overlay(tmp_path: Path, version: str, overlay: str | None) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_version.py").write_text(f'__version__ = "{version}"\n')
    if overlay is not None:
        assert patching.overlay_for(tmp_path) is OVERLAYS[overlay]
        return
    with pytest.raises(patching.PatchError, match=f"refusing to patch vLLM {version} at"):
        patching.overlay_for(tmp_path)


def test_an_unknown_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.6.4+corex.3.2.4'\n")
    for action in ("apply", "verify", "revert"):
        out = patch_ops(action, tmp_path)
        assert out.returncode == 2, (action, out.stdout, out.stderr)
        assert "refusing to patch vLLM 0.6.4+corex.3.2.4" in out.stderr
        assert "0.6.3" in out.stderr and "0.32.0" in out.stderr
    assert not list(tmp_path.glob("vllm_overrides*"))
