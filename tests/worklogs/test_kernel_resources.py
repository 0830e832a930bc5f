"""worklogs/kernel_resources.py: ptxas's resource report read into rows
(scripts/cuda_toolchain.py), kernel names shortened, trees side by side. (The compile itself needs the ~200 MB CUDA wheels: `make kernel-resources`.)"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "worklogs"))
import kernel_resources as kr  # noqa: E402

from scripts import cuda_toolchain  # noqa: E402

# ptxas 13.0 --resource-usage output, two entries (the second without a barrier clause).
PTXAS = """\
ptxas info    : 144 bytes gmem
ptxas info    : Compiling entry function '_ZN12_GLOBAL__N_13fooILb1EEEvPKfi' for 'sm_90'
ptxas info    : Function properties for _ZN12_GLOBAL__N_13fooILb1EEEvPKfi
    24 bytes stack frame, 44 bytes spill stores, 20 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size
ptxas info    : Compile time = 119.873 ms
ptxas info    : Compiling entry function '_Z3barPf' for 'sm_80'
ptxas info    : Function properties for _Z3barPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers
"""


def test_parse_ptxas_reads_every_entry() -> None:
    rows = cuda_toolchain.parse_ptxas(PTXAS)
    assert [r["mangled"] for r in rows] == ["_ZN12_GLOBAL__N_13fooILb1EEEvPKfi", "_Z3barPf"]
    assert rows[0] == {
        "mangled": "_ZN12_GLOBAL__N_13fooILb1EEEvPKfi", "arch": "sm_90", "stack": 24,
        "spill_stores": 44, "spill_loads": 20, "registers": 255, "barriers": 1,
    }  # fmt: skip
    assert (rows[1]["arch"], rows[1]["registers"], rows[1]["barriers"]) == ("sm_80", 12, 0)
    assert rows[1]["spill_stores"] == rows[1]["spill_loads"] == 0


def test_short_name_keeps_the_template_drops_the_parameters() -> None:
    name = (
        "void moe_grouped_gemm_kernel<c10::Half, (bool)1, (bool)0>"
        "(c10::Half const*, long, int const*)"
    )
    assert kr.short_name(name) == "void moe_grouped_gemm_kernel<Half, true, false>"
    # A '(' inside the template arguments is not the parameter list.
    assert kr.short_name("void k<(int)4>(float*)") == "void k<(int)4>"


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="needs binutils' c++filt")
def test_demangle_through_cxxfilt_drops_the_anonymous_namespace() -> None:
    assert kr.demangle(["_ZN12_GLOBAL__N_13fooILb1EEEvPKfi", "_Z3barPf"]) == [
        "void foo<true>",
        "bar",
    ]


def test_table_puts_trees_side_by_side() -> None:
    def usage(tree: str, regs: int, st: int) -> kr.KernelUsage:
        return kr.KernelUsage(tree, "a.cu", "sm_90", "void k<Half>", regs, st, st, 8, 1)

    rows = [usage("base", 128, 32), usage("new", 242, 0), usage("new", 64, 0)]
    rows[2].kernel = "void only_new"
    text = kr.table(rows, ["base", "new"])
    lines = text.splitlines()
    k = lines.index("sm_90  void k<Half>")
    assert lines[k + 1].split("|")[1:] == ["  128    32/32        8 ", "  242     0/0         8"]
    j = lines.index("sm_90  void only_new")
    assert "-" in lines[j + 1].split("|")[1] and "64" in lines[j + 1].split("|")[2]
