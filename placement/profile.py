"""`ExpertProfile`: how often each layer's router picked each expert, for prefill and decode tokens.

File: an `.npz` with a JSON header (format, model id, layer/expert counts, experts per token,
tokens seen, sources) and the arrays prefill [L, E], decode [L, E], coactivation [L, E, E]
(symmetric: how often two experts were picked for the same token), and, where kept, the same
prefill and decode counts split into parts (part_prefill [P, L, E], part_decode [P, L, E],
part_tokens [P, 2]: prefill and decode tokens): one part per prompt of `strata profile` and per
merged recording, at most MAX_PARTS (prompt i goes to part i mod MAX_PARTS). The parts let the
planner check a plan on routings it did not plan from (planner.cross_check). Profiles add up.
Shape legend: L layers, E experts, P parts.
"""
import json
import logging
import os
import zipfile
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "strata-expert-profile"
VERSION = 1
ARRAYS = ("prefill", "decode", "coactivation")
PART_ARRAYS = ("part_prefill", "part_decode", "part_tokens")
MAX_PARTS = 32
HEADER_KEYS = ("model_id", "num_layers", "num_experts", "num_experts_per_tok", "tokens_prefill", "tokens_decode")


class ProfileError(ValueError):
    """A profile file is unreadable, or belongs to another model."""


def model_id(weights):
    """Identifies a model for profiles and placements: architecture, shape, and file name."""
    c = weights.config
    name = os.path.basename(os.path.normpath(weights.source))
    return f"{c.arch}-L{c.num_layers}-E{c.num_experts}-K{c.num_experts_per_tok}-H{c.hidden_size}:{name}"


@dataclass
class ExpertProfile:
    model_id: str
    num_experts_per_tok: int
    prefill: np.ndarray  # int64 [L, E] routings of prompt tokens
    decode: np.ndarray  # int64 [L, E] routings of generated tokens
    coactivation: np.ndarray  # int64 [L, E, E]
    tokens_prefill: int = 0
    tokens_decode: int = 0
    sources: list = field(default_factory=list)
    part_prefill: np.ndarray = None  # int64 [P, L, E] the prefill counts split into parts; None: no parts kept
    part_decode: np.ndarray = None  # int64 [P, L, E]
    part_tokens: np.ndarray = None  # int64 [P, 2] prefill and decode tokens of each part

    def __post_init__(self):
        L, E = np.shape(self.prefill)
        if self.part_prefill is None:
            self.part_prefill, self.part_decode = np.zeros((2, 0, L, E), np.int64)
            self.part_tokens = np.zeros((0, 2), np.int64)
        P = len(self.part_prefill)
        for name, shape in (("decode", (L, E)), ("coactivation", (L, E, E)), ("part_decode", (P, L, E)),
                            ("part_tokens", (P, 2))):
            if np.shape(getattr(self, name)) != shape:
                raise ProfileError(f"profile {self.model_id}: {name} has shape {np.shape(getattr(self, name))}, "
                                   f"expected {shape}")
        if P and not (np.array_equal(self.part_prefill.sum(axis=0), self.prefill)
                      and np.array_equal(self.part_decode.sum(axis=0), self.decode)
                      and tuple(self.part_tokens.sum(axis=0)) == (self.tokens_prefill, self.tokens_decode)):
            raise ProfileError(f"profile {self.model_id}: its parts do not add up to its counts")

    @classmethod
    def empty(cls, model_id, num_layers, num_experts, num_experts_per_tok):
        L, E = num_layers, num_experts
        return cls(model_id, num_experts_per_tok, np.zeros((L, E), np.int64), np.zeros((L, E), np.int64),
                   np.zeros((L, E, E), np.int64))

    @property
    def num_layers(self):
        return self.prefill.shape[0]

    @property
    def num_experts(self):
        return self.prefill.shape[1]

    def counts(self, phase="all"):
        """int64 [L, E] routings of `phase`: prefill, decode or all."""
        if phase == "all":
            return self.prefill + self.decode
        return {"prefill": self.prefill, "decode": self.decode}[phase]

    def tokens(self, phase="all"):
        return {"prefill": self.tokens_prefill, "decode": self.tokens_decode,
                "all": self.tokens_prefill + self.tokens_decode}[phase]

    def probabilities(self, phase="all"):
        """float64 [L, E]: the chance that one token of `phase` is routed to each expert."""
        num_tokens = self.tokens(phase)
        if num_tokens == 0:
            raise ProfileError(f"profile {self.model_id}: no {phase} tokens recorded")
        return np.clip(self.counts(phase) / num_tokens, 0.0, 1.0)

    def decode_estimate(self):
        """(float64 [L, E] per decode token, prior strength in routings): decode routings shrunk towards
        the prompt routings (see `shrunk_probabilities`); the prompt's alone without decode tokens, the
        decode's alone without prompt tokens."""
        if self.tokens() == 0:
            raise ProfileError(f"profile {self.model_id}: no tokens recorded")
        return decode_estimate(self.prefill, self.decode, self.tokens_prefill, self.tokens_decode,
                               self.num_experts_per_tok)

    def parts(self):
        """(prefill int64 [P, L, E], decode int64 [P, L, E], tokens int64 [P, 2]) of the parts that saw tokens;
        a profile without kept parts is one part."""
        if len(self.part_prefill):
            prefill, decode, tokens = self.part_prefill, self.part_decode, self.part_tokens
        else:
            prefill, decode = self.prefill[None], self.decode[None]
            tokens = np.array([[self.tokens_prefill, self.tokens_decode]], np.int64)
        seen = tokens.sum(axis=1) > 0
        return prefill[seen], decode[seen], tokens[seen]

    def with_parts(self, prefill, decode, tokens):
        """This profile with its counts split into parts (prefill, decode [P, L, E], tokens [P, 2], adding up to
        its counts), part i kept in part i mod MAX_PARTS."""
        P = len(prefill)
        fold = np.arange(P) % MAX_PARTS
        arrays = []
        for part, shape in ((prefill, (P, self.num_layers, self.num_experts)), (decode, None), (tokens, (P, 2))):
            part = np.asarray(part, np.int64).reshape(shape or (P, self.num_layers, self.num_experts))
            folded = np.zeros((min(P, MAX_PARTS), *part.shape[1:]), np.int64)
            np.add.at(folded, fold, part)
            arrays.append(folded)
        return ExpertProfile(self.model_id, self.num_experts_per_tok, self.prefill, self.decode, self.coactivation,
                             self.tokens_prefill, self.tokens_decode, list(self.sources), *arrays)

    def check_model(self, num_layers, num_experts, other_id=None, what="the model"):
        """Raises ProfileError when the profile's layer or expert count differs from the model's."""
        if (self.num_layers, self.num_experts) != (num_layers, num_experts):
            raise ProfileError(
                f"profile of {self.model_id} ({self.num_layers} layers x {self.num_experts} experts) does not fit "
                f"{what}{f' {other_id}' if other_id else ''} ({num_layers} layers x {num_experts} experts)")
        if other_id is not None and other_id != self.model_id:
            log.warning("profile of %s used for %s (same layer and expert counts)", self.model_id, other_id)

    def merge(self, other):
        """The sum of two profiles of the same model."""
        other.check_model(self.num_layers, self.num_experts, self.model_id, what="profile")
        if other.num_experts_per_tok != self.num_experts_per_tok:
            raise ProfileError(f"profiles of {self.model_id} and {other.model_id} route "
                               f"{self.num_experts_per_tok} vs {other.num_experts_per_tok} experts per token")
        merged = ExpertProfile(self.model_id, self.num_experts_per_tok, self.prefill + other.prefill,
                               self.decode + other.decode, self.coactivation + other.coactivation,
                               self.tokens_prefill + other.tokens_prefill, self.tokens_decode + other.tokens_decode,
                               self.sources + other.sources)
        mine, theirs = self.parts(), other.parts()
        return merged.with_parts(*(np.concatenate([a, b]) for a, b in zip(mine, theirs)))

    def __add__(self, other):
        return self.merge(other)

    def header(self):
        return {"format": FORMAT, "version": VERSION, "model_id": self.model_id, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "tokens_prefill": self.tokens_prefill, "tokens_decode": self.tokens_decode, "sources": self.sources}

    def save(self, target):
        """Write the profile to `target`, a path or a binary file object (an .npz either way)."""
        if hasattr(target, "write"):
            parts = {name: getattr(self, name) for name in PART_ARRAYS} if len(self.part_prefill) else {}
            np.savez_compressed(target, header=np.array(json.dumps(self.header())), prefill=self.prefill,
                                decode=self.decode, coactivation=self.coactivation, **parts)
            return
        with open(target, "wb") as f:  # a file object: np.savez would append .npz to a bare name
            self.save(f)

    @classmethod
    def load(cls, path):
        header, arrays = _read_profile_file(path)
        shape = (header["num_layers"], header["num_experts"])
        if arrays["prefill"].shape != shape:
            raise ProfileError(f"{path}: prefill counts have shape {arrays['prefill'].shape}, the header says {shape}")
        try:
            return cls(header["model_id"], header["num_experts_per_tok"], arrays["prefill"], arrays["decode"],
                       arrays["coactivation"], header["tokens_prefill"], header["tokens_decode"],
                       list(header.get("sources", [])), *(arrays.get(name) for name in PART_ARRAYS))
        except ProfileError as exc:
            raise ProfileError(f"{path}: {exc}") from None


def decode_estimate(prefill, decode, tokens_prefill, tokens_decode, experts_per_token):
    """ExpertProfile.decode_estimate of counts prefill, decode int [L, E] over that many tokens."""
    if tokens_decode == 0:
        return np.clip(np.asarray(prefill) / tokens_prefill, 0.0, 1.0), np.inf
    if tokens_prefill == 0:
        return np.clip(np.asarray(decode) / tokens_decode, 0.0, 1.0), 0.0
    return shrunk_probabilities(decode, prefill, experts_per_token)


PRIOR_STRENGTHS = np.concatenate([[0.0], np.geomspace(1.0, 1e6, 61)])  # routings per layer, tried in turn


def shrunk_probabilities(decode, prefill, experts_per_token):
    """(float64 [L, E], strength): each layer's decode routing shares, with the prompt routings as their prior.

    A profile often holds few decode tokens (a handful per prompt) and many prompt tokens: decode shares
    alone overfit those few tokens, prompt shares alone miss how decode differs. Per layer the estimate is
    (n_e + s * pi_e) / (N + s), n the decode counts (N their sum), pi the prompt shares (with half a routing
    added per expert, so that no expert is impossible): the posterior mean of a Dirichlet prior of strength s
    around pi. s, in routings and shared by all layers, maximises the leave-one-out likelihood of the decode
    routings, so the prompt prior counts for much while decode routings are few or agree with it, and fades
    as they accumulate and disagree. The prior weighs at most the prompt routings it was made from: at that
    strength the estimate is the pooled shares of both phases. Scaled by experts_per_token, a share becomes a
    per-token chance.
    """
    n = np.asarray(decode, dtype=np.float64)  # [L, E]
    prompt_routings = float(np.asarray(prefill).sum(axis=1).min())
    prior = np.asarray(prefill, dtype=np.float64) + 0.5
    prior /= prior.sum(axis=1, keepdims=True)  # [L, E]
    total = n.sum(axis=1, keepdims=True)  # [L, 1]
    best, best_ll = 0.0, -np.inf
    for s in [*PRIOR_STRENGTHS[PRIOR_STRENGTHS < prompt_routings], prompt_routings]:
        left_out = np.maximum(n - 1.0 + s * prior, 1e-300) / np.maximum(total - 1.0 + s, 1e-300)  # [L, E]
        ll = float(np.sum(n * np.log(left_out)))
        if ll > best_ll:
            best, best_ll = s, ll
    shares = (n + best * prior) / np.maximum(total + best, 1e-300)  # [L, E]
    return np.clip(shares * experts_per_token, 0.0, 1.0), float(best)


def _read_profile_file(path):
    """(header, int64 arrays) of a profile file; ProfileError in our words when it is not one."""
    not_profile = f"{path}: not a Strata expert profile"
    if not zipfile.is_zipfile(path):
        raise ProfileError(f"{not_profile} (not an .npz archive; `strata profile -o P.npz` writes one)")
    try:
        with np.load(path, allow_pickle=False) as data:
            header_text = str(data["header"]) if "header" in data.files else None
            arrays = {name: np.asarray(data[name], dtype=np.int64) for name in ARRAYS + PART_ARRAYS
                      if name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # numpy's text suggests unpickling: not ours
        raise ProfileError(f"{not_profile} (an .npz archive whose arrays are damaged or hold Python objects)") \
            from None
    if header_text is None:
        raise ProfileError(f"{not_profile} (an .npz archive without its header)")
    try:
        header = json.loads(header_text)
    except ValueError:
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        found = f"format {header.get('format')!r}" if isinstance(header, dict) else "its header is not a JSON object"
        raise ProfileError(f"{not_profile} ({found})")
    missing = [key for key in HEADER_KEYS if key not in header] + [name for name in ARRAYS if name not in arrays]
    if missing:
        raise ProfileError(f"{path}: damaged expert profile (no {', '.join(missing)})")
    return header, arrays
