"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the text's last n-gram.

The drafter is an n-gram model over one slot's own prompt and output: for every context of 1 to N tokens
it keeps the token that followed its latest occurrence and how often each token followed it. A draft takes,
token after token, the latest follower of the longest context seen before; its confidence is the share of
that follower among the context's followers, multiplied along the draft. Updating costs N dict writes per
token, drafting N lookups per drafted token: nothing grows with the length of the text.
"""


class _Followers:
    """What followed one context: the latest token and the count of each."""

    __slots__ = ("latest", "counts", "total")

    def __init__(self):
        self.latest, self.counts, self.total = None, {}, 0

    def add(self, token):
        self.latest, self.total = token, self.total + 1
        self.counts[token] = self.counts.get(token, 0) + 1

    @property
    def share(self):
        return self.counts[self.latest] / self.total


class NgramDrafter:
    def __init__(self, max_ngram):
        self.max_ngram = max_ngram
        self.tokens = []
        self.contexts = [{} for _ in range(max_ngram)]  # [n - 1]: n-token tuple -> _Followers

    def extend(self, token_ids):
        """Append tokens of the slot's text (the prompt, then each output token)."""
        tokens = self.tokens
        for token in token_ids:
            token, end = int(token), len(tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                context = tuple(tokens[end - n:])
                followers = self.contexts[n - 1].get(context)
                if followers is None:
                    followers = self.contexts[n - 1][context] = _Followers()
                followers.add(token)
            tokens.append(token)

    def draft(self, k, min_p=0.0):
        """Up to k tokens to follow the text, while the product of their shares stays >= min_p."""
        out, confidence = [], 1.0
        while len(out) < k:
            followers = self._longest_match(out)
            if followers is None:
                break
            confidence *= followers.share
            if confidence < min_p:
                break
            out.append(followers.latest)
        return out

    def _longest_match(self, drafted):
        """The followers of the longest context (1 to N tokens) ending the text plus `drafted`, or None."""
        text = self.tokens + drafted if drafted else self.tokens
        for n in range(min(self.max_ngram, len(text)), 0, -1):
            followers = self.contexts[n - 1].get(tuple(text[len(text) - n:]))
            if followers is not None:
                return followers
        return None
