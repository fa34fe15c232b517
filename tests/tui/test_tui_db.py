"""The chat database: schema version and WAL, conversations and messages round-trip, search,
rename, delete (with its messages), the latest one, branching, and a kill -9 while a reply is
being written leaving a database that opens with every committed message."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from localchat.tui.db import SCHEMA_VERSION, ChatDB, default_path, title_from
from localchat.tui.settings import ChatSettings


def test_a_new_database_is_at_the_schema_version_in_wal_mode(home: Path) -> None:
    db = ChatDB()
    assert db.path == default_path() == home / "chats.sqlite3"
    assert db.version == SCHEMA_VERSION >= 1
    raw = sqlite3.connect(db.path)
    assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()
    assert ChatDB().version == SCHEMA_VERSION  # reopening migrates nothing twice


def test_conversations_round_trip_search_rename_and_delete(tmp_path: Path) -> None:
    db = ChatDB(tmp_path / "c.sqlite3")
    assert db.latest_conversation() is None
    settings = ChatSettings(system="Be brief.", temperature=0.2, max_tokens=64)
    a = db.create_conversation("smollm2", title_from("What is the capital of France?"),
                               settings.to_dict())
    b = db.create_conversation("qwen", "Rust 100% _help_")
    db.add_message(a, "user", "What is the capital of France?")
    db.add_message(a, "assistant", "Paris.", stats={"decode_tok_s": 12.5})
    rows = db.conversations()
    assert [r.id for r in rows] == [a, b]  # the one with the newest message first
    latest = db.latest_conversation()  # what the app opens on
    assert latest is not None and latest.id == a and latest.model == "smollm2"
    assert rows[0].messages == 2 and rows[0].title == "What is the capital of France?"
    assert ChatSettings.from_dict(rows[0].settings) == settings
    assert [r.id for r in db.conversations("capital")] == [a]
    assert [r.id for r in db.conversations("100%")] == [b]  # LIKE wildcards are literal
    assert db.conversations("1_0") == []  # "_" would match "100" as a wildcard
    db.rename(b, "Rust help")
    assert db.conversation(b).title == "Rust help"
    [_, reply] = db.messages(a)
    assert reply.stats == {"decode_tok_s": 12.5} and reply.status == "done"
    db.delete(a)
    assert db.conversation(a) is None and db.messages(a) == []


def test_delete_from_drops_a_message_and_everything_after_it(tmp_path: Path) -> None:
    db = ChatDB(tmp_path / "c.sqlite3")
    c = db.create_conversation("m")
    ids = [db.add_message(c, role, str(i)) for i, role in enumerate(["user", "assistant"] * 3)]
    db.delete_from(c, ids[2])
    assert [m.content for m in db.messages(c)] == ["0", "1"]


def test_title_is_the_start_of_the_first_message() -> None:
    assert title_from("  Hello\n  world ") == "Hello world"
    long = title_from("word " * 40)
    assert len(long) <= 48 and long.endswith("…")


WRITER = textwrap.dedent("""
    import sys
    from localchat.tui.db import ChatDB
    db = ChatDB(sys.argv[1])
    c = db.create_conversation("smollm2", "crash")
    i = 0
    while True:
        db.add_message(c, "user", f"question {i}")
        db.add_message(c, "assistant", "x" * 20000, status="done", stats={"i": i})
        i += 1
        if i == 50:
            print("ready", flush=True)
""")


def test_kill_9_while_writing_leaves_a_database_that_opens(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    db = ChatDB(path)
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    [row] = db.conversations()
    messages = db.messages(row.id)
    assert len(messages) >= 100
    assert all(m.content == "x" * 20000 for m in messages if m.role == "assistant")
