"""The layer runners are made from the recipe and chosen from the backend's declared capabilities."""
from hybrid.arch import ARCHS
from hybrid.backends.base import Capabilities
from hybrid.runners import GraphRunner, PlainRunner, choose_runner, graph_regions

RECIPE = ARCHS["qwen3moe"].recipe


def test_graph_regions_merge_the_capturable_steps():
    """qwen3moe's layer: the norm and q/k/v in one region, the attention alone (it takes each step's start), the
    output projection through the routing in another (its residual add and the FFN's norm one step), the experts and
    their residual add alone."""
    program = graph_regions(PlainRunner(RECIPE).steps)
    assert [(region, tuple(step.name for step in steps)) for region, steps in program] == [
        (0, ("norm", "project")), (None, ("attention",)), (1, ("output", "residual_norm", "route")),
        (None, ("experts",)), (None, ("residual",))]


class FakeBackend:
    def __init__(self, capabilities, layer_graphs=None):
        self.capabilities, self.layer_graphs = capabilities, layer_graphs
        self.asked = []

    def layer_runner(self, recipe, plain):
        self.asked.append(recipe)
        return "compiled"


def test_the_runner_follows_the_capabilities():
    plain = FakeBackend(Capabilities())
    assert isinstance(choose_runner(RECIPE, plain, True, None), PlainRunner)
    compiled = FakeBackend(Capabilities(compiled_decode_layer=True))
    assert choose_runner(RECIPE, compiled, True, None) == "compiled" and compiled.asked == [RECIPE]
    assert isinstance(choose_runner(RECIPE, compiled, False, None), PlainRunner)  # compiled_decode off
    assert isinstance(choose_runner(RECIPE, compiled, True, object()), PlainRunner)  # an expert split
    graphs = FakeBackend(Capabilities(graphed_decode=True), layer_graphs=object())
    runner = choose_runner(RECIPE, graphs, True, None)
    assert isinstance(runner, GraphRunner) and runner.regions() == [("norm", "project"),
                                                                    ("output", "residual_norm", "route")]
    assert isinstance(choose_runner(RECIPE, FakeBackend(Capabilities(graphed_decode=True)), True, None), PlainRunner)
