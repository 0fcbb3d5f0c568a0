"""Schedule builders: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV, and ``place``.

Each builder writes every stage's order of compute actions and ``place``s it on the tick grid
(as early as dependencies allow, with the sends and receives added), then validates it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ._schedule import (
    COMPUTE,
    Action,
    Schedule,
    ScheduleError,
    check_layout,
    check_sizes,
    needs,
    next_stage,
    prev_stage,
)
from ._validate import validate

__all__ = ["dualpipe_v", "gpipe", "interleaved_1f1b", "one_f_one_b", "place", "zb_h1", "zb_v"]


# Builders -----------------------------------------------------------------------------------


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (arXiv:1811.06965): every forward, then every backward.

    With ``v > 1`` chunks per stage this is the breadth-first "looped" schedule: all
    microbatches through chunk 0, then chunk 1, ...; backwards in the reverse chunk order.
    Stashes all ``v * m`` microbatch-chunks per stage.
    """
    check_sizes("gpipe", p, m, v)
    fwd = [("F", j, c) for c in range(v) for j in range(m)]
    bwd = [("BW", j, c) for c in reversed(range(v)) for j in range(m)]
    return place([fwd + bwd] * p, m=m, v=v, name="GPipe", stash_bound=[v * m] * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B, non-interleaved (PipeDream-Flush, arXiv:2104.04473 §2.2).

    Stage ``s`` runs ``p - s - 1`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards; it stashes at most ``p - s`` microbatches.
    """
    check_sizes("one_f_one_b", p, m, 1)
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [("F", j, 0) for j in range(warm)]
        for i in range(m - warm):
            order += [("F", warm + i, 0), ("BW", i, 0)]
        order += [("BW", i, 0) for i in range(m - warm, m)]
        orders.append(order)
    return place(orders, m=m, name="1F1B", stash_bound=[min(p - s, m) for s in range(p)])


def interleaved_1f1b(p: int, m: int, v: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B with ``v`` model chunks per stage, in Megatron-LM's order.

    Forwards go through the chunks in groups of ``group`` consecutive microbatches (Megatron-LM's
    ``microbatch_group_size_per_vp_stage``, Llama 3's tunable ``N``; default ``p``): microbatches
    ``0 .. N-1`` through chunk 0, then chunk 1, ..., then the next group; the last group takes
    what is left. Backwards visit the chunks in reverse. Stage ``s`` runs
    ``2 (p - s - 1) + (v - 1) N`` warm-up forwards (Megatron ``schedules.py``), so it stashes at
    most that plus one microbatch-chunks: with ``N = p``, ``p v + p - 1`` chunks on stage 0, i.e.
    ``p + (p - 1) / v`` stages' worth; a larger ``N`` keeps ``(v - 1)`` more a microbatch added.
    The bubble shrinks to ``(p - 1) / (v m + p - 1)`` of the run.

    ``group`` lets ``m`` be other than a multiple of ``p``: ``p <= N <= m``, and ``m % N`` either
    0 or at least ``p`` (a last group smaller than ``p`` would wait on its own first chunk;
    Megatron refuses it too). With ``p=2, m=5, v=2, group=3`` the forwards run microbatches
    ``0 1 2 0 1 2 3 4 3 4`` of chunks ``0 0 0 1 1 1 0 0 1 1``.

    Raises:
      ScheduleError: ``v < 2``; ``m`` not a multiple of ``p`` without a ``group`` (the message
        names one that fits); a ``group`` outside ``p .. m`` or leaving a last group under ``p``.
    """
    check_sizes("interleaved_1f1b", p, m, v)
    if v < 2:
        raise ScheduleError(
            f"fpar.pipeline.interleaved_1f1b: v={v}; interleaving needs v >= 2 model chunks per "
            f"stage. For one chunk per stage use one_f_one_b({p}, {m})."
        )
    n = interleaved_group(p, m, group)
    table = [(j, c) for start in range(0, m, n) for c in range(v) for j in range(start, min(start + n, m))]
    total = m * v

    def unit(k: int, kind: str) -> tuple[str, int, int]:
        j, c = table[k]
        return kind, j, (c if kind == "F" else v - 1 - c)

    orders = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * n, total)
        order = [unit(k, "F") for k in range(warm)]
        for i in range(total - warm):
            order += [unit(warm + i, "F"), unit(i, "BW")]
        order += [unit(i, "BW") for i in range(total - warm, total)]
        orders.append(order)
    bound = [min(2 * (p - s - 1) + (v - 1) * n + 1, total) for s in range(p)]
    name = f"interleaved 1F1B (v={v}" + (f", N={n})" if n != p else ")")
    return place(orders, m=m, v=v, name=name, stash_bound=bound)


def _fits(p: int, m: int, n: int) -> bool:
    """Megatron-LM's rule for a group of ``n``: it covers the ``p`` stages, and so does the last one."""
    return p <= n <= m and (m % n == 0 or m % n >= p)


def smallest_group(p: int, m: int) -> int | None:
    """Interleaved 1F1B's fewest microbatches a group on ``p`` stages, ``m`` microbatches; None: m < p.

    ``p`` when ``m`` is a multiple of it; the first ``N`` with ``m % N`` 0 or at least ``p`` otherwise.
    """
    return next((n for n in range(p, m + 1) if _fits(p, m, n)), None)


def interleaved_group(p: int, m: int, group: int | None) -> int:
    """Interleaved 1F1B's microbatches a group, ``group`` or ``p``, checked (see its docstring)."""
    if group is None and m % p == 0:
        return p
    if group is not None and not isinstance(group, bool) and isinstance(group, int) and _fits(p, m, group):
        return group
    api = "fpar.pipeline.interleaved_1f1b"
    fit = smallest_group(p, m)
    hint = f"group={fit} fits" if fit else f"no group fits fewer microbatches than stages: use m >= {p}"
    if group is None:
        raise ScheduleError(
            f"{api}: the number of microbatches m={m} is not divisible by the number of stages "
            f"p={p}; the interleaved schedule sends microbatches round in groups of p. Use "
            f"m={m + (-m) % p} (or {m - m % p}) microbatches, or a group of N microbatches (Megatron-LM's "
            f"microbatch_group_size_per_vp_stage: p <= N <= m, m % N 0 or >= p): {hint}."
        )
    if isinstance(group, bool) or not isinstance(group, int) or not p <= group <= m:
        raise ScheduleError(
            f"{api}: group={group!r}; a group is an int N with p={p} <= N <= m={m} (every chunk's "
            f"round must cover the pipeline's p stages): {hint}."
        )
    raise ScheduleError(
        f"{api}: group={group} leaves a last group of {m % group} microbatches (m={m}), fewer than "
        f"the p={p} stages: its next chunk would wait on its first (Megatron-LM refuses it too). "
        f"Choose N with m % N 0 or >= p: {hint}."
    )


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1, the zero-bubble schedule with 1F1B's memory (arXiv:2401.10241 §3).

    The backward is split into ``B`` (input gradient, on the critical path) and ``W`` (weight
    gradient, which nothing downstream waits for).  Stage ``s`` runs ``p - s`` forwards, then
    repeats (B, W, F) with its W passes delayed by ``s`` microbatches, then drains the
    delayed Ws into what would be the cool-down bubble.  With t_F = t_B = t_W the bubble is
    ``(p - 1)`` time units against 1F1B's ``3 (p - 1)``; every stage stashes at most ``p``.
    """
    check_sizes("zb_h1", p, m, 1)
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order = [("F", j, 0) for j in range(warm)]
        done_w = 0
        for i in range(m):
            order.append(("B", i, 0))
            if i >= s:
                order.append(("W", done_w, 0))
                done_w += 1
            if warm + i < m:
                order.append(("F", warm + i, 0))
        order += [("W", j, 0) for j in range(done_w, m)]
        orders.append(order)
    return place(orders, m=m, name="ZB-H1", stash_bound=[min(p, m)] * p)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (arXiv:2401.10241 §6): two chunks per stage in a V, split backward, 1F1B's memory.

    Stage ``s`` holds virtual stages ``s`` and ``2 p - 1 - s`` (``layout="v"``): a microbatch
    goes down the stages on chunk 0 and back up on chunk 1, so the loss and the first layers
    share stage 0.  The order per stage is the paper's (and ``torch.distributed.pipelining``'s
    ``ScheduleZBVZeroBubble``): ``2 (p - s) - 1`` chunk-0 forwards, ``s`` pairs of chunk-1 and
    chunk-0 forwards, ``p - s`` rounds of (F, B, W) on chunk 1, then steady (F, B, W) rounds on
    both chunks, then the remaining Bs with the Ws filling the cool-down.  With
    t_F = t_B = t_W and ``m >= 2 p`` it has no bubble beyond the fill and drain of
    ``p - 1`` units each way; every stage stashes at most ``2 p`` microbatch-chunks, i.e. the
    ``p`` stage-microbatches of 1F1B's first stage.
    """
    check_sizes("zb_v", p, m, 2)
    n = max(2 * p - 1, m)  # the order for enough microbatches to fill the V; extra ones dropped
    orders = []
    for s in range(p):
        order: list[tuple[str, int, int]] = []
        f, b = [0, 0], [0, 0]

        def add(kind: str, c: int, count: list, order: list = order) -> None:
            order.append((kind, count[c], c))
            count[c] += 1

        for _ in range(2 * (p - s) - 1):
            add("F", 0, f)
        for _ in range(s):
            add("F", 1, f)
            add("F", 0, f)
        for _ in range(p - s):
            add("F", 1, f)
            order += [("B", b[1], 1), ("W", b[1], 1)]
            b[1] += 1
        while f[1] < f[0] or f[0] < n:
            if f[0] < n:
                add("F", 0, f)
            order += [("B", b[0], 0), ("W", b[0], 0)]
            b[0] += 1
            add("F", 1, f)
            order += [("B", b[1], 1), ("W", b[1], 1)]
            b[1] += 1
        w = list(b)
        for _ in range(s):
            add("B", 0, b)
            add("B", 1, b)
        for _ in range(p - s):
            add("B", 0, b)
            add("W", 0, w)
        order += [("W", j, 1) for j in range(w[1], b[1])] + [("W", j, 0) for j in range(w[0], b[0])]
        orders.append([u for u in order if u[1] < m])
    return place(orders, m=m, v=2, name="ZB-V", stash_bound=[2 * p] * p, layout="v")


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3, arXiv:2412.19437 §3.2.1, the V-shaped "cut-in-half" DualPipe).

    Two chunks per stage in a V (``layout="v"``), as ``zb_v``.  The steady phase pairs the
    forward of one microbatch on one chunk with the full backward of another on the other
    chunk (``F`` then ``BW``, back to back: DeepSeek overlaps the pair's compute with its
    communication, which this executor gets from posting sends and receives without waiting);
    the warm-up uses zero-bubble (B, W, F) rounds and the cool-down splits the second half of
    its backwards, its Ws filling the drain.  The order per stage is DeepSeek's
    (``deepseek-ai/DualPipe`` ``dualpipev.py``, as ported by ``torch.distributed.pipelining``'s
    ``ScheduleDualPipeV``).

    Raises:
      ScheduleError: ``m < 2 p`` (DualPipeV needs at least as many microbatches as virtual stages).
    """
    check_sizes("dualpipe_v", p, m, 2)
    if m < 2 * p:
        raise ScheduleError(
            f"fpar.pipeline.dualpipe_v: m={m} microbatches for p={p} stages; DualPipeV needs at "
            f"least 2 p = {2 * p} microbatches (one per virtual stage). Use m >= {2 * p} or zb_v."
        )
    orders = []
    for s in range(p):
        order: list[tuple[str, int, int]] = []
        f, b = [0, 0], [0, 0]
        pending: list[tuple[int, int]] = []  # (chunk, microbatch) whose W is still to run

        def fwd(c: int, order: list = order, f: list = f) -> None:
            order.append(("F", f[c], c))
            f[c] += 1

        def bwd(c: int, split: bool, order: list = order, b: list = b, pending: list = pending) -> None:
            order.append(("B" if split else "BW", b[c], c))
            if split:
                pending.append((c, b[c]))
            b[c] += 1

        def weight(order: list = order, pending: list = pending) -> None:
            if pending:
                c, j = pending.pop(0)
                order.append(("W", j, c))

        for _ in range(2 * (p - s - 1)):
            fwd(0)
        for _ in range(s + 1):
            fwd(0)
            fwd(1)
        for _ in range(p - s - 1):
            bwd(1, True)
            weight()
            fwd(1)
        for _ in range(m - 2 * p + s + 1):
            fwd(0)
            bwd(1, False)
            fwd(1)
            bwd(0, False)
        for _ in range(p - s - 1):
            bwd(1, False)
            fwd(1)
            bwd(0, False)
        split = False
        for i in range(s + 1):
            if i == (s + 1) // 2 and s % 2 == 1:
                split = True
            bwd(1, split)
            if i == (s + 1) // 2 and s % 2 == 0:
                split = True
            bwd(0, split)
        for _ in range(p - s - 1):
            weight()
            bwd(0, split)
        while pending:
            weight()
        orders.append(order)
    return place(orders, m=m, v=2, name="DualPipeV", stash_bound=[2 * p + 1] * p, layout="v")


# Placing per-stage orders on the tick grid ----------------------------------------------------

_LABEL = re.compile(r"^(BW|F|B|W)(\d+)(?:\.(\d+))?$")


def place(
    orders: Sequence[Iterable],
    *,
    m: int,
    v: int = 1,
    name: str = "custom",
    stash_bound: Sequence[int] | None = None,
    layout: str = "interleaved",
) -> Schedule:
    """Build a schedule from each stage's order of compute actions, as early as dependencies allow.

    Each stage runs its next action at the first tick at which its inputs have arrived (the
    activation from the previous virtual stage for ``F``, the gradient from the next one for
    ``B``/``BW``, the stage's own ``B`` for ``W``); the sends and receives that move them are
    added at the tick the value is computed.  The result is validated.

    Args:
      orders: per stage, its compute actions in order: ``(kind, microbatch, chunk)`` tuples or
        strings like ``"F3"``, ``"BW3"``, ``"B3.1"`` (microbatch 3 of chunk 1).
      m: number of microbatches.
      v: model chunks per stage.
      name: the schedule's name.
      stash_bound: per stage, the most stashed microbatch-chunks allowed (checked).
      layout: ``"interleaved"`` or ``"v"`` (see ``Schedule``).

    Returns:
      The validated schedule.

    Raises:
      ScheduleError: an order that misses or repeats an action, or that can never finish (a
        deadlock: the message names each stuck stage, the tick and what it waits for).

    Example:
      >>> s = place([["F0", "F1", "BW0", "BW1"], ["F0", "BW0", "F1", "BW1"]], m=2)
    """
    p = len(orders)
    if p < 1:
        raise ScheduleError("fpar.pipeline.place: orders is empty; give one list of actions per stage.")
    check_layout("place", layout, v)
    units = [[_unit(s, i, u) for i, u in enumerate(order)] for s, order in enumerate(orders)]
    _check_orders(units, p, m, v)
    actions = _asap(units, p, v, layout)
    bound = tuple(stash_bound) if stash_bound is not None else None
    return validate(Schedule(name, p, m, v, tuple(actions), bound, layout))


def _unit(s: int, i: int, u) -> tuple[str, int, int]:
    if isinstance(u, Action):
        return u.kind, u.microbatch, u.chunk
    if isinstance(u, str):
        match = _LABEL.match(u.strip())
        if not match:
            raise ScheduleError(
                f"fpar.pipeline.place: stage {s}, position {i}: cannot read action {u!r}; write "
                f"e.g. 'F3', 'BW3', 'B3', 'W3', or 'F3.1' for microbatch 3 of chunk 1."
            )
        return match[1], int(match[2]), int(match[3] or 0)
    if isinstance(u, tuple) and len(u) in (2, 3):
        kind, j, c = (*u, 0) if len(u) == 2 else u
        return kind, j, c
    raise ScheduleError(
        f"fpar.pipeline.place: stage {s}, position {i}: {u!r} is not an action; give a "
        f"(kind, microbatch, chunk) tuple or a string like 'F3'."
    )


def _check_orders(units: list[list[tuple]], p: int, m: int, v: int) -> None:
    for s, order in enumerate(units):
        seen: dict[tuple, int] = {}
        for i, (kind, j, c) in enumerate(order):
            where = f"fpar.pipeline.place: stage {s}, position {i}, action {kind}{j}"
            if kind not in COMPUTE:
                raise ScheduleError(
                    f"{where}: kind {kind!r} is not a compute action {COMPUTE}; sends and receives "
                    f"are added by place."
                )
            if not (0 <= j < m and 0 <= c < v):
                raise ScheduleError(f"{where}: microbatch {j} / chunk {c} out of range (m={m}, v={v}).")
            if (kind, j, c) in seen:
                raise ScheduleError(f"{where}: repeats the action at position {seen[(kind, j, c)]}.")
            seen[(kind, j, c)] = i
        for j in range(m):
            for c in range(v):
                _check_unit_order(s, j, c, seen)


def _check_unit_order(s: int, j: int, c: int, seen: dict) -> None:
    what = f"microbatch {j}, chunk {c}"
    where = f"fpar.pipeline.place: stage {s}"
    f_at = seen.get(("F", j, c))
    if f_at is None:
        raise ScheduleError(f"{where}: the order never runs F of {what}.")
    has_bw, has_b, has_w = (("BW", j, c) in seen), (("B", j, c) in seen), (("W", j, c) in seen)
    if has_bw and (has_b or has_w):
        raise ScheduleError(f"{where}: {what} has both a BW and a split B/W backward; use one or the other.")
    if not has_bw and not (has_b and has_w):
        missing = "BW (or B and W)" if not (has_b or has_w) else ("W" if has_b else "B")
        raise ScheduleError(f"{where}: the order never runs {missing} of {what}.")
    first_back = seen[("BW", j, c)] if has_bw else seen[("B", j, c)]
    if first_back < f_at:
        raise ScheduleError(
            f"{where}, position {first_back}: the backward of {what} comes before its forward "
            f"(position {f_at})."
        )
    if has_w and seen[("W", j, c)] < seen[("B", j, c)]:
        raise ScheduleError(
            f"{where}, position {seen[('W', j, c)]}: W of {what} comes before its B "
            f"(position {seen[('B', j, c)]}); the weight gradient needs the output gradient B receives."
        )


def _asap(units: list[list[tuple]], p: int, v: int, layout: str) -> list[Action]:
    done: dict[tuple, int] = {}  # (kind, stage, mb, chunk) -> tick; "grad" for B or BW
    pos = [0] * p
    actions: list[Action] = []
    tick, left = 0, sum(len(o) for o in units)
    while left:
        ran = []
        for s in range(p):
            if pos[s] == len(units[s]):
                continue
            kind, j, c = units[s][pos[s]]
            if all(done.get(n, tick) < tick for n in needs(s, kind, j, c, p, v, layout)):
                ran.append((s, kind, j, c))
        if not ran:
            raise ScheduleError(_deadlock_message(units, pos, done, p, v, tick, layout))
        for s, kind, j, c in ran:
            done[(kind, s, j, c)] = tick
            if kind in ("B", "BW"):
                done[("grad", s, j, c)] = tick
            actions += _with_comm(Action(tick, s, kind, j, c), p, v, layout)
            pos[s] += 1
            left -= 1
        tick += 1
    return actions


def _with_comm(a: Action, p: int, v: int, layout: str) -> list[Action]:
    """The compute action and the sends/receives of what it produces, at the same tick."""
    out = [a]
    if a.kind == "F":
        nxt = next_stage(a.stage, a.chunk, p, v, layout)
        if nxt is not None:
            out += [
                Action(a.tick, a.stage, "SEND_F", a.microbatch, a.chunk),
                Action(a.tick, nxt[0], "RECV_F", a.microbatch, nxt[1]),
            ]
    elif a.kind in ("B", "BW"):
        prev = prev_stage(a.stage, a.chunk, p, v, layout)
        if prev is not None:
            out += [
                Action(a.tick, a.stage, "SEND_B", a.microbatch, a.chunk),
                Action(a.tick, prev[0], "RECV_B", a.microbatch, prev[1]),
            ]
    return out


def _deadlock_message(units, pos, done, p, v, tick, layout) -> str:
    lines = []
    for s in range(p):
        if pos[s] == len(units[s]):
            continue
        kind, j, c = units[s][pos[s]]
        waits = [n for n in needs(s, kind, j, c, p, v, layout) if n not in done]
        what = "; ".join(_wait_reason(n) for n in waits)
        lines.append(f"stage {s} waits to run {kind}(microbatch={j}, chunk={c}): {what}")
    return (
        f"fpar.pipeline.place: deadlock at tick {tick}: no stage can run its next action, so the "
        f"schedule never finishes. " + ". ".join(lines) + ". Reorder the stages' actions so every "
        "value is produced before it is needed."
    )


def _wait_reason(n: tuple) -> str:
    kind, s, j, c = n
    if kind == "F":
        return f"it needs the activation of microbatch {j} from stage {s} (chunk {c}), whose F has not run"
    if kind == "grad":
        return f"it needs the gradient of microbatch {j} from stage {s} (chunk {c}), whose B/BW has not run"
    return f"it needs its own B of microbatch {j} first"
