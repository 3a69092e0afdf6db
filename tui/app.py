"""The chat app: conversation on the left, live speculation stats on the right.

Loading models and generating run on the engine's thread (edgespec.EngineThread), in
order; the UI thread only draws, and the engine thread never waits for it.
"""

from __future__ import annotations

import inspect
import threading
from time import monotonic

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Footer, Header, Input

import edgespec
from edgespec import Gamma

from .widgets import AssistantMessage, PairPicker, StatsPanel, UserMessage

GAMMAS = (Gamma(), *map(Gamma, (1, 2, 3, 4, 6, 8, 16)))
REFRESH_S = 0.25  # redraw at most this often: drawing shares the CPU with llama.cpp


class UiCall(Message):
    """A call from the engine thread to be made on the app's thread."""

    def __init__(self, callback, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.callback, self.args, self.kwargs = callback, args, kwargs


class ChatApp(App):
    """edgespec chat."""

    TITLE = "edgespec chat"
    CSS_PATH = "chat.tcss"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+t", "toggle_speculation", "Speculation on/off", priority=True),
        Binding("ctrl+o", "toggle_colour", "Colours", priority=True),
        Binding("ctrl+d", "cycle_mode", "Draft mode", priority=True),
        Binding("ctrl+g", "cycle_gamma", "γ", priority=True),
        Binding("ctrl+n", "new_conversation", "New chat", priority=True),
        Binding("ctrl+p", "pick_pair", "Pair", priority=True),
        Binding("ctrl+y", "copy_answer", "Copy answer", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    speculation = reactive(True)
    colour = reactive(False)  # off: answers render as Markdown
    draft_mode = reactive(edgespec.DraftMode.AUTO)
    gamma = reactive(Gamma())
    generating = reactive(False)

    def __init__(
        self,
        pair: str | None = None,
        *,
        target=None,
        draft=None,
        draft_mode: str = "auto",
        gamma: Gamma | None = None,
        max_tokens: int | None = None,
        temperature: float = edgespec.SamplingParams.temperature,
        **load_options,
    ) -> None:
        super().__init__()
        self.set_reactive(ChatApp.draft_mode, draft_mode)
        self.set_reactive(ChatApp.gamma, gamma or Gamma())
        self.engine: edgespec.Engine | None = None
        self.messages: list[dict[str, str]] = []
        self.answer: AssistantMessage | None = None
        self.max_tokens, self.temperature = max_tokens, temperature
        self._source = dict(pair=pair, target=target, draft=draft)
        self._load_options = load_options
        self.last_stats: edgespec.Stats | None = None
        self._stop = threading.Event()
        self._engine_thread = edgespec.EngineThread()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="conversation")
            yield StatsPanel(id="stats")
        yield Input(placeholder="Message (Enter to send)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.load_engine(**self._source)
        self.query_one(Input).focus()

    # --- models -------------------------------------------------------------
    def _on_engine_thread(self, blocking, *args) -> None:
        """Run blocking engine work on the engine thread, in order. It reports back with
        _to_ui(), never waiting for the screen."""
        self._engine_thread.submit(blocking, *args).add_done_callback(self._report_failure)

    def _report_failure(self, future) -> None:
        if (error := future.exception()) is not None:  # a bug of ours: say so instead of hanging
            self._to_ui(self.notify, f"internal error: {type(error).__name__}: {error}", severity="error")

    def _to_ui(self, callback, *args, **kwargs) -> None:
        """From the engine thread: run callback(*args, **kwargs) on the app's thread, in order."""
        self.post_message(UiCall(callback, args, kwargs))

    @on(UiCall)
    async def _ui_call(self, message: UiCall) -> None:
        result = message.callback(*message.args, **message.kwargs)
        if inspect.isawaitable(result):
            await result

    def load_engine(self, pair=None, target=None, draft=None) -> None:
        self._stop.set()  # an answer in progress ends at its next round
        self._set_busy(True)
        self._on_engine_thread(self._load, pair, target, draft)

    def _load(self, pair, target, draft) -> None:
        try:
            if pair and not any(p.name == pair and p.downloaded for p in edgespec.pairs()):
                self._to_ui(self.notify, f"Downloading and verifying '{pair}'…")
                edgespec.pull_models([pair], progress=False)
            engine = edgespec.load(pair, target=target, draft=draft, progress=False, **self._load_options)
        except edgespec.EdgespecError as e:
            self._to_ui(self._load_failed, str(e))
        else:
            self._close_engine()
            self.engine = self._engine_thread.engine = engine
            self._to_ui(self._engine_ready, engine)
        finally:
            self._to_ui(self._set_busy, False)

    def _load_failed(self, message: str) -> None:
        self.notify(message, title="Could not load models", severity="error", timeout=15)

    def _engine_ready(self, engine: edgespec.Engine) -> None:
        self.sub_title = engine.target.path.name + (
            f" ← {engine.draft_name}" if engine.draft_name is not None else " (copy drafts only)"
        )
        self.notify(f"Loaded {self.sub_title}")

    def _set_busy(self, busy: bool) -> None:
        self.query_one(StatsPanel).set_class(busy, "busy")

    def action_pick_pair(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self.action_stop()
                self.load_engine(pair=name)

        self.push_screen(PairPicker(), chosen)

    # --- conversation -------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.engine is None:
            self.notify("No model is loaded yet; wait, or pick a pair with ctrl+p.", severity="warning")
            return
        if self.generating:
            self.notify("Still answering; press Esc to stop first.", severity="warning")
            return
        event.input.value = ""
        self.messages.append({"role": "user", "content": text})
        conversation = self.query_one("#conversation", VerticalScroll)
        self.answer = AssistantMessage(self.colour)
        conversation.mount(UserMessage(text), self.answer)
        conversation.scroll_end(animate=False)
        self.query_one(StatsPanel).reset()
        self.generate(self.answer)

    def generate(self, answer: AssistantMessage) -> None:
        self._stop.clear()
        self.generating = True
        request = edgespec.Request(
            list(self.messages),
            edgespec.SamplingParams(temperature=self.temperature),
            max_tokens=self.max_tokens,
            draft_mode=self.draft_mode if self.speculation else edgespec.DraftMode.OFF,
            gamma=self.gamma,
        )
        self._on_engine_thread(self._generate, answer, request)

    def _generate(self, answer: AssistantMessage, request: edgespec.Request) -> None:
        pieces: list[tuple[str, str | None]] = []
        shown = monotonic()
        stats = None
        try:
            events = self.engine.stream(request)
            for event in events:
                pieces.append((event.text, event.source))
                stats = event.stats
                if self._stop.is_set():
                    break
                if event.done or monotonic() - shown > REFRESH_S:
                    self._to_ui(self._show, answer, pieces, stats)
                    pieces, shown = [], monotonic()
            events.close()  # after a stop: the KV caches hold exactly what was generated
        except edgespec.EdgespecError as e:
            self._to_ui(self.notify, f"{e}. Press ctrl+n for a new conversation.", severity="error")
        finally:
            self._to_ui(self._finished, answer, pieces, stats)

    async def _show(self, answer: AssistantMessage, pieces, stats: edgespec.Stats) -> None:
        await answer.add(pieces)
        self.query_one(StatsPanel).show(stats, self.settings_text)
        self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)

    async def _finished(self, answer: AssistantMessage, pieces, stats: edgespec.Stats | None) -> None:
        self.generating = False
        if answer is not self.answer:  # the conversation was cleared meanwhile
            return
        if stats is not None:
            await self._show(answer, pieces, stats)
            self.last_stats = stats
            if stats.finish_reason == "context":
                self.notify("The context is full. Press ctrl+n to start a new conversation.", severity="warning")
        answer.streaming = False
        self.messages.append({"role": "assistant", "content": answer.text})

    # --- keys ---------------------------------------------------------------
    @property
    def settings_text(self) -> str:
        if not self.speculation:
            return "speculation off"
        return f"{self.draft_mode}, γ {self.gamma}"

    def action_stop(self) -> None:
        self._stop.set()

    def action_toggle_speculation(self) -> None:
        self.speculation = not self.speculation
        self.notify(f"Speculation {'on' if self.speculation else 'off'} from the next answer")

    def action_toggle_colour(self) -> None:
        self.colour = not self.colour
        for message in self.query(AssistantMessage):
            message.coloured = self.colour

    def action_cycle_mode(self) -> None:
        modes = self.engine.draft_modes if self.engine is not None else (edgespec.DraftMode.AUTO,)
        at = modes.index(self.draft_mode) if self.draft_mode in modes else -1
        self.draft_mode = modes[(at + 1) % len(modes)]
        self.notify(f"Draft mode: {self.draft_mode}")

    def action_cycle_gamma(self) -> None:
        self.gamma = GAMMAS[(GAMMAS.index(self.gamma) + 1) % len(GAMMAS)]
        self.notify(f"γ: {self.gamma}")

    def action_new_conversation(self) -> None:
        self.action_stop()
        self.messages.clear()
        self.answer = None
        self.query_one("#conversation", VerticalScroll).remove_children()
        self.query_one(StatsPanel).reset()

    def action_copy_answer(self) -> None:
        if self.answer is not None and self.answer.text:
            self.copy_to_clipboard(self.answer.text)
            self.notify("Copied the last answer")

    def _close_engine(self) -> None:
        """On the engine thread: free the engine (an answer in progress has ended: the
        thread runs one thing at a time)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = self._engine_thread.engine = None

    def on_unmount(self) -> None:
        self._stop.set()
        self._engine_thread.close(last=self._close_engine)  # the engine thread never waits for the screen


def run(**options) -> None:
    ChatApp(**options).run()
