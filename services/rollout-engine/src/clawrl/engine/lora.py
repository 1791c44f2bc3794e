"""LoRA serving as SGLang defines it, independent of how adapters run: `--lora-paths` entries,
target-module names, and the registry of loaded adapters and the requests using them.

The registry follows SGLang's (python/sglang/srt/lora/lora_registry.py): every load gets a new
id (so a name loaded again never shares cached KV with its predecessor); a request takes its
adapter by name when it is admitted and holds it until it ends; unloading removes the name at
once and then waits until no request holds the adapter. As in SGLang's tokenizer manager, an
unload does not forget where the adapter came from: a later request naming it loads it again
from that path (`history`); only a name never loaded is refused. Names are kept from least to
most recently used: `--max-loaded-loras` unloads the first unpinned one (SGLang's registry is an
LRU too). Only the event loop touches a registry.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from clawrl.engine.protocol import RequestError

# SGLang groups the projections it fuses: an adapter on k_proj fits a server configured for
# q_proj, as both are part of qkv_proj.
FUSED_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
ALL_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraError(RequestError):
    """A LoRA request SGLang would refuse (a 400 with its message)."""


class AdapterNotLoaded(LoraError):
    """A request names an adapter that is not loaded."""


@dataclass(frozen=True)
class LoraRef:
    """One loaded adapter. `key` is unique per load (SGLang's lora_id)."""

    name: str
    path: str
    pinned: bool = False
    key: str = field(default_factory=lambda: uuid.uuid4().hex)


def parse_lora_path(spec: str) -> tuple[str, str, bool]:
    """(name, path, pinned) of one `--lora-paths` entry: `PATH` (named by itself), `NAME=PATH`
    or JSON `{"lora_name", "lora_path", "pinned"}`."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            entry = json.loads(spec)
            name, path = entry["lora_name"], entry["lora_path"]
        except (ValueError, KeyError, TypeError) as exc:
            raise LoraError(
                f"--lora-paths entry {spec!r}: a JSON entry needs lora_name and lora_path"
            ) from exc
        return str(name), str(path), bool(entry.get("pinned", False))
    name, sep, path = spec.partition("=")
    if not sep:
        return spec, spec, False
    if not name or not path:
        raise LoraError(f"--lora-paths entry {spec!r} is not NAME=PATH")
    return name, path, False


def normalized_modules(names: list[str] | set[str] | tuple[str, ...]) -> set[str]:
    """Target modules as SGLang compares them (fused groups; `all` is every group)."""
    if "all" in names:
        return set(ALL_MODULES)
    return {FUSED_MODULES.get(name, name) for name in names}


def model_adapter(model: str | None) -> str | None:
    """The adapter of an OpenAI `model` written `base-model:adapter-name` (SGLang's syntax;
    split at the first colon), else None."""
    if not model or ":" not in model:
        return None
    return model.split(":", 1)[1].strip() or None


def never_loaded(name: str, known: list[str]) -> AdapterNotLoaded:
    return AdapterNotLoaded(
        f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {known}."
    )


def not_enabled(name: str) -> LoraError:
    return LoraError(
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
        "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
        "endpoint."
    )


class LoraRegistry:
    """The adapters a server holds, by name, and how many requests use each."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoraRef] = {}
        # Every adapter ever loaded, by name: what a request naming an unloaded one reloads.
        self.history: dict[str, LoraRef] = {}
        self._users: dict[str, int] = {}  # by key
        self._idle: dict[str, asyncio.Event] = {}  # by key: set while nobody uses it

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def loaded(self) -> dict[str, str]:
        """name -> path of every registered adapter (SGLang's loaded_adapters), least recently
        used (or loaded) first."""
        return {ref.name: ref.path for ref in self._by_name.values()}

    def least_recently_used(self) -> str | None:
        """The unpinned adapter loaded or used longest ago (what --max-loaded-loras unloads)."""
        return next((ref.name for ref in self._by_name.values() if not ref.pinned), None)

    def refs(self) -> list[LoraRef]:
        return list(self._by_name.values())

    def register(self, ref: LoraRef) -> None:
        if ref.name in self._by_name:
            raise LoraError(f"Failed to load LoRA adapter {ref.name} because it is already loaded")
        self._by_name[ref.name] = ref
        self.history[ref.name] = ref
        self._users[ref.key] = 0
        self._idle[ref.key] = asyncio.Event()
        self._idle[ref.key].set()

    def unregister(self, name: str) -> LoraRef:
        """Remove `name`: requests naming it are refused from now on."""
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise LoraError(
                f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self._by_name)}"
            )
        return ref

    def acquire(self, name: str) -> LoraRef:
        """The adapter a new request uses, counted until `release`; it becomes the most
        recently used."""
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise AdapterNotLoaded(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: {list(self._by_name)}."
            )
        self._by_name[name] = ref  # to the end: the names run from least to most recently used
        self._users[ref.key] += 1
        self._idle[ref.key].clear()
        return ref

    def release(self, ref: LoraRef) -> None:
        self._users[ref.key] -= 1
        if self._users[ref.key] == 0:
            self._idle[ref.key].set()

    def users(self, ref: LoraRef) -> int:
        return self._users.get(ref.key, 0)

    async def wait_unused(self, ref: LoraRef) -> None:
        """Until no request uses the (unregistered) adapter; then forget its counter."""
        await self._idle[ref.key].wait()
        del self._users[ref.key], self._idle[ref.key]
