"""A pipeline step's time and bubble, predicted by replaying torch's own action lists with given stage times.

[Note: the pipeline simulator]
torch's schedule on stand-in stages (nothing runs) lists each rank's actions: F, I (input gradient), W, B (I then
W), overlapped F;B (their sum). One starts when its rank is free and its inputs exist: F(s, m) after F(s-1, m);
I/B(s, m) after I/B(s+1, m) and F(s, m); W after I; from another rank ``comm_ms`` later. Bubble: idle over busy
time, averaged over ranks (docs/pipeline.md). torch 2.13's ``Schedule1F1B`` lists the last rank's forwards one
microbatch late; they are read as the runtime runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace

from distwgrad.parallel.schedules import SCHEDULES, _schedule_name, check_pipeline_config, stage_placement

__all__ = ["StageTimes", "Prediction", "action_lists", "simulate", "analytic_bubble"]


@dataclass(frozen=True)
class StageTimes:
    """Milliseconds of one microbatch's forward, input gradient and weight gradient on one stage."""

    f: float
    i: float
    w: float

    def __post_init__(self) -> None:
        if min(self.f, self.i, self.w) < 0:
            raise ValueError(f"stage times must be >= 0, got {self}")


@dataclass(frozen=True)
class Prediction:
    schedule: str
    pp: int
    microbatches: int
    step_ms: float
    busy_ms: tuple[float, ...]  # per rank

    @property
    def bubble(self) -> float:
        """Idle time over busy time, averaged over ranks."""
        return sum(self.step_ms / b - 1 for b in self.busy_ms) / len(self.busy_ms)


def action_lists(schedule: str, pp: int, microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """torch's compute actions per rank as ``(kind, stage, microbatch)``, kind F, I, W or B (F;B split in two)."""
    from torch.distributed.pipelining.schedules import _ComputationType as C
    from torch.distributed.pipelining.schedules import get_schedule_class

    name = _schedule_name(schedule)
    per = check_pipeline_config(name, pp_size=pp, n_layers=pp * (1 if SCHEDULES[name] == "single" else 2),
                                n_microbatches=microbatches)
    n = pp * per
    stages = [SimpleNamespace(stage_index=s, num_stages=n, group_size=pp, group_rank=0, is_first=s == 0,
                              is_last=s == n - 1, submod=None, stage_index_to_group_rank=None)
              for s in stage_placement(name, 0, pp, per)]
    sched = get_schedule_class(name)(stages[0] if per == 1 else stages, microbatches, loss_fn=lambda o, t: o,
                                     scale_grads=False)
    kinds = {C.FORWARD: "F", C.BACKWARD_INPUT: "I", C.BACKWARD_WEIGHT: "W", C.FULL_BACKWARD: "B"}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in sched.pipeline_order.items():
        acts = []
        for a in actions:
            if a is None:
                continue
            parts = a.sub_actions if a.computation_type == C.OVERLAP_F_B else (a,)
            for p in parts:
                if p.computation_type in kinds:
                    acts.append((kinds[p.computation_type], p.stage_index, p.microbatch_index))
        out[rank] = acts
    if name == "1F1B":  # [Note: the pipeline simulator]: the last rank's forwards, as its runtime runs them
        last = out[pp - 1]
        if sorted(m for k, _, m in last if k == "F") == list(range(1, microbatches + 1)):
            out[pp - 1] = [(k, s, m - 1) if k == "F" else (k, s, m) for k, s, m in last]
    return out


def simulate(schedule: str, pp: int, microbatches: int, times: StageTimes | Mapping[int, StageTimes],
             comm_ms: float = 0.0) -> Prediction:
    """Replays ``schedule`` with ``times`` (for all stages, or per stage index), ``comm_ms`` per cross-rank send."""
    lists = action_lists(schedule, pp, microbatches)
    n_stages = pp * (1 if SCHEDULES[_schedule_name(schedule)] == "single" else 2)
    per_stage = {s: times for s in range(n_stages)} if isinstance(times, StageTimes) else dict(times)
    if sorted(per_stage) != list(range(n_stages)):
        raise ValueError(f"times must cover stages 0..{n_stages - 1}, got {sorted(per_stage)}")
    rank_of = {s: r for r, acts in lists.items() for _, s, _ in acts}
    done: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(lists, 0.0)
    busy = dict.fromkeys(lists, 0.0)
    pos = dict.fromkeys(lists, 0)

    def ready(kind: str, s: int, m: int) -> float | None:
        """When (kind, s, m)'s inputs exist on rank_of[s], or None if not yet known."""
        deps = []
        if kind == "F" and s > 0:
            deps.append(("F", s - 1, m))
        if kind in ("I", "B"):
            deps.append(("F", s, m))
            if s < n_stages - 1:
                deps.append(("I", s + 1, m) if ("I", s + 1, m) in done else ("B", s + 1, m))
        if kind == "W":
            deps.append(("I", s, m))
        t = 0.0
        for d in deps:
            if d not in done:
                return None
            t = max(t, done[d] + (comm_ms if rank_of[d[1]] != rank_of[s] else 0.0))
        return t

    remaining = sum(len(a) for a in lists.values())
    while remaining:
        progressed = False
        for r, acts in lists.items():
            while pos[r] < len(acts):
                kind, s, m = acts[pos[r]]
                t = ready(kind, s, m)
                if t is None:
                    break
                st = per_stage[s]
                dt = {"F": st.f, "I": st.i, "W": st.w, "B": st.i + st.w}[kind]
                end = max(clock[r], t) + dt
                done[(kind, s, m)] = end
                if kind == "B":  # a full backward is its input gradient too, for the stage before
                    done[("I", s, m)] = end
                clock[r], busy[r] = end, busy[r] + dt
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in lists.items() if pos[r] < len(acts)}
            raise RuntimeError(f"{schedule} at pp={pp}, {microbatches} microbatches: no rank can proceed ({stuck})")
    return Prediction(_schedule_name(schedule), pp, microbatches, max(clock.values()),
                      tuple(busy[r] for r in sorted(busy)))


def analytic_bubble(pp: int, microbatches: int) -> dict[str, float]:
    """The published bubbles (idle over busy, F = I = W): 1F1B's (p - 1) / m and ZB-H1's (p - 1) / (3 m)."""
    return {"1F1B": (pp - 1) / microbatches, "ZB-H1": (pp - 1) / (3 * microbatches)}


def table(layer: StageTimes, n_layers: int, comm_ms: float, pps=(2, 4, 8), micro=(4, 8, 16, 32),
          schedules=tuple(SCHEDULES)) -> str:
    """Markdown table of predicted bubbles for ``n_layers`` of ``layer``, cut evenly into stages, beside the bounds."""
    head = "| pp | m | " + " | ".join(schedules) + " | (p-1)/m | (p-1)/3m |"
    lines = [head, "|" + "---|" * (len(schedules) + 4)]
    for pp in pps:
        for m in micro:
            cells = []
            for name in schedules:
                n_stages = pp * (1 if SCHEDULES[_schedule_name(name)] == "single" else 2)
                if m < (2 * pp if _schedule_name(name) == "DualPipeV" else pp) or n_layers % n_stages:
                    cells.append("-")
                    continue
                k = n_layers // n_stages
                stage = StageTimes(k * layer.f, k * layer.i, k * layer.w)
                cells.append(f"{simulate(name, pp, m, stage, comm_ms).bubble:.3f}")
            a = analytic_bubble(pp, m)
            lines.append(f"| {pp} | {m} | " + " | ".join(cells) + f" | {a['1F1B']:.3f} | {a['ZB-H1']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m distwgrad.parallel.simulate",
                                description="Predicted pipeline bubbles from one layer's F, B and W milliseconds")
    p.add_argument("--layer-ms", type=float, nargs=3, metavar=("F", "B", "W"), required=True)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--comm-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    print(table(StageTimes(*args.layer_ms), args.layers, args.comm_ms))


if __name__ == "__main__":
    main()
