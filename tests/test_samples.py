"""A few rollouts of each trained step as text (rlhpc/train/samples.py): what they hold, decoded by the run's own
tokenizer, and which rows of samples.jsonl a resumed run keeps."""

import json

import torch

from rlhpc.modeling.models import build_tokenizer
from rlhpc.run.rundir import RunDir
from rlhpc.train.samples import Samples, pick, read_samples, rows
from rlhpc.transport.queue import Group, RolloutBatch

TOK = build_tokenizer()


def batch_of(episodes):
    """episodes: [(group, prompt text, completion text, reward, advantage)], grouped as given."""
    tokens, offsets, mask, adv, group_of, groups = [], [0], [], [], [], {}
    for g, prompt, completion, reward, a in episodes:
        p, c = TOK.encode(prompt), TOK.encode(completion)
        tokens += p + c
        mask += [False] * len(p) + [True] * len(c)
        offsets.append(len(tokens))
        adv.append(a)
        group_of.append(g)
        groups.setdefault(g, Group(uid=f"u{g}", env="reverse_text", task_id=f"t{g}", version=3, num_samples=0,
                                   rewards=[], truncated=[]))
        groups[g].rewards.append(reward)
        groups[g].truncated.append(False)
        groups[g].num_samples += 1
    n = len(tokens)
    return RolloutBatch(torch.tensor(tokens), torch.tensor(offsets), torch.zeros(n), torch.tensor(mask),
                        torch.tensor(adv), torch.tensor(group_of), [groups[g] for g in sorted(groups)])


BATCH = batch_of([(0, "Reverse: abc", "cba", 1.0, 0.5), (0, "Reverse: abc", "cab", 0.0, -0.5),
                  (1, "Reverse: xyz", "zyx", 1.0, 0.0), (1, "Reverse: xyz", "zyx", 1.0, 0.0),
                  (2, "Reverse: hello", "olleh", 1.0, 0.9), (2, "Reverse: hello", "hello", 0.1, -0.9)])


def test_each_sample_is_decoded_with_its_own_reward_and_advantage_and_comes_from_its_own_group():
    picked = pick(BATCH, 2, step=7)
    assert len(picked) == 2 and len({BATCH.group_of[i].item() for i in picked}) == 2
    assert pick(BATCH, 2, step=7) == picked  # the same step picks the same (a resumed run too)
    assert len(pick(BATCH, 10, step=1)) == 3  # at most one per group
    every = rows(BATCH, list(range(6)), TOK, step=8)
    assert [(r["prompt"], r["completion"], r["reward"], r["advantage"]) for r in every] == [
        ("Reverse: abc", "cba", 1.0, 0.5), ("Reverse: abc", "cab", 0.0, -0.5), ("Reverse: xyz", "zyx", 1.0, 0.0),
        ("Reverse: xyz", "zyx", 1.0, 0.0), ("Reverse: hello", "olleh", 1.0, 0.9), ("Reverse: hello", "hello", 0.1, -0.9)]
    assert every[5]["task_id"] == "t2" and every[5]["version"] == 3 and every[5]["step"] == 8


class _Metrics:
    """What Samples hands to the metrics (rlhpc/run/metrics.py): each step's rows and its text for TensorBoard."""

    def __init__(self):
        self.texts = []

    def samples(self, step, rows, text):
        self.texts.append((rows, text, step))


def test_samples_jsonl_and_the_text_tab_hold_each_step_and_a_resume_replaces_the_steps_it_trains_again(tmp_path):
    run = RunDir(tmp_path).make()
    metrics = _Metrics()
    first = Samples(run, 2, TOK, metrics)
    for step in (1, 2, 3):
        first.write(step, BATCH)
    assert [r["step"] for r in read_samples(run)] == [1, 1, 2, 2, 3, 3]
    rows_of_step, text, step = metrics.texts[-1]
    assert step == 3 and [r["step"] for r in rows_of_step] == [3, 3]
    assert "```\nReverse: " in text and "reward " in text
    again = Samples(run, 2, TOK, metrics)  # relaunched, resumed from the checkpoint of step 2
    again.resumed(2)
    again.write(3, BATCH)
    assert [r["step"] for r in read_samples(run)] == [1, 1, 2, 2, 3, 3]
    # The file keeps both attempts' rows of step 3; read_samples only the second's.
    assert sum(1 for line in run.samples.read_text().splitlines() if json.loads(line).get("step") == 3) == 4
    Samples(run, 0, TOK, metrics).write(4, BATCH)  # metrics.samples_per_step=0: nothing
    assert max(r["step"] for r in read_samples(run)) == 3
