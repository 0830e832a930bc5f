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


# nvdisasm -c output, cut down: a kernel with a loop of one MMA (.L_x_1), then an outer loop
# (.L_x_0) around an inner one (.L_x_2) that holds both of its MMAs, a forward branch,
# predicated instructions and a self-loop; and a kernel without a loop.
SASS = """\
\t.target\tsm_90
//--------------------- .text._Z1kPf --------------------------
\t.section\t.text._Z1kPf,"ax",@progbits
.text._Z1kPf:
        .type           _Z1kPf,@function
_Z1kPf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDS R3, [R2] ;
        /*0020*/                   HMMA.16816.F32 R8, R12, R14, R8 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0040*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0050*/                   STS [R2], R3 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_2:
        /*0070*/                   LDSM.16.M88.4 R12, [R6] ;
        /*0080*/                   LD.E R7, desc[UR4][R6.64] ;
        /*0090*/                   MOVM.16.MT88 R7, R7 ;
        /*00a0*/                   HMMA.16816.F32 R8, R12, R14, R8 ;
        /*00b0*/              @!P1 HMMA.16816.F32 R8, R12, R16, R8 ;
        /*00c0*/                   STL [R1], R7 ;
        /*00c8*/                   IMAD.WIDE.U32 R6, R7, 0x4, R6 ;
        /*00d0*/              @!P2 BRA `(.L_x_3) ;
        /*00e0*/                   LDL R7, [R1] ;
.L_x_3:
        /*00f0*/               @P1 BRA `(.L_x_2) ;
        /*0100*/               @P3 BRA `(.L_x_0) ;
        /*0110*/                   STG.E desc[UR4][R4.64], R8 ;
        /*0120*/                   EXIT ;
.L_x_4:
        /*0130*/                   BRA `(.L_x_4);
//--------------------- .text._Z1gv --------------------------
.text._Z1gv:
_Z1gv:
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0010*/                   EXIT ;
"""


def test_parse_sass_counts_the_function_and_its_hot_loop() -> None:
    out = cuda_toolchain.parse_sass(SASS)
    assert set(out) == {"_Z1kPf", "_Z1gv"}
    fn = out["_Z1kPf"]["function"]
    assert fn["instructions"] == 21
    assert (fn["mma"], fn["ld_shared"], fn["st_shared"], fn["ld_global"]) == (3, 2, 1, 1)
    assert (fn["ld_generic"], fn["movm"], fn["local"], fn["barrier"], fn["st_global"]) == (
        1, 1, 2, 1, 1,
    )  # fmt: skip
    assert (fn["int_alu"], fn["fp32"]) == (1, 0)
    # The hot loop is .L_x_2 (0x0070 .. its back edge at 0x00f0): two MMAs, as many as the
    # outer .L_x_0 holds, in fewer instructions; .L_x_1 has one, .L_x_4 none.
    loop = out["_Z1kPf"]["hot_loop"]
    assert loop == {
        "instructions": 10, "mma": 2, "ld_shared": 1, "st_shared": 0, "ld_global": 0,
        "ld_generic": 1, "st_global": 0, "movm": 1, "local": 2, "barrier": 0, "int_alu": 1,
        "fp32": 0,
    }  # fmt: skip
    # A kernel without a loop has no hot loop.
    assert out["_Z1gv"]["hot_loop"] is None
    assert out["_Z1gv"]["function"]["ld_global"] == 1


def test_sass_loops_lists_each_loop_by_head_address() -> None:
    out = cuda_toolchain.sass_loops(SASS)
    k = out["_Z1kPf"]
    assert len(k["opcodes"]) == 21 and k["opcodes"][0] == "LDC"
    # .L_x_1 (0x10..0x30), .L_x_0 (0x40..0x100, around .L_x_2), .L_x_2 (0x70..0xf0), the
    # self-loop .L_x_4; .L_x_3 is a forward branch's target, not a loop.
    assert [len(loop) for loop in k["loops"]] == [3, 14, 10, 1]
    assert k["loops"][0] == ["LDS", "HMMA.16816.F32", "BRA"]
    assert k["loops"][1][0] == "LDG.E" and k["loops"][1][-1] == "BRA"
    assert k["loops"][3] == ["BRA"]
    assert out["_Z1gv"] == {"opcodes": ["LDG.E", "EXIT"], "loops": []}


def test_parse_sass_hot_loop_is_the_one_with_most_mmas() -> None:
    # Without .L_x_2's back edge, the outer .L_x_0 is the loop with the most MMAs (two against
    # .L_x_1's one), so it becomes the hot loop, its load and barrier included.
    text = SASS.replace("@P1 BRA `(.L_x_2) ;", "@P1 NOP ;")
    loop = cuda_toolchain.parse_sass(text)["_Z1kPf"]["hot_loop"]
    assert (loop["instructions"], loop["mma"], loop["barrier"], loop["ld_global"]) == (14, 2, 1, 1)


def test_sass_table_shows_each_trees_hot_loop() -> None:
    sass = cuda_toolchain.parse_sass(SASS)
    a = kr.KernelUsage("base", "a.cu", "sm_90", "void k", 64, 0, 0, 0, 1, sass["_Z1kPf"])
    b = kr.KernelUsage("new", "a.cu", "sm_90", "void k", 64, 0, 0, 0, 1, sass["_Z1gv"])
    lines = kr.sass_table([a, b], ["base", "new"]).splitlines()
    k = lines.index("sm_90  void k")
    base, new = lines[k + 1].split("|")[1:]
    assert base.split() == ["10", "2", "1", "0", "1", "1", "2", "1"]
    assert new.strip() == "-"
