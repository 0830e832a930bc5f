"""A broken patch or a tampered overlay fails the image build (not a warning).

The platform line's image (vLLM 0.6.3 at the CoreX path of the base, the stand-in here). Each
case builds a copy of the context the image was built from (the snapshot that
``scripts/image_test.sh`` builds, so edits to the working tree meanwhile do not matter) with one
file changed, with the image's own build arguments, so the layer cache serves every layer up to the overlay and only the overlay
layers rebuild (seconds, not the 5-minute cold build). A control build of the unchanged copy
must come out as the very image under test: proof that the copy is the real context and that the
failures come from the one changed file. Tampering after the overlay is deployed is checked by a
two-step build ``FROM`` the image: change a deployed file, then ``patch_ops.sh verify``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from scripts.build_context import make_context as _make_context
from tests.image.image_support import REPO_DIR, podman

pytestmark = pytest.mark.image

# Where the base keeps vLLM (the vendor's corex dist-packages), so where the overlay deploys.
SITE = "/usr/local/corex/lib64/python3/dist-packages"
PATCH_DIR = Path("patches/vllm-0.6.3")
# A module of the shared core that the V0 overlay deploys and `verify` imports.
VICTIM = "vllm_overrides/media_errors.py"
MakeContext = Callable[[Path], Path]


def build(context: Path, build_args: list[str], iidfile: Path | None = None) -> tuple[int, str]:
    # --network=none: as the image was built (scripts/image_test.sh), so the cache hits.
    args = ["build", "--pull=never", "--network=none", "--layers", "--force-rm"]
    if iidfile is not None:
        args += ["--iidfile", str(iidfile)]
    proc = podman(*args, *build_args, "-f", str(context / "Dockerfile"), str(context))
    return proc.returncode, proc.stdout


@pytest.fixture(scope="module")
def make_context(build_context: Path) -> MakeContext:
    """A copy of the context the image was built from (not of the live working tree)."""
    return lambda dest: _make_context(dest, build_context)


@pytest.fixture(scope="module")
def clean_context(make_context: MakeContext, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_context(tmp_path_factory.mktemp("ctx-clean"))


def test_control_copy_rebuilds_the_same_image(
    clean_context: Path, build_args: list[str], image_id: str, tmp_path: Path
) -> None:
    rc, out = build(clean_context, build_args, tmp_path / "iid")
    assert rc == 0, out[-4000:]
    built = (tmp_path / "iid").read_text().strip().removeprefix("sha256:")
    assert built == image_id, f"the copied context is not the image's context:\n{out[-3000:]}"
    assert "Using cache" in out


def _first_context_line(patch: Path) -> tuple[str, str]:
    """(old line, drifted line): the first unchanged context line of the first hunk."""
    in_hunk = False
    for line in patch.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line.startswith(" ") and line.strip():
            return line, line.rstrip("\n") + "  # upstream drift\n"
    raise AssertionError(f"{patch}: no context line")


def test_broken_patch_fails_the_build(
    make_context: MakeContext, tmp_path: Path, build_args: list[str]
) -> None:
    ctx = make_context(tmp_path / "ctx")
    patches = sorted((ctx / PATCH_DIR).glob("*.patch"))
    assert patches, f"no patches in {PATCH_DIR}"
    patch = patches[0]
    old, drifted = _first_context_line(patch)
    text = patch.read_text(encoding="utf-8")
    patch.write_text(text.replace(old, drifted, 1), encoding="utf-8")
    target = next(
        line[len("+++ b/") :].strip() for line in text.splitlines() if line.startswith("+++ b/")
    )
    rc, out = build(ctx, build_args)
    assert rc != 0, "a patch whose context does not match must fail the build:\n" + out[-3000:]
    assert f"{patch.name}: does not apply to {target}" in out, out[-3000:]
    assert "COMMIT" not in out


def test_overlay_that_does_not_compile_fails_the_build(
    make_context: MakeContext, tmp_path: Path, build_args: list[str]
) -> None:
    ctx = make_context(tmp_path / "ctx")
    victim = ctx / VICTIM
    victim.write_text(victim.read_text(encoding="utf-8") + "\ndef broken(:\n", encoding="utf-8")
    rc, out = build(ctx, build_args)
    assert rc != 0, "an overlay file that does not compile must fail the build:\n" + out[-3000:]
    assert f"verify: FAIL {SITE}/{VICTIM}: does not byte-compile" in out, out[-3000:]
    assert "COMMIT" not in out


def _first_patched_file() -> str:
    """The file (relative to SITE) the first 0.6.3 patch changes."""
    patch = sorted((REPO_DIR / PATCH_DIR).glob("*.patch"))[0]
    text = patch.read_text(encoding="utf-8")
    return next(ln[len("+++ b/") :].strip() for ln in text.splitlines() if ln.startswith("+++ b/"))


def tampering(case: str) -> tuple[str, str]:
    """(what the tampering RUN does, the verify message that must name the file)"""
    if case == "stray-overlay-file":
        stray = f"{SITE}/vllm_overrides/stray.py"
        return (
            f"echo 'x = 1' > {stray}",
            f"verify: FAIL {stray}: not in the manifest (stray overlay file)",
        )
    target = VICTIM if case == "overlay-file-edited" else _first_patched_file()
    edited = f"{SITE}/{target}"
    return (
        f"echo '# tampered' >> {edited}",
        f"verify: FAIL {edited}: sha256 differs from the manifest",
    )


TAMPER_CASES = ["overlay-file-edited", "patched-vllm-file-edited", "stray-overlay-file"]


@pytest.mark.parametrize("case", TAMPER_CASES)
def test_tampering_after_deploy_fails_verify_in_a_build(
    case: str, image: str, tmp_path: Path
) -> None:
    tamper, message = tampering(case)
    (tmp_path / "Dockerfile").write_text(
        f"FROM {image}\nRUN {tamper}\nRUN PYTHON=python3 bash /workspace/patch_ops.sh verify\n",
        encoding="utf-8",
    )
    proc = podman("build", "--pull=never", "--network", "none", "--force-rm", str(tmp_path))
    assert proc.returncode != 0, f"{case}: the build must fail:\n{proc.stdout[-3000:]}"
    assert message in proc.stdout, proc.stdout[-3000:]
    assert "COMMIT" not in proc.stdout


def test_overlay_that_fails_on_import_fails_the_build(
    make_context: MakeContext, tmp_path: Path, build_args: list[str]
) -> None:
    ctx = make_context(tmp_path / "ctx")
    victim = ctx / VICTIM
    victim.write_text(
        victim.read_text(encoding="utf-8") + '\nraise RuntimeError("broken at import")\n',
        encoding="utf-8",
    )
    rc, out = build(ctx, build_args, tmp_path / "iid")
    if rc == 0:  # the wrong outcome: do not leave the image behind
        podman("rmi", (tmp_path / "iid").read_text().strip())
    assert rc != 0, "an overlay module that fails on import must fail the build"
    assert "vllm_overrides.media_errors: import failed" in out, out[-3000:]
