"""A pairwise covering array under constraints: greedy, AETG-style (Cohen et al., IEEE TSE 1997).

``cover(factors, valid, seed)`` returns runs (a level per factor) such that every pair of levels of
two factors that occurs in *some* valid run occurs in one of the returned runs.  Which pairs can
occur is found by completing each pair not yet in a completed run: its other factors start at their
first level (the least constraining one) and up to two of them are changed until ``valid`` accepts
the run.  Then, as
AETG does, each new run is the best of ``candidates`` greedy constructions: start from an uncovered
pair's completion and change its other factors one at a time, in a seeded random order, to the level
that covers the most pairs not yet covered while ``valid`` still accepts the run (a hill climb that
never leaves the valid runs).  Deterministic for a given seed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

Pair = tuple[tuple[str, object], tuple[str, object]]


def pairs_of(run: dict, names: list[str]) -> set[Pair]:
    """Every pair of (factor, level) in ``run``, factors in ``names`` order."""
    return {((a, run[a]), (b, run[b])) for a, b in itertools.combinations(names, 2)}


def complete(
    pair: Pair, factors: dict[str, tuple], valid: Callable[[dict], bool], depth: int = 2
) -> dict | None:
    """A valid run holding ``pair``, changing as few other factors from their first level as it can."""
    base = {f: levels[0] for f, levels in factors.items()}
    base.update(dict(pair))
    if valid(base):
        return base
    fixed = {f for f, _ in pair}
    free = [f for f in factors if f not in fixed]
    for k in range(1, depth + 1):
        for chosen in itertools.combinations(free, k):
            for levels in itertools.product(*(factors[f][1:] for f in chosen)):
                run = {**base, **dict(zip(chosen, levels))}
                if valid(run):
                    return run
    return None


def cover(
    factors: dict[str, tuple], valid: Callable[[dict], bool], *, seed: int = 0, candidates: int = 8
) -> tuple[list[dict], set[Pair]]:
    """Runs that cover every pair a valid run can hold; also the pairs no valid run holds (none
    within two changes of a pair's first-level completion)."""
    names = list(factors)
    rng = random.Random(seed)
    seen: dict[tuple, bool] = {}

    def ok(run: dict) -> bool:
        key = tuple(run[f] for f in names)
        if key not in seen:
            seen[key] = valid(run)
        return seen[key]

    every = {
        ((a, la), (b, lb))
        for a, b in itertools.combinations(names, 2)
        for la in factors[a]
        for lb in factors[b]
    }
    completion: dict[Pair, dict] = {}
    for pair in sorted(every, key=repr):
        if pair not in completion:
            run = complete(pair, factors, ok)
            if run is not None:  # the run completes every pair it holds
                for p in pairs_of(run, names):
                    completion.setdefault(p, run)
    impossible = every - set(completion)
    uncovered = set(completion)
    runs: list[dict] = []
    while uncovered:
        best, best_gain = None, -1
        order = sorted(uncovered, key=repr)
        for _ in range(candidates):
            pair = rng.choice(order)
            run = _construct(completion[pair], {f for f, _ in pair}, factors, names, uncovered, ok, rng)
            gain = len(pairs_of(run, names) & uncovered)
            if gain > best_gain:
                best, best_gain = run, gain
        runs.append(best)
        uncovered -= pairs_of(best, names)
    return runs, impossible


def _gain(run: dict, f: str, level, names: list[str], uncovered: set) -> int:
    """Uncovered pairs that ``f`` at ``level`` makes with the other factors of ``run``."""
    i = names.index(f)
    n = 0
    for j, g in enumerate(names):
        if g != f:
            n += (((f, level), (g, run[g])) if i < j else ((g, run[g]), (f, level))) in uncovered
    return n


def _construct(
    start: dict, fixed: set, factors: dict, names: list[str], uncovered: set, valid, rng: random.Random
) -> dict:
    """Hill-climb from a valid run: change one factor at a time (not those in ``fixed``) to the level
    that covers the most uncovered pairs and keeps the run valid, until no change gains."""
    run = dict(start)
    for _ in range(3):
        changed = False
        rest = [f for f in names if f not in fixed]
        rng.shuffle(rest)
        for f in rest:
            now = _gain(run, f, run[f], names, uncovered)
            options = [
                (_gain(run, f, lv, names, uncovered), rng.random(), lv) for lv in factors[f] if lv != run[f]
            ]
            for gain, _, level in sorted(options, key=lambda o: (-o[0], o[1])):
                if gain <= now:
                    break
                trial = {**run, f: level}
                if valid(trial):
                    run, changed = trial, True
                    break
        if not changed:
            break
    return run
