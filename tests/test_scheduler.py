"""The scheduler and KV block manager on token counts alone: no model, no torch."""
import hashlib
import struct
import subprocess
import sys

import pytest

from lifeline.engine.block_manager import ROOT_HASH, BlockManager, hash_block, hash_chain
from lifeline.engine.request import FinishReason, Request, RequestStatus
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.scheduler import Scheduler, SchedulerConfig


def make_request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule(now=0.0)
    sampled = {id(s.request): token for s in out.scheduled if s.samples}
    finished = sched.update(out, sampled)
    return out, finished


def test_scheduler_and_block_manager_never_import_torch():
    code = ("import sys, lifeline.engine.scheduler, lifeline.engine.block_manager, "
            "lifeline.engine.kv_layout, lifeline.model.presets; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_one_budget_mixes_decodes_and_prefill_chunks():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), BlockManager(64, 4))
    short = make_request("short", list(range(10)))
    sched.add_request(short)
    run_step(sched)
    assert short.num_output_tokens == 1
    long = make_request("long", list(range(100, 200)))
    sched.add_request(long)
    out, _ = run_step(sched)
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["short"].num_new_tokens == 1
    assert by_id["long"].num_new_tokens == 31
    assert not by_id["long"].samples
    assert out.num_tokens == 32
    while long.num_output_tokens == 0:
        run_step(sched)
    assert long.timeline.first_scheduled == 0.0
    assert long.num_computed_tokens == 100


def test_max_num_seqs_caps_running_requests():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2), BlockManager(64, 4))
    for i in range(3):
        sched.add_request(make_request(str(i), [1, 2, 3]))
    out, _ = run_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_prefix_cache_shares_physical_blocks_and_counts_hits():
    kv = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    system = list(range(50, 62))
    a = make_request("a", system + [1, 2], max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    assert a.is_finished
    b = make_request("b", system + [3, 4, 5])
    sched.add_request(b)
    out, _ = run_step(sched)
    assert b.num_cached_tokens == 12
    assert out.scheduled[0].num_new_tokens == 3
    assert kv.stats.hits == 12
    c = make_request("c", system + [9])
    sched.add_request(c)
    run_step(sched)
    assert kv.block_table(b)[:3] == kv.block_table(c)[:3]
    assert all(kv.blocks[i].ref_cnt == 2 for i in kv.block_table(b)[:3])


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    prompt = list(range(8))
    for rid in ("a", "b"):
        req = make_request(rid, prompt, max_tokens=1)
        sched.add_request(req)
        out, _ = run_step(sched)
    assert req.num_cached_tokens == 4
    assert out.scheduled[0].num_new_tokens == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = BlockManager(6, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    a = make_request("a", list(range(8)) + [100], max_tokens=1)
    sched.add_request(a)
    run_step(sched)
    assert len(kv.cached) == 2 and kv.num_free_blocks == 6
    filler = make_request("f", list(range(200, 216)) + [1], max_tokens=1)
    sched.add_request(filler)
    run_step(sched)
    # the filler needed 5 of 6 blocks: the least recently freed cached block survives
    assert len(kv.cached) >= 1
    again = make_request("a2", list(range(8)) + [101], max_tokens=1)
    sched.add_request(again)
    run_step(sched)
    assert again.num_cached_tokens in (4, 8)


def test_preemption_by_recompute_when_blocks_run_out():
    kv = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    reqs = [make_request(str(i), list(range(i * 10, i * 10 + 7)), max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished() and steps < 500:
        run_step(sched)
        steps += 1
    assert all(r.is_finished and r.num_output_tokens == 12 for r in reqs)
    assert sched.num_preemptions > 0
    assert any(r.timeline.preemptions for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_returns_blocks_and_stop_conditions():
    kv = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    req = make_request("a", [1, 2, 3, 4, 5])
    sched.add_request(req)
    run_step(sched)
    assert kv.num_free_blocks < 16
    sched.finish(req, FinishReason.ABORT)
    assert req.status is RequestStatus.FINISHED and kv.num_free_blocks == 16

    eos = Request("e", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=frozenset({7}))
    sched.add_request(eos)
    _, finished = run_step(sched, token=7)
    assert finished == [eos] and eos.finish_reason is FinishReason.STOP

    ignore = Request("i", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True),
                     eos_token_ids=frozenset({7}))
    sched.add_request(ignore)
    for _ in range(3):
        run_step(sched, token=7)
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.num_output_tokens == 3

    stop_id = Request("s", [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    sched.add_request(stop_id)
    run_step(sched, token=9)
    assert stop_id.finish_reason is FinishReason.STOP and stop_id.stop_reason == 9


def test_prompt_larger_than_the_cache_is_refused():
    sched = Scheduler(SchedulerConfig(), BlockManager(2, 4))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", list(range(20))))


def _salted(rid: str, prompt: list[int], salt: bytes, max_tokens: int = 1) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                   extra_hash_key=salt)


def test_block_digest_is_sha256_of_the_chain():
    """Pins the encoding: a prefix hit rests on SHA-256, never on Python's hash() of a tuple."""
    first, second = list(range(100, 104)), [262_143, 0, 7, 2**31]
    want = hashlib.sha256(ROOT_HASH + (3).to_bytes(8, "little") + b"abc"
                          + struct.pack("<4I", *first)).digest()
    assert hash_block(None, first, b"abc") == want
    want2 = hashlib.sha256(want + struct.pack("<4I", *second)).digest()
    assert hash_chain(None, first + second + [1, 2], 4, b"abc") == [want, want2]
    assert hash_block(want, second) == want2


def test_the_salt_is_length_prefixed_and_reaches_every_block():
    tokens = list(range(12))
    plain = hash_chain(None, tokens, 4)
    salted = hash_chain(None, tokens, 4, b"tenant-a")
    assert all(a != b for a, b in zip(plain, salted))
    assert hash_chain(None, tokens, 4, b"tenant-a") == salted
    # Moving bytes between salt and tokens never gives the same block.
    assert hash_block(None, [1, 2], b"") != hash_block(None, [2], struct.pack("<I", 1))


def test_hashes_computed_step_by_step_equal_the_whole_chain():
    kv = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv)
    req = _salted("a", list(range(30, 45)), b"s", max_tokens=11)
    sched.add_request(req)
    while not req.is_finished:
        run_step(sched, token=9)
    assert req.block_hashes == hash_chain(None, req.all_token_ids[:24], 4, b"s")


def test_different_salts_never_share_blocks_equal_salts_do():
    kv = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    prompt = list(range(50, 63))
    first = _salted("a", prompt, b"tenant-a")
    sched.add_request(first)
    run_step(sched)
    assert first.is_finished and first.num_cached_tokens == 0
    for rid, salt in (("b", b"tenant-b"), ("c", b"")):
        other = _salted(rid, prompt, salt)
        sched.add_request(other)
        run_step(sched)
        assert other.num_cached_tokens == 0, f"salt {salt!r} read tenant-a's blocks"
    assert len(kv.cached) == 3 * 3, "each salt registered its own three blocks"
    again = _salted("d", prompt, b"tenant-a", max_tokens=4)
    sched.add_request(again)
    run_step(sched)
    assert again.num_cached_tokens == 12
    assert kv.block_table(again)[:3] == kv.find_cached_prefix(_salted("e", prompt, b"tenant-a"))
