"""Start-up time and resident memory of --prompt-data at 1M and 10M rows, and the cost of datasets and math-verify.

Writes a Parquet file per size in verl's layout (chat messages under ``prompt``, the answer under
``reward_model.ground_truth``), then opens it with ``tidal.train.data.PromptDataset`` in a fresh process, twice:
cold (``datasets`` converts the file into its Arrow cache) and warm (the cached Arrow file is mapped). Each child
reports its seconds and its resident memory (VmRSS after opening and reading a batch, VmHWM the peak).

    uv run python bench/prompt_data.py --rows 1000000 10000000 --workdir /tmp/prompt_bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHUNK = 1_000_000


def write_parquet(path: Path, rows: int) -> None:
    """``rows`` addition problems as verl stores them, written a million rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    for start in range(0, rows, CHUNK):
        ids = range(start, min(rows, start + CHUNK))
        content = pa.array([f"{i % 997}+{i % 89}=" for i in ids])
        role = pa.array(["user"] * len(ids))
        message = pa.StructArray.from_arrays([role, content], names=["role", "content"])
        prompt = pa.ListArray.from_arrays(pa.array(range(len(ids) + 1), pa.int32()), message)
        truth = pa.StructArray.from_arrays([pa.array([str(i % 997 + i % 89) for i in ids])], names=["ground_truth"])
        extra = pa.StructArray.from_arrays([pa.array(ids, pa.int64())], names=["index"])
        table = pa.Table.from_arrays([prompt, truth, extra], names=["prompt", "reward_model", "extra_info"])
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def child(path: str) -> None:
    """Open ``path`` as `train` does and print one JSON line of timings and memory."""
    t0 = time.perf_counter()
    import datasets  # noqa: F401

    imported = time.perf_counter() - t0
    from tidal.train.data import PromptDataset
    from tidal.train.embedded_model import build_tokenizer

    tok = build_tokenizer(["0123456789+="])
    base_rss, base_anon = _status_kb("VmRSS"), _status_kb("RssAnon")
    t1 = time.perf_counter()
    data = PromptDataset(
        path,
        tok,
        input_key="prompt.0.content",
        label_key="reward_model.ground_truth",
        metadata_key="extra_info",
        seed=1,
    )
    opened = time.perf_counter() - t1
    t2 = time.perf_counter()
    batch = data.batch(12345, 64)
    first_batch = time.perf_counter() - t2
    t3 = time.perf_counter()
    for k in range(20):
        data.batch(k, 64)
    per_batch = (time.perf_counter() - t3) / 20
    assert len(batch) == 64 and batch[0].label
    out = {"rows": len(data), "import_datasets_s": imported, "open_s": opened, "first_batch_s": first_batch,
           "batch_64_s": per_batch, "rss_mb": _status_kb("VmRSS") / 1024, "rss_before_open_mb": base_rss / 1024,
           "anon_mb": _status_kb("RssAnon") / 1024, "anon_before_open_mb": base_anon / 1024,
           "peak_rss_mb": _status_kb("VmHWM") / 1024}  # fmt: skip
    print(json.dumps(out))


def math_costs() -> dict[str, float]:
    """math-verify: import seconds (in a fresh process), worker start, and the median seconds of one grading."""
    from tidal.rollout import MathVerifier, Sample

    code = "import time; t = time.perf_counter(); import math_verify; print(time.perf_counter() - t)"
    imported = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    grader = MathVerifier(timeout_s=10)

    def sample(text: str, label: str) -> Sample:
        return Sample(prompt_ids=[1], response_ids=[2], response_log_probs=[0.0], finish_reason="stop", label=label,
                      response_text=text)  # fmt: skip

    t = time.perf_counter()
    grader(sample("\\boxed{1}", "1"))
    started = time.perf_counter() - t
    pairs = [("so \\boxed{\\frac{1}{2}}", "0.5"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("The total is 1,234", "1234"),
             ("\\boxed{(1, 3]}", "(1,3]"), ("12+34=046", "046"), ("\\boxed{x^2+2x+1}", "(x+1)^2")]  # fmt: skip
    times = []
    for _ in range(5):
        for text, label in pairs:
            t = time.perf_counter()
            grader(sample(text, label))
            times.append(time.perf_counter() - t)
    grader.close()
    median = statistics.median(times)
    return {"import_math_verify_s": imported, "worker_start_s": started, "grade_median_ms": median * 1e3,
            "grade_max_ms": max(times) * 1e3}  # fmt: skip


def main() -> None:
    """Write the files, open each cold and warm in a fresh process, and print a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="prompt_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    print("| rows | Parquet MB | import datasets s | open cold s | open warm s | batch of 64 ms "
          "| RSS after open MB (before) | of it anonymous MB (before) | peak RSS MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        path = work / f"verl_{rows}.parquet"
        if not path.exists():
            write_parquet(path, rows)
        cache = work / f"cache_{rows}"
        shutil.rmtree(cache, ignore_errors=True)  # the first open is cold: datasets builds its Arrow cache
        env = {**os.environ, "HF_DATASETS_CACHE": str(cache)}
        runs = []
        for _ in ("cold", "warm"):
            proc = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                                  env=env, check=True)  # fmt: skip
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        cold, warm = runs
        print(f"| {rows:,} | {path.stat().st_size / 2**20:.0f} | {warm['import_datasets_s']:.1f} | "
              f"{cold['open_s']:.1f} | {warm['open_s']:.1f} | "
              f"{warm['batch_64_s'] * 1e3:.1f} | {warm['rss_mb']:.0f} ({warm['rss_before_open_mb']:.0f}) | "
              f"{warm['anon_mb']:.0f} ({warm['anon_before_open_mb']:.0f}) | "
              f"{max(cold['peak_rss_mb'], warm['peak_rss_mb']):.0f} |")  # fmt: skip
        print(json.dumps({"rows": rows, "cold": cold, "warm": warm}), file=sys.stderr)
    print(json.dumps(math_costs()))


if __name__ == "__main__":
    main()
