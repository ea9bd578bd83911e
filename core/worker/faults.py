"""Test-only fault injection, to prove what a failing model step does to the server.

``RINGLLM_FAULT_INJECT=step:N`` makes the N-th model step (counted from 1)
raise :class:`InjectedFault` inside the executor, exactly where a CUDA error
or a kernel bug would surface: the EngineCore reports ENGINE_CORE_DEAD and
exits, and the frontend fails every stream. Read once when the executor is
built; unset (always, outside tests) it costs nothing per step.
"""

from __future__ import annotations

from core import envs

FAULT_ENV = "RINGLLM_FAULT_INJECT"


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, fail_at_step: int) -> None:
        if fail_at_step < 1:
            raise ValueError(f"{FAULT_ENV}: the step must be >= 1, got {fail_at_step}")
        self.fail_at_step = fail_at_step
        self.steps = 0

    def before_step(self) -> None:
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise InjectedFault(f"fault injected at model step {self.steps} ({FAULT_ENV})")


def fault_injector_from_env() -> FaultInjector | None:
    spec = envs.get(FAULT_ENV)
    if not spec:
        return None
    kind, _, value = spec.partition(":")
    if kind != "step" or not value.isdigit():
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected step:N")
    return FaultInjector(int(value))
