"""Bench's prompts replayed through the controller under any machine's cost curve, without
that machine: the Qwen pair's greedy answers to them are recorded once (the target's tokens,
and at each of them whether the draft model's argmax agreed and how sure it was), then each
draft mode is run again round by round on the recording, every round costing what the
curve says. Greedy verification keeps the drafts up to the first one that differs from the
recorded answer, so the replay is exact for copies, and exact for the draft model up to the
length of drafts that fail (it drafts from the true prefix; past a miss its tokens are wrong
and only their count matters).

    python tests/replay.py      # records tests/data/bench_answers.json (2 minutes on 2 cores, the Qwen pair)
    python tests/replay.py --out FILE --max-tokens N CLASS...    # some classes, shorter, elsewhere
    python tests/replay.py --trees 0.2 [CLASS...]    # what draft trees gain in auto mode, draft step 0.2
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from edgespec import Draft, Drafter, Engine, Model, Request, SamplingParams
from edgespec.bench import load_prompts
from edgespec.calibration import CostCurve
from edgespec.controller import Controller, Drafters
from edgespec.cost_curve import RollbackCost
from edgespec.costs import RoundCosts
from edgespec.drafters import CopyDrafter
from edgespec.drafters.base import MAX_SIBLINGS
from edgespec.modes import DraftMode, Gamma, Source
from edgespec.passes import decoded_alone
from edgespec.sampling import verify_tree_greedy
from edgespec.stats import RoundTiming

RECORDING = Path(__file__).with_name("data") / "bench_answers.json"
# V(k) in target steps, as calibrated: a slow 2-core AMD EPYC (Qwen2.5-Coder-1.5B at 12 tok/s:
# a pass of 8 costs almost what one of 16 does), an Intel Xeon with AMX, and a GPU (about flat)
CURVES = {
    "slow-epyc": {1: 1.0, 2: 1.75, 3: 2.17, 4: 3.04, 8: 7.4, 16: 8.0, 32: 22.2, 64: 36.9},
    "intel-amx": {1: 1.0, 4: 2.07, 16: 4.43, 64: 9.76},
    "gpu": {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8, 64: 2.8},
}
DRAFT_STEPS = (0.2, 0.46, 0.7)  # the draft model's step in target steps (0.46: the Qwen pair on a 2-core EPYC)
GREEDY = SamplingParams(temperature=0)
MAX_TOKENS = 256  # as bench answers


@dataclass(frozen=True)
class Recorded:
    """One bench class's greedy answer by the target, and the draft model at each token of it."""

    name: str
    prompt: list[int]
    prediction: list[int]  # the request's predicted output (tokens), if any
    answer: list[int]  # the target's greedy tokens, its end-of-generation token included if it wrote one
    draft_agrees: list[bool]  # at answer[i], given answer[:i]: the draft model's argmax is answer[i]
    draft_confidence: list[float]  # ... and the draft model's probability of its argmax there
    # for trees: the rank of answer[i] among the draft model's likeliest tokens there (0: its argmax;
    # MAX_SIBLINGS + 1: none of them), and their probabilities (a sibling is drafted by them)
    draft_ranks: list[int] | None = None
    draft_top: list[list[float]] | None = None


def record(engine: Engine, classes: list[str] | None = None, max_tokens: int = MAX_TOKENS) -> list[Recorded]:
    """The target's greedy answers to bench's prompts, with the draft model read along them."""
    draft_model = engine.draft_model
    out = []
    for prompt in load_prompts():
        if classes is not None and prompt["name"] not in classes or prompt.get("prediction_is_answer"):
            continue  # (a prediction that is the answer itself is made by bench as it runs)
        request = Request(
            prompt["text"],
            GREEDY,
            max_tokens=max_tokens,
            draft_mode=DraftMode.OFF,
            prediction=prompt.get("prediction"),
            json_schema=prompt.get("json_schema"),
        )
        tokens = engine.prompt_tokens(request)
        engine.forget()
        run = engine.start(request)
        answer = [event.token for event in engine.events(run) if not event.done]
        if run.stats.finish_reason == "stop" and not prompt.get("json_schema"):
            answer.append(engine.target.eos)  # (the loop does not hand out the end it stopped at)
        agrees, confidence, ranks, top = read_along(draft_model, tokens, answer)
        prediction = engine.target.tokenize(prompt["prediction"], add_special=False) if "prediction" in prompt else []
        out.append(
            Recorded(
                prompt["name"],
                tokens,
                prediction,
                answer,
                agrees,
                confidence,
                ranks,
                top,
            )
        )
    return out


def read_along(draft_model: Model, tokens: list[int], answer: list[int]):
    """The draft model at each token of `answer` after `tokens`: whether its argmax is the token,
    its probability, the token's rank among its MAX_SIBLINGS + 1 likeliest (that + 1: not among
    them) and their probabilities (see Recorded)."""
    draft_model.cache.truncate(0)
    draft_model.eval(tokens[:-1])
    logits = draft_model.eval(tokens[-1:] + answer[:-1], rows=len(answer))
    shifted = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, : MAX_SIBLINGS + 1]  # (ties: argmax's first)
    ranks = [
        next((r for r in range(MAX_SIBLINGS + 1) if row[r] == a), MAX_SIBLINGS + 1)
        for row, a in zip(top, answer, strict=True)
    ]
    return (
        [rank == 0 for rank in ranks],
        [round(float(p[row[0]]), 4) for p, row in zip(probs, top, strict=True)],
        ranks,
        [[round(float(x), 4) for x in p[row]] for p, row in zip(probs, top, strict=True)],
    )


def load(path: Path = RECORDING) -> list[Recorded]:
    return [Recorded(**entry) for entry in json.loads(path.read_text())]


def controller_on(
    mode: str,
    gamma: int | None,
    verify: CostCurve | None,
    draft_step: CostCurve | None,
    model: Drafter | None,
    copy: CopyDrafter,
    *,
    verify_rollback: RollbackCost | None = None,
    seed: int = 0,
    trees: bool = False,
) -> Controller:
    """A controller as the engine makes one, on these cost curves (verify None: no costs, for
    a fixed mode and draft length); trees: as on a target that verifies them."""
    costs = RoundCosts(verify, draft_step, verify_rollback) if verify is not None else None
    return Controller(DraftMode(mode), Gamma(gamma), costs, Drafters(copy, model), seed, trees=trees)


class RecordedDraftModel(Drafter):
    """The draft model as the recording saw it: drafts the answer's next tokens while its argmax
    agreed with the target, then wrong tokens; stops where its confidence says to (stop_below).
    Given branching, its next likeliest tokens are siblings where their confidence (weighed by
    the rank's trust) beats the cost, as Chain drafts them: the answer's token where it was of
    that rank, else a wrong one."""

    WRONG = -1  # a token no answer holds (-1 - rank: a wrong sibling)
    branches = True

    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    def draft(self, context, n, params, rng, stop_below=(), grammar=None, branching=None) -> Draft:
        at, r = len(context) - len(self.recorded.prompt), self.recorded
        tokens, parents, chances, chain, p_all, missed = [], [], [], [], 1.0, False  # chain: the nodes of its chain
        for i in range(at, min(at + n, len(r.answer))):
            if len(chain) < len(stop_below) and p_all * r.draft_confidence[i] < stop_below[len(chain)]:
                break
            right = not missed  # the context this position is drafted in is the answer's
            missed |= not r.draft_agrees[i]
            parent = chain[-1] if chain else -1
            chain.append(len(tokens))
            tokens.append(self.WRONG if missed else r.answer[i])
            parents.append(parent)
            chances.append(r.draft_confidence[i])
            for rank in range(1, MAX_SIBLINGS + 1) if branching is not None else ():
                chance = r.draft_top[i][rank]
                if p_all * chance * branching.trust[rank - 1] < branching.cost(len(tokens) + 1):
                    break
                tokens.append(r.answer[i] if right and r.draft_ranks[i] == rank else self.WRONG - rank)
                parents.append(parent)
                chances.append(chance)
            p_all *= r.draft_confidence[i]
        if len(chain) == len(tokens):
            return Draft(tokens, None, source=Source.MODEL)
        return Draft(tokens, None, source=Source.MODEL, parents=parents, chances=chances)


@dataclass(frozen=True)
class Replayed:
    """What a mode did on one recorded answer under one curve."""

    tokens: int
    steps: float  # target steps (V(1) = 1) the rounds cost
    rounds_by_source: dict[str, int]
    trees: int = 0  # rounds that verified a tree
    siblings: int = 0  # the draft model's siblings those trees held
    trust: dict[str, float] = field(default_factory=dict)  # per rank, as the controller learnt it (SiblingKey)

    @property
    def speedup(self) -> float:
        """tokens per target step: the ratio to the target alone."""
        return self.tokens / self.steps


def replay(
    recorded: Recorded,
    vocab: Model,
    mode: str,
    gamma: int | None,
    verify: dict[int, float],
    draft_step: float,
    seed: int = 0,
    trees: bool = False,
) -> Replayed:
    """One answer's rounds under `verify` (V(k) in target steps) with a draft step of `draft_step`
    target steps: the controller plans, the recording says what the target keeps, and every
    round takes exactly what the curves say. trees: the draft model may branch (as on a target
    that verifies trees), greedy verification descending the branch the answer takes."""
    draft_curve = CostCurve({1: draft_step, 2: 2 * draft_step})
    copy = CopyDrafter(vocab=vocab, prediction=recorded.prediction)
    drafter = RecordedDraftModel(recorded)
    controller = controller_on(mode, gamma, CostCurve(dict(verify)), draft_curve, drafter, copy, seed=seed, trees=trees)
    answer, seq = recorded.answer, list(recorded.prompt)
    decoded_alone(controller.begin(seq, room=MAX_TOKENS))
    steps, by_source, trees, siblings = 0.0, {}, 0, 0
    rng = np.random.default_rng(0)
    while (done := len(seq) - len(recorded.prompt)) < len(answer):
        plan = controller.plan(seq, len(answer) - done - 1)
        draft = decoded_alone(controller.draft(plan, seq, GREEDY, rng))
        written = answer[done:] + [RecordedDraftModel.WRONG]  # (past the answer's end: nothing matches)
        kept, _ = verify_tree_greedy(draft.tokens, draft.parents, partial(_at_depth, written, draft))
        n = len(kept)
        seq += answer[done : done + n + 1]
        made = draft.depth * draft_step if draft.source is Source.MODEL else 0.0
        timing = RoundTiming(draft=made, verify=controller.costs.verify_pass(len(draft.tokens) + 1))
        controller.observe(plan, draft, n, timing, seq, kept)
        steps += timing.total
        by_source[draft.source.value] = by_source.get(draft.source.value, 0) + 1
        trees += draft.parents is not None
        siblings += len(draft.tokens) - draft.depth if draft.source is Source.MODEL else 0
    trust = {str(key): learnt.trust for key, learnt in controller.siblings.items()}
    return Replayed(len(answer), steps, by_source, trees, siblings, trust)


def _at_depth(written: list[int], draft: Draft, row: int) -> int:
    """The target's greedy token at a row of the draft's verify pass, on the recorded answer's branch."""
    return written[min(depth(draft, row), len(written) - 1)]


def depth(draft: Draft, row: int) -> int:
    """How far past the context row `row` of a draft's verify pass is (row 0: the context's last
    token; row i + 1: node i, one deeper than its parent)."""
    if row == 0 or draft.parents is None:
        return row
    return 1 + depth(draft, draft.parents[row - 1] + 1)


@dataclass(frozen=True)
class TreeGain:
    """Auto with trees against auto with chains alone, on one class under one curve: tokens per
    target step of each (the mean cost over the controller's draws), and the rounds with a tree."""

    name: str
    curve: str
    draft_step: float
    chains: float
    trees: float
    tree_rounds: float  # per answer, over the draws

    @property
    def gain(self) -> float:
        return self.trees / self.chains


def tree_gains(vocab: Model, draft_step: float, seeds: int = 4, classes: list[str] | None = None) -> list[TreeGain]:
    """What trees gain in auto mode on every recorded class under each curve of CURVES."""
    out = []
    for recorded in load():
        if classes and recorded.name not in classes:
            continue
        for curve, points in CURVES.items():
            runs = {
                trees: [replay(recorded, vocab, "auto", None, points, draft_step, s, trees) for s in range(seeds)]
                for trees in (False, True)
            }
            rate = {
                trees: len(recorded.answer) / float(np.mean([r.steps for r in done])) for trees, done in runs.items()
            }
            rounds = float(np.mean([r.trees for r in runs[True]]))
            out.append(TreeGain(recorded.name, curve, draft_step, rate[False], rate[True], rounds))
    return out


def main() -> None:
    import argparse

    from edgespec import load as load_engine

    parser = argparse.ArgumentParser(description="Record the Qwen pair's greedy answers to bench's prompts.")
    parser.add_argument("classes", nargs="*", help="prompt classes (default: all)")
    parser.add_argument("--out", type=Path, default=RECORDING)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument(
        "--trees", type=float, metavar="DRAFT_STEP", help="print what trees gain in auto mode under each curve instead"
    )
    args = parser.parse_args()
    if args.trees is not None:
        from edgespec.resolve import resolve_model

        vocab = Model(resolve_model("qwen2.5-coder-1.5b"), n_ctx=256)
        gains = tree_gains(vocab, args.trees, classes=args.classes or None)
        vocab.close()
        print(f"{'class':<16}{'curve':<11}{'chains':>8}{'trees':>8}{'gain':>7}{'trees/answer':>14}")
        for g in gains:
            print(f"{g.name:<16}{g.curve:<11}{g.chains:>8.2f}{g.trees:>8.2f}{g.gain:>7.3f}{g.tree_rounds:>14.1f}")
        return
    with load_engine(progress=False) as qwen:
        recorded = record(qwen, args.classes or None, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([r.__dict__ for r in recorded]))


if __name__ == "__main__":
    main()
