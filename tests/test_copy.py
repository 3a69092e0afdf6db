"""The copy drafter (prompt lookup, edits, predicted outputs): alignment on token lists,
renames on a real tokenizer, and exactness through the engine on real SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_sampled_match, with_a_word_changed
from reference import assert_greedy_as_llama, chi_square_pvalue, law_after

from edgespec import Engine, SamplingParams
from edgespec.drafters import CopyDrafter
from edgespec.drafters.copy import Conversation

# --- alignment on token lists ---------------------------------------------------


def follow_and_draft(drafter: CopyDrafter, context: list[int], n: int):
    """As the controller does each round: the drafter follows what the target wrote, then drafts."""
    drafter.accept(context)
    return drafter.draft(context, n)


def test_anchors_on_the_longest_match_and_follows_the_target():
    drafter = CopyDrafter(sizes=(4, 2))
    context = [1, 2, 3, 4, 5, 6, 9, 3, 4, 7, 8, 1, 2, 3, 4]
    draft = follow_and_draft(drafter, context, 10)
    assert draft.tokens == [5, 6, 9, 3, 4, 7, 8, 1, 2, 3] and draft.q is None  # the 4-gram wins over "3 4 -> 7"
    assert draft.source == "copy" and drafter.alignments[0].evidence == 4
    # the target took two of them: the pointer moves along, no new lookup
    assert follow_and_draft(drafter, context + [5, 6], 3).tokens == [9, 3, 4] and drafter.alignments[0].evidence == 6


def test_never_matches_the_context_suffix_itself_and_starts_over_on_a_new_context():
    drafter = CopyDrafter(sizes=(3,))
    assert follow_and_draft(drafter, [1, 2, 3], 5).tokens == []
    assert follow_and_draft(drafter, [1, 2, 3, 9, 1, 2, 3], 5).tokens == [9, 1, 2, 3]
    assert follow_and_draft(drafter, [7, 7, 7, 8, 1, 2, 3], 5).tokens == []  # the old conversation's n-grams are gone
    assert follow_and_draft(drafter, [7, 7, 7, 8, 1, 2, 3, 7, 7, 7], 5).tokens == [8, 1, 2, 3, 7]


SOURCE = [10, 11, 12, 13, 14, 15, 16, 7, 17, 18, 19, 20, 7, 21, 22]  # token 7 is an identifier, used twice
PROMPT = SOURCE + [99]


def test_reanchors_next_to_an_edit_and_carries_the_substitution_forward():
    drafter = CopyDrafter(sizes=(3,))
    context = PROMPT + [10, 11, 12]
    drafter.begin(context)
    assert follow_and_draft(drafter, context, 12).tokens == SOURCE[3:]
    context += [13, 14, 15, 16, 50]  # the target renamed 7 to 50: the pointer is lost
    assert follow_and_draft(drafter, context, 64).tokens == []  # nothing near matches 50
    context += [17]  # the target is back on the source, one token after the edit
    draft = follow_and_draft(drafter, context, 64)
    assert draft.tokens[:7] == [18, 19, 20, 50, 21, 22, 99]  # the rename, learnt, is applied further on


def test_a_substitution_the_target_disagrees_with_is_forgotten():
    drafter = CopyDrafter(sizes=(3,))
    context = PROMPT + [10, 11, 12]
    drafter.begin(context)
    follow_and_draft(drafter, context, 64)
    context += [13, 14, 15, 16, 50, 17]
    follow_and_draft(drafter, context, 64)
    context += [18, 19, 20, 7]  # this time the target kept 7
    assert follow_and_draft(drafter, context, 3).tokens == [21, 22, 99] and drafter.alignments[0].pos is not None
    drafter = CopyDrafter(sizes=(3,), conversation=drafter.conversation)  # a new request starts clean
    drafter.begin(PROMPT + [10, 11, 12])
    assert follow_and_draft(drafter, PROMPT + [10, 11, 12], 12).tokens == SOURCE[3:]


def test_a_prediction_is_drafted_from_its_start_and_found_again_after_a_preamble():
    prediction = [30, 31, 32, 33, 34, 35, 36, 37]
    drafter = CopyDrafter(prediction=prediction, sizes=(3,))
    context = [1, 2, 3]
    drafter.begin(context)
    draft = follow_and_draft(drafter, context, 4)
    assert (draft.tokens, draft.source) == ([30, 31, 32, 33], "prediction")
    context += [5, 6, 30]  # a short preamble, then the prediction's first token
    draft = follow_and_draft(drafter, context, 64)
    assert (draft.tokens, draft.source) == (prediction[1:], "prediction")
    drafter = CopyDrafter(sizes=(3,))  # the next request has none
    drafter.begin([1, 2, 3])
    assert follow_and_draft(drafter, [1, 2, 3], 4).tokens == []


def test_the_context_and_the_prediction_both_draft_every_round():
    """Each source keeps its own alignment, and each drafts what it says comes next: the
    controller weighs the two (the prediction's after it parted from the answer is found again)."""
    prediction = [40, 41, 42, 50, 51, 52, 53]
    drafter = CopyDrafter(prediction=prediction, sizes=(3,))
    context = [1, 2, 3, 40, 41, 42, 43, 44, 45, 9]
    drafter.begin(context)
    [opening] = drafter.lookups(4)  # the context has no match yet; the prediction, from its start
    assert (opening.draft.tokens, opening.draft.source, opening.evidence) == ([40, 41, 42, 50], "prediction", 16)
    context += [40, 41, 42]  # both agree so far
    lookups = {lookup.draft.source: lookup.draft.tokens for lookup in follow_and_draft_all(drafter, context, 3)}
    assert lookups == {"copy": [43, 44, 45], "prediction": [50, 51, 52]}
    context += [43, 44]  # the answer repeats the prompt: the prediction is lost, the context's copy goes on
    lookups = {lookup.draft.source: lookup.draft.tokens for lookup in follow_and_draft_all(drafter, context, 3)}
    assert lookups == {"copy": [45, 9, 40]}
    context += [50, 51]  # ... and comes back to the prediction, which is found again nearby
    lookups = {lookup.draft.source: lookup.draft.tokens for lookup in follow_and_draft_all(drafter, context, 3)}
    assert lookups["prediction"] == [52, 53]


def follow_and_draft_all(drafter: CopyDrafter, context: list[int], n: int):
    drafter.accept(context)
    return drafter.lookups(n)


def test_a_prediction_quoted_in_a_fence_gains_the_fence(smollm2):
    """An edit request quotes the file in a fenced block; the answer opens with the same fence."""
    code = "def area(w, h):\n    return w * h\n"
    prompt = smollm2.tokenize(f"Rename area to surface.\n\n```python\n{code}```\n", add_special=False)
    drafter = CopyDrafter(vocab=smollm2, prediction=smollm2.tokenize(code, add_special=False))
    drafter.begin(prompt)
    [lookup] = drafter.lookups(64)
    text = b"".join(map(smollm2.piece, lookup.draft.tokens)).decode()
    assert text == f"```python\n{code}"
    plain = CopyDrafter(vocab=smollm2, prediction=smollm2.tokenize(code, add_special=False))
    plain.begin(smollm2.tokenize("Write a function.", add_special=False))  # not quoted: as given
    assert b"".join(map(smollm2.piece, plain.lookups(64)[0].draft.tokens)).decode() == code


# --- renames on a real tokenizer ---------------------------------------------------

MODULE = """def load_items(rows):
    items = []
    for row in rows:
        items.append(row.strip())
    return items


def count_items(items):
    total = 0
    for item in items:
        total += item.count
    return total
"""


def replay_rounds(drafter: CopyDrafter, prompt: list[int], output: list[int]) -> list[tuple[int, int]]:
    """Greedy rounds against a known output: (drafted, accepted) per round."""
    context, rounds = list(prompt), []
    drafter.begin(context)
    while len(context) < len(prompt) + len(output):
        done = len(context) - len(prompt)
        draft = follow_and_draft(drafter, context, 64).tokens
        truth, accepted = output[done:], 0
        while accepted < min(len(draft), len(truth)) and draft[accepted] == truth[accepted]:
            accepted += 1
        rounds.append((len(draft), accepted))
        context += output[done : done + accepted + 1]
    return rounds


def test_a_rename_is_carried_over_to_every_token_it_appears_in(smollm2):
    prompt = smollm2.tokenize(f"Rename items to records:\n{MODULE}", add_special=False)
    output = smollm2.tokenize(MODULE.replace("item", "record"), add_special=False)
    with_vocab = replay_rounds(CopyDrafter(vocab=smollm2), prompt, output)
    without = replay_rounds(CopyDrafter(), prompt, output)
    # the first edit is learnt, then ` items`, `_items` and ` item` are all drafted renamed
    assert len(with_vocab) < len(without)
    assert sum(a for _, a in with_vocab) >= 0.8 * len(output)


# --- through the engine, on real SmolLM2 ---------------------------------------------

EDIT = "Repeat this list exactly, twice: apple, banana, cherry, date, elderberry, fig, grape."


FRUITS = "apple, banana, cherry, date, elderberry, fig, grape.\n" * 2 + "apple,"  # (raw: a list going on)


def test_copy_greedy_equals_no_draft(smollm2):
    """(A raw list that goes on: the chat prompt EDIT is repeated on an AMX Xeon, and answered in
    other words on a 2-core AMD EPYC, whose kernels round otherwise.)"""
    engine = Engine(smollm2, None, gamma=8, draft_mode="copy")
    spec = engine.generate(FRUITS, temperature=0, max_tokens=60, raw=True)
    assert spec.stats.rounds_by_source.get("copy", 0) > 0 and spec.stats.accepted > 0
    assert_greedy_as_llama("copy", engine, FRUITS, spec.tokens, raw=True, limit=60)


@pytest.mark.parametrize("mode", ["auto", "copy"])
def test_a_prediction_changes_the_speed_not_the_answer(smollm2, mode):
    engine = Engine(smollm2, None, draft_mode=mode, gamma=8 if mode == "copy" else None)
    prompt = "Write a short poem about the sea."
    plain = engine.generate(prompt, speculative=False, temperature=0, max_tokens=48)
    assert_greedy_as_llama(f"no prediction/{mode}", engine, prompt, plain.tokens, limit=48)
    # a client's word: auto drafts it from the first round
    good = engine.generate(prompt, temperature=0, max_tokens=48, prediction=with_a_word_changed(plain.text))
    assert_greedy_as_llama(f"prediction/{mode}", engine, prompt, good.tokens, limit=48)
    stats = good.stats
    assert stats.drafted > stats.accepted > 12 and stats.rounds_by_source.get("prediction", 0) > 0
    assert stats.rejected_prediction_tokens > 0 and stats.rounds < 0.75 * stats.n_tokens, stats.as_dict()
    assert stats.as_dict()["accepted_prediction_tokens"] == stats.accepted_prediction_tokens
    useless = engine.generate(prompt, temperature=0, max_tokens=48, prediction="Quarterly revenue rose 4%." * 20)
    assert useless.stats.accepted_prediction_tokens == 0
    assert_greedy_as_llama(f"useless prediction/{mode}", engine, prompt, useless.tokens, limit=48)


def test_a_seeded_sampled_answer_is_the_same_with_and_without_copies(smollm2):
    """Copies are verified with each position's own draw (sampling.verify): with a seed,
    speculation changes nothing but the speed, as in greedy mode."""
    engine = Engine(smollm2, None, draft_mode="copy", gamma=8)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=42)
    sampled = dict(temperature=0.7, seed=42, max_tokens=60)
    tokens = engine.prompt_tokens(EDIT)
    baseline = engine.generate(EDIT, speculative=False, **sampled)
    spec = engine.generate(EDIT, **sampled)
    assert spec.stats.accepted > 0
    assert_sampled_match("seeded copy", smollm2, tokens, baseline.tokens, spec.tokens, params, 42)
    predicted = engine.generate(EDIT, prediction=baseline.text, **sampled)
    assert predicted.stats.accepted_prediction_tokens > 0
    assert_sampled_match("seeded prediction", smollm2, tokens, baseline.tokens, predicted.tokens, params, 42)


PARAMS = dict(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
COUNTING = "one two three four five six. one two three four five six. one two three"


@pytest.mark.parametrize("prediction", [None, " four five six. one"], ids=["context", "prediction"])
@pytest.mark.slow
def test_first_and_second_token_laws_are_the_targets(smollm2, prediction):
    """Sampled: the first two tokens over 1500 runs follow the target's own joint law
    p(t1) p(t2 | t1) (chi-square), through copy drafts that are accepted or rejected."""
    engine, runs = Engine(smollm2, None, gamma=2, draft_mode="copy"), 1500
    p1 = law_after(engine, COUNTING, width=3, **PARAMS)
    support = np.flatnonzero(p1)
    p2 = {int(t): law_after(engine, COUNTING, [int(t)], width=2, **PARAMS) for t in support}
    joint = np.concatenate([p1[t] * p2[int(t)] for t in support])
    counts = np.zeros(len(support) * len(p1))
    sources = set()
    rng = np.random.default_rng(11)
    for _ in range(runs):
        events = engine.stream(
            COUNTING, raw=True, max_tokens=2, seed=int(rng.integers(2**32)), prediction=prediction, **PARAMS
        )
        first, second = next(events), next(events)
        events.close()
        counts[int(np.flatnonzero(support == first.token)[0]) * len(p1) + second.token] += 1
        sources.add(first.source)
    assert sources == {"draft", "target"}  # both paths (accepted draft, resampled) were exercised
    assert chi_square_pvalue(counts, joint, runs) > 0.01


def test_a_rename_carries_over_whole_words_only(smollm2):
    """` records` -> ` entries` renames every token holding the whole word `records` (or
    `Records`), and leaves ` record` alone (its stem would be `entrie`); a rename the target was
    seen to write is not overridden by one carried over from another (` Records` -> ` Items`,
    carried over to lower case, would make ` records` ` items`)."""
    text = "def f(records, max_records):\n    for record in records:\n        Records(record)\n"
    tokens = smollm2.tokenize(text, add_special=False)
    drafter = CopyDrafter(vocab=smollm2, prediction=tokens)
    pieces = {t: smollm2.piece(t).decode() for t in set(tokens)}

    def tok(piece: str) -> list[int]:
        return smollm2.tokenize(piece, add_special=False)

    def renamed(token: int) -> str | None:
        rule = drafter.rules.match([token], 0)
        return None if rule is None else b"".join(map(smollm2.piece, rule.replacement)).decode()

    drafter._learn(tok(" records"), tok(" entries"))
    holding = [t for t, piece in pieces.items() if "records" in piece.lower()]
    assert len(holding) >= 2  # ` records`, `records` or `_records`, `Records`
    for t in holding:
        assert renamed(t) == pieces[t].replace("records", "entries").replace("Records", "Entries")
    singular = [t for t, piece in pieces.items() if piece.strip() == "record"]
    assert singular and all(renamed(t) is None for t in singular)
    drafter._learn(tok(" Record"), tok(" Entry"))
    assert all(renamed(t).strip() == "entry" for t in singular)
    drafter._learn(tok(" Records"), tok(" Items"))
    assert renamed(tok(" records")[0]) == " entries"


def test_a_keystrokes_prompt_keeps_what_the_conversation_indexed_up_to_its_change():
    """An editor's next keystroke (or a regenerated answer) shares most of the last prompt: the
    index keeps what they share and is the same as a fresh one's of the new prompt (an index of
    2,000 tokens built again for every keystroke took 15 ms of its first token)."""
    rng = np.random.default_rng(3)
    before = [int(t) for t in rng.integers(0, 40, 600)]  # few distinct tokens: n-grams recur
    for changed_at in (0, 1, 300, 599):
        after = before[:changed_at] + [int(t) for t in rng.integers(0, 40, 25)]
        kept = Conversation()
        CopyDrafter(conversation=kept).begin(before)
        CopyDrafter(conversation=kept).begin(after)
        fresh = Conversation()
        CopyDrafter(conversation=fresh).begin(after)
        assert kept.tokens == after and kept.ngrams.indexed == fresh.ngrams.indexed
        assert kept.ngrams.tables == fresh.ngrams.tables, changed_at
