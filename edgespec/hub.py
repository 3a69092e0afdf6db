"""Models by their Hugging Face hub name, as llama-server's `-hf` takes them:

    hf:OWNER/REPO             the repo's Q4_K_M, else its Q8_0, else its first GGUF
    hf:OWNER/REPO:QUANT       the quant named (case-insensitive: q8_0 is Q8_0)
    hf:OWNER/REPO/FILE.gguf   the file named

A split GGUF (-00001-of-0000N.gguf) is fetched whole. The repo's listing (each file's size and
the sha256 the hub keeps for it, its LFS object id) is kept in the model cache: a name whose
files are cached and verified is used with no network call at all (offline, or with the network
down); `edgespec pull` lists the repo again. The files are fetched by registry.pull, as the
registry's are: resumable, and verified by that sha256 before they are renamed into the cache.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from .cache import cache_dir, replace_atomically
from .errors import EdgespecError
from .registry import ModelEntry, hub_endpoint, hub_reachable, is_cached, pull, verify_cached

PREFIX = "hf:"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama-server's order when no quant is named
SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-")  # GGUFs beside a model that are not one
QUANT = re.compile(r"(?i)(?<![A-Z0-9])((?:I?Q\d+(?:_[A-Z0-9]+)*)|BF16|F16|F32)(?=[-.])")
REPO = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def split_parts(name: str) -> list[str]:
    """The file names of every part of a split GGUF, given its first part's (llama.cpp's gguf-split
    names them -0000i-of-0000N); any other name alone."""
    split = SPLIT.search(name)
    if split is None:
        return [name]
    stem, count = name[: split.start()], int(split.group(2))
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def is_hub_name(name: object) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


@dataclass(frozen=True)
class HubName:
    """What an hf: name asks for: a repo, and a quant or a file in it (neither: the default quant)."""

    repo: str
    quant: str | None = None
    file: str | None = None

    @classmethod
    def parse(cls, name: str) -> HubName:
        rest = name.removeprefix(PREFIX)
        repo, _, quant = rest.partition(":")
        owner, _, path = repo.partition("/")
        repo_name, _, file = path.partition("/")
        repo = f"{owner}/{repo_name}"
        odd_file = file and (not file.endswith(".gguf") or {"", ".", ".."} & set(file.split("/")))
        if not REPO.fullmatch(repo) or odd_file or (quant and file):
            raise EdgespecError(
                f"'{name}' is not a hub model name; write hf:OWNER/REPO, hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf"
            )
        return cls(repo, quant or None, file or None)

    def __str__(self) -> str:
        return PREFIX + self.repo + (f":{self.quant}" if self.quant else "") + (f"/{self.file}" if self.file else "")


@dataclass(frozen=True)
class HubFile:
    """A file of a repo, as the hub lists it: sha256 is None for a file outside LFS."""

    path: str
    size: int
    sha256: str | None


def resolve(name: str, *, offline: bool = False, progress: bool = True) -> Path:
    """The cached, verified file a hub name stands for (its first part, for a split GGUF: llama.cpp
    finds the others beside it), fetched first if it is not cached."""
    wanted = HubName.parse(name)
    listed = _read_listing(wanted.repo)
    if listed is not None:
        try:
            parts = choose(wanted, listed)
        except EdgespecError:
            parts = []  # not in the listing kept: the repo may have it now
        if parts and all(is_cached(part) for part in parts):
            return [verify_cached(part) for part in parts][0]
    if offline or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise EdgespecError(f"{wanted} is not downloaded; run `edgespec pull {wanted}` once with the network on")
    return _fetch(wanted, progress)


def pull_name(name: str, *, offline: bool = False, progress: bool = True) -> Path:
    """As resolve(), but the repo is listed again first (its files may have changed), unless offline."""
    if offline:
        return resolve(name, offline=True, progress=progress)
    return _fetch(HubName.parse(name), progress)


def _fetch(wanted: HubName, progress: bool) -> Path:
    """The files `wanted` stands for, by a fresh listing of its repo (kept for offline use), pulled."""
    files = list_repo(wanted.repo)
    _write_listing(wanted.repo, files)
    return [pull(part, progress=progress) for part in choose(wanted, files)][0]


def choose(wanted: HubName, files: list[HubFile]) -> list[ModelEntry]:
    """The entries (registry.ModelEntry) of the file `wanted` names in a repo of `files`: every part
    of a split GGUF, in order."""
    models = [f for f in files if _is_model(f.path)]
    if not models:
        raise EdgespecError(f"{PREFIX}{wanted.repo} has no GGUF model file; pick a repo with GGUF in its name")
    if wanted.file is not None:
        first = next((f for f in files if f.path == wanted.file), None)
        if first is None:
            names = ", ".join(f.path for f in models)
            raise EdgespecError(f"{PREFIX}{wanted.repo} has no file {wanted.file}; it has {names}")
    else:
        first = _by_quant(wanted, models)
    return [_entry(wanted.repo, part) for part in _parts(first, files)]


def _by_quant(wanted: HubName, models: list[HubFile]) -> HubFile:
    """As llama-server: the first model file (of a split, its first part) whose name has the quant
    followed by . or -; with no quant named, Q4_K_M, then Q8_0, then the first model file."""
    heads = [f for f in models if (m := SPLIT.search(f.path)) is None or int(m.group(1)) == 1]
    for quant in [wanted.quant] if wanted.quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(quant) + r"[.-]", re.IGNORECASE)
        if found := next((f for f in heads if pattern.search(f.path)), None):
            return found
    if wanted.quant is None:
        return heads[0]
    quants = sorted({m.group(1).upper() for f in heads if (m := QUANT.search(f.path.rsplit("/", 1)[-1]))})
    has = ", ".join(quants) or "none with a quant in its name"
    raise EdgespecError(f"{PREFIX}{wanted.repo} has no {wanted.quant} file; it has {has}")


def _parts(first: HubFile, files: list[HubFile]) -> list[HubFile]:
    """A file and, if it is the first part of a split GGUF, the other parts (all must be listed)."""
    names = split_parts(first.path)
    if len(names) == 1:
        return [first]
    by_path = {f.path: f for f in files}
    if missing := [name for name in names if name not in by_path]:
        raise EdgespecError(f"{first.path} is split in {len(names)} parts but the repo lacks {', '.join(missing)}")
    return [by_path[name] for name in names]


def _entry(repo: str, file: HubFile) -> ModelEntry:
    if file.sha256 is None:
        raise EdgespecError(
            f"{PREFIX}{repo}/{file.path} has no sha256 on the hub (not an LFS file), so it cannot be verified;"
            " download it yourself and give its path"
        )
    # one folder for all models: the repo in the name; a split's parts keep their common prefix
    cached_name = f"{repo}/{file.path}".replace("/", "--")
    return ModelEntry(
        f"{PREFIX}{repo}/{file.path}", cached_name, file.size, file.sha256, hf={"repo": repo, "file": file.path}
    )


def _is_model(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(word in name for word in NOT_MODELS)


# --- the hub's listing, and the copy kept ------------------------------------------
def list_repo(repo: str) -> list[HubFile]:
    """Every file of the repo, with its size and LFS sha256 (huggingface-hub's list_repo_tree)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        host = hub_reachable()
    except EdgespecError as e:
        raise EdgespecError(f"cannot list {repo}: {e}; connect, or run a model already downloaded") from None
    try:
        tree = HfApi(endpoint=hub_endpoint()).list_repo_tree(repo, recursive=True)
        return [HubFile(f.path, f.size, f.lfs.sha256 if f.lfs else None) for f in tree if isinstance(f, RepoFile)]
    except GatedRepoError:
        raise EdgespecError(
            f"{PREFIX}{repo} is gated: accept its terms on the hub, then log in (set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise EdgespecError(f"no repo {repo} on the hub (or it is private: set HF_TOKEN); check the name") from None
    except (OSError, ValueError, *HfHubHTTPError.__bases__) as e:  # its HTTP client's errors among them
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EdgespecError(f"could not list {repo} on {host} ({first}); check your network") from None


def _listing_path(repo: str) -> Path:
    return cache_dir() / "models" / "hub" / (repo.replace("/", "--") + ".json")


def _read_listing(repo: str) -> list[HubFile] | None:
    try:
        return [HubFile(**f) for f in json.loads(_listing_path(repo).read_text())["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none kept (or damaged): list the repo again


def _write_listing(repo: str, files: list[HubFile]) -> None:
    path = _listing_path(repo)
    path.parent.mkdir(parents=True, exist_ok=True)
    listing = json.dumps({"repo": repo, "files": [asdict(f) for f in files]}).encode()
    replace_atomically(path, lambda f: f.write(listing))  # never a half-written listing


@dataclass(frozen=True)
class Downloaded:
    """A hub model in the cache: the name that loads it, and its bytes (all parts of a split)."""

    name: str
    size: int


def downloaded() -> list[Downloaded]:
    """Every hub model whose files are all in the cache and verified, by the listings kept."""
    found = []
    for listing in sorted((cache_dir() / "models" / "hub").glob("*.json")):
        repo = listing.stem.replace("--", "/", 1)
        files = _read_listing(repo) or []
        for file in files:
            if not _is_model(file.path) or ((split := SPLIT.search(file.path)) and int(split.group(1)) != 1):
                continue
            try:
                parts = choose(HubName(repo, file=file.path), files)
            except EdgespecError:
                continue  # a part outside LFS, or missing
            if all(is_cached(part) for part in parts):
                found.append(Downloaded(f"{PREFIX}{repo}/{file.path}", sum(part.size for part in parts)))
    return found
