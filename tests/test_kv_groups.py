"""Sliding-window layers in their own KV group: blocks their window left behind go back to the
pool, prefix hits count only as far as every group has the blocks a query reads, and a hybrid
model still gives transformers' logits and greedy continuations."""
import pytest

from lifeline.engine.block_manager import NULL_BLOCK, BlockManager, KVCacheManager
from lifeline.engine.kv_layout import kv_bytes_per_token, plan_kv
from lifeline.engine.request import Request
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.scheduler import Scheduler, SchedulerConfig
from lifeline.model.presets import preset_config


def _request(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                               ignore_eos=True))


def _prefill(sched: Scheduler, req: Request) -> None:
    """Run the scheduler with a stand-in executor until `req` has its first token."""
    sched.add_request(req)
    while not req.output_token_ids:
        out = sched.schedule(now=0.0)
        sched.update(out, {id(s.request): 1 for s in out.scheduled if s.samples})


def _hybrid(window: int, full_blocks: int, window_blocks: int, bs: int = 4,
            chunk: int = 16) -> KVCacheManager:
    return KVCacheManager([BlockManager(full_blocks, bs, True, None, chunk),
                           BlockManager(window_blocks, bs, True, window, chunk)], [1, 1])


def test_window_group_keeps_only_the_blocks_its_window_reads():
    kv = _hybrid(window=8, full_blocks=64, window_blocks=10)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    req = _request("a", list(range(100)), max_tokens=30)
    _prefill(sched, req)
    full, window = kv.groups
    assert full.num_blocks_held(req) == 25  # 100 tokens, every block kept
    # The next query (position 100) reads positions 93..100: blocks 23, 24, 25.
    assert window.block_table(req)[:23] == [NULL_BLOCK] * 23
    assert window.num_blocks_held(req) == 25 - 23
    while not req.is_finished:  # decode on: the window group never grows
        out = sched.schedule(now=0.0)
        sched.update(out, {id(s.request): 1 for s in out.scheduled if s.samples})
        assert window.num_blocks_held(req) <= 8 // 4 + 2
    assert kv.num_free_blocks == kv.num_blocks


def test_a_context_longer_than_the_window_pool_still_fits():
    kv = _hybrid(window=8, full_blocks=64, window_blocks=10)
    assert kv.capacity_tokens() == 64 * 4  # bounded by the global layers only
    small = _hybrid(window=8, full_blocks=64, window_blocks=6)  # cannot hold window + chunk
    assert small.capacity_tokens() == 6 * 4


def test_prefix_hit_needs_the_window_blocks_before_it():
    kv = _hybrid(window=8, full_blocks=64, window_blocks=40)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    prompt = list(range(40))
    first = _request("a", prompt, max_tokens=1)
    sched.add_request(first)
    first_window: dict[int, int] = {}
    while not first.is_finished:
        out = sched.schedule(now=0.0)
        full_table, window_table = kv.get_blocks(first).block_ids
        for j, b in enumerate(window_table):  # before the step gives any back
            first_window.setdefault(j, b)
        first_full = list(full_table)
        sched.update(out, {id(s.request): 1 for s in out.scheduled if s.samples})
    again = _request("b", prompt + [7, 8, 9, 10, 11])
    hit = kv.find_cached_prefix(again)
    # a computed 10 blocks; every full and window block of them is still cached.
    assert len(hit) == 10
    entries = list(zip(*hit))
    assert entries[1] == (NULL_BLOCK,) * 8 + (first_window[8], first_window[9])  # a query at 40
    assert entries[0] == tuple(first_full[:10])                           # reads blocks 8, 9


def test_evicted_window_blocks_shorten_the_hit_to_what_every_group_has():
    kv = _hybrid(window=8, full_blocks=64, window_blocks=12)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    prompt = list(range(40))
    _prefill(sched, _request("a", prompt, max_tokens=1))
    # Another long prompt cycles the small window pool and evicts a's window blocks.
    _prefill(sched, _request("x", list(range(1000, 1100)), max_tokens=1))
    full, window = kv.groups
    again = _request("b", prompt + [7, 8, 9, 10, 11])
    hashes = full.prefix_hashes(again)
    assert full.valid_hits(hashes)[10]  # the global layers still have all 10 blocks of a
    hit = kv.find_cached_prefix(again)
    m = len(hit)
    assert m < 10
    # Whatever hit is granted, the window group can serve it.
    assert window.valid_hits(hashes)[m]


@pytest.mark.parametrize("context", [4096, 32768, 131072])
def test_manager_accounting_equals_the_formula_for_gemma_3(context):
    """The figure docs/moe.md prints: bytes the KV manager holds for one request at the end of
    its prefill, against layers × tokens × bytes per token-layer (window layers: window)."""
    cfg = preset_config("gemma-3-1b")
    layout = plan_kv(cfg, 16, num_blocks=context // 16 + 64, max_num_batched_tokens=2048,
                     dtype_bytes=2)
    kv = layout.manager(enable_prefix_caching=False, max_chunk_tokens=2048)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_model_len=context + 8),
                      kv)
    req = _request("long", [5] * context, max_tokens=2)
    _prefill(sched, req)
    per_layer = kv_bytes_per_token(cfg, 2)
    full_layers = sum(t == "full" for t in cfg.layer_types)
    sliding_layers = cfg.num_layers - full_layers
    formula = per_layer * (full_layers * context + sliding_layers * min(context,
                                                                         cfg.sliding_window))
    held = kv.bytes_held(req)
    # Blocks round up: at most one extra block per group.
    assert formula <= held <= formula + 2 * 16 * per_layer * max(full_layers, sliding_layers)
    no_window = plan_kv(cfg, 16, num_blocks=context // 16 + 64, dtype_bytes=2,
                        sliding_window_kv=False)
    assert not no_window.hybrid
    assert held < per_layer * cfg.num_layers * context


def test_memory_budget_gives_the_global_layers_what_the_window_does_not_need():
    cfg = preset_config("gemma-3-270m")
    budget = 2 << 30
    layout = plan_kv(cfg, 16, memory_bytes=budget, max_num_seqs=64,
                     max_num_batched_tokens=512)
    full, window = layout.groups
    assert (full.num_layers, window.num_layers) == (3, 15)
    assert window.num_blocks == 64 * (512 // 16 + 2) + 512 // 16
    assert layout.total_bytes <= budget
    flat = plan_kv(cfg, 16, memory_bytes=budget, sliding_window_kv=False)
    # Tokens of context the global layers can hold: about 3x what one shared pool gave.
    assert full.num_blocks > 2.5 * flat.groups[0].num_blocks


@pytest.mark.parametrize("context,seqs", [(16384, 16), (32768, 64), (2048, 64)])
def test_kv_sized_by_need_holds_what_llamacpp_allocates_for_the_same_context(context, seqs):
    """No budget given: the global layers hold the served context (shared by the requests, as
    llama-server's `-c`), the window layers llama.cpp's iSWA cache, `min(n_ctx, n_swa * n_seq
    + n_ubatch)` tokens (llama-kv-cache-iswa.cpp), plus our two blocks a request of slack."""
    cfg = preset_config("gemma-3-270m")
    layout = plan_kv(cfg, 16, context_tokens=context, max_num_seqs=seqs,
                     max_num_batched_tokens=512, dtype_bytes=2)
    full, window = layout.groups
    assert full.num_blocks * 16 == context
    llamacpp_swa_tokens = min(context, cfg.sliding_window * seqs + 512)
    assert llamacpp_swa_tokens <= window.num_blocks * 16 <= llamacpp_swa_tokens + seqs * 2 * 16
    assert window.num_blocks <= full.num_blocks
    per_token_layer = kv_bytes_per_token(cfg, 2)
    llamacpp_bytes = per_token_layer * (3 * context + 15 * llamacpp_swa_tokens)
    assert llamacpp_bytes <= layout.total_bytes <= 1.1 * llamacpp_bytes
    assert layout.manager(True, 512).capacity_tokens() >= context
    # a model whose layers are all global: the context, nothing more
    flat = plan_kv(preset_config("llama-3.1-8b"), 16, context_tokens=context, max_num_seqs=seqs)
    assert not flat.hybrid and flat.groups[0].num_blocks * 16 == context


def test_the_engine_default_serves_the_whole_context_without_a_budget():
    """`EngineConfig()` gives no KV budget: the pool holds the served context, so the context
    is never clamped by the cache (it was, at the old 2 GiB default, for long-context models)."""
    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.engine.executor import Executor

    class Nothing(Executor):  # the pool's sizing only: no step runs
        compiled = False

        def __init__(self, layout):
            self.layout = layout

        def execute(self, scheduled):
            raise AssertionError("no step runs here")

    class Loaded:
        config = preset_config("gemma-3-270m")
        tokenizer = None

    engine = LLMEngine(Loaded(), EngineConfig(max_model_len=8192), executor=Nothing)
    full, window = engine.kv_layout.groups
    assert full.num_blocks * 16 == 8192 and engine.max_model_len_reason != "kv_cache"
    assert engine.config.kv_dtype_bytes == 4
    half = LLMEngine(Loaded(), EngineConfig(max_model_len=8192, kv_cache_dtype="fp16"),
                     executor=Nothing)
    assert half.kv_layout.total_bytes * 2 == engine.kv_layout.total_bytes


def test_a_block_no_prefix_keeps_is_written_again_before_a_block_never_written():
    """The pools hold memory only where written: a finished request's unregistered blocks are
    the next ones handed out, registered ones wait at the back (evicted last), and blocks never
    written come in between, so the process grows with the cache's use."""
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    first = _request("a", [1] * 10)
    assert bm.allocate(first, 10)
    held = bm.block_table(first)
    bm.free(first)
    second = _request("b", [2] * 10)
    assert bm.allocate(second, 10)
    assert sorted(bm.block_table(second)) == sorted(held)
    cached = BlockManager(16, 4, enable_prefix_caching=True)
    third = _request("c", [3] * 8)
    assert cached.allocate(third, 8)
    third.num_computed_tokens = 8
    cached.commit(third)
    kept = cached.block_table(third)
    cached.free(third)
    fourth = _request("d", [4] * 8)
    assert cached.allocate(fourth, 8)
    assert not set(cached.block_table(fourth)) & set(kept)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    import torch
    import transformers

    from tests.test_models_hf import _config  # window 8: sliding, sliding, full

    torch.manual_seed(0)
    cfg = _config("gemma3")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, std=0.3)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("window_blocks", [64, 14])
def test_shared_prefixes_through_a_hybrid_cache_give_transformers_greedy(tiny_gemma,
                                                                         window_blocks):
    from lifeline import LLM
    from tests.reference.tiny_hf import hf_greedy, random_prompt

    model, path = tiny_gemma
    llm = LLM(path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    kv = llm.engine.block_manager
    assert [g.window for g in kv.groups] == [None, 8]
    if window_blocks != 64:  # a window pool so small that cached window blocks get evicted
        kv.groups[1] = BlockManager(window_blocks, 4, True, 8, 16)
        caches = llm.engine.executor.runner.kv_caches
        caches[0] = tuple(t[:window_blocks * 4] for t in caches[0])
        caches[1] = tuple(t[:window_blocks * 4] for t in caches[1])
    prefix = random_prompt(30, 1, 320)
    prompts = [prefix + random_prompt(n, 10 + n, 320) for n in (3, 9, 1, 14)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, params)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(model, p, 8)
    assert any(r.num_cached_tokens >= 24 for r in results)
    assert kv.num_free_blocks == kv.num_blocks


def test_a_model_whose_layers_all_slide_matches_transformers(tmp_path):
    """Mistral 7B v0.1's layout: every layer has the window, one windowed group."""
    import torch
    import transformers

    from lifeline import LLM
    from tests.reference.tiny_hf import hf_greedy, random_prompt

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=512, head_dim=16,
        sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    model.save_pretrained(tmp_path)
    llm = LLM(tmp_path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    (group,) = llm.engine.block_manager.groups
    assert group.window == 8
    ids = random_prompt(45, 3, 320)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(llm.engine.prompt_logits(ids), ref, atol=2e-4, rtol=1e-4)
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, ids, 12)
    assert group.num_free_blocks == group.num_blocks
