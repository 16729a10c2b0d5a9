"""Prometheus metrics read from the engine at scrape time (no global registry)."""
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hybrid.scheduler import SlotState
from hybrid.staged_model import StagedModel


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
        yield CounterMetricFamily("strata_draft_n", "Draft tokens scored (speculative decoding)", value=stats.draft_n)
        yield CounterMetricFamily("strata_draft_n_accepted", "Draft tokens accepted", value=stats.draft_n_accepted)
        slots = GaugeMetricFamily("strata_slots", "Slots by state", labels=["state"])
        for state in SlotState:
            slots.add_metric([state.value], sum(1 for s in snapshot["slots"] if s["state"] == state.value))
        yield slots
        yield GaugeMetricFamily("strata_queue_length", "Requests waiting for a slot", value=snapshot["queue_length"])
        yield GaugeMetricFamily("strata_prompt_tokens_per_second", "Prompt read speed of the last step that read one",
                                value=stats.prompt_per_second)
        yield GaugeMetricFamily("strata_decode_tokens_per_second", "Tokens decoded per second, all slots, last step",
                                value=stats.decode_per_second)
        yield from self._expert_usage()
        if self.engine.conversations is not None:
            yield from self._conversation_cache(self.engine.conversations)

    def _expert_usage(self):
        model = self.engine.model
        usage = self.engine.usage.snapshot(getattr(model.backend, "resident", None))  # hit rates with a GPU
        if getattr(model, "residency", None) is not None:  # dynamic: hits counted against each step's mask
            usage.update(model.residency.snapshot())
        routings = CounterMetricFamily("strata_expert_routings", "Routed (token, expert) pairs", labels=["phase"])
        hit_rate = GaugeMetricFamily("strata_expert_cache_hit_rate",
                                     "Share of routed pairs whose expert was resident on the GPU", labels=["phase"])
        for phase in ("prefill", "decode"):
            routings.add_metric([phase], usage[f"routings_{phase}"])
            if usage.get(f"hit_rate_{phase}") is not None:
                hit_rate.add_metric([phase], usage[f"hit_rate_{phase}"])
        yield routings
        yield hit_rate
        if isinstance(model, StagedModel):
            yield from self._stages(model)

    @staticmethod
    def _stages(model):
        """Per GPU (pipeline stage): its device time and the hit rate of its layers' routed pairs."""
        busy = CounterMetricFamily("strata_gpu_busy_seconds", "Device time of each GPU's stage of the steps",
                                   labels=["stage", "device"])
        hit_rate = GaugeMetricFamily("strata_gpu_expert_cache_hit_rate", "Share of the routed pairs of a GPU's "
                                     "layers whose expert it holds", labels=["stage", "phase"])
        for stats in model.device_stats():
            busy.add_metric([str(stats["stage"]), stats["device"]], stats["busy_s"])
            for phase in ("prefill", "decode"):
                if stats[f"hit_rate_{phase}"] is not None:
                    hit_rate.add_metric([str(stats["stage"]), phase], stats[f"hit_rate_{phase}"])
        yield busy
        yield hit_rate

    def _conversation_cache(self, cache):
        s = cache.stats
        yield CounterMetricFamily("strata_conversation_cache_hits", "Prompts that restored a parked prefix",
                                  value=s.hits)
        yield CounterMetricFamily("strata_conversation_cache_misses", "Prompts with no parked prefix", value=s.misses)
        yield CounterMetricFamily("strata_conversation_cache_restored_tokens", "Prompt tokens restored, not read",
                                  value=s.restored_tokens)
        yield CounterMetricFamily("strata_conversation_cache_reread_tokens",
                                  "Prompt tokens read again because their conversation had been evicted",
                                  value=s.reread_tokens)
        yield GaugeMetricFamily("strata_conversation_cache_bytes", "Bytes of parked conversations",
                                value=cache.bytes_used)
        yield GaugeMetricFamily("strata_conversation_cache_state_bytes", "Bytes of parked recurrent-state checkpoints "
                                "(linear-attention models), part of strata_conversation_cache_bytes",
                                value=cache.state_bytes)
        yield GaugeMetricFamily("strata_conversation_cache_entries", "Parked conversations", value=len(cache.entries))
        evictions = CounterMetricFamily("strata_conversation_cache_evictions", "Evictions by cause", labels=["cause"])
        for cause, count in sorted(s.evictions.items()):
            evictions.add_metric([cause], count)
        yield evictions


def registry_for(engine):
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
