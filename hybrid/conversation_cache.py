"""Parked conversations: token ids + KV kept in RAM so a returning conversation is not read again.

A finished request's KV is parked under a byte budget (and an entry limit only
when the user sets one). A new prompt restores the KV of its longest common
prefix with any parked conversation, in whole blocks of `block_tokens`, and
reads only the rest. Every block boundary is a checkpoint: a conversation
whose history was edited still restores up to the last block before the edit.

Eviction is GreedyDual-Size: each entry has a priority H = L + value, where
value is the re-read cost per byte, (1 + n / 8192) for n tokens (the reading
cost grows faster than linearly with n, through attention, while bytes grow
linearly), and L is the priority of the last evicted entry. A hit sets H
again from the current L, so recency counts; among entries of equal age the
long conversations, the ones that hurt most to read again, stay longest.
Equal priorities go least recently used first.

Models with linear-attention layers (Qwen3-Next) keep a recurrent state that cannot be cut at any prefix: their
sequences take state checkpoints every `checkpoint_tokens` tokens as they read (hybrid/recurrent_state.py; the
cache sets the interval on each sequence it sees), a parked conversation keeps its checkpoints plus one at its
end and the KV up to the last one, and a returning conversation restores the longest prefix that ends at a
checkpoint.

With `spill_dir`, every parked entry is also written to disk and loaded back
at start-up, so parked conversations survive a restart; a spill file of
another model is skipped with a warning, one that does not read back whole (its token ids
and state checkpoints are checksummed) is renamed to *.damaged with a warning (once: the next
start does not see it). A state checkpoint of another shape is skipped at restore with a warning.
"""
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from . import kv_store
from .recurrent_state import MAX_CHECKPOINTS, Checkpoint

log = logging.getLogger(__name__)

SPILL_MAGIC = "strata-parked-kv"
SPILL_VERSION = 1
MAX_EVICTED_HEADS = 4096  # evicted conversations remembered for the re-read count
ATTENTION_TOKENS = 8192  # tokens at which attention doubles the per-token reading cost (cost model above)


@dataclass(eq=False)  # entries are compared by identity
class Parked:
    token_ids: np.ndarray  # int64 [n]
    arrays: dict  # kv_store.pack output
    nbytes: int
    priority: float = 0.0
    last_used: int = 0  # the cache's access count when it was last parked or restored
    path: str = None  # spill file, when spilled
    checkpoints: list = field(default_factory=list)  # recurrent-state Checkpoints (linear-attention models)

    @property
    def num_tokens(self):
        return len(self.token_ids)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    reread_tokens: int = 0  # prompt tokens read again because their parked conversation had been evicted
    parked: int = 0
    evictions: dict = field(default_factory=lambda: {"bytes": 0, "entries": 0, "superseded": 0})


def model_fingerprint(weights):
    """Identifies the model whose KV a spill file holds: its config and its file's size and time."""
    from dataclasses import asdict

    stat = os.stat(weights.source)
    ident = {"config": asdict(weights.config), "source": os.path.basename(os.path.normpath(weights.source)),
             "size": stat.st_size, "mtime": int(stat.st_mtime)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def common_prefix(a, b):
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class ConversationCache:
    def __init__(self, budget_bytes, model_fingerprint, max_entries=None, block_tokens=64, store="f32",
                 spill_dir=None, checkpoint_tokens=1024):
        if store not in kv_store.STORES:
            raise ValueError(f"conversation cache KV store must be one of {', '.join(kv_store.STORES)}")
        if checkpoint_tokens <= 0 or checkpoint_tokens % block_tokens:
            raise ValueError(f"state checkpoint interval must be a positive multiple of {block_tokens} tokens, "
                             f"got {checkpoint_tokens}")
        self.checkpoint_tokens = checkpoint_tokens
        self.budget_bytes, self.max_entries, self.block_tokens = budget_bytes, max_entries, block_tokens
        self.store, self.fingerprint, self.spill_dir = store, model_fingerprint, spill_dir
        self.entries = []
        self.inflation = 0.0  # GreedyDual-Size's L
        self.accesses = 0
        self.evicted_heads = {}  # first block of an evicted conversation -> its tokens (to count re-reads)
        self.stats = CacheStats()
        if spill_dir:
            os.makedirs(spill_dir, exist_ok=True)
            self._load_spilled()

    @property
    def bytes_used(self):
        return sum(e.nbytes for e in self.entries)

    @property
    def state_bytes(self):
        """Bytes of the parked recurrent-state checkpoints (part of bytes_used)."""
        return sum(c.nbytes for e in self.entries for c in e.checkpoints)

    def _touch(self, entry):
        self.accesses += 1
        entry.priority = self.inflation + 1.0 + entry.num_tokens / ATTENTION_TOKENS
        entry.last_used = self.accesses

    def lookup(self, prompt_ids, recurrent=False):
        """(entry, tokens to restore) for the longest block-aligned common prefix (recurrent: the longest that ends
        at one of the entry's state checkpoints); (None, 0) on a miss.

        At least the last prompt token is left to read, so its logits get computed.
        """
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        best, usable = None, 0
        for entry in self.entries:
            n = min(common_prefix(entry.token_ids, prompt), len(prompt) - 1)
            if recurrent:
                n = max((c.position for c in entry.checkpoints if c.position <= n), default=0)
            else:
                n = n // self.block_tokens * self.block_tokens
            if n > usable:
                best, usable = entry, n
        if usable == 0:
            self.stats.misses += 1
            return None, 0
        return best, usable

    def restore(self, prompt_ids, seq_kv):
        """Copy the KV of the longest parked prefix of `prompt_ids` into `seq_kv`; returns the tokens restored."""
        recurrent = seq_kv.recurrent is not None
        if recurrent:
            seq_kv.recurrent.checkpoint_tokens = self.checkpoint_tokens
        entry, n = self.lookup(prompt_ids, recurrent)
        evicted = self.evicted_heads.get(self._head(prompt_ids))
        if evicted is not None:
            self.stats.reread_tokens += max(min(evicted, len(prompt_ids) - 1) - n, 0)
        if entry is None:
            return 0
        seq_kv.load(*kv_store.unpack(entry.arrays, n))
        if recurrent:
            try:
                seq_kv.recurrent.load_checkpoint(next(c for c in entry.checkpoints if c.position == n))
            except ValueError as exc:  # another model's state: never used
                log.warning("conversation cache: skipping a state checkpoint: %s", exc)
                seq_kv.truncate(0)
                self._evict(entry, "superseded")
                return 0
        self._touch(entry)
        self.stats.hits += 1
        self.stats.restored_tokens += n
        return n

    def park(self, token_ids, seq_kv, whole_blocks=False):
        """Keep the KV of `token_ids` (positions [0, n) of `seq_kv`).

        whole_blocks: keep only whole blocks, for a request that ended early (cancelled or failed): a
        restore never uses a partial block, and the conversation will not be extended from its end.
        """
        n = min(len(token_ids), seq_kv.length)
        checkpoints = []
        if seq_kv.recurrent is not None:  # only up to the last checkpoint can be restored: one at the end too
            state = seq_kv.recurrent
            checkpoints = [c for c in state.checkpoints if c.position <= n]
            if not whole_blocks and state.length == n and not (checkpoints and checkpoints[-1].position == n):
                checkpoints = (checkpoints + [state.checkpoint_now()])[-MAX_CHECKPOINTS:]
            n = checkpoints[-1].position if checkpoints else 0
        ids = np.asarray(token_ids[: n // self.block_tokens * self.block_tokens if whole_blocks else n],
                         dtype=np.int64)
        if len(ids) < self.block_tokens:
            return
        for entry in self.entries:
            if entry.num_tokens >= len(ids) and common_prefix(entry.token_ids, ids) == len(ids):
                self._touch(entry)  # already parked
                return
        arrays = kv_store.pack(*seq_kv.export(len(ids)), self.store, owned=True)  # export copies
        nbytes = sum(a.nbytes for a in arrays.values()) + ids.nbytes + sum(c.nbytes for c in checkpoints)
        entry = Parked(ids, arrays, nbytes, checkpoints=checkpoints)
        if entry.nbytes > self.budget_bytes:
            log.info("conversation of %d tokens (%.1f MiB) exceeds the cache budget; not parked",
                     len(ids), entry.nbytes / 2**20)
            return
        for old in [e for e in self.entries if common_prefix(e.token_ids, ids) == e.num_tokens]:
            self._evict(old, "superseded")  # the new conversation extends it
        self._insert(entry)
        if self.spill_dir:
            self._spill(entry)

    def _insert(self, entry):
        self._touch(entry)
        self.entries.append(entry)
        self.stats.parked += 1
        while self.bytes_used > self.budget_bytes:
            self._evict(self._lowest(), "bytes")
        while self.max_entries is not None and len(self.entries) > self.max_entries:
            self._evict(self._lowest(), "entries")

    def _lowest(self):
        return min(self.entries, key=lambda e: (e.priority, e.last_used))

    def _head(self, token_ids):
        return np.asarray(token_ids[: self.block_tokens], dtype=np.int64).tobytes()

    def _evict(self, entry, cause):
        self.entries.remove(entry)
        self.stats.evictions[cause] += 1
        if cause != "superseded":
            self.inflation = max(self.inflation, entry.priority)
            self.evicted_heads[self._head(entry.token_ids)] = entry.num_tokens
            if len(self.evicted_heads) > MAX_EVICTED_HEADS:
                del self.evicted_heads[next(iter(self.evicted_heads))]
        if entry.path and os.path.exists(entry.path):
            os.remove(entry.path)

    def _spill(self, entry):
        digest = hashlib.sha256(entry.token_ids.tobytes()).hexdigest()
        state = _state_arrays(entry.checkpoints)
        header = {"magic": SPILL_MAGIC, "version": SPILL_VERSION, "model": self.fingerprint,
                  "store": self.store, "num_tokens": entry.num_tokens, "tokens_sha256": digest,
                  "state_sha256": _state_digest(state)}
        path = os.path.join(self.spill_dir, f"{digest[:24]}.npz")
        tmp = f"{path}.tmp.npz"
        header_bytes = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        np.savez(tmp, header=header_bytes, token_ids=entry.token_ids, **entry.arrays, **state)
        os.replace(tmp, path)
        entry.path = path

    def _load_spilled(self):
        files = sorted((os.path.join(self.spill_dir, f) for f in os.listdir(self.spill_dir) if f.endswith(".npz")),
                       key=os.path.getmtime)
        for path in files:
            entry = self._read_spill(path)
            if entry is not None:
                self._insert(entry)
        if self.entries:
            log.info("conversation cache: %d parked conversations (%.1f MiB) loaded from %s",
                     len(self.entries), self.bytes_used / 2**20, self.spill_dir)

    def _read_spill(self, path):
        try:
            with np.load(path, allow_pickle=False) as data:
                header = json.loads(data["header"].tobytes().decode())
                arrays = {name: data[name] for name in data.files if name not in ("header", "token_ids")}
                state = {name: arrays.pop(name) for name in STATE_ARRAYS if name in arrays}
                ids = data["token_ids"]
        except Exception as exc:  # any unreadable file is skipped, never loaded
            _move_aside(path, f"unreadable ({exc})")
            return None
        problem = self._spill_problem(header)
        if problem:
            log.warning("skipping conversation spill file %s: %s", path, problem)
            return None
        damage = self._spill_damage(header, ids, arrays) or _state_damage(state, len(ids), header)
        if damage:
            _move_aside(path, damage)
            return None
        checkpoints = [Checkpoint(int(p), c, d) for p, c, d in zip(*(state.get(n, ()) for n in STATE_ARRAYS))]
        return Parked(ids.astype(np.int64), arrays, sum(a.nbytes for a in arrays.values()) + ids.nbytes
                      + sum(c.nbytes for c in checkpoints), path=path, checkpoints=checkpoints)

    def _spill_problem(self, header):
        """Why a whole spill file is not for this cache (left in place: another model or setting may use it)."""
        if not isinstance(header, dict) or header.get("magic") != SPILL_MAGIC or \
                header.get("version") != SPILL_VERSION:
            return "not a Strata conversation spill file of this version"
        if header.get("model") != self.fingerprint:
            return "written for another model"
        if header.get("store") != self.store:
            return f"stored as {header.get('store')}, this cache stores {self.store}"
        return None

    def _spill_damage(self, header, ids, arrays):
        if hashlib.sha256(ids.astype(np.int64).tobytes()).hexdigest() != header.get("tokens_sha256"):
            return "token ids do not match their checksum"
        if set(arrays) != kv_store.ARRAY_NAMES[self.store] or \
                any(a.ndim < 2 or a.shape[1] != len(ids) for a in arrays.values()):
            return "KV arrays do not match the token count or the store"
        return None


STATE_ARRAYS = ("state_positions", "state_conv", "state_delta")  # a spill file's recurrent-state checkpoints


def _state_arrays(checkpoints):
    """A parked entry's checkpoints as spill-file arrays (none without checkpoints)."""
    if not checkpoints:
        return {}
    return dict(zip(STATE_ARRAYS, (np.array([c.position for c in checkpoints], np.int64),
                                   np.stack([c.conv for c in checkpoints]), np.stack([c.delta for c in checkpoints]))))


def _state_digest(state):
    """sha256 of a spill file's checkpoint arrays (their bytes and shapes), or None without checkpoints."""
    if not state:
        return None
    digest = hashlib.sha256()
    for name in STATE_ARRAYS:
        digest.update(f"{name}{state[name].dtype}{state[name].shape}".encode())
        digest.update(np.ascontiguousarray(state[name]).tobytes())
    return digest.hexdigest()


def _state_damage(state, num_tokens, header):
    """What is wrong with a spill file's checkpoint arrays, or None (their shapes are checked at restore)."""
    if not state:
        return None
    if set(state) != set(STATE_ARRAYS):
        return "recurrent-state checkpoints incomplete"
    if _state_digest(state) != header.get("state_sha256"):
        return "recurrent-state checkpoints do not match their checksum"
    positions, conv, delta = (state[name] for name in STATE_ARRAYS)
    if positions.ndim != 1 or not len(positions) == len(conv) == len(delta) or \
            positions.min(initial=1) <= 0 or positions.max(initial=0) != num_tokens:
        return "recurrent-state checkpoints do not match the token count"
    return None


def _move_aside(path, damage):
    """Rename a damaged spill file to *.damaged, so that its warning is given once, not at every start."""
    aside = f"{path}.damaged"
    try:
        os.replace(path, aside)
    except OSError as exc:
        log.warning("skipping conversation spill file %s: %s; could not move it aside (%s)", path, damage,
                    exc.strerror)
        return
    log.warning("skipping conversation spill file %s: %s; moved aside to %s", path, damage, aside)
