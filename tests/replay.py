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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgespec import Draft, Drafter, Engine, Model, Request, SamplingParams
from edgespec.bench import load_prompts
from edgespec.calibration import CostCurve
from edgespec.controller import Controller, Drafters
from edgespec.cost_curve import RollbackCost
from edgespec.costs import RoundCosts
from edgespec.drafters import CopyDrafter
from edgespec.model import decoded_alone
from edgespec.modes import DraftMode, Gamma, Source
from edgespec.prompt_cache import common_prefix
from edgespec.stats import RoundTiming

RECORDING = Path(__file__).with_name("data") / "bench_answers.json"
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
        draft_model.truncate(0)
        draft_model.eval(tokens[:-1])
        logits = draft_model.eval(tokens[-1:] + answer[:-1], rows=len(answer))
        best = logits.argmax(axis=1)
        shifted = logits - logits.max(axis=1, keepdims=True)
        confidence = 1.0 / np.exp(shifted).sum(axis=1)
        prediction = engine.target.tokenize(prompt["prediction"], add_special=False) if "prediction" in prompt else []
        out.append(
            Recorded(
                prompt["name"],
                tokens,
                prediction,
                answer,
                [bool(b == a) for b, a in zip(best, answer, strict=True)],
                [round(float(c), 4) for c in confidence],
            )
        )
    return out


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
) -> Controller:
    """A controller as the engine makes one, on these cost curves (verify None: no costs, for
    a fixed mode and draft length)."""
    costs = RoundCosts(verify, draft_step, verify_rollback) if verify is not None else None
    return Controller(DraftMode(mode), Gamma(gamma), costs, Drafters(copy, model), seed)


class RecordedDraftModel:
    """The draft model as the recording saw it: drafts the answer's next tokens while its argmax
    agreed with the target, then wrong tokens; stops where its confidence says to (stop_below)."""

    WRONG = -1  # a token no answer holds
    model = None

    def __init__(self, recorded: Recorded) -> None:
        self.recorded = recorded

    def begin(self, prompt: list[int]) -> None:
        pass

    def accept(self, context: list[int]) -> None:
        pass

    def draft(self, context, n, params, rng, stop_below=(), grammar=None) -> Draft:
        at, r = len(context) - len(self.recorded.prompt), self.recorded
        tokens, p_all, missed = [], 1.0, False
        for i in range(at, min(at + n, len(r.answer))):
            p_all *= r.draft_confidence[i]
            if len(tokens) < len(stop_below) and p_all < stop_below[len(tokens)]:
                break
            missed |= not r.draft_agrees[i]
            tokens.append(self.WRONG if missed else r.answer[i])
        return Draft(tokens, None, source=Source.MODEL)


@dataclass(frozen=True)
class Replayed:
    """What a mode did on one recorded answer under one curve."""

    tokens: int
    steps: float  # target steps (V(1) = 1) the rounds cost
    rounds_by_source: dict[str, int]

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
) -> Replayed:
    """One answer's rounds under `verify` (V(k) in target steps) with a draft step of `draft_step`
    target steps: the controller plans, the recording says what the target keeps, and every
    round takes exactly what the curves say."""
    draft_curve = CostCurve({1: draft_step, 2: 2 * draft_step})
    copy = CopyDrafter(vocab=vocab, prediction=recorded.prediction)
    drafter = RecordedDraftModel(recorded)
    controller = controller_on(mode, gamma, CostCurve(dict(verify)), draft_curve, drafter, copy, seed=seed)
    answer, seq = recorded.answer, list(recorded.prompt)
    decoded_alone(controller.begin(seq, room=MAX_TOKENS))
    steps, by_source = 0.0, {}
    rng = np.random.default_rng(0)
    while (done := len(seq) - len(recorded.prompt)) < len(answer):
        plan = controller.plan(seq, len(answer) - done - 1)
        draft = decoded_alone(controller.draft(plan, seq, GREEDY, rng))
        n = common_prefix(draft.tokens, answer[done:], len(draft.tokens))
        seq += answer[done : done + n + 1]
        made = len(draft.tokens) * draft_step if draft.source is Source.MODEL else 0.0
        timing = RoundTiming(draft=made, verify=controller.costs.verify_pass(len(draft.tokens) + 1))
        controller.observe(plan, draft, n, timing, seq)
        steps += timing.total
        by_source[draft.source.value] = by_source.get(draft.source.value, 0) + 1
    return Replayed(len(answer), steps, by_source)


def main() -> None:
    import argparse

    from edgespec import load as load_engine

    parser = argparse.ArgumentParser(description="Record the Qwen pair's greedy answers to bench's prompts.")
    parser.add_argument("classes", nargs="*", help="prompt classes (default: all)")
    parser.add_argument("--out", type=Path, default=RECORDING)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    with load_engine(progress=False) as qwen:
        recorded = record(qwen, args.classes or None, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([r.__dict__ for r in recorded]))


if __name__ == "__main__":
    main()
