"""A Hugging Face hub on 127.0.0.1, for huggingface-hub itself (HF_ENDPOINT pointed at it): the
two routes a hub model's fetch takes, a repo's tree (/api/models/OWNER/REPO/tree/REV, each file
with its size and, for a .gguf, its LFS sha256) and a file (/OWNER/REPO/resolve/REV/PATH, HEAD
and GET, with byte ranges). What the real hub answers for a missing repo or file (404 with its
X-Error-Code), and faults to test against: a file listed with another sha256 than its bytes',
a connection dropped after some bytes (once), a transfer stalled after some bytes."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Served:
    """One request: its method, path and Range header."""

    method: str
    path: str
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)  # repo -> path -> bytes
    gated: set[str] = field(default_factory=set)  # repos whose terms are not accepted
    wrong_sha: set[tuple[str, str]] = field(default_factory=set)  # (repo, path) listed with a wrong sha256
    drop_after: dict[tuple[str, str], int] = field(default_factory=dict)  # the next GET closes after n bytes
    stall_after: dict[tuple[str, str], int] = field(default_factory=dict)  # GETs wait after n bytes ...
    release: threading.Event = field(default_factory=threading.Event)  # ... until this is set
    stalled: threading.Event = field(default_factory=threading.Event)  # set once a GET waits
    served: list[Served] = field(default_factory=list)

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def listed_sha256(self, repo: str, path: str) -> str:
        sha = hashlib.sha256(self.repos[repo][path]).hexdigest()
        return sha[::-1] if (repo, path) in self.wrong_sha else sha

    # --- the routes ----------------------------------------------------------------
    def _answer(self, request: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(request.path).path)
        self.served.append(Served(request.command, path, request.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            self._tree(request, f"{parts[2]}/{parts[3]}")
        elif len(parts) >= 5 and parts[2] == "resolve":
            try:
                self._file(request, f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away mid-file (killed)
        else:
            self._error(request, 404, "EntryNotFound", "no such route")

    def _tree(self, request: BaseHTTPRequestHandler, repo: str) -> None:
        if repo in self.gated:
            return self._error(request, 403, "GatedRepo", "Access to this repo is restricted")
        if repo not in self.repos:
            return self._error(request, 404, "RepoNotFound", "Repository not found")
        listing = []
        for path, data in self.repos[repo].items():
            entry = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}
            if path.endswith(".gguf"):
                entry["lfs"] = {"oid": self.listed_sha256(repo, path), "size": len(data), "pointerSize": 134}
            listing.append(entry)
        payload = json.dumps(listing).encode()
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)

    def _file(self, request: BaseHTTPRequestHandler, repo: str, path: str, body: bool) -> None:
        if repo not in self.repos:
            return self._error(request, 404, "RepoNotFound", "Repository not found")
        if path not in self.repos[repo]:
            return self._error(request, 404, "EntryNotFound", "Entry not found")
        data = self.repos[repo][path]
        start = 0
        if body and (ranged := request.headers.get("Range")):
            start = int(ranged.removeprefix("bytes=").split("-")[0])
        request.send_response(206 if start else 200)
        request.send_header("X-Repo-Commit", COMMIT)
        request.send_header("ETag", f'"{self.listed_sha256(repo, path)}"')
        request.send_header("Accept-Ranges", "bytes")
        request.send_header("Content-Length", str(len(data) - start))
        if start:
            request.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        request.end_headers()
        if not body:
            return
        key, rest = (repo, path), data[start:]
        if (drop := self.drop_after.pop(key, None)) is not None:
            request.wfile.write(rest[:drop])
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(2)  # mid-file: the client sees the body end early
            return
        if (stall := self.stall_after.get(key)) is not None:
            request.wfile.write(rest[:stall])
            request.wfile.flush()
            self.stalled.set()
            self.release.wait()
            rest = rest[stall:]
        request.wfile.write(rest)

    @staticmethod
    def _error(request: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        request.send_response(status)
        request.send_header("X-Error-Code", code)
        request.send_header("X-Error-Message", message)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)
