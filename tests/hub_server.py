"""A loopback HTTP server that speaks enough of the Hugging Face hub API for `huggingface_hub`.

Point the real client at it with `HF_ENDPOINT=server.url` (or `endpoint=`). It serves model
info with file metadata (`/api/models/{repo}[/revision/{rev}]?blobs=true`), tree listings,
and `HEAD`/`GET /{repo}/resolve/{rev}/{path}` with the hub's headers (ETag, X-Repo-Commit,
X-Linked-Etag/-Size, Content-Length, HTTP Range). LFS files may redirect to a blob URL as the
hub does. Faults for tests: gated/private repos (401/403), missing repos, revisions and files
(404), a file altered after its hash was published, and a file whose transfer stalls or drops
at a given byte. It counts the body bytes it serves, per file.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pth", ".pt", ".so", ".onnx", ".msgpack", ".h5")
LFS_MIN_SIZE = 10 * 1024 * 1024
_CHUNK = 64 * 1024
_DATE = "2024-01-01T00:00:00.000Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with this content (what the hub reports as blobId)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file stored in git for an LFS file."""
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
            ).encode()


@dataclass
class HostedFile:
    """One file: the bytes whose hashes are published, and the bytes actually served."""

    data: bytes
    lfs: bool
    served: bytes = b""

    def __post_init__(self) -> None:
        self.sha256 = hashlib.sha256(self.data).hexdigest()
        self.pointer = lfs_pointer(self.sha256, len(self.data))
        self.blob_id = git_blob_sha1(self.pointer if self.lfs else self.data)
        self.etag = self.sha256 if self.lfs else git_blob_sha1(self.data)
        if not self.served:
            self.served = self.data


@dataclass
class HostedRepo:
    """A model repo at one commit."""

    repo_id: str
    files: dict[str, HostedFile]
    commit: str
    refs: dict[str, str]
    gated: bool = False
    private: bool = False
    tokens: frozenset[str] = frozenset()
    # a gated repo listed to anyone, only its files refused (as huggingface.co does)
    listed: bool = False


@dataclass
class Fault:
    """Misbehaviour of one file's transfer: stall or drop the connection at byte `at`."""

    kind: str  # "stall" or "drop"
    at: int
    times: int = 1  # for drops: how many responses are cut


@dataclass
class LoggedRequest:
    """A request as the server saw it."""

    method: str
    path: str
    range: str | None
    authorization: str | None
    status: int = 0


@dataclass
class _State:
    repos: dict[str, HostedRepo] = field(default_factory=dict)
    faults: dict[tuple[str, str], Fault] = field(default_factory=dict)
    served: Counter[tuple[str, str]] = field(default_factory=Counter)
    requests: list[LoggedRequest] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)
    redirect_lfs: bool = True


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "loopback-hub/1"
    state: _State  # set on the subclass made per server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib name
        pass

    # plumbing --------------------------------------------------------------------------------
    def _log(self) -> LoggedRequest:
        entry = LoggedRequest(self.command, self.path, self.headers.get("Range"),
                              self.headers.get("Authorization"))
        with self.state.lock:
            self.state.requests.append(entry)
        return entry

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _send_json(self, entry: LoggedRequest, status: int, payload: object,
                   headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        entry.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, entry: LoggedRequest, status: int, code: str, message: str) -> None:
        self._send_json(entry, status, {"error": message},
                        {"X-Error-Code": code, "X-Error-Message": message})

    def _repo(self, entry: LoggedRequest, repo_id: str,
              listing: bool = False) -> HostedRepo | None:
        """The repo if this client may see it (`listing`: its file list, not a file), else send
        the hub's error and return None."""
        repo = self.state.repos.get(repo_id)
        token = self._token()
        if repo is None:
            self._error(entry, 404, "RepoNotFound", "Repository not found")
            return None
        if repo.private and token not in repo.tokens:
            self._error(entry, 401, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and listing and repo.listed:
            return repo
        if repo.gated and token is None:
            self._error(entry, 401, "GatedRepo",
                        f"Access to model {repo_id} is restricted. You must have access to it "
                        "and be authenticated to access it. Please log in.")
            return None
        if repo.gated and token not in repo.tokens:
            self._error(entry, 403, "GatedRepo",
                        f"Access to model {repo_id} is restricted and you are not in the "
                        "authorized list.")
            return None
        return repo

    def _commit(self, entry: LoggedRequest, repo: HostedRepo, revision: str) -> str | None:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision == repo.commit:
            return revision
        self._error(entry, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    # routes ----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._route()

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._route()

    def _route(self) -> None:
        entry = self._log()
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        try:
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
            if m:
                return self._model_info(entry, m.group(1), m.group(2) or "main", query)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path)
            if m:
                return self._tree(entry, m.group(1), m.group(2), m.group(3) or "", query)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(entry, m.group(1), m.group(2), m.group(3), redirect=True)
            m = re.fullmatch(r"/_blobs/([^/]+/[^/]+)/([0-9a-f]{40})/(.+)", path)
            if m:
                return self._resolve(entry, m.group(1), m.group(2), m.group(3), redirect=False)
            self._error(entry, 404, "NotFound", f"no route for {path}")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _model_info(self, entry: LoggedRequest, repo_id: str, revision: str,
                    query: dict[str, list[str]]) -> None:
        repo = self._repo(entry, repo_id, listing=True)
        if repo is None:
            return
        commit = self._commit(entry, repo, revision)
        if commit is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for name, f in sorted(repo.files.items()):
            sibling: dict[str, object] = {"rfilename": name}
            if blobs:
                sibling["size"] = len(f.data)
                sibling["blobId"] = f.blob_id
                if f.lfs:
                    sibling["lfs"] = {"size": len(f.data), "sha256": f.sha256,
                                      "pointerSize": len(f.pointer)}
            siblings.append(sibling)
        self._send_json(entry, 200, {
            "_id": hashlib.md5(repo_id.encode(), usedforsecurity=False).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": commit,
            "lastModified": _DATE,
            "createdAt": _DATE,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "library_name": "transformers",
            "siblings": siblings,
        })

    def _tree(self, entry: LoggedRequest, repo_id: str, revision: str, prefix: str,
              query: dict[str, list[str]]) -> None:
        repo = self._repo(entry, repo_id, listing=True)
        if repo is None or self._commit(entry, repo, revision) is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        base = prefix.strip("/")
        items: list[dict[str, object]] = []
        dirs: set[str] = set()
        for name, f in sorted(repo.files.items()):
            if base and not name.startswith(base + "/"):
                continue
            rest = name[len(base) + 1:] if base else name
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                d = "/".join(([base] if base else []) + parts[:depth])
                if (recursive or depth == 1) and d not in dirs:
                    dirs.add(d)
                    items.append({"type": "directory", "oid": git_blob_sha1(d.encode()),
                                  "size": 0, "path": d})
            if len(parts) > 1 and not recursive:
                continue
            item: dict[str, object] = {"type": "file", "oid": f.blob_id, "path": name,
                                       "size": len(f.data)}
            if f.lfs:
                item["lfs"] = {"oid": f.sha256, "size": len(f.data),
                               "pointerSize": len(f.pointer)}
            items.append(item)
        if base and not items:
            self._error(entry, 404, "EntryNotFound", f"{prefix} does not exist")
            return
        self._send_json(entry, 200, items)

    def _resolve(self, entry: LoggedRequest, repo_id: str, revision: str, name: str,
                 redirect: bool) -> None:
        repo = self._repo(entry, repo_id)
        if repo is None:
            return
        commit = self._commit(entry, repo, revision)
        if commit is None:
            return
        f = repo.files.get(name)
        if f is None:
            self._error(entry, 404, "EntryNotFound", f"{name} does not exist")
            return
        meta = {"X-Repo-Commit": commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes"}
        if f.lfs:
            meta["X-Linked-Etag"] = f'"{f.sha256}"'
            meta["X-Linked-Size"] = str(len(f.data))
        if redirect and f.lfs and self.state.redirect_lfs:
            entry.status = 302
            self.send_response(302)
            self.send_header("Location", f"/_blobs/{repo_id}/{commit}/{quote(name)}")
            for k, v in meta.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send_file(entry, repo_id, name, f, meta)

    def _send_file(self, entry: LoggedRequest, repo_id: str, name: str, f: HostedFile,
                   meta: Mapping[str, str]) -> None:
        body = f.served
        total = len(body)
        start, end = 0, total - 1
        status = 200
        wanted = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", (wanted or "").strip())
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)), total - 1) if m.group(2) else total - 1
            if start >= total:
                entry.status = 416
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        entry.status = status
        self.send_response(status)
        for k, v in meta.items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{total}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.state.lock:
            fault = self.state.faults.get((repo_id, name))
            if fault is not None and (fault.times <= 0 or not start < fault.at <= end):
                fault = None
            if fault is not None and fault.kind == "drop":
                fault.times -= 1
        stop_at = fault.at if fault is not None else end + 1
        pos = start
        while pos < stop_at:
            piece = body[pos:min(pos + _CHUNK, stop_at)]
            self.wfile.write(piece)
            with self.state.lock:
                self.state.served[(repo_id, name)] += len(piece)
            pos += len(piece)
        if fault is None:
            return
        self.wfile.flush()
        if fault.kind == "stall":
            self.state.stop.wait(120)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class HubServer:
    """The loopback hub, started in a background thread; use as a context manager."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, redirect_lfs: bool = True) -> None:
        self._state = _State(redirect_lfs=redirect_lfs)
        handler = type("Handler", (_HubHandler,), {"state": self._state})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    # lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The endpoint to give huggingface_hub (HF_ENDPOINT)."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Release stalled transfers, stop serving and close the socket."""
        self._state.stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # content ---------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        files: Path | Mapping[str, bytes],
        *,
        revision: str = "main",
        gated: bool = False,
        private: bool = False,
        tokens: tuple[str, ...] = (),
        listed: bool = False,
    ) -> str:
        """Host a repo from a folder or a {path: bytes} mapping; returns its commit sha.
        `gated`: only `tokens` get it (401 without a token, 403 with another); `listed`: its
        listing is public, only its files are gated (huggingface.co's way)."""
        if isinstance(files, Path):
            contents = {
                p.relative_to(files).as_posix(): p.read_bytes()
                for p in sorted(files.rglob("*")) if p.is_file()
            }
        else:
            contents = dict(files)
        hosted = {
            path: HostedFile(data, lfs=path.endswith(LFS_SUFFIXES) or len(data) >= LFS_MIN_SIZE)
            for path, data in contents.items()
        }
        digest = hashlib.sha1(repo_id.encode(), usedforsecurity=False)
        for path, f in sorted(hosted.items()):
            digest.update(f"{path}\0{f.etag}\n".encode())
        commit = digest.hexdigest()
        with self._state.lock:
            self._state.repos[repo_id] = HostedRepo(
                repo_id, hosted, commit, {revision: commit}, gated=gated, private=private,
                tokens=frozenset(tokens), listed=listed,
            )
        return commit

    def file(self, repo_id: str, path: str) -> HostedFile:
        """A hosted file (its published hashes and its bytes)."""
        return self._state.repos[repo_id].files[path]

    def alter_file(self, repo_id: str, path: str, at: int = 0) -> None:
        """Serve different bytes (same size) than those whose hashes are published."""
        f = self.file(repo_id, path)
        data = bytearray(f.data)
        data[at] ^= 0xFF
        f.served = bytes(data)

    def stall_file(self, repo_id: str, path: str, at: int) -> None:
        """Send a file up to byte `at`, then hang until the server stops."""
        with self._state.lock:
            self._state.faults[(repo_id, path)] = Fault("stall", at, times=1 << 30)

    def drop_file(self, repo_id: str, path: str, at: int, times: int = 1) -> None:
        """Close the connection at byte `at` of a file, for the next `times` transfers."""
        with self._state.lock:
            self._state.faults[(repo_id, path)] = Fault("drop", at, times)

    def clear_faults(self) -> None:
        """Serve every file normally again."""
        with self._state.lock:
            self._state.faults.clear()

    # observation -----------------------------------------------------------------------------
    def bytes_served(self, repo_id: str | None = None, path: str | None = None) -> int:
        """Body bytes of files served so far, optionally for one repo and/or path."""
        with self._state.lock:
            return sum(n for (r, p), n in self._state.served.items()
                       if (repo_id is None or r == repo_id) and (path is None or p == path))

    def served_by_file(self, repo_id: str) -> dict[str, int]:
        """Body bytes served per file of one repo."""
        with self._state.lock:
            return {p: n for (r, p), n in self._state.served.items() if r == repo_id}

    @property
    def requests(self) -> list[LoggedRequest]:
        """Every request so far, in order."""
        with self._state.lock:
            return list(self._state.requests)

    def reset_counters(self) -> None:
        """Forget served bytes and logged requests."""
        with self._state.lock:
            self._state.served.clear()
            self._state.requests.clear()


# fixture repos --------------------------------------------------------------------------------
def tiny_tokenizer_json(vocab_size: int = 256) -> bytes:
    """A small byte-level BPE tokenizer.json, trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello hub",
              "a tiny model for tests of the downloader"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok.to_str().encode()


def tiny_llama_folder(dest: Path, max_shard_size: str | None = None) -> Path:
    """A random-weight Llama (float32, ~1 MB) saved by transformers, with a tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=192,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config).to(torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(dest, **kwargs)
    (dest / "tokenizer.json").write_bytes(tiny_tokenizer_json())
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))
    return dest


def tiny_rwkv_folder(dest: Path) -> Path:
    """A random-weight RWKV-4 laid out like the RWKV org's repos: pytorch_model.bin + vocab."""
    import torch
    from transformers import RwkvConfig, RwkvForCausalLM

    torch.manual_seed(0)
    config = RwkvConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                        context_length=256, architectures=["RwkvForCausalLM"])
    model = RwkvForCausalLM(config)
    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dest)
    torch.save(model.state_dict(), dest / "pytorch_model.bin")
    (dest / "rwkv_vocab_v20230424.txt").write_text("\n".join(
        f"{i + 1} {chr(97 + i % 26)!r} 1" for i in range(256)))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "RWKVWorldTokenizer",
         "auto_map": {"AutoTokenizer": ["tokenization_rwkv_world.RWKVWorldTokenizer", None]}}))
    (dest / "tokenization_rwkv_world.py").write_text("raise SystemExit('remote code ran')\n")
    return dest


def with_decoys(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """Add what real repos carry but a pull must skip: code, other formats, docs, originals."""
    out = dict(files)
    out.update({
        "README.md": b"# tiny\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "modeling_tiny.py": b"raise SystemExit('remote code ran')\n",
        "onnx/model.onnx": b"\0" * 1000,
        "original/consolidated.00.pth": b"\0" * 1000,
        "flax_model.msgpack": b"\0" * 1000,
    })
    if "model.safetensors" in files:
        out["pytorch_model.bin"] = b"\0" * 2000  # the same weights in a second format
    return out


def folder_files(folder: Path) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder`."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}
