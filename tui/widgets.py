"""Small widgets of the chat app: messages, the live stats panel, the pair picker."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import LoadingIndicator, Markdown, OptionList, Static
from textual.widgets.option_list import Option

import edgespec

DRAFT_STYLE = "bold green"  # accepted draft tokens; tokens the target produced itself stay plain


class UserMessage(Static):
    pass


class AssistantMessage(Vertical):
    """An answer: as Markdown, or token by token coloured by provenance (accepted draft
    tokens in green). While it streams it is shown as plain text, and as Markdown once it
    is done: re-laying out Markdown several times a second takes a fifth of the speed of
    generation on a 2-core machine (measured), which shares the CPU with the drawing."""

    coloured = reactive(False)
    streaming = reactive(True)

    def __init__(self, coloured: bool) -> None:
        super().__init__()
        self.text = ""
        self._tokens = Text()
        self.set_reactive(AssistantMessage.coloured, coloured)

    def compose(self) -> ComposeResult:
        yield Markdown()
        yield Static(classes="tokens")

    def on_mount(self) -> None:
        self.set_class(self.coloured, "coloured")
        self.set_class(self.streaming, "streaming")

    async def watch_coloured(self, coloured: bool) -> None:
        self.set_class(coloured, "coloured")
        await self._redraw()

    async def watch_streaming(self, streaming: bool) -> None:
        self.set_class(streaming, "streaming")
        await self._redraw()

    async def _redraw(self) -> None:
        if self.coloured or self.streaming:
            self.query_one(".tokens", Static).update(self._tokens if self.coloured else Text(self.text))
        else:
            await self.query_one(Markdown).update(self.text)

    async def add(self, pieces: list[tuple[str, str | None]]) -> None:
        """Append (text, source) pieces; source "draft" marks accepted draft tokens."""
        self.text += "".join(text for text, _ in pieces)
        for text, source in pieces:
            self._tokens.append(text, style=DRAFT_STYLE if source == "draft" else "")
        await self._redraw()


class ScaledSparkline(Widget):
    """Bars on a scale from 0 to `top` (None: the series' own maximum). Textual's Sparkline
    scales a series to its own minimum and maximum, so a constant one (a single round at
    α 0.00) fills the widget as if it were the best."""

    BARS = "▁▂▃▄▅▆▇█"
    data: reactive[list[float]] = reactive(list, always_update=True)

    def __init__(self, top: float | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.top = top

    def render(self) -> Text:
        width, height = self.size
        values = self.data[-width:] if width else []
        top = self.top if self.top is not None else max(values, default=0.0)
        steps = len(self.BARS)
        # eighths of a row each column fills: 0 draws nothing, `top` the whole height
        filled = [round(min(max(v / top, 0.0), 1.0) * steps * height) if top > 0 else 0 for v in values]
        rows = []
        for row in reversed(range(height)):
            above = [f - row * steps for f in filled]
            rows.append("".join(self.BARS[min(a, steps) - 1] if a > 0 else " " for a in above))
        return Text("\n".join(rows))


class StatsPanel(Vertical):
    """Live numbers of the current (or last) answer, and sparklines over recent rounds."""

    HISTORY = 60

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rates: deque[float] = deque(maxlen=self.HISTORY)
        self.alphas: deque[float] = deque(maxlen=self.HISTORY)
        self._last = (0, 0.0, 0, 0)  # rounds, decode_s, drafted, accepted at the last update

    def compose(self) -> ComposeResult:
        yield Static("speculation", classes="title")
        yield Static(id="numbers", markup=False)
        yield LoadingIndicator(id="busy")
        yield Static("tokens/s per round", classes="title")
        yield ScaledSparkline(id="rate-line")  # from 0 to the highest rate shown
        yield Static("acceptance per round", classes="title")
        yield ScaledSparkline(top=1.0, id="alpha-line")

    def reset(self) -> None:
        self.rates.clear()
        self.alphas.clear()
        self._last = (0, 0.0, 0, 0)

    def show(self, stats: edgespec.Stats, settings: str) -> None:
        rounds, decode_s, drafted, accepted = self._last
        if stats.rounds > rounds:  # one point per update: the rounds since the last one
            new_tokens = stats.accepted - accepted + stats.rounds - rounds
            if stats.decode_s > decode_s:
                self.rates.append(new_tokens / (stats.decode_s - decode_s))
            if stats.drafted > drafted:
                self.alphas.append((stats.accepted - accepted) / (stats.drafted - drafted))
        self._last = (stats.rounds, stats.decode_s, stats.drafted, stats.accepted)
        lines = [
            f"settings   {settings}",
            f"now        {stats.last_source}" + (f" γ={stats.last_gamma}" if stats.last_gamma else ""),
            f"tokens/s   {stats.tokens_per_s:.1f}",
            f"α          {stats.acceptance_rate:.2f}",
            f"tok/round  {stats.tokens_per_round:.2f}  (E[n] {stats.expected_tokens_per_round:.2f})",
            f"rounds     {stats.rounds}  " + " ".join(f"{k}:{v}" for k, v in sorted(stats.rounds_by_source.items())),
            f"tokens     {stats.n_tokens}",
        ]
        if stats.baseline_tokens_per_s:
            lines.append(f"speedup    {stats.measured_speedup:.2f}x (pred. {stats.predicted_speedup:.2f}x)")
        if stats.recall_s:  # drafts from what earlier requests wrote
            remembered = stats.accepted_by_source.get("memory", 0)
            lines.append(f"memory     {remembered} tokens drafted, lookups {1e3 * stats.recall_s:.0f} ms")
        if stats.finish_reason:
            lines.append(f"finished   {stats.finish_reason}")
        self.query_one("#numbers", Static).update("\n".join(lines))
        self.query_one("#rate-line", ScaledSparkline).data = list(self.rates)
        self.query_one("#alpha-line", ScaledSparkline).data = list(self.alphas)


class PairPicker(ModalScreen[str]):
    """Choose a target/draft pair from models.toml; shows which are downloaded."""

    BINDINGS = [("escape", "dismiss", "Cancel")]

    def compose(self) -> ComposeResult:
        options = [
            Option(
                f"{p.name}  {p.target} ← {p.draft}  "
                + ("[green]downloaded[/]" if p.downloaded else "[yellow]not downloaded[/]"),
                id=p.name,
            )
            for p in edgespec.pairs()
        ]
        yield OptionList(*options)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)
