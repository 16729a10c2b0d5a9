"""Every kernel module compiles with NVRTC for sm_90, without a GPU (NVRTC from the nvidia-cuda-nvrtc wheel)."""
import pytest

from gpu_kernels.errors import KernelCompileError
from gpu_kernels.nvrtc import Nvrtc, find_library
from gpu_kernels.sources import module_source

from .module_sets import module_params

pytestmark = pytest.mark.skipif(find_library() is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")


@pytest.fixture(scope="module")
def nvrtc():
    return Nvrtc()


@pytest.mark.parametrize("name,kernel_names", module_params())
def test_module_compiles_for_sm90(nvrtc, name, kernel_names):
    cubin = nvrtc.compile(name, module_source(name), "sm_90", ("--std=c++14",))
    assert cubin[:4] == b"\x7fELF"
    for kernel in kernel_names:
        assert kernel.encode() in cubin, kernel


def test_compile_error_names_module_and_shows_log(nvrtc):
    source = module_source("ops") + "\nextern \"C\" __global__ void broken(float* x) { x[0] = not_declared; }\n"
    with pytest.raises(KernelCompileError) as info:
        nvrtc.compile("ops_broken", source)
    assert "'ops_broken'" in str(info.value)
    assert "not_declared" in str(info.value) and "undefined" in str(info.value)
