"""A loopback stand-in for the Hugging Face hub: an HTTP server on 127.0.0.1 serving the routes
huggingface_hub (the installed version) calls to download a model, from checkpoint directories:

    GET       /api/models/ORG/NAME/revision/REV     repo info (id, sha, siblings)
    GET       /api/models/ORG/NAME/tree/REV         the file listing (path, size, oid, lfs)
    HEAD/GET  /ORG/NAME/resolve/REV/FILE            X-Repo-Commit, ETag, Content-Length; Range -> 206

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo),
which huggingface_hub turns into its named exceptions; a gated repo's files need `token` (as the
Authorization header huggingface_hub sends from HF_TOKEN). `requests` records every request; `faults`
makes a file's GET cut its connection (once after half the body, or always before any byte).
The client side is huggingface_hub itself, pointed here through its HF_ENDPOINT constants
(the `loopback` fixture) or, in a child process, through HF_ENDPOINT itself.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors",)
REPO = "mlxbun-test/tiny-llama"
README = b"---\nlicense: mit\n---\nA tiny llama.\n"


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch -> sha
    gated: bool = False


class LoopbackHub:
    """`add(repo_id, directory)` publishes a directory as the repo's new main commit."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.faults: dict[str, str] = {}  # file name -> "cut_once" | "cut_always"
        self.token = "hf_loopback"  # the token whose terms of every gated repo are accepted
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, directory: Path, *, branch: str = "main", extra: dict[str, bytes] | None = None,
            gated: bool = False) -> str:
        files = {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}
        files.update(extra or {})
        sha = hashlib.sha1(json.dumps({k: _git_oid(v) for k, v in sorted(files.items())}).encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[sha] = files
        repo.refs[branch] = sha
        repo.gated = gated
        return sha

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of a file named `name` (None: the whole file)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    # ------------------------------------------------------------ routing

    def _commit(self, repo_id: str, rev: str):
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, 404, "RepoNotFound"
        sha = repo.refs.get(rev, rev)
        if sha not in repo.commits:
            return None, 404, "RevisionNotFound"
        return sha, 200, None

    @staticmethod
    def _etag(name: str, data: bytes) -> str:
        return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else _git_oid(data)


def _handler(hub: LoopbackHub):
    api = re.compile(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)")
    resolve = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, head: bool = False, commit: str | None = None):
            headers = {"X-Error-Code": code, "X-Error-Message": code}
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": code}).encode(), headers, head=head)

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _route(self, head: bool):
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if m := api.fullmatch(path):
                return self._api(m.group(1), m.group(2), m.group(3))
            if m := resolve.fullmatch(path):
                return self._file(m.group(1), m.group(2), m.group(3), head)
            self._error(404, "NotFound", head)

        def _api(self, repo_id: str, what: str, rev: str):
            sha, status, code = hub._commit(repo_id, rev)
            if sha is None:
                return self._error(status, code)
            files = hub.repos[repo_id].commits[sha]
            if what == "revision":
                body = {"id": repo_id, "sha": sha, "private": False, "gated": "manual" if hub.repos[repo_id].gated
                        else False, "siblings": [{"rfilename": n} for n in files]}
            else:
                body = []
                for name, data in files.items():
                    entry = {"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                    if name.endswith(LFS_SUFFIXES):
                        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                        "pointerSize": 134}
                    body.append(entry)
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _file(self, repo_id: str, rev: str, name: str, head: bool):
            sha, status, code = hub._commit(repo_id, rev)
            if sha is None:
                return self._error(status, code, head)
            if hub.repos[repo_id].gated and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._error(403, "GatedRepo", head)
            data = hub.repos[repo_id].commits[sha].get(name)
            if data is None:
                return self._error(404, "EntryNotFound", head, commit=sha)
            headers = {"X-Repo-Commit": sha, "ETag": f'"{hub._etag(name, data)}"', "Accept-Ranges": "bytes"}
            start = 0
            if (rng := self.headers.get("Range")) and (m := re.fullmatch(r"bytes=(\d+)-", rng)):
                start = int(m.group(1))
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            fault = None if head else hub.faults.get(name)
            if fault is None:
                return self._send(206 if start else 200, body, headers, head=head)
            if fault == "cut_once":
                del hub.faults[name]
            keep = len(body) // 2 if fault == "cut_once" else 0
            self.send_response(206 if start else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:keep])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


@pytest.fixture
def loopback(monkeypatch, tmp_path, zoo):
    """A loopback hub serving zoo:llama as REPO (plus a README the graph does not need), and
    huggingface_hub pointed at it, online, with an empty cache of its own (tmp_path / "hub")."""
    from huggingface_hub import constants

    server = LoopbackHub()
    server.add(REPO, zoo("llama"), extra={"README.md": README})
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    yield server
    server.close()
