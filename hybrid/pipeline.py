"""Pipelined slot groups over the stages (`--batch-groups`): a step's chunks (one per slot) are cut into groups that
move through the stages one after another, so that while stage 1 runs group 0, stage 0 (and its CPU experts) runs
group 1. Each stage has a worker thread of its own (its device and stream current there); a stage takes its groups
in order and each waits for its group's activations from the stage before, which hands them over through host
memory (a group's rows are a few KiB: one synchronous copy down and an upload, never racing the sender's next
group). Logits, routing records and the KV are those of the whole step: the group's rows are its chunks' rows.
Shape legend: T tokens, H hidden, V vocab.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cpu_kernels.target import use_chosen_threads

from .batch import Batch


def num_groups(setting, num_chunks, num_stages):
    """Groups of a step of num_chunks chunks: --batch-groups N (at most one per chunk), or "auto": one per stage
    when there are as many chunks, else 1 (stages in sequence)."""
    if setting == "auto":
        return num_stages if num_chunks >= num_stages else 1
    return max(1, min(int(setting), num_chunks))


class GroupUsage:
    """A group's view of the step's ExpertUsage: records its rows as decode or prompt rows."""

    def __init__(self, usage, decode_rows):
        self.usage, self.decode_rows = usage, decode_rows

    def record(self, layer, ids):
        self.usage.record_rows(layer, ids, self.decode_rows)


class Pipeline:
    """Runs a StagedModel's step as slot groups through its stages (one worker thread per stage)."""

    def __init__(self, model):
        self.model = model
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"stage{stage.index}", initializer=use_chosen_threads)
                         for stage in model.stages]

    def close(self):
        for worker in self._workers:
            worker.shutdown(wait=True)

    def run(self, batch, groups):
        """Logits [len(batch.logit_rows), V] of `batch` run as `groups` (sub-batches, in chunk order)."""
        handed = [None] * len(groups)
        for stage, worker in zip(self.model.stages, self._workers):
            handed = [worker.submit(self._stage_group, stage, group, before) for group, before in zip(groups, handed)]
        logits = np.concatenate([future.result() for future in handed])
        if len(batch.hidden_rows):  # the groups' hidden rows, in chunk order as the batch's
            batch.hidden = np.concatenate([group.hidden for group in groups if group.hidden is not None])
        return logits

    def _stage_group(self, stage, group, before):
        """One stage's part of one group, in the stage's thread: its activations (host [T, H]) for the next stage,
        or at the last stage the group's logits."""
        model, be = self.model, stage.backend
        if before is None:
            x = be.embed(model.token_embd, group.token_ids)  # [T, H]
        else:
            rows = before.result()  # [T, H] on the host
            be.begin_step()
            x = be.staging.upload("stage_in", rows, be.stream)
        start = model.event(be)
        stage.usage = None if model.usage is None else GroupUsage(
            model.usage, np.concatenate([np.full(len(c.token_ids), len(c.token_ids) == 1) for c in group.chunks]))
        if stage.split is not None:
            stage.split.begin_step()
        x = stage.runner.run(stage, x, stage.batch_of(group))  # [T, H]
        if stage.split is not None:
            stage.split.wait_host()
        out = model.head(be, x, group) if stage is model.stages[-1] else be.to_host(x)  # [T_out, V] or [T, H]
        if start is not None:
            stage.events = [start, model.event(be)]
        be.synchronize()
        if stage.split is not None:
            stage.split.finish_step(be, stage.usage)
        model.add_busy(stage)
        return out


def chunk_groups(batch, count):
    """`count` sub-batches of batch's chunks, consecutive, sizes as even as they go."""
    return [Batch([batch.chunks[i] for i in part]) for part in np.array_split(np.arange(len(batch.chunks)), count)]
