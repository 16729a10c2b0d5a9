"""The decode relay's kernels (gpu_kernels/src/ops.cu: publish_decode, await_host_add) compiled for the CPU with
g++ and run as one thread of one block, against host memory another thread writes: the post order, the wait
on the host's flag, the add, and giving up at the timeout. The GPU test (test_decode_path.py) runs them on a
device through mapped memory."""
import ctypes
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from gpu_kernels.sources import SRC

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

MARKER = "// The device's clock in ns"  # the relay's part of ops.cu starts here and runs to its end

PRELUDE = r"""
#include <atomic>
#include <chrono>
typedef long long i64;
#define __HIP_PLATFORM_AMD__ 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx = {0, 0, 0}, blockDim = {1, 1, 1};
static inline void __syncthreads() {}
static inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline i64 wall_clock64() {  // 100 MHz, as clock_ns takes it
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count() / 10;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    ops = (SRC / "ops.cu").read_text()
    assert MARKER in ops
    path = tmp_path_factory.mktemp("relay")
    (path / "relay.cpp").write_text(PRELUDE + ops[ops.index(MARKER):])
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(path / "relay.so"),
                    str(path / "relay.cpp")], check=True, capture_output=True)
    found = ctypes.CDLL(str(path / "relay.so"))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    found.publish_decode.argtypes = [p, p, i32, p, p, p]
    found.await_host_add.argtypes = [p, p, i32, p, p, i64, p, i32, p, i32]
    return found


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _step(seq):
    return np.array([seq], np.int64)  # the step number, read by the kernels from (device) memory


def test_publish_posts_the_data_then_the_flag_and_the_clock(lib):
    rng = np.random.default_rng(1)
    packed = rng.standard_normal(2 * 8 + 300).astype(np.float32)
    box, flag, times, step = np.zeros_like(packed), np.zeros(8, np.int64), np.zeros(2, np.int64), _step(7)
    lib.publish_decode(_ptr(packed), _ptr(box), packed.size, _ptr(flag), _ptr(step), _ptr(times))
    np.testing.assert_array_equal(box, packed)
    assert flag[0] == 7 and times[0] > 0 and times[1] == 0


def test_await_adds_the_rows_once_posted_and_gives_up_at_its_timeout(lib):
    rng = np.random.default_rng(2)
    hidden, seq, layer = 300, 9, 4
    x = rng.standard_normal(hidden).astype(np.float32)
    rows = np.zeros(hidden, np.float32)
    flag, error, times = np.zeros(8, np.int64), np.zeros(8, np.int64), np.array([1, 0], np.int64)
    posted = rng.standard_normal(hidden).astype(np.float32)

    def host_posts():  # the rows, then the flag: the await must see these rows, not the zeros before them
        rows[:] = posted
        flag[0] = seq

    def wait(out, step, timeout_s, add=1):
        lib.await_host_add(_ptr(out), _ptr(rows), hidden, _ptr(flag), _ptr(_step(step)), int(timeout_s * 1e9),
                           _ptr(error), layer, _ptr(times), add)
        return out

    timer = threading.Timer(0.05, host_posts)
    timer.start()
    out = wait(x.copy(), seq, 10)
    timer.join()
    np.testing.assert_array_equal(out, x + posted)
    assert error[0] == 0 and times[1] > 0
    np.testing.assert_array_equal(wait(x.copy(), seq, 10, add=0), posted)  # the host rows alone

    np.testing.assert_array_equal(wait(x.copy(), seq + 1, 0.02), x)  # gave up: nothing added
    assert error[:2].tolist() == [seq + 1, layer]
    t0 = time.perf_counter()
    np.testing.assert_array_equal(wait(x.copy(), seq + 2, 10, add=0), 0 * x)  # an earlier wait gave up: at once
    assert time.perf_counter() - t0 < 5 and error[:2].tolist() == [seq + 1, layer]  # the first stays
    error[:2] = 0
    np.testing.assert_array_equal(wait(x.copy(), seq - 1, 10), x + posted)  # an older step's number passes at once
