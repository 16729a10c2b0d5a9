"""Every kernel module compiles for AMD chips with hipcc, without a GPU (Debian's `hipcc` package, as in .ci/run):
gfx906 (MI50, waves of 64) as a code object linked with ROCm's device libraries, gfx1100 (RX 7900 XTX, waves of 32)
as assembly, since Debian's device libraries stop at gfx1036. The int16 decode kernels' 4-byte dots become the
chip's dot instruction where it has one."""
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpu_kernels.errors import KernelCompileError
from gpu_kernels.hipcc import Hipcc, find_hipcc, kernel_assembly, linkable_chips
from gpu_kernels.sources import INT_DECODE, all_modules, module_name, module_source

pytestmark = pytest.mark.skipif(find_hipcc() is None, reason="no hipcc (Debian: apt-get install hipcc)")

MODULES = all_modules()
IDS = [name for name, _ in MODULES]


@pytest.fixture(scope="module")
def hipcc():
    return Hipcc()


def compile_all(compile_one, names):
    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        return dict(zip(names, pool.map(lambda n: compile_one(n, module_source(n)), names)))


@pytest.fixture(scope="module")
def gfx1100_assembly(hipcc):
    return compile_all(lambda name, source: hipcc.assembly(name, source, "gfx1100"), IDS)


@pytest.fixture(scope="module")
def gfx906_code_objects(hipcc):
    if "gfx906" not in linkable_chips(hipcc.device_libs):
        pytest.skip(f"ROCm's device libraries ({hipcc.device_libs}) have no gfx906")
    return compile_all(lambda name, source: hipcc.code_object(name, source, "gfx906"), IDS)


@pytest.mark.parametrize("name,kernel_names", MODULES, ids=IDS)
def test_module_compiles_for_gfx1100(gfx1100_assembly, name, kernel_names):
    assembly = gfx1100_assembly[name]
    for kernel in kernel_names:
        assert f".amdhsa_kernel {kernel}\n" in assembly, kernel
        assert len(kernel_assembly(assembly, kernel)) > 0
    assert ".amdhsa_wavefront_size32 1" in assembly


@pytest.mark.parametrize("name,kernel_names", MODULES, ids=IDS)
def test_module_links_for_gfx906(gfx906_code_objects, name, kernel_names):
    code = gfx906_code_objects[name]
    assert code.startswith(b"__CLANG_OFFLOAD_BUNDLE__")
    assert b"amdgcn-amd-amdhsa--gfx906" in code
    for kernel in kernel_names:
        assert kernel.encode() in code, kernel


def dot_instructions(assembly):
    return [i for i in kernel_assembly(assembly, "matmul_1q") if i.startswith("v_dot4")]


@pytest.mark.parametrize("chip,formats", [("gfx906", sorted(INT_DECODE)), ("gfx1030", [min(INT_DECODE)]),
                                          ("gfx1100", sorted(INT_DECODE))])
def test_int16_decode_dots_use_the_chips_dot_instruction(hipcc, gfx1100_assembly, chip, formats):
    names = [module_name(q) for q in formats]
    if chip == "gfx1100":
        assemblies = {n: gfx1100_assembly[n] for n in names}
    else:
        assemblies = compile_all(lambda name, source: hipcc.assembly(name, source, chip), names)
    expected = "v_dot4_i32_iu8" if chip == "gfx1100" else "v_dot4"  # RDNA3: the signed/unsigned form, both signed
    for name, assembly in assemblies.items():
        dots = dot_instructions(assembly)
        assert dots and all(d.startswith(expected) for d in dots), (name, dots[:3])


def test_chips_without_a_dot_instruction_take_four_products(hipcc):
    for chip in ("gfx900", "gfx1010"):
        assembly = hipcc.assembly("matmul_q8_0", module_source("matmul_q8_0"), chip)
        assert dot_instructions(assembly) == []
        assert any(i.startswith(("v_mul_i32_i24", "v_mad_i32_i24", "v_mul_lo")) for i in
                   kernel_assembly(assembly, "matmul_1q"))


def test_compile_error_names_module_chip_and_shows_log(hipcc):
    source = module_source("ops") + "\nextern \"C\" __global__ void broken(float* x) { x[0] = not_declared; }\n"
    with pytest.raises(KernelCompileError) as info:
        hipcc.assembly("ops_broken", source, "gfx1100")
    message = str(info.value)
    assert "'ops_broken (gfx1100)'" in message
    assert "not_declared" in message and "ops_broken.hip" in message and "strata-hipcc-" not in message
