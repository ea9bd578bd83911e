"""The utility calls a client may make into an EngineCore, each declared once.

A utility is an EngineCore method that a client calls by name between steps
(vLLM's UTILITY requests). Its declaration here is all there is to it:

- ``name``: the EngineCore method;
- ``args``: a msgspec Struct of its arguments, which the engine decodes typed
  (a malformed call is refused with a message, never splatted into the
  method) and the control routes (app/control.py) read from the request;
- ``result``: the type the client decodes the reply as;
- ``combine``: how a data-parallel group (core/dp_client.py) turns its
  engines' results into one answer.

A client calls ``client.call(PAUSE_SCHEDULER(mode="wait"))`` (or
``await client.call_async(...)``): calling the declaration binds its
arguments into a ``Call``, whose type carries the result's.

Imported by both processes: no torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec

from core.protocol import MemoryUsage, SchedulerStats, SleepResult

R = TypeVar("R")

PauseMode = Literal["abort", "wait", "keep"]


class UtilityArgs(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Base of every utility's arguments: by name on the wire (a control route reads them
    from a query string into the same Struct), unknown names refused."""


class NoArgs(UtilityArgs):
    pass


class ResetPrefixCacheArgs(UtilityArgs, kw_only=True):
    # Preempt the running requests first (their blocks are cached too); else refuse while any run.
    reset_running_requests: bool = False


class PauseArgs(UtilityArgs, kw_only=True):
    # What happens to the requests in the engine (core.protocol.PAUSE_MODES).
    mode: PauseMode = "abort"
    # Empty the prefix cache once paused (not with "keep", whose requests hold their blocks).
    clear_cache: bool = True


class SleepArgs(UtilityArgs, kw_only=True):
    level: Literal[1, 2] = 1  # 1: the KV cache; 2: the weights too
    mode: PauseMode = "abort"


class AddLoRAArgs(UtilityArgs, kw_only=True):
    # A core.protocol.LoRARequest's fields: the adapter's name, its number, its PEFT directory.
    lora_name: str
    lora_int_id: int
    lora_path: str


class LoRAIdArgs(UtilityArgs, kw_only=True):
    lora_id: int


class CollectiveRpcArgs(UtilityArgs, kw_only=True):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


@dataclass(frozen=True)
class Call(Generic[R]):
    """A utility with its arguments bound: what a client sends."""

    utility: Utility[R]
    args: UtilityArgs


@dataclass(frozen=True)
class Utility(Generic[R]):
    name: str
    args: type[UtilityArgs]
    result: Any  # type[R], or a generic alias msgspec decodes (list[Any])
    combine: Callable[[list[R]], R]

    def __call__(self, **kwargs: Any) -> Call[R]:
        """Bind arguments (TypeError for unknown ones, ValueError for values of the wrong type)."""
        try:
            args = msgspec.convert(kwargs, type=self.args)
        except msgspec.ValidationError as exc:
            raise ValueError(f"utility {self.name!r}: {exc}") from None
        return Call(self, args)

    def decode_args(self, raw: bytes | msgspec.Raw) -> UtilityArgs:
        """The engine's side: the arguments off the wire, typed (msgspec.ValidationError if not)."""
        return msgspec.msgpack.decode(raw, type=self.args)


def sum_structs(items: list[Any]) -> Any:
    """Field-wise sum of msgspec structs of one type (int and float fields; others from the first)."""
    first = items[0]
    values = {}
    for field in first.__struct_fields__:
        column = [getattr(item, field) for item in items]
        values[field] = sum(column) if all(isinstance(v, (int, float)) for v in column) else column[0]
    return type(first)(**values)


def _combine_stats(results: list[SchedulerStats]) -> SchedulerStats:
    combined = sum_structs(results)
    combined.kv_cache_usage = sum(r.kv_cache_usage for r in results) / len(results)  # each engine's fraction
    return combined


def _combine_sleep(results: list[SleepResult]) -> SleepResult:
    return SleepResult(
        level=results[0].level,
        before=sum_structs([r.before for r in results]),
        after=sum_structs([r.after for r in results]),
    )


def _union(results: list[list[int]]) -> list[int]:
    return sorted({item for result in results for item in result})


def _concat(results: list[list[Any]]) -> list[Any]:
    return [item for result in results for item in result]


GET_SCHEDULER_STATS: Utility[SchedulerStats] = Utility("get_scheduler_stats", NoArgs, SchedulerStats, _combine_stats)
GET_NUM_UNFINISHED_REQUESTS: Utility[int] = Utility("get_num_unfinished_requests", NoArgs, int, sum)
RESET_PREFIX_CACHE: Utility[bool] = Utility("reset_prefix_cache", ResetPrefixCacheArgs, bool, all)
PAUSE_SCHEDULER: Utility[bool] = Utility("pause_scheduler", PauseArgs, bool, all)
RESUME_SCHEDULER: Utility[bool] = Utility("resume_scheduler", NoArgs, bool, all)
IS_SCHEDULER_PAUSED: Utility[bool] = Utility("is_scheduler_paused", NoArgs, bool, all)
SLEEP: Utility[SleepResult] = Utility("sleep", SleepArgs, SleepResult, _combine_sleep)
WAKE_UP: Utility[MemoryUsage] = Utility("wake_up", NoArgs, MemoryUsage, sum_structs)
IS_SLEEPING: Utility[bool] = Utility("is_sleeping", NoArgs, bool, all)
COLLECTIVE_RPC: Utility[list[Any]] = Utility("collective_rpc", CollectiveRpcArgs, list[Any], _concat)
ADD_LORA: Utility[bool] = Utility("add_lora", AddLoRAArgs, bool, all)
REMOVE_LORA: Utility[bool] = Utility("remove_lora", LoRAIdArgs, bool, any)
PIN_LORA: Utility[bool] = Utility("pin_lora", LoRAIdArgs, bool, all)
LIST_LORAS: Utility[list[int]] = Utility("list_loras", NoArgs, list[int], _union)

UTILITIES: dict[str, Utility[Any]] = {
    u.name: u
    for u in (
        GET_SCHEDULER_STATS, GET_NUM_UNFINISHED_REQUESTS, RESET_PREFIX_CACHE, PAUSE_SCHEDULER, RESUME_SCHEDULER,
        IS_SCHEDULER_PAUSED, SLEEP, WAKE_UP, IS_SLEEPING, COLLECTIVE_RPC, ADD_LORA, REMOVE_LORA, PIN_LORA,
        LIST_LORAS,
    )
}


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    """The UTILITY message's body: the method's arguments travel encoded on their own,
    so that the engine decodes them as that method's ``args``."""

    client_index: int
    call_id: int
    method: str
    args: msgspec.Raw


def encode_call(call: Call[Any], call_id: int) -> UtilityCall:
    return UtilityCall(0, call_id, call.utility.name, msgspec.Raw(msgspec.msgpack.encode(call.args)))
