"""Write a Python function from its specification; hidden unit tests in the sandbox decide the reward.

Tasks are generated in code: 26 families of small functions (digit sums, Caesar shifts, run-length codes, bracket
depth, ...), each instantiated with random parameters (a base, a separator, a shift, a tie rule) that change what the
function must do. A task shows the specification, the signature and `examples` calls with their results, and asks for
the function in a ```python block; `tests` hidden calls (edge cases first) check the answer.

Reward: the fraction of hidden tests whose result equals the reference implementation's; 0 without a code block, when
the code does not compile or define the function, or when the run times out. All tests of one answer run in one
sandboxed program (rlhpc.env.sandbox).

Why the answer cannot forge its result: the expected values never enter the sandbox. The test program receives the
inputs only, calls the candidate on each and reports what it returned, as JSON; this process compares. A forged
report therefore has to contain the right values, which is solving the task. The report is the line that starts with
a random nonce, written to a copy of stdout taken before the candidate runs (its own prints go to stderr), so prints
and an early exit leave no report (reward 0) rather than a wrong one.

`env.args.tools=true` makes it a tool-using episode: the policy may call `run_python(code)` and
`run_tests_on_examples(code)` before its final answer (a turn without a tool call), which the hidden tests score.
"""

from __future__ import annotations

import json
import math
import random
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from rlhpc.env.base import Message, Reply, Task
from rlhpc.env.sandbox import Result
from rlhpc.env.sandboxed import SandboxedEnvironment
from rlhpc.env.tools import Tool, ToolCallError, ToolEnvironment, parser

Args = Tuple[Any, ...]


@dataclass
class Instance:
    """One family member: its parameters, its specification and reference source, and how to draw test inputs."""

    params: Dict[str, Any]
    spec: str
    source: str  # the reference implementation, starting with its `def` line
    draw: Callable[[random.Random], Args]
    edge: Tuple[Args, ...] = ()  # inputs every task of the family is tested on first


FAMILIES: Dict[str, Callable[[random.Random], Instance]] = {}


def family(fn: Callable[[random.Random], Instance]) -> Callable[[random.Random], Instance]:
    FAMILIES[fn.__name__] = fn
    return fn


def _ints(r: random.Random, lo: int, hi: int, max_len: int = 10, min_len: int = 0) -> List[int]:
    return [r.randint(lo, hi) for _ in range(r.randint(min_len, max_len))]


def _text(r: random.Random, alphabet: str, max_len: int = 12, min_len: int = 0) -> str:
    return "".join(r.choice(alphabet) for _ in range(r.randint(min_len, max_len)))


_WORDS = "apple river stone cloud tiger maple honey piano lemon orbit candle mirror violet anchor ember".split()


@family
def digit_power_sum(rng: random.Random) -> Instance:
    base, power = rng.randint(2, 16), rng.randint(1, 3)
    return Instance(
        {"base": base, "power": power},
        f"Write the non-negative integer n in base {base} and return the sum of its digits, each raised to the "
        f"power {power}.",
        f"def digit_power_sum(n: int) -> int:\n"
        f"    total = 0\n"
        f"    while n > 0:\n"
        f"        n, digit = divmod(n, {base})\n"
        f"        total += digit ** {power}\n"
        f"    return total\n",
        lambda r: (r.randint(0, 10 ** r.randint(1, 7)),), edge=((0,),))


_SEPARATORS = [" ", ",", ";", "-", "_", "|", "/", "."]


@family
def reverse_pieces(rng: random.Random) -> Instance:
    sep, join = rng.choice(_SEPARATORS), rng.choice(_SEPARATORS + [""])
    return Instance(
        {"sep": sep, "join": join},
        f"Split s on every {sep!r}, reverse the order of the pieces (empty pieces included) and join them with "
        f"{join!r}.",
        f"def reverse_pieces(s: str) -> str:\n"
        f"    return {join!r}.join(reversed(s.split({sep!r})))\n",
        lambda r: (sep.join(r.choice(_WORDS + [""]) for _ in range(r.randint(1, 5))),), edge=(("",),))


@family
def count_chars(rng: random.Random) -> Instance:
    chars = "".join(sorted(rng.sample("abcdefghijklmnopqrstuvwxyz", rng.randint(3, 6))))
    fold = rng.random() < 0.5
    return Instance(
        {"chars": chars, "ignore_case": fold},
        f"Return how many characters of s are one of the letters {chars!r}"
        + (", ignoring case (an upper-case letter counts like its lower-case one)." if fold else
           " (case matters: upper-case letters do not count)."),
        f"def count_chars(s: str) -> int:\n"
        f"    return sum(1 for c in s{'.lower()' if fold else ''} if c in {chars!r})\n",
        lambda r: (_text(r, chars + chars.upper() + "xyzXYZ .!", 16),), edge=(("",),))


_SOUNDS = ["Fizz", "Buzz", "Bang", "Pop", "Zap", "Boom", "Whiz"]


@family
def fizzbuzz(rng: random.Random) -> Instance:
    a, b = sorted(rng.sample(range(2, 8), 2))
    wa, wb = rng.sample(_SOUNDS, 2)
    return Instance(
        {"a": a, "b": b, "word_a": wa, "word_b": wb},
        f"Return a list of strings for the numbers 1 to n: a multiple of both {a} and {b} becomes {wa + wb!r}, "
        f"another multiple of {a} becomes {wa!r}, another multiple of {b} becomes {wb!r}, and any other number its "
        f"decimal digits.",
        f"def fizzbuzz(n: int) -> list:\n"
        f"    out = []\n"
        f"    for i in range(1, n + 1):\n"
        f"        word = ({wa!r} if i % {a} == 0 else '') + ({wb!r} if i % {b} == 0 else '')\n"
        f"        out.append(word or str(i))\n"
        f"    return out\n",
        lambda r: (r.randint(1, 40),), edge=((0,),))


@family
def is_palindrome(rng: random.Random) -> Instance:
    removed = "".join(rng.sample(" ,.!?-'", rng.randint(1, 4)))
    fold = rng.random() < 0.5

    def draw(r: random.Random) -> Args:
        half = _text(r, "abcAB" + removed, 6)
        s = half + r.choice(["", "x", "a"]) + half[::-1] if r.random() < 0.6 else _text(r, "abcAB" + removed, 12)
        return ("".join(c.swapcase() if fold and r.random() < 0.3 else c for c in s),)

    return Instance(
        {"removed": removed, "ignore_case": fold},
        f"Return True if s reads the same forwards and backwards once every character in {removed!r} is removed"
        + (" and upper case is ignored" if fold else " (case matters)") + "; otherwise False.",
        f"def is_palindrome(s: str) -> bool:\n"
        f"    kept = [c for c in s{'.lower()' if fold else ''} if c not in {removed!r}]\n"
        f"    return kept == kept[::-1]\n",
        draw, edge=(("",), (removed,)))


@family
def running(rng: random.Random) -> Instance:
    op, init = rng.choice(["max", "min", "sum"]), rng.randint(-5, 5)
    step = "acc + x" if op == "sum" else f"{op}(acc, x)"
    return Instance(
        {"op": op, "init": init},
        f"Return a list as long as xs whose i-th element is the {op} of {init} and xs[0], ..., xs[i].",
        f"def running(xs: list) -> list:\n"
        f"    acc, out = {init}, []\n"
        f"    for x in xs:\n"
        f"        acc = {step}\n"
        f"        out.append(acc)\n"
        f"    return out\n",
        lambda r: (_ints(r, -9, 9),), edge=(([],),))


@family
def gcd_of_multiples(rng: random.Random) -> Instance:
    k, negate = rng.randint(2, 12), rng.random() < 0.5
    which = "not multiples" if negate else "multiples"
    return Instance(
        {"k": k, "not": negate},
        f"xs holds positive integers. Return the greatest common divisor of those that are {which} of {k}, or 0 if "
        f"there are none.",
        f"import math\n\n\n"
        f"def gcd_of_multiples(xs: list) -> int:\n"
        f"    g = 0\n"
        f"    for x in xs:\n"
        f"        if x % {k} {'!=' if negate else '=='} 0:\n"
        f"            g = math.gcd(g, x)\n"
        f"    return g\n",
        lambda r: ([r.randint(1, 12) * r.choice([1, k, 2 * k, 3]) for _ in range(r.randint(1, 6))],), edge=(([],),))


@family
def caesar(rng: random.Random) -> Instance:
    shift, back = rng.randint(1, 25), rng.random() < 0.5
    k = -shift if back else shift
    return Instance(
        {"shift": shift, "backward": back},
        f"Shift every ASCII letter of s {shift} places {'backward' if back else 'forward'} in the alphabet, "
        f"wrapping around and keeping its case; leave every other character unchanged.",
        f"def caesar(s: str) -> str:\n"
        f"    out = []\n"
        f"    for c in s:\n"
        f"        if 'a' <= c <= 'z':\n"
        f"            c = chr((ord(c) - 97 + ({k})) % 26 + 97)\n"
        f"        elif 'A' <= c <= 'Z':\n"
        f"            c = chr((ord(c) - 65 + ({k})) % 26 + 65)\n"
        f"        out.append(c)\n"
        f"    return ''.join(out)\n",
        lambda r: (_text(r, "abcxyzABCXYZ mq!7", 14),), edge=(("",),))


@family
def run_length(rng: random.Random) -> Instance:
    count_first, sep, omit_one = rng.random() < 0.5, rng.choice(["", ",", " ", ";", "|"]), rng.random() < 0.5
    run = "f'{n}{c}'" if count_first else "f'{c}{n}'"
    return Instance(
        {"count_first": count_first, "sep": sep, "omit_one": omit_one},
        f"Encode s as its runs of equal consecutive characters: a run of n copies of c becomes "
        f"{'the count n then c' if count_first else 'c then the count n'} (n in decimal)"
        + (", except that a run of length 1 is just c" if omit_one else "")
        + f"; the encoded runs are joined with {sep!r}. The empty string encodes to ''.",
        f"def run_length(s: str) -> str:\n"
        f"    runs = []\n"
        f"    for c in s:\n"
        f"        if runs and runs[-1][0] == c:\n"
        f"            runs[-1][1] += 1\n"
        f"        else:\n"
        f"            runs.append([c, 1])\n"
        f"    return {sep!r}.join("
        + (f"c if n == 1 else {run}" if omit_one else run) + " for c, n in runs)\n",
        lambda r: ("".join(r.choice("aabx") * r.randint(1, 4) for _ in range(r.randint(1, 5))),), edge=(("",),))


@family
def count_divisible(rng: random.Random) -> Instance:
    k, m = rng.sample(range(2, 10), 2)
    return Instance(
        {"k": k, "m": m},
        f"Return how many elements of xs are divisible by {k} but not by {m}.",
        f"def count_divisible(xs: list) -> int:\n"
        f"    return sum(1 for x in xs if x % {k} == 0 and x % {m} != 0)\n",
        lambda r: (_ints(r, -60, 60, 12),), edge=(([],),))


@family
def kth_distinct(rng: random.Random) -> Instance:
    k, largest, default = rng.randint(1, 4), rng.random() < 0.5, rng.randint(-10, -1)
    return Instance(
        {"k": k, "largest": largest, "default": default},
        f"Return the {k}-th {'largest' if largest else 'smallest'} distinct value of xs (counting from 1), or "
        f"{default} if xs has fewer than {k} distinct values.",
        f"def kth_distinct(xs: list) -> int:\n"
        f"    values = sorted(set(xs){', reverse=True' if largest else ''})\n"
        f"    return values[{k - 1}] if len(values) >= {k} else {default}\n",
        lambda r: (_ints(r, 0, 9, 8),), edge=(([],),))


@family
def clamp_all(rng: random.Random) -> Instance:
    lo, hi = rng.randint(-10, 0), rng.randint(1, 10)
    return Instance(
        {"lo": lo, "hi": hi},
        f"Return a list of the elements of xs, each clamped into the range [{lo}, {hi}] (a smaller element becomes "
        f"{lo}, a larger one {hi}).",
        f"def clamp_all(xs: list) -> list:\n"
        f"    return [min(max(x, {lo}), {hi}) for x in xs]\n",
        lambda r: (_ints(r, -15, 15),), edge=(([],),))


@family
def words_by_length(rng: random.Random) -> Instance:
    lo = rng.randint(1, 4)
    hi = rng.randint(lo, lo + 5)
    return Instance(
        {"lo": lo, "hi": hi},
        f"Split s on whitespace and return, in order, the words whose length is between {lo} and {hi} inclusive.",
        f"def words_by_length(s: str) -> list:\n"
        f"    return [w for w in s.split() if {lo} <= len(w) <= {hi}]\n",
        lambda r: (" ".join(r.choice(_WORDS + ["a", "to", "sun", "day"])[: r.randint(1, 8)]
                            for _ in range(r.randint(0, 7))),), edge=(("",),))


@family
def collatz_steps(rng: random.Random) -> Instance:
    t = rng.randint(2, 30)
    return Instance(
        {"t": t},
        f"n is a positive integer. Repeatedly replace n by n // 2 if it is even and by 3 * n + 1 if it is odd; "
        f"return how many replacements it takes until n < {t} (0 if it already is).",
        f"def collatz_steps(n: int) -> int:\n"
        f"    steps = 0\n"
        f"    while n >= {t}:\n"
        f"        n = n // 2 if n % 2 == 0 else 3 * n + 1\n"
        f"        steps += 1\n"
        f"    return steps\n",
        lambda r: (r.randint(1, 500),), edge=((1,),))


@family
def replace_chars(rng: random.Random) -> Instance:
    chars = "".join(sorted(rng.sample("aeioulnrst", rng.randint(2, 5))))
    mark = rng.choice("*#_-+.")
    return Instance(
        {"chars": chars, "mark": mark},
        f"Return s with every character that is one of {chars!r} (case matters) replaced by {mark!r}.",
        f"def replace_chars(s: str) -> str:\n"
        f"    return ''.join({mark!r} if c in {chars!r} else c for c in s)\n",
        lambda r: (_text(r, "aeioulnrstxyzAEIOU ", 14),), edge=(("",),))


_PAIRS = ["()", "[]", "{}", "<>"]


@family
def brackets(rng: random.Random) -> Instance:
    pairs = sorted(rng.sample(_PAIRS, rng.randint(1, 4)), key=_PAIRS.index)
    depth = rng.random() < 0.5
    opening, closing = "".join(p[0] for p in pairs), "".join(p[1] for p in pairs)

    def balanced(r: random.Random, n: int) -> str:
        if n == 0:
            return r.choice(["", "x", "ab"])
        p = r.choice(pairs)
        return p[0] + balanced(r, r.randint(0, n - 1)) + p[1] + balanced(r, r.randint(0, n - 1))

    def draw(r: random.Random) -> Args:
        s = balanced(r, r.randint(1, 4))
        if not depth and r.random() < 0.5:  # an unbalanced variant: one bracket dropped, added or swapped
            i = r.randrange(len(s) + 1)
            s = s[:i] + r.choice(opening + closing) + s[i + 1:]
        return (s,)

    names = " ".join(pairs)
    if depth:
        spec = (f"s contains balanced, properly nested brackets of the kinds {names} and other characters. Return "
                f"the maximum nesting depth (0 without brackets).")
        source = (f"def brackets(s: str) -> int:\n"
                  f"    depth = best = 0\n"
                  f"    for c in s:\n"
                  f"        if c in {opening!r}:\n"
                  f"            depth += 1\n"
                  f"            best = max(best, depth)\n"
                  f"        elif c in {closing!r}:\n"
                  f"            depth -= 1\n"
                  f"    return best\n")
    else:
        spec = (f"Return True if the brackets of the kinds {names} in s are balanced and properly nested, else False. "
                f"Other characters (including other brackets) are ignored.")
        source = (f"def brackets(s: str) -> bool:\n"
                  f"    stack = []\n"
                  f"    for c in s:\n"
                  f"        if c in {opening!r}:\n"
                  f"            stack.append({closing!r}[{opening!r}.index(c)])\n"
                  f"        elif c in {closing!r}:\n"
                  f"            if not stack or stack.pop() != c:\n"
                  f"                return False\n"
                  f"    return not stack\n")
    return Instance({"pairs": names, "depth": depth}, spec, source, draw, edge=(("",),))


@family
def count_pairs(rng: random.Random) -> Instance:
    k = rng.randint(2, 7)
    rem = rng.randint(0, k - 1)
    return Instance(
        {"k": k, "r": rem},
        f"Return the number of index pairs i < j with (xs[i] + xs[j]) % {k} == {rem}.",
        f"def count_pairs(xs: list) -> int:\n"
        f"    return sum(1 for i in range(len(xs)) for j in range(i + 1, len(xs)) if (xs[i] + xs[j]) % {k} == {rem})\n",
        lambda r: (_ints(r, 0, 20, 9),), edge=(([],),))


@family
def rotate(rng: random.Random) -> Instance:
    k, left = rng.randint(1, 9), rng.random() < 0.5
    cut = f"{k} % len(xs)" if left else f"-({k} % len(xs))"
    return Instance(
        {"k": k, "left": left},
        f"Return xs rotated {k} positions to the {'left' if left else 'right'} (a rotation by len(xs) gives xs "
        f"back; the empty list stays empty). Do not modify xs.",
        f"def rotate(xs: list) -> list:\n"
        f"    if not xs:\n"
        f"        return []\n"
        f"    k = {cut}\n"
        f"    return xs[k:] + xs[:k]\n",
        lambda r: (_ints(r, 0, 9, 8),), edge=(([],),))


@family
def chunk_reduce(rng: random.Random) -> Instance:
    size, op = rng.randint(2, 6), rng.choice(["sum", "max", "min"])
    return Instance(
        {"size": size, "op": op},
        f"Split xs into consecutive chunks of {size} elements (the last chunk may be shorter) and return the list "
        f"of each chunk's {op}.",
        f"def chunk_reduce(xs: list) -> list:\n"
        f"    return [{op}(xs[i:i + {size}]) for i in range(0, len(xs), {size})]\n",
        lambda r: (_ints(r, -20, 20, 14),), edge=(([],),))


@family
def case_words(rng: random.Random) -> Instance:
    n, mode = rng.randint(1, 8), rng.choice(["upper", "capitalize", "swapcase"])
    what = {"upper": "upper case", "capitalize": "its first letter upper case and the rest lower case",
            "swapcase": "every letter's case swapped"}[mode]
    return Instance(
        {"n": n, "mode": mode},
        f"Split s on single spaces; every piece of length at least {n} is changed to {what}, other pieces stay as "
        f"they are; join the pieces back with single spaces.",
        f"def case_words(s: str) -> str:\n"
        f"    return ' '.join(w.{mode}() if len(w) >= {n} else w for w in s.split(' '))\n",
        lambda r: (" ".join(r.choice(_WORDS + ["Ab", "CAT", "x", ""])[: r.randint(0, 9)]
                            for _ in range(r.randint(1, 6))),), edge=(("",),))


@family
def primes_mod(rng: random.Random) -> Instance:
    m = rng.randint(2, 8)
    rem = rng.randint(0, m - 1)
    return Instance(
        {"m": m, "r": rem},
        f"Return the ascending list of the primes p <= n with p % {m} == {rem}.",
        f"def primes_mod(n: int) -> list:\n"
        f"    out = []\n"
        f"    for p in range(2, n + 1):\n"
        f"        if all(p % d for d in range(2, int(p ** 0.5) + 1)) and p % {m} == {rem}:\n"
        f"            out.append(p)\n"
        f"    return out\n",
        lambda r: (r.randint(0, 120),), edge=((1,),))


@family
def longest_step_run(rng: random.Random) -> Instance:
    d = rng.randint(-5, 5)

    def draw(r: random.Random) -> Args:
        xs: List[int] = []
        while len(xs) < r.randint(0, 12):
            start = r.randint(-9, 9)
            xs += [start + d * i for i in range(r.randint(1, 4))]
        return (xs,)

    return Instance(
        {"d": d},
        f"Return the length of the longest stretch of consecutive elements of xs in which each element equals the "
        f"previous one plus {d} (a single element is a stretch of length 1; 0 for an empty list).",
        f"def longest_step_run(xs: list) -> int:\n"
        f"    best = run = 0\n"
        f"    for i, x in enumerate(xs):\n"
        f"        run = run + 1 if i and x == xs[i - 1] + ({d}) else 1\n"
        f"        best = max(best, run)\n"
        f"    return best\n",
        draw, edge=(([],),))


@family
def most_common(rng: random.Random) -> Instance:
    tie, ignore = rng.choice(["smallest", "largest", "first"]), rng.randint(-3, 3)
    rule = {"smallest": "the smallest of them", "largest": "the largest of them",
            "first": "the one that appears first in xs"}[tie]
    key = {"smallest": "(counts[v], -v)", "largest": "(counts[v], v)", "first": "(counts[v], -xs.index(v))"}[tie]
    return Instance(
        {"tie": tie, "ignore": ignore},
        f"Return the most frequent value of xs, not counting the value {ignore}; on a tie, {rule}. Return None if "
        f"there is no other value.",
        f"def most_common(xs: list):\n"
        f"    counts = {{}}\n"
        f"    for x in xs:\n"
        f"        if x != {ignore}:\n"
        f"            counts[x] = counts.get(x, 0) + 1\n"
        f"    if not counts:\n"
        f"        return None\n"
        f"    return max(counts, key=lambda v: {key})\n",
        lambda r: (_ints(r, -3, 4, 9),), edge=(([],), ([ignore],)))


@family
def interleave(rng: random.Random) -> Instance:
    p, q = rng.randint(1, 4), rng.randint(1, 4)
    return Instance(
        {"p": p, "q": q},
        f"Build a string by repeatedly taking the next {p} characters of a, then the next {q} characters of b, "
        f"until both are used up (once one is used up, the rest of the other follows).",
        f"def interleave(a: str, b: str) -> str:\n"
        f"    out, i, j = [], 0, 0\n"
        f"    while i < len(a) or j < len(b):\n"
        f"        out.append(a[i:i + {p}])\n"
        f"        out.append(b[j:j + {q}])\n"
        f"        i, j = i + {p}, j + {q}\n"
        f"    return ''.join(out)\n",
        lambda r: (_text(r, "abcdef", 9), _text(r, "XYZ", 9)), edge=(("", ""),))


@family
def diagonal_sum(rng: random.Random) -> Instance:
    k, anti = rng.randint(-3, 3), rng.random() < 0.5
    where = f"i + j == len(grid) - 1 + ({k})" if anti else f"j - i == {k}"
    return Instance(
        {"k": k, "anti": anti},
        f"grid is a square list of lists of integers. Return the sum of grid[i][j] over all positions with {where} "
        f"(0 if there are none).",
        f"def diagonal_sum(grid: list) -> int:\n"
        f"    n = len(grid)\n"
        f"    return sum(grid[i][j] for i in range(n) for j in range(n) if {where.replace('len(grid)', 'n')})\n",
        lambda r: ([[r.randint(-9, 9) for _ in range(n)] for n in [r.randint(1, 5)] for _ in range(n)],),
        edge=(([],),))


@family
def count_occurrences(rng: random.Random) -> Instance:
    pattern, overlap = _text(rng, "ab", 3, 2), rng.random() < 0.5
    step = "1" if overlap else "len(pattern)"
    return Instance(
        {"pattern": pattern, "overlapping": overlap},
        f"Return how many times {pattern!r} occurs in s, counting "
        + ("overlapping occurrences (in 'aaa', 'aa' occurs twice)." if overlap else
           "non-overlapping occurrences from left to right (in 'aaa', 'aa' occurs once)."),
        f"def count_occurrences(s: str) -> int:\n"
        f"    pattern, count, i = {pattern!r}, 0, 0\n"
        f"    while True:\n"
        f"        i = s.find(pattern, i)\n"
        f"        if i < 0:\n"
        f"            return count\n"
        f"        count += 1\n"
        f"        i += {step}\n",
        lambda r: (_text(r, "aab", 14),), edge=(("",),))


# The test program. Its first lines take the workdir off sys.path (so no file there can stand in for json or os),
# read the whole payload from stdin (the candidate finds stdin empty) and keep a private copy of stdout for the report.
RUNNER = r'''
import sys
del sys.path[0]
import json, os

payload = json.loads(sys.stdin.read())
report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]


results, load_error = [], None
try:
    namespace = {"__name__": "solution"}
    exec(compile(payload["code"], "solution.py", "exec"), namespace)
    fn = namespace.get(payload["func"])
    if not callable(fn):
        load_error = "the code defines no function " + payload["func"]
except BaseException as e:
    load_error = describe(e)
if load_error is None:
    for args in payload["inputs"]:
        try:
            results.append('{"value": ' + json.dumps(fn(*json.loads(args))) + "}")
        except BaseException as e:
            results.append(json.dumps({"error": describe(e)}))
report.write(payload["nonce"] + json.dumps({"load_error": load_error}) + "\n" + "\n".join(results) + "\n")
report.close()
'''

_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_code(text: str, func: str) -> Optional[str]:
    """The answer's code: the last ```python (or untagged) block that defines `func`, else the last such block."""
    blocks = [body for lang, body in _CODE_BLOCK.findall(text) if lang.lower() in ("", "python", "python3", "py")]
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(func)}\s*\(", b, re.M)]
    return (defining or blocks or [None])[-1]


def same(got: Any, want: Any) -> bool:
    """Equal as JSON values; numbers compare by value (floats with a tolerance), but True is not 1."""
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


def _call(func: str, args: List[Any]) -> str:
    return f"{func}({', '.join(map(repr, args))})"


class Code(SandboxedEnvironment, ToolEnvironment):
    name = "code"

    def __init__(self, tools: bool = False, max_turns: int = 4, eval_size: int = 64, eval_seed: int = 12345,
                 examples: int = 2, tests: int = 8, families: Optional[List[str]] = None, output_chars: int = 2000):
        for key, value, least in [("max_turns", max_turns, 1), ("eval_size", eval_size, 1), ("examples", examples, 0),
                                  ("tests", tests, 1), ("output_chars", output_chars, 100)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"env.args.{key}: expected an integer >= {least}, got {value!r}")
        if not isinstance(tools, bool):
            raise ValueError(f"env.args.tools: expected true or false, got {tools!r}")
        unknown = sorted(set(families or []) - set(FAMILIES))
        if unknown:
            raise ValueError(f"env.args.families: unknown {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
        self.use_tools, self.examples, self.tests, self.output_chars = tools, examples, tests, output_chars
        self.max_turns = max_turns if tools else 1
        self.families = list(families or FAMILIES)
        # The eval set: the first `eval_size` distinct instances (family and parameters) drawn from `eval_seed`;
        # training never draws those instances.
        rng = random.Random(eval_seed)
        self._eval: List[Task] = []
        self._held_out: set = set()
        for _ in range(100 * eval_size):
            if len(self._eval) == eval_size:
                break
            task = self._task(rng, f"eval-{len(self._eval)}")
            if task is not None and task.data["key"] not in self._held_out:
                self._held_out.add(task.data["key"])
                self._eval.append(task)
        if len(self._eval) < eval_size:
            raise ValueError(f"env.args.eval_size: {eval_size} is more distinct tasks than the families give")

    def _run(self, code: Optional[str] = None, runner_input: Optional[str] = None) -> Result:
        """Runs `code` (a program) in a fresh sandbox folder, or the test program with `runner_input` on stdin."""
        workdir = tempfile.mkdtemp(prefix="rlhpc-code-")
        try:
            return self.sandbox(workdir).run_python(RUNNER if code is None else code, stdin=runner_input)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def run_candidate(self, code: str, func: str, inputs: List[List[Any]]) -> Tuple[Optional[str], List[Dict]]:
        """(load error, one {"value": ...} or {"error": ...} per input) of `code`'s `func`; ("...", []) when the
        program timed out or left no report."""
        nonce = secrets.token_hex(16)
        payload = {"nonce": nonce, "code": code, "func": func, "inputs": [json.dumps(a) for a in inputs]}
        r = self._run(runner_input=json.dumps(payload))
        if r.timed_out:
            return f"timed out after {r.wall_s:.0f}s", []
        lines = r.stdout.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith(nonce)]
        if not starts:
            tail = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
            return f"the program ended without a result ({tail[:300]})", []
        head = starts[-1]
        try:
            load_error = json.loads(lines[head][len(nonce):])["load_error"]
            if load_error is not None:
                return load_error, []
            results = [json.loads(line) for line in lines[head + 1: head + 1 + len(inputs)]]
        except (json.JSONDecodeError, KeyError, TypeError):
            return "the result could not be read", []
        if len(results) != len(inputs) or not all(isinstance(x, dict) for x in results):
            return "the result is incomplete", []
        return None, results

    # --- tasks ---

    def _task(self, rng: random.Random, task_id: str) -> Optional[Task]:
        name = rng.choice(self.families)
        inst = FAMILIES[name](rng)
        key = json.dumps([name, inst.params], sort_keys=True)
        seen, inputs = set(), []
        want = self.examples + self.tests
        candidates = [list(a) for a in inst.edge]
        for _ in range(50 * want):
            if len(inputs) == want:
                break
            args = candidates.pop(0) if candidates else list(inst.draw(rng))
            text = json.dumps(args)
            if text not in seen:
                seen.add(text)
                inputs.append(args)
        if len(inputs) < want:
            return None
        namespace: Dict[str, Any] = {}
        exec(compile(inst.source, f"<reference {name}>", "exec"), namespace)  # our own code, not the model's
        outputs = [json.loads(json.dumps(namespace[name](*json.loads(json.dumps(a))))) for a in inputs]
        cases = [{"args": a, "expected": o} for a, o in zip(inputs, outputs)]
        # Edge cases are hidden tests; the examples are the first random inputs.
        n_edge = min(len(inst.edge), self.tests)
        examples = cases[n_edge:n_edge + self.examples]
        tests = cases[:n_edge] + cases[n_edge + self.examples:]
        return Task(task_id, {"key": key, "family": name, "params": inst.params, "func": name, "spec": inst.spec,
                              "signature": next(line for line in inst.source.splitlines() if line.startswith("def ")),
                              "reference": inst.source, "examples": examples, "tests": tests})

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split == "eval":
            yield from self._eval
            return
        rng = random.Random(seed)
        i = misses = 0
        while True:
            task = self._task(rng, f"{seed}-{i}")
            if task is None or task.data["key"] in self._held_out:  # held-out instances are never trained on
                misses += 1
                if misses > 10000:
                    raise ValueError("env.args.eval_size: the held-out set covers (nearly) every task of "
                                     f"{', '.join(self.families)}; lower eval_size or allow more families")
                continue
            misses = 0
            yield task
            i += 1

    def messages(self, task: Task) -> List[Message]:
        d = task.data
        lines = [f"Write a Python function `{d['func']}`.", "", d["spec"], "", "Signature:", f"    {d['signature']}"]
        if d["examples"]:
            lines += ["", "Examples:"] + [f"    {_call(d['func'], c['args'])} == {c['expected']!r}"
                                         for c in d["examples"]]
        if self.use_tools:
            lines += ["", "You may call the tools run_python (runs a program and shows its output) and "
                          "run_tests_on_examples (checks a function against the examples above). When you are done, "
                          "answer without a tool call, with the complete function in a ```python code block."]
        else:
            lines += ["", "Answer with the complete function in a ```python code block."]
        lines += ["Hidden tests will call it; use only the standard library."]
        return [{"role": "user", "content": "\n".join(lines)}]

    # --- reward ---

    def reward(self, task: Task, completion: str) -> float:
        code = extract_code(completion, task.data["func"])
        if code is None:
            return 0.0
        tests = task.data["tests"]
        load_error, results = self.run_candidate(code, task.data["func"], [t["args"] for t in tests])
        if load_error is not None:
            return 0.0
        passed = sum(1 for t, r in zip(tests, results) if "value" in r and same(r["value"], t["expected"]))
        return passed / len(tests)

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        final = completions[-1]
        if self.use_tools and self._calls_tools(final):  # the turns ran out before a final answer
            return 0.0
        return self.reward(task, final)

    def _calls_tools(self, text: str) -> bool:
        try:
            return bool(parser(getattr(self.config, "tool_parser", "hermes"))(text))
        except ToolCallError:
            return True

    def reference(self, task: Task) -> Union[str, List[Message]]:
        answer = f"```python\n{task.data['reference']}```"
        if not self.use_tools:
            return answer
        d = task.data
        program = d["reference"] + "\n" + "".join(f"print(repr({_call(d['func'], c['args'])}))\n"
                                                  for c in d["examples"])
        call = {"name": "run_python", "arguments": {"code": program}}
        first = f"Let me try it on the examples.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        reply = self.respond(task, self.start(task), first)
        return [{"role": "assistant", "content": first}, *reply.messages,
                {"role": "assistant", "content": f"It gives the expected results.\n\n{answer}"}]

    # --- tools ---

    def respond(self, task: Task, state: Dict[str, Any], completion: str) -> Reply:
        if not self.use_tools:
            return Reply(done=True)
        return super().respond(task, state, completion)

    def tools(self) -> List[Tool]:
        if not self.use_tools:
            return []
        code_arg = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                    "required": ["code"]}
        return [Tool("run_python", "Run a Python program (standard library only, no network) and return its exit "
                                   "code, stdout and stderr.", code_arg, self.run_python),
                Tool("run_tests_on_examples", "Check the function defined by `code` against the task's examples.",
                     code_arg, self.run_tests_on_examples)]

    def run_python(self, code: str) -> str:
        r = self._run(code=code)
        head = f"timed out after {r.wall_s:.0f}s" if r.timed_out else f"exit code {r.returncode}"
        # Tracebacks name the program by its random file name in the sandbox folder; the policy sees "main.py".
        clean = [re.sub(r"(/[^\s\"']*)?/main-[A-Za-z0-9_]+\.py", "main.py", s) for s in (r.stdout, r.stderr)]
        out = [head] + [f"{name}:\n{_clip(text, self.output_chars)}" for name, text in zip(("stdout", "stderr"), clean)
                        if text]
        return "\n".join(out)

    def run_tests_on_examples(self, code: str, state: Dict[str, Any]) -> str:
        task_data = state["task"]
        func, examples = task_data["func"], task_data["examples"]
        if not examples:
            return "this task has no examples"
        load_error, results = self.run_candidate(code, func, [c["args"] for c in examples])
        if load_error is not None:
            return f"could not run the examples: {load_error}"
        lines, passed = [], 0
        for i, (c, r) in enumerate(zip(examples, results), 1):
            call = _call(func, c["args"])
            if "error" in r:
                lines.append(f"example {i}: {call} raised {r['error']}")
            elif same(r["value"], c["expected"]):
                passed += 1
                lines.append(f"example {i}: {call} == {c['expected']!r}, as expected")
            else:
                lines.append(f"example {i}: {call} returned {r['value']!r}, expected {c['expected']!r}")
        lines.append(f"{passed} of {len(examples)} examples passed")
        return _clip("\n".join(lines), self.output_chars)

    def start(self, task: Task) -> Dict[str, Any]:
        # The examples' tool needs the task; the hidden tests stay out of the state (and out of every tool).
        return {"task": {"func": task.data["func"], "examples": task.data["examples"]}}
