"""eagle3-console: the Textual UI. Renders engine state, sends commands; never imports torch."""

__version__ = "0.1.0"
