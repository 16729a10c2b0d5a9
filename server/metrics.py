"""Prometheus metrics read from the engine at scrape time (no global registry)."""
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybrid.scheduler import SlotState


class EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats, snapshot = self.engine.stats, self.engine.snapshot()
        requests = CounterMetricFamily("strata_requests", "Finished requests by finish reason", labels=["reason"])
        for reason, count in sorted(stats.requests.items()):
            requests.add_metric([reason], count)
        yield requests
        yield CounterMetricFamily("strata_prompt_tokens", "Prompt tokens read", value=stats.prompt_tokens)
        yield CounterMetricFamily("strata_generated_tokens", "Tokens generated", value=stats.generated_tokens)
        slots = GaugeMetricFamily("strata_slots", "Slots by state", labels=["state"])
        for state in SlotState:
            slots.add_metric([state.value], sum(1 for s in snapshot["slots"] if s["state"] == state.value))
        yield slots
        yield GaugeMetricFamily("strata_queue_length", "Requests waiting for a slot", value=snapshot["queue_length"])
        yield GaugeMetricFamily("strata_prompt_tokens_per_second", "Prompt read speed of the last step that read one",
                                value=stats.prompt_per_second)
        yield GaugeMetricFamily("strata_decode_tokens_per_second", "Tokens decoded per second, all slots, last step",
                                value=stats.decode_per_second)


def registry_for(engine):
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
