"""A few rollouts of each trained step as text, to read what the policy writes: run_dir/samples.jsonl (one JSON row a
sample), TensorBoard's text tab (trainer-0, "samples") and a table in each of metrics.trackers.
`metrics.samples_per_step` of each step's batch, from as many groups, chosen by a generator seeded with the step (a
resumed run picks the same ones). Each row: the step that trained on it, the weights version that generated it, the
environment and task, the sample's reward and advantage, whether it was cut at the token limit, and its prompt and
completion as the tokenizer decodes them (special tokens kept: a tool call and the tool's answer show as the model saw
them; in a multi-turn episode the completion holds the environment's replies between the model's turns).

A run that resumes trains again the steps after its checkpoint: it appends {"resumed": "rl", "step": k}, and the rows
before that mark with a larger step are an earlier attempt's (`read_samples` leaves them out), as in the metrics."""

from __future__ import annotations

import json
import random
from typing import List

from rlhpc.run.rundir import RunDir
from rlhpc.transport.queue import RolloutBatch


def pick(batch: RolloutBatch, k: int, step: int) -> List[int]:
    """Indices of `k` samples of `batch`, each from another group (fewer when the batch has fewer groups)."""
    rng = random.Random(step)
    by_group: dict = {}
    for i, g in enumerate(batch.group_of.tolist()):
        by_group.setdefault(g, []).append(i)
    groups = sorted(by_group)
    return sorted(rng.choice(by_group[g]) for g in rng.sample(groups, min(k, len(groups))))


def rows(batch: RolloutBatch, indices: List[int], tokenizer, step: int) -> List[dict]:
    group_of = batch.group_of.tolist()
    out = []
    for i in indices:
        a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
        tokens, mask = batch.tokens[a:b].tolist(), batch.loss_mask[a:b].tolist()
        first = mask.index(True) if True in mask else len(tokens)
        g = batch.groups[group_of[i]]
        j = group_of[:i].count(group_of[i])  # the sample's place in its group
        out.append({
            "step": step, "version": g.version, "env": g.env, "task_id": g.task_id,
            "reward": round(float(g.rewards[j]), 6), "advantage": round(float(batch.advantages[i]), 6),
            "truncated": bool(g.truncated[j]),
            "prompt": tokenizer.decode(tokens[:first], skip_special_tokens=False),
            "completion": tokenizer.decode(tokens[first:], skip_special_tokens=False),
        })
    return out


def markdown(samples: List[dict]) -> str:
    """TensorBoard's text tab renders markdown: each sample's numbers, then its prompt and completion as code."""
    parts = []
    for r in samples:
        parts.append(f"**task {r['task_id']}** ({r['env']}, weights version {r['version']}): reward {r['reward']:.3f}, "
                     f"advantage {r['advantage']:+.3f}{', truncated' if r['truncated'] else ''}")
        for what in ("prompt", "completion"):
            text = r[what].replace("```", "` ` `")
            parts.append(f"{what}:\n\n```\n{text}\n```")
    return "\n\n".join(parts)


class Samples:
    """Rank 0's writer of samples.jsonl and the text tab."""

    def __init__(self, run: RunDir, k: int, tokenizer, metrics):
        self.run, self.k, self.tokenizer, self.metrics = run, k, tokenizer, metrics

    def resumed(self, step: int) -> None:
        if self.k and self.run.samples.exists():
            with open(self.run.samples, "a") as f:
                f.write(json.dumps({"resumed": "rl", "step": step}) + "\n")

    def write(self, step: int, batch: RolloutBatch) -> None:
        if not self.k:
            return
        samples = rows(batch, pick(batch, self.k, step), self.tokenizer, step)
        with open(self.run.samples, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in samples))
        self.metrics.samples(step, samples, markdown(samples))


def read_samples(run: RunDir) -> List[dict]:
    """The rows of samples.jsonl that belong to the run: those an earlier attempt wrote past a resume are left out."""
    if not run.samples.exists():
        return []
    kept: List[dict] = []
    for line in run.samples.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line cut by a crash
            continue
        if "resumed" in row:
            kept = [r for r in kept if r["step"] <= row["step"]]
        else:
            kept.append(row)
    return kept
