"""Screens of the terminal UI: models (and the welcome view), chat, and the dialogs."""
