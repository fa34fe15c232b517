"""The terminal UI that `localchat` opens: a Textual app to find, pull and chat with models.

`localchat.tui.app.LocalchatApp` is the app; it reaches the engine only through
`localchat.tui.backend` and keeps conversations in SQLite (`localchat.tui.db`).
"""
