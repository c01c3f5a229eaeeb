"""Turns the JSON of gpu_bench.py and router_bench.py into a dated docs/BENCHMARKS.md section.

    python bench/report.py --gpu gpu_bench.json --router router_bench.json \\
        --command "bash bench/h200.sh" [--append docs/BENCHMARKS.md]

Prints the section; `--append` also adds it to the file. The figures are the JSON's; what a
reader must still be told (what limits a missed target) is for the person who ran it to add.

Every benchmark's JSON names the tree that ran with `current_commit`; `python bench/report.py
--commit` prints it, for PAGEDSERVE_COMMIT on a copy of the tree that runs elsewhere.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

TARGETS = {"w1": 10_000, "w2": 230, "w1_router_fraction": 0.90, "w3_tpot_p50_s": 0.012,
           "w3_ttft_p50_s": 0.080}


def current_commit() -> str:
    """The tree that runs, for a benchmark's JSON: what the caller put in PAGEDSERVE_COMMIT,
    else the commit of the checkout this file is in, with "-dirty" when the tree differs from
    it (edited or untracked files), else "unknown". The variable wins: the device machine runs
    a copy of the working tree with no .git of its own, or a stale one (which reported the
    session's first commit for every later run); a .git in a folder above the tree is another
    checkout's, and naming its commit would name a tree that did not run."""
    if commit := os.environ.get("PAGEDSERVE_COMMIT"):
        return commit
    tree = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=tree)
        return run.stdout.strip() if run.returncode == 0 else None
    top = git("rev-parse", "--show-toplevel")
    head = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain")
    if top is None or Path(top).resolve() != tree or head is None or status is None:
        return "unknown"
    return head + ("-dirty" if status else "")


def verdict(met: bool, missed_by: float) -> str:
    return "**met**" if met else f"missed by {missed_by:.0%}"


def gpu_rows(g: dict) -> list[str]:
    engine, peer = g["engine"], g.get("transformers", {})
    w1, w2, w4 = engine["w1"], engine["w2"], engine["w4"]
    rows = ["| workload | pagedserve | transformers (same run) | ratio | target |", "| --- | --- | --- | --- | --- |"]
    tput = w1["output_tokens_per_s"]
    peer_w1 = peer.get("w1_subset", {}).get("output_tokens_per_s")
    peer_text, ratio = (f"{peer_w1:,.0f} out tok/s", f"{tput / peer_w1:.1f}×") if peer_w1 else ("–", "–")
    rows.append(f"| W1 offline | {tput:,.0f} out tok/s ({w1['seconds']:.1f} s, {w1['steps']} steps) "
                f"| {peer_text} | {ratio} | ≥ 10,000: {verdict(tput >= TARGETS['w1'], 1 - tput / TARGETS['w1'])} |")
    rate = w2["decode_tokens_per_s"]
    peer_w2 = peer.get("w2", {}).get("output_tokens_per_s")
    peer_text, ratio = (f"{peer_w2:.1f} tok/s", f"{rate / peer_w2:.1f}×") if peer_w2 else ("–", "–")
    rows.append(f"| W2 batch-1 decode | {rate:.0f} tok/s = {g['w2_fraction_of_roofline']:.0%} of the "
                f"{g['w2_roofline_tokens_per_s']:.0f} tok/s roofline | {peer_text} | {ratio} "
                f"| ≥ 230: {verdict(rate >= TARGETS['w2'], 1 - rate / TARGETS['w2'])} |")
    rows.append(
        f"| W4 KV memory | {w4['paged_bytes'] / 1e9:.1f} GB paged ({w4['tokens']:,} tokens) | "
        f"{w4['padded_to_longest_bytes'] / 1e9:.1f} GB padded to the longest; "
        f"{w4['padded_to_max_model_len_bytes'] / 1e9:.1f} GB to max_model_len | "
        f"{w4['ratio']:.2f}× / {w4['ratio_vs_max_model_len']:.2f}× less | ≥ 4.8× |")
    for name in ("w1_sync", "w2_sync"):
        if name in engine:
            value = engine[name].get("decode_tokens_per_s", engine[name]["output_tokens_per_s"])
            rows.append(f"| {name[:2].upper()} with async scheduling off | {value:,.0f} tok/s | – | – | – |")
    return rows


def compiled(phase: dict) -> str:
    """A note of kernels compiled during a measured phase: each one stalled the step loop."""
    names = phase.get("kernels_compiled", [])
    n = len(names)
    return f"; {n} kernel compile{'s' if n > 1 else ''} during it ({', '.join(names)})" if n else ""


def router_rows(r: dict, engine_w1: float | None) -> list[str]:
    rows = ["| workload | result | target |", "| --- | --- | --- |"]
    if "w1" in r:
        w1 = r["w1"]["output_tokens_per_s"]
        share = f" = {w1 / engine_w1:.0%} of the engine-level figure" if engine_w1 else ""
        met = engine_w1 and w1 / engine_w1 >= TARGETS["w1_router_fraction"]
        rows.append(f"| W1 through the router | {w1:,.0f} out tok/s{share}{compiled(r['w1'])} | ≥ 90 %: "
                    f"{'**met**' if met else 'missed' if engine_w1 else '–'} |")
    for w3 in r.get("w3", []):
        ttft, tpot = w3["ttft_s"], w3["tpot_s"]
        target = "–"
        if w3["rate"] == 32:
            met = tpot["p50"] <= TARGETS["w3_tpot_p50_s"] and ttft["p50"] <= TARGETS["w3_ttft_p50_s"]
            target = f"TPOT p50 ≤ 12 ms, TTFT p50 ≤ 80 ms: {'**met**' if met else 'missed'}"
        rows.append(f"| W3 at {w3['rate']:g} req/s ({w3['requests']} requests, mean in/out "
                    f"{w3['mean_input_tokens']:.0f}/{w3['mean_output_tokens']:.0f}) | TTFT p50 "
                    f"{ttft['p50'] * 1e3:.0f} ms, p99 {ttft['p99'] * 1e3:.0f} ms; TPOT p50 "
                    f"{tpot['p50'] * 1e3:.1f} ms, p99 {tpot['p99'] * 1e3:.1f} ms; "
                    f"{w3['output_tokens_per_s']:,.0f} out tok/s{compiled(w3)} | {target} |")
    return rows


def section(gpu: dict | None, router: dict | None, command: str) -> str:
    first = gpu or router
    lines = [f"## {first['date']} — generated by bench/report.py, {gpu['gpu'] if gpu else 'GPU'}", "",
             f"Commit `{first['commit'] or 'unknown'}`. Command: `{command}`."]
    if gpu:
        lines[-1] += (f" torch {gpu['torch']}; copy ceiling {gpu['copy_bytes_per_s'] / 1e12:.2f} TB/s; "
                      f"{gpu['engine']['weight_bytes'] / 1e9:.2f} GB of weights.")
        lines += ["", *gpu_rows(gpu)]
    if router:
        engine_w1 = gpu["engine"]["w1"]["output_tokens_per_s"] if gpu else None
        lines += ["", "Through the router's gRPC API:", "", *router_rows(router, engine_w1)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", help="gpu_bench.py's JSON")
    parser.add_argument("--router", help="router_bench.py's JSON")
    parser.add_argument("--command", default="bash bench/h200.sh", help="what produced them")
    parser.add_argument("--append", help="a Markdown file to add the section to")
    parser.add_argument("--commit", action="store_true",
                        help="only print what names this tree (current_commit), for PAGEDSERVE_COMMIT on a copy")
    args = parser.parse_args()
    if args.commit:
        print(current_commit())
        return
    load = lambda path: json.loads(Path(path).read_text()) if path and Path(path).exists() else None  # noqa: E731
    gpu, router = load(args.gpu), load(args.router)
    if gpu is None and router is None:
        parser.error("give --gpu and/or --router files that exist")
    text = section(gpu, router, args.command)
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
