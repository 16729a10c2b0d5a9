"""`strata setup --check`: a short greedy generation with the written config, its decode speed against
setup's prediction."""
TOLERANCE = 0.25  # the acceptance bound of the prediction
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def check(path, plan, num_tokens):
    """One line: measured decode tok/s of one slot over `num_tokens` against the plan's prediction for one
    slot alone at the context it held, and whether it is within TOLERANCE."""
    from hybrid.config import resolve_sources
    from hybrid.config_file import read_config
    from hybrid.llm import LLM

    config, _ = resolve_sources(file=read_config(path))
    llm = LLM(config=config.with_settings(kv_sequences=1))
    try:
        llm.warm_up()
        out = llm.generate(PROMPT, max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    finally:
        llm.close()
    measured, made = out.timings["predicted_per_second"], out.timings["predicted_n"]
    context = out.timings["prompt_n"] + made // 2  # the tokens the slot held, on average over its decode
    predicted = plan.alone_at(context)
    ratio = measured / predicted if predicted else float("inf")
    verdict = "within" if abs(ratio - 1) <= TOLERANCE else "OUTSIDE"
    return (f"check: decode {measured:.1f} tok/s measured over {made} tokens at ~{context} tokens of context, "
            f"{predicted:.1f} predicted for one slot there ({ratio:.0%}): {verdict} {TOLERANCE:.0%}")
