"""The settings of the hybrid MoE split (hybrid/moe.py ExpertSplit), resolved by hybrid/config.py."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SplitSettings:
    """cpu_share: None for prefill borrow's cost model, else the share (0..1) of a chunk's non-resident pair rows,
    the least-used experts, kept on the host (placement/borrow.py).
    decode_relay: a decode step's host experts handed over through the relay (hybrid/relay.py), used where both
    sides have it. It meets the overlap target and decodes faster with experts resident, slower with none
    (bench/results/gpu_model.md).
    relay_tokens: the most tokens of a decode step (several users' tokens decoded together) that go through the
    relay, their resident pairs found by the device too; a step of more runs as a prompt chunk does.
    relay_threads: Numba threads of the relay worker's experts (None: set_threads' count). While the calling thread
    queues a step's first layers it takes a core, and a parallel region of every core then waits on the thread that
    shares one; fewer threads leave it a core.
    relay_graphs: a decode step whose host experts go through the relay runs as one device graph, the relay's waits on
    the host inside it (hybrid/step_graph.py), as a step with every expert resident does."""

    cpu_share: Optional[float] = None
    decode_relay: bool = True
    relay_tokens: int = 1
    relay_threads: Optional[int] = None
    relay_graphs: bool = True

    def __post_init__(self):
        if self.cpu_share is not None and not 0.0 <= self.cpu_share <= 1.0:
            raise ValueError(f"cpu_share={self.cpu_share}: expected a number from 0 to 1")
        if self.relay_tokens < 1:
            raise ValueError(f"relay_tokens={self.relay_tokens}: expected a token count >= 1")
        if self.relay_threads is not None and self.relay_threads < 1:
            raise ValueError(f"relay_threads={self.relay_threads}: expected a thread count >= 1")
