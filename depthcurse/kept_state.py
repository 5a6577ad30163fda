"""What a resumable job's kept state belongs to: one identity, made by one function from the job's
whole config (every field of its dataclass, or every argument of its call) and a digest of its
inputs (token windows, models, lenses), so a field added later is in it without anyone listing it.
A job leaves out only what it names beside the call, with why: how its work is heard, timed and
kept (`HEARD`), or what adds to a run rather than changes it (select's `--seeds`).

Every sweep, select, heal, lens, depth-use's batches, depth-map's rows and speculate's prompts
compare their kept identity with this one and take nothing up on a difference (`io.refuse_other_run`,
or a fresh start where the state is a cache of the run's own). `tests/test_kept_state.py` walks every
field of each and shows that changing it is a difference."""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path

# how work is heard, timed and kept: never what it computes
HEARD = frozenset({"on_step", "on_note", "on_variant", "clock", "kept", "state", "forecast"})
SAMPLED = 4096  # a tensor of a model is digested through this many elements, evenly spaced, and its shape and dtype


def identity_of(config, *, leave_out=frozenset()) -> dict:
    """Every field of `config` (a dataclass, or a mapping of a call's arguments) in JSON's terms (`plain`),
    but those in `HEARD` and `leave_out`."""
    if is_dataclass(config) and not isinstance(config, type):
        items = {f.name: getattr(config, f.name) for f in fields(config)}
    else:
        items = dict(config)
    return {name: plain(value) for name, value in items.items() if name not in HEARD and name not in leave_out}


def call_identity(fn, arguments: dict, *, leave_out=frozenset()) -> dict:
    """The identity of a call of `fn` from its arguments as bound (`locals()` before its body changes
    any): every parameter of its signature, so a parameter added later is in it."""
    return identity_of({name: arguments[name] for name in inspect.signature(fn).parameters}, leave_out=leave_out)


def plain(value):
    """`value` as JSON holds it and compares it after a round trip: a dataclass by its fields, a tensor
    by its shape, dtype and digest, a module by `module_digest`, an object by its `identity()`; a type
    it does not know is an error (a field that would otherwise drop out of the identity unseen)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # NaN != NaN: kept as its name
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if hasattr(value, "named_parameters"):  # a torch module: a model, a lens
        return {"module": type(value).__name__, "sha256": module_digest(value)}
    if hasattr(value, "detach") and hasattr(value, "shape"):
        return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "sha256": tensors_digest(value)}
    if callable(getattr(value, "identity", None)):
        return plain(value.identity())
    raise TypeError(f"{type(value).__name__} has no identity for kept state: give it identity(), or leave the field out with why")


def file_digest(source) -> str | None:
    """Sixteen hex digits of sha256 over a file's bytes where `source` names a file (a text or prompts
    file a job reads by name), else None: a named source (wiki, c4) is the same text under its name."""
    if source is None or not Path(str(source)).expanduser().is_file():
        return None
    return hashlib.sha256(Path(str(source)).expanduser().read_bytes()).hexdigest()[:16]


def _bytes(t) -> bytes:
    import torch  # lazy: the CLI reads configs' identities before torch is needed

    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""  # as bytes: numpy has no bfloat16


def tensors_digest(*tensors) -> str:
    """Sixteen hex digits of sha256 over every byte of `tensors`: token windows, streams."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(_bytes(t))
    return digest.hexdigest()[:16]


def module_digest(module) -> str:
    """Sixteen hex digits of sha256 over every parameter's and buffer's name, shape, dtype and
    `SAMPLED` of its elements, evenly spaced: another checkpoint, dtype or architecture differs in
    them, and a billion weights are not read to say so."""
    digest = hashlib.sha256()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        digest.update(f"{name}:{list(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        digest.update(_bytes(flat[:: max(1, flat.numel() // SAMPLED)][:SAMPLED]))
    return digest.hexdigest()[:16]
