"""Where the CPU backend's ops switch between a kernel's serial twin and its parallel form; the op-by-op
path (cpu.py) and the compiled layers (cpu_decode.py, cpu_layer_parts.py) make the same choices from these.

With one thread (only then), ops at most the SERIAL_* sizes run as serial twins: no parallel region to
open. At any thread count, ops of at most the TINY_* sizes run serially: they take ~1-4 us, far inside
the pool's spin time, while opening a region costs ~15-30 us at 16 threads.
"""
SERIAL_MAX_ELEMENTS = 1 << 15  # elementwise ops on at most this many values
SERIAL_MAX_ATTENTION = 1 << 20  # attention of at most this many query-key-dim products
SERIAL_MAX_WEIGHT_BYTES = 1 << 20  # a one-token matvec over at most this many weight bytes
TINY_MAX_ELEMENTS = 1 << 14  # elementwise ops on at most this many values
TINY_MAX_ATTENTION = 1 << 15  # attention of at most this many query-key-dim products
