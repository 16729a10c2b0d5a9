"""One request's speculation: its n-gram drafter, its adaptive number of drafts and its counters."""
from .ngram import NgramDrafter


class SlotSpeculation:
    """Drafts for one request. The number of drafts adapts to the request's own acceptance: after a step
    that kept every draft it grows by 2 (up to settings.k), after one that rejected a draft it shrinks by 1
    (down to 1), so text that copies its prompt drafts long runs and free text wastes little."""

    def __init__(self, settings, prompt_ids):
        self.settings = settings
        self.drafter = NgramDrafter(settings.ngram)
        self.drafter.extend(prompt_ids)
        self.k = settings.k
        self.draft_n = self.draft_n_accepted = 0

    def draft(self, limit):
        """Up to min(k, limit) draft tokens to follow the text so far."""
        return self.drafter.draft(min(self.k, limit), self.settings.min_p) if limit > 0 else []

    def extend(self, token_ids):
        self.drafter.extend(token_ids)

    def record(self, num_drafted, num_accepted):
        """A verification step kept num_accepted of num_drafted drafts."""
        self.draft_n += num_drafted
        self.draft_n_accepted += num_accepted
        if num_accepted == num_drafted:
            self.k = min(self.settings.k, self.k + 2)
        else:
            self.k = max(1, self.k - 1)
