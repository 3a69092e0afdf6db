"""The chat app, driven headless with Textual's Pilot on the SmolLM2 pair."""

from __future__ import annotations

import asyncio
from pathlib import Path
from weakref import WeakKeyDictionary

import pytest
from textual.notifications import Notification, Notify

import tui.app
from tui.app import ChatApp
from tui.widgets import AssistantMessage, StatsPanel

SMALL = dict(pair="smollm2-self", n_ctx=1024, max_tokens=24, temperature=0)


async def wait_for(pilot, condition, timeout=60.0):
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("timed out waiting for the app")


async def send(pilot, app: ChatApp, text: str) -> None:
    await wait_for(pilot, lambda: app.engine is not None and not app.generating)
    before = len(app.messages)
    app.query_one("#prompt").value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.messages) == before + 2)  # the answer is in the conversation


_NOTIFIED: WeakKeyDictionary = WeakKeyDictionary()


def notifications(app) -> list[Notification]:
    """What the app has notified so far (seen by record_notifications)."""
    return _NOTIFIED.setdefault(app, [])


def record_notifications(app):
    """A message hook for App.run_test that keeps each notification the app posts."""

    def hook(message) -> None:
        if isinstance(message, Notify):
            notifications(app).append(message.notification)

    return hook


def run(test, **options):
    async def main():
        app = ChatApp(**{**SMALL, **options})
        async with app.run_test(size=(120, 40), message_hook=record_notifications(app)) as pilot:
            await test(app, pilot)

    asyncio.run(main())


def test_send_and_answer_with_stats():
    async def test(app, pilot):
        await send(pilot, app, "Say hello.")
        answers = app.query(AssistantMessage)
        assert len(answers) == 1 and answers[0].text.strip()
        assert app.last_stats.n_tokens > 0 and app.last_stats.mode == "speculative"
        numbers = str(app.query_one("#numbers").render())
        assert "tokens/s" in numbers and f"tokens     {app.last_stats.n_tokens}" in numbers
        assert [m["role"] for m in app.messages] == ["user", "assistant"]

    run(test)


def test_toggles_take_effect_on_the_next_answer():
    async def test(app, pilot):
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("ctrl+t")  # speculation off
        await send(pilot, app, "Name a colour.")
        assert app.last_stats.mode == "target-only"
        await pilot.press("ctrl+t", "ctrl+d")  # on again; auto -> model
        assert app.draft_mode == "model"
        await pilot.press("ctrl+g", "ctrl+g")  # auto -> 1 -> 2
        assert app.gamma.fixed == 2
        await send(pilot, app, "Name another colour.")
        stats = app.last_stats
        assert (stats.mode, stats.draft_mode, stats.gamma) == ("speculative", "model", 2)
        assert stats.rounds_by_source.get("model", 0) > 0
        answer = app.query(AssistantMessage).last()
        assert not answer.has_class("coloured")  # Markdown by default
        await pilot.press("ctrl+o")
        assert answer.has_class("coloured") and app.colour

    run(test)


@pytest.mark.slow
def test_stop_mid_answer_then_send_again():
    async def test(app, pilot):
        await wait_for(pilot, lambda: app.engine is not None)
        app.query_one("#prompt").value = "Write a long story about a lighthouse keeper."
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query(AssistantMessage).last().text)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        stopped = app.last_stats.n_tokens
        assert stopped < 800
        await send(pilot, app, "Now say goodbye.")
        assert app.last_stats.n_tokens > 0 and app.last_stats.n_prompt_cached > 0  # KV prefix reused
        assert len(app.messages) == 4

    run(test, max_tokens=800)


def test_new_conversation_clears_everything():
    async def test(app, pilot):
        await send(pilot, app, "Hi!")
        await pilot.press("ctrl+n")
        await pilot.pause(0.1)
        assert app.messages == [] and len(app.query(AssistantMessage)) == 0
        await send(pilot, app, "Hello again.")
        assert len(app.messages) == 2

    run(test)


def test_incompatible_pair_shows_an_error_notification(smollm2_path):
    async def test(app, pilot):
        await wait_for(pilot, lambda: any(n.severity == "error" for n in notifications(app)))
        errors = [n for n in notifications(app) if n.severity == "error"]
        assert "cannot draft for" in errors[0].message
        assert app.engine is None
        assert app.query_one(StatsPanel)  # the app is still up

    run(test, pair=None, target="smollm2-135m", draft="qwen2.5-coder-0.5b")


def test_the_panel_draws_acceptance_on_a_fixed_scale():
    """A whole answer at α 0.00 (one copy round and one model round, nothing accepted) draws
    no bars; a round at α 1.00 fills the height; tokens/s are drawn from 0."""
    from textual.app import App

    from edgespec import Stats

    class Panel(App):
        def compose(self):
            yield StatsPanel()

    def drawn(app, selector: str) -> list[str]:
        line = app.query_one(selector)
        return [line.render_line(y).text for y in range(line.size.height)]

    async def main():
        app = Panel(css_path=Path(tui.app.__file__).with_name(ChatApp.CSS_PATH))
        async with app.run_test(size=(60, 30)) as pilot:
            panel = app.query_one(StatsPanel)
            stats = Stats(mode="speculative", gamma="auto")
            for rounds, drafted, accepted, decode_s in ((1, 8, 0, 0.1), (2, 12, 0, 0.2)):
                stats.rounds, stats.drafted, stats.accepted, stats.decode_s = rounds, drafted, accepted, decode_s
                panel.show(stats, "auto")
            await pilot.pause()
            assert list(panel.alphas) == [0.0, 0.0]
            assert not "".join(drawn(app, "#alpha-line")).strip()  # α 0: nothing drawn
            rates = drawn(app, "#rate-line")
            assert rates[0][:2] == "██"  # both rounds at 10 tokens/s: the top of a scale from 0
            stats.rounds, stats.drafted, stats.accepted, stats.decode_s = 3, 16, 2, 0.5
            panel.show(stats, "auto")  # α 0.5, 10 tokens/s
            await pilot.pause()
            alpha = drawn(app, "#alpha-line")
            assert [row[:3] for row in alpha] == ["   ", "  ▄", "  █"]  # half of three rows
            assert [row[2] for row in drawn(app, "#rate-line")] == ["█", "█", "█"]

    asyncio.run(main())
