"""Conversations, their messages, settings and each reply's stats, in SQLite (stdlib sqlite3).

The database lives in the data directory (`LOCALCHAT_HOME` honoured) as `chats.sqlite3`, in WAL
mode, so a crash or kill -9 loses at most the transaction being written and never leaves the
file unreadable. `PRAGMA user_version` holds the schema version; `MIGRATIONS[v]` upgrades a
database from version v to v + 1. Every method is safe to call from any thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.paths import data_dir

DB_NAME = "chats.sqlite3"


def _v0_to_v1(db: sqlite3.Connection) -> None:
    _run_script(db, """
        CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT NOT NULL,
            settings TEXT NOT NULL DEFAULT '{}',
            created REAL NOT NULL,
            updated REAL NOT NULL
        );
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'done',
            stats TEXT,
            created REAL NOT NULL
        );
        CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
        """)


def _run_script(db: sqlite3.Connection, script: str) -> None:
    # statement by statement: executescript() would commit the migration's transaction
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _v1_to_v2(db: sqlite3.Connection) -> None:
    # a reasoning model's thinking, kept apart from the reply's content
    db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [_v0_to_v1, _v1_to_v2]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class ConversationRow:
    """One conversation as the list shows it."""

    id: int
    title: str
    model: str
    settings: dict[str, Any]
    created: float
    updated: float
    messages: int = 0


@dataclass(frozen=True)
class MessageRow:
    """One stored message; `status` is "done", "cancelled" (stopped, partial) or "error"."""

    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "done"
    stats: dict[str, Any] | None = field(default=None)
    thinking: str = ""  # a reasoning model's thinking before this reply


def default_path() -> Path:
    """Where the chat database lives: the data directory's `chats.sqlite3`."""
    return data_dir() / DB_NAME


def title_from(text: str, limit: int = 48) -> str:
    """A conversation title from the start of its first message."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


class ChatDB:
    """The chat database at `path` (default: `default_path()`), upgraded to the current schema."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0,
                                   isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    @property
    def version(self) -> int:
        """The schema version of the open database."""
        with self._lock:
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        with self._lock:
            version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                return  # written by a newer localchat: read what we understand
            for step in range(version, SCHEMA_VERSION):
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    MIGRATIONS[step](self._db)
                    self._db.execute(f"PRAGMA user_version = {step + 1}")
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise

    def _write(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # conversations ---------------------------------------------------------------------------
    def create_conversation(self, model: str, title: str = "New chat",
                            settings: dict[str, Any] | None = None) -> int:
        """A new conversation with `model`; returns its id."""
        now = time.time()
        cur = self._write(
            "INSERT INTO conversations (title, model, settings, created, updated) "
            "VALUES (?, ?, ?, ?, ?)",
            (title, model, json.dumps(settings or {}), now, now),
        )
        return int(cur.lastrowid or 0)

    def conversations(self, search: str = "") -> list[ConversationRow]:
        """Conversations whose title contains `search` (case-insensitive), newest first."""
        rows = self._read(
            "SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n "
            "FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' "
            "ORDER BY c.updated DESC, c.id DESC",
            ("%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%",),
        )
        return [_conversation(r) for r in rows]

    def conversation(self, conversation_id: int) -> ConversationRow | None:
        """One conversation, or None."""
        rows = self._read("SELECT c.*, 0 AS n FROM conversations c WHERE id = ?",
                          (conversation_id,))
        return _conversation(rows[0]) if rows else None

    def latest_conversation(self) -> ConversationRow | None:
        """The most recently updated conversation, or None when there is none."""
        rows = self._read("SELECT c.*, 0 AS n FROM conversations c "
                          "ORDER BY c.updated DESC, c.id DESC LIMIT 1")
        return _conversation(rows[0]) if rows else None

    def rename(self, conversation_id: int, title: str) -> None:
        """Give a conversation a new title."""
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and its messages."""
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def set_settings(self, conversation_id: int, settings: dict[str, Any]) -> None:
        """Store a conversation's settings."""
        self._write("UPDATE conversations SET settings = ? WHERE id = ?",
                    (json.dumps(settings), conversation_id))

    def last_used(self) -> dict[str, float]:
        """Model name -> when a conversation with it last changed."""
        rows = self._read("SELECT model, MAX(updated) AS t FROM conversations GROUP BY model")
        return {r["model"]: float(r["t"]) for r in rows}

    # messages --------------------------------------------------------------------------------
    def add_message(self, conversation_id: int, role: str, content: str, *,
                    status: str = "done", stats: dict[str, Any] | None = None,
                    thinking: str = "") -> int:
        """Append a message (one transaction, with the conversation's `updated`); its id."""
        now = time.time()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "INSERT INTO messages (conversation_id, role, content, status, stats, "
                    "created, thinking) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (conversation_id, role, content, status,
                     json.dumps(stats) if stats is not None else None, now, thinking),
                )
                self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                                 (now, conversation_id))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return int(cur.lastrowid or 0)

    def messages(self, conversation_id: int) -> list[MessageRow]:
        """A conversation's messages in order."""
        rows = self._read("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                          (conversation_id,))
        return [
            MessageRow(r["id"], r["conversation_id"], r["role"], r["content"], r["status"],
                       json.loads(r["stats"]) if r["stats"] else None, r["thinking"])
            for r in rows
        ]

    def delete_from(self, conversation_id: int, message_id: int) -> None:
        """Delete a message and every later one of its conversation (to branch or regenerate)."""
        self._write("DELETE FROM messages WHERE conversation_id = ? AND id >= ?",
                    (conversation_id, message_id))

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._db.close()


def _conversation(row: sqlite3.Row) -> ConversationRow:
    try:
        settings = json.loads(row["settings"] or "{}")
    except json.JSONDecodeError:
        settings = {}
    return ConversationRow(row["id"], row["title"], row["model"], settings, row["created"],
                           row["updated"], int(row["n"]))
