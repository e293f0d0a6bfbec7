"""The key footer, rebuilt once per burst of binding changes instead of once per change.

Textual's Footer recomposes (every key widget rebuilt) on every `bindings_updated` signal,
and start-up alone sends six (focus, tab activation, pane switch...); a tab switch sends
several more. Only the last state matters, so one pending rebuild serves them all: it reads
the bindings when it runs, after every change queued before it.
"""

from __future__ import annotations

from textual.widgets import Footer


class ConsoleFooter(Footer):
    """Footer whose rebuilds after binding changes are coalesced into one per refresh."""

    _rebuild_pending = False

    def bindings_changed(self, screen) -> None:
        self._bindings_ready = True
        if not screen.app.app_focus:
            return
        if self.is_attached and screen is self.screen and not self._rebuild_pending:
            self._rebuild_pending = True
            self.call_after_refresh(self._rebuild)

    async def _rebuild(self) -> None:
        self._rebuild_pending = False  # a change from here on schedules another rebuild
        await self.recompose()
