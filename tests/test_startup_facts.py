"""Startup facts: SGLang's per-rank memory lines (0.5.6 and 0.5.23 formats) and progress."""

from __future__ import annotations

from pathlib import Path

from supervisor.core.diagnosis.startup_facts import MAIN_RANK, StartupFactsParser, line_rank, parse_startup_facts
from supervisor.core.model import RankFacts


def ts(rank: str = "") -> str:
    return f"[2026-03-01 12:00:00{' ' + rank if rank else ''}] "


LOG_056 = "\n".join([
    ts() + "server_args=ServerArgs(model_path='deepseek-ai/DeepSeek-V3', tp_size=2, mem_fraction_static=0.93)",
    ts("TP0") + "Load weight begin. avail mem=139.23 GB",
    ts("TP1") + "Load weight begin. avail mem=139.23 GB",
    "Loading safetensors checkpoint shards:  50% Completed | 81/163 [00:35<00:35,  2.31it/s]",
    ts("TP0") + "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=56.12 GB, mem usage=83.11 GB.",
    ts("TP1") + "Load weight end. type=DeepseekV3ForCausalLM, dtype=torch.bfloat16, avail mem=56.20 GB, mem usage=83.03 GB.",
    ts("TP0") + "KV Cache is allocated. #tokens: 1200000, K size: 20.06 GB, V size: 20.06 GB",
    ts("TP1") + "KV Cache is allocated. #tokens: 1199000, K size: 20.05 GB, V size: 20.05 GB",
    ts("TP0") + "Memory pool end. avail mem=14.50 GB",
    ts("TP0") + "Capture cuda graph begin. This can take up to several minutes. avail mem=14.20 GB",
    "Capturing batches (bs=160 avail_mem=13.10 GB):  50%|█████     | 12/24 [00:05<00:05,  2.2it/s]",
    ts("TP0") + "Capture cuda graph end. Time elapsed: 28.12 s. mem usage=13.38 GB. avail mem=0.82 GB.",
    ts("TP1") + "Capture cuda graph end. Time elapsed: 28.30 s. mem usage=13.20 GB. avail mem=0.95 GB.",
    ts("TP0") + "max_total_num_tokens=1200000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=4096, context_len=163840, available_gpu_mem=0.82 GB",
    ts("TP1") + "max_total_num_tokens=1199000, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=4096, context_len=163840, available_gpu_mem=0.95 GB",
    ts("TP0") + "Allocating 40.00 GB host memory for hierarchical KV cache.",
    ts() + "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
    ts() + 'INFO:     127.0.0.1:51234 - "POST /generate HTTP/1.1" 200 OK',
    ts() + "The server is fired up and ready to roll!",
])


def test_sglang_056_format_gives_every_fact_per_rank() -> None:
    """Every 0.5.6 startup line lands in its rank's facts; the summary is the minimum."""
    facts = parse_startup_facts(LOG_056)
    assert facts.ready and facts.progress == "ready"
    assert facts.ranks["TP0"] == RankFacts(
        rank="TP0",
        avail_mem_after_weights_gb=56.12,
        weights_gb=83.11,
        kv_cache_tokens=1200000,
        kv_cache_gb=40.12,
        avail_mem_after_pool_gb=14.50,
        avail_mem_after_capture_gb=0.82,
        max_total_num_tokens=1200000,
        host_kv_pool_gb=40.0,
    )
    assert facts.ranks["TP1"].avail_mem_after_capture_gb == 0.95
    assert facts.avail_mem_after_capture_gb == 0.82
    assert facts.kv_cache_tokens == 1199000
    assert facts.max_total_num_tokens == 1199000
    assert MAIN_RANK not in facts.ranks  # the server_args / uvicorn lines carry no facts


def test_sglang_0523_format_with_mla_kv_size_and_named_host_pool() -> None:
    """0.5.23 lines: elapsed/quant fields, MLA 'KV size', per-graph capture ends, named pools."""
    log = "\n".join([
        ts("DP1 TP3") + "Load weight end. elapsed=70.12 s, type=DeepseekV3ForCausalLM, quant=fp8, avail mem=60.50 GB, mem usage=78.70 GB.",
        ts("DP1 TP3") + "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 900000, KV size: 31.50 GB",
        ts("DP1 TP3") + "Capture target decode CUDA graph end. bs=[1, 2, 4, 8, 16], elapsed=12.30 s, mem usage=2.10 GB, avail mem=3.25 GB.",
        ts("DP1 TP3") + "Capture draft decode CUDA graph end. bs=[1, 2, 4], elapsed=3.30 s, mem usage=0.50 GB, avail mem=2.75 GB.",
        ts("DP1 TP3") + "Allocating MHA hierarchical KV host pool: 1000000 tokens, 80.00 GB host memory.",
        ts("DP1 TP3") + "Allocating draft hierarchical KV host pool: 100000 tokens, 8.00 GB host memory.",
        ts("DP1 TP3") + "Allocating MHA hierarchical KV host pool: 1000000 tokens, 80.00 GB host memory.",
    ])
    rank = parse_startup_facts(log).ranks["DP1 TP3"]
    assert (rank.avail_mem_after_weights_gb, rank.weights_gb) == (60.50, 78.70)
    assert (rank.kv_cache_tokens, rank.kv_cache_gb) == (900000, 31.50)
    assert rank.avail_mem_after_capture_gb == 2.75  # the last capture, not the first
    assert rank.host_kv_pool_gb == 88.0  # two pools; a repeated line is not counted twice


def test_capture_end_without_avail_mem_gives_no_headroom_fact() -> None:
    """Old capture lines without 'avail mem' move the progress but state no headroom."""
    facts = parse_startup_facts(ts("TP0") + "Capture cuda graph end. Time elapsed: 27.74 s\n")
    assert facts.progress == "capture"
    assert facts.avail_mem_after_capture_gb is None


def test_progress_bars_do_not_count_as_capture_end_values() -> None:
    """A bar's avail_mem is not the headroom after capture; a fact glued after a bar is read."""
    bar = "Capturing batches (bs=1 avail_mem=9.99 GB): 100%|██████████| 24/24 [00:10<00:00,  2.40it/s]"
    facts = parse_startup_facts(bar + "\n")
    assert facts.progress == "capture" and facts.avail_mem_after_capture_gb is None
    glued = bar + ts("TP1") + "Capture cuda graph end. Time elapsed: 9.1 s. mem usage=1.00 GB. avail mem=4.40 GB."
    facts = parse_startup_facts(glued + "\n" + bar + "\r" + ts("TP2") + "Memory pool end. avail mem=7.00 GB\n")
    assert facts.ranks["TP1"].avail_mem_after_capture_gb == 4.40
    assert facts.ranks["TP2"].avail_mem_after_pool_gb == 7.00
    shards = "Loading safetensors checkpoint shards: 100% Completed | 163/163 [01:10<00:00]"
    facts = parse_startup_facts(shards + ts("TP3") + "KV Cache is allocated. #tokens: 10, KV size: 1.00 GB\n")
    assert facts.ranks["TP3"].kv_cache_tokens == 10


def test_lines_without_rank_go_under_main_and_other_units_convert() -> None:
    """A rankless line is 'main'; MB values become GB."""
    facts = parse_startup_facts("KV Cache is allocated. #tokens: 5000, K size: 512.00 MB, V size: 512.00 MB\n")
    assert facts.ranks[MAIN_RANK].kv_cache_gb == 1.0


def test_feed_reports_changes_and_progress_only_moves_forward() -> None:
    """feed() is True exactly when a fact or the progress changed; progress never goes back."""
    parser = StartupFactsParser()
    assert parser.facts.progress == "unknown"
    assert parser.feed("hello") is True  # launching
    assert parser.feed("nothing here") is False
    assert parser.feed(ts("TP0") + "Memory pool end. avail mem=7.00 GB") is True
    assert parser.feed(ts("TP0") + "Memory pool end. avail mem=7.00 GB") is False
    assert parser.feed(ts("TP0") + "Load weight begin. avail mem=80.00 GB") is False  # no step back
    assert parser.facts.progress == "kv_pool"
    parser.feed(ts() + "INFO:     Uvicorn running on http://127.0.0.1:30000")
    assert parser.facts.progress == "warmup"
    snapshot = parser.facts
    assert parser.facts is snapshot  # cached until something changes


def test_line_rank_reads_sglang_vllm_and_torch_prefixes() -> None:
    """Ranks come from SGLang's bracket, vLLM's worker name, or torch's [rankN]."""
    assert line_rank("[2026-03-01 12:00:00.123 TP3] x") == "TP3"
    assert line_rank("[2026-03-01 12:00:00 DP1 TP3 EP3] x") == "DP1 TP3 EP3"
    assert line_rank("(Worker_TP7_DCP1_EP7 pid=641) ERROR x") == "TP7 EP7"
    assert line_rank("[rank6]:[E210 02:06:33] x") == "rank6"
    assert line_rank("[2026-03-01 12:00:00] no rank") is None


def test_rank_prefixes_with_any_parallel_parts() -> None:
    """DP, PP, ATTN_CP, MOE_DP, TP and EP parts, in SGLang's order, all make the rank."""
    assert line_rank("[2026-01-01 10:00:00 DP1 ATTN_CP0 TP3 EP3] Load weight end.") == "DP1 ATTN_CP0 TP3 EP3"
    assert line_rank("[2026-01-01 10:00:00 PP1 TP0] x") == "PP1 TP0"
    assert line_rank("[2026-01-01 10:00:00.123 DP0 PP1 ATTN_CP1 MOE_DP2 TP5 EP5] x") == "DP0 PP1 ATTN_CP1 MOE_DP2 TP5 EP5"
    assert line_rank("Subprocess scheduler_DP1_ATTN_CP0_TP3 (pid=1) crashed") == "DP1 ATTN_CP0 TP3"
    facts = parse_startup_facts(
        "[2026-01-01 10:00:00 DP1 ATTN_CP0 TP3 EP3] Load weight end. type=X, avail mem=50.00 GB, mem usage=30.00 GB.\n"
        "[2026-01-01 10:00:00 DP1 ATTN_CP1 TP3 EP3] Load weight end. type=X, avail mem=51.00 GB, mem usage=29.00 GB.\n"
    )
    assert facts.ranks["DP1 ATTN_CP0 TP3 EP3"].avail_mem_after_weights_gb == 50.0
    assert facts.ranks["DP1 ATTN_CP1 TP3 EP3"].avail_mem_after_weights_gb == 51.0


def test_speculative_decoding_keeps_target_and_draft_facts() -> None:
    """The draft model's second Load weight end / KV Cache / Memory pool end go to draft_* fields."""
    log = "\n".join([
        ts("TP0") + "Load weight end. elapsed=10.00 s, type=LlamaForCausalLM, avail mem=60.00 GB, mem usage=15.00 GB.",
        ts("TP0") + "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, K size: 20.00 GB, V size: 20.00 GB",
        ts("TP0") + "Memory pool end. avail mem=18.00 GB",
        ts("TP0") + "Load weight begin. avail mem=18.00 GB",
        ts("TP0") + "Load weight end. elapsed=1.00 s, type=LlamaForCausalLMEagle3, avail mem=17.00 GB, mem usage=1.00 GB.",
        ts("TP0") + "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, KV size: 1.50 GB",
        ts("TP0") + "Memory pool end. avail mem=15.50 GB",
    ])
    rank = parse_startup_facts(log).ranks["TP0"]
    assert (rank.avail_mem_after_weights_gb, rank.weights_gb) == (60.0, 15.0)
    assert (rank.kv_cache_tokens, rank.kv_cache_gb, rank.avail_mem_after_pool_gb) == (500000, 40.0, 18.0)
    assert (rank.draft_avail_mem_after_weights_gb, rank.draft_weights_gb) == (17.0, 1.0)
    assert (rank.draft_kv_cache_tokens, rank.draft_kv_cache_gb, rank.draft_avail_mem_after_pool_gb) == (500000, 1.5, 15.5)


def test_a_repeated_line_is_not_a_draft_models() -> None:
    """Without a second Load weight end after the pool, a repeated pool line is just a repeat."""
    rank = parse_startup_facts(ts("TP0") + "Memory pool end. avail mem=7.00 GB\n" * 2).ranks["TP0"]
    assert rank.avail_mem_after_pool_gb == 7.0
    assert rank.draft_avail_mem_after_pool_gb is None


def test_mem_fraction_static_is_read_from_the_server_args_line() -> None:
    """SGLang's chosen fraction comes from its server_args=ServerArgs(...) line."""
    parser = StartupFactsParser()
    assert parser.facts.mem_fraction_static is None
    assert parser.feed("[2026-01-01 10:00:00] server_args=ServerArgs(model_path='m', tp_size=8, mem_fraction_static=0.82, chunked_prefill_size=8192)")
    assert parser.facts.mem_fraction_static == 0.82
    parser.feed("[2026-01-01 10:00:01] a later line mentions mem_fraction_static=0.5 but is no server_args line")
    assert parser.facts.mem_fraction_static == 0.82
    parser.feed("[2026-01-01 10:00:02] server_args={'model_path': 'm', 'mem_fraction_static': 0.719, 'tp_size': 1}")
    assert parser.facts.mem_fraction_static == 0.719  # 0.5.23 prints a dict


def test_real_sglang_log_gives_its_fraction_and_progress() -> None:
    """A real SGLang 0.5.23 log (when the real tier committed one) yields the fraction SGLang chose."""
    real = sorted((Path(__file__).parent / "data" / "crashlogs" / "real").glob("*.log"))
    with_args = [p for p in real if "server_args=" in p.read_text(errors="replace")]
    for path in with_args:
        facts = parse_startup_facts(path.read_text(errors="replace"))
        assert facts.mem_fraction_static is not None and 0 < facts.mem_fraction_static < 1, path.name
    assert with_args, "the real-SGLang logs in tests/data/crashlogs/real print a server_args line"
