"""Statistics of a generation: one type, written in one place (the decode loop), read
by every shell (the command line, the server, the chat app, bench) through as_dict()
or its fields."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from time import perf_counter

import numpy as np

from .cost_curve import expected_tokens
from .modes import Source

DERIVED = (
    "acceptance_rate",
    "tokens_per_round",
    "tokens_per_s",
    "other_s",
    "mean_gamma",
    "expected_tokens_per_round",
    "drafting_share",
    "measured_speedup",
    "accepted_prediction_tokens",
    "rejected_prediction_tokens",
    "tokens_by_source",
    "mean_tree_size",
)
SUMMED = (
    "n_prompt",
    "n_prompt_cached",
    "rounds",
    "drafted",
    "accepted",
    "tree_rounds",
    "tree_drafted",
    "n_tokens",
    "prefill_s",
    "first_token_s",
    "decode_s",
    "draft_s",
    "verify_s",
    "rollback_s",
    "rounds_s",
    "plain_s",
    "recall_s",
    "known_tokens",
)
# what combine() takes from the first generation: the machine's settings, not counts
SETTINGS = ("flash_attn", "repack", "rollback", "checkpoint_steps", "restore_steps", "calibration_stale")
SUMMED_BY_SOURCE = ("rounds_by_source", "drafted_by_source", "accepted_by_source")
LOOPING = 64  # an answer ending in this many repeated tokens is worth saying so
MAX_PERIOD = 256  # the longest repeated span looked for


def trailing_repeat(tokens) -> tuple[int, int]:
    """(tokens, period): the longest stretch at the end of `tokens` made of one span of `period`
    tokens written at least twice in a row, first copy included; (0, 0) if there is none."""
    out = np.asarray(tokens)
    best = (0, 0)
    for period in range(1, min(MAX_PERIOD, len(out) // 2) + 1):
        same = (out[period:] == out[:-period])[::-1]
        run = len(same) if same.all() else int(np.argmin(same))  # repeats, counted from the end
        if run >= period and run + period > best[0]:
            best = (run + period, period)
    return best


@dataclass(frozen=True)
class RoundTiming:
    """Seconds one round of draft -> verify took, by part."""

    draft: float  # making the draft
    verify: float  # the target's batched pass, accept/resample
    rollback: float = 0.0  # on a recurrent target: its checkpoint, and after a rejection, its restore
    rereads: int = 0  # tokens a restore left to this round's pass, beside its own (they were kept, then cut)
    beside: tuple[tuple[int, int], ...] = ()  # (sequence, tokens) of other requests' passes decoded with its own

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.rollback


class RoundClock:
    """Where a round's time goes: each mark() charges a part (draft, verify, rollback, or one left
    out) with the time since the last mark, or with `own` seconds where other runs' steps came
    between (the part's passes waited for theirs: that time is theirs)."""

    PARTS = ("draft", "verify", "rollback")

    def __init__(self) -> None:
        self.last = perf_counter()
        self.spent = dict.fromkeys(self.PARTS, 0.0)

    def mark(self, part: str | None, own: float | None = None) -> None:
        """part None: time that is not the round's (log-probabilities read for the caller)."""
        now = perf_counter()
        if part is not None:
            self.spent[part] += now - self.last if own is None else own
        self.last = now

    @property
    def own(self) -> float:
        """The round's own seconds, all parts."""
        return sum(self.spent.values())

    def timing(self, rereads: int, beside: tuple[tuple[int, int], ...]) -> RoundTiming:
        return RoundTiming(self.spent["draft"], self.spent["verify"], self.spent["rollback"], rereads, beside)


@dataclass(frozen=True)
class RoundReport:
    """One round as the controller saw it: what it drafted (from `source`) and kept, its times,
    and the controller's view after it."""

    source: Source
    drafted: int
    accepted: int
    timing: RoundTiming
    alpha_by_source: dict[str, float]  # the acceptance rate learnt per drafter (and copy evidence level)
    predicted_speedup: float  # over the target alone, by the plans so far
    plain_step_s: float  # what a round without a draft takes now (0: rounds not planned by cost)
    tree: bool = False  # its drafts were a tree (several candidates somewhere), verified in one pass
    recall_s: float = 0.0  # of its draft time: looking the context's end up in the memory


@dataclass
class Stats:
    """Running statistics of one generation (updated in place while it streams)."""

    mode: str  # "speculative" or "target-only"
    gamma: int | str  # the requested draft length, or "auto"
    draft_mode: str = "off"  # requested: auto, model, copy, hybrid or off
    n_prompt: int = 0  # prompt tokens
    n_prompt_cached: int = 0  # of those, reused from the KV cache of the previous request
    rounds: int = 0  # target forward passes after prefill
    drafted: int = 0
    accepted: int = 0
    tree_rounds: int = 0  # rounds whose drafts were a tree (their drafted tokens count every node)
    tree_drafted: int = 0  # the nodes of those trees
    known_tokens: int = 0  # drawn from rows an earlier answer to the prompt computed, no pass (known_rows.py)
    n_tokens: int = 0  # tokens generated (prompt excluded)
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # start -> the first answer token: the prefill and the first round
    decode_s: float = 0.0  # end of prefill -> last token
    draft_s: float = 0.0  # of decode_s: making drafts
    verify_s: float = 0.0  # of decode_s: the target's batched forward + accept/resample
    rollback_s: float = 0.0  # of decode_s: cutting a recurrent target's state back (checkpoints, restores)
    rounds_s: float = 0.0  # the rounds' whole time, planning and learning included (not the caller's between them)
    plain_s: float = 0.0  # of rounds_s: the rounds that drafted nothing, each a plain step of the target
    recall_s: float = 0.0  # of draft_s: looking the context's end up in the memory (every round, drafted or not)
    # stop | stop_string | length | context; an editor's stops: indent | deadline (see Request);
    # cancelled (stopped from outside: a client gone)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended the answer (finish_reason stop_string)
    # what the controller chose: rounds per source ("model", "copy", "prediction", "off"), draft
    # tokens proposed and accepted per source, its α per drafter, its last choice, and the
    # speedup over the target alone that its cost model predicted
    rounds_by_source: dict[str, int] = field(default_factory=dict)
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    alpha_by_source: dict[str, float] = field(default_factory=dict)
    last_source: str = Source.OFF
    last_gamma: int = 0
    predicted_speedup: float = 1.0
    # the target alone's rate now, what measured_speedup is against: without plain rounds in this
    # generation, the calibrated step as this generation's rounds ran against their plan (0: no calibration)
    baseline_tokens_per_s: float = 0.0
    # why the calibration could not be timed again when it was due ("": it was, or none was due):
    # its curves are older than they should be (the engine's thread tries again, backing off)
    calibration_stale: str = ""
    flash_attn: bool = False  # whether the target runs with flash attention
    repack: bool = True  # whether the target's weights are repacked for llama.cpp's extra CPU kernels (kernels.py)
    # how the target's cache is cut back after a rejection (model.Rollback: truncate, snapshots,
    # checkpoints) and what the calibration says a checkpoint and a restore cost, in target steps:
    # on a recurrent model that is why auto may leave speculation off
    rollback: str = "truncate"
    checkpoint_steps: float = 0.0
    restore_steps: float = 0.0
    # the answer's last stretch of tokens that repeats one span over and over (0: none), and the
    # span's length: a model looping (under a forced tool call, say) shows here
    repeated_tokens: int = 0
    repeat_period: int = 0
    # token healing (healing.py): the bytes taken back from the prompt's end, which the answer wrote again
    healed_bytes: int = 0

    @property
    def accepted_prediction_tokens(self) -> int:
        """Tokens drafted from the prediction that the target kept (as OpenAI's usage reports them)."""
        return self.accepted_by_source.get(Source.PREDICTION, 0)

    @property
    def rejected_prediction_tokens(self) -> int:
        """Tokens drafted from the prediction that the target verified and rejected."""
        return self.drafted_by_source.get(Source.PREDICTION, 0) - self.accepted_prediction_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def mean_tree_size(self) -> float:
        """Nodes per tree, over the rounds that verified one (0: none)."""
        return self.tree_drafted / self.tree_rounds if self.tree_rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_gamma(self) -> float:
        """Draft length over the rounds that drafted."""
        drafting = self.rounds - self.rounds_by_source.get(Source.OFF, 0)
        return self.drafted / drafting if drafting else 0.0

    @property
    def expected_tokens_per_round(self) -> float:
        """E[n] that the measured α predicts for the mean draft length."""
        return expected_tokens(self.acceptance_rate, round(self.mean_gamma)) if self.mean_gamma else 1.0

    @property
    def measured_speedup(self) -> float:
        """The rounds' tokens per second against the target alone's now (0 if not calibrated): its
        plain steps in this generation when there are any (all plain: 1.00), else baseline_tokens_per_s."""
        plain = self.rounds_by_source.get(Source.OFF, 0)
        baseline = plain / self.plain_s if plain and self.plain_s > 0 else self.baseline_tokens_per_s
        if not baseline or self.rounds_s <= 0:
            return 0.0
        return (self.accepted + self.rounds) / self.rounds_s / baseline

    @property
    def other_s(self) -> float:
        return max(self.decode_s - self.draft_s - self.verify_s - self.rollback_s, 0.0)

    @property
    def drafting_share(self) -> float:
        """Of the rounds, the share that drafted."""
        return (self.rounds - self.rounds_by_source.get(Source.OFF, 0)) / self.rounds if self.rounds else 0.0

    @property
    def tokens_by_source(self) -> dict[str, int]:
        """Where the answer's tokens came from: each drafter's accepted drafts, and the target."""
        return dict(self.accepted_by_source) | {"target": self.n_tokens - self.accepted}

    def record(self, report: RoundReport, seconds: float) -> None:
        """One round of draft -> verify; `seconds`: all of it (planning and learning included)."""
        source = str(report.source)  # (its plain name, as JSON and the shells show it)
        self.rounds += 1
        self.rounds_s += seconds
        if source == Source.OFF:
            self.plain_s += seconds
        self.baseline_tokens_per_s = 1.0 / report.plain_step_s if report.plain_step_s > 0 else 0.0
        self.drafted += report.drafted
        self.accepted += report.accepted
        if report.tree:
            self.tree_rounds += 1
            self.tree_drafted += report.drafted
        self.draft_s += report.timing.draft
        self.verify_s += report.timing.verify
        self.rollback_s += report.timing.rollback
        self.recall_s += report.recall_s
        self.rounds_by_source[source] = self.rounds_by_source.get(source, 0) + 1
        if report.drafted:
            self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + report.drafted
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + report.accepted
        self.alpha_by_source = report.alpha_by_source
        self.last_source, self.last_gamma = source, report.drafted
        self.predicted_speedup = report.predicted_speedup

    def as_dict(self) -> dict:
        """The one JSON view of the statistics (the command line's --json, the server's
        `speculative` object, bench): every field and every derived figure."""
        return asdict(self) | {name: getattr(self, name) for name in DERIVED}

    @classmethod
    def combine(cls, many: Sequence[Stats]) -> Stats:
        """Several generations' statistics as one (counts, times and per-source counts
        summed; the settings of the first): what bench reports per mode."""
        total = cls(mode=many[0].mode, gamma=many[0].gamma, draft_mode=many[0].draft_mode)
        for stats in many:
            for name in SUMMED:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
            for name in SUMMED_BY_SOURCE:
                mine = getattr(total, name)
                for source, n in getattr(stats, name).items():
                    mine[source] = mine.get(source, 0) + n
        for name in SETTINGS:
            setattr(total, name, getattr(many[0], name))
        return total

    def summary(self) -> str:
        line = f"{self.n_tokens} tokens, {self.tokens_per_s:.2f} tok/s"
        if self.mode == "speculative":
            line += (
                f", acceptance {self.acceptance_rate:.0%}, {self.tokens_per_round:.2f} tokens/round"
                f" (mode {self.draft_mode}, gamma {self.gamma})"
            )
            if self.baseline_tokens_per_s:
                chosen = ", ".join(f"{k} {v}" for k, v in sorted(self.rounds_by_source.items()))
                line += (
                    f", rounds: {chosen}; speedup predicted {self.predicted_speedup:.2f}x,"
                    f" measured {self.measured_speedup:.2f}x"
                )
            if self.drafted_by_source.get(Source.PREDICTION):
                line += (
                    f", prediction tokens accepted {self.accepted_prediction_tokens},"
                    f" rejected {self.rejected_prediction_tokens}"
                )
        line += f", flash attention {'on' if self.flash_attn else 'off'}, repack {'on' if self.repack else 'off'}"
        if self.rollback != "truncate":
            line += f", rollback by {self.rollback}"
            if self.checkpoint_steps or self.restore_steps:
                line += f" (checkpoint {self.checkpoint_steps:.2f}, restore {self.restore_steps:.2f} target steps)"
        if self.calibration_stale:
            line += f", calibration not renewed ({self.calibration_stale})"
        if self.repeated_tokens >= LOOPING:
            line += f", the last {self.repeated_tokens} tokens repeat a {self.repeat_period}-token span"
        rollback = f", rollback {self.rollback_s:.2f}s" if self.rollback != "truncate" else ""
        if self.known_tokens:
            line += f", {self.known_tokens} tokens drawn from an earlier answer's rows"
        if self.recall_s:
            rollback += f", memory lookups {self.recall_s * 1e3:.1f}ms"
        split = f"draft {self.draft_s:.2f}s, verify {self.verify_s:.2f}s{rollback}, other {self.other_s:.2f}s"
        return (
            f"{line}, {self.rounds} rounds, prefill {self.prefill_s:.2f}s, first token {self.first_token_s:.2f}s,"
            f" decode {self.decode_s:.2f}s ({split})"
        )
