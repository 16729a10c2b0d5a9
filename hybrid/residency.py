"""Which experts the GPU's expert cache holds at start-up, and whether they move afterwards.

- a placement (`--placement placement.json`): its resident set for GPU 0, refused when it was
  planned for another model; the cache refuses it when the room left cannot hold it;
- a profile (`--expert-cache auto --profile P.npz`): planned at start-up with
  placement.planner for the room the cache actually has after dense weights, KV and scratch;
- neither: the cache's default fill (whole layers first, in order);
- `--expert-cache dynamic`: starts from the above (without either, the same number of experts in
  every layer) and swaps experts in the background (placement/dynamic.py).
The predicted hit rate is logged when a plan gives one. Shape legend: L layers, E experts.
"""
import logging

log = logging.getLogger(__name__)

EXPERT_CACHE_MODES = ("auto", "dynamic")


def expert_cache_device(device, placement=None, profile=None, mode="auto", cache_mib=None):
    """`device` checked, before the model loads, against the expert cache options, which need a GPU:
    with "cpu" they are a ValueError; with "auto" and no usable GPU they do nothing: "cpu" and a warning."""
    asked = [flag for flag, given in (("--placement", placement is not None), ("--profile", profile is not None),
                                      ("--expert-cache dynamic", mode == "dynamic"),
                                      ("--expert-cache-mib", cache_mib is not None)) if given]
    if not asked or device not in ("cpu", "auto"):
        return device
    if device == "cpu":
        raise ValueError(f"{', '.join(asked)}: set up the GPU's expert cache, so they do nothing with --device cpu")
    from gpu_kernels.runtime import probe

    found = probe()
    if found.runtime is not None:
        return device
    log.warning("%s: no usable GPU (%s), so they do nothing: every expert runs on the CPU", ", ".join(asked),
                found.reason)
    return "cpu"


def resident_choice(weights, placement=None, profile=None, mode="auto", batch=1, max_context=4096):
    """The GPU backend's `resident`: a mask bool [L, E], a function (room bytes, bytes per expert) -> mask
    that plans for the room, or None (the default fill). Bad input raises ValueError naming it."""
    from placement.placement import Placement
    from placement.profile import ExpertProfile, model_id

    if mode not in EXPERT_CACHE_MODES:
        raise ValueError(f"--expert-cache {mode!r}: expected one of {', '.join(EXPERT_CACHE_MODES)}")
    if placement is not None and profile is not None:
        raise ValueError("give --placement or --profile, not both (a placement was already planned from a profile)")
    c, name = weights.config, model_id(weights)
    if placement is not None:
        loaded = Placement.load(placement) if isinstance(placement, str) else placement
        mask = loaded.resident_mask(c.num_layers, c.num_experts, gpu=0)  # PlacementError when the model differs
        if loaded.model_id != name:
            log.warning("placement of %s used for %s (same layer and expert counts)", loaded.model_id, name)
        if len(loaded.gpus) > 1:
            log.warning("placement planned for %d GPUs: this engine uses GPU 0's %d experts", len(loaded.gpus),
                        int(mask.sum()))
        _log_prediction("placement", loaded, int(mask.sum()))
        return mask
    if profile is not None:
        loaded = ExpertProfile.load(profile) if isinstance(profile, str) else profile
        loaded.check_model(c.num_layers, c.num_experts, name)  # ProfileError when the model differs
        return _planner(weights, loaded, batch, max_context)
    if mode == "dynamic":
        from placement.residency import even_residency

        return lambda room, bytes_per_expert: even_residency(bytes_per_expert, c.num_experts, room)
    log.info("expert cache: no placement or profile, filled layer by layer (hit rate not predicted; "
             "see `strata profile` and `strata plan`)")
    return None


def _planner(weights, profile, batch, max_context):
    from placement.budget import ModelSizes
    from placement.planner import plan_slots

    sizes = ModelSizes.from_weights(weights)

    def plan_for_room(room, bytes_per_expert):
        num_slots = int(room // max(bytes_per_expert))
        placement = plan_slots(profile, sizes, num_slots, batch, max_context=max_context)
        _log_prediction(f"planned at start-up for {room / (1 << 20):.0f} MiB ({num_slots} slots)", placement,
                        placement.predicted["resident"])
        return placement.resident_mask(sizes.num_layers, sizes.num_experts)

    return plan_for_room


def _log_prediction(what, placement, num_resident):
    p, base = placement.predicted, placement.baselines
    if not p:
        log.info("expert cache: %s, %d experts resident (no prediction in the file)", what, num_resident)
        return
    log.info("expert cache: %s, %d experts resident: predicted hit rate %.1f%% (uniform %.1f%%, global top-k "
             "%.1f%%), decode %.1f tok/s at batch %s", what, num_resident, 100 * p["hit_rate"],
             100 * base["uniform"]["hit_rate"], 100 * base["global_top"]["hit_rate"], p["decode_tok_s"],
             p.get("batch"))
