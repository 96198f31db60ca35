"""`make bench`: run the benchmarks, print a table with both sides and the ratios, write bench/results/*.json
and the table into docs/performance.md.

    python -m bench.run                 # every benchmark
    python -m bench.run single_stream   # some of them
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from bench import llama_engine, load, spec_busy, spec_ceiling, transformers_engine, ui_bench, vllm_engine
from bench.common import RESULTS, ROOT, machine, write_result

BENCHMARKS: dict[str, Callable[[], dict[str, Any]]] = {
    "single_stream": llama_engine.single_stream,
    "concurrency": llama_engine.concurrency,
    "prompt_cache": llama_engine.prompt_cache,
    "speculative": llama_engine.speculative,
    "spec_after_busy": spec_busy.run,
    "spec_ceiling": spec_ceiling.run,
    "transformers": transformers_engine.pipeline_vs_generate,
    "transformers_concurrency": transformers_engine.concurrency,
    "ui_latency": ui_bench.run,
    "ui_page_speed": ui_bench.page_speeds,
    "load": load.run,
    "vllm": vllm_engine.run,
}
DOC = ROOT / "docs" / "performance.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def rows(name: str, r: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, textgen, reference, ratio, target) rows for the table."""
    if name == "single_stream":
        return [
            (
                "1 stream, 128 tokens: tokens/s",
                f"{r['textgen_tokens_per_s']:.1f}",
                f"{r['raw_tokens_per_s']:.1f} (Llama.create_completion)",
                f"{r['ratio']:.3f}",
                r["target"],
            ),
            *(
                [
                    (
                        "1 stream after an embeddings and a logits request",
                        f"{r['after_embeddings_and_logits_tokens_per_s']:.1f}",
                        f"{r['raw_tokens_per_s']:.1f} (Llama.create_completion)",
                        f"{r['after_embeddings_and_logits_ratio']:.3f}",
                        "as the row above",
                    )
                ]
                if "after_embeddings_and_logits_ratio" in r
                else []
            ),
            *(
                [
                    (
                        "1 stream, scheduler in-process (no HTTP): tokens/s",
                        f"{r['engine_in_process_tokens_per_s']:.1f}",
                        f"{r['raw_tokens_per_s']:.1f} (Llama.create_completion)",
                        f"{r['engine_in_process_ratio']:.3f}",
                        "none (the account)",
                    )
                ]
                if "engine_in_process" in r
                else []
            ),
        ]
    if name == "concurrency":
        ours, peer = r["textgen"], r["llama_cpp_server"]
        return [
            (
                f"{r['clients']} streams: aggregate tokens/s",
                f"{ours['tokens_per_s']:.1f}",
                f"{peer['tokens_per_s']:.1f} (llama_cpp.server)",
                f"{r['ratio']:.2f}",
                ">= 1.5",
            ),
            *(
                [
                    (
                        f"{r['clients']} streams: decode-phase tokens/s vs raw batched decode",
                        f"{ours['decode_phase_tokens_per_s']:.1f}",
                        f"{r['raw_batched_decode_tokens_per_s']:.1f} (llama_decode loop, no HTTP)",
                        f"{r['ratio_vs_raw_batched']:.2f}",
                        ">= 0.95",
                    )
                ]
                if "raw_batched_decode_tokens_per_s" in r
                else []
            ),
            *(
                [
                    (
                        f"{r['clients']} streams: decode phase, scheduler in-process (no HTTP)",
                        f"{r['engine_in_process_tokens_per_s']:.1f}",
                        f"{r['raw_batched_decode_tokens_per_s']:.1f} (llama_decode loop, no HTTP)",
                        f"{r['engine_in_process_ratio_vs_raw_batched']:.2f}",
                        "none (the account)",
                    )
                ]
                if "engine_in_process" in r
                else []
            ),
            (
                f"{r['clients']} streams: p95 time to first token",
                f"{ours['p95_ttft_s']:.2f} s",
                f"{peer['p95_ttft_s']:.2f} s (llama_cpp.server)",
                f"{ours['p95_ttft_s'] / peer['p95_ttft_s']:.2f}",
                "< 1",
            ),
        ]
    if name == "speculative":
        grounded, story = r["input_grounded"], r["open_ended"]
        same = (
            "same text"
            if grounded["same_text_as_raw"]
            else f"text differs at char {grounded['first_difference_vs_raw']}"
        )
        return [
            (
                "rewrite a given text, 256 tokens: tokens/s",
                f"{grounded['textgen_tokens_per_s']:.1f} (speculative)",
                f"{grounded['raw_tokens_per_s']:.1f} (Llama.create_completion; {same})",
                f"{grounded['ratio_vs_raw']:.2f}",
                ">= 1.5",
            ),
            (
                "rewrite a given text, 256 tokens: tokens/s",
                f"{grounded['textgen_tokens_per_s']:.1f} (speculative)",
                f"{grounded['prompt_lookup_tokens_per_s']:.1f} (LlamaPromptLookupDecoding)",
                f"{grounded['ratio_vs_prompt_lookup']:.2f}",
                ">= 1.2",
            ),
            *(
                [
                    (
                        "rewrite a given code file, 256 tokens: tokens/s",
                        f"{r['input_grounded_code']['textgen_tokens_per_s']:.1f} (speculative)",
                        f"{r['input_grounded_code']['raw_tokens_per_s']:.1f} (Llama.create_completion)",
                        f"{r['input_grounded_code']['ratio_vs_raw']:.2f}",
                        "none (the model does not copy the code)",
                    )
                ]
                if "input_grounded_code" in r
                else []
            ),
            (
                "story, 256 tokens: tokens/s",
                f"{story['speculation_on_tokens_per_s']:.1f} (speculative)",
                f"{story['speculation_off_tokens_per_s']:.1f} (--no-speculative)",
                f"{story['ratio']:.3f}",
                ">= 0.97",
            ),
        ]
    if name == "spec_after_busy":
        return [
            (
                "rewrite after a busy spell (its first 2 beside a busy process): tokens/s",
                f"{r['after_busy_tokens_per_s']:.1f} (drafted {sum(r['draft_tokens']['after']):.0f})",
                f"{r['no_busy_spell_tokens_per_s']:.1f} (no busy spell; drafted {sum(r['draft_tokens']['quiet']):.0f})",
                f"{r['ratio']:.3f}",
                r["target"],
            )
        ]
    if name == "prompt_cache":
        return [
            (
                "3rd chat turn: time to first token",
                f"{r['third_turn_ttft_with_cache_s'] * 1000:.0f} ms (cache)",
                f"{r['third_turn_ttft_without_cache_s'] * 1000:.0f} ms (no cache)",
                f"{r['ratio']:.2f}",
                r["target"],
            )
        ]
    if name == "ui_latency":
        short, long = r["short"], r["long"]
        return [
            (
                "UI: streamed token to paint, median",
                f"{long['median_ms']:.0f} ms (500 messages)",
                f"{short['median_ms']:.0f} ms (10 messages)",
                f"{r['ratio_median']:.2f}",
                "<= 2",
            ),
            *(
                [
                    (
                        "UI: same, all 500 messages shown",
                        f"{r['long_show_all']['median_ms']:.0f} ms (500 shown)",
                        f"{short['median_ms']:.0f} ms (10 messages)",
                        f"{r['ratio_show_all']:.2f}",
                        "none (for the record)",
                    )
                ]
                if "long_show_all" in r
                else []
            ),
        ]
    if name == "ui_page_speed":
        return [
            (
                f"UI: a {run['tokens']}-token reply with the page open, {run['rate']:g} updates/s: tokens/s",
                f"{run['ui_tokens_per_s']:.1f}",
                f"{run['api_tokens_per_s']:.1f} (the same server's API, no page)",
                f"{run['ratio']:.2f}",
                r["target"],
            )
            for run in r["runs"]
        ]
    if name == "spec_ceiling":
        steps = r["step_ms"]
        return [
            (
                f"rewrite replayed through step costs ({r['cpu']}): {label}",
                f"{r[key]['speedup']:.2f}x plain ({r[key]['steps']} steps, {r[key]['draft_tokens']} drafted)",
                f"t(1) {steps['1']} ms, +{r['per_extra_token_ms']} ms a token, switch {r['switch_ms']} ms",
                f"{r[key]['speedup']:.2f}",
                {
                    "oracle": "knows where the model departs from the text",
                    "known_odds": "for the record (this reply's odds by streak, known in advance)",
                }.get(key, "for the record"),
            )
            for key, label in (
                ("planner", "our planner"),
                ("always_3", "always 3"),
                ("known_odds", "known odds by streak"),
                ("oracle", "oracle"),
            )
        ] + [
            (
                f"rewrite measured in-process ({r['cpu']}): {label}",
                f"{m[key]['tokens_per_s']:.1f}",
                f"{m['raw_tokens_per_s']:.1f} (Llama.create_completion)",
                f"{m[key]['ratio_vs_raw']:.3f}",
                note,
            )
            for m in [r["measured"]]
            for key, label, note in (
                ("off", "speculation off", "for the record"),
                ("planner", "our planner", "for the record"),
                ("oracle_16", "oracle, 16 at most", "knows where the model departs from the text"),
                ("oracle_64", "oracle, 64 at most", "knows where the model departs from the text"),
                ("perfect_64", "perfect drafter, 64 at most", "drafts the reply itself: no drafter does better"),
            )
        ]
    if name == "transformers":
        return [
            (
                "transformers, 128 tokens: tokens/s",
                f"{r['textgen_tokens_per_s']:.1f}",
                f"{r['raw_generate_tokens_per_s']:.1f} (model.generate)",
                f"{r['ratio']:.3f}",
                r["target"],
            )
        ]
    if name == "transformers_concurrency":
        return [
            (
                f"transformers, {r['clients']} streams: aggregate tokens/s",
                f"{r['aggregate_tokens_per_s']:.1f} (p95 TTFT {r['p95_ttft_s']:.2f} s)",
                f"{r['one_stream_tokens_per_s']:.1f} (1 stream)",
                f"{r['ratio']:.2f}",
                r["target"],
            )
        ]
    if name == "load":
        head = f"load {r['requests']}x{r['concurrency']}"
        growth = r["rss_growth_mb"]
        return [
            (
                f"{head}: 5xx / slots free at end",
                f"{r['server_errors']} / {r['slots_free_at_end']}",
                "",
                "",
                "0 / True",
            ),
            (
                f"{head}: p95 latency",
                f"{r['latency_p95_s']:.2f} s",
                f"{r['idle_latency_p95_s']:.2f} s (one at a time)",
                f"{r['latency_p95_s'] / r['idle_latency_p95_s']:.1f}" if r["idle_latency_p95_s"] else "",
                "none (for the record)",
            ),
            (
                f"{head}: server RSS",
                f"{r['rss_mb']['after_disconnect_tests']:.0f} MB (end)",
                f"{r['rss_mb']['after_warmup']:.0f} MB (after warm-up)",
                f"{growth:+.1f} MB",
                "< +50 MB",
            ),
        ]
    if name == "vllm":
        n = r["clients"]
        return [
            (
                f"{n} streams through textgen -> vLLM: aggregate tokens/s",
                f"{r['textgen_vllm_tokens_per_s']:.1f}",
                f"{r['vllm_direct_tokens_per_s']:.1f} (the same vLLM, direct)",
                f"{r['ratio']:.3f}",
                ">= 0.95",
            ),
            (
                f"{n} streams through textgen -> vLLM: p95 time to first token",
                f"{r['textgen_vllm_p95_ttft_s']:.2f} s",
                f"{r['vllm_direct_p95_ttft_s']:.2f} s (direct)",
                f"{r['ttft_gap_s']:+.2f} s",
                "within 0.1 s",
            ),
            (
                f"{n} streams, textgen's llama.cpp engine (Q4_1), same run",
                f"{r['llama_cpp_tokens_per_s']:.1f}",
                f"{r['textgen_vllm_tokens_per_s']:.1f} (textgen -> vLLM)",
                f"{r['llama_cpp_tokens_per_s'] / r['textgen_vllm_tokens_per_s']:.2f}",
                "for the record",
            ),
        ]
    return [(name, "", "", str(r.get("ratio", "")), str(r.get("target", "")))]


def table(all_rows: list[tuple[str, str, str, str, str]]) -> str:
    lines = ["| benchmark | textgen | reference | ratio | target |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in all_rows]
    return "\n".join(lines)


def update_doc(text: str) -> None:
    if not DOC.exists():
        return
    content = DOC.read_text()
    if BEGIN in content and END in content:
        head, _, rest = content.partition(BEGIN)
        _, _, tail = rest.partition(END)
        DOC.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    for name in names:
        print(f"running {name} ...", flush=True)
        path = write_result(name, BENCHMARKS[name]())
        print(f"  wrote {path.relative_to(ROOT)}")
    # the table holds the latest result of every benchmark: this run's, and earlier ones not rerun
    all_rows = []
    stamps = []
    for name in BENCHMARKS:
        result_path = RESULTS / f"{name}.json"
        if result_path.is_file():
            result = json.loads(result_path.read_text())
            all_rows += rows(name, result)
            stamps.append(f"{name} {result.get('time', '')}")
    m = machine()
    text = table(all_rows)
    header = (
        f"Machine: {m['cpu']}, {m['cores']} cores / {m['threads']} threads, {m['memory_gb']} GiB, Python {m['python']}."
    )
    print()
    print(header)
    print(text)
    for name, key, what in (  # where the time goes: wall time per token or step, CPU per token by part
        ("single_stream", "ms_per_token", "ms per token"),
        ("single_stream", "cpu_ms_per_token", "CPU ms per token, API runs"),
        ("concurrency", "step_ms", "ms per 8-token step"),
        ("concurrency", "cpu_ms_per_token", "CPU ms per token, 8 streams"),
    ):
        if name in names:
            account = json.loads((RESULTS / f"{name}.json").read_text()).get(key, {})
            print(f"{what}: " + ", ".join(f"{k} {v:.2f}" for k, v in account.items()))
    missing = [name for name in BENCHMARKS if not (RESULTS / f"{name}.json").is_file()]
    if missing:  # the doc's table would lose those rows: it is rewritten only from a full set of results
        print(f"\n{DOC.relative_to(ROOT)} not updated: no result yet for {', '.join(missing)}")
        return 0
    update_doc(f"{header}\n\n{text}\n\nRun at: {'; '.join(stamps)}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
