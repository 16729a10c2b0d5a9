"""One request's speculation: its drafter (n-gram, or MTP), its draft acceptance estimate and its draft counters."""
from .ngram import NgramDrafter
from .policy import best_k

DECAY = 0.8  # weight of the older verification steps in the acceptance estimate
PRIOR = (2.0, 1.0)  # pseudo-counts (accepted, rejected) the estimate starts from and drifts back to: p = 2/3,
# above the break-even of one draft where it costs up to 2/3 of a step (a CPU step of 2 tokens costs ~1.5 of one)
DRIFT = 0.05  # share of the way back to the prior per step that drafts nothing


class SlotSpeculation:
    """Drafts for one request. `p`, the chance that a draft is accepted given the ones before it were, is
    estimated from the request's own verification steps (recent ones weigh most); the number of drafts is the
    one of the most expected tokens per second at that p (`policy.best_k`). While the slot drafts nothing the
    estimate drifts back to the prior, so a request whose text turns repetitive later drafts again."""

    def __init__(self, settings, prompt_ids, drafter=None):
        """drafter: extend(token_ids), draft(k, min_p) and needs_hidden (an mtp.MtpDrafter); None: n-gram."""
        self.settings = settings
        self.drafter = NgramDrafter(settings.ngram) if drafter is None else drafter
        self.needs_hidden = drafter is not None and drafter.needs_hidden  # add_hidden after each forward pass
        self.drafter.extend(prompt_ids)
        self.accepted, self.rejected = PRIOR
        self.draft_n = self.draft_n_accepted = 0

    @property
    def p(self):
        return self.accepted / (self.accepted + self.rejected)

    def draft(self, limit, num_slots=1, times=None):
        """Up to `limit` draft tokens to follow the text so far (times: the step times, policy.StepTimes)."""
        k = best_k(self.p, min(self.settings.k, limit), num_slots, times) if limit > 0 else 0
        if k == 0:
            self.accepted += DRIFT * (PRIOR[0] - self.accepted)
            self.rejected += DRIFT * (PRIOR[1] - self.rejected)
            return []
        return self.drafter.draft(k, self.settings.min_p)

    def extend(self, token_ids):
        self.drafter.extend(token_ids)

    def add_hidden(self, start, rows):
        """The hidden rows [n, H] of positions [start, start + n) of the slot's last chunk."""
        self.drafter.add_hidden(start, rows)

    def record(self, num_drafted, num_accepted):
        """A verification step kept num_accepted of num_drafted drafts."""
        self.draft_n += num_drafted
        self.draft_n_accepted += num_accepted
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (num_accepted < num_drafted)
