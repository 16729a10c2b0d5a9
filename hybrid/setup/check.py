"""`strata setup --check`: short greedy generations with the written config, after a short prompt and after one
of the predictions' context, their decode speed against setup's prediction at the context each held."""
TOLERANCE = 0.25  # the acceptance bound of the prediction
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def check(path, plan, num_tokens):
    """Lines: measured decode tok/s of one slot over `num_tokens`, after the short PROMPT and after a prompt of
    about plan.context tokens, each against the plan's prediction for one slot alone at the context it held."""
    from hybrid.config import resolve_sources
    from hybrid.config_file import read_config
    from hybrid.llm import LLM

    config, _ = resolve_sources(file=read_config(path))
    llm = LLM(config=config.with_settings(kv_sequences=1))
    try:
        llm.warm_up()
        short = llm.tokenizer.encode(PROMPT)
        longest = llm.max_context - num_tokens
        prompts = [short] + ([_repeated(short, plan.context)] if len(short) < plan.context <= longest else [])
        return "\n".join(_line(llm, ids, plan, num_tokens) for ids in prompts)
    finally:
        llm.close()


def _repeated(ids, length):
    """`ids` repeated to `length` tokens."""
    return (ids * (length // len(ids) + 1))[:length]


def _line(llm, ids, plan, num_tokens):
    out = llm.generate(ids, max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    measured, made = out.timings["predicted_per_second"], out.timings["predicted_n"]
    context = out.timings["prompt_n"] + made // 2  # the tokens the slot held, on average over its decode
    predicted = plan.alone_at(context)
    ratio = measured / predicted if predicted else float("inf")
    verdict = "within" if abs(ratio - 1) <= TOLERANCE else "OUTSIDE"
    return (f"check: decode {measured:.1f} tok/s measured over {made} tokens at ~{context} tokens of context, "
            f"{predicted:.1f} predicted for one slot there ({ratio:.0%}): {verdict} {TOLERANCE:.0%}")
