"""Every kernel module compiles for AMD chips without a GPU (Debian's ROCm 5.2 packages, as .ci/run installs): with
hiprtc, as CuPy for ROCm compiles them, into code objects for gfx906 (MI50, waves of 64); with hipcc into assembly
for gfx1100 (RX 7900 XTX, RDNA3, waves of 32), which Debian's device libraries do not cover.
Matmul modules compile at their format's decode tuning, as the runtime compiles them. The int16 decode kernels'
4-byte dots become the chip's dot instruction where it has one."""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpu_kernels import hiprtc
from gpu_kernels.errors import KernelCompileError
from gpu_kernels.hipcc import Hipcc, find_hipcc, kernel_assembly
from gpu_kernels.kernels import format_tuning, has_dot4, tuned_source
from gpu_kernels.sources import FORMAT_HEADERS, INT_DECODE, INT_DOT_KERNELS, module_name, module_source

from .module_sets import DEFAULT_MODULES, REST_MODULES, module_params

MODULES = DEFAULT_MODULES  # built at once by the `builds` fixture; REST_MODULES in the slow test
IDS = [name for name, _ in MODULES]
FORMAT_OF = {module_name(q): q for q in FORMAT_HEADERS}
needs_hiprtc = pytest.mark.skipif(hiprtc.find_library() is None, reason="no hiprtc (Debian: libamdhip64-dev)")
needs_hipcc = pytest.mark.skipif(find_hipcc() is None, reason="no hipcc (Debian: apt-get install hipcc)")
ROOT = Path(__file__).resolve().parents[2]
BROKEN = "\nextern \"C\" __global__ void broken(float* x) { x[0] = not_declared; }\n"


def runtime_source(name):
    """Module `name`'s source as the runtime compiles it: a matmul module at its format's decode tuning."""
    qtype = FORMAT_OF.get(name)
    if qtype is None:
        return module_source(name)
    rows, _, blocks = format_tuning(qtype)
    return tuned_source(qtype, rows, blocks)


@pytest.fixture(scope="module")
def hipcc():
    return Hipcc()


def assemble_all(hipcc, chip, names):
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return dict(zip(names, pool.map(lambda n: hipcc.assembly(n, runtime_source(n), chip), names)))


def hiprtc_all(chip):
    compiler = hiprtc.Hiprtc()
    return {name: compiler.compile(name, runtime_source(name), chip) for name in IDS}


@pytest.fixture(scope="module")
def builds():
    """(gfx906 code objects by module through hiprtc, gfx1100 assembly by module through hipcc), each None where its
    compiler is missing; made at once (hiprtc in this process, hipcc in others), as the two take about as long."""
    with ThreadPoolExecutor(1 + (os.cpu_count() or 2)) as pool:
        code = pool.submit(hiprtc_all, "gfx906") if hiprtc.find_library() else None
        hip = Hipcc() if find_hipcc() else None
        assembly = {n: pool.submit(hip.assembly, n, runtime_source(n), "gfx1100") for n in IDS} if hip else None
        return (code and code.result()), (assembly and {n: job.result() for n, job in assembly.items()})


@pytest.fixture(scope="module")
def gfx1100_assembly(builds):
    return builds[1]


@needs_hiprtc
def test_every_module_compiles_with_hiprtc_for_gfx906(builds):
    for name, kernel_names in MODULES:
        code = builds[0][name]
        assert code[:4] == b"\x7fELF", name
        for kernel in kernel_names:
            assert kernel.encode() in code, (name, kernel)


@needs_hiprtc
def test_a_hiprtc_compile_error_names_module_chip_and_shows_log():
    with pytest.raises(KernelCompileError) as info:
        hiprtc.Hiprtc().compile("ops_broken", module_source("ops") + BROKEN, "gfx906")
    assert "'ops_broken (gfx906)'" in str(info.value) and "not_declared" in str(info.value)


@pytest.mark.slow
@needs_hiprtc
@needs_hipcc
def test_the_less_common_formats_compile_for_gfx906_and_gfx1100(hipcc):
    compiler = hiprtc.Hiprtc()
    assembly = assemble_all(hipcc, "gfx1100", [name for name, _ in REST_MODULES])
    for name, kernel_names in REST_MODULES:
        code = compiler.compile(name, runtime_source(name), "gfx906")
        assert code[:4] == b"\x7fELF", name
        for kernel in kernel_names:
            assert kernel.encode() in code and f".amdhsa_kernel {kernel}\n" in assembly[name], (name, kernel)


@needs_hipcc
@pytest.mark.parametrize("name,kernel_names", [p for p in module_params() if not p.marks])
def test_module_compiles_for_gfx1100(gfx1100_assembly, name, kernel_names):
    assembly = gfx1100_assembly[name]
    for kernel in kernel_names:
        assert f".amdhsa_kernel {kernel}\n" in assembly, kernel
        assert len(kernel_assembly(assembly, kernel)) > 0
    assert ".amdhsa_wavefront_size32 1" in assembly


def dot_instructions(assembly):
    return [i for i in kernel_assembly(assembly, "matmul_1q") if i.startswith("v_dot4")]


@needs_hipcc
@pytest.mark.parametrize("chip,formats", [("gfx906", sorted(INT_DECODE)), ("gfx1030", [min(INT_DECODE)]),
                                          ("gfx1100", sorted(INT_DECODE))])
def test_int16_decode_dots_use_the_chips_dot_instruction(hipcc, gfx1100_assembly, chip, formats):
    names = [module_name(q) for q in formats]
    assemblies = ({n: gfx1100_assembly[n] for n in names} if chip == "gfx1100" else assemble_all(hipcc, chip, names))
    expected = "v_dot4_i32_iu8" if chip == "gfx1100" else "v_dot4"  # RDNA3: the signed/unsigned form, both signed
    for name, assembly in assemblies.items():
        dots = dot_instructions(assembly)
        assert dots and all(d.startswith(expected) for d in dots), (name, dots[:3])


@needs_hipcc
def test_chips_without_a_dot_instruction_take_four_products(hipcc):
    for chip in ("gfx900", "gfx1010"):
        assembly = hipcc.assembly("matmul_q8_0", module_source("matmul_q8_0"), chip)
        assert dot_instructions(assembly) == []
        assert any(i.startswith(("v_mul_i32_i24", "v_mad_i32_i24", "v_mul_lo")) for i in
                   kernel_assembly(assembly, "matmul_1q"))


@needs_hipcc
def test_the_hosts_list_of_chips_with_a_dot_instruction_is_the_kernels(hipcc):
    """kernels.has_dot4 (which makes "auto" take float x where it is False) says of each chip what its machine code
    shows: a dot instruction in the int16 kernel, or none."""
    chips = ["gfx900", "gfx906", "gfx908", "gfx90a", "gfx940", "gfx1010", "gfx1012", "gfx1030", "gfx1031", "gfx1100",
             "gfx1101", "gfx1103"]
    source = module_source("matmul_q8_0")
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        found = dict(zip(chips, pool.map(lambda c: bool(dot_instructions(hipcc.assembly("matmul_q8_0", source, c))),
                                         chips)))
    assert found == {chip: has_dot4(chip) for chip in chips}


@needs_hipcc
def test_a_hipcc_compile_error_names_module_chip_and_shows_log(hipcc):
    with pytest.raises(KernelCompileError) as info:
        hipcc.assembly("ops_broken", module_source("ops") + BROKEN, "gfx1100")
    message = str(info.value)
    assert "'ops_broken (gfx1100)'" in message
    assert "not_declared" in message and "ops_broken.hip" in message and "strata-hipcc-" not in message


@needs_hipcc
def test_the_assembly_bench_counts_fewer_loop_instructions_with_the_dot_instruction(tmp_path):
    """bench/hip_assembly.py on one format and chip: a row per one-token kernel, its dot loop shorter with the chip's
    dot instruction than with four products."""
    out = tmp_path / "table.md"
    done = subprocess.run([sys.executable, "bench/hip_assembly.py", "--chips", "gfx1100", "--formats", "q8_0",
                           "--output", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()[2:]]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        ("Q8_0", "gfx1100", kernel) for kernel in INT_DOT_KERNELS]
    for r in rows:
        products_loop, dot_loop, dots = int(r[5]), int(r[6]), int(r[7])
        assert dots > 0 and products_loop > dot_loop > 0
