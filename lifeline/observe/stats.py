"""What an engine reports about itself at one moment, read by `/metrics` and `/health`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int = 0
    """Requests in the running batch."""
    num_waiting: int = 0
    """Requests waiting to be scheduled."""
    kv_usage: float = 0.0
    """Fraction of KV cache blocks in use (1 means full)."""
    kv_blocks_used: int = 0
    """KV cache blocks held by requests (every cache group's)."""
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the engine started."""
    prefix_cache_hits: int = 0
    """Prompt tokens found in the prefix cache since the engine started."""
    num_preemptions: int = 0
    """Requests preempted (to be recomputed) since the engine started."""
    step_errors: int = 0
    """Steps that raised; the engine went on."""
    step_error_requests: int = 0
    """Requests those steps failed."""
    last_step_error: str | None = None
    """The exception type of the last failed step."""
    last_step_error_time: float | None = None
    """Wall-clock time (`time.time()`) of the last failed step."""
    intraop_threads: int | None = None
    """The threads each step runs with (`EngineConfig.adaptive_threads`); None: not adaptive."""
    cpu_others_cores: float | None = None
    """Cores the machine's other processes used over the governor's last reading."""
    thread_changes: int = 0
    """Times the adaptive thread count changed."""
    moe: Any = None
    """An MoE model's routing accounting (`lifeline.engine.moe_usage.MoEAccounting`), read by
    the metrics; None for a dense model or an engine in another process."""

    @classmethod
    def of(cls, engine: Any) -> EngineStats:
        """Read from an `LLMEngine` in this process. Safe from another thread: it reads only
        numbers and lengths, never iterates the engine's lists."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        errors = getattr(engine, "step_errors", None)
        threads = getattr(engine, "threads", None)
        return cls(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                   kv_usage=blocks.usage,
                   kv_blocks_used=blocks.num_blocks - blocks.num_free_blocks,
                   kv_blocks_total=blocks.num_blocks, prefix_cache_queries=blocks.stats.queries,
                   prefix_cache_hits=blocks.stats.hits,
                   num_preemptions=scheduler.num_preemptions,
                   step_errors=errors.count if errors else 0,
                   step_error_requests=errors.requests_failed if errors else 0,
                   last_step_error=errors.last_error if errors else None,
                   last_step_error_time=errors.last_time if errors else None,
                   intraop_threads=threads.threads if threads else None,
                   cpu_others_cores=threads.others if threads else None,
                   thread_changes=threads.changes if threads else 0,
                   moe=getattr(engine, "moe", None))
