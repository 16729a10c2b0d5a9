"""The one-token matmuls' per-format tuning: which rows-per-group and lane width each launch gets, and
that every tuned module compiles (NVRTC, no GPU)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gpu_kernels.kernels import (DECODE_MIN_BLOCKS, DECODE_ROWS, DECODE_TUNING, LANE_SLICES, MATMUL_THREADS,
                                 GPU_INT16_FORMATS, SLICE_WEIGHTS, Kernels, format_tuning, gpu_act_quant,
                                 XQ_KERNELS, tuned_module_name, tuned_source)
from gpu_kernels.nvrtc import Nvrtc, find_library
from gpu_kernels.runtime import amd_chip
from gpu_kernels.sources import INT_DECODE, module_name, module_source


@pytest.fixture(autouse=True)
def blocks_round_x(monkeypatch):
    """The tuning as the per-block `_q` kernels take it: their `_qx` twins (x rounded once a launch, the default)
    launch with the same grid and arguments (test_a_twin_launches_as_its_per_block_kernel)."""
    monkeypatch.setattr("gpu_kernels.kernels.XQ_PER_LAUNCH", frozenset())


class LaunchRecorder:
    """The runtime calls Kernels makes to launch a matmul, recorded instead of run."""

    warp_size = 32
    multiprocessors = 132
    resident = 264  # blocks the GPU holds at once: 2 an SM on 132 SMs (an H100 at ~120 registers a thread)

    def __init__(self):
        self.compiled, self.launches, self.shared = [], [], []
        self.resident_asked = []

    def resident_blocks(self, function, threads, shared_mem=0):
        self.resident_asked.append((function, threads, shared_mem))
        return self.resident

    def compile(self, name, source, kernel_names):
        self.compiled.append((name, source))
        return {k: k for k in kernel_names}

    def launch(self, function, grid, block, args, shared_mem=0, stream=None):
        self.launches.append((function, grid, args))
        self.shared.append(shared_mem)

    @staticmethod
    def empty(shape, dtype):  # the scratch of x rounded once a launch (Kernels.xq_per_launch)
        return np.empty(shape, dtype)

    zeros = empty


def _one_token_launch(qtype, **tuning):
    rt = LaunchRecorder()
    raw = np.zeros((768, 8), np.uint8)  # the launch reads only its shape
    Kernels(rt, **tuning).matmul(raw, qtype, np.zeros((1, 2048), np.float32), np.zeros((1, 768), np.float32))
    (name, source), (function, grid, args) = rt.compiled[-1], rt.launches[-1]
    return name, source, function, grid, int(args[-2])


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_one_token_launch_takes_the_format_tuning(qtype):
    rows, slices = DECODE_TUNING.get(qtype, (DECODE_ROWS, LANE_SLICES))
    blocks = DECODE_MIN_BLOCKS.get(qtype, 0)
    name, source, function, grid, tpr = _one_token_launch(qtype, small_tuning=None)
    int16 = qtype in INT_DECODE and qtype in GPU_INT16_FORMATS
    assert function == ("matmul_1q" if int16 else "matmul_1") and name.endswith(f"_r{rows}_b{blocks}")
    assert f"#define DECODE_ROWS {rows}\n#define DECODE_MIN_BLOCKS {blocks}\n" in source
    assert tpr == min(32, 1 << max(0, -(-2048 // SLICE_WEIGHTS[qtype] // slices) - 1).bit_length())
    assert grid == (-(-768 // (MATMUL_THREADS // tpr * rows)), 1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_a_twin_launches_as_its_per_block_kernel(qtype):
    launches = {}
    for twins in (frozenset(), frozenset(XQ_KERNELS)):
        rt = LaunchRecorder()
        kernels = Kernels(rt, small_tuning=None)
        kernels.xq_per_launch = twins
        kernels.matmul(np.zeros((768, 8), np.uint8), qtype, np.zeros((1, 2048), np.float32),
                       np.zeros((1, 768), np.float32))
        (function, grid, args), shared = rt.launches[-1], rt.shared[-1]
        launches[bool(twins)] = function, grid, [int(a) for a in args[-4:]], shared, len(rt.launches)
    (one, grid, scalars, shared, count), (twin, twin_grid, twin_scalars, twin_shared, twin_count) = launches.values()
    assert one == "matmul_1q" and twin == "matmul_1qx" and twin_grid == grid and twin_scalars == scalars
    assert shared > 0 and twin_shared == 0 and twin_count == count + 1  # x staged by every block / by one launch before


def test_explicit_tuning_wins_for_every_format():
    name, source, _, grid, tpr = _one_token_launch(Q.Q4_K, decode_rows=1, lane_slices=1, min_blocks=3)
    assert name.endswith("_r1_b3") and "#define DECODE_MIN_BLOCKS 3\n" in source
    assert tpr == 32 and grid == (768 // (MATMUL_THREADS // 32), 1)


def test_small_one_token_launches_take_the_small_tuning():
    """Kernels(small_tuning=(rows, slices, prefetch)): a dense one-token launch whose blocks at its format's tuning
    would fill at most half the multiprocessors takes it; larger ones, expert launches (several tiles) and every
    launch where a tuning is given to every format keep their format's."""
    name, source, _, grid, tpr = _one_token_launch(Q.Q4_K, small_tuning=(1, 2, None))  # 6 blocks at (4, 8)
    assert name.endswith("_r1_b0") and tpr == 32 and grid == (768 // (MATMUL_THREADS // 32), 1)
    assert "DECODE_PREFETCH" not in source.split("\n", 3)[2]
    name, source, *_ = _one_token_launch(Q.Q4_K, small_tuning=(1, 2, 4))
    assert name.endswith("_r1_b0_p4") and source.startswith("#define DECODE_ROWS 1\n#define DECODE_MIN_BLOCKS 0\n"
                                                            "#define DECODE_PREFETCH 4\n")
    name, *_ = _one_token_launch(Q.Q4_K, small_tuning=(1, 2, 4), decode_rows=2)
    assert name.endswith("_r2_b0")
    rt = LaunchRecorder()
    rt.multiprocessors = 8  # the 6 blocks fill more than half of them
    Kernels(rt, small_tuning=(1, 2, 4)).matmul(np.zeros((768, 8), np.uint8), Q.Q4_K, np.zeros((1, 2048), np.float32),
                                               np.zeros((1, 768), np.float32))
    assert rt.compiled[-1][0].endswith(f"_r{DECODE_TUNING[Q.Q4_K][0]}_b0")
    rt = LaunchRecorder()
    _moe_launch(rt, Q.Q4_K, 768, 8, small_tuning=(1, 2, 4))
    assert rt.compiled[-1][0].endswith(f"_r{DECODE_TUNING[Q.Q4_K][0]}_b0")


def test_expert_launches_take_the_expert_prefetch(monkeypatch):
    """EXPERT_PREFETCH: the one-token expert launches (several tiles) compile with that DECODE_PREFETCH; the dense
    ones keep theirs."""
    import gpu_kernels.kernels as kmod

    monkeypatch.setattr(kmod, "EXPERT_PREFETCH", 4)
    rt = LaunchRecorder()
    _moe_launch(rt, Q.Q4_K, 768, 8)
    assert rt.compiled[-1][0].endswith("_p4") and "#define DECODE_PREFETCH 4\n" in rt.compiled[-1][1]
    name, *_ = _one_token_launch(Q.Q4_K, small_tuning=None)
    assert not name.endswith("_p4")


def test_tiled_kernels_keep_the_default_lane_width():
    rt = LaunchRecorder()
    raw = np.zeros((768, 8), np.uint8)
    Kernels(rt).matmul(raw, Q.Q4_K, np.zeros((19, 2048), np.float32), np.zeros((19, 768), np.float32))
    function, grid, args = rt.launches[-1]
    assert function == "matmul" and int(args[-2]) == 2048 // SLICE_WEIGHTS[Q.Q4_K] // LANE_SLICES
    assert int(args[-1]) == 1  # one run of rows a block: the tiled kernels never walk several


def _moe_launch(rt, qtype, num_rows, num_tiles, tile_tokens=1, **options):
    raw = np.zeros((4, num_rows, 8), np.uint8)  # [S, R, B]: the launch reads only its shape
    tiles = [np.zeros(num_tiles, np.int32)] * 3
    Kernels(rt, **options).moe_matmul(raw, qtype, np.zeros((num_tiles, 2048), np.float32),
                                      np.zeros((num_tiles, num_rows), np.float32), *tiles, tile_tokens=tile_tokens)
    function, grid, args = rt.launches[-1]
    return grid, int(args[-2]), int(args[-1])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_one_token_blocks_walk_runs_of_rows_once_the_gpu_is_full(qtype):
    rt = LaunchRecorder()
    per_block = lambda tpr: MATMUL_THREADS // tpr * Kernels(rt).tuning(qtype)[0]  # noqa: E731
    # decode: 8 pairs of a token, fewer blocks than the GPU holds: one run a block
    grid, tpr, chunks = _moe_launch(rt, qtype, 768, 8)
    assert chunks == 1 and grid == (-(-768 // per_block(tpr)), 8)
    # a bench-sized step, 128 pairs: the fewest runs that fit the launch on the GPU at once
    grid, tpr, chunks = _moe_launch(rt, qtype, 768, 128)
    blocks = -(-768 // per_block(tpr))
    assert blocks * 128 > rt.resident and chunks == -(-blocks * 128 // rt.resident)
    assert grid == (-(-blocks // chunks), 128) and grid[0] * grid[1] <= rt.resident
    assert rt.resident_asked and rt.resident_asked[-1][1] == MATMUL_THREADS


def test_row_chunks_setting_wins_and_stays_within_the_rows():
    rt = LaunchRecorder()
    grid, tpr, chunks = _moe_launch(rt, Q.Q4_K, 768, 8, row_chunks=2)
    blocks = -(-768 // (MATMUL_THREADS // tpr * Kernels(rt).tuning(Q.Q4_K)[0]))  # at one run a block
    assert chunks == 2 and grid[0] == -(-blocks // 2)
    grid, _, chunks = _moe_launch(rt, Q.Q4_K, 51, 8, row_chunks=5)  # one block's rows: at most one run
    assert chunks == 1 and grid[0] == 1
    grid, tpr, chunks = _moe_launch(rt, Q.Q4_K, 768, 300, tile_tokens=8, row_chunks=3)  # tiled: always 1
    assert chunks == 1 and grid == (-(-768 // (MATMUL_THREADS // tpr)), 300)


@pytest.mark.skipif(find_library() is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("qtype", sorted(DECODE_TUNING), ids=lambda q: Q(q).name)
def test_tuned_modules_compile_for_sm90(qtype):
    rows, _, blocks = format_tuning(qtype)
    cubin = Nvrtc().compile(tuned_module_name(qtype, rows, blocks), tuned_source(qtype, rows, blocks), "sm_90",
                            ("--std=c++14",))
    assert b"matmul_1" in cubin


@pytest.mark.skipif(find_library() is None, reason="no libnvrtc (pip install nvidia-cuda-nvrtc)")
def test_register_capped_module_compiles_for_sm90():
    """The launch bounds the benchmark sweeps (4 blocks of 256 threads: at most 64 registers a thread)."""
    source = "#define DECODE_ROWS 4\n#define DECODE_MIN_BLOCKS 4\n" + module_source(module_name(Q.Q4_K))
    assert b"moe_matmul_1" in Nvrtc().compile("matmul_q4_k_r4_b4", source, "sm_90", ("--std=c++14",))


@pytest.mark.parametrize("qtype,act_quant,num_cols,kernel,shared", [
    (Q.Q4_K, "int16", 2048, "matmul_1q", 2 * 2048 + 8 * 64),
    (Q.Q8_0, "int16", 768, "matmul_1q", 2 * 768 + 8 * 24),
    (Q.Q4_K, "float", 2048, "matmul_1", 0),
    (Q.BF16, "int16", 2048, "matmul_1", 0),  # no int16 dot: the float kernel
    (Q.Q8_0, "int16", 32768, "matmul_1", 0),  # x would not fit the shared memory cap
    (Q.Q4_K, "auto", 2048, "matmul_1q", 2 * 2048 + 8 * 64),  # measured faster with int16 x
    (Q.Q8_0, "auto", 768, "matmul_1q", 2 * 768 + 8 * 24),  # measured faster with int16 x
    (Q.Q5_K, "auto", 768, "matmul_1q", 2 * 768 + 8 * 24),
    (Q.BF16, "auto", 768, "matmul_1", 0),  # no int16 dot: float
], ids=["q4_k", "q8_0", "q4_k-float", "bf16", "q8_0-wide", "q4_k-auto", "q8_0-auto", "q5_k-auto", "bf16-auto"])
def test_one_token_kernel_takes_x_as_int16_where_it_can(qtype, act_quant, num_cols, kernel, shared):
    rt = LaunchRecorder()
    raw = np.zeros((768, 8), np.uint8)
    Kernels(rt, act_quant=act_quant).matmul(raw, qtype, np.zeros((1, num_cols), np.float32),
                                            np.zeros((1, 768), np.float32))
    assert rt.launches[-1][0] == kernel and rt.shared[-1] == shared


def test_act_quant_setting():
    assert gpu_act_quant() == "auto" and gpu_act_quant(None) == "auto"
    assert gpu_act_quant("AUTO") == "auto"
    assert gpu_act_quant("int16") == "int16"
    assert gpu_act_quant("Float") == "float"
    assert gpu_act_quant("int8") == "int16"  # no int8 dot on the GPU
    with pytest.raises(ValueError, match="act_quant 'fp8'"):
        gpu_act_quant("fp8")


@pytest.mark.parametrize("chip,act_quant,kernel", [
    (None, "auto", "matmul_1q"),  # NVIDIA: dp4a
    ("gfx1100", "auto", "matmul_1q"), ("gfx906", "auto", "matmul_1q"), ("gfx1030", "auto", "matmul_1q"),
    ("gfx900", "auto", "matmul_1"), ("gfx1010", "auto", "matmul_1"),  # four products a dot: float x
    ("gfx900", "int16", "matmul_1q"),  # asked for: kept
])
def test_auto_takes_float_x_on_amd_chips_without_a_dot_instruction(chip, act_quant, kernel):
    rt = LaunchRecorder()
    rt.chip = chip
    Kernels(rt, act_quant=act_quant).matmul(np.zeros((768, 34), np.uint8), Q.Q8_0, np.zeros((1, 1024), np.float32),
                                            np.zeros((1, 768), np.float32))
    assert rt.launches[-1][0] == kernel


def test_amd_chip_names():
    assert amd_chip(b"gfx90a:sramecc+:xnack-") == "gfx90a"
    assert amd_chip("gfx1100") == "gfx1100"
    assert amd_chip(None) is None and amd_chip(b"") is None
