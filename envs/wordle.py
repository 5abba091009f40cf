"""Wordle: find a secret 5-letter word in at most 6 guesses, with per-letter feedback after each guess.

The secret words are reasoning-gym's 2,315-word Wordle answer list; a guess must be a word of that list or (with
`guesses: extended`, the default) of reasoning-gym's larger 5-letter word lists. The policy ends each turn with its
guess as <guess>crane</guess>; the environment answers with the guess spelled out and one mark per letter:

    C R A N E
    . Y . . G
    5 guesses left.

G: right letter, right spot. Y: in the word, elsewhere. ".": not in the word, or no more copies of it than the G/Y
marks already account for (the secret "abbey" marks the guess "babes" as Y Y G G .). A reply without a guess, or a
guess that is not a known 5-letter word, gets a message saying so and uses up the guess (counted as
env/invalid_guesses).

Reward: solved in k of N guesses: 0.7 + 0.3 * (N - k) / (N - 1) (1.0 in one guess, 0.7 in the last). Not solved:
0.2 * best + 0.1 * valid, where best is the most feedback any valid guess earned ((greens + yellows / 2) / 5) and valid
the fraction of turns with a valid guess, so an unsolved episode earns at most 0.26 and one without a valid guess 0.
The episode is scored by replaying the policy's turns (the trainer does not ask for a reply to the last turn).
"""

from __future__ import annotations

import csv
import random
import re
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from rlhpc.env import Environment, Task
from rlhpc.env.base import Message, Reply

WORD_LENGTH = 5
SOLVED = "G" * WORD_LENGTH
OPENER = "slate"  # the scripted solver's first guess

_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S | re.I)
_GUESS = re.compile(r"<guess>(.*?)</guess>", re.S | re.I)
_BARE = re.compile(r"[A-Za-z]+")


def answer_words() -> List[str]:
    """reasoning-gym's Wordle answer list (2,315 words), in its own order."""
    try:
        from reasoning_gym.data.wordle_words import wordle_words
    except ImportError as e:
        raise ImportError("envs/wordle.py takes its secret words from reasoning-gym's Wordle list "
                          f"(reasoning_gym.data.wordle_words), which cannot be imported here: {e}. "
                          "Install reasoning-gym (pip install reasoning-gym).") from e
    return [w.lower() for w in wordle_words]


def extra_words() -> set:
    """The 5-letter words of reasoning-gym's other word lists (words.csv, words3to10.txt), lower-case, letters only;
    empty when a list is missing."""
    from importlib import resources

    words = set()
    try:
        data = resources.files("reasoning_gym.data")
        with (data / "words.csv").open() as f:
            words |= {row.get("5_letter", "").lower() for row in csv.DictReader(f)}
        words |= {w for w in (data / "words3to10.txt").read_text().split() if w.islower()}
    except (OSError, ModuleNotFoundError):
        pass
    return {w for w in words if len(w) == WORD_LENGTH and w.isascii() and w.isalpha()}


def feedback(secret: str, guess: str) -> str:
    """Wordle's marks for `guess`: G (right spot), Y (elsewhere in the word), . (absent). Greens are taken first and a
    letter is marked Y only while the secret has unmatched copies of it, left to right."""
    marks = ["."] * WORD_LENGTH
    unmatched = Counter()
    for i, (s, g) in enumerate(zip(secret, guess)):
        if s == g:
            marks[i] = "G"
        else:
            unmatched[s] += 1
    for i, g in enumerate(guess):
        if marks[i] == "." and unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def parse_guess(text: str) -> Optional[str]:
    """The guess in a reply: the last <guess>...</guess> outside any <think> block, or a reply that is a single
    word; lower-cased, surrounding blanks and punctuation removed. None when there is no guess."""
    text = _THINK.sub("", text or "")
    tags = _GUESS.findall(text)
    if tags:
        word = tags[-1]
    else:
        words = _BARE.findall(text)
        if len(words) != 1:
            return None
        word = words[0]
    word = word.strip().strip("\"'`*.,!:;").strip().lower()
    return word or None


class Wordle(Environment):
    name = "wordle"
    max_turns = 6

    def __init__(self, eval_size: int = 100, eval_seed: int = 12345, guesses: str = "extended",
                 max_guesses: int = 6):
        answers = answer_words()
        if not 1 <= eval_size < len(answers):
            raise ValueError(f"env.args.eval_size: need 1 <= eval_size < {len(answers)} (the answer list), "
                             f"got {eval_size}")
        if guesses not in ("answers", "extended"):
            raise ValueError(f"env.args.guesses: 'answers' (the {len(answers)} secret words) or 'extended' "
                             f"(plus reasoning-gym's other 5-letter words), got {guesses!r}")
        if not 1 <= max_guesses <= 20:
            raise ValueError(f"env.args.max_guesses: need 1 to 20, got {max_guesses}")
        self.max_guesses = self.max_turns = max_guesses
        self.answers = answers
        self.allowed = set(answers) | (extra_words() if guesses == "extended" else set())
        held_out = random.Random(eval_seed).sample(range(len(answers)), eval_size)
        self._eval = [answers[i] for i in held_out]
        eval_set = set(self._eval)
        self._train = [w for w in answers if w not in eval_set]
        self._solver_cache: Dict[tuple, str] = {}

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split == "eval":
            for i, word in enumerate(self._eval):
                yield Task(f"eval-{i}", {"secret": word})
            return
        rng = random.Random(seed)
        i = 0
        while True:  # each pass over the train words in a new order
            for word in rng.sample(self._train, len(self._train)):
                yield Task(f"{seed}-{i}", {"secret": word})
                i += 1

    def messages(self, task: Task) -> List[Message]:
        n = self.max_guesses
        return [{"role": "user", "content": (
            f"Let's play Wordle. I have chosen a secret {WORD_LENGTH}-letter English word; find it in at most {n} "
            f"guess{'es' if n > 1 else ''}.\n"
            "After each guess I show your word and one mark per letter:\n"
            "G = right letter in the right spot, Y = in the word but in another spot, "
            ". = not in the word (or no more copies of it).\n"
            f"Each guess must be a real {WORD_LENGTH}-letter English word. End your reply with your guess inside "
            "<guess></guess>, for example <guess>crane</guess>.")}]

    # The episode: state = {"guesses": [word or None per turn], "marks": [marks or an error text per turn],
    # "invalid": count, "solved": bool}.
    def start(self, task: Task) -> Dict[str, Any]:
        return {"guesses": [], "marks": [], "invalid": 0, "solved": False}

    def judge(self, secret: str, completion: str) -> Tuple[Optional[str], str]:
        """(the valid guess or None, its marks or the reason it is invalid)."""
        word = parse_guess(completion)
        if word is None:
            return None, "No guess found: end your reply with your guess inside <guess></guess>."
        if len(word) != WORD_LENGTH or not word.isalpha():
            return None, f'"{word[:40]}" is not a {WORD_LENGTH}-letter word.'
        if word not in self.allowed:
            return None, f'"{word}" is not in the word list.'
        return word, feedback(secret, word)

    def respond(self, task: Task, state: Dict[str, Any], completion: str) -> Reply:
        secret = task.data["secret"]
        word, marks = self.judge(secret, completion)
        state["guesses"].append(word)
        state["marks"].append(marks)
        left = self.max_guesses - len(state["guesses"])
        if word is None:
            state["invalid"] += 1
            text = f"{marks} That used a guess."
        else:
            text = f"{' '.join(word.upper())}\n{' '.join(marks)}"
        if word is not None and marks == SOLVED:
            state["solved"] = True
            n = len(state["guesses"])
            text += f"\nSolved in {n} guess{'es' if n > 1 else ''}."
        elif left <= 0:
            text += f"\nNo guesses left: the word was {secret.upper()}."
        else:
            text += f"\n{left} guess{'es' if left > 1 else ''} left."
        return Reply([{"role": "user", "content": text}], done=state["solved"] or left <= 0,
                     counts={"invalid_guesses": float(word is None)})

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        secret, n = task.data["secret"], self.max_guesses
        turns = completions[:n]
        best, valid = 0.0, 0
        for k, completion in enumerate(turns, start=1):
            word, marks = self.judge(secret, completion)
            if word is None:
                continue
            valid += 1
            if marks == SOLVED:
                return 0.7 + 0.3 * (n - k) / (n - 1) if n > 1 else 1.0
            best = max(best, (marks.count("G") + 0.5 * marks.count("Y")) / WORD_LENGTH)
        return 0.2 * best + 0.1 * valid / len(turns) if turns else 0.0

    def reference(self, task: Task) -> List[Message]:
        """A scripted solver's episode: the turns and replies that follow `messages(task)`, ending with the guess
        that solves it."""
        secret = task.data["secret"]
        state = self.start(task)
        out: List[Message] = []
        for guess in solve(secret, self.answers, self.max_guesses, self._solver_cache):
            turn = f"<guess>{guess}</guess>"
            out.append({"role": "assistant", "content": turn})
            reply = self.respond(task, state, turn)
            if reply.done:
                break
            out.extend(reply.messages)
        return out


def solve(secret: str, answers: Sequence[str], max_guesses: int = 6,
          cache: Optional[Dict[tuple, str]] = None) -> List[str]:
    """The guesses of a scripted solver that sees the secret only through the marks: open with OPENER, then guess
    the word that splits the words still possible into the smallest worst-case group: one of those words while
    more than 20 or at most 3 remain, any answer word in between (preferring a possible word on ties). It solves
    every word of the 2,315-word list within 6 guesses (3.5 on average). `cache` (history -> next guess) makes
    repeated calls cheap: the solver is deterministic given the marks so far."""
    cache = {} if cache is None else cache
    candidates = list(answers)
    guesses, history = [OPENER], ()
    while True:
        marks = feedback(secret, guesses[-1])
        if marks == SOLVED or len(guesses) >= max_guesses:
            return guesses
        history += ((guesses[-1], marks),)
        candidates = [w for w in candidates if feedback(w, guesses[-1]) == marks]
        if history not in cache:
            cache[history] = _pick(candidates, answers)
        guesses.append(cache[history])


def _pick(candidates: List[str], answers: Sequence[str]) -> str:
    if len(candidates) <= 2:
        return candidates[0]
    possible = set(candidates)
    best, best_key = candidates[0], None
    for g in answers if 3 < len(candidates) <= 20 else candidates:
        groups = Counter(feedback(s, g) for s in candidates)
        key = (max(groups.values()), -len(groups), g not in possible)
        if best_key is None or key < best_key:
            best, best_key = g, key
    return best
