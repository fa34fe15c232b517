"""Widgets of the terminal UI: messages, the prompt input, the jobs panel."""
