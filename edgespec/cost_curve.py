"""V(k), the seconds one forward pass over k tokens costs: a pure curve of measured
points (calibration.py measures them and keeps them in the store)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

SMOOTH_UP_TO = 8  # below this V(k) is close to linear: any k may be planned, interpolated
MAX_K = 65  # up to a 64-token copy draft plus the token before it
DRIFT_WEIGHT = 0.05  # weight of one real round in the whole curve's scale (the machine's speed drifts)
POINT_WEIGHT = 0.25  # ... and in the point it measured
RECHECK_S = 600.0  # measure a point again when it is older than this
# a pass over k tokens costs at most k single steps (measured here: 1.9 for 2, 6.95 for 8);
# a time above this bound was disturbed by other load
BATCH_SLACK = 1.1


class CostCurve:
    """Seconds for one forward pass over k tokens of one model: measured points,
    linear in between, the last slope beyond."""

    def __init__(self, points: dict[int, float], checked: dict[int, float] | None = None) -> None:
        self.points: dict[int, float] = {}
        self._table: np.ndarray | None = None  # V(0..MAX_K), rebuilt after a change (V is read many times a round)
        for k in sorted(points):  # the single step first: it bounds the others
            self._set(k, points[k])
        now = time.time()
        self.checked = {k: now for k in points} if checked is None else dict(checked)  # when each was timed

    def _set(self, k: int, seconds: float) -> None:
        self.points[k] = min(seconds, pass_bound(k, self.points[1])) if k != 1 and 1 in self.points else seconds
        self._table = None

    def _scale(self, factor: float) -> None:
        for k in self.points:
            self.points[k] *= factor
        self._table = None

    def __call__(self, k: int) -> float:
        if self._table is None:
            ks = sorted(self.points)
            # a pass over more tokens never costs less than one over fewer: a point timed
            # below a smaller one was timed on a quieter moment, and is read as that one
            values = np.maximum.accumulate([self.points[x] for x in ks]).tolist()
            if len(ks) == 1:
                ks, values = [0, *ks], [0.0, *values]  # one point: proportional
            slope = (values[-1] - values[-2]) / (ks[-1] - ks[-2])
            k_all = np.arange(MAX_K + 1)
            self._table = np.where(k_all <= ks[-1], np.interp(k_all, ks, values), values[-1] + slope * (k_all - ks[-1]))
        return float(self._table[min(k, MAX_K)])

    def sizes(self, limit: int) -> list[int]:
        """Pass sizes worth planning, up to `limit`: any small one, else only known points."""
        return [k for k in range(1, min(limit, MAX_K) + 1) if k <= SMOOTH_UP_TO or k in self.points]

    def best_rate(self) -> tuple[float, int]:
        """The ceiling a perfect free drafter reaches: max over k of k / V(k), in target steps."""
        return max((k * self(1) / self(k), k) for k in self.sizes(MAX_K))

    def observe(self, k: int, seconds: float) -> None:
        """Fold in a real round's timing: a little into the whole curve (the machine's
        speed drifts for all k together), more into the point itself (its own shape),
        except for the single step: it is the unit the others are counted in, so a
        passing slowdown of single steps alone must not make passes look cheap.
        Clipped, so one outlier (a page fault) moves it little."""
        k = min(k, MAX_K)
        ratio = min(max(seconds / self(k), 0.5), 2.0)
        self._scale(1 + DRIFT_WEIGHT * (ratio - 1))
        if k != 1:  # a size the curve only interpolated becomes a point of its own
            self._set(k, self(k) * (1 + POINT_WEIGHT * (ratio - 1)))
            self.checked.setdefault(k, time.time())

    def recheck(self, step: float, k: int, seconds: float) -> None:
        """Fold in fresh timings of a single step and of a pass over k tokens, taken under
        the same load. The step sets the scale of the whole curve, the pass its point's
        ratio to the step (the curve's shape): each taken at once when lower (other load
        only ever adds time: the old figure was measured on a busy machine), halfway when
        higher (the machine may have become slower, or be busy now)."""
        now = time.time()
        self._scale(_toward(self.points[1], step) / self.points[1])
        self.checked[1] = now
        if k != 1 and not math.isnan(seconds):  # NaN: no room left in the context for the pass
            self._set(k, self.points[1] * _toward(self(k) / self.points[1], seconds / step))
            self.checked[k] = now

    def mark_stale(self) -> None:
        """Every point is due for a re-check (the curve was found to be measured on a busy machine)."""
        self.checked = {k: 0.0 for k in self.points}

    def due(self) -> int | None:
        """The point to time again now, with a single step (its unit): the one checked
        longest ago, once that is older than RECHECK_S; else None. One point per answer
        keeps each re-check short; a stale curve is renewed over a few answers."""
        stalest = min(self.points, key=lambda k: (self.checked.get(k, 0.0), k == 1))
        return stalest if time.time() - self.checked.get(stalest, 0.0) > RECHECK_S else None

    def to_json(self) -> dict:
        return {"points": _str_keys(self.points), "checked": _str_keys(self.checked)}

    @classmethod
    def from_json(cls, data: dict) -> CostCurve:
        return cls(
            {int(k): float(v) for k, v in data["points"].items()},
            {int(k): float(v) for k, v in data["checked"].items()},
        )


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens/round] = (1 - α^(γ+1)) / (1 - α): accepted drafts plus the one the target adds."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass(frozen=True)
class RollbackCost:
    """What a round costs beyond its passes on a model whose recurrent state cannot be cut
    back (model.Rollback): a checkpoint before the pass, and after a rejection a restore and
    the kept tokens evaluated again, beside the next pass's own token (V(kept + 1) - V(1)).
    Passes of up to `snapshots` + 1 tokens need neither (llama.cpp's snapshots; a draft model
    has none). Measured by calibration.measure_rollback."""

    checkpoint_s: float
    restore_s: float
    snapshots: int = 0

    def of_round(self, gamma: int, accepted: int, V: Callable[[int], float]) -> float:
        """The extra seconds of a round that verified `gamma` draft tokens and kept `accepted`."""
        if gamma <= self.snapshots:
            return 0.0
        return self.checkpoint_s + (self.restore_s + V(accepted + 2) - V(1) if accepted < gamma else 0.0)

    def expected(self, gamma: int, alpha: float, V: Callable[[int], float]) -> float:
        """of_round's expectation when each draft token is accepted with probability alpha
        (the first rejection at token i has probability alpha^i (1 - alpha))."""
        if gamma <= self.snapshots:
            return 0.0
        rejected = sum(alpha**i * (1 - alpha) * (self.restore_s + V(i + 2) - V(1)) for i in range(gamma))
        return self.checkpoint_s + rejected

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RollbackCost:
        return cls(float(data["checkpoint_s"]), float(data["restore_s"]), int(data["snapshots"]))


@dataclass(frozen=True)
class BatchSpread:
    """What a pass costs beyond V(k) when its k rows lie in several sequences (a server's
    requests decoded together) rather than one: factors[n] = W(n) / V(n), W(n) the pass of
    one token in each of n sequences. Each sequence has cells of its own (model.py), so
    llama.cpp computes attention per sequence: more, smaller operations. Measured by
    calibration.measure_spread (a 2-core EPYC, Qwen 1.5B: 1.02 for 2, 1.04 for 4 at a 16-token
    cache; 1.04 and 1.07 at 400); linear in between, the last factor beyond."""

    factors: dict[int, float]
    _knots: tuple[list[int], list[float]] = field(init=False, repr=False, compare=False)  # read every round

    def __post_init__(self) -> None:
        known = sorted(k for k in self.factors if k > 1)
        object.__setattr__(self, "_knots", ([1, *known], [1.0, *(self.factors[k] for k in known)]))

    def __call__(self, sequences: int) -> float:
        sizes, factors = self._knots
        if sequences <= 1 or len(sizes) == 1:
            return 1.0
        return float(np.interp(sequences, sizes, factors))

    def to_json(self) -> dict:
        return {"factors": _str_keys(self.factors)}

    @classmethod
    def from_json(cls, data: dict) -> BatchSpread:
        return cls({int(k): float(v) for k, v in data["factors"].items()})


UNSPREAD = BatchSpread({})  # not measured (one sequence, a recurrent model): as one sequence's


def pass_bound(k: int, step: float) -> float:
    """The most a pass over k tokens can cost: k single steps (and the slack)."""
    return k * step * BATCH_SLACK


def _toward(old: float, new: float) -> float:
    return new if new < old else (old + new) / 2


def _str_keys(d: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in d.items()}
