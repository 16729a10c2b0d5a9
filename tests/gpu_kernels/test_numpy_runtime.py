"""The NumPy stand-in runtime's graphs behave as CUDA graphs do: capturing records the queued copies and kernels
without running them, and each launch runs them with the arguments they had when captured."""
import numpy as np
import pytest

from gpu_kernels.numpy_runtime import NumpyRuntime

from .conftest import ReferenceKernels


def test_a_graph_replays_its_calls_with_the_arguments_they_were_captured_with():
    rt, kernels = NumpyRuntime(), ReferenceKernels()
    x, total, host = np.arange(4, dtype=np.float32), np.zeros(4, np.float32), np.zeros(4, np.float32)
    src = np.ones(4, np.float32)
    graph = rt.capture(None, lambda: (kernels.add_into(total, x), rt.copy_to_host_async(host, total, None)))
    assert not total.any() and not host.any() and len(graph.calls) == 2  # recorded, not run
    x[:] = 10  # the graph reads the array it was captured with, as it is at each launch
    graph.launch()
    graph.launch()
    np.testing.assert_array_equal(host, [20, 20, 20, 20])
    x = src  # a new array: the graph still reads the old one
    graph.launch()
    np.testing.assert_array_equal(host, [30, 30, 30, 30])
    kernels.add_into(total, x)  # outside a capture: runs now
    np.testing.assert_array_equal(total, [31, 31, 31, 31])


def test_a_capture_inside_a_capture_is_an_error():
    rt = NumpyRuntime()
    with pytest.raises(RuntimeError, match="already under way"):
        rt.capture(None, lambda: rt.capture(None, lambda: None))
    assert rt.capture(None, lambda: None).calls == []  # the failed capture ended


def test_a_capture_may_not_allocate_or_copy_synchronously():
    rt = NumpyRuntime()
    for work in (lambda: rt.empty((4,), np.float32), lambda: rt.to_host(np.zeros(4))):
        with pytest.raises(RuntimeError, match="during a graph capture"):
            rt.capture(None, work)
