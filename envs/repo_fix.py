"""Fix a planted bug in a small Python repository with file tools; hidden checks in the sandbox decide the reward.

Each task is one of 8 small packages generated in code (inventory, textstats, geometry, bank, grades, dates, matrix,
codec: 2-3 modules each, random constants and test values) with ONE planted bug (an off-by-one, a wrong operator or
constant, swapped arguments, a missing edge case), and tests/ with plain `test_*` functions, at least one of which
the bug makes fail (checked when the task is made). The policy works in its own copy of the repository with the tools
`list_files`, `read_file`, `edit_file` (exact search/replace), `run_tests` (the visible tests, in the sandbox) and ends
the episode by answering without a tool call.

Reward: 1 if every hidden check passes and no test file was changed (sha256 against the task's), else 0. The hidden
checks are the visible tests' calls plus as many more, each a call whose result is compared with the unbugged
package's. No partial credit: the buggy package already passes most checks, so a fraction would pay for doing nothing.

Why the result cannot be forged: the hidden checks never enter the work folder, and their expected values never enter
the sandbox. The check program (ours, written next to the package only for the run) receives the calls on stdin,
evaluates them against the package and reports each result as JSON on a copy of stdout taken before the package is
imported, after a random nonce; this process compares. Code that prints a fake report, or finds the nonce, still has
to report the right values, which is fixing the bug.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from string import Template
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from rlhpc.env.base import Message, Task
from rlhpc.env.sandbox import Result
from rlhpc.env.sandboxed import SandboxedEnvironment
from rlhpc.env.tools import Tool, ToolCallError, ToolEnvironment


@dataclass
class Check:
    module: str  # the module under test (its visible tests go to tests/test_<module>.py)
    test: str  # the test's name, without "test_"
    expr: str  # a call, evaluated after `from <package> import <module>`
    visible: bool = True


@dataclass
class Bug:
    id: str
    path: str
    good: str  # a snippet of the correct file...
    bad: str  # ...and what the bug turns it into (unique in the buggy file: the reference fix searches for it)


@dataclass
class Repo:
    package: str
    about: str
    files: Dict[str, str]  # the correct package, path -> source
    checks: List[Check]
    bugs: List[Bug]


REPOS: Dict[str, Callable[[random.Random], Repo]] = {}


def repo(fn: Callable[[random.Random], Repo]) -> Callable[[random.Random], Repo]:
    REPOS[fn.__name__] = fn
    return fn


def _src(text: str, **values: Any) -> str:
    return Template(text.lstrip("\n")).substitute(values)


# --- the repositories -------------------------------------------------------------------------------------------

_ITEMS = ["bolts", "nuts", "screws", "washers", "hinges", "nails", "rivets", "clamps"]


@repo
def inventory(rng: random.Random) -> Repo:
    low, bulk, discount = rng.randint(2, 6), rng.randint(5, 12), rng.choice([5, 10, 15, 20, 25])
    files = {
        "inventory/__init__.py": '"""Stock keeping for a small hardware shop."""\n',
        "inventory/stock.py": _src('''
"""Quantities on hand, keyed by item name."""

LOW_STOCK = $low


def add(stock, item, quantity):
    """A copy of `stock` with `quantity` more units of `item`."""
    new = dict(stock)
    new[item] = new.get(item, 0) + quantity
    return new


def remove(stock, item, quantity):
    """A copy of `stock` with `quantity` fewer units of `item`, never below zero."""
    new = dict(stock)
    new[item] = max(0, new.get(item, 0) - quantity)
    return new


def low(stock, threshold=LOW_STOCK):
    """The names of the items with at most `threshold` units, sorted."""
    return sorted(name for name, quantity in stock.items() if quantity <= threshold)
''', low=low),
        "inventory/pricing.py": _src('''
"""Order prices with a bulk discount, and the value of the stock (all amounts in cents)."""

BULK_QUANTITY = $bulk
BULK_DISCOUNT_PERCENT = $discount


def order_price(unit_price, quantity):
    """Price of `quantity` units at `unit_price` each: BULK_DISCOUNT_PERCENT percent off from BULK_QUANTITY units
    on, rounded down to a whole cent."""
    price = unit_price * quantity
    if quantity >= BULK_QUANTITY:
        price = price * (100 - BULK_DISCOUNT_PERCENT) // 100
    return price


def stock_value(stock, prices):
    """Value of `stock` at `prices` (per unit); items without a price are worth nothing."""
    return sum(quantity * prices.get(name, 0) for name, quantity in stock.items())
''', bulk=bulk, discount=discount),
    }
    names = rng.sample(_ITEMS, 5)
    stock = {names[0]: low, names[1]: rng.randint(0, low - 1), names[2]: rng.randint(low + 1, 40),
             names[3]: rng.randint(low + 1, 40)}
    prices = {n: rng.randint(5, 300) for n in names[:3]}  # names[3] has no price
    unit = rng.randint(10, 500)
    checks = [
        Check("stock", "low_includes_items_at_the_threshold", f"stock.low({stock!r})"),
        Check("stock", "remove_never_goes_below_zero",
              f"stock.remove({stock!r}, {names[1]!r}, {stock[names[1]] + rng.randint(1, 5)})"),
        Check("stock", "add_to_a_new_item", f"stock.add({stock!r}, {names[4]!r}, {rng.randint(1, 9)})"),
        Check("pricing", "bulk_discount_from_the_bulk_quantity", f"pricing.order_price({unit}, {bulk})"),
        Check("pricing", "small_orders_pay_full_price", f"pricing.order_price({unit}, {rng.randint(1, bulk - 1)})"),
        Check("pricing", "stock_value_skips_unpriced_items", f"pricing.stock_value({stock!r}, {prices!r})"),
        Check("stock", "low_with_threshold", f"stock.low({stock!r}, {rng.randint(0, 20)})", False),
        Check("stock", "remove_some", f"stock.remove({stock!r}, {names[2]!r}, {rng.randint(1, low)})", False),
        Check("stock", "remove_unknown_item", f"stock.remove({stock!r}, {names[4]!r}, 3)", False),
        Check("pricing", "large_order", f"pricing.order_price({rng.randint(10, 500)}, {bulk + rng.randint(1, 30)})",
              False),
        Check("pricing", "stock_value_all_priced",
              f"pricing.stock_value({ {n: stock[n] for n in names[:3]}!r}, {prices!r})", False),
    ]
    bugs = [
        Bug("remove_clamp", "inventory/stock.py", "max(0, new.get(item, 0) - quantity)", "new.get(item, 0) - quantity"),
        Bug("low_bound", "inventory/stock.py", "if quantity <= threshold)", "if quantity < threshold)"),
        Bug("bulk_bound", "inventory/pricing.py", "if quantity >= BULK_QUANTITY:", "if quantity > BULK_QUANTITY:"),
        Bug("discount_sign", "inventory/pricing.py", "(100 - BULK_DISCOUNT_PERCENT)", "(100 + BULK_DISCOUNT_PERCENT)"),
        Bug("unpriced", "inventory/pricing.py", "prices.get(name, 0)", "prices[name]"),
    ]
    return Repo("inventory", "Stock keeping for a small hardware shop.", files, checks, bugs)


_VOCAB = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "sun", "rose", "over", "hills"]


def _sentence(rng: random.Random, n: int) -> str:
    words = []
    for _ in range(n):
        w = rng.choice(_VOCAB)
        w = w.upper() if rng.random() < 0.2 else w.capitalize() if rng.random() < 0.3 else w
        words.append(w + (rng.choice([",", ".", "!", ""]) if rng.random() < 0.3 else ""))
    return " ".join(words)


@repo
def textstats(rng: random.Random) -> Repo:
    files = {
        "textstats/__init__.py": '"""Word statistics of short texts."""\n',
        "textstats/tokens.py": '''"""Splitting text into words."""

PUNCTUATION = ".,;:!?\\"'()"


def words(text):
    """The words of `text`: split on whitespace, punctuation stripped from both ends, lower-cased, empty ones
    dropped."""
    out = []
    for raw in text.split():
        word = raw.strip(PUNCTUATION).lower()
        if word:
            out.append(word)
    return out
''',
        "textstats/counts.py": '''"""Word frequencies."""

from textstats.tokens import words


def frequencies(text):
    """How often each word occurs."""
    counts = {}
    for word in words(text):
        counts[word] = counts.get(word, 0) + 1
    return counts


def top(text, k):
    """The `k` most frequent words as [word, count] pairs: most frequent first, ties in alphabetical order."""
    ranked = sorted(frequencies(text).items(), key=lambda pair: (-pair[1], pair[0]))
    return [[word, count] for word, count in ranked[:k]]
''',
        "textstats/summary.py": '''"""Summaries of a text."""

from textstats.tokens import words


def mean_word_length(text):
    """The average length of the words, rounded to 2 decimals; 0.0 for a text without words."""
    found = words(text)
    if not found:
        return 0.0
    return round(sum(len(w) for w in found) / len(found), 2)


def longest(text, n):
    """The `n` longest distinct words, longest first, ties in alphabetical order."""
    return sorted(set(words(text)), key=lambda w: (-len(w), w))[:n]
''',
    }
    shouty = "The " + _sentence(rng, 3) + " THE the, " + rng.choice(_VOCAB).upper() + "!"
    texts = [_sentence(rng, rng.randint(8, 16)) for _ in range(4)]
    checks = [
        Check("tokens", "words_are_lowercased_and_stripped", f"tokens.words({shouty!r})"),
        Check("counts", "frequencies_ignore_case", f"counts.frequencies({shouty!r})"),
        Check("counts", "top_words", f"counts.top({texts[0]!r}, {rng.randint(2, 4)})"),
        Check("summary", "mean_word_length_of_an_empty_text_is_zero", "summary.mean_word_length(' ,, ')"),
        Check("summary", "mean_word_length", f"summary.mean_word_length({texts[1]!r})"),
        Check("tokens", "words_more", f"tokens.words({texts[2]!r})", False),
        Check("counts", "top_more", f"counts.top({texts[2]!r}, {rng.randint(1, 5)})", False),
        Check("counts", "top_of_nothing", "counts.top('', 3)", False),
        Check("summary", "mean_word_length_more", f"summary.mean_word_length({texts[3]!r})", False),
        Check("summary", "longest", f"summary.longest({texts[3]!r}, {rng.randint(1, 4)})", False),
    ]
    bugs = [
        Bug("no_lower", "textstats/tokens.py", "raw.strip(PUNCTUATION).lower()", "raw.strip(PUNCTUATION)"),
        Bug("top_slice", "textstats/counts.py", "ranked[:k]]", "ranked[:k - 1]]"),
        Bug("top_order", "textstats/counts.py", "key=lambda pair: (-pair[1], pair[0])",
            "key=lambda pair: (pair[1], pair[0])"),
        Bug("empty_text", "textstats/summary.py", "    found = words(text)\n    if not found:\n        return 0.0\n",
            "    found = words(text)\n"),
    ]
    return Repo("textstats", "Word statistics of short texts.", files, checks, bugs)


def _point(rng: random.Random, lo: int = -9, hi: int = 9) -> List[int]:
    return [rng.randint(lo, hi), rng.randint(lo, hi)]


@repo
def geometry(rng: random.Random) -> Repo:
    files = {
        "geometry/__init__.py": '"""Plane geometry on integer points."""\n',
        "geometry/vectors.py": '''"""Points and vectors in the plane, as [x, y] lists."""


def add(a, b):
    """a + b."""
    return [a[0] + b[0], a[1] + b[1]]


def sub(a, b):
    """a - b."""
    return [a[0] - b[0], a[1] - b[1]]


def manhattan(a, b):
    """The Manhattan (taxicab) distance between points a and b."""
    dx, dy = sub(b, a)
    return abs(dx) + abs(dy)
''',
        "geometry/shapes.py": '''"""Axis-aligned rectangles, given by two opposite corners."""

from geometry.vectors import sub


def area(corner, opposite):
    width, height = sub(opposite, corner)
    return abs(width * height)


def perimeter(corner, opposite):
    width, height = sub(opposite, corner)
    return 2 * (abs(width) + abs(height))


def contains(corner, opposite, point):
    """True when `point` lies inside the rectangle or on its border."""
    low_x, high_x = sorted([corner[0], opposite[0]])
    low_y, high_y = sorted([corner[1], opposite[1]])
    return low_x <= point[0] <= high_x and low_y <= point[1] <= high_y
''',
        "geometry/paths.py": '''"""Paths: lists of points visited in order."""

from geometry.vectors import manhattan


def length(points):
    """The total Manhattan length of the path (0 for fewer than two points)."""
    return sum(manhattan(points[i], points[i + 1]) for i in range(len(points) - 1))


def farthest(points, origin):
    """The index of the point farthest from `origin` (Manhattan distance), the first one on a tie; None for no
    points."""
    best = None
    for i, point in enumerate(points):
        if best is None or manhattan(point, origin) > manhattan(points[best], origin):
            best = i
    return best
''',
    }
    a, b = _point(rng), _point(rng)
    while a[0] == b[0] or a[1] == b[1]:
        b = _point(rng)
    low_y, high_y = sorted([a[1], b[1]])
    border = [a[0], rng.randint(low_y, high_y)]
    path = [_point(rng) for _ in range(rng.randint(3, 6))]
    far = rng.randint(5, 9)
    tie = [_point(rng, -2, 2), [far, 0], _point(rng, -2, 2), [0, -far]]
    checks = [
        Check("vectors", "sub", f"vectors.sub({a!r}, {b!r})"),
        Check("shapes", "perimeter", f"shapes.perimeter({a!r}, {b!r})"),
        Check("shapes", "contains_points_on_the_border", f"shapes.contains({a!r}, {b!r}, {border!r})"),
        Check("paths", "length", f"paths.length({path!r})"),
        Check("paths", "farthest_takes_the_first_on_a_tie", f"paths.farthest({tie!r}, [0, 0])"),
        Check("vectors", "add", f"vectors.add({a!r}, {b!r})", False),
        Check("vectors", "manhattan", f"vectors.manhattan({b!r}, {a!r})", False),
        Check("shapes", "area", f"shapes.area({b!r}, {a!r})", False),
        Check("shapes", "contains_outside", f"shapes.contains({a!r}, {b!r}, {[max(a[0], b[0]) + 1, a[1]]!r})",
              False),
        Check("paths", "length_of_one_point", f"paths.length({path[:1]!r})", False),
        Check("paths", "farthest_of_nothing", "paths.farthest([], [0, 0])", False),
    ]
    bugs = [
        Bug("sub_index", "geometry/vectors.py", "[a[0] - b[0], a[1] - b[1]]", "[a[0] - b[0], a[1] - b[0]]"),
        Bug("perimeter_parens", "geometry/shapes.py", "2 * (abs(width) + abs(height))",
            "2 * abs(width) + abs(height)"),
        Bug("contains_border", "geometry/shapes.py", "low_x <= point[0] <= high_x", "low_x < point[0] < high_x"),
        Bug("length_range", "geometry/paths.py", "range(len(points) - 1)", "range(len(points) - 2)"),
        Bug("farthest_tie", "geometry/paths.py", "> manhattan(points[best], origin)",
            ">= manhattan(points[best], origin)"),
    ]
    return Repo("geometry", "Plane geometry on integer points.", files, checks, bugs)


@repo
def bank(rng: random.Random) -> Repo:
    limit, rate = rng.choice([100, 200, 500, 1000]), rng.randint(2, 9)
    files = {
        "bank/__init__.py": '"""Account balances, interest and ledgers (amounts in cents)."""\n',
        "bank/accounts.py": _src('''
"""Balances in cents; a withdrawal may overdraw the account down to -OVERDRAFT_LIMIT."""

OVERDRAFT_LIMIT = $limit


def deposit(balance, amount):
    """The balance after depositing `amount` (> 0)."""
    if amount <= 0:
        raise ValueError("a deposit must be positive")
    return balance + amount


def withdraw(balance, amount):
    """The balance after withdrawing `amount` (> 0); ValueError if it would go below -OVERDRAFT_LIMIT."""
    if amount <= 0:
        raise ValueError("a withdrawal must be positive")
    if balance - amount < -OVERDRAFT_LIMIT:
        raise ValueError("overdraft limit exceeded")
    return balance - amount
''', limit=limit),
        "bank/interest.py": _src('''
"""Yearly interest on positive balances."""

RATE_PERCENT = $rate


def yearly(balance):
    """One year's interest: RATE_PERCENT percent of a positive balance, rounded down; 0 otherwise."""
    if balance <= 0:
        return 0
    return balance * RATE_PERCENT // 100


def compound(balance, years):
    """The balance after `years` years, each adding that year's interest."""
    for _ in range(years):
        balance += yearly(balance)
    return balance
''', rate=rate),
        "bank/ledger.py": '''"""Transactions: ["deposit", amount] or ["withdraw", amount]."""

from bank.accounts import deposit, withdraw


def apply(balance, transactions):
    """The balance after every transaction, in order."""
    for kind, amount in transactions:
        if kind == "deposit":
            balance = deposit(balance, amount)
        else:
            balance = withdraw(balance, amount)
    return balance


def largest_withdrawal(transactions):
    """The largest amount withdrawn, or 0 without withdrawals."""
    return max((amount for kind, amount in transactions if kind == "withdraw"), default=0)
''',
    }
    start = rng.randint(2000, 5000)
    moves = [["deposit", rng.randint(100, 900)], ["withdraw", rng.randint(100, 900)],
             ["withdraw", rng.randint(100, 900)], ["deposit", rng.randint(100, 900)]]
    rng.shuffle(moves)
    deposits = [["deposit", rng.randint(10, 99)] for _ in range(rng.randint(1, 3))]
    checks = [
        Check("accounts", "withdraw_down_to_the_overdraft_limit", f"accounts.withdraw({start}, {start + limit})"),
        Check("accounts", "withdraw_past_the_limit_raises", f"accounts.withdraw({start}, {start + limit + 1})"),
        Check("interest", "yearly", f"interest.yearly({rng.randint(1000, 90000)})"),
        Check("interest", "compound", f"interest.compound({rng.randint(1000, 90000)}, {rng.randint(2, 5)})"),
        Check("ledger", "apply", f"ledger.apply({start}, {moves!r})"),
        Check("ledger", "largest_withdrawal_without_withdrawals", f"ledger.largest_withdrawal({deposits!r})"),
        Check("accounts", "deposit", f"accounts.deposit({start}, {rng.randint(1, 500)})", False),
        Check("accounts", "deposit_of_nothing_raises", f"accounts.deposit({start}, 0)", False),
        Check("interest", "no_interest_when_overdrawn", f"interest.yearly({-rng.randint(1, 500)})", False),
        Check("interest", "compound_zero_years", f"interest.compound({start}, 0)", False),
        Check("ledger", "largest_withdrawal", f"ledger.largest_withdrawal({moves!r})", False),
    ]
    bugs = [
        Bug("overdraft_bound", "bank/accounts.py", "if balance - amount < -OVERDRAFT_LIMIT:",
            "if balance - amount <= -OVERDRAFT_LIMIT:"),
        Bug("rate_constant", "bank/interest.py", "balance * RATE_PERCENT // 100", "balance * RATE_PERCENT // 10"),
        Bug("compound_years", "bank/interest.py", "for _ in range(years):", "for _ in range(years - 1):"),
        Bug("swapped_args", "bank/ledger.py", "balance = withdraw(balance, amount)",
            "balance = withdraw(amount, balance)"),
        Bug("no_default", "bank/ledger.py", 'if kind == "withdraw"), default=0)', 'if kind == "withdraw"))'),
    ]
    return Repo("bank", "Account balances, interest and ledgers (amounts in cents).", files, checks, bugs)


_STUDENTS = ["ada", "ben", "cleo", "dev", "eli", "fay", "gus"]


@repo
def grades(rng: random.Random) -> Repo:
    a = rng.randint(85, 95)
    b, c, d = a - rng.randint(8, 12), a - rng.randint(18, 22), a - rng.randint(28, 32)
    files = {
        "grades/__init__.py": '"""Scores, averages and letter grades of a class."""\n',
        "grades/stats.py": '''"""Averages of score lists."""


def mean(scores):
    """The arithmetic mean, rounded to 2 decimals."""
    return round(sum(scores) / len(scores), 2)


def median(scores):
    """The middle score, or the mean of the two middle scores for an even count."""
    ordered = sorted(scores)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
''',
        "grades/letters.py": _src('''
"""Letter grades."""

CUTOFFS = [[$a, "A"], [$b, "B"], [$c, "C"], [$d, "D"]]


def letter(score):
    """The grade of the first cutoff that `score` reaches (score >= cutoff); "F" below them all."""
    for cutoff, grade in CUTOFFS:
        if score >= cutoff:
            return grade
    return "F"
''', a=a, b=b, c=c, d=d),
        "grades/roster.py": '''"""A roster maps student names to their lists of scores."""

from grades.letters import letter
from grades.stats import mean


def best(roster):
    """The student with the highest mean score, the alphabetically first on a tie."""
    return sorted(roster, key=lambda name: (-mean(roster[name]), name))[0]


def report(roster):
    """Each student's letter grade, from their mean score."""
    return {name: letter(mean(scores)) for name, scores in sorted(roster.items())}


def failing(roster):
    """The students graded F, sorted."""
    return sorted(name for name, grade in report(roster).items() if grade == "F")
''',
    }
    roster = {n: [rng.randint(40, 100) for _ in range(rng.randint(2, 5))] for n in rng.sample(_STUDENTS, 4)}
    even = [rng.randint(0, 100) for _ in range(2 * rng.randint(1, 3))]
    checks = [
        Check("stats", "mean", f"stats.mean({roster[next(iter(roster))]!r})"),
        Check("stats", "median_of_an_even_count", f"stats.median({even!r})"),
        Check("letters", "a_score_at_a_cutoff_reaches_it", f"letters.letter({rng.choice([a, b, c, d])})"),
        Check("roster", "best", f"roster.best({roster!r})"),
        Check("roster", "report", f"roster.report({roster!r})"),
        Check("stats", "median_of_an_odd_count", f"stats.median({[rng.randint(0, 100) for _ in range(5)]!r})", False),
        Check("letters", "letter_f", f"letters.letter({d - rng.randint(1, 30)})", False),
        Check("letters", "letter_a", f"letters.letter({rng.randint(a, 100)})", False),
        Check("roster", "failing", f"roster.failing({roster!r})", False),
        Check("roster", "best_on_a_tie", "roster.best({'zoe': [80, 90], 'amy': [90, 80]})", False),
    ]
    bugs = [
        Bug("median_even", "grades/stats.py",
            "    if len(ordered) % 2:\n        return ordered[middle]\n"
            "    return (ordered[middle - 1] + ordered[middle]) / 2\n",
            "    return ordered[middle]\n"),
        Bug("cutoff_bound", "grades/letters.py", "if score >= cutoff:", "if score > cutoff:"),
        Bug("best_sign", "grades/roster.py", "(-mean(roster[name]), name)", "(mean(roster[name]), name)"),
        Bug("mean_divisor", "grades/stats.py", "sum(scores) / len(scores)", "sum(scores) / (len(scores) + 1)"),
    ]
    return Repo("grades", "Scores, averages and letter grades of a class.", files, checks, bugs)


def _date(rng: random.Random) -> List[int]:
    return [rng.randint(1901, 2099), rng.randint(1, 12), rng.randint(1, 28)]


@repo
def dates(rng: random.Random) -> Repo:
    files = {
        "dates/__init__.py": '"""Gregorian calendar arithmetic; dates are [year, month, day] lists."""\n',
        "dates/months.py": '''"""Leap years and month lengths."""

DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap(year):
    """Divisible by 4, except centuries, except every fourth century."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    """The number of days of `month` (1-12) in `year`."""
    if month == 2 and is_leap(year):
        return 29
    return DAYS[month - 1]
''',
        "dates/ordinal.py": '''"""Counting days."""

from dates.months import days_in_month, is_leap


def day_of_year(year, month, day):
    """1 for January 1st, up to 365 or 366 for December 31st."""
    return sum(days_in_month(year, m) for m in range(1, month)) + day


def days_between(first, second):
    """The days from date `first` to date `second` (negative if `second` is earlier); years from 1900 on."""
    return _serial(second) - _serial(first)


def _serial(date):
    year, month, day = date
    return sum(366 if is_leap(y) else 365 for y in range(1900, year)) + day_of_year(year, month, day)
''',
    }
    first, second = sorted([_date(rng), _date(rng)])
    month = rng.choice([1, 3, 4, 5, 6, 9, 10, 11, 12])
    checks = [
        Check("months", "century_divisible_by_400_is_leap", f"months.is_leap({rng.choice([1600, 2000, 2400])})"),
        Check("months", "days_in_month", f"months.days_in_month({rng.randint(1901, 2099)}, {month})"),
        Check("ordinal", "day_of_year", f"ordinal.day_of_year(*{_date(rng)!r})"),
        Check("ordinal", "days_between", f"ordinal.days_between({first!r}, {second!r})"),
        Check("months", "century_not_divisible_by_400", f"months.is_leap({rng.choice([1700, 1900, 2100])})", False),
        Check("months", "february_of_a_leap_year", f"months.days_in_month({rng.choice([1996, 2004, 2024])}, 2)",
              False),
        Check("months", "december", f"months.days_in_month({rng.randint(1901, 2099)}, 12)", False),
        Check("ordinal", "day_of_year_in_january", f"ordinal.day_of_year({rng.randint(1901, 2099)}, 1, 17)", False),
        Check("ordinal", "days_backwards", f"ordinal.days_between({second!r}, {first!r})", False),
    ]
    bugs = [
        Bug("leap_400", "dates/months.py", "(year % 100 != 0 or year % 400 == 0)", "year % 100 != 0"),
        Bug("month_index", "dates/months.py", "return DAYS[month - 1]", "return DAYS[month]"),
        Bug("day_of_year_range", "dates/ordinal.py", "for m in range(1, month))", "for m in range(1, month + 1))"),
        Bug("between_sign", "dates/ordinal.py", "_serial(second) - _serial(first)", "_serial(first) - _serial(second)"),
    ]
    return Repo("dates", "Gregorian calendar arithmetic; dates are [year, month, day] lists.", files, checks, bugs)


def _matrix(rng: random.Random, rows: int, cols: int) -> List[List[int]]:
    return [[rng.randint(-5, 5) for _ in range(cols)] for _ in range(rows)]


@repo
def matrix(rng: random.Random) -> Repo:
    files = {
        "matrix/__init__.py": '"""Integer matrices as lists of rows."""\n',
        "matrix/core.py": '''"""Building and reshaping matrices."""


def zeros(rows, cols):
    return [[0] * cols for _ in range(rows)]


def identity(n):
    m = zeros(n, n)
    for i in range(n):
        m[i][i] = 1
    return m


def transpose(m):
    """Rows become columns."""
    return [[m[r][c] for r in range(len(m))] for c in range(len(m[0]))]
''',
        "matrix/ops.py": '''"""Products, traces and powers."""

from matrix.core import identity


def multiply(a, b):
    """The matrix product of a and b (len(a[0]) == len(b))."""
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def trace(m):
    """The sum of the main diagonal of a square matrix."""
    return sum(m[i][i] for i in range(len(m)))


def power(m, k):
    """m multiplied by itself k times (the identity for k == 0)."""
    result = identity(len(m))
    for _ in range(k):
        result = multiply(result, m)
    return result
''',
    }
    n, p, q = rng.randint(2, 3), rng.randint(2, 4), rng.randint(2, 3)
    square = _matrix(rng, n, n)
    checks = [
        Check("core", "transpose_of_a_wide_matrix", f"core.transpose({_matrix(rng, n, n + 1)!r})"),
        Check("ops", "multiply", f"ops.multiply({_matrix(rng, p, q)!r}, {_matrix(rng, q, n)!r})"),
        Check("ops", "trace", f"ops.trace({square!r})"),
        Check("ops", "power", f"ops.power({square!r}, {rng.randint(2, 3)})"),
        Check("core", "identity", f"core.identity({rng.randint(1, 4)})", False),
        Check("core", "transpose_of_a_tall_matrix", f"core.transpose({_matrix(rng, n + 1, n)!r})", False),
        Check("ops", "multiply_more", f"ops.multiply({_matrix(rng, q, p)!r}, {_matrix(rng, p, p)!r})", False),
        Check("ops", "power_zero", f"ops.power({square!r}, 0)", False),
        Check("ops", "power_one", f"ops.power({square!r}, 1)", False),
    ]
    bugs = [
        Bug("transpose_index", "matrix/core.py", "[m[r][c] for r in range(len(m))]",
            "[m[c][r] for r in range(len(m))]"),
        Bug("multiply_range", "matrix/ops.py", "for k in range(len(b)))", "for k in range(len(b) - 1))"),
        Bug("trace_range", "matrix/ops.py", "m[i][i] for i in range(len(m)))", "m[i][i] for i in range(len(m) - 1))"),
        Bug("power_start", "matrix/ops.py", "for _ in range(k):", "for _ in range(1, k):"),
    ]
    return Repo("matrix", "Integer matrices as lists of rows.", files, checks, bugs)


@repo
def codec(rng: random.Random) -> Repo:
    shift = rng.randint(3, 23)
    files = {
        "codec/__init__.py": '"""Toy text codecs: a Caesar cipher and run-length coding."""\n',
        "codec/caesar.py": _src('''
"""Caesar cipher on ASCII letters; other characters pass through."""

SHIFT = $shift


def shift_char(c, k):
    if "a" <= c <= "z":
        return chr((ord(c) - ord("a") + k) % 26 + ord("a"))
    if "A" <= c <= "Z":
        return chr((ord(c) - ord("A") + k) % 26 + ord("A"))
    return c


def encode(text, k=SHIFT):
    return "".join(shift_char(c, k) for c in text)


def decode(text, k=SHIFT):
    return encode(text, -k)
''', shift=shift),
        "codec/rle.py": '''"""Run-length coding: "aaab" <-> "a3b1"."""


def encode(text):
    runs = []
    for c in text:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return "".join(f"{c}{n}" for c, n in runs)


def decode(code):
    """The inverse of encode, for texts without digits (a count may have several digits)."""
    out, i = [], 0
    while i < len(code):
        j = i + 1
        while j < len(code) and code[j].isdigit():
            j += 1
        out.append(code[i] * int(code[i + 1:j]))
        i = j
    return "".join(out)
''',
    }

    def word(alphabet: str = "abcxyz") -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(4, 8)))

    runs = "".join(c * rng.randint(1, 4) for c in word("abcd"))
    long_code = f"{rng.choice('xyz')}{rng.randint(10, 19)}{rng.choice('abc')}{rng.randint(1, 9)}"
    checks = [
        Check("caesar", "encode_wraps_around", f"caesar.encode({word('wxyz') + ' ' + word('WXYZ')!r})"),
        Check("caesar", "decode_inverts_encode", f"caesar.decode({word() + '!'!r})"),
        Check("rle", "encode", f"rle.encode({runs!r})"),
        Check("rle", "decode_counts_of_two_digits", f"rle.decode({long_code!r})"),
        Check("caesar", "encode_more", f"caesar.encode({word() + ', ' + word('ABCXYZ')!r}, {rng.randint(1, 25)})",
              False),
        Check("caesar", "decode_more", f"caesar.decode({word('uvwxyz')!r}, {rng.randint(1, 25)})", False),
        Check("rle", "encode_empty", "rle.encode('')", False),
        Check("rle", "decode", f"rle.decode('a{rng.randint(1, 9)}b{rng.randint(1, 9)}')", False),
    ]
    bugs = [
        Bug("modulus", "codec/caesar.py", '% 26 + ord("a")', '% 25 + ord("a")'),
        Bug("decode_sign", "codec/caesar.py", "return encode(text, -k)", "return encode(text, k)"),
        Bug("run_start", "codec/rle.py", "runs.append([c, 1])", "runs.append([c, 0])"),
        Bug("one_digit", "codec/rle.py", "        while j < len(code) and code[j].isdigit():\n",
            "        if j < len(code) and code[j].isdigit():\n"),
    ]
    return Repo("codec", "Toy text codecs: a Caesar cipher and run-length coding.", files, checks, bugs)


PAIRS: List[Tuple[str, str]] = [(name, bug.id) for name, fn in REPOS.items() for bug in fn(random.Random(0)).bugs]


# --- the programs that run in the sandbox (ours; the package under test is the policy's) ------------------------

# Evaluates the checks against the package in each of `roots`; one JSON line per check and root, after the nonce.
# The workdir leaves sys.path before json and os are imported, so no file there can stand in for them.
CHECK_RUNNER = r'''
import sys
workdir = sys.path.pop(0)
import json, os

payload = json.loads(sys.stdin.read())
report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
lines = [payload["nonce"]]
for root in payload["roots"]:
    sys.path.insert(0, os.path.join(workdir, root))
    for check in payload["checks"]:
        try:
            namespace = {}
            exec(check["imports"], namespace)
            value = eval(check["expr"], namespace)
            lines.append('{"value": ' + json.dumps(value) + ', "repr": ' + json.dumps(repr(value)) + "}")
        except BaseException as e:
            lines.append(json.dumps({"error": type(e).__name__, "message": str(e)[:300]}))
    sys.path.pop(0)
    for name in [m for m in sys.modules if m == payload["package"] or m.startswith(payload["package"] + ".")]:
        del sys.modules[name]
report.write("\n".join(lines) + "\n")
report.close()
'''

# Runs tests/test_*.py: every function named test_*, in file order; paths in the output are relative to the repo.
TEST_RUNNER = r'''
import sys
root = sys.path[0]
import importlib.util, os, traceback


def where(e):
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(root + os.sep)]
    return f" ({os.path.relpath(frames[-1].filename, root)}:{frames[-1].lineno})" if frames else ""


passed = failed = 0
names = sorted(n for n in os.listdir("tests") if n.startswith("test_") and n.endswith(".py")) \
    if os.path.isdir("tests") else []
for name in names:
    try:
        spec = importlib.util.spec_from_file_location("tests." + name[:-3], os.path.join(root, "tests", name))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except BaseException as e:
        failed += 1
        print(f"ERROR tests/{name}: {type(e).__name__}: {e}{where(e)}", flush=True)
        continue
    for test, fn in list(vars(module).items()):
        if not (test.startswith("test_") and callable(fn)):
            continue
        try:
            fn()
        except BaseException as e:
            failed += 1
            print(f"FAIL tests/{name}::{test}: {type(e).__name__}: {e}{where(e)}", flush=True)
        else:
            passed += 1
            print(f"PASS tests/{name}::{test}", flush=True)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed or not passed else 0)
'''


def same(got: Dict[str, Any], want: Dict[str, Any]) -> bool:
    """A check's result equals the expected one: the same exception type, or equal JSON values (floats within a
    tolerance; True is not 1)."""
    if "error" in want or "error" in got:
        return got.get("error") == want.get("error")
    return _equal(got.get("value"), want.get("value"))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _render_tests(package: str, module: str, cases: List[Tuple[Check, Dict[str, Any]]]) -> str:
    out = [f'"""Tests of {package}.{module}."""', "", f"from {package} import {module}"]
    for check, want in cases:
        out += ["", "", f"def test_{check.test}():"]
        if "error" in want:
            out += ["    try:", f"        {check.expr}", f"    except {want['error']}:", "        return",
                    f"    raise AssertionError({check.expr + ' should raise ' + want['error']!r})"]
        else:
            out += [f"    got = {check.expr}", f"    want = {want['repr']}",
                    '    assert got == want, f"got {got!r}, want {want!r}"']
    return "\n".join(out) + "\n"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _clip_tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"... [{len(text) - limit} characters cut]\n{text[-limit:]}"


class RepoFix(SandboxedEnvironment, ToolEnvironment):
    name = "repo_fix"
    max_turns = 8

    def __init__(self, max_turns: int = 8, eval_size: int = 8, eval_seed: int = 12345, work_root: str = "",
                 repos: Optional[List[str]] = None, output_chars: int = 4000):
        for key, value, least in [("max_turns", max_turns, 1), ("eval_size", eval_size, 1),
                                  ("output_chars", output_chars, 200)]:
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"env.args.{key}: expected an integer >= {least}, got {value!r}")
        unknown = sorted(set(repos or []) - set(REPOS))
        if unknown:
            raise ValueError(f"env.args.repos: unknown {', '.join(unknown)} (known: {', '.join(REPOS)})")
        if not isinstance(work_root, str):
            raise ValueError(f"env.args.work_root: expected a folder path, got {work_root!r}")
        pairs = [p for p in PAIRS if p[0] in (repos or REPOS)]
        if eval_size >= len(pairs):
            raise ValueError(f"env.args.eval_size: {eval_size} leaves no (repository, bug) pair to train on; the "
                             f"chosen repos have {len(pairs)}, so use at most {len(pairs) - 1}")
        self.max_turns, self.output_chars = max_turns, output_chars
        self.work_root = work_root or tempfile.gettempdir()
        self.eval_seed = eval_seed
        # Held out by (repository, bug): training never sees the eval set's bugs, in any of their instances.
        self._eval_pairs = random.Random(eval_seed).sample(pairs, eval_size)
        self._train_pairs = [p for p in pairs if p not in self._eval_pairs]
        self._eval: Optional[List[Task]] = None  # made at first use: making a task runs the sandbox

    def run_checks(self, workdir: str, package: str, checks: List[Dict[str, str]],
                   roots: Tuple[str, ...] = (".",)) -> Optional[List[List[Dict[str, Any]]]]:
        """Each check's result ({"value", "repr"} or {"error", "message"}) per root folder of `workdir`; None when
        the program timed out or left no readable report."""
        nonce = secrets.token_hex(16)
        payload = {"nonce": nonce, "roots": list(roots), "package": package, "checks": checks}
        r = self.sandbox(workdir).run_python(CHECK_RUNNER, stdin=json.dumps(payload))
        lines = r.stdout.splitlines()
        starts = [i for i, line in enumerate(lines) if line == nonce]
        if r.timed_out or not starts:
            return None
        body = lines[starts[-1] + 1:]
        if len(body) != len(roots) * len(checks):
            return None
        try:
            results = [json.loads(line) for line in body]
        except json.JSONDecodeError:
            return None
        return [results[i * len(checks):(i + 1) * len(checks)] for i in range(len(roots))]

    # --- tasks ---

    def _task(self, rng: random.Random, task_id: str, pair: Tuple[str, str]) -> Task:
        name, bug_id = pair
        for _ in range(20):  # values for which the bug makes a visible test fail
            r = REPOS[name](rng)
            bug = next(b for b in r.bugs if b.id == bug_id)
            good = r.files[bug.path]
            if good.count(bug.good) != 1:
                raise RuntimeError(f"repo_fix: {name}/{bug_id}: the fixed snippet occurs {good.count(bug.good)} times")
            buggy = dict(r.files, **{bug.path: good.replace(bug.good, bug.bad)})
            if buggy[bug.path].count(bug.bad) != 1:
                raise RuntimeError(f"repo_fix: {name}/{bug_id}: the buggy snippet is not unique")
            checks = [{"imports": f"from {r.package} import {c.module}", "expr": c.expr} for c in r.checks]
            with tempfile.TemporaryDirectory(prefix="rlhpc-repo-fix-") as d:
                for root, files in (("good", r.files), ("bad", buggy)):
                    _write(os.path.join(d, root), files)
                results = self.run_checks(d, r.package, checks, roots=("good", "bad"))
            if results is None:
                raise RuntimeError(f"repo_fix: {name}: the check program failed (sandbox limits too tight?)")
            expected, broken = results
            if not any(c.visible and not same(b, e) for c, e, b in zip(r.checks, expected, broken)):
                continue
            visible = [(c, e) for c, e in zip(r.checks, expected) if c.visible]
            tests = {f"tests/test_{m}.py": _render_tests(r.package, m, [(c, e) for c, e in visible if c.module == m])
                     for m in dict.fromkeys(c.module for c, _ in visible)}
            files = {"README.md": f"# {r.package}\n\n{r.about}\n\nTests: tests/test_*.py (plain test functions).\n",
                     **buggy, **tests}
            return Task(task_id, {
                "repo": name, "bug": bug_id, "package": r.package, "files": files,
                "test_hashes": {p: _sha(t) for p, t in tests.items()},
                "checks": [dict(ch, expected=e) for ch, e in zip(checks, expected)],
                "fix": {"path": bug.path, "search": bug.bad, "replace": bug.good}})
        raise RuntimeError(f"repo_fix: {name}/{bug_id}: no values made the bug fail a visible test")

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        if split == "eval":
            if self._eval is None:
                rng = random.Random(self.eval_seed)
                self._eval = [self._task(rng, f"eval-{i}", p) for i, p in enumerate(self._eval_pairs)]
            yield from self._eval
            return
        rng = random.Random(seed)
        i = 0
        while True:
            yield self._task(rng, f"{seed}-{i}", rng.choice(self._train_pairs))
            i += 1

    def messages(self, task: Task) -> List[Message]:
        files = "\n".join(f"  {p}" for p in sorted(task.data["files"]))
        return [{"role": "user", "content":
                 f"The Python package `{task.data['package']}` in your work folder has a bug: at least one of the "
                 f"tests in tests/ fails. Find the bug and fix the package's code with the tools (list_files, "
                 f"read_file, edit_file, run_tests). Do not change the tests: a fix that edits them scores nothing. "
                 f"When you are done, answer without a tool call, in one line saying what you fixed.\n\n"
                 f"Files:\n{files}"}]

    # --- episodes ---

    def start(self, task: Task) -> Dict[str, Any]:
        os.makedirs(self.work_root, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="rlhpc-repo-fix-", dir=self.work_root)
        _write(workdir, task.data["files"])
        return {"dir": workdir}

    def finish(self, task: Task, state: Dict[str, Any]) -> None:
        if state.get("dir"):
            shutil.rmtree(state["dir"], ignore_errors=True)

    def score(self, task: Task, state: Dict[str, Any], completions: List[str]) -> float:
        workdir = state["dir"]
        for path, digest in task.data["test_hashes"].items():
            full = os.path.join(workdir, path)
            if os.path.islink(full) or not os.path.isfile(full) or _sha(_read(full)) != digest:
                return 0.0
        checks = [{"imports": c["imports"], "expr": c["expr"]} for c in task.data["checks"]]
        results = self.run_checks(workdir, task.data["package"], checks)
        if results is None:
            return 0.0
        return float(all(same(got, c["expected"]) for got, c in zip(results[0], task.data["checks"])))

    def reference(self, task: Task) -> List[Message]:
        """A scripted fix, played against a fresh copy so each tool reply is the one the environment gives."""
        fix = task.data["fix"]
        calls = [{"name": "read_file", "arguments": {"path": fix["path"]}},
                 {"name": "edit_file", "arguments": dict(fix)},
                 {"name": "run_tests", "arguments": {}}]
        lines = ["Let me read the module the failing test is about.", "That is the bug; fixing it.",
                 "Checking the tests."]
        state = self.start(task)
        out: List[Message] = []
        try:
            for line, call in zip(lines, calls):
                text = f"{line}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
                out.append({"role": "assistant", "content": text})
                out += self.respond(task, state, text).messages
        finally:
            self.finish(task, state)
        bad, good = fix["search"].strip(), fix["replace"].strip()
        out.append({"role": "assistant", "content": f"Fixed {fix['path']}: `{bad}` is now `{good}`; the tests pass."})
        return out

    # --- tools ---

    def tools(self) -> List[Tool]:
        path = {"type": "string", "description": "a path relative to the repository root, e.g. tests/test_x.py"}
        return [
            Tool("list_files", "List the repository's files.", {"type": "object", "properties": {}}, self.list_files),
            Tool("read_file", "Return the text of a file.",
                 {"type": "object", "properties": {"path": path}, "required": ["path"]}, self.read_file),
            Tool("edit_file", "Replace the exact text `search` (it must occur exactly once in the file) by `replace`.",
                 {"type": "object", "properties": {"path": path, "search": {"type": "string"},
                                                   "replace": {"type": "string"}},
                  "required": ["path", "search", "replace"]}, self.edit_file),
            Tool("run_tests", "Run the tests in tests/ and return their results.",
                 {"type": "object", "properties": {}}, self.run_tests),
        ]

    def _path(self, state: Dict[str, Any], path: str) -> str:
        """The real path of `path` inside the episode's folder; ToolCallError for anything that leads outside it."""
        root = os.path.realpath(state["dir"])
        full = os.path.realpath(os.path.join(root, path))
        if "\x00" in path or not full.startswith(root + os.sep):
            raise ToolCallError(f"{path!r} is outside the repository: use paths relative to its root, as list_files "
                                f"shows them")
        return full

    def list_files(self, state: Dict[str, Any]) -> str:
        root = state["dir"]
        found = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
        return "\n".join(found[:500]) + (f"\n... and {len(found) - 500} more" if len(found) > 500 else "")

    def read_file(self, path: str, state: Dict[str, Any]) -> str:
        full = self._path(state, path)
        if not os.path.isfile(full):
            raise ToolCallError(f"no file {path} (list_files shows the files)")
        text = _read(full)
        limit = 5 * self.output_chars
        return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"

    def edit_file(self, path: str, search: str, replace: str, state: Dict[str, Any]) -> str:
        full = self._path(state, path)
        if not os.path.isfile(full):
            raise ToolCallError(f"no file {path} (list_files shows the files)")
        if not search:
            raise ToolCallError("search must not be empty")
        text = _read(full)
        n = text.count(search)
        if n == 0:
            raise ToolCallError(f"search text not found in {path}: it must match the file exactly, indentation "
                                f"included (read_file shows it)")
        if n > 1:
            raise ToolCallError(f"search text occurs {n} times in {path}: include more of the surrounding lines so "
                                f"it occurs once")
        with open(full, "w") as f:
            f.write(text.replace(search, replace))
        return f"edited {path}: replaced {search.count(chr(10)) + 1} line(s) with {replace.count(chr(10)) + 1}"

    def run_tests(self, state: Dict[str, Any]) -> str:
        r: Result = self.sandbox(state["dir"]).run_python(TEST_RUNNER)
        if r.timed_out:
            head = f"the tests timed out after {r.wall_s:.0f}s"
        elif not r.stdout.rstrip().endswith(" failed"):  # the runner itself did not finish
            head = f"the tests stopped with exit code {r.returncode}"
        else:
            head = ""
        parts = [p for p in (head, _clip_tail(r.stdout.strip(), self.output_chars)) if p]
        if r.stderr.strip() and (head or r.returncode != 0):
            parts.append("stderr:\n" + _clip_tail(r.stderr.strip(), self.output_chars // 2))
        return "\n".join(parts)


def _write(root: str, files: Dict[str, str]) -> None:
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
