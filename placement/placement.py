"""The Placement file: which (layer, expert) pairs each GPU holds, planned for which budget.

JSON: format, model id, layer/expert counts, per GPU its layer range, the budget it was planned
for and its resident (layer, expert) list; the predicted hit rate and decode speed of the plan
and of the baselines; the settings the plan was made with.
"""
import json
from dataclasses import asdict, dataclass, field

import numpy as np

FORMAT = "strata-placement"
VERSION = 1


class PlacementError(ValueError):
    """A placement file is unreadable or does not fit the model."""


@dataclass
class GpuPlacement:
    gpu: int
    first_layer: int
    last_layer: int  # exclusive
    resident: list  # [(layer, expert)], sorted
    budget: dict = field(default_factory=dict)  # GpuBudget.to_json()


@dataclass
class Placement:
    model_id: str
    num_layers: int
    num_experts: int
    gpus: list  # [GpuPlacement]
    predicted: dict = field(default_factory=dict)  # hit_rate, decode_tok_s, batch, step_ms
    baselines: dict = field(default_factory=dict)  # name -> {hit_rate, decode_tok_s}
    settings: dict = field(default_factory=dict)

    def resident_mask(self, num_layers, num_experts, gpu=None):
        """bool [L, E]: the experts GPU `gpu` holds (every GPU's when gpu is None)."""
        if (num_layers, num_experts) != (self.num_layers, self.num_experts):
            raise PlacementError(f"placement of {self.model_id} ({self.num_layers} layers x {self.num_experts} "
                                 f"experts) does not fit a model of {num_layers} layers x {num_experts} experts")
        mask = np.zeros((num_layers, num_experts), dtype=bool)
        for g in self.gpus:
            if gpu is None or g.gpu == gpu:
                for layer, expert in g.resident:
                    mask[layer, expert] = True
        return mask

    def layer_gpus(self):
        """int [L]: the GPU that runs each layer."""
        out = np.full(self.num_layers, -1, dtype=np.int64)
        for g in self.gpus:
            out[g.first_layer:g.last_layer] = g.gpu
        return out

    def to_json(self):
        out = {"format": FORMAT, "version": VERSION, **asdict(self)}
        for g in out["gpus"]:
            g["resident"] = [list(pair) for pair in g["resident"]]
        return out

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise PlacementError(f"{path}: cannot read the placement ({exc})") from None
        if data.get("format") != FORMAT:
            raise PlacementError(f"{path}: not a Strata placement (format {data.get('format')!r})")
        try:
            gpus = [GpuPlacement(g["gpu"], g["first_layer"], g["last_layer"],
                                 [tuple(pair) for pair in g["resident"]], g.get("budget", {})) for g in data["gpus"]]
            placement = cls(data["model_id"], data["num_layers"], data["num_experts"], gpus,
                            data.get("predicted", {}), data.get("baselines", {}), data.get("settings", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlacementError(f"{path}: malformed placement ({type(exc).__name__}: {exc})") from None
        placement._check(path)
        return placement

    def _check(self, path):
        for g in self.gpus:
            for layer, expert in g.resident:
                if not (g.first_layer <= layer < g.last_layer and 0 <= expert < self.num_experts):
                    raise PlacementError(f"{path}: GPU {g.gpu} lists expert ({layer}, {expert}) outside its "
                                         f"layers {g.first_layer}-{g.last_layer - 1} or the model's "
                                         f"{self.num_experts} experts")
